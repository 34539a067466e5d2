"""What a spawned or forked stage hands back to the main process: on every node of a multi-node run (each node's
main process gets its node's first worker's results, the same on both), and, when the hand-back cannot be written
(a full temporary directory), an error that says what ran out and where instead of ``EOFError: Ran out of input``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from phalanx_distributed import SCRIPTS, assert_ok, clean_environment, free_port, run_script

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")


@pytest.mark.parametrize("strategy", ["ddp_spawn", "ddp_fork"])
def test_each_nodes_main_process_gets_its_hand_back(tmp_path, strategy):
    port = str(free_port())
    nodes = []
    for node in ("0", "1"):  # two "nodes" on this machine, one worker each: a world of two
        env = clean_environment(NODE_RANK=node, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        command = [sys.executable, str(SCRIPTS / "spawn_hand_back_job.py"), str(tmp_path), strategy, "node"]
        nodes.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for process in nodes:
        try:
            stdout, stderr = process.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for other in nodes:
                other.kill()
            raise
        assert process.returncode == 0, stderr[-6000:]
    first, second = (json.loads((tmp_path / f"node{node}.json").read_text()) for node in (0, 1))
    assert first["global_step"] == second["global_step"] == 3
    assert first["best_model_path"] == second["best_model_path"] != ""
    assert first["weights"] == second["weights"]  # both got a trained model back: DDP keeps the replicas equal


@pytest.mark.parametrize("strategy", ["ddp_spawn", "ddp_fork"])
def test_a_hand_back_that_cannot_be_written_says_what_ran_out_and_where(tmp_path, strategy):
    job = run_script("spawn_hand_back_job.py", str(tmp_path), strategy, "unwritable")
    assert_ok(job)
    error = json.loads((tmp_path / "error.json").read_text())
    # The worker's error file of torch.multiprocessing could not be written either: the main process says so.
    assert "its error could not be handed back" in error["message"] and "temporary directory" in error["message"]
    assert error["type"] == "RuntimeError"  # not EOFError or UnpicklingError from torch.multiprocessing
    # The worker's own error, on its standard error: which file, how many bytes, and the system's reason.
    assert "Rank 0 could not hand its results back to the main process: writing" in job.stderr
    assert "results.pt failed ([Errno 27] File too large)" in job.stderr
