"""ModelPruning: prune the module's weights during training with ``torch.nn.utils.prune`` (Lightning's
``ModelPruning``), its masks kept in checkpoints so that a resumed run prunes on exactly as before."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from copy import deepcopy
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Union

import torch
import torch.nn.utils.prune as pytorch_prune
from torch import Tensor, nn

from phalanx.callbacks.callback import Callback
from phalanx.module import TrainingModule
from phalanx.utilities.exceptions import MisconfigurationError
from phalanx.utilities.rank_zero import rank_zero_only

if TYPE_CHECKING:
    from phalanx.trainer.trainer import Trainer

log = logging.getLogger(__name__)

_PRUNING_FUNCTIONS = {
    "ln_structured": pytorch_prune.ln_structured,
    "l1_unstructured": pytorch_prune.l1_unstructured,
    "random_structured": pytorch_prune.random_structured,
    "random_unstructured": pytorch_prune.random_unstructured,
}
_PRUNING_METHODS = {
    "ln_structured": pytorch_prune.LnStructured,
    "l1_unstructured": pytorch_prune.L1Unstructured,
    "random_structured": pytorch_prune.RandomStructured,
    "random_unstructured": pytorch_prune.RandomUnstructured,
}
_ParameterList = Sequence[tuple[nn.Module, str]]
_Amount = Union[int, float, Callable[[int], Union[int, float]]]
_Switch = Union[bool, Callable[[int], bool]]
# Layers that only hold other layers: never pruned themselves.
_CONTAINERS = (TrainingModule, nn.Sequential, nn.ModuleList, nn.ModuleDict)


def _is_pruning_method(method: Any) -> bool:
    return inspect.isclass(method) and issubclass(method, pytorch_prune.BasePruningMethod)


def _resolve_pruning_fn(
    pruning_fn: Any, use_global_unstructured: bool, pruning_dim: int | None, pruning_norm: int | None
) -> tuple[Any, dict[str, Any], str | None]:
    """``(the callable or method class to prune with, keyword arguments of a global method, its name)``."""
    names = list(_PRUNING_FUNCTIONS)
    if isinstance(pruning_fn, str):
        name = pruning_fn.lower()
        if name not in _PRUNING_FUNCTIONS:
            raise MisconfigurationError(f"pruning_fn={pruning_fn!r} is not one of torch's pruning functions {names}.")
        kwargs: dict[str, Any] = {}
        if name.endswith("_structured"):
            if pruning_dim is None:
                raise MisconfigurationError(f"pruning_fn={name!r} is structured: pass pruning_dim, the dimension.")
            if name == "ln_structured":
                if pruning_norm is None:
                    raise MisconfigurationError(
                        "pruning_fn='ln_structured' needs pruning_norm, the norm (e.g. 1 or 2)."
                    )
                kwargs["n"] = pruning_norm
            kwargs["dim"] = pruning_dim
        if use_global_unstructured:
            method = _PRUNING_METHODS[name]
            return method, kwargs, method.__name__
        function = _PRUNING_FUNCTIONS[name]
        return partial(function, **kwargs), {}, function.__name__
    if _is_pruning_method(pruning_fn):
        if not use_global_unstructured:
            raise MisconfigurationError(
                f"pruning_fn={pruning_fn.__name__} (a BasePruningMethod) needs use_global_unstructured=True."
            )
        return pruning_fn, {}, pruning_fn.__name__
    raise MisconfigurationError(
        f"pruning_fn={pruning_fn!r} is not valid; pass one of {names} or a torch.nn.utils.prune.BasePruningMethod"
        " subclass (the class, not an instance)."
    )


def _pruned_stats(module: nn.Module, name: str) -> tuple[int, int]:
    mask = getattr(module, f"{name}_mask", None)
    if mask is None:
        return 0, 1
    return int((mask == 0).sum().item()), mask.numel()


class ModelPruning(Callback):
    """Prune parameters during training with ``torch.nn.utils.prune``, as Lightning's ``ModelPruning`` does: at the
    end of each training epoch (or validation epoch), by ``amount``, globally or layer by layer, optionally resetting
    the kept weights to their initial values (the lottery ticket hypothesis).

    Checkpoints hold the pruned weights under the module's own names (``weight`` = ``weight_orig * weight_mask``, as
    Lightning writes them with ``make_pruning_permanent=True``), so they load into the plain module and stay
    ``weights_only=True`` loadable; the callback's state holds the masks, the values the masks hide and the initial
    weights, with which a resumed fit prunes on exactly as the uninterrupted one would.

    Needs every pruned parameter whole on each process: single-device and DDP strategies. Under FSDP, tensor
    parallelism or DeepSpeed (whose engine owns the parameters) it is refused when fit starts.

    Args:
        pruning_fn: "l1_unstructured", "random_unstructured", "ln_structured", "random_structured", or a
            ``BasePruningMethod`` subclass (with ``use_global_unstructured=True``).
        parameters_to_prune: ``(module, "weight")`` pairs; empty: every ``parameter_names`` of every layer.
        parameter_names: Which parameters of each layer, among "weight" and "bias" (default both).
        use_global_unstructured: Rank the parameters of all layers together (unstructured methods only).
        amount: The fraction (float) or number (int) to prune, or a function of the epoch returning it.
        apply_pruning: Whether to prune, or a function of the epoch returning whether.
        make_pruning_permanent: Remove the pruning re-parametrisation when training ends, and write the pruned
            weights in checkpoints (False: the checkpoints hold ``weight_orig`` and ``weight_mask``, as Lightning's).
        use_lottery_ticket_hypothesis: After pruning, reset the kept weights to their values at set-up (or a function
            of the epoch returning whether to).
        resample_parameters: With the lottery ticket hypothesis, draw new initial values instead.
        pruning_dim: The dimension of a structured method.
        pruning_norm: The norm of ``ln_structured``.
        verbose: 0 silent, 1 the overall sparsity, 2 also each layer's (logged on rank 0 at INFO level).
        prune_on_train_epoch_end: Prune at the end of the training epoch; False: at the end of validation.
    """

    PARAMETER_NAMES = ("weight", "bias")

    def __init__(
        self,
        pruning_fn: Callable | str,
        parameters_to_prune: _ParameterList = (),
        parameter_names: list[str] | None = None,
        use_global_unstructured: bool = True,
        amount: _Amount = 0.5,
        apply_pruning: _Switch = True,
        make_pruning_permanent: bool = True,
        use_lottery_ticket_hypothesis: _Switch = True,
        resample_parameters: bool = False,
        pruning_dim: int | None = None,
        pruning_norm: int | None = None,
        verbose: int = 0,
        prune_on_train_epoch_end: bool = True,
    ) -> None:
        self._use_global_unstructured = use_global_unstructured
        self._parameters_to_prune: _ParameterList = parameters_to_prune
        self._use_lottery_ticket_hypothesis = use_lottery_ticket_hypothesis
        self._resample_parameters = resample_parameters
        self._prune_on_train_epoch_end = prune_on_train_epoch_end
        self._parameter_names = list(parameter_names or self.PARAMETER_NAMES)
        for name in self._parameter_names:
            if name not in self.PARAMETER_NAMES:
                raise MisconfigurationError(f"parameter_names has {name!r}; choose among {list(self.PARAMETER_NAMES)}.")
        self.pruning_fn, self._global_kwargs, self._pruning_method_name = _resolve_pruning_fn(
            pruning_fn, use_global_unstructured, pruning_dim, pruning_norm
        )
        if use_global_unstructured and getattr(self.pruning_fn, "PRUNING_TYPE", None) != "unstructured":
            raise MisconfigurationError(
                f"use_global_unstructured=True needs an unstructured method; {self._pruning_method_name} is"
                f" {getattr(self.pruning_fn, 'PRUNING_TYPE', 'not a pruning method')}."
            )
        if isinstance(amount, bool) or not (isinstance(amount, (int, float)) or callable(amount)):
            raise MisconfigurationError(
                f"amount={amount!r} is not valid; pass an int, a float or a function of the epoch."
            )
        if verbose not in (0, 1, 2):
            raise MisconfigurationError(f"verbose={verbose!r} is not valid; choose 0, 1 or 2.")
        self.amount = amount
        self._apply_pruning = apply_pruning
        self._make_pruning_permanent = make_pruning_permanent
        self._verbose = verbose
        self._original_layers: dict[int, dict[str, Any]] | None = None
        self._names: list[str] = []  # "layer.path.weight" for each entry of _parameters_to_prune
        self._restored: dict[str, Any] | None = None

    # ------------------------------------------------------------------ Lightning's overridable pieces
    def filter_parameters_to_prune(self, parameters_to_prune: _ParameterList = ()) -> _ParameterList:
        """Override to choose which of ``parameters_to_prune`` to prune."""
        return parameters_to_prune

    @staticmethod
    def sanitize_parameters_to_prune(
        pl_module: nn.Module, parameters_to_prune: _ParameterList = (), parameter_names: Sequence[str] = ()
    ) -> _ParameterList:
        """``parameters_to_prune`` checked against ``pl_module``; all ``parameter_names`` of its layers when empty."""
        names = parameter_names or ModelPruning.PARAMETER_NAMES
        layers = [m for m in pl_module.modules() if not isinstance(m, _CONTAINERS)]
        if not parameters_to_prune:
            return [
                (layer, name)
                for name in names
                for layer in layers
                if isinstance(getattr(layer, name, None), nn.Parameter)
            ]
        if not (
            isinstance(parameters_to_prune, (list, tuple))
            and all(isinstance(pair, (list, tuple)) and len(pair) == 2 for pair in parameters_to_prune)
            and all(isinstance(m, nn.Module) and isinstance(n, str) for m, n in parameters_to_prune)
        ):
            raise MisconfigurationError(
                "parameters_to_prune must be a list of (nn.Module, parameter name) pairs, or empty for all layers."
            )
        missing_modules = [m for m, _ in parameters_to_prune if not any(m is layer for layer in layers)]
        missing_parameters = [n for m, n in parameters_to_prune if m not in missing_modules and not hasattr(m, n)]
        if missing_modules or missing_parameters:
            raise MisconfigurationError(
                "Some provided parameters_to_prune are not in the model: missing modules"
                f" {[type(m).__name__ for m in missing_modules]}, missing parameters {missing_parameters}."
            )
        return list(parameters_to_prune)

    def make_pruning_permanent(self, module: nn.Module) -> None:
        """Remove the pruning re-parametrisation (and buffers) from every layer of ``module``."""
        for layer in module.modules():
            for key, hook in list(layer._forward_pre_hooks.items()):
                if isinstance(hook, pytorch_prune.BasePruningMethod):
                    hook.remove(layer)
                    del layer._forward_pre_hooks[key]

    def apply_lottery_ticket_hypothesis(self) -> None:
        """Reset the weights kept by the masks to their values at set-up (new draws with ``resample_parameters``)."""
        assert self._original_layers is not None
        for entry in self._original_layers.values():
            copy = entry["data"]
            if self._resample_parameters and callable(getattr(copy, "reset_parameters", None)):
                copy = deepcopy(copy)  # keep the originals
                copy.reset_parameters()
            for index, name in entry["names"]:
                layer, _ = self._parameters_to_prune[index]
                _copy_parameter(layer, copy, name)

    def apply_pruning(self, amount: int | float) -> None:
        """Prune ``parameters_to_prune`` by ``amount``."""
        before = [_pruned_stats(m, n) for m, n in self._parameters_to_prune] if self._verbose else []
        if self._use_global_unstructured:
            kwargs = {**self._global_kwargs, "amount": amount}
            accepted = set(inspect.signature(self.pruning_fn).parameters) - {"self"}
            pytorch_prune.global_unstructured(
                self._parameters_to_prune,
                pruning_method=self.pruning_fn,
                **{key: value for key, value in kwargs.items() if key in accepted},
            )
        else:
            for layer, name in self._parameters_to_prune:
                self.pruning_fn(layer, name=name, amount=amount)
        if self._verbose:
            self._log_sparsity_stats(before, [_pruned_stats(m, n) for m, n in self._parameters_to_prune], amount)

    @rank_zero_only
    def _log_sparsity_stats(
        self, before: list[tuple[int, int]], after: list[tuple[int, int]], amount: int | float = 0
    ) -> None:
        total = sum(size for _, size in after)
        zeros_before, zeros_after = sum(z for z, _ in before), sum(z for z, _ in after)
        log.info(
            f"Applied `{self._pruning_method_name}`. Pruned: {zeros_before}/{total} ({zeros_before / total:.2%}) ->"
            f" {zeros_after}/{total} ({zeros_after / total:.2%})"
        )
        if self._verbose == 2:
            for (layer, name), (z0, n0), (z1, n1) in zip(self._parameters_to_prune, before, after):
                log.info(
                    f"Applied `{self._pruning_method_name}` to `{layer!r}.{name}` with amount={amount}. Pruned:"
                    f" {z0} ({z0 / n0:.2%}) -> {z1} ({z1 / n1:.2%})"
                )

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        parameters = self.sanitize_parameters_to_prune(module, self._parameters_to_prune, self._parameter_names)
        self._parameters_to_prune = self.filter_parameters_to_prune(parameters)
        paths = {id(layer): path for path, layer in module.named_modules()}
        self._names = [_join(paths.get(id(layer), "?"), name) for layer, name in self._parameters_to_prune]
        if self._use_lottery_ticket_hypothesis:
            # Per layer: a copy of its values now, and the (index, name) of each of its parameters to prune.
            self._original_layers = {}
            for index, (layer, name) in enumerate(self._parameters_to_prune):
                entry = self._original_layers.setdefault(id(layer), {"data": deepcopy(layer), "names": []})
                entry["names"].append((index, name))

    def on_fit_start(self, trainer: Trainer, module: TrainingModule) -> None:
        _refuse_unless_whole(trainer, self._parameters_to_prune, self._names)
        if self._restored is not None:
            # Now that the optimizers exist (built over the plain parameters, in their original order) and hold
            # their saved states, the masks of the checkpoint go back on.
            self._restore_masks(self._restored)
            self._restored = None

    def on_train_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None:
        if self._prune_on_train_epoch_end:
            self._run_pruning(module.current_epoch)

    def on_validation_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None:
        if not trainer.sanity_checking and not self._prune_on_train_epoch_end:
            self._run_pruning(module.current_epoch)

    def on_train_end(self, trainer: Trainer, module: TrainingModule) -> None:
        if self._make_pruning_permanent:
            self.make_pruning_permanent(module)

    def _run_pruning(self, epoch: int) -> None:
        prune = self._apply_pruning(epoch) if callable(self._apply_pruning) else self._apply_pruning
        amount = self.amount(epoch) if callable(self.amount) else self.amount
        if not prune or not amount:
            return
        self.apply_pruning(amount)
        lottery = self._use_lottery_ticket_hypothesis
        if lottery(epoch) if callable(lottery) else lottery:
            self.apply_lottery_ticket_hypothesis()

    # ------------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, trainer: Trainer, module: TrainingModule, checkpoint: dict[str, Any]) -> None:
        if self._make_pruning_permanent and "state_dict" in checkpoint:
            checkpoint["state_dict"] = _permanent(checkpoint["state_dict"])

    def state_dict(self) -> dict[str, Any]:
        """The masks, the values they hide and the initial weights, by parameter name: the exact state of pruning."""
        masks, hidden = {}, {}
        for (layer, name), key in zip(self._parameters_to_prune, self._names):
            mask = getattr(layer, f"{name}_mask", None)
            if mask is not None:
                masks[key] = mask.detach().to("cpu", copy=True)
                hidden[key] = getattr(layer, f"{name}_orig").detach()[mask == 0].cpu()
        original = {}
        for entry in (self._original_layers or {}).values():
            for index, name in entry["names"]:
                original[self._names[index]] = getattr(entry["data"], name).detach().to("cpu", copy=True)
        return {"masks": masks, "hidden": hidden, "original": original} if masks or original else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        unknown = sorted(set(state_dict.get("masks", {})) - set(self._names))
        if unknown:
            raise ValueError(f"the checkpoint prunes {unknown}, which this ModelPruning does not prune: {self._names}.")
        self._restored = state_dict

    def _restore_masks(self, state: dict[str, Any]) -> None:
        for (layer, name), key in zip(self._parameters_to_prune, self._names):
            mask = state.get("masks", {}).get(key)
            if mask is not None:
                parameter = getattr(layer, name)
                with torch.no_grad():
                    parameter[mask.to(parameter.device) == 0] = state["hidden"][key].to(parameter.device)
                pytorch_prune.custom_from_mask(layer, name, mask.to(parameter.device))
        for entry in (self._original_layers or {}).values():
            for index, name in entry["names"]:
                saved = state.get("original", {}).get(self._names[index])
                if saved is not None:
                    getattr(entry["data"], name).data.copy_(saved)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _copy_parameter(new: nn.Module, old: nn.Module, name: str) -> None:
    target = getattr(new, f"{name}_orig", None)
    target = getattr(new, name) if target is None else target
    source = getattr(old, name)
    if isinstance(target, Tensor) and isinstance(source, Tensor):
        with torch.no_grad():
            target.copy_(source)  # in place: the optimizer (and DDP) keep the same parameter


def _permanent(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` with each pruned ``X_orig``/``X_mask`` pair written as ``X = X_orig * X_mask``, in place of the
    pair and in the module's order."""
    result: dict[str, Any] = {}
    for key, value in state_dict.items():
        if key.endswith("_orig") and f"{key[: -len('_orig')]}_mask" in state_dict:
            stem = key[: -len("_orig")]
            result[stem] = state_dict[f"{stem}_mask"].to(dtype=value.dtype) * value
        elif not (key.endswith("_mask") and f"{key[: -len('_mask')]}_orig" in state_dict):
            result[key] = value
    return result


def _refuse_unless_whole(trainer: Trainer, parameters: _ParameterList, names: list[str]) -> None:
    """Refuse a strategy under which the parameters to prune are not whole tensors of the module on each process."""
    reason = None
    if trainer.strategy.traits.wraps_module_with_optimizers:
        reason = f"{type(trainer.strategy).__name__}'s engine owns the parameters and their optimizer"
    for (layer, name), key in zip(parameters, names):
        parameter = getattr(layer, f"{name}_orig", None)
        parameter = getattr(layer, name, None) if parameter is None else parameter
        if reason is None and type(parameter) not in (nn.Parameter, Tensor):
            reason = f"{key} is a {type(parameter).__name__} (sharded across processes)"
        elif reason is None and hasattr(parameter, "ds_id"):
            reason = f"{key} is partitioned by DeepSpeed"
    if reason is not None:
        raise MisconfigurationError(
            f"ModelPruning cannot prune under {type(trainer.strategy).__name__}: {reason}, and torch.nn.utils.prune"
            " needs each parameter whole. Use a single-device or DDP strategy."
        )


__all__ = ["ModelPruning"]
