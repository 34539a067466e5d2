"""strategy='ddp_ft' across real replica groups (one process each) and a lighthouse in this process."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta

import pytest
from phalanx_distributed import SCRIPTS, clean_environment, free_port

pytest.importorskip("torchft")

GROUPS = 2


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """One fault-tolerant run of GROUPS groups (the Trainer's defaults otherwise) and its one-process reference."""
    from phalanx.strategies.fault_tolerant import start_lighthouse

    out = tmp_path_factory.mktemp("ddp_ft")
    with start_lighthouse(min_replicas=GROUPS, join_timeout=timedelta(milliseconds=200)) as lighthouse:
        processes = []
        for group in range(GROUPS):
            environment = clean_environment(
                REPLICA_GROUP_ID=str(group),
                NUM_REPLICA_GROUPS=str(GROUPS),
                TORCHFT_LIGHTHOUSE=lighthouse.address,
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(free_port()),
            )
            log = (out / f"group{group}.log").open("w")
            command = [sys.executable, str(SCRIPTS / "ft_group_job.py"), str(out)]
            processes.append(subprocess.Popen(command, env=environment, stdout=log, stderr=subprocess.STDOUT))
        try:
            codes = [process.wait(timeout=240) for process in processes]
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait(timeout=30)
    logs = {group: (out / f"group{group}.log").read_text()[-6000:] for group in range(GROUPS)}
    assert codes == [0] * GROUPS, f"exit codes {codes}; logs: {logs}"
    sys.path.insert(0, str(SCRIPTS))
    try:
        import ft_group_job
    finally:
        sys.path.remove(str(SCRIPTS))
    reference = ft_group_job.reference_fit(GROUPS, out / "reference")
    results = [json.loads((out / f"group{group}.json").read_text()) for group in range(GROUPS)]
    return {"results": results, "reference": reference, "steps": ft_group_job.STEPS, "batch": ft_group_job.BATCH}


def test_every_group_ends_with_the_weights_of_one_process_on_the_combined_batches(run):
    for group, result in enumerate(run["results"]):
        for got, want in zip(result["weights"], run["reference"]):
            assert max(abs(a - b) for a, b in zip(got, want)) < 1e-6, f"group {group} differs from the reference"


def test_global_step_counts_the_committed_steps(run):
    assert [result["global_step"] for result in run["results"]] == [run["steps"]] * GROUPS


def test_the_groups_read_disjoint_shares_that_cover_the_combined_batches(run):
    seen = [set(result["seen_train"]) for result in run["results"]]
    assert all(len(result["seen_train"]) == run["steps"] * run["batch"] for result in run["results"])
    assert not set.intersection(*seen)
    assert set.union(*seen) == set(range(run["steps"] * run["batch"] * GROUPS))


def test_only_group_zero_writes_checkpoints(run):
    assert [result["is_global_zero"] for result in run["results"]] == [True] + [False] * (GROUPS - 1)
    assert run["results"][0]["checkpoints"] and not any(result["checkpoints"] for result in run["results"][1:])
