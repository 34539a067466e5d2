"""HivemindStrategy's arguments, checked before anything starts, and those a launch may set by environment."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

#: Environment variables read when the matching argument is not given (the strategy picked by name, a second peer
#: started with the same script).
INITIAL_PEERS_ENV = "PHALANX_HIVEMIND_INITIAL_PEERS"
TARGET_BATCH_SIZE_ENV = "PHALANX_HIVEMIND_TARGET_BATCH_SIZE"
RUN_ID_ENV = "PHALANX_HIVEMIND_RUN_ID"

DEFAULT_RUN_ID = "phalanx_run"
#: hivemind's compression classes by name (8-bit blockwise quantization needs bitsandbytes and is left out).
COMPRESSIONS = {
    "none": "NoCompression",
    "float16": "Float16Compression",
    "scaled_float16": "ScaledFloat16Compression",
    "uniform8bit": "Uniform8BitQuantization",
    "quantile8bit": "Quantile8BitQuantization",
}


def positive_int(name: str, value: Any) -> int:
    """``value`` if it is an int >= 1, else ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"HivemindStrategy({name}={value!r}) must be an int >= 1.")
    return value


def positive_seconds(name: str, value: Any) -> float:
    """``value`` as a float if it is a finite number > 0, else ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"HivemindStrategy({name}={value!r}) must be a number of seconds > 0.")
    return float(value)


def flag(name: str, value: Any) -> bool:
    """``value`` if it is a bool, else TypeError naming ``name``."""
    if not isinstance(value, bool):
        raise TypeError(f"HivemindStrategy({name}={value!r}) must be True or False.")
    return value


def addresses(name: str, value: Any) -> list[str] | None:
    """A list of multiaddress strings from a list, a tuple or one comma-separated string (None stays None)."""
    if value is None:
        return None
    if isinstance(value, str):
        items = [part.strip() for part in value.split(",") if part.strip()]
    elif isinstance(value, Sequence):
        items = [str(part) for part in value]
    else:
        raise TypeError(
            f"HivemindStrategy({name}={value!r}) must be a list of multiaddresses (e.g. ['/ip4/127.0.0.1/tcp/31337/p2p/"
            "Qm...']) or one comma-separated string."
        )
    bad = [item for item in items if not item.startswith("/")]
    if bad:
        raise ValueError(
            f"HivemindStrategy({name}=...) holds {bad[0]!r}, which is not a multiaddress: each starts with '/', such"
            " as '/ip4/203.0.113.5/tcp/31337/p2p/12D3KooW...'."
        )
    return items


def target_batch_size(value: Any) -> int:
    """The argument, or the environment variable when it is None; ValueError when neither is set."""
    if value is not None:
        return positive_int("target_batch_size", value)
    text = os.environ.get(TARGET_BATCH_SIZE_ENV)
    if text is None:
        raise ValueError(
            "HivemindStrategy needs target_batch_size (the number of samples the whole swarm accumulates before each"
            f" optimizer step): pass target_batch_size=... or set {TARGET_BATCH_SIZE_ENV}."
        )
    try:
        return positive_int(TARGET_BATCH_SIZE_ENV, int(text))
    except ValueError:
        raise ValueError(f"{TARGET_BATCH_SIZE_ENV}={text!r} must be an int >= 1.") from None


def run_id(value: Any) -> str:
    """The argument, the environment variable, or the default run id."""
    value = value if value is not None else os.environ.get(RUN_ID_ENV, DEFAULT_RUN_ID)
    if not isinstance(value, str) or not value or any(ch.isspace() for ch in value):
        raise ValueError(
            f"HivemindStrategy(run_id={value!r}) must be a non-empty string without spaces: every peer of one"
            " training run uses the same run_id."
        )
    return value


def initial_peers(value: Any) -> list[str]:
    """The argument, or the comma-separated environment variable; empty when this peer starts a new swarm."""
    if value is None:
        value = os.environ.get(INITIAL_PEERS_ENV)
        if value is None:
            return []
        return addresses(INITIAL_PEERS_ENV, value) or []
    return addresses("initial_peers", value) or []


def compression(name: str, value: Any) -> Any:
    """A compression name from ``COMPRESSIONS`` or a hivemind ``CompressionBase`` instance (checked by duck type)."""
    if isinstance(value, str):
        if value.lower() not in COMPRESSIONS:
            raise ValueError(
                f"HivemindStrategy({name}={value!r}) is not a known compression; choose one of"
                f" {sorted(COMPRESSIONS)} or pass a hivemind.compression.CompressionBase instance."
            )
        return value.lower()
    if callable(getattr(value, "compress", None)) and callable(getattr(value, "extract", None)):
        return value
    raise TypeError(
        f"HivemindStrategy({name}={value!r}) must be one of {sorted(COMPRESSIONS)} or a"
        " hivemind.compression.CompressionBase instance."
    )


def make_compression(value: Any) -> Any:
    """The hivemind compression object for a checked ``compression`` value (imports hivemind)."""
    if not isinstance(value, str):
        return value
    import hivemind.compression

    return getattr(hivemind.compression, COMPRESSIONS[value])()


def check_delays(
    offload_optimizer: bool, delay_optimizer_step: bool, delay_grad_averaging: bool, delay_state_averaging: bool
) -> None:
    """hivemind's rules for the delayed modes, as ValueErrors naming the option to add."""
    if delay_grad_averaging and not delay_optimizer_step:
        raise ValueError("HivemindStrategy(delay_grad_averaging=True) needs delay_optimizer_step=True as well.")
    if delay_optimizer_step and not offload_optimizer:
        raise ValueError("HivemindStrategy(delay_optimizer_step=True) needs offload_optimizer=True as well.")
    if delay_optimizer_step and not delay_state_averaging:
        raise ValueError("HivemindStrategy(delay_optimizer_step=True) needs delay_state_averaging=True as well.")


def check_local_updates(use_local_updates: bool, delay_grad_averaging: bool, grad_compression: Any) -> None:
    """Local updates average parameters, never gradients: refuse gradient options that would be ignored."""
    if not use_local_updates:
        return
    if delay_grad_averaging:
        raise ValueError(
            "HivemindStrategy(use_local_updates=True) steps on local gradients and averages parameters only; it"
            " cannot be combined with delay_grad_averaging=True."
        )
    if grad_compression != "none":
        raise ValueError(
            "HivemindStrategy(use_local_updates=True) never averages gradients, so grad_compression has no effect;"
            " leave it at 'none' (state_compression applies to the averaged parameters)."
        )


def ratio(name: str, value: Any) -> float | None:
    """``value`` as a float if it is a finite number >= 1 (an average is never larger than its largest part), or None
    (the check is off); else ValueError naming ``name``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 1 <= value < float("inf"):
        raise ValueError(
            f"HivemindStrategy({name}={value!r}) must be a finite number >= 1, or None to accept averaged values of"
            " any finite size."
        )
    return float(value)


#: The methods of hivemind's AuthorizerBase (hivemind.utils.auth), checked by duck type so that hivemind is not
#: imported when the strategy is built.
AUTHORIZER_METHODS = ("sign_request", "validate_request", "sign_response", "validate_response")


def authorizer(value: Any) -> Any:
    """None or a hivemind ``AuthorizerBase`` (by duck type: its four methods); else TypeError."""
    if value is None or all(callable(getattr(value, method, None)) for method in AUTHORIZER_METHODS):
        return value
    raise TypeError(
        f"HivemindStrategy(authorizer={value!r}) must be a hivemind.utils.auth.AuthorizerBase (with methods"
        f" {', '.join(AUTHORIZER_METHODS)}), such as a TokenAuthorizerBase subclass, or None."
    )
