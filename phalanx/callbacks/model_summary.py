"""ModelSummary: print a table of the module's layers and parameter counts when ``fit`` starts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from torch import nn
from torch.nn.parameter import UninitializedParameter

from phalanx.callbacks.callback import Callback
from phalanx.utilities.checks import is_int_at_least

if TYPE_CHECKING:
    from phalanx.module import TrainingModule
    from phalanx.trainer.trainer import Trainer

_UNITS = ["", "K", "M", "B", "T"]


def _numel(parameter: nn.Parameter) -> int:
    """Element count; 0 for lazy parameters whose shape is not known yet (meta tensors report their shape)."""
    if isinstance(parameter, UninitializedParameter):
        return 0
    return parameter.numel()


def _unique(parameters: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    seen: set[int] = set()
    result = []
    for parameter in parameters:
        if id(parameter) not in seen:
            seen.add(id(parameter))
            result.append(parameter)
    return result


def human_readable_count(number: int) -> str:
    """``123 -> '123'``, ``1234 -> '1.2 K'``, ``2_000_000 -> '2.0 M'``."""
    value = float(number)
    unit = 0
    while abs(value) >= 1000 and unit < len(_UNITS) - 1:
        value /= 1000
        unit += 1
    if unit == 0:
        return str(int(number))
    return f"{value:.1f} {_UNITS[unit]}"


def parameter_counts(module: nn.Module) -> tuple[int, int, int]:
    """Return ``(trainable, non_trainable, total)`` parameter counts (shared parameters counted once)."""
    parameters = _unique(module.parameters())
    trainable = sum(_numel(p) for p in parameters if p.requires_grad)
    total = sum(_numel(p) for p in parameters)
    return trainable, total - trainable, total


def _layers(module: nn.Module, max_depth: int) -> list[tuple[str, nn.Module]]:
    if max_depth == 0:
        return []
    layers = []
    for name, submodule in module.named_modules():
        if not name:
            continue
        depth = name.count(".") + 1
        if max_depth < 0 or depth <= max_depth:
            layers.append((name, submodule))
    return layers


def summary_rows(module: nn.Module, max_depth: int = 1) -> list[list[str]]:
    """The summary table's rows: index, name, type, parameter count and mode of each layer down to ``max_depth``."""
    if not is_int_at_least(max_depth, -1):
        raise ValueError(f"`max_depth` must be an int >= -1 (-1: all layers), got {max_depth!r}.")
    rows = []
    for index, (name, layer) in enumerate(_layers(module, max_depth)):
        count = sum(_numel(p) for p in _unique(layer.parameters()))
        mode = "train" if layer.training else "eval"
        rows.append([str(index), name, type(layer).__name__, human_readable_count(count), mode])
    return rows


def summary_totals(module: nn.Module) -> list[tuple[str, str]]:
    """(value, label) of each total under the table: parameter counts, size, and the lazy parameters if any."""
    trainable, non_trainable, total = parameter_counts(module)
    totals = [
        (human_readable_count(trainable), "Trainable params"),
        (human_readable_count(non_trainable), "Non-trainable params"),
        (human_readable_count(total), "Total params"),
        (f"{total * 4 / 1e6:.3f}", "Total estimated model params size (MB)"),  # as float32
    ]
    lazy = sum(1 for p in module.parameters() if isinstance(p, UninitializedParameter))
    if lazy:
        totals.append((str(lazy), "Uninitialized (lazy) parameters, counted as 0"))
    return totals


SUMMARY_HEADER = ["", "Name", "Type", "Params", "Mode"]


def summarize(module: nn.Module, max_depth: int = 1) -> str:
    """Return the summary table of ``module``: its layers down to ``max_depth`` (-1: all) and the totals."""
    rows = summary_rows(module, max_depth)
    lines: list[str] = []
    if rows:
        header = SUMMARY_HEADER
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

        def format_row(row: list[str]) -> str:
            return " | ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()

        head = format_row(header)
        rule = "-" * max(len(head), max(len(format_row(r)) for r in rows))
        lines += [head, rule, *(format_row(row) for row in rows), rule]
    column = 10
    lines += [f"{value:<{column}}{label}" for value, label in summary_totals(module)]
    return "\n".join(lines)


class ModelSummary(Callback):
    """Print the module's summary (layers down to ``max_depth``, parameter counts, size) on rank 0 at fit start.

    Args:
        max_depth: How deep to list submodules: 1 the direct children, -1 all of them, 0 disables the summary.
    """

    def __init__(self, max_depth: int = 1) -> None:
        if not is_int_at_least(max_depth, -1):
            raise ValueError(f"`max_depth` must be an int >= -1 (-1: all layers, 0: no summary), got {max_depth!r}.")
        self._max_depth = max_depth

    @property
    def max_depth(self) -> int:
        return self._max_depth

    def on_fit_start(self, trainer: Trainer, module: TrainingModule) -> None:
        if self._max_depth == 0 or not trainer.is_global_zero:
            return
        self._show(module)

    def _show(self, module: TrainingModule) -> None:
        """Print the summary of ``module`` (a subclass draws it its own way)."""
        print(summarize(module, self._max_depth))
