"""loss.backward() instead of cohort.backward(loss) on 2 CPU processes (scripts/cohort_backward_job.py): allowed and
equal on ddp and fsdp, refused on deepspeed_stage_2 (where it would train differently). The single-process cases are
in tests/unit/cohort/test_cohort_backward_slip.py."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from phalanx_distributed import assert_ok, clean_environment, run_script

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    out = tmp_path_factory.mktemp("cohort_backward")
    assert_ok(run_script("cohort_backward_job.py", str(out), "torch", timeout=400))
    result = json.loads((out / "torch.json").read_text())
    if importlib.util.find_spec("deepspeed") is not None:
        job = run_script(
            "cohort_backward_job.py", str(out), "deepspeed", env=clean_environment(DS_ACCELERATOR="cpu"), timeout=600
        )
        assert_ok(job)
        result.update(json.loads((out / "deepspeed.json").read_text()))
    return result


@pytest.mark.parametrize(("strategy", "refused"), [("ddp", False), ("fsdp", False), ("deepspeed_stage_2", True)])
def test_loss_backward_in_an_accumulation_loop_is_refused_only_where_it_changes_the_result(outcomes, strategy, refused):
    if strategy not in outcomes:
        pytest.skip("deepspeed is not installed (pip install 'phalanx[deepspeed]')")
    if refused:
        assert "Call cohort.backward(loss) instead of loss.backward()" in outcomes[strategy]["error"]
    else:
        assert outcomes[strategy] == {"difference": 0.0}
