"""The XLA accelerator without torch_xla: device parsing, refusal naming the extra, registration, lazy import.

The real runtime is exercised by tests/xla (its own virtual environment with torch_xla); here torch_xla is absent, or
made to look absent or present with monkeypatch, so these tests run in the main suite.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import phalanx
from phalanx.accelerators import ACCELERATOR_REGISTRY, XLAAccelerator
from phalanx.accelerators import xla as xla_module
from phalanx.accelerators.xla import import_torch_xla, parse_xla_devices
from phalanx.plugins.precision import XLAPrecision
from phalanx.strategies import SingleDeviceXLAStrategy, XLASPMDStrategy, XLAStrategy
from phalanx.strategies.resolve import resolve_strategy


@pytest.fixture
def no_torch_xla(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch_xla looks uninstalled, whatever this environment holds."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch_xla" else real(name, *a))


@pytest.fixture
def fake_xla_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch_xla looks installed with two devices; nothing of it is imported."""
    monkeypatch.setattr(XLAAccelerator, "is_available", staticmethod(lambda: True))
    monkeypatch.setattr(xla_module, "local_device_count", lambda: 2)


# ------------------------------------------------------------------ device parsing (a pure function of the count)
@pytest.mark.parametrize(
    ("devices", "available", "expected"),
    [
        ("auto", 2, 2),
        (-1, 4, 4),
        ("-1", 4, 4),
        (1, 8, 1),
        ("1", 8, 1),
        (8, 8, 8),
        (" 2 ", 2, 2),
        ([3], 8, [3]),
        ((0,), 1, [0]),
        ([1, 0], 2, [0, 1]),
    ],
)
def test_parse_xla_devices(devices: object, available: int, expected: object) -> None:
    assert parse_xla_devices(devices, available) == expected


@pytest.mark.parametrize(
    ("devices", "available", "message"),
    [
        (3, 8, r"devices=3 asks for 3 XLA devices.*has 8\. Pass devices=1, devices=8 or 'auto'.*CPU_NUM_DEVICES"),
        (0, 2, r"devices=0 is not valid: ask for at least one XLA device"),
        (-2, 2, r"devices=-2 is not valid"),
        ([2], 2, r"asks for XLA device index 2.*valid indices are \[0, 1\]"),
        ([0, 0], 2, r"names a device more than once"),
        ([0, 1], 4, r"must name all of them\. Pass one index, devices=4 or 'auto'"),
        ([], 2, r"non-empty list of XLA device indices"),
        ([True], 2, r"non-empty list of XLA device indices"),
        ("two", 2, r"not valid for the XLA accelerator: pass 1, the number of devices \(2 here\), 'auto'"),
        (2.0, 2, r"not valid for the XLA accelerator"),
        (None, 2, r"not valid for the XLA accelerator"),
        (True, 2, r"not valid for the XLA accelerator"),
        ("auto", 0, r"finds no XLA device.*PJRT_DEVICE=CPU"),
    ],
)
def test_parse_xla_devices_refuses_with_the_valid_choices(devices: object, available: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_xla_devices(devices, available)


def test_parallel_devices_are_xla_devices_and_nothing_is_started(fake_xla_host: None) -> None:
    assert XLAAccelerator.get_parallel_devices("auto") == [torch.device("xla", 0), torch.device("xla", 1)]
    assert XLAAccelerator.get_parallel_devices([1]) == [torch.device("xla", 1)]
    assert XLAAccelerator.get_parallel_devices(1) == [torch.device("xla", 0)]
    assert XLAAccelerator.supported_precisions() == ("32-true", "bf16-true", "bf16-mixed")


# ------------------------------------------------------------------ refusal without torch_xla
def test_import_refusal_names_the_extra(no_torch_xla: None) -> None:
    assert not XLAAccelerator.is_available()
    with pytest.raises(ModuleNotFoundError, match=r"torch_xla, which is not installed.*pip install 'phalanx\[xla\]'"):
        import_torch_xla()


def test_a_torch_xla_that_does_not_import_is_explained(monkeypatch: pytest.MonkeyPatch) -> None:
    # Installed (found) but broken, as torch_xla 2.9 is with another torch release.
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.setitem(sys.modules, "torch_xla", None)  # makes `import torch_xla` raise ImportError
    with pytest.raises(ImportError, match=r"does not import with torch .*torch_xla X\.Y works only with torch X\.Y"):
        import_torch_xla()


@pytest.mark.parametrize("accelerator", ["xla", "tpu", "XLA"])
def test_trainer_refuses_xla_without_torch_xla_naming_the_extra(no_torch_xla: None, accelerator: str) -> None:
    with pytest.raises(ValueError, match=r"not available on this machine: torch_xla is not installed.*phalanx\[xla\]"):
        phalanx.Trainer(accelerator=accelerator, devices=1, logger=False)


def test_setting_up_a_strategy_without_torch_xla_names_the_extra(no_torch_xla: None) -> None:
    strategy = SingleDeviceXLAStrategy(accelerator=XLAAccelerator())
    with pytest.raises(ModuleNotFoundError, match=r"phalanx\[xla\]"):
        strategy.setup_environment()


# ------------------------------------------------------------------ registration and strategy="auto"
@pytest.mark.parametrize("name", ["xla", "tpu"])
def test_xla_accelerator_is_registered(name: str) -> None:
    assert ACCELERATOR_REGISTRY.get_class(name) is XLAAccelerator
    assert "torch_xla" in ACCELERATOR_REGISTRY.description(name)


@pytest.mark.parametrize(
    ("accelerator", "devices", "strategy_class", "device_count"),
    [
        ("tpu", 1, SingleDeviceXLAStrategy, 1),
        ("xla", [1], SingleDeviceXLAStrategy, 1),
        ("xla", "auto", XLAStrategy, 2),
        ("tpu", 2, XLAStrategy, 2),
        ("tpu", -1, XLAStrategy, 2),
    ],
)
def test_auto_strategy_is_single_xla_for_one_device_and_xla_for_several(
    fake_xla_host: None, accelerator: str, devices: object, strategy_class: type, device_count: int
) -> None:
    strategy = resolve_strategy(accelerator=accelerator, devices=devices, strategy="auto", precision="bf16-mixed")
    assert type(strategy) is strategy_class
    assert isinstance(strategy.accelerator, XLAAccelerator)
    assert isinstance(strategy.precision_plugin, XLAPrecision) and strategy.precision_plugin.precision == "bf16-mixed"
    if isinstance(strategy, XLAStrategy):
        assert strategy.parallel_devices == [torch.device("xla", i) for i in range(device_count)]
        assert (strategy.world_size, strategy.global_rank) == (2, 0)  # the layout, before any launch
    else:
        assert strategy.root_device == torch.device("xla", 1 if devices == [1] else 0)


def test_spmd_is_one_process_over_every_device(fake_xla_host: None) -> None:
    strategy = resolve_strategy(accelerator="tpu", devices="auto", strategy="xla_spmd")
    assert isinstance(strategy, XLASPMDStrategy) and strategy.parameter_sharding == "fsdp"
    assert strategy.parallel_devices == [torch.device("xla", 0), torch.device("xla", 1)]
    assert (strategy.world_size, strategy.global_rank, strategy.launcher) == (1, 0, None)


def test_trainer_with_the_tpu_accelerator_builds_without_torch_xla(fake_xla_host: None) -> None:
    trainer = phalanx.Trainer(accelerator="tpu", devices=2, logger=False, enable_progress_bar=False)
    assert isinstance(trainer.strategy, XLAStrategy) and trainer.global_rank == 0


@pytest.mark.parametrize(
    "strategy",
    ["ddp", "ddp_spawn", "fsdp", "deepspeed", "single_device", "model_parallel", "DDPStrategy()", "FSDPStrategy()"],
)
@pytest.mark.parametrize("accelerator", ["xla", "tpu"])
def test_strategies_that_do_not_run_on_xla_are_refused_naming_the_xla_ones(
    fake_xla_host: None, accelerator: str, strategy: str
) -> None:
    from phalanx.strategies import DDPStrategy, FSDPStrategy

    given: Any = {"DDPStrategy()": DDPStrategy, "FSDPStrategy()": FSDPStrategy}.get(strategy, lambda: strategy)()
    devices = 1 if strategy == "single_device" else 2
    with pytest.raises(ValueError, match="does not run on XLA devices") as raised:
        phalanx.Trainer(accelerator=accelerator, strategy=given, devices=devices, logger=False)
    for name in ("'single_xla'", "'xla'", "'xla_spmd'", "accelerator='cpu'"):
        assert name in str(raised.value)


@pytest.mark.parametrize(
    ("strategy", "devices", "message"),
    [
        ("xla", [1], r"got indices \[1\].*use strategy='single_xla' \(or 'auto'\) with devices=\[1\]"),
        ("xla_spmd", [1], r"got indices \[1\]"),
        (XLAStrategy, [1, 0], r"devices 0..N-1 in order, got indices \[1, 0\]"),  # an instance given its devices
        (XLAStrategy, [0, 2], r"got indices \[0, 2\]"),
    ],
)
def test_replica_strategies_refuse_device_indices_torch_xla_would_not_use(
    fake_xla_host: None, strategy: Any, devices: list[int], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        if isinstance(strategy, str):
            resolve_strategy(accelerator="xla", devices=devices, strategy=strategy)
        else:
            strategy(parallel_devices=[torch.device("xla", index) for index in devices])


@pytest.mark.parametrize("precision", ["16-mixed", "16-true", "64-true"])
def test_precisions_an_xla_device_cannot_run_are_refused(fake_xla_host: None, precision: str) -> None:
    with pytest.raises(ValueError, match=r"not supported on XLA devices; choose one of \['32-true', 'bf16-true'"):
        resolve_strategy(accelerator="xla", devices=1, precision=precision)


# ------------------------------------------------------------------ import phalanx never imports torch_xla
def test_import_phalanx_and_a_cpu_trainer_never_import_torch_xla(tmp_path: Path) -> None:
    # A stand-in torch_xla that fails loudly if anything imports it (one subprocess: sys.modules is per process).
    (tmp_path / "torch_xla").mkdir()
    (tmp_path / "torch_xla" / "__init__.py").write_text("raise RuntimeError('torch_xla was imported')\n")
    code = textwrap.dedent(
        """
        import sys
        import phalanx
        from phalanx.accelerators import ACCELERATOR_REGISTRY
        from phalanx.strategies import STRATEGY_REGISTRY
        assert {"xla", "tpu"} <= set(ACCELERATOR_REGISTRY.available())
        assert {"single_xla", "xla", "xla_debug", "xla_spmd", "xla_spmd_dp"} <= set(STRATEGY_REGISTRY.available())
        trainer = phalanx.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
        assert "torch_xla" not in sys.modules, sorted(m for m in sys.modules if "xla" in m)
        print("ok")
        """
    )
    root = Path(phalanx.__file__).parent.parent
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={"PYTHONPATH": f"{tmp_path}:{root}", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
