"""Profiling and throughput with two processes: a report (and a trace) per rank with the DDP strategy's parts, the
gradient reduction among the recorded operators, and world rates that are the device's times the world size."""

from __future__ import annotations

import collections
import csv
import json

import pytest
import torch
from phalanx_distributed import assert_ok, run_script

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")

STEPS = 6
ROWS = ("run_training_batch", "[Strategy]DDPStrategy.training_step", "[Strategy]DDPStrategy.backward",
        "[Strategy]DDPStrategy.optimizer_step", "[Callback]ThroughputMonitor.on_train_batch_end")  # fmt: skip


def _calls(report: str) -> dict[str, int]:
    return {line.split("|")[1].strip(): int(line.split("|")[3]) for line in report.splitlines()[4:] if "|" in line}


@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn"])
def test_each_rank_reports_the_strategys_steps_and_rank_zero_logs_world_rates(tmp_path, strategy):
    assert_ok(run_script("profile_job.py", str(tmp_path), strategy, "simple", timeout=300))
    profiles = tmp_path / "profiles"
    assert sorted(p.name for p in profiles.iterdir()) == ["fit-perf-0.txt", "fit-perf-1.txt"]
    for rank in (0, 1):
        report = (profiles / f"fit-perf-{rank}.txt").read_text()
        assert report.startswith("FIT Profiler Report")
        assert {row: _calls(report).get(row) for row in ROWS} == dict.fromkeys(ROWS, STEPS)
    rows = list(csv.DictReader((tmp_path / "logs" / "version_0" / "metrics.csv").open()))
    rates = [row for row in rows if row.get("train/device/samples_per_sec")]
    assert len(rates) == STEPS - 1  # the window of 2 batches is full from the second on
    for row in rates:
        assert float(row["train/samples_per_sec"]) == pytest.approx(2 * float(row["train/device/samples_per_sec"]))
        assert float(row["train/batches_per_sec"]) == pytest.approx(2 * float(row["train/device/batches_per_sec"]))
        assert int(row["train/samples"]) == 4 * int(row["train/batches"])  # rank 0's own samples


def test_each_rank_writes_a_trace_with_its_gradient_reduction(tmp_path):
    assert_ok(run_script("profile_job.py", str(tmp_path), "ddp", "pytorch", timeout=300))
    profiles = tmp_path / "profiles"
    for rank in (0, 1):
        (trace_file,) = profiles.glob(f"fit-perf-{rank}.*.pt.trace.json")
        names = collections.Counter(event.get("name") for event in json.loads(trace_file.read_text())["traceEvents"])
        assert names["[pl][profile][Strategy]DDPStrategy.backward"] == 3  # the default schedule's 3 steps
        reductions = [
            name for name in names if name and "all_reduce" in name.lower().replace("allreduce", "all_reduce")
        ]
        assert reductions, sorted(n for n in names if n)[:80]
        assert (profiles / f"fit-perf-{rank}.txt").read_text().startswith("FIT Profiler Report")
