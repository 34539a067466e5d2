"""examples/lightning_user_project.py, a Lightning user's project changed only in its imports, on every CPU strategy:
the same metric names as Lightning, Lightning's logging cadence, the checkpoints ModelCheckpoint promises, and rank 0's
results in the main process.

Each strategy runs the script once (tiny: 96 images of 12x12, 3 epochs); DeepSpeed's first run on a machine compiles
a communication op (cached under ~/.cache/torch_extensions).
"""

from __future__ import annotations

import csv
import math
import re
import sys
from pathlib import Path

import pytest
from phalanx_distributed import assert_ok, clean_environment, run

SCRIPT = Path(__file__).parents[2] / "examples" / "lightning_user_project.py"
SAMPLES, BATCH_SIZE, ACCUMULATE, EPOCHS, LOG_EVERY = 96, 8, 2, 3, 2  # as the script sets them

STRATEGIES = [("single_device", 1), ("ddp", 2), ("ddp_spawn", 2), ("fsdp", 2), ("deepspeed", 2)]

# TEMPORARY: runs that fail on this branch only because of bugs other helpers of issue 23 are fixing. The lead removes
# each entry when the fix is merged; the test then runs. (strategy, check) -> why.
AWAITING_OTHER_FIXES: dict[tuple[str, str], str] = {}


def _awaiting(strategy: str, check: str) -> None:
    reason = AWAITING_OTHER_FIXES.get((strategy, check))
    if reason is not None:
        pytest.skip(f"awaiting another fix: {reason}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """strategy -> (job, root folder), each run once on first use."""
    done: dict[str, tuple] = {}

    def get(strategy: str, devices: int):
        if strategy not in done:
            root = tmp_path_factory.mktemp(strategy)
            command = [sys.executable, str(SCRIPT), "--strategy", strategy, "--devices", str(devices)]
            command += ["--accelerator", "cpu", "--max-epochs", str(EPOCHS), "--root", str(root)]
            done[strategy] = (run(command, env=clean_environment(), timeout=400, cwd=root), root)
        return done[strategy]

    return get


def _rows(root: Path) -> list[dict[str, str]]:
    (metrics,) = root.glob("csv/version_*/metrics.csv")
    with open(metrics, newline="") as handle:
        return list(csv.DictReader(handle))


def _steps(rows: list[dict[str, str]], name: str) -> list[int]:
    return [int(row["step"]) for row in rows if row.get(name)]


def _lightning_cadence(world_size: int) -> dict[str, list[int]]:
    """The steps at which Lightning 2.6 logs each name for this project (its CSV rows, in order)."""
    batches = math.ceil(math.ceil(SAMPLES / world_size) / BATCH_SIZE)  # DistributedSampler pads to equal shards
    per_epoch = math.ceil(batches / ACCUMULATE)
    steps = per_epoch * EPOCHS
    # Step values are logged at the optimizer step k (1-based) with k % log_every_n_steps == 0, under the step count
    # before it (k - 1); LearningRateMonitor logs at the start of such a step's batches, at that same count.
    logged = [k - 1 for k in range(1, steps + 1) if k % LOG_EVERY == 0]
    epoch_ends = [per_epoch * (epoch + 1) - 1 for epoch in range(EPOCHS)]
    return {
        "train_loss_step": logged,
        "lr-AdamW": logged,
        "val_loss": epoch_ends,
        "val_acc": epoch_ends,
        "train_loss_epoch": epoch_ends,
        "test_acc": [steps],
    }


@pytest.mark.parametrize(("strategy", "devices"), STRATEGIES)
def test_the_project_runs_and_writes_lightning_s_metric_names(runs, strategy, devices):
    _awaiting(strategy, "run")
    job, root = runs(strategy, devices)
    assert_ok(job)
    rows = _rows(root)
    names = set().union(*({name for name, value in row.items() if value} for row in rows)) - {"step"}
    assert names == {"train_loss_step", "train_loss_epoch", "val_loss", "val_acc", "lr-AdamW", "epoch", "test_acc"}
    assert list(root.glob("tensorboard/version_*/events.out.tfevents.*")), "TensorBoardLogger wrote no event file"
    # ModelCheckpoint(save_top_k=2, save_last=True) in its default folder (the first logger's version folder).
    folder = root / "tensorboard" / "version_0" / "checkpoints"
    assert sorted(path.name for path in folder.iterdir() if not path.name.startswith(".")) == sorted(
        ["last.ckpt", *(f"epoch={epoch}-val_loss={loss}.ckpt" for epoch, loss in _top_two(rows))]
    )
    # Rank 0's results reach the main process (ddp_spawn included): the best checkpoint, its score, the test.
    best = re.search(r"best checkpoint: (\S+) \(val_loss (\d+\.\d+)\)", job.stdout)
    assert best is not None, job.stdout[-2000:]
    assert Path(best.group(1)).parent == folder and Path(best.group(1)).name.startswith("epoch=")
    assert float(best.group(2)) == pytest.approx(
        min(float(row["val_loss"]) for row in rows if row["val_loss"]), abs=1e-4
    )
    assert "test accuracy: " in job.stdout


def _top_two(rows: list[dict[str, str]]) -> list[tuple[int, str]]:
    scored = [(float(row["val_loss"]), int(float(row["epoch"]))) for row in rows if row.get("val_loss")]
    return [(epoch, f"{loss:.3f}") for loss, epoch in sorted(scored)[:2]]


@pytest.mark.parametrize(("strategy", "devices"), STRATEGIES)
def test_the_project_logs_at_lightning_s_cadence(runs, strategy, devices):
    _awaiting(strategy, "run")
    _awaiting(strategy, "cadence")
    job, root = runs(strategy, devices)
    assert_ok(job)
    rows = _rows(root)
    for name, steps in _lightning_cadence(devices).items():
        # Lightning's monitor logs the rate once per batch of an accumulation window: its steps, not its count, matter.
        logged = sorted(set(_steps(rows, name))) if name.startswith("lr-") else _steps(rows, name)
        assert logged == steps, name


@pytest.mark.parametrize(("strategy", "devices"), [s for s in STRATEGIES if s[1] == 2 and s[0] != "ddp"])
def test_every_two_process_strategy_logs_as_ddp_does(runs, strategy, devices):
    """Whatever the cadence, the strategies do not differ in it: the same names at the same steps as DDP."""
    _awaiting(strategy, "run")
    _awaiting(strategy, "same as ddp")
    reference_job, reference_root = runs("ddp", 2)
    job, root = runs(strategy, devices)
    assert_ok(reference_job)
    assert_ok(job)
    reference, rows = _rows(reference_root), _rows(root)
    for name in ("train_loss_step", "lr-AdamW", "val_loss", "train_loss_epoch", "test_acc", "epoch"):
        assert _steps(rows, name) == _steps(reference, name), name
