"""ModelCheckpoint's argument and input checks: name templates, constructor arguments, restored scores, finiteness.

Everything here runs before training (at construction) or at a save point, so that a bad argument fails at once and
a checkpoint's callback state is checked before it is used.
"""

from __future__ import annotations

import os
import re
from datetime import timedelta
from functools import lru_cache
from typing import Any

import torch
from torch import Tensor

from phalanx.callbacks._checkpoint_files import FILE_EXTENSION, checkpoint_in_folder, is_url
from phalanx.utilities.checks import is_int_at_least
from phalanx.utilities.exceptions import CheckpointError

# ``{name}``, ``{name!r}``, ``{name:format_spec}``; a name may hold anything but braces, colons and "!" ("val/loss").
TEMPLATE_FIELD = re.compile(r"\{([^{}:!]+)(?:!([^{}:]*))?(?::([^{}]*))?\}")
_CONVERSIONS = {"r": repr, "s": str, "a": ascii}
_INTEGER_FIELDS = ("epoch", "step")
# Most file systems refuse longer names (in bytes); room is kept for a "-vN" suffix.
_MAX_NAME_BYTES = 255
_SEPARATORS = tuple(sorted({"/", os.sep, os.altsep or "/"}))


def format_field(conversion: str | None, spec: str, value: Any) -> str:
    """Format one template field's value like ``str.format`` would (``conversion`` is 'r', 's', 'a' or None)."""
    if conversion:
        value = _CONVERSIONS[conversion](value)
    return format(value, spec)


def fill_template(template: str, metrics: dict[str, Any], equals: str | None) -> str:
    """The file name (without extension) for ``metrics``; ``equals`` set: fields are written ``name=value``."""

    def fill(match: re.Match) -> str:
        key, conversion, spec = match.group(1), match.group(2), match.group(3) or ""
        value = metrics.get(key, 0)
        try:
            text = format_field(conversion, spec, value)
        except (ValueError, TypeError) as error:
            raise ValueError(
                f"ModelCheckpoint(filename={template!r}) cannot format {key}={value!r} with "
                f"{match.group(0)!r}: {error}."
            ) from None
        return f"{key}{equals}{text}" if equals is not None else text

    name = TEMPLATE_FIELD.sub(fill, template)
    # "/" in a metric name or a formatted value must not move the file out of ``dirpath``.
    for separator in _SEPARATORS:
        name = name.replace(separator, "_")
    return name


# ---------------------------------------------------------------------------- name templates
@lru_cache(maxsize=64)
def check_template(template: str, argument: str = "filename") -> None:
    """Raise ValueError when ``template`` cannot name a checkpoint file directly inside ``dirpath``."""
    where = f"ModelCheckpoint({argument}={template!r})"
    if not template:
        raise ValueError(
            f"{where}: the name template is empty; leave `{argument}` as None for the default '{{epoch}}-{{step}}'."
        )
    if "\0" in template:
        raise ValueError(f"{where}: the name template holds a NUL character, which no file name may contain.")
    position = 0
    sample = []
    for match in TEMPLATE_FIELD.finditer(template):
        sample.append(_checked_literal(template[position : match.start()], where))
        sample.append(_checked_field(match, where))
        position = match.end()
    sample.append(_checked_literal(template[position:], where))
    name = "".join(sample)
    if name.startswith("."):
        raise ValueError(
            f"{where}: names starting with '.' are the hidden temporary files of atomic writes (ckpt_path='auto' never"
            " resumes from them); start the template with another character."
        )
    if len(f"{name}-v99{FILE_EXTENSION}".encode()) > _MAX_NAME_BYTES:
        raise ValueError(
            f"{where}: a name made from it (e.g. {name!r}) is longer than the {_MAX_NAME_BYTES} bytes file "
            f"systems accept."
        )


def _checked_literal(text: str, where: str) -> str:
    if "{" in text or "}" in text:
        raise ValueError(
            f"{where}: unbalanced, empty or nested brace in {text!r}. Fields are written '{{name}}',"
            " '{name:format_spec}' or '{name!r}', e.g. '{epoch}-{val_loss:.2f}'; literal braces are not supported."
        )
    for separator in _SEPARATORS:
        if separator in text:
            raise ValueError(
                f"{where}: the path separator {separator!r} would put checkpoints outside dirpath; the template names a"
                " file directly inside dirpath (choose the folder with `dirpath`)."
            )
    return text


def _checked_field(match: re.Match, where: str) -> str:
    key, conversion, spec = match.group(1), match.group(2), match.group(3) or ""
    if key != key.strip():
        raise ValueError(
            f"{where}: the field {match.group(0)!r} has spaces around its name {key!r}; write '{{{key.strip()}}}'."
        )
    if conversion is not None and conversion not in _CONVERSIONS:
        raise ValueError(f"{where}: the conversion '!{conversion}' in {match.group(0)!r} is not one of !r, !s, !a.")
    # Metrics are numbers: a spec is valid when it formats an int or a float (epoch and step are ints).
    samples: tuple[Any, ...] = (3,) if key in _INTEGER_FIELDS else (0.125, 3)
    error: Exception | None = None
    for value in samples:
        try:
            return format_field(conversion, spec, value)
        except (ValueError, TypeError) as caught:
            error = caught
    kind = "an int" if key in _INTEGER_FIELDS else "a number"
    raise ValueError(f"{where}: the format spec {spec!r} of field {match.group(0)!r} cannot format {kind}: {error}.")


# ---------------------------------------------------------------------------- other arguments
def check_arguments(
    dirpath: Any, filename: Any, monitor: Any, save_top_k: Any, mode: Any, every_n_train_steps: Any, every_n_epochs: Any
) -> None:
    """Refuse bad ModelCheckpoint arguments at construction rather than at the first save, an epoch later."""
    if mode not in ("min", "max"):
        raise ValueError(f"`mode` must be 'min' or 'max', got {mode!r}.")
    if not is_int_at_least(save_top_k, -1):
        raise ValueError(
            f"`save_top_k` must be an int >= -1 (-1: keep all, 0: keep none, k: keep the best k), got {save_top_k!r}."
        )
    if monitor is not None and not isinstance(monitor, str):
        raise TypeError(f"`monitor` must be a metric name (a str) or None, got {type(monitor).__name__}.")
    if monitor == "":
        raise ValueError("`monitor` must be a metric name or None, got ''.")
    if monitor is None and save_top_k not in (-1, 0, 1):
        raise ValueError(
            f"ModelCheckpoint(save_top_k={save_top_k}, monitor=None) cannot rank checkpoints: set `monitor` to a"
            " logged metric, or use save_top_k=1 (keep the newest) or save_top_k=-1 (keep all)."
        )
    for name, value in (("every_n_train_steps", every_n_train_steps), ("every_n_epochs", every_n_epochs)):
        if value is not None and not is_int_at_least(value, 0):
            raise ValueError(f"`{name}` must be None or an int >= 0, got {value!r}.")
    if (every_n_train_steps or 0) > 0 and (every_n_epochs or 0) > 0:
        raise ValueError(
            f"`every_n_train_steps={every_n_train_steps}` and `every_n_epochs={every_n_epochs}` are mutually"
            " exclusive: set only one of them."
        )
    check_dirpath(dirpath)
    if filename is not None:
        if not isinstance(filename, str):
            raise TypeError(f"`filename` must be a str template or None, got {type(filename).__name__}.")
        check_template(filename)


def restored_score(value: Any, where: str) -> Tensor | None:
    """A score from a checkpoint's callback state as a 0-dim float tensor (None stays None); refuses non-numbers."""
    if value is None:
        return None
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not is_number and not (isinstance(value, Tensor) and value.numel() == 1 and not value.is_complex()):
        raise CheckpointError(
            f"The ModelCheckpoint state in this checkpoint holds {where}={value!r}; a score must be a number or a"
            " one-element tensor. The checkpoint is damaged or was not written by ModelCheckpoint."
        )
    if isinstance(value, Tensor):
        score = value.detach().reshape(()).cpu().clone()
        return score if score.is_floating_point() else score.double()
    return torch.tensor(float(value), dtype=torch.float64)


def local_parameters_finite(module: torch.nn.Module) -> bool:
    """Whether this process's part of every floating parameter is finite (one device sync per device)."""
    flags: dict[torch.device, list[Tensor]] = {}
    for parameter in module.parameters():
        # DeepSpeed ZeRO-3 keeps this rank's partition in ``ds_tensor`` (the parameter itself is empty); a DTensor
        # (FSDP) is checked through its local shard, without a collective.
        local = getattr(parameter, "ds_tensor", None)
        if local is None:
            local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
        local = local.detach()
        if local.device.type == "meta" or local.numel() == 0 or not (local.is_floating_point() or local.is_complex()):
            continue
        flags.setdefault(local.device, []).append(torch.isfinite(local).all())
    return all(bool(torch.stack(group).all()) for group in flags.values())


def check_flags(**flags: Any) -> None:
    """Raise TypeError unless every flag is a bool (``save_last`` and ``save_on_train_epoch_end`` may be None).

    ``save_last`` may also be ``"link"``.
    """
    for name, value in flags.items():
        if name == "save_last":
            if value is None or isinstance(value, bool) or (isinstance(value, str) and value == "link"):
                continue
            raise TypeError(
                "`save_last` must be True, False, None or 'link' (last.ckpt as a symbolic link to the newest"
                f" checkpoint), got {value!r}."
            )
        allow_none = name == "save_on_train_epoch_end"
        if not isinstance(value, bool) and not (allow_none and value is None):
            allowed = "True, False or None" if allow_none else "True or False"
            raise TypeError(f"`{name}` must be {allowed}, got {value!r}.")


def check_time_interval(train_time_interval: Any, every_n_train_steps: Any, every_n_epochs: Any) -> None:
    """Refuse a ``train_time_interval`` that is not a ``timedelta`` >= 0, or one set together with another trigger."""
    if train_time_interval is None:
        return
    if not isinstance(train_time_interval, timedelta):
        raise TypeError(
            f"`train_time_interval` must be a datetime.timedelta (e.g. timedelta(minutes=30)) or None, got"
            f" {type(train_time_interval).__name__} {train_time_interval!r}."
        )
    if train_time_interval < timedelta(0):
        raise ValueError(f"`train_time_interval` must not be negative, got {train_time_interval!r}.")
    others = [
        f"{name}={value!r}"
        for name, value in (("every_n_train_steps", every_n_train_steps), ("every_n_epochs", every_n_epochs))
        if value
    ]
    if others:
        raise ValueError(
            f"`train_time_interval={train_time_interval!r}` and `{others[0]}` are mutually exclusive: set only one"
            " trigger per ModelCheckpoint (use several callbacks to save on several triggers)."
        )


def check_dirpath(dirpath: Any) -> None:
    """Raise unless ``dirpath`` is None, a URL, or a local path that is (or can become) a folder."""
    if dirpath is None:
        return
    if not isinstance(dirpath, (str, os.PathLike)):
        raise TypeError(f"`dirpath` must be a str, an os.PathLike or None, got {type(dirpath).__name__}.")
    path = os.fspath(dirpath)
    if not path or "\0" in path:
        raise ValueError(
            f"`dirpath` must name a folder, got {path!r}; leave it None for the default (log_dir/checkpoints)."
        )
    if not is_url(path) and os.path.lexists(path) and not os.path.isdir(path):
        raise ValueError(f"`dirpath` {path!r} exists and is not a folder; checkpoints are written into a folder.")


def restored_entries(state: dict[str, Any], dirpath: str) -> tuple[dict[str, Tensor], dict[str, Any], list[str]]:
    """The checked entries of a ModelCheckpoint state: (best_k_models, other paths and scores, dropped entries).

    A path that is not a '*.ckpt' entry directly inside ``dirpath`` becomes "" (or leaves ``best_k_models``) and is
    listed in the third item; a score that is not a number raises CheckpointError.
    """
    dropped: list[str] = []

    def inside(where: str, path: Any) -> str:
        if path is None or (isinstance(path, str) and not path):
            return ""
        target = checkpoint_in_folder(path, dirpath)
        if target is None:
            dropped.append(f"{where}={path!r}")
            return ""
        return target

    best_k = state.get("best_k_models") or {}
    if not isinstance(best_k, dict):
        raise CheckpointError(
            f"The ModelCheckpoint state's best_k_models is a {type(best_k).__name__}, not a dict of path: score."
        )
    kept: dict[str, Tensor] = {}
    for path, score in best_k.items():
        checked = restored_score(score, f"best_k_models[{path!r}]")
        target = inside("best_k_models", path)
        if target and checked is not None:
            kept[target] = checked
    entries = {
        name: inside(name, state.get(name)) for name in ("best_model_path", "last_model_path", "kth_best_model_path")
    }
    for name in ("best_model_score", "current_score", "kth_value"):
        entries[name] = restored_score(state.get(name), name)
    return kept, entries, dropped
