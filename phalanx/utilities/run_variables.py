"""What ``phalanx run`` tells the Cohorts of the script it launches: its settings, through environment variables."""

from __future__ import annotations

import os
from typing import Any

#: Set to "1" in every process ``phalanx run`` starts (and in the one it runs the script in).
RUN_MARKER = "PHALANX_RUN"
#: Cohort argument -> the variable through which ``phalanx run --<argument>`` sets it.
RUN_VARIABLES = {
    "accelerator": "PHALANX_RUN_ACCELERATOR",
    "strategy": "PHALANX_RUN_STRATEGY",
    "devices": "PHALANX_RUN_DEVICES",
    "num_nodes": "PHALANX_RUN_NUM_NODES",
    "precision": "PHALANX_RUN_PRECISION",
}
#: The Cohort's defaults for those arguments: code that leaves one at its default takes the command line's value.
COHORT_DEFAULTS: dict[str, Any] = {
    "accelerator": "auto",
    "strategy": "auto",
    "devices": "auto",
    "num_nodes": 1,
    "precision": "32-true",
}


def devices_text(devices: int | str | list[int]) -> str:
    """``devices`` as ``phalanx run`` writes it into its variable (a list as '0,1')."""
    return ",".join(str(index) for index in devices) if isinstance(devices, list) else str(devices)


def _parsed(name: str, text: str) -> Any:
    if name == "num_nodes":
        return int(text)
    if name == "devices":
        if "," in text:
            return [int(part) for part in text.split(",") if part.strip()]
        stripped = text.strip()
        return int(stripped) if stripped.lstrip("-").isdigit() else stripped
    return text


def _same(value: Any, other: Any) -> bool:
    if isinstance(value, (bool, int, str, list)) and isinstance(other, (int, str, list)):
        return value == other or (not isinstance(value, list) and str(value) == str(other))
    return False  # an object (a Strategy, an Accelerator instance) is never the command line's name


def settings_from_run(given: dict[str, Any]) -> dict[str, Any]:
    """``given`` (a Cohort's accelerator, strategy, devices, num_nodes and precision) with the values ``phalanx run``
    set; outside ``phalanx run``, ``given`` unchanged.

    An argument the code sets to another value than both its default and the command line's raises ValueError: the
    run would otherwise differ from what one of them says.
    """
    if os.environ.get(RUN_MARKER) != "1":
        return given
    settings = dict(given)
    for name, variable in RUN_VARIABLES.items():
        text = os.environ.get(variable)
        if text is None:
            continue
        value = _parsed(name, text)
        current = given[name]
        if not _same(current, COHORT_DEFAULTS[name]) and not _same(current, value):
            flag = "--" + name.replace("_", "-")
            raise ValueError(
                f"Cohort({name}={current!r}) conflicts with {flag} {text} given to phalanx run; remove it from the"
                f" Cohort(...) call or from the command line."
            )
        settings[name] = value
    return settings
