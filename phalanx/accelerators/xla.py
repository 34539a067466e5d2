"""The XLA accelerator: TPUs (and torch_xla's PJRT CPU runtime) through torch_xla.

torch_xla is imported only when an XLA object needs it, never by ``import phalanx``. Counting devices never starts
the XLA runtime: torch_xla's launcher refuses to start once the runtime runs in the launching process.
"""

from __future__ import annotations

import importlib.util
import os
import threading
from types import ModuleType
from typing import Any

import torch

from phalanx.accelerators.accelerator import Accelerator
from phalanx.utilities.registry import Registry

#: What to install when torch_xla is missing (the extra pins the torch release torch_xla was built against).
INSTALL_HINT = (
    "install the XLA extra in its own virtual environment with pip install 'phalanx[xla]', which pairs torch_xla 2.9"
    " with torch 2.9 (torch_xla imports only with the torch release it was built for)"
)

#: The precisions an XLA device runs (float16 has no fast path there; float64 is emulated on TPUs).
XLA_PRECISIONS = ("32-true", "bf16-true", "bf16-mixed")


def torch_xla_installed() -> bool:
    """Whether torch_xla can be found (without importing it)."""
    return importlib.util.find_spec("torch_xla") is not None


def import_torch_xla() -> ModuleType:
    """Import torch_xla, or raise a ModuleNotFoundError/ImportError that says what to install."""
    if not torch_xla_installed():
        raise ModuleNotFoundError(f"The XLA accelerator needs torch_xla, which is not installed: {INSTALL_HINT}.")
    try:
        import torch_xla
    except ImportError as error:
        raise ImportError(
            f"torch_xla is installed but does not import with torch {torch.__version__} ({error}). torch_xla X.Y works"
            f" only with torch X.Y: {INSTALL_HINT}."
        ) from error
    return torch_xla


def device_type() -> str:
    """The PJRT device type torch_xla will use ('TPU', 'CPU', ...): ``PJRT_DEVICE``, or torch_xla's own choice."""
    import_torch_xla()  # importing torch_xla picks a default PJRT_DEVICE when none is set
    import torch_xla.runtime as xr

    return (xr.device_type() or "CPU").upper()


def _positive_env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"The environment variable {name}={value!r} must be a positive integer (a device count).")
    return int(value)


def local_device_count() -> int:
    """How many XLA devices this host has, without starting the XLA runtime."""
    kind = device_type()
    if kind == "CPU":
        # The PJRT CPU client makes CPU_NUM_DEVICES devices (1 when unset).
        return _positive_env_int("CPU_NUM_DEVICES", 1)
    if kind == "TPU":
        from torch_xla._internal import tpu  # the PCI scan torch_xla's launcher itself uses; starts no runtime

        return tpu.num_available_devices()
    import torch_xla.runtime as xr

    # Other PJRT plugins (CUDA, NEURON) can only be asked through the runtime.
    return xr.addressable_runtime_device_count()


def _parse_index_list(devices: list[Any] | tuple[Any, ...], available: int) -> list[int]:
    if not devices or not all(isinstance(i, int) and not isinstance(i, bool) for i in devices):
        raise ValueError(f"devices={devices!r}: a list of devices must be a non-empty list of XLA device indices.")
    if len(set(devices)) != len(devices):
        raise ValueError(f"devices={devices!r} names a device more than once.")
    bad = [i for i in devices if not 0 <= i < available]
    if bad:
        raise ValueError(
            f"devices={devices!r} asks for XLA device index {bad[0]}, but this host has {available} XLA device(s):"
            f" valid indices are {list(range(available))}."
        )
    if len(devices) > 1 and sorted(devices) != list(range(available)):
        raise ValueError(
            f"devices={devices!r}: torch_xla runs one replica on every device the runtime sees ({available} here), so"
            f" a list of several devices must name all of them. Pass one index, devices={available} or 'auto', or"
            " make fewer devices visible (CPU_NUM_DEVICES on the CPU runtime, TPU_VISIBLE_CHIPS on a TPU host)."
        )
    return sorted(devices)


def parse_xla_devices(devices: Any, available: int) -> int | list[int]:
    """Validate ``devices`` against ``available`` XLA devices: a count (1 or all), 'auto'/-1, or a list of indices."""
    if available < 1:
        raise ValueError(
            f"devices={devices!r}: torch_xla finds no XLA device on this host. On a TPU VM check that libtpu is"
            " installed; to run on the CPU set PJRT_DEVICE=CPU (and CPU_NUM_DEVICES for several devices)."
        )
    if devices == "auto":
        return available
    if isinstance(devices, (list, tuple)):
        return _parse_index_list(devices, available)
    if isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
        devices = int(devices.strip())
    if isinstance(devices, bool) or not isinstance(devices, int):
        raise ValueError(
            f"devices={devices!r} is not valid for the XLA accelerator: pass 1, the number of devices ({available}"
            " here), 'auto', -1, or a list of device indices."
        )
    if devices == -1:
        return available
    if devices < 1:
        raise ValueError(f"devices={devices!r} is not valid: ask for at least one XLA device (or -1/'auto').")
    if devices not in (1, available):
        raise ValueError(
            f"devices={devices} asks for {devices} XLA devices, but torch_xla runs one replica on every device the"
            f" runtime sees, and this host has {available}. Pass devices=1, devices={available} or 'auto', or make"
            " fewer devices visible (CPU_NUM_DEVICES on the CPU runtime, TPU_VISIBLE_CHIPS on a TPU host)."
        )
    return devices


# Per thread (replicas may be threads of one process): the switch that turned autograd's device threads off, if any.
_backward_switch = threading.local()
# The engine's answer, asked once per process: its queues, once sized, stay as they are.
_engine_answer: list[bool] = []


def engine_lacks_xla_queues(device: torch.device) -> bool:
    """Whether PyTorch's autograd engine started before torch_xla registered its devices.

    The engine sizes its per-device queues once per process, at the first backward pass, from the device types
    registered then: after a backward pass that ran before torch_xla was imported (on the CPU or a GPU), it holds no
    queue for XLA devices and every XLA backward pass trips its internal assert on ``device_ready_queues_``. Nothing
    public tells which happened, so a backward pass through one zero-dimensional lazy tensor asks the engine itself
    (it traces a few nodes; nothing compiles or runs).
    """
    if _engine_answer:
        return _engine_answer[0]
    probe = torch.zeros((), device=device, requires_grad=True)
    try:
        with torch.inference_mode(False), torch.enable_grad(), torch.autograd.set_multithreading_enabled(True):
            torch.autograd.grad(probe * 1.0, probe)
    except RuntimeError as error:
        if "device_ready_queues_" not in str(error):
            raise
        _engine_answer.append(True)
    else:
        _engine_answer.append(False)
    return _engine_answer[0]


def _replica_threads() -> bool:
    import torch_xla.runtime as xr

    return xr.addressable_device_count() > 1 and xr.world_size() > 1


class XLAAccelerator(Accelerator):
    """TPUs (or the PJRT CPU runtime) through torch_xla; ``devices`` is 1, every device ('auto'), or indices."""

    name = "xla"
    strategy_family = "xla"

    def setup_device(self, device: torch.device) -> None:
        """Make ``device`` this thread's default XLA device (starts the runtime when it is not running)."""
        if device.type != "xla":
            raise ValueError(f"XLAAccelerator got a non-XLA device: {device}")
        torch_xla = import_torch_xla()
        torch_xla.device(device.index)
        seed = os.environ.get("PHALANX_GLOBAL_SEED")
        if seed is not None:  # seed_everything's seed, as for torch's generators (torch.manual_seed leaves XLA's alone)
            import torch_xla.core.xla_model as xm

            xm.set_rng_state(int(seed), device=str(device))
        if _replica_threads():
            # Not probed there: the probe on the first replica thread left its graphs unlike the other thread's, and
            # their first collective then waited for each other until XLA aborted (2 of 4 runs of the tier's replica
            # scenario). So replica threads after a backward pass run before torch_xla stay unsupported (README).
            return
        if getattr(_backward_switch, "switch", None) is None and engine_lacks_xla_queues(device):
            # Backward passes of this thread then run in the thread itself, as they do on the CPU: they work, with the
            # same results, where the engine has no XLA queue. Given back at teardown.
            _backward_switch.switch = torch.autograd.set_multithreading_enabled(False)

    def teardown(self) -> None:
        """Give this thread back the autograd setting ``setup_device`` changed, if it changed it."""
        switch = getattr(_backward_switch, "switch", None)
        if switch is not None:
            _backward_switch.switch = None
            switch.__exit__(None, None, None)

    def get_device_stats(self, device: torch.device) -> dict[str, Any]:
        """Memory use as torch_xla reports it (empty where the runtime does not implement it, e.g. on the CPU)."""
        import_torch_xla()
        import torch_xla.core.xla_model as xm

        try:
            info = xm.get_memory_info(device)
        except (RuntimeError, NotImplementedError):
            return {}
        return {key: info[key] for key in ("bytes_used", "bytes_limit", "peak_bytes_used") if key in info}

    @staticmethod
    def parse_devices(devices: Any) -> int | list[int]:
        """Return a device count (1 or all) or a list of indices for ``devices``."""
        return parse_xla_devices(devices, XLAAccelerator.auto_device_count())

    @staticmethod
    def get_parallel_devices(devices: Any) -> list[torch.device]:
        """Return one ``xla:i`` device per replica (``torch.device`` objects; nothing is started)."""
        parsed = XLAAccelerator.parse_devices(devices)
        indices = parsed if isinstance(parsed, list) else list(range(parsed))
        return [torch.device("xla", i) for i in indices]

    @staticmethod
    def auto_device_count() -> int:
        """The number of XLA devices on this host (on the CPU runtime: ``CPU_NUM_DEVICES``, default 1)."""
        return local_device_count()

    @staticmethod
    def is_available() -> bool:
        """Whether torch_xla is installed (checked without importing it)."""
        return torch_xla_installed()

    @classmethod
    def unavailable_hint(cls) -> str:
        """Why XLA cannot be used here, and what to install."""
        return f": torch_xla is not installed; {INSTALL_HINT}"

    @classmethod
    def auto_strategy(cls, process_count: int) -> str:
        """'single_xla' for one device, 'xla' (one replica per device) for several."""
        return "xla" if process_count > 1 else "single_xla"

    @classmethod
    def supported_precisions(cls) -> tuple[str, ...]:
        """float32, bfloat16 weights, or bfloat16 autocast."""
        return XLA_PRECISIONS

    @classmethod
    def register_accelerators(cls, registry: Registry[Accelerator]) -> None:
        """Register as "xla" and "tpu"."""
        registry.register("xla", cls, description="XLA devices (TPU, or the PJRT CPU runtime) through torch_xla.")
        registry.register("tpu", cls, description="TPUs through torch_xla (the same accelerator as 'xla').")
