"""One job of bench/bench_cohort_agreement.py. Usage: python agreement_job.py WORLD_SIZE CALLS

WORLD_SIZE CPU processes (gloo) set up a Cohort, then each makes CALLS collective-call agreements
(``agree_on_call(cohort, "barrier")``: the store round alone, no barrier after it) through a store that counts its
operations. Rank 0 prints one line of JSON: microseconds per call (median of 5 blocks), store operations per call on
each rank, and the store's key count before and after.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

import phalanx

try:  # this tree
    from phalanx.cohort import agreement as implementation
except ImportError:  # an older tree (git archive of an earlier commit): the agreement sat in guards.py
    from phalanx.cohort import guards as implementation  # type: ignore[no-redef]


class CountingStore:
    """Forwards to the process group's store and counts each operation by name."""

    def __init__(self, store: Any) -> None:
        self.store, self.counts = store, Counter()

    def __getattr__(self, name: str) -> Any:
        operation = getattr(self.store, name)
        if not callable(operation):
            return operation

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.counts[name] += 1
            return operation(*args, **kwargs)

        return counted


def main() -> None:
    world_size, calls = int(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(1)
    cohort = phalanx.Cohort(strategy="ddp", devices=world_size, accelerator="cpu")
    cohort.launch()
    cohort.setup(torch.nn.Linear(2, 2))
    real = dist.distributed_c10d._get_default_store()
    counting = CountingStore(real)
    if hasattr(implementation, "agreement_of_this_process"):
        implementation.agreement_of_this_process()._store_of = lambda: counting
    else:
        dist.distributed_c10d._get_default_store = lambda: counting
    implementation.agree_on_call(cohort, "barrier")  # the first call pays for connections; not counted
    counting.counts.clear()
    keys_before = real.num_keys()
    blocks = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls // 5):
            implementation.agree_on_call(cohort, "barrier")
        blocks.append((time.perf_counter() - start) / (calls // 5) * 1e6)
    made = 5 * (calls // 5)
    operations = sum(counting.counts.values()) / made
    cohort.barrier()  # every rank has counted its keys' effect before any reads the total
    result = {
        "world_size": world_size,
        "calls": made,
        "us_per_call": statistics.median(blocks),
        "store_ops_per_call": cohort.strategy.all_gather_object(round(operations, 2)),
        "by_operation": {name: round(count / made, 2) for name, count in sorted(counting.counts.items())},
        "keys_before": keys_before,
        "keys_after": real.num_keys(),
    }
    cohort.barrier()
    if cohort.global_rank == 0:
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
