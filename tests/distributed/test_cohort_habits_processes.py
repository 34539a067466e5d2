"""Cohort.load_raw and the Fabric-style resume loop on 2 CPU processes (scripts/cohort_habits_job.py): ddp and fsdp in
one job, DeepSpeed stages 2 and 3 in another."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from phalanx_distributed import assert_ok, clean_environment, run_script

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")


@pytest.fixture(scope="module")
def torch_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("cohort_habits_torch")
    assert_ok(run_script("cohort_habits_job.py", str(out), "torch", timeout=400))
    return json.loads((out / "torch.json").read_text())


@pytest.fixture(scope="module")
def deepspeed_job(tmp_path_factory):
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (pip install 'phalanx[deepspeed]')")
    out = tmp_path_factory.mktemp("cohort_habits_deepspeed")
    job = run_script(
        "cohort_habits_job.py", str(out), "deepspeed", env=clean_environment(DS_ACCELERATOR="cpu"), timeout=600
    )
    assert_ok(job)
    return json.loads((out / "deepspeed.json").read_text())


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_load_raw_gives_the_files_weights_on_torch_strategies(torch_job, strategy):
    assert torch_job[f"{strategy}_load_raw"] == 0.0


@pytest.mark.parametrize("strategy", ["deepspeed_stage_2", "deepspeed_stage_3"])
def test_load_raw_gives_the_files_weights_on_deepspeed_even_after_a_step(deepspeed_job, strategy):
    assert deepspeed_job[f"{strategy}_load_raw"] == 0.0


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_shuffled_loop_resumed_mid_epoch_equals_the_uninterrupted_one(torch_job, strategy):
    assert torch_job[f"{strategy}_resume"] == 0.0


def test_a_shuffled_loop_resumed_mid_epoch_on_deepspeed_stage_2_equals_the_uninterrupted_one(deepspeed_job):
    assert deepspeed_job["deepspeed_stage_2_resume"] == 0.0
