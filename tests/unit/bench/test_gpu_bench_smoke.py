"""``bench/gpu/run.py`` works before a GPU session runs it once: its CPU smoke mode, its run plan and its report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "bench" / "gpu"))
try:
    import meter
    import report
    import run
finally:
    sys.path.remove(str(ROOT / "bench" / "gpu"))  # bench/gpu/model.py must not shadow other modules

FIGURES = ("ms_per_step", "tokens_per_s", "syncs_per_step", "dtoh_copies_per_step", "item_calls_per_step")
KEYS = {
    "name",
    "kind",
    "strategy",
    "devices",
    "compiled",
    "defaults",
    "card",
    "torch",
    "status",
    "parameters",
    "mfu",
    "benchmark_started",
}


def test_the_cpu_smoke_mode_writes_one_json_line_per_run_and_a_dated_table(tmp_path: Path) -> None:
    out, results_md = tmp_path / "results.jsonl", tmp_path / "RESULTS.md"
    results_md.write_text(f"# Results\n\n{report.MARKER}\n\n## Later section\n")
    command = [sys.executable, str(ROOT / "bench/gpu/run.py"), "--device", "cpu", "--tiny", "--runs", "loop,phalanx"]
    done = subprocess.run(
        [*command, "--out", str(out), "--results-md", str(results_md)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["name"] for line in lines] == ["loop", "phalanx"]
    for line in lines:
        assert line["status"] == "ok", line
        assert KEYS | set(FIGURES) <= set(line), sorted(KEYS | set(FIGURES) - set(line))
        assert line["ms_per_step"] > 0 and line["tokens_per_s"] > 0 and line["parameters"] > 0
        assert line["card"] == "cpu" and line["mfu"] is None  # no peak figure for a CPU
    loop, phalanx = lines
    # phalanx's plain step reads nothing back to the host that the loop does not (counted by the profiler).
    assert phalanx["item_calls_per_step"] <= loop["item_calls_per_step"]
    text = results_md.read_text()
    assert text.index("| loop | single_device | 1 |") < text.index(report.MARKER) < text.index("## Later section")
    assert "| phalanx's plain step against the hand-written loop |" in text


@pytest.mark.parametrize(
    ("gpus", "expected_ws2"),
    [(0, []), (1, []), (2, ["ddp_ws2", "fsdp_ws2", "model_parallel_ws2"])],
)
def test_the_full_plan_interleaves_the_core_runs_and_adds_world_size_2_with_two_gpus(gpus, expected_ws2) -> None:
    args = run.parse(["--out", "unused.jsonl"])
    names = [spec["name"] for spec in run.plan(args, gpus)]
    core = [name for name in names if name in run.CORE]
    assert core[: len(core) // 2] == core[len(core) // 2 :]  # A B C A B C: interleaved, not A A B B
    assert names.count("loop_compiled") == names.count("phalanx_compiled") == args.repeats
    assert [name for name in names if name.endswith("_ws2") and "deepspeed" not in name] == expected_ws2
    assert {"ddp", "fsdp", "model_parallel"} <= set(names)


@pytest.mark.parametrize(
    ("name", "kind", "strategy", "compiled", "defaults", "devices"),
    [
        ("loop", "loop", "single_device", False, False, 1),
        ("loop_compiled", "loop", "single_device", True, False, 1),
        ("phalanx_defaults", "phalanx", "single_device", False, True, 1),
        ("phalanx_compiled", "phalanx", "single_device", True, False, 1),
        ("lightning", "lightning", "single_device", False, False, 1),
        ("fsdp_ws2", "phalanx", "fsdp", False, False, 2),
        ("deepspeed_stage_2", "phalanx", "deepspeed_stage_2", False, False, 1),
    ],
)
def test_a_run_name_says_what_it_trains_with(name, kind, strategy, compiled, defaults, devices) -> None:
    spec = run.run_spec(name, run.parse(["--tiny"]), devices)
    assert (spec["kind"], spec["strategy"], spec["compiled"], spec["defaults"]) == (kind, strategy, compiled, defaults)


@pytest.mark.parametrize("runs", ["phalnx", "loop,fsdp_ws3", "loop,,phalanx"])
def test_an_unknown_run_name_is_refused_with_the_valid_names(runs) -> None:
    with pytest.raises(SystemExit, match="Valid run names: loop, phalanx"):
        run.plan(run.parse(["--runs", runs]), gpus=0)


def _ok(name: str, ms: float) -> dict:
    return {"name": name, "status": "ok", "ms_per_step": ms, "strategy": "single_device", "devices": 1}


@pytest.mark.parametrize(
    ("runs", "verdict"),
    [
        ([_ok("loop", 30.0), _ok("phalanx", 30.1), _ok("loop", 30.0), _ok("phalanx", 30.1)], "met"),
        ([_ok("loop", 30.0), _ok("phalanx", 31.0)], "missed"),
        ([_ok("loop", 30.0), {"name": "phalanx", "status": "skipped", "reason": "time guard"}], "not measured"),
    ],
)
def test_the_report_marks_each_target_met_missed_or_not_measured(tmp_path: Path, runs, verdict) -> None:
    path = tmp_path / "RESULTS.md"
    report.append_table(runs, path)
    line = next(line for line in path.read_text().splitlines() if line.startswith("| phalanx's plain step"))
    assert line.split("|")[-2].strip().startswith(verdict)


@pytest.mark.parametrize("reads_per_step", [0, 1, 3])
def test_the_meter_counts_host_reads_only_in_its_profiled_steps(reads_per_step) -> None:
    steps = meter.Meter(torch.device("cpu"), warmup=1, steps=2, profile_steps=2)
    weight = torch.ones(4, requires_grad=True)
    for index in range(steps.total_steps):
        steps.step_start(index)
        loss = (weight * index).sum()
        loss.backward()
        for _ in range(reads_per_step):
            loss.item()
        steps.step_end(index)
    figures = steps.figures(tokens_per_step=10, parameters=4)
    assert figures["item_calls_per_step"] == reads_per_step
    assert figures["ms_per_step"] > 0 and figures["mfu"] is None and figures["peak_memory_gib"] is None


def test_the_meter_refuses_figures_when_the_run_ended_before_its_window() -> None:
    steps = meter.Meter(torch.device("cpu"), warmup=2, steps=3, profile_steps=1)
    steps.step_start(0)
    steps.step_end(0)
    with pytest.raises(RuntimeError, match="the timed window did not close"):
        steps.figures(tokens_per_step=10, parameters=4)


@pytest.mark.parametrize(
    ("card", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA H100 PCIe", None),
        ("NVIDIA A10G", None),
        ("cpu", None),
    ],
)
def test_the_peak_rate_comes_from_the_card_name(card, peak) -> None:
    assert meter.peak_flops(card) == peak
