"""BaseFinetuning and BackboneFinetuning: freeze part of a model, then unfreeze it into a new parameter group."""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Iterable
from typing import TYPE_CHECKING, Any, Union

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.optim import Optimizer

from phalanx.callbacks.callback import Callback
from phalanx.utilities.exceptions import MisconfigurationError
from phalanx.utilities.rank_zero import rank_zero_warn

if TYPE_CHECKING:
    from phalanx.module import TrainingModule
    from phalanx.trainer.trainer import Trainer

log = logging.getLogger(__name__)

#: A module, or an iterable of modules (nested iterables allowed), as the static helpers take them.
Modules = Union[nn.Module, Iterable[Any]]


def multiplicative(epoch: int) -> float:
    """BackboneFinetuning's default ``lambda_func``: the backbone's learning rate doubles every epoch."""
    return 2.0


class BaseFinetuning(Callback):
    """Base class of finetuning callbacks: freeze modules before training, unfreeze them later into a new parameter
    group of the optimizer (Lightning's ``BaseFinetuning``).

    Override :meth:`freeze_before_training` (called in ``setup``, before ``configure_optimizers``: build the optimizer
    from the parameters that require grad) and :meth:`finetune_function` (called at the start of every epoch with each
    optimizer; unfreeze there with :meth:`unfreeze_and_add_param_group`).

    Checkpoints keep the parameter groups it added, by parameter name, and which parameters and batch-norm layers are
    frozen: a resumed run rebuilds the groups in ``on_fit_start``, before the Trainer loads the optimizer state that
    holds them, and freezes exactly what was frozen when the checkpoint was saved (Lightning leaves the parameters
    frozen by ``freeze_before_training`` frozen after a resume, unfrozen ones included). Refused with a strategy whose
    optimizer lives inside an engine (DeepSpeed), which takes no new parameter group, and on more than one process,
    where DistributedDataParallel would not average the gradients of what is unfrozen after it wrapped the module.
    """

    def __init__(self) -> None:
        self._internal_optimizer_metadata: dict[int, list[dict[str, Any]]] = {}
        self._restarting = False
        self._frozen: dict[str, list[str]] | None = None  # restored: what was frozen when the checkpoint was saved
        self._module: TrainingModule | None = None

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"internal_optimizer_metadata": self._internal_optimizer_metadata}
        if self._module is not None:
            state["frozen"] = _frozen_names(self._module)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restarting = True
        self._internal_optimizer_metadata = state_dict["internal_optimizer_metadata"]
        self._frozen = state_dict.get("frozen")

    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        self._module = module
        self.freeze_before_training(module)
        strategy = trainer.strategy
        if strategy.traits.wraps_module_with_optimizers:
            raise NotImplementedError(
                f"{type(self).__name__} adds parameter groups to the optimizer, which {type(strategy).__name__} keeps"
                " inside its engine; choose another strategy or remove the callback."
            )
        if stage == "fit" and trainer.world_size > 1:
            # DistributedDataParallel registers its gradient hooks for the parameters that require grad when it wraps
            # the module: the gradients of those unfrozen later are never averaged, and each process trains its own.
            raise NotImplementedError(
                f"{type(self).__name__} unfreezes parameters during fit, whose gradients {type(strategy).__name__} on"
                f" {trainer.world_size} processes would not average across them (Lightning's processes silently"
                " diverge there); train on one device, or unfreeze before fit and set the learning rates instead."
            )

    def on_fit_start(self, trainer: Trainer, module: TrainingModule) -> None:
        if not self._restarting:
            return
        # The optimizer state the Trainer loads next holds the groups this callback added: rebuild them first.
        named_parameters = dict(module.named_parameters())
        for index, optimizer in enumerate(trainer.optimizers):
            if index in self._internal_optimizer_metadata:
                groups = self._internal_optimizer_metadata[index]
                optimizer.param_groups = self._apply_mapping_to_param_groups(groups, named_parameters)
        if self._frozen is not None:
            _restore_frozen(module, self._frozen)
        self._restarting = False

    def on_train_epoch_start(self, trainer: Trainer, module: TrainingModule) -> None:
        for index, optimizer in enumerate(trainer.optimizers):
            num_param_groups = len(optimizer.param_groups)
            self.finetune_function(module, trainer.current_epoch, optimizer)
            self._store(module, index, num_param_groups, optimizer.param_groups)

    def finetune_function(self, module: TrainingModule, epoch: int, optimizer: Optimizer) -> None:
        """Override: unfreeze what ``epoch`` trains (called at the start of every epoch, once per optimizer)."""
        raise NotImplementedError(f"{type(self).__name__} must define finetune_function(module, epoch, optimizer).")

    def freeze_before_training(self, module: TrainingModule) -> None:
        """Override: freeze what the first epochs do not train (called in ``setup``)."""
        raise NotImplementedError(f"{type(self).__name__} must define freeze_before_training(module).")

    # ------------------------------------------------------------------ helpers for subclasses
    @staticmethod
    def flatten_modules(modules: Modules) -> list[nn.Module]:
        """The leaf modules of ``modules``, and the modules that hold parameters of their own."""
        if isinstance(modules, nn.ModuleDict):
            modules = modules.values()
        if isinstance(modules, Iterable):
            flat: list[nn.Module] = []
            for item in modules:
                flat.extend(BaseFinetuning.flatten_modules(item))
            candidates: Iterable[nn.Module] = flat
        else:
            candidates = modules.modules()
        return [module for module in candidates if not list(module.children()) or module._parameters]

    @staticmethod
    def filter_params(modules: Modules, train_bn: bool = True, requires_grad: bool = True) -> Generator:
        """Yield the parameters of ``modules`` whose ``requires_grad`` is ``requires_grad`` (batch-norm layers'
        only with ``train_bn``)."""
        for module in BaseFinetuning.flatten_modules(modules):
            if isinstance(module, _BatchNorm) and not train_bn:
                continue
            for parameter in module.parameters(recurse=False):  # a parent's own: its children come separately
                if parameter.requires_grad == requires_grad:
                    yield parameter

    @staticmethod
    def make_trainable(modules: Modules) -> None:
        """Unfreeze ``modules``: their parameters require grad, their batch-norm layers track statistics."""
        for module in BaseFinetuning.flatten_modules(modules):
            if isinstance(module, _BatchNorm):
                module.track_running_stats = True
            for parameter in module.parameters(recurse=False):
                parameter.requires_grad = True

    @staticmethod
    def freeze_module(module: nn.Module) -> None:
        """Freeze one module's own parameters (and stop a batch-norm layer tracking statistics)."""
        if isinstance(module, _BatchNorm):
            module.track_running_stats = False
        for parameter in module.parameters(recurse=False):
            parameter.requires_grad = False

    @staticmethod
    def freeze(modules: Modules, train_bn: bool = True) -> None:
        """Freeze ``modules``; with ``train_bn`` their batch-norm layers stay trainable."""
        for module in BaseFinetuning.flatten_modules(modules):
            if isinstance(module, _BatchNorm) and train_bn:
                BaseFinetuning.make_trainable(module)
            else:
                BaseFinetuning.freeze_module(module)

    @staticmethod
    def filter_on_optimizer(optimizer: Optimizer, params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
        """The parameters of ``params`` that ``optimizer`` does not hold yet (a warning names the others)."""
        held = {id(parameter) for group in optimizer.param_groups for parameter in group["params"]}
        kept, skipped = [], []
        for parameter in params:
            (skipped if id(parameter) in held else kept).append(parameter)
        if skipped:
            rank_zero_warn(
                f"{len(skipped)} parameter(s) to unfreeze are already in a parameter group of the"
                f" {type(optimizer).__name__} and are skipped. Build the optimizer from the parameters that require"
                " grad: torch.optim.SGD(filter(lambda p: p.requires_grad, self.parameters()), ...)."
            )
        return kept

    @staticmethod
    def unfreeze_and_add_param_group(
        modules: Modules,
        optimizer: Optimizer,
        lr: float | None = None,
        initial_denom_lr: float = 10.0,
        train_bn: bool = True,
    ) -> None:
        """Unfreeze ``modules`` and add their parameters to ``optimizer`` as a new parameter group, at learning rate
        ``lr`` (default: the first group's divided by ``initial_denom_lr``)."""
        BaseFinetuning.make_trainable(modules)
        params_lr = optimizer.param_groups[0]["lr"] if lr is None else float(lr)
        denom_lr = initial_denom_lr if lr is None else 1.0
        params = BaseFinetuning.filter_params(modules, train_bn=train_bn, requires_grad=True)
        params = BaseFinetuning.filter_on_optimizer(optimizer, params)
        for parameter in params:
            # Gathered while outside the optimizer, which never zeroed it: Lightning's zero_grad at the next window's
            # start drops it, and no checkpoint holds it.
            parameter.grad = None
        if params:
            optimizer.add_param_group({"params": params, "lr": params_lr / denom_lr})

    # ------------------------------------------------------------------ the groups kept in checkpoints
    @staticmethod
    def _apply_mapping_to_param_groups(groups: list[dict[str, Any]], mapping: dict[Any, Any]) -> list[dict[str, Any]]:
        """``groups`` with each parameter replaced by ``mapping[parameter]`` (names to parameters, or back)."""
        mapped = []
        for group in groups:
            settings = {key: value for key, value in group.items() if key != "params"}
            mapped.append({**settings, "params": [mapping[parameter] for parameter in group["params"]]})
        return mapped

    def _store(self, module: TrainingModule, index: int, num_param_groups: int, groups: list[dict[str, Any]]) -> None:
        names = {parameter: name for name, parameter in module.named_parameters()}
        if index not in self._internal_optimizer_metadata:
            self._internal_optimizer_metadata[index] = self._apply_mapping_to_param_groups(groups, names)
        elif num_param_groups != len(groups):
            self._internal_optimizer_metadata[index].extend(
                self._apply_mapping_to_param_groups(groups[num_param_groups:], names)
            )


def _frozen_names(module: nn.Module) -> dict[str, list[str]]:
    """The parameters that do not require grad and the batch-norm layers that track no statistics, by name."""
    untracked = [name for name, layer in module.named_modules() if isinstance(layer, _BatchNorm)]
    return {
        "parameters": [name for name, parameter in module.named_parameters() if not parameter.requires_grad],
        "batch_norms": [name for name in untracked if not module.get_submodule(name).track_running_stats],
    }


def _restore_frozen(module: nn.Module, frozen: dict[str, list[str]]) -> None:
    parameters, batch_norms = set(frozen["parameters"]), set(frozen["batch_norms"])
    for name, parameter in module.named_parameters():
        parameter.requires_grad = name not in parameters
    for name, layer in module.named_modules():
        if isinstance(layer, _BatchNorm):
            layer.track_running_stats = name not in batch_norms


class BackboneFinetuning(BaseFinetuning):
    """Freeze the module's ``backbone`` until epoch ``unfreeze_backbone_at_epoch``, then train it in a new parameter
    group whose learning rate grows by ``lambda_func`` every epoch (Lightning's ``BackboneFinetuning``).

    Args:
        unfreeze_backbone_at_epoch: The epoch (from 0) at which the backbone is unfrozen.
        lambda_func: ``epoch -> factor``: the backbone's learning rate is multiplied by ``lambda_func(epoch + 1)``
            at the start of each later epoch.
        backbone_initial_ratio_lr: The backbone's first learning rate as a fraction of the first group's.
        backbone_initial_lr: The backbone's first learning rate (overrides ``backbone_initial_ratio_lr``).
        should_align: Once the backbone's learning rate would pass the first group's, keep it equal to it.
        initial_denom_lr: Passed to :meth:`unfreeze_and_add_param_group`.
        train_bn: Whether the backbone's batch-norm layers are added to the new parameter group.
        verbose: Log both learning rates at the start of each epoch from the unfreezing on.
        rounding: The digits the learning rates are logged with.

    The module must have a ``backbone`` attribute that is an ``nn.Module``, and build its optimizer without it
    (``torch.optim.Adam(self.head.parameters())`` or from the parameters that require grad).
    """

    def __init__(
        self,
        unfreeze_backbone_at_epoch: int = 10,
        lambda_func: Callable[[int], float] = multiplicative,
        backbone_initial_ratio_lr: float = 10e-2,
        backbone_initial_lr: float | None = None,
        should_align: bool = True,
        initial_denom_lr: float = 10.0,
        train_bn: bool = True,
        verbose: bool = False,
        rounding: int = 12,
    ) -> None:
        super().__init__()
        self.unfreeze_backbone_at_epoch = unfreeze_backbone_at_epoch
        self.lambda_func = lambda_func
        self.backbone_initial_ratio_lr = backbone_initial_ratio_lr
        self.backbone_initial_lr = backbone_initial_lr
        self.should_align = should_align
        self.initial_denom_lr = initial_denom_lr
        self.train_bn = train_bn
        self.verbose = verbose
        self.rounding = rounding
        self.previous_backbone_lr: float | None = None

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "previous_backbone_lr": self.previous_backbone_lr}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.previous_backbone_lr = state_dict["previous_backbone_lr"]
        super().load_state_dict(state_dict)

    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        if not isinstance(getattr(module, "backbone", None), nn.Module):
            raise MisconfigurationError(
                f"BackboneFinetuning needs {type(module).__name__}.backbone, an nn.Module: the part of the model"
                " that it freezes and unfreezes."
            )
        super().setup(trainer, module, stage)

    def freeze_before_training(self, module: TrainingModule) -> None:
        self.freeze(module.backbone)  # its batch-norm layers stay trainable, as in Lightning

    def finetune_function(self, module: TrainingModule, epoch: int, optimizer: Optimizer) -> None:
        current_lr = optimizer.param_groups[0]["lr"]
        if epoch == self.unfreeze_backbone_at_epoch:
            if self.backbone_initial_lr is not None:
                backbone_lr = self.backbone_initial_lr
            else:
                backbone_lr = current_lr * self.backbone_initial_ratio_lr
            self.previous_backbone_lr = backbone_lr
            self.unfreeze_and_add_param_group(
                module.backbone,
                optimizer,
                backbone_lr,
                train_bn=self.train_bn,
                initial_denom_lr=self.initial_denom_lr,
            )
        elif epoch > self.unfreeze_backbone_at_epoch:
            if self.previous_backbone_lr is None:
                raise MisconfigurationError(
                    f"BackboneFinetuning(unfreeze_backbone_at_epoch={self.unfreeze_backbone_at_epoch}) reached epoch"
                    f" {epoch} without having unfrozen the backbone (a resume from a checkpoint saved without this"
                    " callback?); resume from one saved with it, or raise unfreeze_backbone_at_epoch."
                )
            backbone_lr = self.lambda_func(epoch + 1) * self.previous_backbone_lr
            if self.should_align and backbone_lr > current_lr:
                backbone_lr = current_lr
            optimizer.param_groups[-1]["lr"] = backbone_lr
            self.previous_backbone_lr = backbone_lr
        else:
            return
        if self.verbose:
            log.info(
                f"Current lr: {round(current_lr, self.rounding)}, Backbone lr: {round(backbone_lr, self.rounding)}"
            )


__all__ = ["BackboneFinetuning", "BaseFinetuning", "multiplicative"]
