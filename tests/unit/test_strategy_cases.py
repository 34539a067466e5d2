"""tests/strategy_cases.py against the registry: every registered built-in strategy has its row (or is in the XLA tier),
every row names a registered strategy of its class, and every declared guarantee belongs to a suite that exists. A
strategy missing from the table fails here, once; the suites in tests/distributed run the rows that promise theirs."""

from __future__ import annotations

from pathlib import Path

import pytest
from strategy_cases import CASES, FAULT_TOLERANT_TIER, SUITES, XLA_TIER, case, names, promising

from phalanx.strategies import STRATEGY_REGISTRY

DISTRIBUTED = Path(__file__).resolve().parents[1] / "distributed"


def _built_ins() -> dict[str, str]:
    """Registry name -> class name of every strategy phalanx itself registers."""
    found = {}
    for name in STRATEGY_REGISTRY.available():
        cls = STRATEGY_REGISTRY.get_class(name)
        if isinstance(cls, type) and cls.__module__.startswith("phalanx.strategies."):
            found[name] = cls.__name__
    return found


def test_every_registered_built_in_has_a_row_or_is_in_the_xla_or_fault_tolerant_tier():
    missing = sorted(set(_built_ins()) - {row.name for row in CASES} - set(XLA_TIER) - set(FAULT_TOLERANT_TIER))
    assert not missing, f"add a row to tests/strategy_cases.py for {missing} (what it promises, how the kit builds it)"


@pytest.mark.parametrize("row", CASES, ids=lambda row: row.name)
def test_each_row_names_a_registered_strategy_of_its_class(row):
    assert _built_ins().get(row.name) == row.strategy_class


@pytest.mark.parametrize("row", CASES, ids=lambda row: row.name)
def test_each_row_promises_known_guarantees_or_names_what_it_varies(row):
    assert row.promises <= set(SUITES)
    assert bool(row.promises) != bool(row.variant_of), "a row promises guarantees, or names the row it varies"
    if row.variant_of is not None:
        assert case(row.variant_of).strategy_class == row.strategy_class
    assert ("conformance" in row.promises) == bool(row.kit), "the conformance promise comes with the kit's runs"


def test_every_built_in_class_passes_the_kit_through_some_row():
    kit_classes = {row.strategy_class for row in CASES if row.kit}
    assert kit_classes == {cls for name, cls in _built_ins().items() if name not in (*XLA_TIER, *FAULT_TOLERANT_TIER)}


@pytest.mark.parametrize("suite", SUITES)
def test_every_suite_exists_and_holds_some_strategy(suite):
    module, guarantee = SUITES[suite]
    assert (DISTRIBUTED / module).is_file() and guarantee
    assert promising(suite) and names(suite) == [row.name for row in promising(suite)]


def test_kit_run_ids_are_unique_and_picklable():
    import pickle

    runs = [run for row in CASES for run in row.kit]
    assert len({run.id for run in runs}) == len(runs)
    for run in runs:
        pickle.dumps(run.make)


def test_lookups_name_the_table_when_they_miss():
    with pytest.raises(KeyError, match="has no row in tests/strategy_cases.py"):
        case("no_such_strategy")
    with pytest.raises(KeyError, match="no suite 'nope'"):
        promising("nope")
