"""Preemption in one process: real signals sent to this process during fit, and automatic resume."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
import torch
from phalanx_testing import Regressor, loaders, parameters_of, quiet_trainer, same_parameters

import phalanx
from phalanx.trainer import PREEMPTED_EXIT_CODE, Preemption
from phalanx.trainer.checkpoint import COMPLETE_MARKER, is_complete_checkpoint, newest_complete_checkpoint


class SignalAt(phalanx.Callback):
    def __init__(self, step: int, signum: int) -> None:
        self.step, self.signum = step, signum

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), self.signum)


def _fit(tmp_path, *, callbacks=(), seed=3, ckpt_path=None, **options) -> tuple[list[torch.Tensor], phalanx.Trainer]:
    phalanx.seed_everything(seed)
    model = Regressor(dropout=0.2)
    trainer = quiet_trainer(max_epochs=2, default_root_dir=tmp_path, callbacks=list(callbacks), **options)
    trainer.fit(model, *loaders(n=64, batch_size=8), ckpt_path=ckpt_path)
    return parameters_of(model), trainer


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_saves_a_checkpoint_exits_with_the_preempted_status_and_resumes_exactly(tmp_path, signum):
    reference, _ = _fit(tmp_path / "reference")
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as exited:
        _fit(run_dir, callbacks=[SignalAt(5, signum)])
    assert exited.value.code == PREEMPTED_EXIT_CODE == 75
    saved = sorted((run_dir / "checkpoints").glob("preempted-*.ckpt"))
    assert [p.name for p in saved] == ["preempted-epoch=0-step=5.ckpt"]
    assert torch.load(saved[0], weights_only=True)["global_step"] == 5
    assert signal.getsignal(signum) is signal.SIG_DFL  # the handler is gone once fit is over
    resumed, trainer = _fit(run_dir, seed=99, ckpt_path="auto")
    assert trainer.global_step == 16 and not trainer.preempted
    assert same_parameters(resumed, reference)


def test_preemption_without_exit_returns_and_can_be_disabled(tmp_path):
    _, trainer = _fit(tmp_path / "a", callbacks=[SignalAt(3, signal.SIGUSR1)], preemption=Preemption(exit=False))
    assert trainer.preempted and trainer.global_step == 3
    with pytest.raises(TypeError, match="preemption"):
        quiet_trainer(preemption="yes")
    with pytest.raises(ValueError, match="SIGKILL|cannot be handled"):
        Preemption(signals=[signal.SIGKILL])
    with pytest.raises(ValueError, match="check_every_n_steps"):
        Preemption(check_every_n_steps=0)


def test_slurm_requeue_runs_the_configured_command(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    monkeypatch.setenv("PHALANX_REQUEUE_COMMAND", f"touch {tmp_path}/requeued-{{job_id}}")
    _, trainer = _fit(
        tmp_path / "run", callbacks=[SignalAt(2, signal.SIGTERM)], preemption=Preemption(exit=False, requeue=True)
    )
    assert trainer.preempted
    assert (tmp_path / "requeued-777").exists()


def test_auto_without_checkpoints_starts_fresh(tmp_path):
    _, trainer = _fit(tmp_path, ckpt_path="auto")
    assert trainer.global_step == 16


def test_newest_complete_checkpoint_skips_partial_writes_and_unfinished_directories(tmp_path):
    from phalanx.plugins.io.formats.dcp import save_sharded

    older = tmp_path / "older.ckpt"
    torch.save({"global_step": 1, "state_dict": {}}, older)
    further = tmp_path / "further.ckpt"
    torch.save({"global_step": 9, "state_dict": {}}, further)
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(further.read_bytes()[:-40])  # a copy cut short
    further.unlink()
    partial = tmp_path / ".newest.ckpt.abc.tmp"  # an atomic write that never finished
    partial.write_bytes(older.read_bytes())
    unfinished = tmp_path / "sharded.ckpt"
    save_sharded(
        {"global_step": 3, "state_dict": {"w": torch.ones(2)}},
        unfinished,
        is_global_zero=True,
        broadcast=lambda value: value,
        barrier=lambda name: None,
    )
    (unfinished / COMPLETE_MARKER).unlink()  # as a directory whose save did not finish
    assert not is_complete_checkpoint(truncated) and not is_complete_checkpoint(unfinished)
    assert newest_complete_checkpoint([tmp_path]) == str(older.resolve())
    (unfinished / COMPLETE_MARKER).touch()
    assert newest_complete_checkpoint([tmp_path]) == str(unfinished.resolve())  # step 3 is further than step 1
    assert newest_complete_checkpoint([tmp_path / "missing"]) is None
