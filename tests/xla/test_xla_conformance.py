"""The conformance kit (phalanx.testing) against single_xla, and ``phalanx demo --accelerator xla``, on the PJRT CPU
runtime. ("xla" is not run through the kit: the kit starts its own CPU processes with gloo, while "xla" starts its
replicas through torch_xla's launcher; tests/xla/test_xla_strategy.py covers its collectives and checkpoints.)"""

from __future__ import annotations

import os
import subprocess
import sys
from functools import partial
from pathlib import Path

from xla_helpers import ROOT

from phalanx.accelerators.xla import XLAAccelerator
from phalanx.strategies import SingleDeviceXLAStrategy
from phalanx.testing import CHECKS_BY_DRIVER, run_conformance


def test_single_xla_passes_the_conformance_kit(tmp_path: Path) -> None:
    make = partial(SingleDeviceXLAStrategy, accelerator=XLAAccelerator())
    report = run_conformance(make, processes=1, timeout=300, workdir=tmp_path)
    assert [result.name for result in report.failures] == [], report.describe_failures()
    # Both drivers (the Trainer with its defaults, a Cohort loop) ran every check of theirs; one process has no
    # gradient synchronisation to skip, through either.
    skipped = {key for key, result in report.results.items() if result.status == "skipped"}
    assert skipped == {("trainer", "no_sync"), ("cohort", "no_sync")}, report.summary()
    assert list(report.results) == [(driver, check) for driver, checks in CHECKS_BY_DRIVER.items() for check in checks]


def test_the_demo_trains_on_an_xla_device(tmp_path: Path) -> None:
    command = [sys.executable, "-c", "import sys; from phalanx.cli import main; sys.exit(main())", "demo"]
    options = ["--accelerator", "xla", "--max-steps", "30", "--no-progress-bar", "--default-root-dir", str(tmp_path)]
    environment = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1"}
    environment["PYTHONPATH"] = os.pathsep.join([str(ROOT), environment.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    done = subprocess.run(
        command + options, cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "--- sample ---" in done.stdout and "step 30: val_loss" in done.stdout
    losses = [float(line.split()[-1]) for line in done.stdout.splitlines() if line.startswith("step ")]
    assert losses[-1] < losses[0]  # it learned
