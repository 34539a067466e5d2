"""Splitting a model into pipeline stages by its repeated blocks, keeping the full model's parameter names.

A model whose body is a sequence of repeated blocks (a transformer's layers) is cut into stages of balanced block
counts, or at split points the user gives. :func:`keep_stage` removes in place what other stages hold, so that a
rank's module keeps only its stage's parameters, under the names they have in the whole model (checkpoints written by
stages then line up with one process's).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from torch import nn


def stage_ranges(num_blocks: int, num_stages: int, split_points: Sequence[int] | None = None) -> list[range]:
    """The block indices each stage holds: balanced by count (the first ``num_blocks % num_stages`` stages hold one
    more), or cut before each of ``split_points`` (``num_stages - 1`` increasing indices)."""
    for name, value in (("num_blocks", num_blocks), ("num_stages", num_stages)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1.")
    if split_points is None:
        if num_stages > num_blocks:
            raise ValueError(
                f"num_stages={num_stages} is more than the {num_blocks} blocks; every stage needs at least one block."
            )
        size, extra = divmod(num_blocks, num_stages)
        bounds = [0]
        for stage in range(num_stages):
            bounds.append(bounds[-1] + size + (stage < extra))
    else:
        points = list(split_points)
        if len(points) != num_stages - 1:
            raise ValueError(
                f"split_points={points} must give {num_stages - 1} indices for {num_stages} stages (each stage but"
                " the first starts at one)."
            )
        bounds = [0, *points, num_blocks]
        if any(not isinstance(point, int) or isinstance(point, bool) for point in points) or any(
            low >= high for low, high in zip(bounds, bounds[1:])
        ):
            raise ValueError(
                f"split_points={points} must be increasing ints strictly between 0 and {num_blocks}, so that every"
                " stage holds at least one block."
            )
    return [range(low, high) for low, high in zip(bounds, bounds[1:])]


def keep_stage(
    module: nn.Module,
    blocks: str,
    stage: int,
    num_stages: int,
    *,
    split_points: Sequence[int] | None = None,
    first: Sequence[str] = (),
    last: Sequence[str] = (),
) -> range:
    """Remove from ``module`` what stage ``stage`` of ``num_stages`` does not hold; the indices of the blocks kept.

    ``blocks`` names the ``nn.ModuleList`` or ``nn.Sequential`` of repeated blocks; the others are removed without
    renumbering, so iterating over it runs this stage's blocks and parameter names stay those of the whole model (do
    not index it by position afterwards). ``first`` names submodules only the first stage holds (an embedding), and
    ``last`` those only the last stage holds (a final norm and head); a removed one becomes None.
    """
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < num_stages:
        raise ValueError(f"stage={stage!r} must be an int from 0 to {num_stages - 1}.")
    # configure_model runs again for each later stage of a run (validate, predict): the split it made stays.
    kept = module.__dict__.get("_kept_stage")
    if kept is not None:
        if kept[:3] != (blocks, stage, num_stages):
            raise ValueError(
                f"The module already holds stage {kept[1]} of {kept[2]} (blocks {kept[0]!r}); it cannot become stage"
                f" {stage} of {num_stages}. Build a new module for another split."
            )
        return kept[3]
    container = _blocks_container(module, blocks, (*first, *last))
    held = stage_ranges(len(container), num_stages, split_points)[stage]
    for index, key in enumerate(list(container._modules)):
        if index not in held:
            del container._modules[key]
    for names, keeps in ((first, stage == 0), (last, stage == num_stages - 1)):
        if not keeps:
            for name in names:
                parent, _, child = name.rpartition(".")
                setattr(module.get_submodule(parent), child, None)
    module.__dict__["_kept_stage"] = (blocks, stage, num_stages, held)
    return held


def keep_stages(
    module: nn.Module,
    blocks: str,
    stages: Sequence[int],
    num_stages: int,
    *,
    split_points: Sequence[int] | None = None,
    first: Sequence[str] = (),
    last: Sequence[str] = (),
) -> list[range]:
    """:func:`keep_stage` for a rank that holds several stages (virtual-stage schedules): keep every block of
    ``stages``, and record them so that :func:`stage_views` gives one module per stage; the blocks each stage holds."""
    stages = tuple(stages)
    if not stages or any(isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < num_stages for s in stages):
        raise ValueError(f"stages={list(stages)} must be ints from 0 to {num_stages - 1}.")
    if len(stages) == 1:
        return [keep_stage(module, blocks, stages[0], num_stages, split_points=split_points, first=first, last=last)]
    kept = module.__dict__.get("_kept_stages")
    if kept is not None:
        if kept[:3] != (blocks, stages, num_stages):
            raise ValueError(
                f"The module already holds stages {list(kept[1])} of {kept[2]} (blocks {kept[0]!r}); it cannot hold"
                f" stages {list(stages)} of {num_stages}. Build a new module for another split."
            )
        return list(kept[3])
    container = _blocks_container(module, blocks, (*first, *last))
    ranges = [stage_ranges(len(container), num_stages, split_points)[stage] for stage in stages]
    for index, key in enumerate(list(container._modules)):
        if not any(index in held for held in ranges):
            del container._modules[key]
    for names, keeps in ((first, 0 in stages), (last, num_stages - 1 in stages)):
        if not keeps:
            for name in names:
                _set_submodule(module, name, None)
    module.__dict__["_kept_stages"] = (blocks, stages, num_stages, ranges, tuple(first), tuple(last))
    return ranges


def stage_views(module: nn.Module) -> list[nn.Module]:
    """One module per stage that :func:`keep_stages` kept in ``module``: shallow views sharing its parameters, each
    running only its stage's blocks (and the first or last parts where its stage holds them)."""
    kept = module.__dict__.get("_kept_stages")
    if kept is None:
        raise ValueError(
            "The module holds no virtual stages: call keep_stages(self, blocks, strategy.pipeline_stages, ...) in"
            " configure_model."
        )
    blocks, stages, num_stages, ranges, first, last = kept
    container = module.get_submodule(blocks)
    keys = list(container._modules)
    indices = sorted({index for held in ranges for index in held})
    views = []
    for stage, held in zip(stages, ranges):
        view = _view(module)
        part = type(container)()
        for index, key in zip(indices, keys):
            if index in held:
                part._modules[key] = container._modules[key]
        _set_submodule(view, blocks, part, copy_path=True)
        for names, keeps in ((first, stage == 0), (last, stage == num_stages - 1)):
            if not keeps:
                for name in names:
                    _set_submodule(view, name, None, copy_path=True)
        views.append(view)
    return views


def _view(module: nn.Module) -> nn.Module:
    view = copy.copy(module)
    view._modules = dict(module._modules)  # its own children table: replacing one leaves the module as it is
    return view


def _set_submodule(module: nn.Module, name: str, value: nn.Module | None, copy_path: bool = False) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = module
    for part in parent_name.split(".") if parent_name else ():
        node = parent._modules[part]
        assert node is not None
        if copy_path:
            node = _view(node)
            parent._modules[part] = node
        parent = node
    if value is None:
        setattr(parent, child, None)
    else:
        parent._modules[child] = value


def _blocks_container(module: nn.Module, blocks: str, kept_names: Sequence[str]) -> nn.ModuleList | nn.Sequential:
    """The container of repeated blocks named ``blocks``, after checking that every name in ``kept_names`` exists (an
    unknown name is refused before anything is removed)."""
    container = module.get_submodule(blocks)
    if not isinstance(container, (nn.ModuleList, nn.Sequential)):
        raise TypeError(
            f"{blocks!r} is a {type(container).__name__}; name the nn.ModuleList or nn.Sequential of repeated blocks."
        )
    for name in kept_names:
        module.get_submodule(name)
    return container
