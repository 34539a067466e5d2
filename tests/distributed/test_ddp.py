"""DDP on 2 CPU processes (gloo), started through the shared helper in tests/phalanx_distributed.py."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from phalanx_distributed import SCRIPTS, assert_ok, clean_environment, free_port, run, run_script

sys.path.insert(0, str(SCRIPTS))  # the scripts' shared models (ddp_common) serve as references here too

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")


def _ranks(directory, count):
    return [json.loads((directory / f"rank{rank}.json").read_text()) for rank in range(count)]


@pytest.fixture(scope="module")
def features(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp_features")
    assert_ok(run_script("ddp_features.py", str(out)))
    return out, _ranks(out, 2)


def test_training_data_is_sharded_and_reshuffled_each_epoch(features):
    _, (rank0, rank1) = features
    assert rank0["world_size"] == rank1["world_size"] == 2
    # 51 samples -> 26 per rank (one padded), batches of 13 -> 2 steps an epoch, 3 epochs
    assert rank0["global_step"] == rank1["global_step"] == 6
    per_epoch = 26
    for epoch in range(3):
        first = rank0["seen_train"][epoch * per_epoch : (epoch + 1) * per_epoch]
        second = rank1["seen_train"][epoch * per_epoch : (epoch + 1) * per_epoch]
        assert set(first) | set(second) == set(range(51))
    assert rank0["sampler_orders"][0] != rank0["sampler_orders"][1]  # set_epoch changes the order
    assert set(rank0["sampler_orders"][0]).isdisjoint(set(rank1["sampler_orders"][0]) - {rank0["sampler_orders"][0][0]})


def test_evaluation_counts_every_sample_once_and_metrics_agree(features):
    _, (rank0, rank1) = features
    assert rank0["val_count"] == rank1["val_count"] == 51.0  # no padded duplicates
    assert rank0["val_loss_fit"] == rank1["val_loss_fit"]
    assert rank0["validated"] == rank1["validated"] and rank0["validated"][0]["val_count"] == 51.0
    assert rank0["tested"] == rank1["tested"]


def test_weights_stay_identical_and_collectives_work(features):
    _, (rank0, rank1) = features
    assert rank0["weights"] == rank1["weights"]
    assert rank0["gathered"] == rank1["gathered"] == [0.0, 1.0]
    assert rank0["decision_all"] is False and rank0["decision_any"] is True
    assert rank1["decision_all"] is False and rank1["decision_any"] is True
    assert (rank0["rank_zero_calls"], rank1["rank_zero_calls"]) == (1, 0)


def test_checkpoints_written_once_and_callbacks_agree(features):
    out, (rank0, rank1) = features
    assert rank0["io_saved"] > 0 and rank1["io_saved"] == 0
    assert rank0["best_model_path"] == rank1["best_model_path"]
    assert rank0["best_k"] == rank1["best_k"]
    assert (out / "checkpoints" / "last.ckpt").exists()
    checkpoint = torch.load(rank0["best_model_path"], weights_only=True)
    assert len(checkpoint["rng_states"]) == 2  # every rank's generators


def test_predictions_come_back_in_dataset_order(features):
    out, (rank0, rank1) = features
    from ddp_common import Net

    saved = torch.load(out / "state0.pt", weights_only=True)
    model = Net(batchnorm=True)
    model.load_state_dict(saved["state_dict"])
    model.eval()
    with torch.no_grad():
        expected = model(saved["x"]).flatten().tolist()
    assert rank0["prediction_batches"] == [8] * 6 + [3]
    assert rank0["predictions"] == pytest.approx(expected, abs=1e-6)
    assert rank1["predictions"] == rank0["predictions"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The hand-written DDP script's weights after its 50 steps: one run serves every test that compares with it."""
    path = tmp_path_factory.mktemp("reference_ddp") / "reference.pt"
    assert_ok(run_script("reference_ddp.py", str(path)))
    return torch.load(path, weights_only=True)


def test_same_weights_as_a_hand_written_ddp_script_and_close_to_one_process(tmp_path, reference):
    assert_ok(run_script("ddp_parity.py", str(tmp_path / "phalanx.pt")))
    ours = torch.load(tmp_path / "phalanx.pt", weights_only=True)
    assert all(torch.equal(a, b) for a, b in zip(ours, reference))

    # One process on the union of both ranks' batches (batch 16, the same permutation) ends at the same point.
    from ddp_common import IndexedRegression
    from torch import nn
    from torch.utils.data import DataLoader, DistributedSampler

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = IndexedRegression(n=800)
    loader = DataLoader(
        data, batch_size=16, sampler=DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    )
    for step, (x, y, _) in enumerate(loader):
        if step == 50:
            break
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(ours, model.parameters()))


@pytest.mark.parametrize("strategy", ["ddp_spawn", "ddp_fork"])
def test_spawned_and_forked_ranks_train_like_ddp_and_a_hand_written_script(tmp_path, strategy, reference):
    # Spawned workers receive the module through shared memory: each rank must step its own copy, or every update
    # lands world_size times (the weights would differ from the reference by far more than rounding).
    assert_ok(run_script("ddp_parity.py", str(tmp_path / "ours.pt"), strategy))
    ours = torch.load(tmp_path / "ours.pt", weights_only=True)
    assert all(torch.equal(a, b) for a, b in zip(ours, reference))


@pytest.mark.parametrize("strategy", ["ddp_spawn", "ddp_fork"])
def test_workers_keep_the_main_process_switches_and_configure_model_layers_come_back(tmp_path, strategy):
    assert_ok(run_script("spawn_settings.py", str(tmp_path), strategy))
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen == {
            "deterministic": True,
            "warn_only": True,
            "cudnn_deterministic": True,
            "matmul_precision": "medium",
        }
    main = json.loads((tmp_path / "main.json").read_text())
    assert main == {"has_head": True, "same_as_rank0": True}


@pytest.mark.parametrize("strategy", ["ddp_spawn", "ddp_fork"])
def test_multiprocessing_launchers_bring_results_back(tmp_path, strategy):
    assert_ok(run_script("launch_results.py", str(tmp_path), strategy))
    main = json.loads((tmp_path / "main.json").read_text())
    assert main["changed"] is True  # the user's module in the main process holds the trained weights
    assert main["global_step"] == 10 and main["current_epoch"] == 2
    assert main["val_loss"] is not None
    assert main["best_model_path"].endswith(".ckpt") and (tmp_path / main["best_model_path"].split("/")[-1]).exists()
    assert main["predictions_match"] is True
    assert main["prediction_batches"] == [8] * 5


def test_torchrun_starts_the_processes(tmp_path):
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        str(SCRIPTS / "tiny_fit.py"),
        str(tmp_path),
        "2",
        "1",
    ]
    assert_ok(run(command))
    rank0, rank1 = _ranks(tmp_path, 2)
    assert rank0["environment"] == rank1["environment"] == "TorchElasticEnvironment"
    assert (rank0["global_rank"], rank1["global_rank"]) == (0, 1)
    assert rank0["weights"] == rank1["weights"] and rank0["global_step"] == 4


def test_torchrun_with_mismatched_devices_is_refused(tmp_path):
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        str(SCRIPTS / "tiny_fit.py"),
        str(tmp_path),
        "3",
        "1",
    ]
    job = run(command)
    assert job.returncode != 0
    assert "devices=3" in job.stderr


def test_slurm_environment_is_detected_from_its_variables(tmp_path):
    port = str(free_port())
    procs = []
    import subprocess

    for rank in range(2):
        env = clean_environment(
            SLURM_NTASKS="2",
            SLURM_PROCID=str(rank),
            SLURM_LOCALID=str(rank),
            SLURM_NODEID="0",
            SLURM_NNODES="1",
            SLURM_NTASKS_PER_NODE="2",
            SLURM_JOB_ID="4242",
            SLURM_JOB_NAME="train",
            SLURM_NODELIST="127.0.0.1",
            MASTER_PORT=port,
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(SCRIPTS / "tiny_fit.py"), str(tmp_path), "2", "1"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outputs = [proc.communicate(timeout=120) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    rank0, rank1 = _ranks(tmp_path, 2)
    assert rank0["environment"] == "SLURMEnvironment"
    assert (rank0["global_rank"], rank1["global_rank"]) == (0, 1)
    assert rank0["weights"] == rank1["weights"]


def test_two_nodes_on_one_machine(tmp_path):
    port = str(free_port())
    import subprocess

    procs = []
    for node in range(2):
        env = clean_environment(NODE_RANK=str(node), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(
            subprocess.Popen(
                [sys.executable, str(SCRIPTS / "tiny_fit.py"), str(tmp_path), "1", "2"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outputs = [proc.communicate(timeout=120) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    rank0, rank1 = _ranks(tmp_path, 2)
    assert (rank0["node_rank"], rank1["node_rank"]) == (0, 1)
    assert rank0["world_size"] == 2 and rank0["weights"] == rank1["weights"]


@pytest.fixture(scope="module")
def options_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp_options")
    assert_ok(run_script("ddp_options.py", str(out)))
    return out, _ranks(out, 2)


@pytest.fixture(scope="module")
def options(options_job):
    return options_job[1]


def test_a_zero_redundancy_optimizer_checkpoint_holds_the_whole_state_of_plain_adam(options_job):
    out, (rank0, rank1) = options_job
    flat = lambda tensors: [value for tensor in tensors for value in tensor]  # noqa: E731
    assert rank0["zero"] == rank1["zero"]
    assert flat(rank0["zero"]) == pytest.approx(flat(rank0["adam"]), abs=1e-6)  # ZeRO trained like plain Adam
    zero = torch.load(out / "zero.ckpt", weights_only=True)["optimizer_states"][0]
    adam = torch.load(out / "adam.ckpt", weights_only=True)["optimizer_states"][0]
    assert zero["param_groups"][0]["params"] == adam["param_groups"][0]["params"] == [0, 1, 2, 3]
    assert zero["state"].keys() == adam["state"].keys() == {0, 1, 2, 3}  # both ranks' shards, consolidated
    for index, entries in adam["state"].items():
        assert entries.keys() == zero["state"][index].keys()
        for name, value in entries.items():
            torch.testing.assert_close(zero["state"][index][name], value, rtol=1e-5, atol=1e-7)
    # ... and it is the state of an ordinary optimizer: one process loads it into plain Adam
    from ddp_common import Net

    resumed = torch.optim.Adam(Net().parameters(), lr=0.01)
    resumed.load_state_dict(zero)
    assert resumed.state_dict()["state"][0]["exp_avg"].shape == (16, 4)


def test_manual_optimization_and_static_graph_match_automatic_ddp(options):
    rank0, rank1 = options
    for key in ("automatic", "manual", "static_graph", "comm_hook", "averaging"):
        assert rank0[key] == rank1[key], f"{key}: ranks diverged"
    assert rank0["manual"] == rank0["automatic"]
    assert rank0["static_graph"] == rank0["automatic"]


def test_comm_hook_with_wrapper_and_post_local_sgd_averaging(options):
    rank0, _ = options
    assert rank0["hook_calls"] == 6  # one bucket per step, through our hook
    flat = lambda tensors: [value for tensor in tensors for value in tensor]  # noqa: E731
    assert flat(rank0["comm_hook"]) == pytest.approx(flat(rank0["automatic"]), abs=1e-2)  # fp16-compressed gradients
    assert rank0["comm_hook"] != rank0["automatic"]
    assert rank0["averaging_optimizer"] == "PostLocalSGDOptimizer"
    assert rank0["averaging"] != rank0["automatic"]  # local steps between averages change the trajectory


def test_unused_parameters_error_becomes_a_hint(tmp_path):
    job = run_script("ddp_options.py", str(tmp_path), "unused")
    assert job.returncode != 0
    assert "find_unused_parameters=True" in job.stderr and "ddp_find_unused_parameters_true" in job.stderr


def test_python_dash_m_with_arguments_is_relaunched_the_same_way(tmp_path):
    job = run([sys.executable, "-m", "tiny_fit", str(tmp_path), "2", "1", "--extra-flag"], cwd=SCRIPTS)
    assert_ok(job)
    rank0, rank1 = _ranks(tmp_path, 2)
    assert rank1["argv"] == rank0["argv"] == [str(tmp_path), "2", "1", "--extra-flag"]
    assert rank0["weights"] == rank1["weights"]
