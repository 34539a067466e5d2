"""Runs that survive: preemption signals, torchrun restarts and a kill during a checkpoint write (real processes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from phalanx_distributed import SCRIPTS, assert_ok, clean_environment, free_port, run, run_script

from phalanx.trainer.checkpoint import is_complete_checkpoint


def _same(a, b) -> bool:
    first, second = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return all(torch.equal(x, y) for x, y in zip(first, second))


@pytest.fixture(scope="module")
def reference_two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    assert_ok(run_script("resumable_job.py", str(out), "2"))
    return out / "final.pt"


def test_a_signal_on_one_rank_stops_every_rank_at_the_same_step_and_the_rerun_matches(tmp_path, reference_two_ranks):
    first = run_script("resumable_job.py", str(tmp_path), "2", "--signal", "1", "6", "SIGUSR1")
    assert first.returncode == 75, first.stderr[-3000:]
    assert [p.name for p in (tmp_path / "checkpoints").glob("preempted-*")] == ["preempted-epoch=0-step=6.ckpt"]
    checkpoint = torch.load(tmp_path / "checkpoints" / "preempted-epoch=0-step=6.ckpt", weights_only=True)
    assert len(checkpoint["rng_states"]) == 2
    assert_ok(run_script("resumable_job.py", str(tmp_path), "2", "--signal", "1", "6", "SIGUSR1"))
    assert _same(tmp_path / "final.pt", reference_two_ranks)


def test_torchrun_restarts_after_a_killed_worker_and_ends_like_an_uninterrupted_run(tmp_path, reference_two_ranks):
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "3",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
        str(SCRIPTS / "resumable_job.py"), str(tmp_path), "2", "--kill", "1", "9",
    ]  # fmt: skip
    job = run(command, timeout=150)
    assert_ok(job)
    assert (tmp_path / "attempted").exists()  # the kill did happen
    assert _same(tmp_path / "final.pt", reference_two_ranks)


def test_a_kill_during_a_checkpoint_write_leaves_the_previous_one_and_the_rerun_resumes_from_it(tmp_path):
    reference = tmp_path / "reference"
    assert_ok(run_script("resumable_job.py", str(reference), "1"))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "resumable_job.py"), str(run_dir), "1", "--slow-save", "8"],
        env=clean_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while not (run_dir / "saving").exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert (run_dir / "saving").exists(), proc.communicate()
    os.killpg(proc.pid, signal.SIGKILL)  # mid-write: the step-8 bytes are on disk under a temporary name
    proc.communicate()
    checkpoints = run_dir / "checkpoints"
    # The name was claimed (a hidden marker, so that a run beside this one picks another) but never filled: nothing
    # is under the final name.
    assert not os.path.lexists(checkpoints / "epoch=0-step=8.ckpt")
    assert not is_complete_checkpoint(checkpoints / "epoch=0-step=8.ckpt")
    assert any(p.name.endswith(".tmp") for p in checkpoints.iterdir())
    assert (checkpoints / ".epoch=0-step=8.ckpt.claim").exists()
    previous = torch.load(checkpoints / "epoch=0-step=4.ckpt", weights_only=True)
    assert previous["global_step"] == 4
    assert_ok(run_script("resumable_job.py", str(run_dir), "1", "--slow-save", "8"))
    assert _same(run_dir / "final.pt", reference / "final.pt")
    # The rerun reclaimed the killed save's name (its marker unlocked) and what it left, and saved step 8 under it.
    assert torch.load(checkpoints / "epoch=0-step=8.ckpt", weights_only=True)["global_step"] == 8
    assert not any(p.name.endswith((".tmp", ".claim")) for p in checkpoints.iterdir())


def _close(a, b, tolerance: float = 1e-5) -> bool:
    first, second = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return len(first) == len(second) and all(
        torch.allclose(x, y, atol=tolerance, rtol=0) for x, y in zip(first, second)
    )


@pytest.mark.parametrize("strategy", ["fsdp", "deepspeed_stage_2"])
def test_sigterm_on_a_sharded_strategy_saves_exits_75_and_the_rerun_ends_like_ddp(
    tmp_path, reference_two_ranks, strategy
):
    if strategy.startswith("deepspeed"):
        pytest.importorskip("deepspeed")
    env = clean_environment(DS_ACCELERATOR="cpu")
    first = run_script(
        "resumable_job.py", str(tmp_path), "2", "--strategy", strategy, "--signal", "1", "6", "SIGTERM", env=env
    )
    assert first.returncode == 75, first.stderr[-3000:]
    preempted = tmp_path / "checkpoints" / "preempted-epoch=0-step=6.ckpt"
    assert is_complete_checkpoint(preempted)  # FSDP: one whole file by default; DeepSpeed: a marked directory
    before = (tmp_path / "checkpoints" / "epoch=0-step=4.ckpt").stat().st_mtime_ns
    assert_ok(run_script("resumable_job.py", str(tmp_path), "2", "--strategy", strategy, env=env))
    assert (tmp_path / "checkpoints" / "epoch=0-step=4.ckpt").stat().st_mtime_ns == before  # resumed, not restarted
    assert is_complete_checkpoint(tmp_path / "checkpoints" / "epoch=0-step=8.ckpt")
    assert _close(tmp_path / "final.pt", reference_two_ranks)
