"""torch.compile with every parallel strategy at 2 CPU processes, through Trainer.fit: compiled weights equal eager
ones, checkpoints resume exactly across eager and compiled runs, the steps compile a bounded number of times without
graph breaks. One job for all strategies (scripts/compile_job.py): aot_eager everywhere, inductor once (DDP); FSDP
also with activation checkpointing; the spawn launcher in a job of its own (scripts/compile_spawn_job.py)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from phalanx_distributed import assert_ok, clean_environment, run_script
from strategy_cases import names

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")

#: The strategies that promise it (tests/strategy_cases.py).
STRATEGIES = names("compile")
#: What each strategy compiles (docs/compile.md): Net's own forward (it holds the blocks itself), or each block.
UNITS = {
    "ddp": ["<forward>"],
    "fsdp": ["blocks.0", "blocks.1"],
    "model_parallel": ["blocks.0", "blocks.1"],
    "deepspeed_stage_2": ["<forward>"],
}
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("compile_strategies")
    names = [name for name in STRATEGIES if HAS_DEEPSPEED or not name.startswith("deepspeed")]
    assert_ok(run_script("compile_job.py", str(out), *names, env=clean_environment(DS_ACCELERATOR="cpu"), timeout=600))
    return {name: torch.load(out / f"{name}.pt", weights_only=False) for name in names}


def _strategy(runs, name):
    if name not in runs:
        pytest.skip("deepspeed is not installed (pip install 'phalanx[deepspeed]')")
    return runs[name]


def _assert_close(a, b):
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-5, rtol=1e-5, msg=key)


@pytest.mark.parametrize("name", STRATEGIES)
def test_compiled_weights_equal_eager_weights_and_keep_their_names(runs, name):
    result = _strategy(runs, name)
    assert result["compiled_modules"] == UNITS[name]
    assert not [key for key in result["compiled"] if "_orig_mod" in key]
    _assert_close(result["eager"], result["compiled"])
    assert result.get("compiled_ckpt_keys", sorted(result["eager"])) == sorted(result["eager"])


@pytest.mark.parametrize("name", STRATEGIES)
@pytest.mark.parametrize("resumed", ["compiled_from_eager", "eager_from_compiled"])
def test_checkpoints_resume_exactly_across_eager_and_compiled(runs, name, resumed):
    result = _strategy(runs, name)
    assert (result[resumed]["head.weight"] != result["eager"]["head.weight"]).any()  # the extra step ran
    _assert_close(result["straight"], result[resumed])


@pytest.mark.parametrize("name", STRATEGIES)
def test_steps_compile_a_bounded_number_of_times_without_graph_breaks(runs, name):
    result = _strategy(runs, name)
    # The whole Net: once. The blocks share one code object: once for the first block (its input needs no grad), once
    # for the next.
    assert result["frames"] == (1 if UNITS[name] == ["<forward>"] else 2)
    assert result["resumed_frames"] == result["frames"]
    assert result["graph_breaks"] == 0


@pytest.mark.parametrize("run", ["precompiled", "inductor"])
def test_ddp_runs_a_torch_compiled_model_and_inductor_like_eager(runs, run):
    _assert_close(runs["ddp"]["eager"], runs["ddp"][run])


def test_fsdp_compiles_activation_checkpointed_blocks_like_eager(runs):
    result = runs["fsdp"]
    _assert_close(result["checkpointed_eager"], result["checkpointed"])
    _assert_close(result["eager"], result["checkpointed"])  # recomputing activations changes no number
    assert 1 <= result["checkpointed_frames"] <= 2
    assert result["checkpointed_graph_breaks"] == 0


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    out = tmp_path_factory.mktemp("compile_spawn")
    assert_ok(run_script("compile_spawn_job.py", str(out), env=clean_environment(), timeout=300))
    return torch.load(out / "spawn.pt", weights_only=False)


@pytest.mark.parametrize("run", ["compiled", "precompiled"])
def test_spawned_workers_compile_and_hand_back_eager_weights(spawned, run):
    assert spawned["eager"]["compiled"] == 0.0
    assert spawned[run]["compiled"] == 1.0  # logged by the workers' steps
    _assert_close(spawned["eager"]["weights"], spawned[run]["weights"])
