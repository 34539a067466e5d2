"""The set-up skeleton every strategy shares: one fixed order of named steps that subclasses override."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from torch import nn

from phalanx.strategies.settings import RunSettings, check_run_settings

if TYPE_CHECKING:
    from phalanx.strategies.strategy import Strategy


class SetupSteps:
    """The ``setup(settings)`` of :class:`~phalanx.strategies.Strategy` and the steps it calls, in this order:

    ``check_setup`` -> ``prepare_module`` -> ``place_module`` -> ``wrap_module_and_optimizers`` (``wrap_module``, then
    ``setup_optimizers`` when fitting) -> ``setup_precision_plugin`` -> ``finish_setup``.
    """

    def setup(self: Strategy, settings: RunSettings) -> None:
        """Set the module up for a run in the fixed order of the steps; strategies override the steps, not this."""
        self.check_setup(settings)
        self._start_setup(settings)
        assert self._module is not None
        self._module = self.prepare_module(self._module, settings)
        self._model = self._module
        self.place_module(settings)
        self.wrap_module_and_optimizers(settings)
        self.setup_precision_plugin()
        self.finish_setup(settings)

    def _start_setup(self: Strategy, settings: RunSettings) -> None:
        # Checks that no step may skip: the arguments, the composed parts; then the accelerator prepares.
        check_run_settings(type(self).__name__, settings)
        if self.accelerator is None:
            raise RuntimeError(
                f"{type(self).__name__} has no accelerator: give it one (accelerator=...) before setup()."
            )
        if self._module is None:
            raise RuntimeError(f"{type(self).__name__}.setup() needs a module: call connect(module) first.")
        self._run_settings = settings
        self.accelerator.setup()

    def _begin_setup(self: Strategy, settings: RunSettings) -> None:
        """Deprecated: strategies no longer override ``setup``; override its steps (see docs/adding-a-strategy.md)."""
        warnings.warn(
            f"{type(self).__name__} calls Strategy._begin_setup, deprecated and removed in the next release. "
            "Do not override setup(): override its steps instead"
            " (check_setup, prepare_module, place_module, wrap_module, wrap_module_and_optimizers, finish_setup).",
            DeprecationWarning,
            stacklevel=2,
        )
        self._start_setup(settings)

    def check_setup(self: Strategy, settings: RunSettings) -> None:
        """Step 0, before anything changes: refuse settings or options this strategy cannot run (nothing by default)."""

    def prepare_module(self: Strategy, module: nn.Module, settings: RunSettings) -> nn.Module:
        """Step 1, before placement: convert the module (precision, layer sync, sharding); returns the module to use."""
        return self.precision_plugin.convert_module(module)

    def place_module(self: Strategy, settings: RunSettings) -> None:
        """Step 2: put the module on its device (``model_to_device`` by default)."""
        self.model_to_device()

    def wrap_module_and_optimizers(self: Strategy, settings: RunSettings) -> None:
        """Step 3: ``wrap_module``, then the optimizers when fitting (override both where one engine needs both)."""
        assert self._module is not None
        self._model = self.wrap_module(self._module, settings)
        if settings.fitting:
            self.setup_optimizers(settings)

    def wrap_module(self: Strategy, module: nn.Module, settings: RunSettings) -> nn.Module:
        """The module that the steps run through (a wrapper such as DistributedDataParallel); ``module`` by default."""
        return module

    def setup_optimizers(self: Strategy, settings: RunSettings) -> None:
        """Create the optimizers and LR scheduler configs with ``settings.configure_optimizers`` (none without it)."""
        factory = settings.configure_optimizers
        if factory is None:
            return
        assert self._module is not None
        self.optimizers, self.lr_scheduler_configs = factory(self._module)

    def setup_precision_plugin(self: Strategy) -> None:
        """Step 4: let the precision plugin wrap the model, optimizers and schedulers."""
        model, optimizers, _ = self.precision_plugin.connect(self.model, self.optimizers, self.lr_scheduler_configs)
        self._model = model
        self.optimizers = optimizers

    def finish_setup(self: Strategy, settings: RunSettings) -> None:
        """Step 5, last: anything that needs the finished set-up (e.g. joining a swarm with the optimizers)."""
