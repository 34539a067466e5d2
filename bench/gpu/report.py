"""The dated markdown table of a GPU benchmark run, with the issue's targets marked met or missed."""

from __future__ import annotations

import datetime
import statistics
from pathlib import Path
from typing import Any

#: New tables go just above this line of ``bench/RESULTS.md`` (at the end of the file when it is missing).
MARKER = "<!-- bench/gpu/run.py appends its tables above this line -->"
#: (what is compared, the run, its baseline run, the largest allowed slowdown).
TARGETS = (
    ("phalanx's plain step against the hand-written loop", "phalanx", "loop", 0.005),
    (
        "phalanx with defaults on (progress bar, logger, self.log) against its plain step",
        "phalanx_defaults",
        "phalanx",
        0.02,
    ),
    ("compiled phalanx against the compiled loop", "phalanx_compiled", "loop_compiled", 0.01),
    ("FSDP at world size 1 against a single device", "fsdp", "phalanx", 0.10),
    ("DDP at world size 1 against a single device", "ddp", "phalanx", 0.05),
)
COLUMNS = ("ms_per_step", "tokens_per_s", "mfu", "peak_memory_gib", "syncs_per_step", "dtoh_copies_per_step")


def median_ms(results: list[dict[str, Any]]) -> dict[str, float]:
    """The median ms per step of each run name over its interleaved repeats (runs that finished only)."""
    times: dict[str, list[float]] = {}
    for result in results:
        if result.get("status") == "ok":
            times.setdefault(result["name"], []).append(result["ms_per_step"])
    return {name: statistics.median(values) for name, values in times.items()}


def target_lines(results: list[dict[str, Any]]) -> list[str]:
    medians = median_ms(results)
    lines = [
        "| target | run / baseline (median ms) | slowdown | allowed | verdict |",
        "| --- | --- | --- | --- | --- |",
    ]
    for what, run, baseline, allowed in TARGETS:
        if run in medians and baseline in medians:
            slowdown = medians[run] / medians[baseline] - 1
            verdict = "met" if slowdown <= allowed else "missed"
            figures = f"{medians[run]:.2f} / {medians[baseline]:.2f}"
            lines.append(f"| {what} | {figures} | {slowdown:+.2%} | {allowed:.1%} | {verdict} |")
        else:
            lines.append(
                f"| {what} | - | - | {allowed:.1%} | not measured (a run failed, was skipped or unsupported) |"
            )
    return lines


def run_lines(results: list[dict[str, Any]]) -> list[str]:
    header = "| run | strategy | devices | " + " | ".join(COLUMNS) + " | status |"
    lines = [header, "| " + " | ".join(["---"] * (len(COLUMNS) + 4)) + " |"]
    for result in results:
        cells = [result["name"], result.get("strategy", "-"), str(result.get("devices", "-"))]
        cells += ["-" if result.get(column) is None else str(result[column]) for column in COLUMNS]
        status = result.get("status", "?")
        reason = result.get("reason") or (result.get("stderr_tail") or "").strip().splitlines()[-1:]
        cells.append(f"{status}: {''.join(reason)[:120]}" if status != "ok" and reason else status)
        lines.append("| " + " | ".join(cell.replace("|", "/") for cell in cells) + " |")
    return lines


def table(results: list[dict[str, Any]]) -> str:
    first = next((r for r in results if r.get("card")), {})
    today = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    title = f"### {today}, {first.get('card', 'unknown card')}, torch {first.get('torch', 'unknown')}"
    return "\n".join([title, "", *run_lines(results), "", *target_lines(results), ""])


def append_table(results: list[dict[str, Any]], path: Path) -> None:
    """Put this run's table above :data:`MARKER` in ``path`` (or at its end)."""
    text = path.read_text() if path.exists() else ""
    block = table(results) + "\n"
    if MARKER in text:
        text = text.replace(MARKER, block + MARKER, 1)
    else:
        text = text + ("\n" if text and not text.endswith("\n") else "") + "\n" + block
    path.write_text(text)
