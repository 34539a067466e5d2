"""What every XLA strategy shares: the graph cut per step, the device-side dataloader, CPU checkpoints."""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any, Callable, ClassVar

import torch
from torch import nn
from torch.optim import Optimizer

from phalanx.accelerators.accelerator import Accelerator
from phalanx.plugins.precision.precision import Precision
from phalanx.plugins.precision.xla import XLAPrecision
from phalanx.strategies.settings import RunSettings
from phalanx.strategies.traits import StrategyTraits
from phalanx.strategies.xla._collectives import cut_graph, launch_turn
from phalanx.utilities.apply import apply_to_tensors


def xla_device(device: Any, strategy: str) -> torch.device:
    """``device`` as an XLA ``torch.device`` (an int is an index); ValueError for anything else."""
    if isinstance(device, int) and not isinstance(device, bool):
        device = torch.device("xla", device)
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"{strategy} got device={device!r}, which is not a torch device: {error}") from None
    if parsed.type != "xla":
        raise ValueError(
            f"{strategy} runs on XLA devices, got device={device!r}. Pass an XLA device ('xla', 'xla:0' or an index),"
            " or use a strategy for this device type."
        )
    return parsed if parsed.index is not None else torch.device("xla", 0)


def holds_xla_tensors(data: Any) -> bool:
    """Whether ``data`` (nested containers) holds a tensor on an XLA device."""
    found: list[bool] = []
    apply_to_tensors(data, lambda t: found.append(t.device.type == "xla"))
    return any(found)


def to_cpu(data: Any) -> Any:
    """``data`` with every XLA tensor copied to the CPU (plain tensors: a checkpoint loads with weights_only=True)."""
    return apply_to_tensors(data, lambda t: t.detach().cpu() if t.device.type == "xla" else t)


class DeviceLoader:
    """Iterates a dataloader through torch_xla's ParallelLoader, which moves batches to ``device`` in the background.

    Every other attribute (``sampler``, ``batch_sampler``, ``dataset``, ``batch_size``) is the wrapped loader's, so
    the driver still finds the sampler to set its epoch. The CPU iterator is created in the calling thread, so a
    shuffling sampler draws its seed there, in the same order as without the wrapper.
    """

    def __init__(self, loader: Any, device: torch.device) -> None:
        self.dataloader = loader  # the wrapped one: drivers that need the DataLoader itself find it here
        self.device = device
        self._parallel: Any = None

    def __iter__(self) -> Any:
        import torch_xla.distributed.parallel_loader as pl

        self.close()
        self._parallel = pl.ParallelLoader(iter(self.dataloader), [self.device])
        return self._parallel.per_device_loader(self.device)

    def __len__(self) -> int:
        return len(self.dataloader)

    def close(self) -> None:
        """Stop the background threads of the last iteration."""
        if self._parallel is not None:
            self._parallel.close()
            self._parallel = None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or "dataloader" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["dataloader"], name)

    def __getstate__(self) -> dict[str, Any]:
        return {"dataloader": self.dataloader, "device": self.device, "_parallel": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


def refuse_compile(strategy: object, settings: RunSettings) -> None:
    """Refuse ``compile``: torch_xla traces and compiles each step into one XLA graph already (see docs/compile.md)."""
    if settings.compile is not None:
        raise ValueError(
            f"{type(strategy).__name__} does not run torch.compile: torch_xla traces and compiles every step into one"
            " XLA graph already. Drop compile=... from the Trainer or Cohort, and pass the plain model, not"
            " torch.compile(model)."
        )


class XLAStrategyMixin:
    """Steps end with a graph cut; dataloaders feed the device; checkpoints are written from CPU copies."""

    precision_plugin_type: type[Precision] = XLAPrecision
    #: The XLA accelerator runs only this family (``XLAAccelerator.strategy_family``).
    family: ClassVar[str | None] = "xla"

    @classmethod
    def precision_plugin_for(cls, precision: str, accelerator: Accelerator) -> XLAPrecision:
        """The XLA precision plugin for ``precision`` ('32-true', 'bf16-true', 'bf16-mixed')."""
        return XLAPrecision(precision)

    def check_setup(self, settings: RunSettings) -> None:
        """Refuse ``compile`` (see :func:`refuse_compile`)."""
        refuse_compile(self, settings)
        super().check_setup(settings)  # type: ignore[misc]

    def declare_traits(self) -> StrategyTraits:
        """No inference mode: torch_xla cannot run a module under it (its tensors lack version counters); as in
        Lightning, evaluation on XLA runs under no_grad."""
        return replace(super().declare_traits(), allows_inference_mode=False)  # type: ignore[misc]

    def optimizer_step(
        self, optimizer: Optimizer, closure: Callable[[], Any], model: nn.Module | None = None, **kwargs: Any
    ) -> Any:
        """Step as usual, then cut the graph: the step (and its gradient all-reduce) compiles and runs once."""
        result = super().optimizer_step(optimizer, closure, model, **kwargs)  # type: ignore[misc]
        cut_graph()
        return result

    def process_dataloader(self, dataloader: Any) -> Any:
        """Wrap ``dataloader`` so that batches arrive on this replica's device."""
        if isinstance(dataloader, DeviceLoader):
            return dataloader
        wrapped = DeviceLoader(dataloader, self.root_device)  # type: ignore[attr-defined]
        self.__dict__.setdefault("_device_loaders", []).append(wrapped)
        return wrapped

    def teardown(self) -> None:
        """Stop the dataloaders' background threads (a later iteration starts new ones), then tear down as usual."""
        for loader in self.__dict__.pop("_device_loaders", []):
            loader.close()
        super().teardown()  # type: ignore[misc]

    def host_reads(self) -> AbstractContextManager:
        """Replica threads of one process take turns: each read compiles and runs a graph, and XLA:CPU crashed
        (segmentation fault, twice in our runs) when two replicas did so at once outside the step's graph cut."""
        return launch_turn()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Finish pending work (every replica), then write CPU copies of the tensors on global rank 0."""
        if holds_xla_tensors(checkpoint):
            # Only then: after a multi-device fit, the launching process holds CPU weights and must not start the
            # XLA runtime (torch_xla's launcher refuses to start once it runs). The generator state this checkpoint
            # holds is the one before this cut: the cut leaves it there.
            cut_graph(keep_generator=True)
        if self.is_global_zero:  # type: ignore[attr-defined]
            self.checkpoint_io.save_checkpoint(  # type: ignore[attr-defined]
                to_cpu(checkpoint), filepath, storage_options=storage_options
            )


class XLAParallelDevices:
    """``parallel_devices`` that must be XLA devices (for the strategies that span several)."""

    @property
    def parallel_devices(self) -> list[torch.device] | None:
        """One XLA device per replica (or per mesh position) on this host."""
        return self._parallel_devices

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        wrong = [device for device in devices or [] if torch.device(device).type != "xla"]
        if wrong:
            raise ValueError(
                f"{type(self).__name__} runs on XLA devices, got {wrong[0]}: pass accelerator='xla' (or 'tpu'), or use"
                " 'ddp' for CPU or CUDA devices."
            )
        devices = [torch.device(device) for device in devices] if devices is not None else None
        indices = [device.index or 0 for device in devices or []]
        if indices != list(range(len(indices))):
            # torch_xla's launcher gives replica i the device of ordinal i: other indices would silently be others.
            alone = (
                f" To train on device {indices[0]} alone, use strategy='single_xla' (or 'auto') with devices={indices}."
            )
            single = alone if len(indices) == 1 else ""
            raise ValueError(
                f"{type(self).__name__} runs its replicas on the host's XLA devices 0..N-1 in order, got indices"
                f" {indices}: pass devices=N or 'auto'.{single}"
            )
        self._parallel_devices = devices
