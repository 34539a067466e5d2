"""XLAStrategy on two PJRT CPU devices (one process, one thread per device) against one CPU process.

The replicas read disjoint halves of each global batch of 16; their averaged gradients give the same update as one
process on the whole batch. Every collective of the contract is checked on both replicas.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from xla_helpers import run_scenario


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    workdir = tmp_path_factory.mktemp("xla_replicas")
    result = run_scenario("replicas", workdir, devices=2)
    result["workdir"] = workdir
    return result


@pytest.mark.parametrize(
    ("key", "tolerance"),
    [
        ("param_diff_32", 1e-6),
        ("param_diff_accumulate_clip", 1e-6),
        ("resume_diff", 1e-6),
        ("validate_diff", 1e-6),
        ("predict_diff", 1e-5),
    ],
)
def test_two_devices_match_one_cpu_process(replicas: dict[str, Any], key: str, tolerance: float) -> None:
    assert replicas[key] <= tolerance, (key, replicas[key])


def test_accumulation_and_clipping_changed_the_run(replicas: dict[str, Any]) -> None:
    assert replicas["accumulate_clip_vs_plain"] > 1e-3


def test_your_own_loop_with_cohort_learns_on_two_replicas(replicas: dict[str, Any]) -> None:
    after_one, after_three = replicas["cohort_losses"]
    assert after_three < 0.5 * after_one, replicas["cohort_losses"]


def test_predictions_come_back_whole_and_validation_metrics_synced(replicas: dict[str, Any]) -> None:
    assert replicas["predict_rows"] == [16, 16, 16, 16] and replicas["validate_keys"] == ["val_loss"]


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("world_size", 2),
        ("mean", [1.5]),
        ("sum", [3.0]),
        ("max", [2.0]),
        ("min", [1.0]),
        ("reduce_cpu_tensor_stays_on_cpu", "cpu"),
        ("all_gather", [[0, 10], [1, 11]]),
        ("broadcast_from_1", 1),
        ("broadcast_tensor", [0.0, 0.0]),
        ("all_gather_object", [["rank", 0], ["rank", 1]]),
        ("all_true", True),
        ("all_rank0", False),
        ("any_rank0", True),
    ],
)
def test_collectives_on_every_replica(replicas: dict[str, Any], rank: int, key: str, expected: Any) -> None:
    got = replicas["collectives"][rank]
    assert got["rank"] == rank and got["device"] == f"xla:{rank}"
    assert got[key] == expected, (rank, key, got[key])


def test_each_replica_thread_has_its_own_rank_and_sync_dist_logging_sums(replicas: dict[str, Any]) -> None:
    assert [got["rank_zero_only_rank"] for got in replicas["collectives"]] == [0, 1]
    # self.log(rank + 1, sync_dist=True, reduce_fx="sum") on each replica's 2 validation batches: (1 + 1) + (2 + 2).
    assert replicas["rank_sum"] == 6.0


def test_rank_zero_writes_one_checkpoint_loadable_with_weights_only(replicas: dict[str, Any]) -> None:
    assert replicas["checkpoint_files"] == ["epoch=1-step=8.ckpt", "last.ckpt"]
    assert replicas["global_step"] == 8
    checkpoint = torch.load(replicas["checkpoint"], map_location="cpu", weights_only=True)
    final = torch.load(Path(replicas["workdir"]) / "replicas_final.pt", weights_only=True)
    for name, tensor in checkpoint["state_dict"].items():
        assert torch.equal(tensor, final[name]), name


def test_default_spawn_start_method(tmp_path: Path) -> None:
    # The default start method starts a fresh interpreter for the replicas (the tests above fork, to save time).
    result = run_scenario("replicas", tmp_path, devices=2, XLA_START_METHOD="spawn")
    assert result["param_diff_32"] <= 1e-6 and result["global_step"] == 8


def test_a_failing_replica_ends_the_run_with_its_error(tmp_path: Path) -> None:
    result = run_scenario("failure", tmp_path, devices=2, timeout=300)
    assert result["error"] is not None and "replica one fails on purpose" in result["error"], result
    assert result["seconds"] < 120
