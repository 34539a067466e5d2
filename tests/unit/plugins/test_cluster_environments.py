"""Cluster environments: detection, ranks, rendezvous address/port, validation messages, auto-detection order."""

from __future__ import annotations

import builtins
import os
import socket
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from phalanx.plugins import ClusterEnvironment as ExportedClusterEnvironment
from phalanx.plugins.environments import (
    ClusterEnvironment,
    DefaultEnvironment,
    KubeflowEnvironment,
    LSFEnvironment,
    MPIEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
    detect_cluster_environment,
    expand_hostlist,
    first_host,
)
from phalanx.plugins.environments import lsf as lsf_module
from phalanx.utilities.rank_zero import rank_zero_only

_VARIABLES = (
    # generic / torchrun
    "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "ROLE_RANK",
    "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
    # SLURM
    "SLURM_NTASKS", "SLURM_JOB_NAME", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NODELIST",
    "SLURM_JOB_NODELIST", "SLURM_JOB_ID", "SLURM_NTASKS_PER_NODE", "SLURM_NNODES",
    # LSF
    "LSB_JOBID", "LSB_DJOB_RANKFILE", "JSM_NAMESPACE_SIZE", "JSM_NAMESPACE_RANK", "JSM_NAMESPACE_LOCAL_RANK",
    # MPI
    "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
    "OMPI_COMM_WORLD_NODE_RANK", "PMI_SIZE", "PMI_RANK", "MPI_LOCALRANKID", "MPI_LOCALNRANKS",
    "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE",
    # Kubernetes
    "KUBERNETES_PORT",
)  # fmt: skip


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # The machine running the tests may itself be a SLURM job or have MASTER_PORT exported.
    for name in _VARIABLES:
        monkeypatch.delenv(name, raising=False)
    # Warnings are emitted on rank 0 only; make this process rank 0 whatever earlier tests set.
    monkeypatch.setattr(rank_zero_only, "rank", 0)


def _setenv(monkeypatch: pytest.MonkeyPatch, **variables: Any) -> None:
    for name, value in variables.items():
        monkeypatch.setenv(name, str(value))


def _torchrun(monkeypatch: pytest.MonkeyPatch, **overrides: Any) -> None:
    variables = dict(
        RANK=5, WORLD_SIZE=8, LOCAL_RANK=1, GROUP_RANK=1, LOCAL_WORLD_SIZE=4, MASTER_ADDR="10.0.0.1",
        MASTER_PORT=29500, TORCHELASTIC_RUN_ID="run-1",
    )  # fmt: skip
    variables.update(overrides)
    _setenv(monkeypatch, **{k: v for k, v in variables.items() if v is not None})


def _slurm(monkeypatch: pytest.MonkeyPatch, **overrides: Any) -> None:
    variables = dict(
        SLURM_NTASKS=8, SLURM_JOB_NAME="train", SLURM_PROCID=6, SLURM_LOCALID=2, SLURM_NODEID=1,
        SLURM_NODELIST="node[07-08]", SLURM_JOB_ID=4512345, SLURM_NTASKS_PER_NODE=4, SLURM_NNODES=2,
    )  # fmt: skip
    variables.update(overrides)
    _setenv(monkeypatch, **{k: v for k, v in variables.items() if v is not None})


def _rankfile(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "rankfile"
    path.write_text("\n".join(lines) + "\n")
    return path


def _lsf(monkeypatch: pytest.MonkeyPatch, rankfile: Path, **overrides: Any) -> None:
    variables = dict(
        LSB_JOBID=123456, LSB_DJOB_RANKFILE=rankfile, JSM_NAMESPACE_SIZE=4, JSM_NAMESPACE_RANK=3,
        JSM_NAMESPACE_LOCAL_RANK=1,
    )  # fmt: skip
    variables.update(overrides)
    _setenv(monkeypatch, **{k: v for k, v in variables.items() if v is not None})


def _openmpi(monkeypatch: pytest.MonkeyPatch, **overrides: Any) -> None:
    variables = dict(
        OMPI_COMM_WORLD_SIZE=8, OMPI_COMM_WORLD_RANK=5, OMPI_COMM_WORLD_LOCAL_RANK=1, OMPI_COMM_WORLD_LOCAL_SIZE=4,
    )  # fmt: skip
    variables.update(overrides)
    _setenv(monkeypatch, **{k: v for k, v in variables.items() if v is not None})


def _kubeflow(monkeypatch: pytest.MonkeyPatch) -> None:
    _setenv(
        monkeypatch, KUBERNETES_PORT="tcp://10.96.0.1:443", MASTER_ADDR="job-master-0", MASTER_PORT=23456,
        WORLD_SIZE=3, RANK=2,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------- exports / base


def test_all_environments_are_cluster_environments_and_exported() -> None:
    assert ExportedClusterEnvironment is ClusterEnvironment
    for cls in (DefaultEnvironment, TorchElasticEnvironment, SLURMEnvironment, LSFEnvironment, MPIEnvironment,
                KubeflowEnvironment):  # fmt: skip
        assert issubclass(cls, ClusterEnvironment)
        cls()  # every abstract method is implemented


def _forbid_mpi4py(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # makes `import mpi4py` raise ImportError
    real_import = builtins.__import__

    def no_mpi4py(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("mpi4py"):
            raise ImportError("No module named 'mpi4py'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_mpi4py)


def test_mpi_detection_and_ranks_need_no_mpi4py(monkeypatch: pytest.MonkeyPatch) -> None:
    _forbid_mpi4py(monkeypatch)
    _openmpi(monkeypatch, MASTER_ADDR="n0", MASTER_PORT=29400)
    env = detect_cluster_environment()
    assert isinstance(env, MPIEnvironment)
    assert (env.global_rank(), env.main_address, env.main_port) == (5, "n0", 29400)


# --------------------------------------------------------------------------------------------- Default


def test_default_environment_defaults() -> None:
    env = DefaultEnvironment()
    assert DefaultEnvironment.detect() is True
    assert env.creates_processes_externally is False
    assert env.main_address == "127.0.0.1"
    assert env.world_size() == 1
    assert env.global_rank() == 0
    assert env.local_rank() == 0
    assert env.node_rank() == 0


def test_default_environment_reads_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    _setenv(monkeypatch, LOCAL_RANK=3, NODE_RANK=2, MASTER_ADDR="10.1.2.3", MASTER_PORT=31337, WORLD_SIZE=8)
    env = DefaultEnvironment()
    assert env.creates_processes_externally is True
    assert env.local_rank() == 3
    assert env.node_rank() == 2
    assert env.main_address == "10.1.2.3"
    assert env.main_port == 31337
    assert env.world_size() == 8


def test_default_environment_node_rank_falls_back_to_group_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    _setenv(monkeypatch, GROUP_RANK=4)
    assert DefaultEnvironment().node_rank() == 4
    _setenv(monkeypatch, NODE_RANK=1)
    assert DefaultEnvironment().node_rank() == 1  # NODE_RANK wins


def test_default_environment_set_ranks() -> None:
    env = DefaultEnvironment()
    env.set_world_size(6)
    env.set_global_rank(4)
    assert env.world_size() == 6
    assert env.global_rank() == 4


def test_default_environment_chooses_free_port_once_and_exports_it() -> None:
    env = DefaultEnvironment()
    port = env.main_port
    assert 0 < port < 65536
    assert os.environ["MASTER_PORT"] == str(port)
    assert env.main_port == port
    assert DefaultEnvironment().main_port == port  # children / later instances inherit it
    # The port was free: we can bind it ourselves now.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))


def test_default_environment_teardown_removes_only_what_it_set(monkeypatch: pytest.MonkeyPatch) -> None:
    env = DefaultEnvironment()
    env.set_world_size(4)
    assert os.environ["WORLD_SIZE"] == "4"
    env.teardown()
    assert "WORLD_SIZE" not in os.environ

    monkeypatch.setenv("WORLD_SIZE", "2")  # provided by the user
    env = DefaultEnvironment()
    env.set_world_size(2)
    env.teardown()
    assert os.environ["WORLD_SIZE"] == "2"


def test_non_integer_variable_gives_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "zero")
    with pytest.raises(ValueError, match=r"LOCAL_RANK='zero' is not an integer"):
        DefaultEnvironment().local_rank()


# --------------------------------------------------------------------------------------------- TorchElastic


def test_torchelastic_detect(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not TorchElasticEnvironment.detect()
    _torchrun(monkeypatch)
    assert TorchElasticEnvironment.detect()


@pytest.mark.parametrize("missing", ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"])
def test_torchelastic_detect_needs_every_rendezvous_variable(monkeypatch: pytest.MonkeyPatch, missing: str) -> None:
    _torchrun(monkeypatch)
    monkeypatch.delenv(missing)
    assert not TorchElasticEnvironment.detect()


def test_torchelastic_detect_needs_an_agent_marker(monkeypatch: pytest.MonkeyPatch) -> None:
    # The plain variables are what phalanx's launcher or a hand-written script sets: not torchrun.
    _torchrun(monkeypatch, TORCHELASTIC_RUN_ID=None, GROUP_RANK=None)
    assert not TorchElasticEnvironment.detect()
    monkeypatch.setenv("GROUP_RANK", "0")
    assert TorchElasticEnvironment.detect()
    monkeypatch.delenv("GROUP_RANK")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    assert TorchElasticEnvironment.detect()


def test_torchelastic_ranks_and_rendezvous(monkeypatch: pytest.MonkeyPatch) -> None:
    _torchrun(monkeypatch)
    env = TorchElasticEnvironment()
    assert env.creates_processes_externally is True
    assert (env.world_size(), env.global_rank(), env.local_rank(), env.node_rank()) == (8, 5, 1, 1)
    assert env.main_address == "10.0.0.1"
    assert env.main_port == 29500


def test_torchelastic_setters_warn_and_ignore(monkeypatch: pytest.MonkeyPatch) -> None:
    _torchrun(monkeypatch)
    env = TorchElasticEnvironment()
    with pytest.warns(UserWarning, match="world size 4 .* environment says 8"):
        env.set_world_size(4)
    with pytest.warns(UserWarning, match="global rank 0 .* environment says 5"):
        env.set_global_rank(0)
    assert env.world_size() == 8
    assert env.global_rank() == 5


def test_torchelastic_setters_silent_when_they_agree(monkeypatch: pytest.MonkeyPatch, recwarn: Any) -> None:
    _torchrun(monkeypatch)
    env = TorchElasticEnvironment()
    env.set_world_size(8)
    env.set_global_rank(5)
    assert len(recwarn) == 0


def test_torchelastic_validate_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    _torchrun(monkeypatch)
    env = TorchElasticEnvironment()
    env.validate_settings(num_devices=4, num_nodes=2)  # matches
    with pytest.raises(ValueError, match=r"torchrun started 4 processes per node \(--nproc-per-node 4\).*devices=2"):
        env.validate_settings(num_devices=2, num_nodes=2)
    with pytest.raises(ValueError, match=r"WORLD_SIZE=8.*4 \* 3 = 12"):
        env.validate_settings(num_devices=4, num_nodes=3)


def test_torchelastic_validate_without_local_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    _torchrun(monkeypatch, LOCAL_WORLD_SIZE=None)
    env = TorchElasticEnvironment()
    env.validate_settings(num_devices=8, num_nodes=1)
    with pytest.raises(ValueError, match="WORLD_SIZE=8"):
        env.validate_settings(num_devices=2, num_nodes=1)


# --------------------------------------------------------------------------------------------- SLURM hostlists


@pytest.mark.parametrize(
    ("hostlist", "expected"),
    [
        ("node01", ["node01"]),
        ("host1,host2", ["host1", "host2"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("node[8-10]", ["node8", "node9", "node10"]),
        ("node[008-010]", ["node008", "node009", "node010"]),
        ("gpu-a[1,3]-b", ["gpu-a1-b", "gpu-a3-b"]),
        ("rack[1-2]-n[08-09]", ["rack1-n08", "rack1-n09", "rack2-n08", "rack2-n09"]),
        ("a[1-2],b,c[05,10-11]", ["a1", "a2", "b", "c05", "c10", "c11"]),
        ("cn[3]", ["cn3"]),
    ],
)
def test_expand_hostlist(hostlist: str, expected: list[str]) -> None:
    assert expand_hostlist(hostlist) == expected
    assert first_host(hostlist) == expected[0]


@pytest.mark.parametrize(
    ("hostlist", "message"),
    [
        ("node[01-04", "'\\[' without '\\]'"),
        ("node01-04]", "'\\]' without '\\['"),
        ("node[a-b]", "bad range 'a-b'"),
        ("node[5-3]", "descending range '5-3'"),
        ("node[[1]]", "nested brackets"),
    ],
)
def test_expand_hostlist_rejects_malformed(hostlist: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        expand_hostlist(hostlist)


def test_first_host_of_empty_list() -> None:
    with pytest.raises(ValueError, match="names no host; export MASTER_ADDR"):
        first_host(" , ")


# --------------------------------------------------------------------------------------------- SLURM


def test_slurm_detect(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not SLURMEnvironment.detect()
    _slurm(monkeypatch)
    assert SLURMEnvironment.detect()
    monkeypatch.delenv("SLURM_JOB_NAME")
    assert SLURMEnvironment.detect()  # no job name is still a batch job


@pytest.mark.parametrize("job_name", ["bash", "interactive"])
def test_slurm_interactive_shell_is_not_detected(monkeypatch: pytest.MonkeyPatch, job_name: str) -> None:
    _slurm(monkeypatch, SLURM_JOB_NAME=job_name)
    assert not SLURMEnvironment.detect()


def test_slurm_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    _slurm(monkeypatch)
    env = SLURMEnvironment()
    assert env.creates_processes_externally is True
    assert (env.world_size(), env.global_rank(), env.local_rank(), env.node_rank()) == (8, 6, 2, 1)
    assert SLURMEnvironment.job_id() == 4512345


def test_slurm_options_are_stored() -> None:
    import signal

    env = SLURMEnvironment(auto_requeue=False, requeue_signal=signal.SIGUSR2)
    assert env.auto_requeue is False
    assert env.requeue_signal is signal.SIGUSR2
    assert SLURMEnvironment().auto_requeue is True
    assert SLURMEnvironment.job_id() is None


def test_slurm_main_address_and_port_derived_from_job(monkeypatch: pytest.MonkeyPatch) -> None:
    _slurm(monkeypatch, SLURM_NODELIST="gpu[009-012,020]")
    env = SLURMEnvironment()
    assert env.main_address == "gpu009"
    assert env.main_port == 10000 + 2345
    monkeypatch.delenv("SLURM_NODELIST")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "cpu-[3-4]")
    assert env.main_address == "cpu-3"
    monkeypatch.setenv("SLURM_JOB_ID", "12")
    assert env.main_port == 10012


def test_slurm_master_variables_override(monkeypatch: pytest.MonkeyPatch) -> None:
    _slurm(monkeypatch, MASTER_ADDR="login7", MASTER_PORT=40001)
    env = SLURMEnvironment()
    assert env.main_address == "login7"
    assert env.main_port == 40001


def test_slurm_missing_nodelist_and_job_id(monkeypatch: pytest.MonkeyPatch) -> None:
    _slurm(monkeypatch, SLURM_NODELIST=None, SLURM_JOB_ID=None)
    env = SLURMEnvironment()
    with pytest.raises(ValueError, match="SLURM_NODELIST.*export MASTER_ADDR"):
        env.main_address  # noqa: B018 - the property raises
    with pytest.raises(ValueError, match="SLURM_JOB_ID is not set.*export MASTER_PORT"):
        env.main_port  # noqa: B018 - the property raises


def test_slurm_setters_warn_and_ignore(monkeypatch: pytest.MonkeyPatch) -> None:
    _slurm(monkeypatch)
    env = SLURMEnvironment()
    with pytest.warns(UserWarning, match="SLURMEnvironment: ignoring the world size 2"):
        env.set_world_size(2)
    assert env.world_size() == 8


@pytest.mark.parametrize("per_node", ["4", "4(x2)"])
def test_slurm_validate_settings_accepts_matching(monkeypatch: pytest.MonkeyPatch, per_node: str) -> None:
    _slurm(monkeypatch, SLURM_NTASKS_PER_NODE=per_node)
    assert SLURMEnvironment().validate_settings(num_devices=4, num_nodes=2) is None


def test_slurm_validate_settings_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    _slurm(monkeypatch, SLURM_NTASKS_PER_NODE="4(x2)")
    env = SLURMEnvironment()
    with pytest.raises(ValueError, match=r"#SBATCH --ntasks-per-node=4\(x2\).*devices=2") as info:
        env.validate_settings(num_devices=2, num_nodes=2)
    assert "set #SBATCH --ntasks-per-node=2" in str(info.value)
    with pytest.raises(ValueError, match=r"#SBATCH --nodes=2.*num_nodes=3"):
        env.validate_settings(num_devices=4, num_nodes=3)


def test_slurm_validate_settings_with_ntasks_only(monkeypatch: pytest.MonkeyPatch) -> None:
    _slurm(monkeypatch, SLURM_NTASKS_PER_NODE=None, SLURM_NNODES=1, SLURM_NTASKS=3)
    with pytest.raises(ValueError, match=r"#SBATCH --ntasks=3.*2 \* 1 = 2"):
        SLURMEnvironment().validate_settings(num_devices=2, num_nodes=1)


# --------------------------------------------------------------------------------------------- LSF


def test_lsf_detect(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert not LSFEnvironment.detect()
    _lsf(monkeypatch, _rankfile(tmp_path, ["launch", "h1", "h2"]))
    assert LSFEnvironment.detect()
    monkeypatch.delenv("JSM_NAMESPACE_LOCAL_RANK")
    assert not LSFEnvironment.detect()


def test_lsf_rankfile_parsing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # One line per slot: the launch node, then each compute host once per process on it.
    rankfile = _rankfile(tmp_path, ["batch1", "c01", "c01", "", "c02", "c02", "c01"])
    _lsf(monkeypatch, rankfile)
    monkeypatch.setattr(lsf_module, "_hostname", lambda: "c02")
    env = LSFEnvironment()
    assert env.compute_hosts() == ["c01", "c02"]
    assert env.creates_processes_externally is True
    assert (env.world_size(), env.global_rank(), env.local_rank(), env.node_rank()) == (4, 3, 1, 1)
    assert env.main_address == "c01"
    assert env.main_port == 10000 + 3456
    monkeypatch.setattr(lsf_module, "_hostname", lambda: "c01.cluster.example.org")
    assert env.node_rank() == 0  # short name in the rank file, FQDN from gethostname()


def test_lsf_overrides_and_unknown_host(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _lsf(monkeypatch, _rankfile(tmp_path, ["batch1", "c01", "c02"]), MASTER_PORT=41000, MASTER_ADDR="c02")
    monkeypatch.setattr(lsf_module, "_hostname", lambda: "elsewhere")
    env = LSFEnvironment()
    assert env.main_port == 41000
    assert env.main_address == "c02"
    with pytest.raises(ValueError, match="'elsewhere' is not among the compute hosts"):
        env.node_rank()


def test_lsf_missing_or_empty_rankfile(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _lsf(monkeypatch, tmp_path / "does-not-exist")
    with pytest.raises(ValueError, match="Cannot read the LSF rank file"):
        LSFEnvironment().main_address  # noqa: B018 - the property raises
    _lsf(monkeypatch, _rankfile(tmp_path, ["batch1"]))
    with pytest.raises(ValueError, match="lists no compute host"):
        LSFEnvironment().node_rank()


def test_lsf_validate_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _lsf(monkeypatch, _rankfile(tmp_path, ["batch1", "c01", "c01", "c02", "c02"]))
    env = LSFEnvironment()
    env.validate_settings(num_devices=2, num_nodes=2)
    with pytest.raises(ValueError, match="2 compute hosts but the Trainer has num_nodes=1"):
        env.validate_settings(num_devices=4, num_nodes=1)
    with pytest.raises(ValueError, match=r"JSM_NAMESPACE_SIZE=4.*3 \* 2 = 6"):
        env.validate_settings(num_devices=3, num_nodes=2)


# --------------------------------------------------------------------------------------------- MPI


def test_mpi_detect_open_mpi(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not MPIEnvironment.detect()
    _openmpi(monkeypatch)
    assert MPIEnvironment.detect()
    env = MPIEnvironment()
    assert env.creates_processes_externally is True
    # Node rank = global rank // processes per node, not OMPI_COMM_WORLD_NODE_RANK.
    monkeypatch.setenv("OMPI_COMM_WORLD_NODE_RANK", "1")
    assert (env.world_size(), env.global_rank(), env.local_rank(), env.node_rank()) == (8, 5, 1, 1)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "2")
    assert env.node_rank() == 0


def test_mpi_detect_needs_local_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    _openmpi(monkeypatch, OMPI_COMM_WORLD_LOCAL_SIZE=None)
    assert not MPIEnvironment.detect()
    with pytest.raises(ValueError, match="No MPI launcher variables"):
        MPIEnvironment().world_size()


def test_mpi_detect_hydra(monkeypatch: pytest.MonkeyPatch) -> None:
    _setenv(monkeypatch, PMI_SIZE=6, PMI_RANK=4, MPI_LOCALRANKID=1, MPI_LOCALNRANKS=3)
    assert MPIEnvironment.detect()
    env = MPIEnvironment()
    assert (env.world_size(), env.global_rank(), env.local_rank(), env.node_rank()) == (6, 4, 1, 1)


def test_mpi_master_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    _openmpi(monkeypatch, MASTER_ADDR="n0", MASTER_PORT=29400)
    env = MPIEnvironment()
    assert env.main_address == "n0"
    assert env.main_port == 29400


def test_mpi_without_mpi4py_and_master_variables_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    _openmpi(monkeypatch)
    _forbid_mpi4py(monkeypatch)
    env = MPIEnvironment()
    with pytest.raises(ValueError, match="export MASTER_ADDR.*MASTER_PORT.*install mpi4py"):
        env.main_address  # noqa: B018 - the property raises
    with pytest.raises(ValueError, match="install mpi4py"):
        env.main_port  # noqa: B018 - the property raises


class _FakeComm:
    def __init__(self, rank: int, root_payload: tuple[str, int]) -> None:
        self.rank = rank
        self.root_payload = root_payload
        self.sent: list[Any] = []

    def Get_rank(self) -> int:  # noqa: N802 (mpi4py's name)
        return self.rank

    def bcast(self, payload: Any, root: int = 0) -> Any:
        assert root == 0
        self.sent.append(payload)
        return payload if self.rank == 0 else self.root_payload


def _fake_mpi4py(monkeypatch: pytest.MonkeyPatch, comm: _FakeComm) -> None:
    package = types.ModuleType("mpi4py")
    mpi = types.ModuleType("mpi4py.MPI")
    mpi.COMM_WORLD = comm  # type: ignore[attr-defined]
    package.MPI = mpi  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mpi4py", package)
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", mpi)


def test_mpi_rank0_broadcasts_hostname_and_free_port_once(monkeypatch: pytest.MonkeyPatch) -> None:
    _openmpi(monkeypatch, OMPI_COMM_WORLD_RANK=0, OMPI_COMM_WORLD_LOCAL_RANK=0)
    comm = _FakeComm(rank=0, root_payload=("unused", 0))
    _fake_mpi4py(monkeypatch, comm)
    env = MPIEnvironment()
    address, port = env.main_address, env.main_port
    assert address == socket.gethostname()
    assert 0 < port < 65536
    assert comm.sent == [(address, port)]  # one broadcast serves both properties


def test_mpi_other_ranks_receive_rank0_rendezvous(monkeypatch: pytest.MonkeyPatch) -> None:
    _openmpi(monkeypatch)
    comm = _FakeComm(rank=5, root_payload=("node-of-rank-0", 23456))
    _fake_mpi4py(monkeypatch, comm)
    env = MPIEnvironment()
    assert env.main_port == 23456
    assert env.main_address == "node-of-rank-0"
    assert comm.sent == [None]


def test_mpi_validate_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    _openmpi(monkeypatch)
    env = MPIEnvironment()
    env.validate_settings(num_devices=4, num_nodes=2)
    with pytest.raises(ValueError, match="4 processes on this node but the Trainer has devices=2"):
        env.validate_settings(num_devices=2, num_nodes=4)
    with pytest.raises(ValueError, match=r"started 8 processes.*4 \* 1 = 4"):
        env.validate_settings(num_devices=4, num_nodes=1)


def test_mpi_setters_warn_and_ignore(monkeypatch: pytest.MonkeyPatch) -> None:
    _openmpi(monkeypatch)
    env = MPIEnvironment()
    with pytest.warns(UserWarning, match="global rank 1 .* environment says 5"):
        env.set_global_rank(1)
    assert env.global_rank() == 5


# --------------------------------------------------------------------------------------------- Kubeflow


def test_kubeflow_detect_and_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not KubeflowEnvironment.detect()
    _kubeflow(monkeypatch)
    assert KubeflowEnvironment.detect()
    env = KubeflowEnvironment()
    assert env.creates_processes_externally is True
    assert (env.world_size(), env.global_rank(), env.local_rank(), env.node_rank()) == (3, 2, 0, 2)
    assert env.main_address == "job-master-0"
    assert env.main_port == 23456
    monkeypatch.delenv("KUBERNETES_PORT")
    assert not KubeflowEnvironment.detect()


def test_kubeflow_validate_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    _kubeflow(monkeypatch)
    env = KubeflowEnvironment()
    env.validate_settings(num_devices=1, num_nodes=3)
    with pytest.raises(ValueError, match="one process per pod.*devices=2.*devices=1"):
        env.validate_settings(num_devices=2, num_nodes=3)
    with pytest.raises(ValueError, match="WORLD_SIZE=3 pods.*num_nodes=2"):
        env.validate_settings(num_devices=1, num_nodes=2)


# --------------------------------------------------------------------------------------------- auto-detection


def test_detect_nothing_gives_default() -> None:
    assert type(detect_cluster_environment()) is DefaultEnvironment


def test_detect_torchrun_inside_slurm_gives_torchelastic(monkeypatch: pytest.MonkeyPatch) -> None:
    _slurm(monkeypatch)
    _torchrun(monkeypatch)
    assert type(detect_cluster_environment()) is TorchElasticEnvironment


def test_detect_slurm_only(monkeypatch: pytest.MonkeyPatch) -> None:
    _slurm(monkeypatch)
    assert type(detect_cluster_environment()) is SLURMEnvironment


def test_detect_slurm_before_lsf_and_mpi(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _lsf(monkeypatch, _rankfile(tmp_path, ["batch", "c01"]))
    _openmpi(monkeypatch)
    assert type(detect_cluster_environment()) is LSFEnvironment
    _slurm(monkeypatch)
    assert type(detect_cluster_environment()) is SLURMEnvironment


def test_detect_mpi_only(monkeypatch: pytest.MonkeyPatch) -> None:
    _openmpi(monkeypatch)
    assert type(detect_cluster_environment()) is MPIEnvironment


def test_detect_interactive_slurm_gives_default(monkeypatch: pytest.MonkeyPatch) -> None:
    _slurm(monkeypatch, SLURM_JOB_NAME="bash")
    assert type(detect_cluster_environment()) is DefaultEnvironment


def test_detect_never_picks_kubeflow(monkeypatch: pytest.MonkeyPatch) -> None:
    _kubeflow(monkeypatch)
    assert KubeflowEnvironment.detect()
    assert type(detect_cluster_environment()) is DefaultEnvironment
