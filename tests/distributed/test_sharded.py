"""FSDP and ModelParallel on 2 CPU processes (gloo): one job (scripts/sharded_suite.py) runs every fit; these tests
compare its results with single-process training and with DDP."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from phalanx_distributed import SCRIPTS, assert_ok, run_script

sys.path.insert(0, str(SCRIPTS))

import phalanx  # noqa: E402
from phalanx.cli import main as phalanx_cli  # noqa: E402
from phalanx.utilities.dtensor import is_dtensor  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")

TOLERANCE = dict(rtol=1e-5, atol=1e-6)


def _single_device(steps: int, *, save_at: str | None = None):
    from sharded_common import MLP, loader, quiet

    phalanx.seed_everything(7)
    module = MLP()
    trainer = quiet(max_steps=steps)
    trainer.fit(module, loader(1))
    if save_at is not None:
        trainer.save_checkpoint(save_at)
    return module


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded")
    single_checkpoint = out / "single_step10.ckpt"
    _single_device(10, save_at=str(single_checkpoint))
    assert_ok(run_script("sharded_suite.py", str(out / "job"), str(single_checkpoint), timeout=600))
    job_dir = out / "job"
    return job_dir, json.loads((job_dir / "results.json").read_text())


@pytest.fixture(scope="module")
def single_run():
    from sharded_common import STEPS

    module = _single_device(STEPS)
    return module.losses, {name: value.detach().clone() for name, value in module.state_dict().items()}


def _weights(job_dir, name):
    return torch.load(job_dir / f"{name}.pt", weights_only=True)


def _assert_same_weights(a, b, **tolerance):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(
            a[name], b[name], **(tolerance or dict(rtol=0, atol=0)), msg=lambda m, name=name: f"{name}: {m}"
        )


def _global_losses(per_rank):
    # Each rank's loss is the mean over its 8 samples; the 16-sample loss of one process is their mean.
    return [sum(step) / len(step) for step in zip(*per_rank)]


@pytest.mark.parametrize(
    "name",
    ["fsdp", "fsdp_SHARD_GRAD_OP", "fsdp_NO_SHARD", "fsdp_HYBRID_SHARD", "fsdp_wrap_blocks", "fsdp_cpu_offload", "ddp"],
)
def test_loss_curves_match_one_process_for_20_steps(job, single_run, name):
    _, results = job
    single_losses, _ = single_run
    assert results[name]["global_step"] == 20
    assert _global_losses(results[name]["losses"]) == pytest.approx(single_losses, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize(
    "name",
    [
        "fsdp_SHARD_GRAD_OP",
        "fsdp_NO_SHARD",
        "fsdp_HYBRID_SHARD",
        "fsdp_wrap_blocks",
        "fsdp_cpu_offload",
        "fsdp_activation_checkpointing",
        "fsdp_self_sharded",
    ],
)
def test_sharding_options_end_with_the_weights_of_ddp(job, name):
    job_dir, _ = job
    _assert_same_weights(_weights(job_dir, name), _weights(job_dir, "ddp"), **TOLERANCE)


@pytest.mark.parametrize("name", ["fsdp_seed_arguments", "fsdp_hybrid_process_groups", "fsdp_hybrid_zero2"])
def test_the_seeds_fsdp1_arguments_train_like_ddp(job, name):
    job_dir, results = job
    assert results[name]["global_step"] == 20
    _assert_same_weights(_weights(job_dir, name), _weights(job_dir, "ddp"), **TOLERANCE)


def test_fsdp1_process_groups_and_device_mesh_tuples_become_the_mesh(job):
    _, results = job
    assert results["fsdp_hybrid_process_groups"]["mesh"] == [1, 2]  # (shard over both, each rank its own replica group)
    assert results["fsdp_hybrid_zero2"]["mesh"] == [2, 1]
    assert results["fsdp_seed_arguments"]["block_calls"] == [
        40,
        40,
    ]  # checkpointed blocks (transformer policy) ran twice


def test_a_module_sharded_in_configure_model_is_not_wrapped_again(job):
    _, results = job
    assert len(results["fsdp_self_sharded"]["warnings"]) == 1  # rank 0 warns that the wrap policy is ignored
    assert (
        "auto_wrap_policy and activation_checkpointing_policy are ignored"
        in results["fsdp_self_sharded"]["warnings"][0]
    )


def test_fsdp_weights_match_one_process(job, single_run):
    job_dir, _ = job
    _, single_weights = single_run
    _assert_same_weights(_weights(job_dir, "fsdp"), single_weights, **TOLERANCE)


def test_gradient_accumulation_and_clipping_match_ddp(job):
    job_dir, results = job
    for kind in ("accumulate", "clip"):
        assert _global_losses(results[f"fsdp_{kind}"]["losses"]) == pytest.approx(
            _global_losses(results[f"ddp_{kind}"]["losses"]), rel=1e-5, abs=1e-6
        )
        _assert_same_weights(_weights(job_dir, f"fsdp_{kind}"), _weights(job_dir, f"ddp_{kind}"), **TOLERANCE)
    assert results["fsdp_accumulate"]["global_step"] == 10
    # clipping changed the trajectory (else this test would prove nothing)
    assert _global_losses(results["fsdp_clip"]["losses"]) != pytest.approx(
        _global_losses(results["fsdp"]["losses"]), rel=1e-3
    )


def test_activation_checkpointing_recomputes_the_blocks_and_changes_nothing_else(job):
    _, results = job
    assert _global_losses(results["fsdp_activation_checkpointing"]["losses"]) == pytest.approx(
        _global_losses(results["fsdp"]["losses"]), rel=1e-6
    )
    plain = results["fsdp_plain_calls"]["block_calls"]
    assert plain == [20, 20]
    assert results["fsdp_activation_checkpointing"]["block_calls"] == [2 * calls for calls in plain]


def test_bf16_mixed_precision_trains_close_to_ddp_with_float32_master_weights(job):
    _, results = job
    assert results["fsdp_bf16"]["param_dtype"] == "torch.float32"
    fsdp = _global_losses(results["fsdp_bf16"]["losses"])
    ddp = _global_losses(results["ddp_bf16"]["losses"])
    float32 = _global_losses(results["fsdp"]["losses"])
    assert fsdp == pytest.approx(ddp, rel=0.03, abs=0.01)
    assert fsdp != float32  # bf16 compute really happened


def test_meta_device_creation_is_materialised_like_an_eager_model(job):
    from sharded_common import MLP

    job_dir, results = job
    assert results["meta_init"]["meta_left"] is False
    phalanx.seed_everything(11)
    eager = MLP()  # the same seed as the job's meta-device module, built directly
    _assert_same_weights(torch.load(job_dir / "meta_init_weights.pt", weights_only=True), eager.state_dict())
    assert all(len(per_rank) == 3 for per_rank in results["meta_init"]["losses"])


def test_full_shard_holds_a_half_of_parameters_gradients_and_adam_state_per_rank(job):
    _, results = job
    figures = results["memory_FULL_SHARD"]["figures"]
    total = figures["total"]
    held = figures["params_in_step"] + figures["grads"] + figures["optimizer"]
    # ZeRO-3: parameters, gradients and both Adam moments all split in two
    assert held == pytest.approx(4 * total / 2, rel=0.10)
    assert figures["params_in_step"] == pytest.approx(total / 2, rel=0.10)


def test_shard_grad_op_keeps_whole_parameters_but_shards_gradients_and_adam_state(job):
    _, results = job
    figures = results["memory_SHARD_GRAD_OP"]["figures"]
    total = figures["total"]
    # ZeRO-2: the whole parameters stay gathered from forward to backward (next to this rank's shard)
    assert figures["params_in_step"] >= total
    assert figures["grads"] == pytest.approx(total / 2, rel=0.10)
    assert figures["optimizer"] == pytest.approx(2 * total / 2, rel=0.10)


@pytest.mark.parametrize(
    ("resumed", "uninterrupted"),
    [
        ("fsdp_from_fsdp_full", "fsdp"),
        ("fsdp_from_fsdp_sharded", "fsdp"),
        ("ddp_from_fsdp_sharded", "ddp"),
        ("fsdp_from_ddp", "fsdp"),
    ],
)
def test_resume_across_strategies_ends_like_the_uninterrupted_run(job, resumed, uninterrupted):
    job_dir, results = job
    assert results[resumed]["global_step"] == 20
    assert len(results[resumed]["losses"][0]) == 10  # only the last 10 steps ran
    assert results[resumed]["losses"][0] == pytest.approx(results[uninterrupted]["losses"][0][10:], rel=1e-5, abs=1e-6)
    _assert_same_weights(_weights(job_dir, resumed), _weights(job_dir, uninterrupted), **TOLERANCE)


def test_sharded_checkpoint_is_a_directory_with_each_ranks_shards(job):
    job_dir, _ = job
    directory = job_dir / "fsdp_sharded_ckpt" / "step=10.ckpt"
    assert directory.is_dir()
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "phalanx_meta.pt", ".complete"} <= {
        p.name for p in directory.iterdir()
    }
    whole = torch.load(job_dir / "fsdp_full_ckpt" / "step=10.ckpt", weights_only=True)
    assert whole["global_step"] == 10 and len(whole["rng_states"]) == 2
    assert set(whole["optimizer_states"][0]["state"]) == set(range(len(whole["state_dict"])))


def test_one_process_resumes_from_a_two_process_sharded_checkpoint(job, single_run, tmp_path):
    from sharded_common import MLP, loader, quiet

    job_dir, _ = job
    _, single_weights = single_run
    phalanx.seed_everything(7)
    module = MLP()
    trainer = quiet(max_steps=20)
    trainer.fit(module, loader(1), ckpt_path=str(job_dir / "fsdp_sharded_ckpt" / "step=10.ckpt"))
    assert trainer.global_step == 20 and len(module.losses) == 10
    _assert_same_weights(module.state_dict(), single_weights, **TOLERANCE)


def test_a_full_checkpoint_holds_the_whole_optimizer_state_and_one_process_resumes_from_it(job, single_run):
    from sharded_common import MLP, loader, quiet

    job_dir, _ = job
    _, single_weights = single_run
    path = job_dir / "fsdp_full_ckpt" / "step=10.ckpt"
    checkpoint = torch.load(path, weights_only=True)
    shapes = [value.shape for value in checkpoint["state_dict"].values()]
    state = checkpoint["optimizer_states"][0]["state"]
    assert [(state[i]["exp_avg"].shape, state[i]["exp_avg_sq"].shape) for i in range(len(shapes))] == [
        (s, s) for s in shapes
    ]
    assert not any(is_dtensor(value) for entries in state.values() for value in entries.values())
    phalanx.seed_everything(7)
    module = MLP()
    trainer = quiet(max_steps=20)
    trainer.fit(module, loader(1), ckpt_path=str(path))
    assert trainer.global_step == 20 and len(module.losses) == 10
    _assert_same_weights(module.state_dict(), single_weights, **TOLERANCE)


def test_two_processes_resume_from_a_one_process_checkpoint(job, single_run):
    job_dir, _ = job
    _, single_weights = single_run
    _assert_same_weights(_weights(job_dir, "fsdp_from_single"), single_weights, **TOLERANCE)


def test_consolidate_turns_a_sharded_directory_into_one_loadable_file(job, tmp_path, capsys):
    from sharded_common import MLP

    job_dir, _ = job
    out = tmp_path / "whole.ckpt"
    assert (
        phalanx_cli(["checkpoint", "consolidate", str(job_dir / "fsdp_sharded_ckpt" / "step=20.ckpt"), str(out)]) == 0
    )
    checkpoint = torch.load(out, weights_only=True)
    _assert_same_weights(checkpoint["state_dict"], _weights(job_dir, "fsdp_sharded_save"))
    assert checkpoint["global_step"] == 20 and "sharded_tensors" not in checkpoint
    exp_avg = checkpoint["optimizer_states"][0]["state"][0]["exp_avg"]
    assert exp_avg.shape == checkpoint["state_dict"]["inp.weight"].shape
    restored = MLP.load_from_checkpoint(out)
    _assert_same_weights(restored.state_dict(), checkpoint["state_dict"])


def test_evaluation_and_prediction_of_a_sharded_model_with_uneven_shards(job):
    from sharded_common import MLP, loader

    job_dir, results = job
    module = MLP()
    module.load_state_dict(_weights(job_dir, "fsdp_eval_weights"))
    x, y = loader(1).dataset[:45]
    with torch.no_grad():
        expected = module(x).flatten()
    evaluated = results["fsdp_eval"]
    assert evaluated["prediction_batches"] == [8, 8, 8, 8, 8, 5]  # as one process batches 45 samples, no repeats
    assert evaluated["predictions"] == pytest.approx(expected.tolist(), abs=1e-5)
    exact = torch.nn.functional.mse_loss(expected.unsqueeze(1), y).item()
    # 45 samples on 2 ranks: one sample is evaluated twice (padding), so the mean is close to, not exactly, the exact
    # one
    assert evaluated["validated"][0]["val_loss"] == pytest.approx(exact, rel=0.05)


def test_tensor_parallel_transformer_block_matches_one_process(job, tmp_path):
    from sharded_common import TransformerBlock, quiet, sequences
    from torch.utils.data import DataLoader

    job_dir, results = job
    assert {"q.weight", "k.weight", "v.weight", "o.weight", "up.weight", "down.weight"} <= set(results["tp"]["sharded"])
    assert "norm1.weight" not in results["tp"]["sharded"]
    phalanx.seed_everything(13)
    block = TransformerBlock()
    trainer = quiet(max_steps=10)
    trainer.fit(block, DataLoader(sequences(), batch_size=8))
    rank0, rank1 = results["tp"]["losses"]
    assert rank0 == rank1  # both tensor-parallel ranks computed the same (whole) loss
    assert rank0 == pytest.approx(block.losses, rel=1e-4, abs=1e-5)
    _assert_same_weights(_weights(job_dir, "tp"), block.state_dict(), rtol=1e-4, atol=1e-5)
    # its sharded checkpoint consolidates into a file one process can load
    out = tmp_path / "tp.ckpt"
    assert phalanx_cli(["checkpoint", "consolidate", str(job_dir / "tp_ckpt" / "step=10.ckpt"), str(out)]) == 0
    _assert_same_weights(torch.load(out, weights_only=True)["state_dict"], _weights(job_dir, "tp"))
