"""The strategy contract's boundaries: strategies never reach the Trainer, and run from any loop with RunSettings alone.

1. No file under phalanx/strategies, phalanx/plugins or phalanx/accelerators imports the Trainer's or the callbacks'
   package at run time, or reads a ``trainer`` / ``_trainer`` attribute (checked on the syntax tree of every file).
2. SingleDeviceStrategy and DDPStrategy (one gloo process) drive a plain ``nn.Module`` through connect,
   setup_environment, setup(RunSettings), backward and optimizer_step: the before-step callback runs once per step,
   clipping applies, and the weights equal those of the same loop written with torch alone.
3. RunSettings refuses bad values, naming the field and the valid choices.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import phalanx
from phalanx.accelerators import CPUAccelerator
from phalanx.plugins.environments import DefaultEnvironment
from phalanx.strategies import DDPStrategy, RunSettings, SingleDeviceStrategy

ROOT = Path(phalanx.__file__).parent
CHECKED = sorted(
    path for package in ("strategies", "plugins", "accelerators") for path in (ROOT / package).rglob("*.py")
)
FORBIDDEN_PACKAGES = ("phalanx.trainer", "phalanx.callbacks")
FORBIDDEN_NAMES = ("trainer", "_trainer")


# ---------------------------------------------------------------------------- 1. no way back to the Trainer
def _is_type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def _forbidden_module(name: str | None) -> bool:
    return name is not None and any(name == package or name.startswith(package + ".") for package in FORBIDDEN_PACKAGES)


def _reaches_by_name(call: ast.Call) -> bool:
    function = call.func
    name = (
        function.id if isinstance(function, ast.Name) else function.attr if isinstance(function, ast.Attribute) else ""
    )
    strings = [arg.value for arg in call.args if isinstance(arg, ast.Constant) and isinstance(arg.value, str)]
    if name in ("getattr", "hasattr", "setattr", "delattr"):
        return any(value in FORBIDDEN_NAMES for value in strings)
    return name in ("import_module", "__import__") and any(_forbidden_module(value) for value in strings)


def violations(source: str) -> list[str]:
    """Run-time imports of the Trainer's or callbacks' package and reads of ``trainer`` / ``_trainer`` in ``source``."""
    found: list[str] = []

    def visit(node: ast.AST, type_checking_only: bool) -> None:
        if isinstance(node, ast.Import) and not type_checking_only:
            found.extend(
                f"line {node.lineno}: import {alias.name}" for alias in node.names if _forbidden_module(alias.name)
            )
        elif isinstance(node, ast.ImportFrom) and not type_checking_only:
            names = (
                [f"{node.module}.{alias.name}" for alias in node.names] if node.module == "phalanx" else [node.module]
            )
            found.extend(
                f"line {node.lineno}: from {node.module} import ..." for name in names if _forbidden_module(name)
            )
        elif isinstance(node, ast.Attribute) and node.attr in FORBIDDEN_NAMES:
            found.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Name) and node.id in FORBIDDEN_NAMES:
            found.append(f"line {node.lineno}: name {node.id}")
        elif isinstance(node, ast.arg) and node.arg in FORBIDDEN_NAMES:
            found.append(f"line {node.lineno}: parameter {node.arg}")
        elif isinstance(node, ast.Call) and _reaches_by_name(node):
            found.append(
                f"line {node.lineno}: {ast.unparse(node)}"
            )  # getattr(x, "_trainer"), import_module("phalanx.trainer")
        for child in ast.iter_child_nodes(node):
            visit(child, type_checking_only or _is_type_checking_block(node))

    visit(ast.parse(source), False)
    return found


@pytest.mark.parametrize("path", CHECKED, ids=lambda path: str(path.relative_to(ROOT)))
def test_no_strategy_plugin_or_accelerator_reaches_the_trainer(path: Path) -> None:
    assert violations(path.read_text()) == []


CHECKER_CASES = [
    # (source, flagged)
    ("from phalanx.trainer.arguments import TrainerSettings", True),
    ("def f():\n    from phalanx.callbacks import ModelCheckpoint", True),
    ("import phalanx.trainer.trainer", True),
    ("from phalanx import trainer", True),
    ("x = module._trainer", True),
    ("x = getattr(module, '_trainer', None)", True),
    ("trainer._before_optimizer_step(optimizer)", True),
    ("def setup(self, trainer): pass", True),
    ("importlib.import_module('phalanx.callbacks.progress')", True),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from phalanx.trainer.trainer import Trainer", False),
    ("from phalanx.trainer_utils import x", False),  # another package that merely starts with the same letters
    ("from phalanx.strategies.settings import RunSettings\n# the Trainer passes RunSettings", False),
    ("state = read_trainer_state(path)", False),  # a function about a checkpoint file's content, not the Trainer
    ("hasattr(obj, 'trainer')", True),
    (
        "if 'trainer' in parameters: raise TypeError('setup(self, trainer) is the old signature')",
        False,
    ),  # naming it is fine
]


@pytest.mark.parametrize(("source", "flagged"), CHECKER_CASES)
def test_the_checker_flags_what_it_must(source: str, flagged: bool) -> None:
    assert bool(violations(source)) is flagged


# ---------------------------------------------------------------------------- 2. driven from a hand-written loop
MAX_NORM = 0.05
STEPS = 3


def _module() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 4, generator=generator), torch.randn(6, 1, generator=generator)) for _ in range(STEPS)]


def _sgd(module: nn.Module) -> tuple[list[torch.optim.Optimizer], list[Any]]:
    return [torch.optim.SGD(module.parameters(), lr=0.5)], []


def _torch_loop() -> nn.Module:
    """The reference: the same steps written with torch alone."""
    module = _module()
    optimizer = _sgd(module)[0][0]
    for x, y in _batches():
        nn.functional.mse_loss(module(x), y).backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
    return module


def _strategy_loop(strategy: Any) -> tuple[nn.Module, list[torch.optim.Optimizer], list[float]]:
    """Connect, set up and train through the strategy's own methods only; return the module, the steps seen and the
    norms."""
    module = _module()
    seen: list[torch.optim.Optimizer] = []
    norms: list[float] = []

    def before_optimizer_step(optimizer: torch.optim.Optimizer) -> None:
        seen.append(optimizer)
        strategy.clip_gradients(strategy.model, optimizer, max_norm=MAX_NORM)
        norms.append(float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in module.parameters()]))))

    strategy.connect(module)
    strategy.setup_environment()
    strategy.setup(RunSettings(stage="fit", configure_optimizers=_sgd, before_optimizer_step=before_optimizer_step))
    optimizer = strategy.optimizers[0]
    for x, y in _batches():

        def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            loss = nn.functional.mse_loss(strategy.model(x), y)
            strategy.backward(loss, optimizer)
            return loss

        strategy.optimizer_step(optimizer, closure)
        optimizer.zero_grad()
    strategy.teardown()
    return module, seen, norms


@pytest.fixture
def one_gloo_process(tmp_path, monkeypatch):
    """A process group of this process alone, through a file store inside tmp_path (no port to race for)."""
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert not torch.distributed.is_initialized(), "another test left a process group behind"
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


def _ddp(strategy_class: type = DDPStrategy) -> DDPStrategy:
    strategy = strategy_class(
        accelerator=CPUAccelerator(), parallel_devices=[torch.device("cpu")], cluster_environment=DefaultEnvironment()
    )
    strategy.record_global_rank()
    return strategy


def _check_loop(strategy: Any) -> None:
    module, seen, norms = _strategy_loop(strategy)
    assert len(seen) == STEPS and all(optimizer is strategy.optimizers[0] for optimizer in seen)  # once per step
    assert all(norm <= MAX_NORM * (1 + 1e-5) for norm in norms)  # clipping applied before each update
    expected = _torch_loop()
    for ours, reference in zip(module.parameters(), expected.parameters()):
        assert torch.equal(ours, reference)


def test_single_device_strategy_runs_a_plain_module_from_a_hand_written_loop() -> None:
    strategy = SingleDeviceStrategy(device="cpu", accelerator=CPUAccelerator())
    _check_loop(strategy)
    assert strategy.model is strategy.module


def test_ddp_strategy_runs_a_plain_module_from_a_hand_written_loop(one_gloo_process) -> None:
    strategy = _ddp()
    module = _module()
    strategy.connect(module)
    strategy.setup_environment()
    strategy.setup(RunSettings(configure_optimizers=_sgd))
    assert isinstance(strategy.model, DistributedDataParallel) and strategy.module is module
    assert strategy.optimizers[0].param_groups[0]["params"][0] is next(module.parameters())
    strategy.teardown()
    _check_loop(_ddp())


class _CustomDDP(DDPStrategy):
    """The documentation's example: a subclass that wraps the module its own way."""

    calls = 0

    def configure_ddp(self) -> None:
        type(self).calls += 1
        self.model = DistributedDataParallel(self.model, gradient_as_bucket_view=True)


def test_a_configure_ddp_override_wraps_the_module(one_gloo_process) -> None:
    strategy = _ddp(_CustomDDP)
    _CustomDDP.calls = 0
    strategy.connect(_module())
    strategy.setup_environment()
    strategy.setup(RunSettings(configure_optimizers=_sgd))
    assert (
        _CustomDDP.calls == 1
        and isinstance(strategy.model, DistributedDataParallel)
        and strategy.model.gradient_as_bucket_view
    )
    strategy.teardown()


@pytest.mark.parametrize("stage", ["validate", "test", "predict"])
def test_evaluation_settings_neither_wrap_nor_make_optimizers(one_gloo_process, stage: str) -> None:
    strategy = _ddp()
    made: list[nn.Module] = []
    strategy.connect(_module())
    strategy.setup_environment()
    strategy.setup(RunSettings(stage=stage, configure_optimizers=lambda module: made.append(module) or _sgd(module)))
    assert made == [] and strategy.optimizers == [] and strategy.model is strategy.module
    assert strategy.run_settings is not None and strategy.run_settings.stage == stage
    strategy.teardown()


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({}, ValueError, r"exactly one of max_norm= \(clip by total norm\) or clip_val= \(clip by value\)"),
        ({"max_norm": 1.0, "clip_val": 1.0}, ValueError, "exactly one of max_norm="),
        ({"max_norm": "1"}, TypeError, r"clip_gradients\(max_norm='1'\) must be a number"),
        ({"clip_val": True}, TypeError, r"clip_gradients\(clip_val=True\) must be a number"),
        ({"max_norm": -1.0}, ValueError, r"clip_gradients\(max_norm=-1.0\) must be >= 0"),
    ],
)
def test_clip_gradients_refuses_bad_arguments(arguments: dict, error: type, message: str) -> None:
    module = nn.Linear(2, 1)
    with pytest.raises(error, match=message):
        SingleDeviceStrategy(device="cpu").clip_gradients(
            module, torch.optim.SGD(module.parameters(), lr=0.1), **arguments
        )


def test_clip_gradients_by_value_and_a_training_module_clipping_itself_without_a_trainer() -> None:
    strategy = SingleDeviceStrategy(device="cpu", accelerator=CPUAccelerator())
    module = phalanx.TrainingModule()
    module.layer = nn.Linear(3, 1)
    with pytest.raises(RuntimeError, match="clip_gradients needs the strategy that runs this module"):
        module.clip_gradients(torch.optim.SGD(module.parameters(), lr=0.1), gradient_clip_val=0.1)
    strategy.connect(module)
    assert "_strategy" not in module.state_dict() and module._strategy is strategy
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    module.layer(torch.full((1, 3), 100.0)).sum().backward()
    module.clip_gradients(optimizer, gradient_clip_val=0.1, gradient_clip_algorithm="value")
    assert float(module.layer.weight.grad.abs().max()) == pytest.approx(0.1)
    assert strategy.clip_gradients(module, optimizer, max_norm=0.01) is not None  # the total norm before clipping


def test_setup_refuses_the_old_trainer_argument_and_a_missing_module() -> None:
    strategy = SingleDeviceStrategy(device="cpu", accelerator=CPUAccelerator())
    with pytest.raises(RuntimeError, match=r"needs a module: call connect\(module\) first"):
        strategy.setup(RunSettings())
    strategy.connect(nn.Linear(1, 1))
    with pytest.raises(TypeError, match=r"takes a phalanx.strategies.RunSettings, got Trainer"):
        strategy.setup(phalanx.Trainer(accelerator="cpu", logger=False))


# ---------------------------------------------------------------------------- 3. RunSettings
def _noop(*args: Any) -> None:
    return None


BAD_SETTINGS: list[tuple[dict[str, Any], type, str]] = [
    (
        {"stage": "train"},
        ValueError,
        r"stage='train'\) is not valid; choose one of \['fit', 'validate', 'test', 'predict'\]",
    ),
    ({"accumulate_grad_batches": 0}, ValueError, r"accumulate_grad_batches=0\) must be an int >= 1"),
    ({"accumulate_grad_batches": 2.0}, ValueError, r"accumulate_grad_batches=2.0\) must be an int >= 1"),
    ({"accumulate_grad_batches": True}, ValueError, r"accumulate_grad_batches=True\) must be an int >= 1"),
    ({"gradient_clip_val": -0.5}, ValueError, r"gradient_clip_val=-0.5\) must be a number >= 0 or None"),
    ({"gradient_clip_val": float("nan")}, ValueError, r"gradient_clip_val=nan\) must be a number >= 0 or None"),
    ({"gradient_clip_val": "1"}, ValueError, r"gradient_clip_val='1'\) must be a number >= 0 or None"),
    (
        {"gradient_clip_algorithm": "l2"},
        ValueError,
        r"gradient_clip_algorithm='l2'\) is not valid; choose 'norm' or 'value'",
    ),
    ({"train_batch_size": 0}, ValueError, r"train_batch_size=0\) must be a positive int or None"),
    ({"configure_optimizers": "adam"}, TypeError, r"configure_optimizers='adam'\) must be a callable or None"),
    ({"before_optimizer_step": 3}, TypeError, r"before_optimizer_step=3\) must be a callable or None"),
]


@pytest.mark.parametrize(("arguments", "error", "message"), BAD_SETTINGS)
def test_run_settings_refuse_bad_values(arguments: dict[str, Any], error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        RunSettings(**arguments)


GOOD_SETTINGS: list[tuple[dict[str, Any], bool]] = [
    ({}, True),
    ({"stage": "validate"}, False),
    ({"stage": "predict", "gradient_clip_val": 0}, False),
    (
        {
            "accumulate_grad_batches": 4,
            "gradient_clip_val": 1.5,
            "gradient_clip_algorithm": "value",
            "train_batch_size": 8,
        },
        True,
    ),
    ({"configure_optimizers": _sgd, "before_optimizer_step": _noop}, True),
]


@pytest.mark.parametrize(("arguments", "fitting"), GOOD_SETTINGS)
def test_run_settings_accept_valid_values_and_stay_frozen(arguments: dict[str, Any], fitting: bool) -> None:
    settings = RunSettings(**arguments)
    assert settings.fitting is fitting
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.stage = "fit"  # type: ignore[misc]
