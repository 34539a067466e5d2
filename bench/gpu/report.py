"""The dated markdown table of a GPU benchmark run, with the issue's targets marked met or missed."""

from __future__ import annotations

import datetime
import statistics
from pathlib import Path
from typing import Any

#: New tables go just above this line of ``bench/RESULTS.md`` (at the end of the file when it is missing).
MARKER = "<!-- bench/gpu/run.py appends its tables above this line -->"
#: (what is compared, the run, its baseline runs (the fastest of them counts), the largest allowed slowdown).
TARGETS = (
    ("phalanx's plain step against the hand-written loop", "phalanx", ("loop",), 0.005),
    (
        "phalanx with defaults on (progress bar, logger, self.log) against its plain step",
        "phalanx_defaults",
        ("phalanx",),
        0.01,
    ),
    (
        "compiled phalanx against the faster compiled loop (whole model or per block)",
        "phalanx_compiled",
        ("loop_compiled_model", "loop_compiled_blocks"),
        0.01,
    ),
    ("compiled phalanx against phalanx eager (never slower)", "phalanx_compiled", ("phalanx",), 0.0),
    ("FSDP at world size 1 against a single device", "fsdp", ("phalanx",), 0.10),
    ("DDP at world size 1 against a single device", "ddp", ("phalanx",), 0.05),
)
COLUMNS = ("ms_per_step", "tokens_per_s", "mfu", "peak_memory_gib", "syncs_per_step", "dtoh_copies_per_step")


def median_ms(results: list[dict[str, Any]]) -> dict[tuple[str, str], float]:
    """The median ms per step of each (shape, run name) over its interleaved repeats (runs that finished only)."""
    times: dict[tuple[str, str], list[float]] = {}
    for result in results:
        if result.get("status") == "ok":
            times.setdefault((result.get("shape", "project"), result["name"]), []).append(result["ms_per_step"])
    return {key: statistics.median(values) for key, values in times.items()}


def target_lines(results: list[dict[str, Any]]) -> list[str]:
    medians = median_ms(results)
    lines = [
        "| shape | target | run / baseline (median ms) | slowdown | allowed | verdict |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    shapes = list(dict.fromkeys(result.get("shape", "project") for result in results))
    for shape in shapes:
        for what, run, baselines, allowed in TARGETS:
            measured = [medians[(shape, name)] for name in baselines if (shape, name) in medians]
            if (shape, run) in medians and len(measured) == len(baselines):
                ms, baseline = medians[(shape, run)], min(measured)
                slowdown = ms / baseline - 1
                verdict = "met" if slowdown <= allowed else "missed"
                cells = [shape, what, f"{ms:.2f} / {baseline:.2f}", f"{slowdown:+.2%}", f"{allowed:.1%}", verdict]
            elif (shape, run) in medians or any((shape, name) in medians for name in baselines):
                reason = "not measured (a run failed, was skipped or unsupported)"
                cells = [shape, what, "-", "-", f"{allowed:.1%}", reason]
            else:
                continue  # neither side ran on this shape (the strategies run on the project's shape only)
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def run_lines(results: list[dict[str, Any]]) -> list[str]:
    header = "| run | shape | strategy | devices | " + " | ".join(COLUMNS) + " | status |"
    lines = [header, "| " + " | ".join(["---"] * (len(COLUMNS) + 5)) + " |"]
    for result in results:
        cells = [result["name"], result.get("shape", "project"), result.get("strategy", "-")]
        cells.append(str(result.get("devices", "-")))
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
