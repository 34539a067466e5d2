"""Runs started together in one ``save_dir`` get distinct ``version_N`` folders: the folder's creation is the claim."""

import os
import time
import uuid

import fsspec
import pytest
from phalanx_concurrency import in_processes, in_threads

from phalanx.loggers import CSVLogger
from phalanx.loggers.logger import _claim_version, _next_version
from phalanx.utilities.rank_zero import rank_zero_only


@pytest.fixture(autouse=True)
def _rank_zero(monkeypatch):
    monkeypatch.setattr(rank_zero_only, "rank", 0)


def start_run(save_dir, run, barrier):
    """One run: pick the version at the same moment as the others, then write its own hyperparameters and metrics."""
    logger = CSVLogger(save_dir)
    barrier.wait(timeout=10)
    version = logger.version
    time.sleep(0.05)  # a run sets up (model, data) between choosing its folder and first writing to it
    logger.log_hyperparams({"run": run})
    logger.log_metrics({"run": float(run)}, step=0)
    logger.finalize("success")
    return version


def assert_each_run_has_its_own_folder(save_dir, versions):
    runs = len(versions)
    assert sorted(versions.values()) == list(range(runs))
    for run, version in versions.items():
        folder = os.path.join(save_dir, "logs", f"version_{version}")
        with open(os.path.join(folder, "hparams.yaml")) as handle:
            assert handle.read() == f"run: {run}\n"
        with open(os.path.join(folder, "metrics.csv")) as handle:
            assert handle.read().splitlines() == ["step,run", f"0,{float(run)}"]


def test_threads_started_together_get_distinct_versions(tmp_path):
    versions = in_threads(lambda run, barrier: start_run(str(tmp_path), run, barrier), runs=8)
    assert_each_run_has_its_own_folder(str(tmp_path), versions)


def test_processes_started_together_get_distinct_versions(tmp_path):
    versions = in_processes(lambda run, barrier: start_run(str(tmp_path), run, barrier), runs=3)
    assert all(isinstance(version, int) for version in versions.values()), versions
    assert_each_run_has_its_own_folder(str(tmp_path), versions)


def test_claim_skips_taken_names(tmp_path):
    (tmp_path / "version_0").mkdir()
    (tmp_path / "version_2").write_text("a file holds the name too")
    assert _claim_version(str(tmp_path)) == 1
    assert _claim_version(str(tmp_path)) == 3  # version_2 is taken by the file
    assert os.path.isdir(tmp_path / "version_1") and os.path.isdir(tmp_path / "version_3")


def test_explicit_version_and_other_ranks_claim_nothing(tmp_path, monkeypatch):
    assert CSVLogger(tmp_path, version=5).version == 5
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    assert CSVLogger(tmp_path).version == 0
    assert list(tmp_path.iterdir()) == []


def test_fsspec_versions_are_claimed():
    root = f"memory://versions-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    try:
        assert [_claim_version(root) for _ in range(3)] == [0, 1, 2]
        assert _next_version(root) == 3
        assert fs.isdir(f"{root.split('://')[1]}/version_2")
    finally:
        fs.rm(root.split("://")[1], recursive=True)
