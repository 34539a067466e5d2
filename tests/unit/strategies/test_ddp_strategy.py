"""DDPStrategy and ParallelStrategy pieces that need no second process."""

from __future__ import annotations

import os
import sys
import types
from datetime import timedelta

import pytest
import torch
from torch import nn

import phalanx
from phalanx.plugins.environments import DefaultEnvironment, TorchElasticEnvironment
from phalanx.plugins.layer_sync import TorchSyncBatchNorm
from phalanx.strategies import STRATEGY_REGISTRY, DDPStrategy
from phalanx.strategies.launchers.multiprocessing import MultiProcessingLauncher
from phalanx.strategies.launchers.subprocess_script import SubprocessScriptLauncher, script_command


def test_registry_names_and_their_options():
    names = {"ddp", "ddp_spawn", "ddp_fork", "ddp_notebook"}
    for base in list(names):
        names |= {f"{base}_find_unused_parameters_true", f"{base}_find_unused_parameters_false"}
    assert names <= set(STRATEGY_REGISTRY.available())
    assert STRATEGY_REGISTRY.init_params("ddp_spawn_find_unused_parameters_true") == {
        "start_method": "spawn",
        "find_unused_parameters": True,
    }
    assert STRATEGY_REGISTRY.init_params("ddp_notebook") == {"start_method": "fork"}


def test_trainer_resolves_ddp_with_devices_environment_and_launcher(monkeypatch):
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    trainer = phalanx.Trainer(
        strategy="ddp_find_unused_parameters_true", devices=3, num_nodes=2, accelerator="cpu", logger=False
    )
    strategy = trainer.strategy
    assert isinstance(strategy, DDPStrategy)
    assert strategy.parallel_devices == [torch.device("cpu")] * 3 and strategy.num_nodes == 2
    assert isinstance(strategy.cluster_environment, DefaultEnvironment)
    assert isinstance(strategy.launcher, SubprocessScriptLauncher)
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 6, "rank": 0}
    assert strategy._ddp_kwargs == {"find_unused_parameters": True}
    assert isinstance(
        phalanx.Trainer(strategy="ddp_spawn", devices=2, accelerator="cpu", logger=False).strategy.launcher,
        MultiProcessingLauncher,
    )
    assert isinstance(phalanx.Trainer(devices=2, accelerator="cpu", logger=False).strategy, DDPStrategy)  # 'auto'


def test_torchrun_environment_is_detected_and_validated(monkeypatch):
    variables = {
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RUN_ID": "x",
    }
    for key, value in variables.items():
        monkeypatch.setenv(key, value)
    strategy = phalanx.Trainer(strategy="ddp", devices=2, accelerator="cpu", logger=False).strategy
    assert isinstance(strategy.cluster_environment, TorchElasticEnvironment)
    assert strategy.launcher is None  # torchrun started the processes
    assert strategy.global_rank == 1 and strategy.local_rank == 1
    with pytest.raises(ValueError, match="devices=4"):
        phalanx.Trainer(strategy="ddp", devices=4, accelerator="cpu", logger=False)


def test_constructor_validation():
    with pytest.raises(ValueError, match="popen"):
        DDPStrategy(start_method="thread")
    with pytest.raises(TypeError, match="timedelta"):
        DDPStrategy(timeout=30)
    with pytest.raises(ValueError, match="model_averaging_period"):
        DDPStrategy(model_averaging_period=0)
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState

    with pytest.raises(ValueError, match="model_averaging_period="):
        DDPStrategy(ddp_comm_state=PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=1))
    assert DDPStrategy(timeout=timedelta(seconds=5))._timeout == timedelta(seconds=5)


def test_sync_batchnorm_on_cpu_is_refused_and_conversion_round_trips():
    with pytest.raises(ValueError, match="SyncBatchNorm does not run on the CPU"):
        phalanx.Trainer(strategy="ddp", devices=2, accelerator="cpu", sync_batchnorm=True, logger=False)
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Sequential(nn.BatchNorm1d(4)))
    model[1].running_mean.fill_(3.0)
    layer_sync = TorchSyncBatchNorm()
    synced = layer_sync.apply(model)
    assert isinstance(synced[1], nn.SyncBatchNorm) and isinstance(synced[2][0], nn.SyncBatchNorm)
    reverted = layer_sync.revert(synced)
    assert not any(isinstance(m, nn.SyncBatchNorm) for m in reverted.modules())
    assert torch.equal(reverted[1].running_mean, torch.full((2,), 3.0))
    assert reverted[1].weight is synced[1].weight
    reverted.eval()
    assert reverted[:2](torch.randn(1, 1, 5, 5)).shape == (1, 2, 3, 3)


def test_script_command_reruns_scripts_and_modules(monkeypatch, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    fake_main = types.ModuleType("__main__")
    fake_main.__spec__ = None
    monkeypatch.setitem(sys.modules, "__main__", fake_main)
    monkeypatch.setattr(sys, "argv", [str(script), "--lr", "0.1"])
    assert script_command() == [sys.executable, str(script), "--lr", "0.1"]
    fake_main.__spec__ = types.SimpleNamespace(name="mypackage.train")
    monkeypatch.setattr(sys, "argv", ["/somewhere/mypackage/train.py", "--fast"])
    assert script_command() == [sys.executable, "-m", "mypackage.train", "--fast"]
    fake_main.__spec__ = types.SimpleNamespace(name="mypackage.__main__")
    assert script_command()[:3] == [sys.executable, "-m", "mypackage"]
    fake_main.__spec__ = None
    monkeypatch.setattr(sys, "argv", ["-c"])
    with pytest.raises(RuntimeError, match="ddp_notebook"):
        script_command()


@pytest.mark.parametrize(("processes", "refused"), [(1, False), (2, True)], ids=["one-process", "two-processes"])
def test_a_launch_from_python_c_is_refused_only_when_the_script_must_run_again(monkeypatch, processes, refused):
    # `python -c`, a notebook or a pytest-xdist worker has no script: a single process per node has nothing to re-run.
    from phalanx.plugins.environments.default import DefaultEnvironment
    from phalanx.strategies.launchers.subprocess_script import SubprocessScriptLauncher

    fake_main = types.ModuleType("__main__")
    fake_main.__spec__ = None
    monkeypatch.setitem(sys.modules, "__main__", fake_main)
    monkeypatch.setattr(sys, "argv", ["-c"])
    for name in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    launcher = SubprocessScriptLauncher(DefaultEnvironment(), num_processes=processes, num_nodes=1)
    if refused:
        with pytest.raises(RuntimeError, match="'-c' is not a file"):
            launcher.launch(lambda: "ran")
    else:
        assert launcher.launch(lambda: "ran") == "ran" and launcher.procs == []
    assert os.environ["WORLD_SIZE"] == str(processes)


def test_seed_everything_workers_injects_a_rank_aware_worker_init_fn(monkeypatch):
    from phalanx_testing import loaders, quiet_trainer

    phalanx.seed_everything(3, workers=True)
    trainer = quiet_trainer()
    train, _ = loaders(num_workers=1)
    prepared = trainer._prepare_dataloader(train, training=True)
    assert prepared.worker_init_fn is not None and prepared.worker_init_fn.keywords == {"rank": 0}
    monkeypatch.setenv("PHALANX_SEED_WORKERS", "0")
    fresh, _ = loaders(num_workers=1)
    assert trainer._prepare_dataloader(fresh, training=True).worker_init_fn is None


@pytest.mark.parametrize(
    ("node_rank", "local_rank", "expected"), [("1", None, 2), ("1", "1", 3), ("0", "1", 1), (None, None, 0)]
)
def test_ranks_are_known_from_construction_not_only_from_fit(monkeypatch, node_rank, local_rank, expected):
    from phalanx.utilities import rank_zero

    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_PORT", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    if node_rank is not None:
        monkeypatch.setenv("NODE_RANK", node_rank)
    if local_rank is not None:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    try:
        trainer = phalanx.Trainer(strategy="ddp", devices=2, num_nodes=2, accelerator="cpu", logger=False)
        assert trainer.global_rank == expected and trainer.is_global_zero is (expected == 0)
        assert rank_zero.rank_zero_only.rank == expected  # rank-zero-only code before fit runs on global rank 0 only
    finally:
        rank_zero.set_global_rank(0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"find_unused_paramters": True},
            r"unknown keyword argument\(s\) 'find_unused_paramters' \(did you mean 'find_unused_parameters'\?\)",
        ),
        ({"bucket_cap": 25}, r"'bucket_cap' \(did you mean 'bucket_cap_mb'\?\)"),
        (
            {"zzz": 1},
            r"unknown keyword argument\(s\) 'zzz'; it passes extra keywords to DistributedDataParallel, which accepts"
            r" \[.*'static_graph'",
        ),
        ({"device_ids": [0]}, r"DDPStrategy sets \['device_ids'\] itself"),
        ({"output_device": 0}, r"DDPStrategy sets \['output_device'\] itself"),
    ],
)
def test_a_misspelt_ddp_option_is_refused_at_construction(kwargs, message):
    with pytest.raises(TypeError, match=message):
        DDPStrategy(**kwargs)


def test_every_distributed_data_parallel_option_is_accepted():
    options = {
        "find_unused_parameters": True,
        "static_graph": True,
        "gradient_as_bucket_view": True,
        "bucket_cap_mb": 10,
        "broadcast_buffers": False,
    }
    assert DDPStrategy(**options)._ddp_kwargs == options


def test_device_arguments_left_at_none_are_dropped():
    # jsonargparse fills in every DistributedDataParallel parameter it finds behind **kwargs, with its default.
    assert DDPStrategy(device_ids=None, output_device=None, dim=0)._ddp_kwargs == {"dim": 0}
