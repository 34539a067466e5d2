"""strategy='ddp_ft' with replica groups of two processes each (two groups and a lighthouse in this process): one
process of group 1 is killed with SIGKILL, the whole group ends, group 0 trains on alone, and the restarted group heals
from group 0's live state; every process ends with the weights of one process trained on the committed batches."""

from __future__ import annotations

import re
import signal

import pytest
from ft_harness import steered_kill_and_rejoin

pytest.importorskip("torchft")


@pytest.fixture(scope="module")
def ddp_ft(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    out = tmp_path_factory.mktemp("ddp_ft_groups")
    run = steered_kill_and_rejoin(out, "ddp_ft")
    run["reference"] = run["job"].reference_fit(out)
    return run


def test_every_process_ends_with_the_weights_of_one_process_on_the_committed_batches(ddp_ft):
    assert len(ddp_ft["results"]) == 4, sorted(ddp_ft["results"])
    for name, result in ddp_ft["results"].items():
        assert result["global_step"] == ddp_ft["max_steps"]
        for got, want in zip(result["weights"], ddp_ft["reference"]):
            assert max(abs(a - b) for a, b in zip(got, want)) < 1e-6, f"{name} differs from the reference"


def test_the_survivor_committed_steps_alone_and_with_the_restarted_group(ddp_ft):
    sizes = [len(indices) for indices in ddp_ft["steps"]]
    both, alone = 2 * 2 * ddp_ft["batch"], 2 * ddp_ft["batch"]
    assert len(sizes) == ddp_ft["max_steps"] and sizes[0] == both and alone in sizes and sizes[-1] == both, sizes
    indices = [index for step in ddp_ft["steps"] for index in step]
    assert len(set(indices)) == len(indices)  # no sample trained twice by committed steps


def test_killing_one_process_ends_its_whole_group(ddp_ft):
    first_life = ddp_ft["logs"][1]
    assert ddp_ft["killed_code"] == 1, first_life[-3000:]
    assert f"a process of this job exited with status {-signal.SIGKILL}; stopping the others" in first_life


def test_the_logs_say_when_a_group_left_and_rejoined(ddp_ft):
    survivor, _, restarted = ddp_ft["logs"]
    assert "Replica group 0 joined quorum" in survivor and "of replica groups [0, 1]." in survivor
    left = survivor.index("Replica group(s) [1] left the quorum")
    assert "replica group 0 trains on with replica groups [0]." in survivor[left:]
    assert "Replica group(s) [1] joined the quorum" in survivor[left:]
    healed = re.search(r"Replica group 1 healed from a peer \(no checkpoint read\).*global_step=(\d+)", restarted)
    assert healed and int(healed.group(1)) >= 2, restarted[-3000:]
