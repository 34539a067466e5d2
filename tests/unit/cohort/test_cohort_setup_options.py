"""Fabric's ``setup`` options on a Cohort: ``move_to_device=`` and ``setup(module)`` without an optimizer where the
strategy needs both (DeepSpeed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import phalanx
from phalanx.cohort import CohortModule
from phalanx.strategies import SingleDeviceStrategy
from phalanx.strategies.traits import StrategyTraits

ROOT = Path(__file__).resolve().parents[3]
LAUNCH_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")


class _OneEngineStrategy(SingleDeviceStrategy):
    """Like DeepSpeed: sets up the module together with its optimizers."""

    def declare_traits(self) -> StrategyTraits:
        return replace(super().declare_traits(), wraps_module_with_optimizers=True)


class _ElsewhereStrategy(SingleDeviceStrategy):
    """Runs on another device than the module's (only the placement check looks at it here)."""

    @property
    def root_device(self) -> torch.device:
        return torch.device("cuda", 0)


def _strategy(name: str) -> Any:
    cpu = torch.device("cpu")
    if name == "deepspeed_stage_2":
        pytest.importorskip("deepspeed")
        from phalanx.strategies import DeepSpeedStrategy

        return DeepSpeedStrategy(stage=2, parallel_devices=[cpu])
    return {"one engine": _OneEngineStrategy, "single_device": SingleDeviceStrategy}[name](device=cpu)


@pytest.mark.parametrize(
    ("strategy", "refused"), [("one engine", True), ("deepspeed_stage_2", True), ("single_device", False)]
)
def test_setup_without_an_optimizer_says_what_to_pass_where_the_strategy_needs_both(strategy, refused):
    cohort = phalanx.Cohort(accelerator="cpu", strategy=_strategy(strategy))
    module = nn.Linear(2, 1)
    if not refused:
        assert isinstance(cohort.setup(module), CohortModule)
        return
    with pytest.raises(ValueError, match=r"was given no optimizer, but \w+ builds one engine") as error:
        cohort.setup(module)
    assert "Pass the optimizer too: model, optimizer = cohort.setup(module, optimizer)." in str(error.value)


@pytest.mark.parametrize("method", ["setup", "setup_module"])
@pytest.mark.parametrize(
    ("strategy", "module_device", "move_to_device", "refused"),
    [
        ("single_device", "cpu", True, False),
        ("single_device", "cpu", False, False),  # already where the strategy places it: nothing moves
        ("elsewhere", "cpu", False, True),  # the strategy would move it: refused rather than ignored
    ],
)
def test_move_to_device_false_is_taken_where_nothing_moves(method, strategy, module_device, move_to_device, refused):
    kind = _ElsewhereStrategy if strategy == "elsewhere" else SingleDeviceStrategy
    cohort = phalanx.Cohort(accelerator="cpu", strategy=kind(device=torch.device("cpu")))
    module = nn.Linear(2, 1, device=module_device)
    optimizers = (torch.optim.SGD(module.parameters(), lr=0.1),) if method == "setup" else ()
    if refused:
        with pytest.raises(ValueError, match=rf"Cohort.{method}\(move_to_device=False\): the module has tensors on"):
            getattr(cohort, method)(module, *optimizers, move_to_device=move_to_device)
        return
    set_up = getattr(cohort, method)(module, *optimizers, move_to_device=move_to_device)
    model = set_up[0] if method == "setup" else set_up
    assert {p.device.type for p in model.parameters()} == {module_device}


@pytest.mark.parametrize("value", [None, 0, "no"])
def test_move_to_device_takes_true_or_false(value):
    cohort = phalanx.Cohort(accelerator="cpu", strategy="single_device")
    with pytest.raises(TypeError, match=rf"Cohort.setup\(move_to_device={value!r}\) must be True or False"):
        cohort.setup(nn.Linear(2, 1), move_to_device=value)


ADAM_SECTION = {"optimizer": {"type": "Adam", "params": {"lr": 0.5, "torch_adam": True}}}
STEP_SCHEDULER = {"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.05, "warmup_num_steps": 2}}}

# Cohorts on DeepSpeed in a process of their own (DeepSpeed keeps its process groups in module state, which a test
# process could not hand on clean), one per config in turn: one process, so that DeepSpeed is imported and its
# process group started once for every case. Prints one line per config: "refused: <message>" or "stepped: <whether
# the weights moved>".
_SETUPS = """
import json, sys, warnings
import torch
from torch import nn
import phalanx
from phalanx.strategies import DeepSpeedStrategy

warnings.filterwarnings("ignore")
for sections in json.loads(sys.argv[1]):
    config = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 1, **sections}
    strategy = DeepSpeedStrategy(config=config, parallel_devices=[torch.device("cpu")])
    cohort = phalanx.Cohort(accelerator="cpu", strategy=strategy)
    cohort.launch()
    module = nn.Linear(2, 1)
    try:
        model, optimizer = cohort.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    except ValueError as error:
        print("refused:", error, flush=True)
        continue
    before = module.weight.detach().clone()
    cohort.backward(model(torch.ones(1, 2)).sum())
    optimizer.step()
    print("stepped:", not torch.equal(module.weight.detach(), before), flush=True)
"""

#: Each config's sections, by name, and what cohort.setup must do under it.
CASES = {
    "optimizer section": (ADAM_SECTION, "refused"),
    "optimizer and scheduler sections": ({**ADAM_SECTION, **STEP_SCHEDULER}, "refused"),
    "scheduler section": (STEP_SCHEDULER, "stepped: True"),
    "neither": ({}, "stepped: True"),
}


def test_an_optimizer_passed_with_a_deepspeed_config_that_names_one_is_refused_not_dropped(tmp_path):
    """DeepSpeed would build the config's optimizer and never step the one a Fabric user passed. One test runs the
    whole table in one process (a test per case would start DeepSpeed once per case, or per xdist worker)."""
    pytest.importorskip("deepspeed")
    environment = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    environment["PYTHONPATH"] = os.pathsep.join([str(ROOT), environment.get("PYTHONPATH", "")])
    script = tmp_path / "setups.py"  # a file: the launcher re-runs a script, never `python -c`
    script.write_text(_SETUPS)
    finished = subprocess.run(
        [sys.executable, str(script), json.dumps([sections for sections, _ in CASES.values()])],
        capture_output=True,
        text=True,
        env=environment,
        cwd=ROOT,
        timeout=900,  # a hang bound: the first DeepSpeed run on a machine compiles its shared-memory op (minutes)
    )
    assert finished.returncode == 0, finished.stderr[-3000:]
    lines = [line for line in finished.stdout.splitlines() if line.startswith(("refused:", "stepped:"))]
    assert len(lines) == len(CASES), finished.stdout[-3000:]
    for (name, (_, outcome)), line in zip(CASES.items(), lines):
        assert line.startswith(outcome), f"{name}: {line}"
        if outcome == "refused":
            assert "the DeepSpeed config has an 'optimizer' section too" in line, name
            assert "Remove the 'optimizer' section from the config" in line, name
