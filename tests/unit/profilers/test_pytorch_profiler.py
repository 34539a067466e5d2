"""PyTorchProfiler in a Trainer: the Chrome trace of the recorded steps (JSON, with the Trainer's actions and the
submodules as labelled ranges), its schedules, and the operator table as the report."""

from __future__ import annotations

import collections
import json

import pytest
import torch
from phalanx_distributed import free_port
from phalanx_testing import Regressor, loaders, quiet_trainer

from phalanx.profilers import PyTorchProfiler

TRAINING_STEP = "[pl][profile][Strategy]SingleDeviceStrategy.training_step"


def _traces(folder) -> list[collections.Counter]:
    """The names of the events of each trace written in ``folder``, counted (one Counter per file, by name)."""
    files = sorted(folder.glob("fit-perf.*.pt.trace.json"))
    return [collections.Counter(event.get("name") for event in json.loads(f.read_text())["traceEvents"]) for f in files]


@pytest.mark.parametrize(
    ("max_steps", "schedule", "recorded"),
    [
        (8, None, [3]),  # the default: wait 1, warm up 1, record 3, once
        (3, None, [2]),  # too short for the default: everything after the first step
        (8, dict(wait=1, warmup=1, active=2, repeat=2), [2, 2]),  # a window of 2 steps, twice
    ],
)
def test_each_recorded_window_is_a_chrome_trace_of_its_steps(tmp_path, max_steps, schedule, recorded):
    kwargs = {} if schedule is None else {"schedule": torch.profiler.schedule(**schedule)}
    profiler = PyTorchProfiler(filename="perf", **kwargs)
    trainer = quiet_trainer(max_steps=max_steps, default_root_dir=tmp_path, profiler=profiler)
    trainer.fit(Regressor(), loaders()[0])
    traces = _traces(tmp_path)
    assert [trace[TRAINING_STEP] for trace in traces] == recorded
    for trace in traces:
        assert trace["[pl][module]torch.nn.modules.linear.Linear: net.0"] == trace[TRAINING_STEP]
        assert trace["[pl][profile][Strategy]SingleDeviceStrategy.backward"] == trace[TRAINING_STEP]
        assert trace["aten::addmm"] > 0  # the operators inside them
    report = (tmp_path / "fit-perf.txt").read_text()
    assert report.startswith("FIT Profiler Report\nProfile stats for: records")
    assert "aten::" in report


def test_module_names_can_be_left_out(tmp_path):
    profiler = PyTorchProfiler(filename="perf", record_module_names=False)
    quiet_trainer(max_steps=3, default_root_dir=tmp_path, profiler=profiler).fit(Regressor(), loaders()[0])
    (trace,) = _traces(tmp_path)
    assert trace[TRAINING_STEP] == 2
    assert not [name for name in trace if name and name.startswith("[pl][module]")]


def test_a_test_stage_counts_its_test_steps(tmp_path):
    profiler = PyTorchProfiler(filename="perf")
    quiet_trainer(default_root_dir=tmp_path, profiler=profiler).test(Regressor(), loaders()[1], verbose=False)
    (trace_file,) = tmp_path.glob("test-perf.*.pt.trace.json")
    names = collections.Counter(e.get("name") for e in json.loads(trace_file.read_text())["traceEvents"])
    assert names["[pl][profile][Strategy]SingleDeviceStrategy.test_step"] == 3  # 4 batches, after the first
    assert (tmp_path / "test-perf.txt").read_text().startswith("TEST Profiler Report")


@pytest.fixture
def one_process(monkeypatch):
    """Where a strategy of one process meets itself; the process group it leaves is destroyed afterwards."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def test_fsdps_unsharding_reduction_and_resharding_are_in_the_trace(tmp_path, one_process):
    profiler = PyTorchProfiler(filename="perf")
    trainer = quiet_trainer(strategy="fsdp", devices=1, max_steps=3, default_root_dir=tmp_path, profiler=profiler)
    trainer.fit(Regressor(), loaders()[0])
    (trace_file,) = tmp_path.glob("fit-perf.*.pt.trace.json")
    names = {event.get("name") or "" for event in json.loads(trace_file.read_text())["traceEvents"]}
    parts = ("FSDP::pre_forward", "FSDP::post_forward", "FSDP::post_backward_reduce", "FSDP::post_backward_reshard")
    assert [part for part in parts if not any(name.startswith(part) for name in names)] == []
    assert "[pl][profile][Strategy]FSDPStrategy.backward" in names
