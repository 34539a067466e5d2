"""The profiler objects on their own: what SimpleProfiler and AdvancedProfiler record and report, their file names
per stage and rank, the refusals of bad arguments, and that each travels to a spawned worker (pickles)."""

from __future__ import annotations

import inspect
import pickle
import pstats

import pytest
import torch

from phalanx.profilers import AdvancedProfiler, PassThroughProfiler, Profiler, PyTorchProfiler, SimpleProfiler


def _record(profiler: Profiler, calls: dict[str, int]) -> None:
    for action, count in calls.items():
        for _ in range(count):
            with profiler.profile(action):
                sum(range(100))


@pytest.mark.parametrize("calls", [{"a": 1}, {"a": 3, "b": 2}, {"forward": 5, "backward": 5, "step": 1}])
def test_simple_profiler_counts_each_action_and_sorts_by_total(calls):
    profiler = SimpleProfiler()
    profiler.setup("fit")
    _record(profiler, calls)
    assert {action: len(durations) for action, durations in profiler.recorded_durations.items()} == calls
    report = profiler.summary()
    assert report.startswith("FIT Profiler Report")
    rows = {line.split("|")[1].strip(): line for line in report.splitlines() if line.startswith("| ")}
    assert rows["Total"].split("|")[3].strip() == str(sum(calls.values()))
    for action, count in calls.items():
        assert rows[action].split("|")[3].strip() == str(count)
    totals = [
        float(profiler_row.split("|")[4]) for name, profiler_row in rows.items() if name not in ("Action", "Total")
    ]
    assert totals == sorted(totals, reverse=True)


def test_simple_profiler_without_extended_reports_mean_and_total_only():
    profiler = SimpleProfiler(extended=False)
    _record(profiler, {"a": 2})
    header = next(line for line in profiler.summary().splitlines() if line.startswith("| Action"))
    assert [cell.strip() for cell in header.strip("|").split("|")] == ["Action", "Mean duration (s)", "Total time (s)"]


@pytest.mark.parametrize(
    ("misuse", "message"),
    [
        (lambda p: (p.start("a"), p.start("a")), "was started while it was running"),
        (lambda p: p.stop("never"), "was stopped but never started"),
    ],
)
def test_simple_profiler_refuses_a_start_twice_and_a_stop_without_start(misuse, message):
    with pytest.raises(ValueError, match=message):
        misuse(SimpleProfiler())


def test_advanced_profiler_counts_a_function_in_the_innermost_action_only():
    def inner_work() -> int:
        return sum(range(1000))

    profiler = AdvancedProfiler()
    profiler.setup("fit")
    with profiler.profile("outer"):
        with profiler.profile("inner"):
            inner_work()
    functions = {name: {key[2] for key in pstats.Stats(p).stats} for name, p in profiler.profiled_actions.items()}
    assert "inner_work" in functions["inner"]
    assert "inner_work" not in functions["outer"]
    report = profiler.summary()
    assert "Profile stats for: outer" in report and "Profile stats for: inner" in report


def test_advanced_profiler_dumps_stats_readable_by_pstats(tmp_path):
    profiler = AdvancedProfiler(dirpath=tmp_path, filename="perf", dump_stats=True)
    profiler.setup("fit", local_rank=1)
    _record(profiler, {"[Strategy]X.training_step": 2})
    profiler.describe()
    dumped = tmp_path / "fit-perf-1-[Strategy]X.training_step.prof"
    assert dumped.is_file(), sorted(p.name for p in tmp_path.iterdir())
    assert any(key[2] == "<built-in method builtins.sum>" for key in pstats.Stats(str(dumped)).stats)
    assert "Profile stats for: [Strategy]X.training_step rank: 1" in (tmp_path / "fit-perf-1.txt").read_text()


@pytest.mark.parametrize(
    ("stage", "rank", "filename", "expected"),
    [
        ("fit", None, "perf", "fit-perf.txt"),
        ("fit", 1, "perf", "fit-perf-1.txt"),
        ("validate", 0, "perf", "validate-perf-0.txt"),
        ("test", None, "a/b:c", "test-a_b_c.txt"),
    ],
)
def test_the_report_goes_to_one_file_per_stage_and_rank(tmp_path, stage, rank, filename, expected):
    profiler = SimpleProfiler(dirpath=tmp_path, filename=filename)
    profiler.setup(stage, local_rank=rank)
    _record(profiler, {"a": 1})
    profiler.describe()
    assert [p.name for p in tmp_path.iterdir()] == [expected]
    assert f"{stage.upper()} Profiler Report" in (tmp_path / expected).read_text()


def test_without_a_filename_the_report_is_printed_and_no_file_is_written(tmp_path, capsys):
    profiler = SimpleProfiler(dirpath=tmp_path)
    profiler.setup("fit")
    _record(profiler, {"printed_action": 1})
    profiler.describe()
    assert "printed_action" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda: SimpleProfiler(dirpath=3), TypeError, "dirpath=3 is not valid"),
        (lambda: SimpleProfiler(filename=b"x"), TypeError, "filename=b'x' is not valid"),
        (lambda: AdvancedProfiler(line_count_restriction=-1), ValueError, "line_count_restriction=-1 is not valid"),
        (lambda: AdvancedProfiler(line_count_restriction=1.5), ValueError, "is a float above 1.0"),
        (lambda: PyTorchProfiler(sort_by_key="speed"), ValueError, "sort_by_key='speed' is not valid"),
        (lambda: PyTorchProfiler(record_shape=True), TypeError, r"unknown keyword arguments \['record_shape'\]"),
        (lambda: PyTorchProfiler(table_kwargs={"sort_by": "count"}), TypeError, r"unknown keys \['sort_by'\]"),
        (lambda: PyTorchProfiler(schedule=3), TypeError, "schedule=3 is not callable"),
        (lambda: PyTorchProfiler(schedule=lambda step: "record"), TypeError, "not a torch.profiler.ProfilerAction"),
    ],
)
def test_bad_arguments_are_refused_at_construction(make, error, message):
    with pytest.raises(error, match=message):
        make()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_emit_nvtx_without_cuda_is_refused():
    with pytest.raises(ValueError, match="emit_nvtx=True.* needs CUDA"):
        PyTorchProfiler(emit_nvtx=True)


@pytest.mark.parametrize("make", [SimpleProfiler, AdvancedProfiler, PyTorchProfiler, PassThroughProfiler])
def test_a_profiler_in_use_pickles_for_a_spawned_worker(tmp_path, make):
    profiler = make(dirpath=tmp_path, filename="perf")
    profiler.setup("fit", local_rank=0)
    _record(profiler, {"a": 1})
    profiler._write("report so far")  # an open report file
    copy = pickle.loads(pickle.dumps(profiler))
    assert (copy.dirpath, copy.filename, copy._output) == (tmp_path, "perf", None)
    profiler.teardown("fit")


@pytest.mark.parametrize(
    "name", ["Profiler", "PassThroughProfiler", "SimpleProfiler", "AdvancedProfiler", "PyTorchProfiler"]
)
def test_constructor_arguments_are_lightnings(name):
    lightning_profilers = pytest.importorskip("pytorch_lightning.profilers")
    import phalanx.profilers

    ours = list(inspect.signature(getattr(phalanx.profilers, name)).parameters)
    theirs = list(inspect.signature(getattr(lightning_profilers, name)).parameters)
    assert ours == theirs
