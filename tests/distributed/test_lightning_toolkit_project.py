"""examples/lightning_toolkit_project.py (LightningCLI, torchmetrics objects in self.log, MLflow, a SimpleProfiler with
a section of the user's own, ThroughputMonitor, StochasticWeightAveraging, the learning-rate finder) run on phalanx
and, with only its imports changed, on Lightning 2.6: the MLflow run each writes is read back with MlflowClient and
compared metric by metric, on one process and on DDP's two.

Each (framework, strategy) runs once (tiny: 128 points, 3 epochs, a sqlite tracking store in the test's folder).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from phalanx_distributed import assert_ok, clean_environment, run

pytest.importorskip("torchmetrics")
pytest.importorskip("mlflow")
pytest.importorskip("pytorch_lightning")

SCRIPT = Path(__file__).parents[2] / "examples" / "lightning_toolkit_project.py"
# The script's phalanx imports and Lightning's (as its comment gives them): nothing else differs between the two.
LIGHTNING_IMPORTS = {
    "from phalanx import DataModule as LightningDataModule\n": "from pytorch_lightning import LightningDataModule\n",
    "from phalanx import TrainingModule as LightningModule\n": "from pytorch_lightning import LightningModule\n",
    "from phalanx.callbacks import StochasticWeightAveraging, ThroughputMonitor\n": (
        "from pytorch_lightning.callbacks import StochasticWeightAveraging, ThroughputMonitor\n"
    ),
    "from phalanx.cli import LightningCLI\n": "from pytorch_lightning.cli import LightningCLI\n",
    "from phalanx.loggers import MLFlowLogger\n": "from pytorch_lightning.loggers import MLFlowLogger\n",
    "from phalanx.profilers import SimpleProfiler\n": "from pytorch_lightning.profilers import SimpleProfiler\n",
    "from phalanx.tuner import Tuner\n": "from pytorch_lightning.tuner import Tuner\n",
}
# Wall-clock figures differ between any two runs: their steps are compared, not their values.
TIMED = ("_per_sec", "/time")
CASES = [("single_device", 1), ("ddp", 2)]


def _lightning_script(folder: Path) -> Path:
    text = SCRIPT.read_text()
    for ours, theirs in LIGHTNING_IMPORTS.items():
        assert ours in text, f"the example no longer imports {ours.strip()!r}"
        text = text.replace(ours, theirs)
    assert "phalanx" not in text.split('"""', 2)[2], "the Lightning copy still names phalanx"
    path = folder / "lightning_toolkit_project.py"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(framework, strategy) -> (job, root folder), each run once on first use."""
    done: dict[tuple[str, str], tuple] = {}

    def get(framework: str, strategy: str, devices: int):
        if (framework, strategy) not in done:
            root = tmp_path_factory.mktemp(f"{framework}_{strategy}")
            script = SCRIPT if framework == "phalanx" else _lightning_script(root)
            command = [sys.executable, str(script), "--trainer.strategy", strategy, "--trainer.devices", str(devices)]
            command += ["--trainer.accelerator", "cpu", "--trainer.max_epochs", "3"]
            job = run(command, env=clean_environment(), timeout=400, cwd=root)
            done[framework, strategy] = (job, root / "toolkit_runs")  # where the script writes, under its folder
        return done[framework, strategy]

    return get


def _history(root: Path) -> tuple[dict[str, list[tuple[int, float]]], dict[str, str]]:
    """Every metric of the one MLflow run under ``root``, as (step, value) in logging order, and the run's params."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{root}/mlflow.db")
    experiment = client.get_experiment_by_name("toolkit")
    assert experiment is not None, "no MLflow experiment named 'toolkit'"
    (tracked,) = client.search_runs([experiment.experiment_id])  # one run, whatever the number of processes
    history = {
        key: [
            (metric.step, metric.value)
            for metric in sorted(client.get_metric_history(tracked.info.run_id, key), key=lambda m: m.timestamp)
        ]
        for key in tracked.data.metrics
    }
    return history, dict(tracked.data.params)


@pytest.mark.parametrize(("strategy", "devices"), CASES)
def test_the_mlflow_run_matches_lightning_s_metric_by_metric(runs, strategy, devices):
    (ours, our_root), (theirs, their_root) = runs("phalanx", strategy, devices), runs("lightning", strategy, devices)
    assert_ok(ours)
    assert_ok(theirs)
    history, params = _history(our_root)
    expected, expected_params = _history(their_root)
    # On one process the learning-rate finder sets lr before fit. The run records the rate it trained at; Lightning's
    # keeps the rate from before the search, recorded by the fit its finder ran (docs/migrating-from-lightning.md).
    found = re.search(r"learning rate found: (\S+)", ours.stdout)
    assert (found is not None) == (devices == 1), ours.stdout[-2000:]
    expected_params.pop("_instantiator", None)  # Lightning's CLI records how it built the module
    assert expected_params == {"hidden": "32", "lr": "0.05", "batch_size": "16"}
    expected_lr = float(found.group(1)) if found else 0.05
    assert float(params.pop("lr")) == pytest.approx(expected_lr, rel=1e-3) and params == {
        "hidden": "32",
        "batch_size": "16",
    }
    assert sorted(history) == sorted(expected)
    for name in ("train_acc_step", "train_acc_epoch", "val_acc", "test_acc", "train/samples", "validate/samples"):
        assert name in history, f"{name} was not logged"
    for name, points in history.items():
        steps, expected_steps = sorted(step for step, _ in points), sorted(step for step, _ in expected[name])
        assert steps == expected_steps, name
        if not name.endswith(TIMED):
            ordered, expected_ordered = sorted(points), sorted(expected[name])
            assert [value for _, value in ordered] == pytest.approx([value for _, value in expected_ordered], abs=1e-5)


@pytest.mark.parametrize(("strategy", "devices"), CASES)
def test_the_profile_holds_the_users_section_and_the_test_result_reaches_the_main_process(runs, strategy, devices):
    job, root = runs("phalanx", strategy, devices)
    assert_ok(job)
    for stage in ("fit", "test"):
        reports = sorted(root.glob(f"{stage}-profile*.txt"))
        assert reports, f"no {stage} profile under {root}: {sorted(p.name for p in root.iterdir())}"
    assert any("accuracy_update" in path.read_text() for path in root.glob("fit-profile*.txt"))
    printed = re.search(r"test accuracy: (\d+\.\d+)", job.stdout)
    assert printed is not None, job.stdout[-2000:]
    history, _ = _history(root)
    assert float(printed.group(1)) == pytest.approx(history["test_acc"][-1][1], abs=1e-4)
