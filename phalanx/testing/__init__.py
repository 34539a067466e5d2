"""A conformance kit for Strategy authors: point it at your Strategy and it checks the contract the Trainer relies on.

    from phalanx.testing import check_strategy

    def test_my_strategy_conforms():
        check_strategy(MyStrategy, processes=2)  # raises StrategyConformanceError listing every failed check

Each run starts ``processes`` CPU processes (gloo) once and runs every check in them, through two drivers: the Trainer
(``Trainer.fit`` with its defaults on: lifecycle order, module hooks, no-sync, teardown, reduce / all_gather /
broadcast / barrier / reduce_boolean_decision, a save -> load round trip) and the Cohort (a hand-written loop:
lifecycle order, no-sync, ``cohort.save`` -> ``cohort.load`` -> resume). ``run_conformance`` returns the report per
driver instead of raising, for one pytest test per check (see ``CHECKS_BY_DRIVER``).
Not imported by ``import phalanx``; its names load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_PUBLIC = {
    "CHECKS": "phalanx.testing.report",
    "CHECKS_BY_DRIVER": "phalanx.testing.report",
    "COHORT_CHECKS": "phalanx.testing.report",
    "DRIVERS": "phalanx.testing.report",
    "CheckResult": "phalanx.testing.report",
    "ConformanceReport": "phalanx.testing.report",
    "NotApplicable": "phalanx.testing.report",
    "StrategyConformanceError": "phalanx.testing.report",
    "check_strategy": "phalanx.testing.runner",
    "run_conformance": "phalanx.testing.runner",
    "check_all_gather": "phalanx.testing.collectives",
    "check_barrier": "phalanx.testing.collectives",
    "check_broadcast": "phalanx.testing.collectives",
    "check_reduce": "phalanx.testing.collectives",
    "check_reduce_boolean_decision": "phalanx.testing.collectives",
    "ConformanceModule": "phalanx.testing.module",
}

if TYPE_CHECKING:
    from phalanx.testing.collectives import (
        check_all_gather,
        check_barrier,
        check_broadcast,
        check_reduce,
        check_reduce_boolean_decision,
    )
    from phalanx.testing.module import ConformanceModule
    from phalanx.testing.report import (
        CHECKS,
        CHECKS_BY_DRIVER,
        COHORT_CHECKS,
        DRIVERS,
        CheckResult,
        ConformanceReport,
        NotApplicable,
        StrategyConformanceError,
    )
    from phalanx.testing.runner import check_strategy, run_conformance


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'phalanx.testing' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})


__all__ = [
    "CHECKS",
    "CHECKS_BY_DRIVER",
    "COHORT_CHECKS",
    "DRIVERS",
    "CheckResult",
    "ConformanceModule",
    "ConformanceReport",
    "NotApplicable",
    "StrategyConformanceError",
    "check_all_gather",
    "check_barrier",
    "check_broadcast",
    "check_reduce",
    "check_reduce_boolean_decision",
    "check_strategy",
    "run_conformance",
]
