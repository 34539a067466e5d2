"""`phalanx run` on 2 CPU processes: a Cohort script with every flag (launched through torchrun's launcher), and the
same script started inside a simulated SLURM job step and torchrun worker set, where phalanx run runs it in the
process the cluster started (scripts/run_command_job.py, scripts/run_command_clusters.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from phalanx_distributed import SCRIPTS, assert_ok, clean_environment, free_port, run, run_script

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")


def _ranks(directory: Path) -> list[dict]:
    return [json.loads((directory / f"rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.fixture(scope="module")
def every_flag(tmp_path_factory):
    out, port = tmp_path_factory.mktemp("phalanx_run"), free_port()
    flags = ["--accelerator", "cpu", "--strategy", "ddp", "--devices", "2", "--num-nodes", "1", "--node-rank", "0"]
    flags += ["--main-address", "127.0.0.1", "--main-port", str(port), "--precision", "bf16-mixed"]
    command = [sys.executable, "-m", "phalanx", "run", *flags, str(SCRIPTS / "run_command_job.py"), str(out)]
    job = run([*command, "--lr", "0.5", "tail"], env=clean_environment(), timeout=300)
    assert_ok(job)
    return _ranks(out), port, job


def test_every_flag_reaches_the_cohort_of_every_rank(every_flag):
    ranks, port, _ = every_flag
    for rank, seen in enumerate(ranks):
        assert (seen["global_rank"], seen["local_rank"], seen["node_rank"], seen["world_size"]) == (rank, rank, 0, 2)
        assert (seen["num_nodes"], seen["num_devices"]) == (1, 2)
        assert (seen["strategy"], seen["accelerator"], seen["precision"]) == (
            "DDPStrategy",
            "CPUAccelerator",
            "bf16-mixed",
        )
        assert (seen["main_address"], seen["main_port"]) == ("127.0.0.1", str(port))
        assert seen["cluster_environment"] == "TorchElasticEnvironment"  # torchrun's launcher started the ranks
        assert seen["script_args"] == ["--lr", "0.5", "tail"]
        assert seen["loss_dtype"] == "torch.float32"  # item 1: outputs back in the default dtype
        assert seen["rank_sum"] == 1.0
    assert ranks[0]["weights"] == ranks[1]["weights"]  # DDP kept the replicas equal
    assert ranks[0]["pid"] != ranks[1]["pid"]


@pytest.fixture(scope="module")
def clusters(tmp_path_factory):
    out = tmp_path_factory.mktemp("phalanx_run_clusters")
    assert_ok(run_script("run_command_clusters.py", str(out), str(free_port()), "slurm", "torchrun", timeout=400))
    return out


@pytest.mark.parametrize(
    ("kind", "environment"), [("slurm", "SLURMEnvironment"), ("torchrun", "TorchElasticEnvironment")]
)
def test_inside_a_started_job_the_script_runs_in_the_process_the_cluster_started(clusters, kind, environment):
    launched = json.loads((clusters / kind / "launched.json").read_text())
    assert launched["codes"] == [0, 0]
    ranks = _ranks(clusters / kind)
    # The script ran in the very process the cluster started (no torchrun below it), rank as the cluster said.
    assert [seen["pid"] for seen in ranks] == launched["pids"]
    for rank, seen in enumerate(ranks):
        assert (seen["global_rank"], seen["world_size"], seen["cluster_environment"]) == (rank, 2, environment)
        assert (seen["strategy"], seen["precision"], seen["num_devices"]) == ("DDPStrategy", "64-true", 2)
        assert seen["main_address"] == "127.0.0.1"  # SLURM: the first host of a space-separated node list (item 4)
        assert seen["script_args"] == [kind] and seen["loss_dtype"] == "torch.float32"
    assert ranks[0]["weights"] == ranks[1]["weights"]


def test_a_failing_script_fails_the_command_naming_the_ranks(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    command = [sys.executable, "-m", "phalanx", "run", "--accelerator", "cpu", "--devices", "2"]
    job = run([*command, "--main-port", str(free_port()), str(script)], env=clean_environment(), timeout=120)
    assert job.returncode == 1
    assert f"phalanx run: error: {script} failed on rank(s) [1]" in job.stderr
