"""What the conformance kit reports: one result per check, merged over the ranks, and the error that lists failures."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Every check the kit runs, in the order it runs them (``checks=`` selects a subset).
CHECKS = (
    "lifecycle", "hooks", "no_sync", "teardown",
    "reduce", "all_gather", "broadcast", "barrier", "reduce_boolean_decision",
    "checkpoint",
)  # fmt: skip

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
    """The results of one conformance run of ``strategy`` on ``processes`` processes."""

    strategy: str
    processes: int
    results: dict[str, CheckResult] = field(default_factory=dict)

    @property
    def failures(self) -> list[CheckResult]:
        """The failed checks, in the order they ran."""
        return [result for result in self.results.values() if result.failed]

    def __getitem__(self, check: str) -> CheckResult:
        if check not in self.results:
            raise KeyError(
                f"No result for check {check!r}; this run has {list(self.results)} (all checks: {list(CHECKS)})."
            )
        return self.results[check]

    def assert_passed(self, check: str | None = None) -> None:
        """Raise StrategyConformanceError if ``check`` (any, when None) failed; a skipped check skips under pytest."""
        if check is None:
            if self.failures:
                raise StrategyConformanceError(self.describe_failures())
            return
        result = self[check]
        if result.failed:
            raise StrategyConformanceError(
                f"{self.strategy} on {self._processes_text()}: check {check!r} failed:\n{_indent(result.message)}"
            )
        if result.status == SKIPPED and "pytest" in sys.modules:
            sys.modules["pytest"].skip(f"{check}: {result.message}")

    def describe_failures(self) -> str:
        """A message naming the strategy, the process count and each failed check with what it saw."""
        failures = self.failures
        lines = [
            f"{self.strategy} failed {len(failures)} of {len(self.results)} conformance checks"
            f" on {self._processes_text()}:"
        ]
        lines += [f"  - {result.name}:\n{_indent(result.message, 6)}" for result in failures]
        return "\n".join(lines)

    def summary(self) -> str:
        """One line per check: its status and, unless it passed, why."""
        lines = [f"{self.strategy} on {self._processes_text()}:"]
        for result in self.results.values():
            detail = "" if result.passed else f": {result.message.splitlines()[0] if result.message else ''}"
            lines.append(f"  {result.status:7} {result.name}{detail}")
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

    def record(self, check: str, status: str, message: str = "") -> None:
        """Store the outcome of ``check`` on this rank (on disk at once: a later check may never return)."""
        self.checks[check] = {"status": status, "message": message}
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
    strategy: str, processes: int, checks: tuple[str, ...], ranks: list[dict[str, Any] | None], stopped: dict[int, str]
) -> ConformanceReport:
    """Combine the ranks' results: a check fails if it failed (or never finished) on any rank."""
    report = ConformanceReport(strategy, processes)
    for check in checks:
        failures: dict[str, list[int]] = {}
        skipped: list[str] = []
        for rank, found in enumerate(ranks):
            entry = (found or {}).get("checks", {}).get(check)
            if entry is None:
                reason = stopped.get(rank) or (found or {}).get("fatal") or "the worker ended without reporting it"
                failures.setdefault(f"did not finish: {reason}", []).append(rank)
            elif entry["status"] == FAILED:
                failures.setdefault(entry["message"], []).append(rank)
            elif entry["status"] == SKIPPED:
                skipped.append(entry["message"])
        if failures:
            message = "\n".join(_on_ranks(ranks_with, processes, text) for text, ranks_with in failures.items())
            report.results[check] = CheckResult(check, FAILED, message)
        elif skipped and len(skipped) == len(ranks):
            report.results[check] = CheckResult(check, SKIPPED, skipped[0])
        else:
            report.results[check] = CheckResult(check, PASSED)
    return report


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
