"""What dynamo compiles for issue 37's model on each parallel strategy at 2 CPU processes, asked either way, with the
Trainer's defaults on (scripts/compile_count_job.py), and through a Cohort on DDP: the strategy's unit, a training
graph compiled first and with static sizes (the sanity check runs eagerly; its validation batches have another size),
no graph break, one graph for training and one for validation, and every matmul in bfloat16 under 'bf16-mixed'."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from phalanx_compile import LAYERS
from phalanx_distributed import assert_ok, clean_environment, run_script

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
BLOCKS = [f"gpt.h.{index}" for index in range(LAYERS)]
#: What each strategy compiles by default (docs/compile.md says why): the GPT that holds the blocks, or each block.
UNITS = {"ddp": ["gpt"], "fsdp": BLOCKS, "model_parallel": BLOCKS, "deepspeed_stage_2": ["gpt"]}
NAMES = [*UNITS, "cohort"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("compile_counts")
    names = [name for name in NAMES if HAS_DEEPSPEED or not name.startswith("deepspeed")]
    environment = clean_environment(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    assert_ok(run_script("compile_count_job.py", str(out), *names, env=environment, timeout=1500))
    return {name: torch.load(out / f"{name}.pt", weights_only=False) for name in names}


def _results(runs, name):
    if name not in runs:
        pytest.skip("deepspeed is not installed (pip install 'phalanx[deepspeed]')")
    return runs[name]


@pytest.mark.parametrize("how", ["argument", "precompiled"])
@pytest.mark.parametrize("name", list(UNITS))
def test_each_strategy_compiles_its_unit_once_for_training_with_static_sizes(runs, name, how):
    result = _results(runs, name)[how]
    assert result["compiled"] == UNITS[name]
    assert result["graph_breaks"] == 0
    # Training first (grad mode on, static sizes), then validation (its other batch size may be dynamic there).
    assert [grad for grad, _ in result["graphs"]] == [True, False]
    assert result["graphs"][0] == (True, False)
    assert result["dtypes"] == ["bfloat16"]
    # Per block: qkv, two attention matmuls, proj, fc, proj; the whole GPT (3 blocks in this job) adds the head.
    assert result["matmuls"] == (6 if UNITS[name] == BLOCKS else 6 * 3 + 1)


def test_a_cohort_compiles_the_gpt_once_in_bfloat16(runs):
    result = runs["cohort"]["cohort"]
    assert result["compiled"] == ["gpt"]
    assert result["graph_breaks"] == 0
    assert result["graphs"] == [(True, False)]
    assert result["dtypes"] == ["bfloat16"]
