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
    "shape",
    "unit",
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
    assert [(line["shape"], line["name"]) for line in lines] == [
        ("project", "loop"),
        ("project", "phalanx"),
        ("independent", "loop"),
        ("independent", "phalanx"),
    ]
    for line in lines:
        assert line["status"] == "ok", line
        assert KEYS | set(FIGURES) <= set(line), sorted(KEYS | set(FIGURES) - set(line))
        assert line["ms_per_step"] > 0 and line["tokens_per_s"] > 0 and line["parameters"] > 0
        assert line["card"] == "cpu" and line["mfu"] is None  # no peak figure for a CPU
    for loop, phalanx in (lines[:2], lines[2:]):
        # phalanx's plain step reads nothing back to the host that the loop does not (counted by the profiler).
        assert phalanx["item_calls_per_step"] <= loop["item_calls_per_step"]
    assert lines[2]["parameters"] != lines[0]["parameters"]  # two different models
    text = results_md.read_text()
    table = text.index("| loop | project | single_device | 1 |")
    assert table < text.index("| loop | independent | single_device | 1 |") < text.index(report.MARKER)
    assert text.index(report.MARKER) < text.index("## Later section")
    for shape in ("project", "independent"):
        assert f"| {shape} | phalanx's plain step against the hand-written loop |" in text


@pytest.mark.parametrize(
    ("gpus", "expected_ws2"),
    [(0, []), (1, []), (2, ["ddp_ws2", "fsdp_ws2", "model_parallel_ws2"])],
)
def test_the_full_plan_interleaves_the_core_runs_and_adds_world_size_2_with_two_gpus(gpus, expected_ws2) -> None:
    args = run.parse(["--out", "unused.jsonl"])
    specs = run.plan(args, gpus)
    names = [spec["name"] for spec in specs]
    compared = [(spec["shape"], spec["name"]) for spec in specs if spec["name"] in run.CORE + run.COMPILED]
    # A B C A' B' C' A B C A' B' C': each shape's core and compiled runs interleaved, not A A B B.
    assert compared[: len(compared) // 2] == compared[len(compared) // 2 :]
    for shape in run.SHAPES:
        for name in ("loop", "phalanx", "phalanx_defaults", *run.COMPILED):
            assert compared.count((shape, name)) == args.repeats, (shape, name)
    assert [name for name in names if name.endswith("_ws2") and "deepspeed" not in name] == expected_ws2
    assert {"ddp", "fsdp", "model_parallel"} <= set(names)
    # Lightning and the strategies run on the project's shape only.
    assert {spec["shape"] for spec in specs if spec["name"] in run.PROJECT_ONLY} <= {"project"}


@pytest.mark.parametrize(
    ("name", "kind", "strategy", "compiled", "unit", "defaults", "devices"),
    [
        ("loop", "loop", "single_device", False, None, False, 1),
        ("loop_compiled_model", "loop", "single_device", True, "model", False, 1),
        ("loop_compiled_blocks", "loop", "single_device", True, "blocks", False, 1),
        ("phalanx_defaults", "phalanx", "single_device", False, None, True, 1),
        ("phalanx_compiled", "phalanx", "single_device", True, None, False, 1),
        ("lightning", "lightning", "single_device", False, None, False, 1),
        ("fsdp_ws2", "phalanx", "fsdp", False, None, False, 2),
        ("deepspeed_stage_2", "phalanx", "deepspeed_stage_2", False, None, False, 1),
    ],
)
def test_a_run_name_says_what_it_trains_with(name, kind, strategy, compiled, unit, defaults, devices) -> None:
    spec = run.run_spec(name, run.parse(["--tiny"]), devices)
    expected = (kind, strategy, compiled, unit, defaults)
    assert (spec["kind"], spec["strategy"], spec["compiled"], spec["unit"], spec["defaults"]) == expected


@pytest.mark.parametrize("runs", ["phalnx", "loop,fsdp_ws3", "loop,,phalanx"])
def test_an_unknown_run_name_is_refused_with_the_valid_names(runs) -> None:
    with pytest.raises(SystemExit, match="Valid run names: loop, phalanx"):
        run.plan(run.parse(["--runs", runs]), gpus=0)


@pytest.mark.parametrize("shape", ["projct", "project,", "gpt2"])
def test_an_unknown_shape_is_refused_with_the_valid_shapes(shape) -> None:
    with pytest.raises(SystemExit, match="Valid shapes: project, independent"):
        run.parse(["--shape", shape])


def _ok(name: str, ms: float, shape: str = "project") -> dict:
    return {"name": name, "shape": shape, "status": "ok", "ms_per_step": ms, "strategy": "single_device", "devices": 1}


COMPILED_LOOPS = [_ok("phalanx", 30.0), _ok("loop_compiled_model", 25.0), _ok("loop_compiled_blocks", 27.0)]


@pytest.mark.parametrize(
    ("runs", "target", "verdict"),
    [
        ([_ok("loop", 30.0), _ok("phalanx", 30.1), _ok("loop", 30.0), _ok("phalanx", 30.1)], "plain step", "met"),
        ([_ok("loop", 30.0), _ok("phalanx", 31.0)], "plain step", "missed"),
        ([_ok("loop", 30.0), {"name": "phalanx", "status": "skipped"}], "plain step", "not measured"),
        ([*COMPILED_LOOPS, _ok("phalanx_compiled", 25.2)], "faster compiled loop", "met"),
        # Within 1% of the per-block loop, but the whole-model loop is faster: missed.
        ([*COMPILED_LOOPS, _ok("phalanx_compiled", 27.2)], "faster compiled loop", "missed"),
        ([*COMPILED_LOOPS, _ok("phalanx_compiled", 30.3)], "never slower", "missed"),
        ([*COMPILED_LOOPS[:2], _ok("phalanx_compiled", 25.0)], "faster compiled loop", "not measured"),
    ],
)
def test_the_report_marks_each_target_met_missed_or_not_measured(tmp_path: Path, runs, target, verdict) -> None:
    path = tmp_path / "RESULTS.md"
    report.append_table(runs, path)
    line = next(line for line in path.read_text().splitlines() if line.startswith("| project |") and target in line)
    assert line.split("|")[-2].strip().startswith(verdict)


def test_the_report_judges_each_shape_on_its_own_runs(tmp_path: Path) -> None:
    runs = [
        _ok("loop", 30.0),
        _ok("phalanx", 30.0),
        _ok("loop", 20.0, "independent"),
        _ok("phalanx", 21.0, "independent"),
    ]
    path = tmp_path / "RESULTS.md"
    report.append_table(runs, path)
    verdicts = {
        line.split("|")[1].strip(): line.split("|")[-2].strip()
        for line in path.read_text().splitlines()
        if "plain step against" in line
    }
    assert verdicts == {"project": "met", "independent": "missed"}


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
