"""The multiprocessing launcher brings rank 0's results back through a file only this user can reach."""

from __future__ import annotations

import os
import pickle
import stat
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from phalanx.strategies.launchers import WorkerState
from phalanx.strategies.launchers import multiprocessing as launcher_module
from phalanx.strategies.launchers.multiprocessing import (
    MultiProcessingLauncher,
    _read_results,
    _to_bytes,
    _write_results,
)


def _strategy() -> Any:
    return SimpleNamespace(
        cluster_environment=SimpleNamespace(main_address="127.0.0.1", main_port=29500), num_processes=2, global_rank=0
    )


def test_results_travel_through_a_private_directory_that_is_removed_afterwards(monkeypatch, tmp_path):
    monkeypatch.setattr(launcher_module.tempfile, "tempdir", str(tmp_path))
    seen: dict[str, Any] = {}

    def start_processes(function, args, nprocs, start_method, join):  # stands in for the workers: rank 0 writes
        results_path = Path(args[4])
        seen["mode"] = stat.S_IMODE(os.stat(results_path.parent).st_mode)
        seen["directory"] = results_path.parent
        results_path.write_bytes(_to_bytes({"result": {"answer": 42, "tensor": torch.ones(2)}}))

    monkeypatch.setattr(launcher_module.torch.multiprocessing, "start_processes", start_processes)
    result = MultiProcessingLauncher(_strategy(), start_method="spawn").launch(lambda: None)
    assert result["answer"] == 42 and torch.equal(result["tensor"], torch.ones(2))
    assert seen["mode"] == 0o700 and seen["directory"].parent == tmp_path  # no other user may enter, list or write
    assert not seen["directory"].exists()


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_results_file_owned_by_another_user_is_not_unpickled(tmp_path):
    path = tmp_path / "results.pt"
    path.write_bytes(_to_bytes({"result": 1}))
    os.chown(path, 12345, -1)
    with pytest.raises(
        RuntimeError, match="belongs to user id 12345, not to this process's user: refusing to unpickle it"
    ):
        _read_results(str(path))


class _RecordingState:
    """A driver's WorkerState: what the worker of rank 0 collects, and what the main process restores."""

    def __init__(self) -> None:
        self.restored: list[dict] = []

    def collect(self) -> dict:
        return {"steps": 3, "weights": torch.ones(2, requires_grad=True)}

    def restore(self, state: dict) -> None:
        self.restored.append(state)


def test_rank_zero_runs_with_the_launchers_strategy_and_its_worker_state_comes_back(monkeypatch, tmp_path):
    monkeypatch.setattr(launcher_module.tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("PHALANX_GLOBAL_SEED", raising=False)
    strategy = _strategy()
    seen: dict[str, Any] = {}

    def start_processes(function, args, nprocs, start_method, join):  # rank 0 only, in this process
        function(0, *args)

    def work(value: int, *, scale: int) -> int:
        seen["launched_rank"] = strategy._launched_local_rank  # the strategy the launcher holds is the worker's
        return value * scale

    monkeypatch.setattr(launcher_module.torch.multiprocessing, "start_processes", start_processes)
    state = _RecordingState()
    assert isinstance(state, WorkerState)
    assert MultiProcessingLauncher(strategy, start_method="spawn").launch(work, 7, worker_state=state, scale=3) == 21
    assert seen["launched_rank"] == 0
    (restored,) = state.restored
    assert (
        restored["steps"] == 3
        and torch.equal(restored["weights"], torch.ones(2))
        and not restored["weights"].requires_grad
    )
    assert (
        MultiProcessingLauncher(strategy, start_method="spawn").launch(work, 2, scale=2) == 4
    )  # no state: nothing restored
    assert len(state.restored) == 1


@pytest.mark.parametrize("global_rank", [0, 1, 3])
def test_the_first_worker_of_every_node_hands_back_to_its_main_process(monkeypatch, tmp_path, global_rank):
    """On node N of a multi-node run the first worker has global rank N * devices: its main process gets its results
    too (only global rank 0 wrote them before, and the other nodes' main processes failed on the missing file)."""
    monkeypatch.setattr(launcher_module.tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("PHALANX_GLOBAL_SEED", raising=False)
    strategy = _strategy()
    strategy.global_rank = global_rank

    def start_processes(function, args, nprocs, start_method, join):  # this node's first worker, in this process
        function(0, *args)

    monkeypatch.setattr(launcher_module.torch.multiprocessing, "start_processes", start_processes)
    state = _RecordingState()
    assert MultiProcessingLauncher(strategy, start_method="spawn").launch(lambda: "done", worker_state=state) == "done"
    assert [restored["steps"] for restored in state.restored] == [3]


def _raise_from_torch(error: BaseException) -> Any:
    def start_processes(function, args, nprocs, start_method, join):
        raise error  # what torch's join raises when the worker's error file is empty or cut short

    return start_processes


def _launch_failing_in_torch(monkeypatch, tmp_path, error: BaseException) -> None:
    monkeypatch.setattr(launcher_module.tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(launcher_module.torch.multiprocessing, "start_processes", _raise_from_torch(error))
    MultiProcessingLauncher(_strategy(), start_method="spawn").launch(lambda: None)


def _truncated(tmp_path: Path, size: int | None) -> None:
    path = tmp_path / "results.pt"
    if size is not None:
        path.write_bytes(_to_bytes({"result": torch.ones(100)})[:size])
    _read_results(str(path))


#: How the hand-back fails (a full temporary directory, and what it leads to), and what the error must name.
FAILURES: dict[str, tuple[Any, list[str]]] = {
    "the results cannot be written: the device is full": (
        lambda monkeypatch, tmp_path: _write_results("/dev/full", b"x" * 100, 3),
        ["Rank 3 could not hand its results back", "writing 100 bytes to /dev/full failed", "No space left on device"],
    ),
    "the results cannot be written: no such folder": (
        lambda monkeypatch, tmp_path: _write_results(str(tmp_path / "gone" / "results.pt"), b"x", 0),
        ["Rank 0 could not hand", "gone/results.pt failed", "No such file or directory"],
    ),
    "the results are cut short": (
        lambda monkeypatch, tmp_path: _truncated(tmp_path, 50),
        ["results.pt are cut short (50 bytes)", "bytes free"],
    ),
    "the results are empty": (
        lambda monkeypatch, tmp_path: _truncated(tmp_path, 0),
        ["results.pt are cut short (0 bytes)", "Ran out of input"],
    ),
    "the results are missing": (
        lambda monkeypatch, tmp_path: _truncated(tmp_path, None),
        ["the results the first worker of this node writes are not at", "results.pt"],
    ),
    "torch's error file is empty": (
        lambda monkeypatch, tmp_path: _launch_failing_in_torch(monkeypatch, tmp_path, EOFError("Ran out of input")),
        ["its error could not be handed back", "in the temporary directory {tmp}, empty or cut short", "bytes free"],
    ),
    "torch's error file is cut short": (
        lambda monkeypatch, tmp_path: _launch_failing_in_torch(
            monkeypatch, tmp_path, pickle.UnpicklingError("pickle data was truncated")
        ),
        ["its error could not be handed back", "UnpicklingError: pickle data was truncated", "point TMPDIR"],
    ),
}


@pytest.mark.parametrize("failure", list(FAILURES))
def test_a_failed_hand_back_says_what_ran_out_and_where(monkeypatch, tmp_path, failure):
    if "device is full" in failure and not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full (Linux), whose writes fail with ENOSPC")
    fail, named = FAILURES[failure]
    with pytest.raises(RuntimeError) as raised:
        fail(monkeypatch, tmp_path)
    for text in named:
        assert text.format(tmp=tmp_path) in str(raised.value)
    assert not isinstance(raised.value, EOFError)
