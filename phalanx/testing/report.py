"""What the conformance kit reports: one result per check, merged over the ranks, and the error that lists failures."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Every check the kit runs through the Trainer, in the order it runs them (``checks=`` selects a subset).
CHECKS = (
    "lifecycle", "hooks", "no_sync", "teardown",
    "reduce", "all_gather", "broadcast", "barrier", "reduce_boolean_decision",
    "checkpoint",
)  # fmt: skip
#: The checks the kit runs through ``phalanx.Cohort`` (a hand-written loop with save, load and resume).
COHORT_CHECKS = ("lifecycle", "no_sync", "checkpoint")
#: What drives the strategy (``drivers=`` selects), and the checks each one runs, in the order they run.
DRIVERS = ("trainer", "cohort")
CHECKS_BY_DRIVER = {"trainer": CHECKS, "cohort": COHORT_CHECKS}

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"


class StrategyConformanceError(AssertionError):
    """A strategy broke the Strategy contract; the message lists every failed check and what it saw."""


class NotApplicable(Exception):
    """Raised by a check that has nothing to verify for this strategy or process count (reported as skipped)."""


@dataclass(frozen=True)
class CheckResult:
    """The outcome of one check over all ranks: 'passed', 'failed' or 'skipped', and what was seen."""

    name: str
    status: str
    message: str = ""
    driver: str = "trainer"

    @property
    def label(self) -> str:
        """``driver/check``, as reports name it."""
        return f"{self.driver}/{self.name}"

    @property
    def passed(self) -> bool:
        """Whether the check passed (a skipped check neither passed nor failed)."""
        return self.status == PASSED

    @property
    def failed(self) -> bool:
        """Whether the check failed on at least one rank."""
        return self.status == FAILED


@dataclass
class ConformanceReport:
    """The results of one conformance run of ``strategy`` on ``processes`` processes, per driver and check."""

    strategy: str
    processes: int
    results: dict[tuple[str, str], CheckResult] = field(default_factory=dict)

    @property
    def drivers(self) -> list[str]:
        """The drivers that ran, in order."""
        return list(dict.fromkeys(driver for driver, _ in self.results))

    @property
    def failures(self) -> list[CheckResult]:
        """The failed checks, in the order they ran."""
        return [result for result in self.results.values() if result.failed]

    def __getitem__(self, key: str | tuple[str, str]) -> CheckResult:
        """``report[driver, check]``; ``report[check]`` where one driver ran that check."""
        if isinstance(key, tuple):
            if key not in self.results:
                raise KeyError(f"No result for {key!r}; this run has {list(self.results)}.")
            return self.results[key]
        found = self._results_of(key)
        if len(found) != 1:
            raise KeyError(
                f"check {key!r} ran through {[result.driver for result in found]}; name the driver, e.g."
                f" report[{DRIVERS[0]!r}, {key!r}] (all checks: {CHECKS_BY_DRIVER})."
            )
        return found[0]

    def _results_of(self, check: str, driver: str | None = None) -> list[CheckResult]:
        return [result for (run_by, name), result in self.results.items() if name == check and driver in (None, run_by)]

    def assert_passed(self, check: str | None = None, driver: str | None = None) -> None:
        """Raise StrategyConformanceError if ``check`` (any, when None) failed through ``driver`` (any, when None); a
        check skipped through every such driver skips under pytest."""
        if check is None:
            failures = [result for result in self.failures if driver in (None, result.driver)]
            if failures:
                raise StrategyConformanceError(self.describe_failures(failures))
            return
        found = self._results_of(check, driver)
        if not found:
            raise KeyError(
                f"No result for check {check!r} through {driver or 'any driver'}; ran: {list(self.results)}."
            )
        failed = [result for result in found if result.failed]
        if failed:
            details = "\n".join(f"{result.label}:\n{_indent(result.message)}" for result in failed)
            raise StrategyConformanceError(
                f"{self.strategy} on {self._processes_text()}: check {check!r} failed:\n{details}"
            )
        if all(result.status == SKIPPED for result in found) and "pytest" in sys.modules:
            sys.modules["pytest"].skip(f"{check}: {found[0].message}")

    def describe_failures(self, failures: list[CheckResult] | None = None) -> str:
        """A message naming the strategy, the process count and each failed check (``driver/check``) with what it
        saw."""
        failures = self.failures if failures is None else failures
        lines = [
            f"{self.strategy} failed {len(failures)} of {len(self.results)} conformance checks"
            f" on {self._processes_text()}:"
        ]
        lines += [f"  - {result.label}:\n{_indent(result.message, 6)}" for result in failures]
        return "\n".join(lines)

    def summary(self) -> str:
        """Per driver, one line per check: its status and, unless it passed, why."""
        lines = [f"{self.strategy} on {self._processes_text()}:"]
        for driver in self.drivers:
            lines.append(f"  through the {driver}:")
            for (run_by, _), result in self.results.items():
                if run_by != driver:
                    continue
                detail = "" if result.passed else f": {result.message.splitlines()[0] if result.message else ''}"
                lines.append(f"    {result.status:7} {result.name}{detail}")
        return "\n".join(lines)

    def _processes_text(self) -> str:
        return f"{self.processes} process{'es' if self.processes != 1 else ''}"


def _indent(text: str, spaces: int = 4) -> str:
    return "\n".join(" " * spaces + line for line in text.splitlines())


# ---------------------------------------------------------------------------- one rank's results on disk
class RankResults:
    """What one worker found, written as JSON (never pickle) for the process that started it; progress line by line."""

    def __init__(self, directory: Path, rank: int) -> None:
        self.path = directory / f"rank{rank}.json"
        self._progress = directory / f"rank{rank}.progress"
        self.rank = rank
        self.checks: dict[str, dict[str, str]] = {}
        self.fatal: str | None = None

    def started(self, what: str) -> None:
        """Note that ``what`` started, so that a rank that never finishes is reported with where it stopped."""
        with open(self._progress, "a") as progress:
            progress.write(what + "\n")

    def record(self, driver: str, check: str, status: str, message: str = "") -> None:
        """Store the outcome of ``check`` through ``driver`` on this rank (on disk at once: a later check may never
        return)."""
        self.checks[f"{driver}/{check}"] = {"status": status, "message": message}
        self.write()

    def write(self) -> None:
        """Write everything found so far (called once the worker ends, whatever happened)."""
        payload = {"rank": self.rank, "checks": self.checks, "fatal": self.fatal}
        partial = self.path.with_suffix(".partial")
        partial.write_text(json.dumps(payload))
        os.replace(partial, self.path)  # the parent polls for this file: it must never see half of it


def last_started(directory: Path, rank: int) -> str | None:
    """The last step a rank announced, or None."""
    path = directory / f"rank{rank}.progress"
    if not path.exists():
        return None
    lines = path.read_text().splitlines()
    return lines[-1] if lines else None


def read_rank(directory: Path, rank: int) -> dict[str, Any] | None:
    """One rank's results, or None when it wrote none (it was stopped or died)."""
    path = directory / f"rank{rank}.json"
    if not path.exists():
        return None
    return json.loads(path.read_text())


def merge(
    strategy: str,
    processes: int,
    checks: dict[str, tuple[str, ...]],
    ranks: list[dict[str, Any] | None],
    stopped: dict[int, str],
) -> ConformanceReport:
    """Combine the ranks' results (``checks``: driver -> its checks): a check fails if it failed (or never finished) on
    any rank."""
    report = ConformanceReport(strategy, processes)
    for driver, names in checks.items():
        for check in names:
            report.results[driver, check] = _merged(driver, check, processes, ranks, stopped)
    return report


def _merged(
    driver: str, check: str, processes: int, ranks: list[dict[str, Any] | None], stopped: dict[int, str]
) -> CheckResult:
    failures: dict[str, list[int]] = {}
    skipped: list[str] = []
    for rank, found in enumerate(ranks):
        entry = (found or {}).get("checks", {}).get(f"{driver}/{check}")
        if entry is None:
            reason = stopped.get(rank) or (found or {}).get("fatal") or "the worker ended without reporting it"
            failures.setdefault(f"did not finish: {reason}", []).append(rank)
        elif entry["status"] == FAILED:
            failures.setdefault(entry["message"], []).append(rank)
        elif entry["status"] == SKIPPED:
            skipped.append(entry["message"])
    if failures:
        message = "\n".join(_on_ranks(ranks_with, processes, text) for text, ranks_with in failures.items())
        return CheckResult(check, FAILED, message, driver)
    if skipped and len(skipped) == len(ranks):
        return CheckResult(check, SKIPPED, skipped[0], driver)
    return CheckResult(check, PASSED, "", driver)


def _on_ranks(ranks: list[int], processes: int, text: str) -> str:
    """``text`` under a header naming the ranks that saw it (no header on one process)."""
    if processes == 1:
        return text
    where = (
        "on every rank"
        if len(ranks) == processes
        else f"on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
    )
    if "\n" not in text:
        return f"{where}: {text}"
    return f"{where}:\n{_indent(text, 2)}"
