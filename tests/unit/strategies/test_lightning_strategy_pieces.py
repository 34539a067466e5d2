"""Strategy pieces that behave as in Lightning: ModelParallelStrategy.device_mesh read before the processes joined
their group is a clear error, and the script launcher refuses to start processes from a local rank other than 0."""

from __future__ import annotations

import pytest
import torch
from phalanx_testing import Regressor

from phalanx.plugins.environments import DefaultEnvironment
from phalanx.strategies import ModelParallelStrategy
from phalanx.strategies.launchers.subprocess_script import SubprocessScriptLauncher


def test_the_device_mesh_read_before_set_up_is_a_clear_error():
    strategy = ModelParallelStrategy(parallel_devices=[torch.device("cpu")] * 2)
    with pytest.raises(RuntimeError, match="device_mesh is built when the processes join their group"):
        strategy.device_mesh  # noqa: B018
    mesh = object()
    strategy.device_mesh = mesh  # what setup_environment does
    assert strategy.device_mesh is mesh


def test_a_module_reads_no_mesh_before_set_up():
    # The module answers None, as Lightning's does, rather than the strategy's error.
    module = Regressor()
    module.trainer = type("Driver", (), {"strategy": ModelParallelStrategy()})()
    assert module.device_mesh is None


class _Environment(DefaultEnvironment):
    def __init__(self, local_rank: int) -> None:
        super().__init__()
        self._local = local_rank

    @property
    def creates_processes_externally(self) -> bool:
        return False  # claims nothing else started the processes

    def local_rank(self) -> int:
        return self._local


@pytest.mark.parametrize(("local_rank", "refused"), [(0, False), (1, True), (3, True)])
def test_only_local_rank_zero_starts_the_other_processes(monkeypatch, local_rank, refused):
    launcher = SubprocessScriptLauncher(_Environment(local_rank), num_processes=4, num_nodes=1)
    started: list[bool] = []
    monkeypatch.setattr(launcher, "_start_children", lambda: started.append(True))
    if refused:
        with pytest.raises(RuntimeError, match=f"local rank {local_rank} but was asked to start the job's other"):
            launcher.launch(lambda: "ran")
        assert started == []
    else:
        assert launcher.launch(lambda: "ran") == "ran" and started == [True]
