"""The defaults tier: every strategy that runs on the CPU, used as a new user uses it, with every Trainer argument left
at its default except ``accelerator``, ``devices`` and ``max_epochs`` and a validation loader, in a working directory
of its own (the default CSV logger and checkpoint folder), progress bar on.

One launch per strategy (scripts/defaults_tier_job.py) runs, in order: validate/test/predict before fit, fit with its
sanity check, validate/test(``ckpt_path="best"``)/predict after it, then fresh Trainers resuming with
``ckpt_path="auto"``, ``"last"`` and ``"best"``. The other distributed tests switch defaults off (no sanity check, an
explicit ``dirpath``, ``logger=False``); these do not, so no strategy is covered only through them.
"""

from __future__ import annotations

import csv
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from phalanx_distributed import SCRIPTS, assert_ok, clean_environment, run
from strategy_cases import case, promising

sys.path.insert(0, str(SCRIPTS))

from defaults_tier_job import BATCH, ONE_PROCESS, TRAIN  # noqa: E402

#: The strategies that promise this tier (tests/strategy_cases.py), and the class each must run on.
STRATEGIES = {row.name: row.strategy_class for row in promising("defaults")}
#: The stages of Trainer A (max_epochs=2): all of them must log to its one version folder.
FIRST_TRAINER = [
    "validate_before_fit",
    "test_before_fit",
    "predict_before_fit",
    "fit",
    "validate_after_fit",
    "test_best_after_fit",
    "predict_after_fit",
]


class Run:
    """A finished job: rank 0's view of each stage (the process that called it), every rank's events, the folders."""

    def __init__(self, strategy: str, root: Path) -> None:
        self.work = root / "work"
        self.out = root / "out"
        self.work.mkdir()
        self.out.mkdir()
        command = [sys.executable, str(SCRIPTS / "defaults_tier_job.py"), strategy, str(self.out)]
        self.job = run(command, env=clean_environment(DS_ACCELERATOR="cpu"), cwd=self.work, timeout=400)
        assert_ok(self.job)
        reports = [json.loads(path.read_text()) for path in self.out.glob("report_*.json")]
        rank_zero = [report for report in reports if report["global_rank"] == 0]
        assert len(rank_zero) == 1, reports
        # Every process that called fit (both ranks under ddp) holds the checkpoint callback's results.
        for report in reports:
            fit = next(stage for stage in report["stages"] if stage["stage"] == "fit")
            assert fit["best_model_path"] and fit["dirpath"] == str(self.work / "logs" / "version_0" / "checkpoints")
        assert rank_zero[0]["strategy"] == STRATEGIES[strategy]
        # Processes that read different data: model_parallel's default mesh is all tensor parallel (1 x 2).
        replicas = 1 if strategy in ONE_PROCESS or strategy == "model_parallel" else 2
        self.stages = {stage["stage"]: stage for stage in rank_zero[0]["stages"]}
        self.steps_per_epoch = TRAIN // (BATCH * replicas)
        lines = (self.out / "events_rank0.jsonl").read_text().splitlines()
        self.events = [json.loads(line) for line in lines]

    def version(self, n: int) -> str:
        return str(self.work / "logs" / f"version_{n}")

    def fits(self) -> list[list[dict[str, Any]]]:
        """Rank 0's events of each fit, in order (a fit begins with its sanity check)."""
        fits: list[list[dict[str, Any]]] = []
        for event in self.events:
            if event["event"] == "sanity_step" and (not fits or fits[-1][-1]["event"] == "train_end"):
                fits.append([])
            fits[-1].append(event)
        return fits


@pytest.fixture(params=list(STRATEGIES))
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Run:
    if case(request.param).needs is not None:
        pytest.importorskip(case(request.param).needs)
    return Run(request.param, tmp_path)


def _val_losses(metrics_csv: Path) -> list[float]:
    with open(metrics_csv, newline="") as file:
        return [float(row["val_loss"]) for row in csv.DictReader(file) if row.get("val_loss")]


def _check_first_trainer(run: Run) -> None:
    stages, spe = run.stages, run.steps_per_epoch
    for name in FIRST_TRAINER:
        assert stages[name]["log_dir"] == run.version(0), (name, stages[name]["log_dir"])
    fit = stages["fit"]
    folder = Path(run.version(0)) / "checkpoints"
    expected = f"epoch=1-step={2 * spe}.ckpt"
    assert (fit["dirpath"], fit["files"]) == (str(folder), [expected])
    assert fit["best_model_path"] == str(folder / expected) and (folder / expected).exists()
    assert (fit["global_step"], fit["current_epoch"]) == (2 * spe, 2)
    assert stages["test_best_after_fit"]["ckpt_path"] == fit["best_model_path"]
    before, after = stages["validate_before_fit"]["result"], stages["validate_after_fit"]["result"]
    assert after[0]["val_loss"] < before[0]["val_loss"]
    for name in ("test_before_fit", "test_best_after_fit"):
        assert math.isfinite(stages[name]["result"][0]["test_loss"])
    assert stages["predict_before_fit"]["result"] != stages["predict_after_fit"]["result"]
    with open(folder.parent / "metrics.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    assert sum(bool(row["test_loss"]) for row in rows) == 2  # both test runs logged into this version's file
    val_losses = _val_losses(folder.parent / "metrics.csv")
    assert len(val_losses) == 4 and val_losses[2] < val_losses[1]  # validate, 2 epochs of fit, validate


def _check_resumes(run: Run) -> None:
    stages, spe = run.stages, run.steps_per_epoch
    auto, saving = stages["fit_auto"], stages["fit_auto_save_last"]
    assert auto["ckpt_path"] == stages["fit"]["best_model_path"] and auto["log_dir"] == run.version(1)
    assert saving["ckpt_path"] == auto["best_model_path"] and saving["log_dir"] == run.version(2)
    folder = Path(run.version(2)) / "checkpoints"
    assert saving["files"] == [f"epoch=3-step={4 * spe}.ckpt", "last.ckpt"]
    assert saving["last_model_path"] == str(folder / "last.ckpt") and math.isfinite(saving["best_model_score"])
    assert (stages["validate_last"]["ckpt_path"], stages["validate_last"]["log_dir"]) == (
        saving["last_model_path"],
        run.version(2),
    )
    assert (stages["test_best"]["ckpt_path"], stages["test_best"]["log_dir"]) == (
        saving["best_model_path"],
        run.version(2),
    )
    last, best = stages["fit_last"], stages["fit_best"]
    assert last["ckpt_path"] == saving["last_model_path"] and last["global_step"] == 5 * spe
    assert best["ckpt_path"] == last["best_model_path"]
    # Where each fit started: its global step, and the epoch of its first training step (a fit resumed from the
    # checkpoint written at the end of epoch E trains epoch E + 1 first; one resumed at max_epochs trains nothing).
    starts = []
    for fit in run.fits():
        losses = [event["epoch"] for event in fit if event["event"] == "train_loss"]
        step = next(event["step"] for event in fit if event["event"] == "train_start")
        starts.append((losses[0] if losses else None, step))
    assert starts[:4] == [(0, 0), (2, 2 * spe), (3, 3 * spe), (4, 4 * spe)]
    best_step = int(re.search(r"step=(\d+)", best["ckpt_path"]).group(1))
    assert starts[4] == (best_step // spe if best_step < 5 * spe else None, best_step)
    assert sorted(path.name for path in (run.work / "logs").iterdir()) == [f"version_{n}" for n in range(5)]


def test_every_stage_runs_with_default_arguments(tier: Run) -> None:
    output = tier.job.stdout + tier.job.stderr
    assert "Sanity Checking" in output and "Epoch 1" in output  # the default progress bar
    for fit in tier.fits():
        sanity = [event for event in fit if event["event"] == "sanity_step"]
        assert len(sanity) == 2  # num_sanity_val_steps=2 (every rank has at least 2 validation batches)
    losses: dict[int, list[float]] = {}
    for event in tier.events:
        if event["event"] == "train_loss":
            losses.setdefault(event["epoch"], []).append(event["loss"])
    assert sorted(losses) == [0, 1, 2, 3, 4]
    assert all(math.isfinite(loss) for epoch in losses.values() for loss in epoch)
    assert sum(losses[4]) / len(losses[4]) < sum(losses[0]) / len(losses[0])
    _check_first_trainer(tier)
    _check_resumes(tier)
