"""``SLURMEnvironment.main_address`` against Lightning 2.6's (lightning_fabric's) on the node-list forms both read:
space-separated, comma-separated, bracket ranges and their mixtures; the first host is where rank 0 runs."""

from __future__ import annotations

import pytest

from phalanx.plugins.environments import SLURMEnvironment

# (SLURM_NODELIST, its first host). Lightning reads all of these; forms with several brackets in one host name
# ("rack[1-2]-n[08-09]") only phalanx reads, and test_cluster_environments.py covers them.
NODE_LISTS = [
    ("alpha", "alpha"),
    ("alpha beta gamma", "alpha"),
    ("alpha  beta", "alpha"),
    ("alpha,beta,gamma", "alpha"),
    ("node[5-9]", "node5"),
    ("node[05-09]", "node05"),
    ("node[3]", "node3"),
    ("node[1,4-6]", "node1"),
    ("gpu[009-012,020]", "gpu009"),
    ("node[2-3],login", "node2"),
    ("node[2-3] login", "node2"),
    ("login node[2-3]", "login"),
    ("10.0.0.7 10.0.0.8", "10.0.0.7"),
]


@pytest.fixture
def slurm(monkeypatch: pytest.MonkeyPatch):
    for name in ("MASTER_ADDR", "SLURM_JOB_NODELIST"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_JOB_ID", "1234")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "2")

    def main_address(environment_class: type, nodes: str) -> str:
        monkeypatch.setenv("SLURM_NODELIST", nodes)
        monkeypatch.delenv("MASTER_ADDR", raising=False)  # Lightning's main_address exports what it found
        return environment_class().main_address

    return main_address


@pytest.mark.parametrize(("nodes", "first"), NODE_LISTS)
def test_main_address_is_the_first_host_of_the_node_list(slurm, nodes, first):
    assert slurm(SLURMEnvironment, nodes) == first


@pytest.mark.parametrize(("nodes", "first"), NODE_LISTS)
def test_main_address_equals_lightnings(slurm, nodes, first):
    lightning = pytest.importorskip(
        "lightning_fabric.plugins.environments.slurm", reason="Lightning (the oracle) is not installed"
    )
    assert slurm(SLURMEnvironment, nodes) == slurm(lightning.SLURMEnvironment, nodes) == first
