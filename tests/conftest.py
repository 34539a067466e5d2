"""Shared pytest set-up: the test models live in phalanx_testing.py beside this file (importable from every test)."""

import os

import pytest
import torch

# What a launcher sets for its processes: left behind, they make the next test look like a process of a started job.
_LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK")
# What seed_everything leaves for child processes: left behind, a later job's DistributedSampler (phalanx's and
# Lightning's alike) shuffles with another test's seed, and a parity test compares two different orders.
_SEED_VARIABLES = ("PHALANX_GLOBAL_SEED", "PL_GLOBAL_SEED", "PHALANX_SEED_WORKERS", "PL_SEED_WORKERS")


@pytest.fixture(autouse=True)
def _restore_torch_globals():
    # Tests that change torch's global switches (deterministic algorithms, default dtype) must not leak them.
    dtype = torch.get_default_dtype()
    deterministic = torch.are_deterministic_algorithms_enabled()
    launch = {name: os.environ.get(name) for name in _LAUNCH_VARIABLES + _SEED_VARIABLES}
    yield
    for name, value in launch.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    torch.set_default_dtype(dtype)
    torch.use_deterministic_algorithms(deterministic)
    _refuse_a_leftover_process_group()


def _refuse_a_leftover_process_group() -> None:
    # A process group left initialised makes every later in-process test that starts one fail far from the cause
    # ("trying to initialize the default process group twice"), and a forked child inherits its threads' state: the
    # test that left it fails here instead, and the group is destroyed so that the next tests start clean.
    distributed = torch.distributed
    if distributed.is_available() and distributed.is_initialized():
        distributed.destroy_process_group()
        pytest.fail("this test left a torch.distributed process group initialised; destroy it (strategy.teardown())")
