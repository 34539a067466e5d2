"""The DeepSpeed config of a run: the user's (dict, JSON file or environment), or one made from the strategy's
arguments, completed from the run's settings (accumulation, clipping, batch size) and the precision plugin."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any, Callable

from phalanx.strategies.deepspeed._activation import merge_activation_section
from phalanx.strategies.settings import RunSettings
from phalanx.utilities.rank_zero import rank_zero_info

#: Environment variable naming a DeepSpeed JSON config, used when ``config`` is not given.
CONFIG_ENV_VAR = "PHALANX_DEEPSPEED_CONFIG_PATH"
_STAGE_1_KEYS = (
    "contiguous_gradients",
    "overlap_comm",
    "allgather_partitions",
    "reduce_scatter",
    "allgather_bucket_size",
    "reduce_bucket_size",
)
_OFFLOAD_DEVICES = ("cpu", "nvme")
_REMOTE_DEVICES = (None, "cpu", "nvme")


def load_config(config: dict[str, Any] | str | os.PathLike | None) -> dict[str, Any] | None:
    """The user's DeepSpeed config: a dict, a JSON file, or the file named by PHALANX_DEEPSPEED_CONFIG_PATH."""
    source = "config"
    if config is None:
        config = os.environ.get(CONFIG_ENV_VAR) or None
        source = CONFIG_ENV_VAR
        if config is None:
            return None
    if isinstance(config, dict):
        return copy.deepcopy(config)
    if not isinstance(config, (str, os.PathLike)):
        raise TypeError(f"config must be a dict or the path of a DeepSpeed JSON file, got {type(config).__name__}.")
    path = Path(config)
    if not path.is_file():
        raise FileNotFoundError(f"The DeepSpeed config file given by {source} does not exist: {str(path)!r}.")
    try:
        loaded = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(
            f"The DeepSpeed config file {str(path)!r} (from {source}) is not valid JSON: {error}"
        ) from None
    if not isinstance(loaded, dict):
        raise ValueError(
            f"The DeepSpeed config file {str(path)!r} must hold a JSON object, not a {type(loaded).__name__}."
        )
    return loaded


def zero_settings(
    *, stage: int, remote_device: str | None, offload_optimizer: bool, offload_parameters: bool, **settings: Any
) -> dict[str, Any]:
    """The ZeRO ``settings`` by argument name (``nvme_path`` as a str), once the offload arguments fit ``stage``."""
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage!r} is not a ZeRO stage; choose 0, 1, 2 or 3.")
    for name in ("offload_params_device", "offload_optimizer_device"):
        if settings[name] not in _OFFLOAD_DEVICES:
            raise ValueError(f"{name}={settings[name]!r} is not valid; choose one of {list(_OFFLOAD_DEVICES)}.")
    if remote_device not in _REMOTE_DEVICES:
        raise ValueError(f"remote_device={remote_device!r} is not valid; choose one of {list(_REMOTE_DEVICES)}.")
    if offload_optimizer and stage == 0:
        raise ValueError(
            "offload_optimizer=True needs ZeRO stage 1, 2 or 3 (stage=0 does not partition the optimizer)."
        )
    if offload_parameters and stage != 3:
        raise ValueError(
            f"offload_parameters=True needs ZeRO stage 3 (only stage 3 partitions parameters); got stage={stage}."
        )
    if remote_device is not None and stage != 3:
        raise ValueError(f"remote_device={remote_device!r} applies to ZeRO stage 3 only; got stage={stage}.")
    uses_nvme = "nvme" in (
        remote_device,
        settings["offload_params_device"] if offload_parameters else None,
        settings["offload_optimizer_device"] if offload_optimizer else None,
    )
    if uses_nvme and not str(settings["nvme_path"] or ""):
        raise ValueError("Offloading to 'nvme' needs nvme_path= (a directory on a fast local NVMe drive).")
    return {**settings, "nvme_path": str(settings["nvme_path"])}


def checked_flag(name: str, value: Any) -> bool:
    """``value`` when it is True or False (TypeError naming the argument ``name`` otherwise)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}.")
    return value


def checked_gradient_clipping(gradient_clipping: Any, config: dict[str, Any] | None) -> float | None:
    """``DeepSpeedStrategy(gradient_clipping=...)`` as a float (None: not given), written into the given ``config``,
    which must not set another value."""
    if gradient_clipping is None:
        return None
    if isinstance(gradient_clipping, bool) or not isinstance(gradient_clipping, (int, float)) or gradient_clipping < 0:
        raise ValueError(
            f"DeepSpeedStrategy(gradient_clipping={gradient_clipping!r}) must be a number >= 0 (the total gradient"
            " norm to clip to; 0 does not clip) or None."
        )
    value = float(gradient_clipping)
    if config is not None:
        given = config.get("gradient_clipping")
        if given is not None and given != value:
            raise ValueError(
                f"DeepSpeedStrategy(gradient_clipping={gradient_clipping!r}) conflicts with the config's"
                f" gradient_clipping={given!r}; set it in one place."
            )
        config["gradient_clipping"] = value
    return value


def checked_logging_batch_size(logging_batch_size_per_gpu: Any) -> int | str:
    """``logging_batch_size_per_gpu`` when it is 'auto' or an int >= 1 (ValueError otherwise)."""
    if logging_batch_size_per_gpu != "auto" and (
        isinstance(logging_batch_size_per_gpu, bool)
        or not isinstance(logging_batch_size_per_gpu, int)
        or logging_batch_size_per_gpu < 1
    ):
        raise ValueError(f"logging_batch_size_per_gpu={logging_batch_size_per_gpu!r} must be 'auto' or an int >= 1.")
    return logging_batch_size_per_gpu


def generated_config(
    stage: int,
    zero: dict[str, Any],
    *,
    offload_optimizer: bool,
    offload_parameters: bool,
    allow_untested_optimizer: bool,
    activation: dict[str, Any],
    gradient_clipping: float | None = None,
) -> dict[str, Any]:
    """The config the strategy's arguments make: the ZeRO section (``zero``: the ZeRO settings by argument name)."""
    section: dict[str, Any] = {"stage": stage}
    if stage > 0:
        section.update({key: zero[key] for key in _STAGE_1_KEYS})
    if stage == 3:
        section["sub_group_size"] = zero["sub_group_size"]
        section["stage3_param_persistence_threshold"] = zero["param_persistence_threshold"]
    if offload_optimizer:
        section["offload_optimizer"] = {
            "device": zero["offload_optimizer_device"], "nvme_path": zero["nvme_path"],
            "buffer_count": zero["optimizer_buffer_count"], "pin_memory": zero["pin_memory"],
        }  # fmt: skip
    if offload_parameters:
        section["offload_param"] = {
            "device": zero["offload_params_device"],
            "nvme_path": zero["nvme_path"],
            "buffer_count": zero["params_buffer_count"],
            "buffer_size": zero["params_buffer_size"],
            "max_in_cpu": zero["max_in_cpu"],
            "pin_memory": zero["pin_memory"],
        }
    generated: dict[str, Any] = {
        "zero_optimization": section,
        "zero_allow_untested_optimizer": allow_untested_optimizer,
    }
    if gradient_clipping is not None:
        generated["gradient_clipping"] = gradient_clipping
    merge_activation_section(generated, activation)
    return generated


def complete_config(
    config: dict[str, Any],
    settings: RunSettings,
    *,
    micro_batch_size: Callable[[], int],
    precision_sections: dict[str, Any],
    precision: str,
) -> dict[str, Any]:
    """Fill ``config`` in place from the run's settings and the precision, refusing what contradicts them; return it.

    ``micro_batch_size`` is asked only when fitting with a config that does not set the batch size itself.
    """
    accumulate = settings.accumulate_grad_batches
    given = config.get("gradient_accumulation_steps")
    if given is not None and given != accumulate:
        raise ValueError(
            f"The DeepSpeed config sets gradient_accumulation_steps={given!r} but the Trainer has"
            f" accumulate_grad_batches={accumulate};"
            " set it once, with Trainer(accumulate_grad_batches=...)."
        )
    config["gradient_accumulation_steps"] = accumulate
    clip_val = settings.gradient_clip_val
    if clip_val:
        if settings.gradient_clip_algorithm != "norm":
            raise ValueError(
                "DeepSpeed clips gradients by norm only: use gradient_clip_algorithm='norm' (or leave it unset) with"
                " gradient_clip_val."
            )
        if config.get("gradient_clipping") not in (None, clip_val):
            raise ValueError(
                f"The DeepSpeed config sets gradient_clipping={config['gradient_clipping']!r} but the Trainer has"
                f" gradient_clip_val={clip_val}; set it in one place."
            )
        config["gradient_clipping"] = float(clip_val)
    # DeepSpeed clips to 1.0 unless told otherwise; phalanx clips only when asked.
    config.setdefault("gradient_clipping", 0.0)
    if "train_micro_batch_size_per_gpu" not in config and "train_batch_size" not in config:
        config["train_micro_batch_size_per_gpu"] = micro_batch_size() if settings.fitting else 1
    for key in ("fp16", "bf16"):
        if key in config:
            enabled = bool((config[key] or {}).get("enabled", False))
            if enabled != (key in precision_sections):
                state = "enables" if enabled else "disables"
                raise ValueError(
                    f"The DeepSpeed config {state} '{key}' but the precision is {precision!r}; remove '{key}' from the"
                    " config and choose the precision with Trainer(precision=...)."
                )
        elif key in precision_sections:
            config[key] = precision_sections[key]
    return config


def partitioning_config(config: dict[str, Any]) -> dict[str, Any]:
    """The part of ``config`` that partitions parameters (ZeRO-3 creation and evaluation engines), without training
    settings."""
    partitioning: dict[str, Any] = {
        key: config[key]
        for key in ("zero_optimization", "fp16", "bf16", "zero_allow_untested_optimizer")
        if key in config
    }
    partitioning["train_micro_batch_size_per_gpu"] = 1  # DeepSpeed validates it; nothing here uses it
    return partitioning


def micro_batch_size(logging_batch_size_per_gpu: int | str, settings: RunSettings) -> int:
    """The per-process batch size DeepSpeed's config (and throughput logs) wants: the argument's, else the training
    data's."""
    if isinstance(logging_batch_size_per_gpu, int):
        return logging_batch_size_per_gpu
    if settings.train_batch_size is not None:
        return settings.train_batch_size
    rank_zero_info(
        "DeepSpeed: the training dataloader's batch size is unknown; DeepSpeed's throughput logs assume 1 (set"
        " DeepSpeedStrategy(logging_batch_size_per_gpu=...))."
    )
    return 1


__all__ = [
    "CONFIG_ENV_VAR",
    "checked_flag",
    "checked_gradient_clipping",
    "checked_logging_batch_size",
    "complete_config",
    "generated_config",
    "load_config",
    "micro_batch_size",
    "partitioning_config",
    "zero_settings",
]
