"""TrainingModule.optimizer_step under DeepSpeed (one CPU process): called for every batch, its update applied.

DeepSpeed accumulates gradients itself, so, as in Lightning, the loop calls optimizer_step on every batch and the
engine decides when the weights change. Skipped when deepspeed is not installed.
"""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
pytest.importorskip("deepspeed")

from phalanx_distributed import assert_ok, clean_environment, run_script  # noqa: E402


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    job = run_script(
        "deepspeed_hooks_job.py",
        str(tmp_path_factory.mktemp("ds_hooks")),
        env=clean_environment(DS_ACCELERATOR="cpu"),
        timeout=600,
    )
    assert_ok(job)
    line = next(line for line in job.stdout.splitlines() if line.startswith("RESULTS "))
    return json.loads(line[len("RESULTS ") :])


def test_optimizer_step_is_called_for_every_batch_and_a_default_override_changes_nothing(results):
    assert results["default"]["calls"] == [[batch, batch] for batch in range(4)]  # global_step counts batches here
    assert results["default"]["weights"] == results["plain"]["weights"]
    assert results["default"]["global_step"] == results["plain"]["global_step"] == 4


def test_a_warm_up_in_optimizer_step_reaches_the_engine(results):
    # The same warm-up without DeepSpeed (whose effect on the weights tests/unit/trainer/test_lightning_hooks.py
    # checks).
    assert results["warmup"]["weights"] == pytest.approx(results["reference_warmup"]["weights"], abs=1e-6)


def test_an_optimizer_step_without_the_closure_is_refused(results):
    assert "Net.optimizer_step did not run the optimizer_closure" in results["no_closure"]["error"]
    assert results["no_closure"]["calls"] == [[0, 0]]
