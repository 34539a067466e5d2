"""The conformance kit's parts that need no extra process: arguments, report merging, judging, the collective checks
on one process, and that ``import phalanx`` stays free of it. The multi-process runs are in tests/distributed."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch

from phalanx.strategies import SingleDeviceStrategy
from phalanx.testing import (
    CHECKS,
    CHECKS_BY_DRIVER,
    COHORT_CHECKS,
    DRIVERS,
    CheckResult,
    ConformanceReport,
    StrategyConformanceError,
    run_conformance,
)
from phalanx.testing.collectives import (
    check_all_gather,
    check_barrier,
    check_broadcast,
    check_reduce,
    check_reduce_boolean_decision,
)
from phalanx.testing.probes import differences, local_copy
from phalanx.testing.report import merge
from phalanx.testing.training import EXPECTED_HOOKS, EXPECTED_LIFECYCLE, _compact, sequence_problems


# ------------------------------------------------------------------ arguments are checked before anything starts
@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"processes": 0}, ValueError, r"processes=0 must be an int >= 1"),
        ({"processes": True}, ValueError, r"processes=True must be an int >= 1"),
        ({"processes": "2"}, ValueError, r"processes='2' must be an int >= 1"),
        ({"checks": ["reduce", "nope"]}, ValueError, r"\['nope'\]; choose from \['lifecycle', 'hooks'"),
        ({"drivers": ["trainer", "fabric"]}, ValueError, r"drivers=\['trainer', 'fabric'\] is not valid: \['fabric'\]"),
        ({"drivers": []}, ValueError, r"drivers=\[\] is not valid: empty; choose from \['trainer', 'cohort'\]"),
        ({"drivers": "cohort"}, TypeError, r"drivers='cohort' must be a list of driver names"),
        (
            {"drivers": ["cohort"], "checks": ["reduce"]},
            ValueError,
            r"checks=\['reduce'\] has no check that drivers=\['cohort'\] run",
        ),
        ({"checks": []}, ValueError, r"empty; choose from"),
        ({"checks": "reduce"}, TypeError, r"a list of check names, not a string"),
        ({"timeout": 0}, ValueError, r"timeout=0 must be a positive number"),
        ({"start_method": "thread"}, ValueError, r"start_method='thread' is not valid here; choose one of \['spawn'"),
        ({"resume_atol": -1.0}, ValueError, r"resume_atol=-1.0 must be a number >= 0"),
        (
            {"workdir": "/nonexistent/phalanx-kit"},
            ValueError,
            r"workdir='/nonexistent/phalanx-kit' is not an existing directory",
        ),
    ],
)
def test_bad_arguments_are_refused_by_name(options: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        run_conformance(SingleDeviceStrategy, **options)


@pytest.mark.parametrize(
    ("make_strategy", "match"), [(42, "got int"), (lambda: SingleDeviceStrategy(), "cannot be pickled")]
)
def test_make_strategy_must_be_callable_and_picklable_for_spawn(make_strategy: Any, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        run_conformance(make_strategy)


# ---------------------------------------------------------------------------- merging the ranks' results
def _rank(driver: str = "trainer", **checks: tuple[str, str]) -> dict[str, Any]:
    return {
        "checks": {
            f"{driver}/{name}": {"status": status, "message": message} for name, (status, message) in checks.items()
        },
        "fatal": None,
    }


@pytest.mark.parametrize(
    ("ranks", "stopped", "status", "message"),
    [
        ([_rank(reduce=("passed", "")), _rank(reduce=("passed", ""))], {}, "passed", ""),
        (
            [_rank(reduce=("skipped", "one process")), _rank(reduce=("skipped", "one process"))],
            {},
            "skipped",
            "one process",
        ),
        ([_rank(reduce=("skipped", "why")), _rank(reduce=("passed", ""))], {}, "passed", ""),
        ([_rank(reduce=("failed", "sum")), _rank(reduce=("failed", "sum"))], {}, "failed", "on every rank: sum"),
        ([_rank(reduce=("passed", "")), _rank(reduce=("failed", "a\nb"))], {}, "failed", "on rank 1:\n  a\n  b"),
        (
            [_rank(reduce=("passed", "")), None],
            {1: "stopped while running 'reduce'"},
            "failed",
            "on rank 1: did not finish: stopped while running 'reduce'",
        ),
        (
            [_rank(), {"checks": {}, "fatal": "boom"}],
            {},
            "failed",
            "on rank 0: did not finish: the worker ended without reporting it\non rank 1: did not finish: boom",
        ),
    ],
)
def test_a_check_fails_if_any_rank_failed_or_never_finished_it(
    ranks: list, stopped: dict, status: str, message: str
) -> None:
    report = merge("MyStrategy", 2, {"trainer": ("reduce",)}, ranks, stopped)
    assert report["reduce"] == report["trainer", "reduce"] == CheckResult("reduce", status, message)


def test_one_process_reports_carry_no_rank_header_and_failures_name_every_check() -> None:
    report = merge(
        "MyStrategy",
        1,
        {"trainer": ("lifecycle", "reduce", "barrier")},
        [_rank(lifecycle=("failed", "order"), reduce=("passed", ""), barrier=("failed", "no wait"))],
        {},
    )
    assert [result.name for result in report.failures] == ["lifecycle", "barrier"]
    text = report.describe_failures()
    assert text == "\n".join(
        [
            "MyStrategy failed 2 of 3 conformance checks on 1 process:",
            "  - trainer/lifecycle:",
            "      order",
            "  - trainer/barrier:",
            "      no wait",
        ]
    )
    with pytest.raises(StrategyConformanceError, match="check 'barrier' failed:\ntrainer/barrier:\n    no wait"):
        report.assert_passed("barrier")
    report.assert_passed("reduce")
    with pytest.raises(KeyError, match="No result for check 'hooks'"):
        report.assert_passed("hooks")
    assert issubclass(StrategyConformanceError, AssertionError)


def test_a_skipped_check_skips_the_pytest_test_that_asserts_it() -> None:
    report = ConformanceReport(
        "MyStrategy", 1, {("trainer", "no_sync"): CheckResult("no_sync", "skipped", "one process")}
    )
    with pytest.raises(pytest.skip.Exception, match="no_sync: one process"):
        report.assert_passed("no_sync")
    report.assert_passed()  # a skipped check is no failure


def test_a_report_of_both_drivers_names_the_driver_of_each_result() -> None:
    ranks = [
        {
            "checks": {
                **_rank(lifecycle=("passed", ""), checkpoint=("passed", ""))["checks"],
                **_rank("cohort", lifecycle=("passed", ""), checkpoint=("failed", "weights differ"))["checks"],
            },
            "fatal": None,
        }
    ]
    report = merge(
        "MyStrategy", 1, {"trainer": ("lifecycle", "checkpoint"), "cohort": ("lifecycle", "checkpoint")}, ranks, {}
    )
    assert report.drivers == ["trainer", "cohort"]
    assert [result.label for result in report.failures] == ["cohort/checkpoint"]
    assert report["cohort", "checkpoint"].message == "weights differ" and report["trainer", "checkpoint"].passed
    with pytest.raises(KeyError, match=r"check 'checkpoint' ran through \['trainer', 'cohort'\]; name the driver"):
        report["checkpoint"]  # noqa: B018 - the lookup raises
    report.assert_passed("checkpoint", driver="trainer")
    with pytest.raises(StrategyConformanceError, match="check 'checkpoint' failed:\ncohort/checkpoint:\n    weights"):
        report.assert_passed("checkpoint")
    with pytest.raises(StrategyConformanceError, match="failed 1 of 4 conformance checks"):
        report.assert_passed(driver="cohort")
    report.assert_passed(driver="trainer")
    assert report.summary().splitlines() == [
        "MyStrategy on 1 process:",
        "  through the trainer:",
        "    passed  lifecycle",
        "    passed  checkpoint",
        "  through the cohort:",
        "    passed  lifecycle",
        "    failed  checkpoint: weights differ",
    ]


# ---------------------------------------------------------------------------- judging
def test_sequence_problems_point_at_the_first_divergence_and_fold_repeated_cycles() -> None:
    seen = list(EXPECTED_LIFECYCLE)
    seen.insert(2, "setup_environment")
    (problem,) = sequence_problems("calls", EXPECTED_LIFECYCLE, seen)
    assert problem.startswith("calls: call #2 was 'setup_environment', expected 'setup'.")
    assert "[on_train_batch_start, training_step, backward, optimizer_step] x 4, on_train_end, teardown" in problem
    assert sequence_problems("calls", EXPECTED_LIFECYCLE, list(EXPECTED_LIFECYCLE)) == []
    (short,) = sequence_problems("hooks", EXPECTED_HOOKS, list(EXPECTED_HOOKS[:-1]))
    assert f"call #{len(EXPECTED_HOOKS) - 1} was 'nothing more', expected 'teardown'" in short
    assert _compact(["a", "b", "c", "d", "e", "b", "c", "d", "e", "f"]) == "a, [b, c, d, e] x 2, f"


@pytest.mark.parametrize(
    ("expected", "actual", "atol", "found"),
    [
        ({"w": torch.ones(2)}, {"w": torch.ones(2)}, 0.0, []),
        ({"w": torch.ones(2)}, {"w": torch.ones(2) + 1e-7}, 0.0, ["state['w']: values differ (largest difference"]),
        ({"w": torch.ones(2)}, {"w": torch.ones(2) + 1e-7}, 1e-6, []),
        (
            {"w": torch.ones(2)},
            {"w": torch.ones(3)},
            0.0,
            ["state['w']: shape/dtype (2,)/torch.float32 became (3,)/torch.float32"],
        ),
        ({"w": torch.ones(2)}, {"v": torch.ones(2)}, 0.0, ["state: keys ['w'] became ['v']"]),
        ({"g": [{"lr": 0.1, "betas": (0.9, 0.99)}]}, {"g": [{"lr": 0.1, "betas": [0.9, 0.99]}]}, 0.0, []),
        ({"g": [{"lr": 0.1}]}, {"g": [{"lr": 0.2}]}, 0.0, ["state['g'][0]['lr']: 0.1 became 0.2"]),
        ({"s": [1, 2]}, {"s": [1]}, 0.0, ["state['s']: 2 entries became 1"]),
        ({"t": torch.ones(1)}, {"t": 1.0}, 0.0, ["state['t']: Tensor became float"]),
    ],
)
def test_differences_compare_nested_state_exactly_unless_a_tolerance_is_given(
    expected: Any, actual: Any, atol: float, found: list[str]
) -> None:
    seen = differences(expected, actual, atol=atol)
    assert len(seen) == len(found) and all(
        text.startswith(prefix) for text, prefix in zip(seen, found, strict=False)
    ), seen


def test_local_copy_detaches_and_copies_tensors_in_nested_state() -> None:
    weight = torch.ones(2, requires_grad=True)
    copied = local_copy({"a": [weight, (3, "x")]})
    assert copied["a"][1] == [3, "x"] and not copied["a"][0].requires_grad
    with torch.no_grad():
        weight.add_(1)
    assert torch.equal(copied["a"][0], torch.ones(2))


# ---------------------------------------------------------------------------- the collective checks on one process
class _Doubling(SingleDeviceStrategy):
    def reduce(self, tensor: Any, group: Any = None, reduce_op: str | None = "mean") -> Any:
        return tensor * 2


class _NoOpValidation(SingleDeviceStrategy):
    def reduce(self, tensor: Any, group: Any = None, reduce_op: str | None = "mean") -> Any:
        return tensor  # accepts any reduce_op silently


class _Detaching(SingleDeviceStrategy):
    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        return tensor.detach()


class _Copying(SingleDeviceStrategy):
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return {"something": "else"}


class _Raising(SingleDeviceStrategy):
    def barrier(self, name: str | None = None) -> None:
        raise RuntimeError("no barrier here")


class _Inverting(SingleDeviceStrategy):
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002
        return not decision


@pytest.mark.parametrize(
    ("check", "broken", "match"),
    [
        (
            check_reduce,
            _Doubling,
            r"reduce\(tensor\) on rank 0 with \[1.0, -2.0\] returned \[2.0, -4.0\]; expected the mean over 1 rank",
        ),
        (
            check_reduce,
            _NoOpValidation,
            r"reduce_op='median'\) returned without an error; an unknown reduce_op must raise ValueError",
        ),
        (
            check_all_gather,
            _Detaching,
            r"all_gather\(tensor, sync_grads=True\).sum\(\).backward\(\) raised RuntimeError",
        ),
        (
            check_broadcast,
            _Copying,
            r"broadcast\(obj, src=0\) on rank 0 returned \{'something': 'else'\}; expected rank 0's object",
        ),
        (check_barrier, _Raising, r"barrier\('conformance'\) raised RuntimeError: no barrier here"),
        (
            check_reduce_boolean_decision,
            _Inverting,
            r"all=True\) when only rank 0 decides True returned False on rank 0; expected True",
        ),
    ],
)
def test_each_collective_check_passes_a_correct_strategy_and_names_what_a_broken_one_did(
    check: Any, broken: type, match: str
) -> None:
    check(SingleDeviceStrategy())
    with pytest.raises(AssertionError, match=match):
        check(broken())


def test_all_checks_are_listed_in_the_order_they_run() -> None:
    assert (
        CHECKS[:4] == ("lifecycle", "hooks", "no_sync", "teardown")
        and CHECKS[-1] == "checkpoint"
        and len(set(CHECKS)) == 10
    )
    assert DRIVERS == ("trainer", "cohort") and CHECKS_BY_DRIVER == {"trainer": CHECKS, "cohort": COHORT_CHECKS}
    assert set(COHORT_CHECKS) < set(CHECKS)  # the Cohort's checks judge the same promises as the Trainer's


def test_import_phalanx_does_not_load_the_kit_and_the_kit_loads_torch_only_when_it_runs() -> None:
    code = (
        "import sys, phalanx; assert 'phalanx.testing' not in sys.modules;"
        " from phalanx.testing import check_strategy, run_conformance, CHECKS, StrategyConformanceError;"
        " assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('phalanx'))"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
