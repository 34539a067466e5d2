"""Every collective Cohort method under disagreement, on 2 ranks. Usage: python cohort_agreement_job.py OUT MODE

MODE 'disagree': the ranks call each collective with different arguments (or different methods), one case after the
other, then agree; each rank writes OUT/disagree{R}.json: per case, the error it got (None: no error).
MODE 'exited': rank 1 exits after setup; rank 0 calls every collective in turn and writes OUT/exited0.json.
MODE 'stalled': rank 1 sleeps after setup (alive, in no collective); rank 0 calls barrier and save and writes
OUT/stalled0.json. The strategy's timeout= is TIMEOUT seconds (default 20) in every mode.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

import phalanx
from phalanx.strategies import DDPStrategy


def attempt(results: dict[str, Any], case: str, call: Callable[[], Any]) -> Any:
    """Run one case; record its error (or None) and how long it took."""
    start = time.monotonic()
    try:
        value = call()
        results[case] = {"error": None, "seconds": time.monotonic() - start}
        return value
    except Exception as error:  # recorded for the test
        results[case] = {"error": f"{type(error).__name__}: {error}", "seconds": time.monotonic() - start}
        return None


def disagree(cohort: phalanx.Cohort, out: Path) -> dict[str, Any]:
    rank, results = cohort.global_rank, {}
    attempt(results, "setup", lambda: cohort.setup(nn.Linear(2, 2 + rank)))  # a module of another shape
    model = cohort.setup(nn.Linear(2, 2))
    attempt(results, "broadcast", lambda: cohort.broadcast("x", src=rank))
    attempt(results, "save", lambda: cohort.save(out / f"rank{rank}.ckpt", {"model": model}))
    attempt(
        results, "method", lambda: cohort.save(out / "one.ckpt", {"model": model}) if rank == 0 else cohort.barrier()
    )
    # Node-local disks: the same relative path names a file of each rank's own; rank 1's holds another step.
    cohort.save(out / "base.ckpt", {"model": model})
    node = out / f"node{rank}"
    node.mkdir()
    shutil.copyfile(out / "base.ckpt", node / "last.ckpt")
    torch.save(model.module.state_dict(), node / "weights.pt")
    if rank == 1:
        checkpoint = torch.load(node / "last.ckpt", weights_only=False)  # (written by this job)
        torch.save({**checkpoint, "global_step": 7}, node / "last.ckpt")
        with torch.no_grad():
            torch.save({name: value + 1 for name, value in model.module.state_dict().items()}, node / "weights.pt")
    else:
        shutil.copyfile(out / "base.ckpt", node / "only0.ckpt")
    os.chdir(node)
    attempt(results, "load", lambda: cohort.load("last.ckpt", {"model": model}))
    attempt(results, "load-missing", lambda: cohort.load("only0.ckpt", {"model": model}))
    attempt(results, "load_raw", lambda: cohort.load_raw("weights.pt", model))
    # And after all of that, the ranks agree again: the same calls succeed, and the store's keys stay bounded.
    results["agreed-broadcast"] = cohort.broadcast(f"from {rank}", src=1)
    attempt(results, "agreed-load", lambda: cohort.load(out / "base.ckpt", {"model": model}))
    store = torch.distributed.distributed_c10d._get_default_store()
    cohort.barrier()
    before = store.num_keys()
    for _ in range(200):
        cohort.barrier()
    results["keys-before"], results["keys-after"] = before, store.num_keys()
    cohort.barrier()  # no rank ends (and says so in the store) before both counted
    return results


def exited(cohort: phalanx.Cohort, out: Path) -> dict[str, Any]:
    model = cohort.setup(nn.Linear(2, 2))
    cohort.save(out / "base.ckpt", {"model": model})
    torch.save(model.module.state_dict(), out / "weights.pt")
    if cohort.global_rank == 1:
        sys.exit(0)  # a rank that returns early: its process ends normally
    results: dict[str, Any] = {}
    for case, call in [
        ("barrier", lambda: cohort.barrier()),
        ("broadcast", lambda: cohort.broadcast("x")),
        ("save", lambda: cohort.save(out / "late.ckpt", {"model": model})),
        ("load", lambda: cohort.load(out / "base.ckpt", {"model": model})),
        ("load_raw", lambda: cohort.load_raw(out / "weights.pt", model)),
        ("all_reduce", lambda: cohort.all_reduce(torch.ones(2))),
        ("all_gather", lambda: cohort.all_gather(torch.ones(2))),
    ]:
        attempt(results, case, call)
    return results


def stalled(cohort: phalanx.Cohort, out: Path) -> dict[str, Any]:
    model = cohort.setup(nn.Linear(2, 2))
    if cohort.global_rank == 1:
        time.sleep(300)  # alive, in no collective: the job ends when rank 0 (its launcher) does
    results: dict[str, Any] = {}
    attempt(results, "barrier", lambda: cohort.barrier())
    attempt(results, "save", lambda: cohort.save(out / "late.ckpt", {"model": model}))
    return results


def main() -> None:
    out, mode = Path(sys.argv[1]).resolve(), sys.argv[2]
    timeout = float(os.environ.get("TIMEOUT", "20"))
    strategy = DDPStrategy(timeout=timedelta(seconds=timeout))
    cohort = phalanx.Cohort(strategy=strategy, devices=2, accelerator="cpu")
    cohort.launch()
    results = {"disagree": disagree, "exited": exited, "stalled": stalled}[mode](cohort, out)
    (out / f"{mode}{cohort.global_rank}.json").write_text(json.dumps(results))
    if mode == "stalled":
        os._exit(0)  # rank 1 sleeps in no collective: nothing to wait for at exit (its watchdog ends it)


if __name__ == "__main__":
    main()
