"""MLFlowLogger against real MLflow stores: a ``file:`` store, an ``sqlite:`` database and an ``mlflow server`` (sqlite
backend) started on a free localhost port for this module; what each run holds is read back with ``MlflowClient`` and
compared, name by name, step by step, with what Lightning's MLFlowLogger records for the same project."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from phalanx_distributed import clean_environment, free_port
from tracker_parity import LIGHTNING_MISSING, assert_same_series, fit, lightning_available, mlflow_run

import phalanx
from phalanx.loggers import MLFlowLogger

pytest.importorskip("mlflow")


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """An ``mlflow server`` on a free localhost port with an sqlite store, killed (its whole process group) after."""
    folder = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    command = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    command += ["--backend-store-uri", f"sqlite:///{folder}/store.db", "--artifacts-destination", str(folder / "art")]
    log = open(folder / "server.log", "w")
    environment = clean_environment(MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=environment, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300  # a bound on start-up, not a speed requirement
        while not _healthy(url):
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(
                    f"mlflow server did not start (exit {server.poll()}):\n{(folder / 'server.log').read_text()}"
                )
            time.sleep(0.5)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=60)
        log.close()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def sqlite_store(tmp_path_factory):
    """One sqlite database for the module's tests (each uses runs of its own): its tables are made once."""
    return f"sqlite:///{tmp_path_factory.mktemp('sqlite') / 'store.db'}"


@pytest.fixture
def store(request, tmp_path, monkeypatch):
    """A tracking URI of the kind the test asks for (``file``, ``sqlite`` or ``http``)."""
    kind = request.param
    if kind == "file":
        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow 3 refuses file stores without it
        return f"file:{tmp_path / 'mlruns'}"
    return request.getfixturevalue("sqlite_store" if kind == "sqlite" else "mlflow_server")


# (id, store, MLFlowLogger keywords, Trainer keywords)
DEFAULTS_ON = {"enable_progress_bar": True, "enable_model_summary": True, "enable_checkpointing": True}
CASES = [
    ("file-defaults", "file", {}, DEFAULTS_ON),
    ("sqlite-prefix", "sqlite", {"prefix": "p", "tags": {"team": "a"}}, {}),
    ("server-log_model_all", "http", {"log_model": "all"}, {"enable_checkpointing": True}),
    ("server-log_model_true", "http", {"log_model": True}, {"enable_checkpointing": True}),
]


def _record(name: str, uri: str, root: Path, options: dict, trainer_options: dict, experiment: str) -> dict:
    def make(loggers: Any) -> Any:
        return loggers.MLFlowLogger(experiment_name=experiment, run_name=f"{name}-run", tracking_uri=uri, **options)

    trainer, _ = fit(name, make, root, **trainer_options)
    logger = trainer.logger
    record = mlflow_run(uri, logger.run_id)
    record["name_version"] = (logger.name, logger.version)
    dirpath = getattr(trainer.checkpoint_callback, "dirpath", None)
    record["checkpoints"] = Path(dirpath).parts[-3:] if dirpath else None
    return record


@pytest.mark.parametrize(
    ("store", "options", "trainer_options"), [c[1:] for c in CASES], ids=[c[0] for c in CASES], indirect=["store"]
)
def test_runs_match_lightnings(store, tmp_path, options, trainer_options, request):
    experiment = f"parity-{request.node.callspec.id}"
    ours = _record("phalanx", store, tmp_path / "phalanx", options, trainer_options, experiment)
    assert ours["status"] == "FINISHED" and ours["experiment"] == experiment
    assert ours["tags"]["mlflow.runName"] == "phalanx-run"
    assert ours["params"] == {"lr": "0.05", "hidden": "8", "note": "tiny"}
    prefix = f"{options['prefix']}-" if "prefix" in options else ""
    assert [step for step, _ in ours["metrics"][f"{prefix}val_loss"]] == [3, 7]
    experiment_id, run_id = ours["name_version"]
    if ours["checkpoints"] is not None:  # save_dir (or default_root_dir)/experiment id/run id/checkpoints
        assert ours["checkpoints"] == (experiment_id, run_id, "checkpoints")
    if not lightning_available():
        pytest.skip(LIGHTNING_MISSING)
    theirs = _record("lightning", store, tmp_path / "lightning", options, trainer_options, experiment)
    assert_same_series(ours["metrics"], theirs["metrics"], f"MLflow {store}")
    assert ours["params"] == theirs["params"]
    assert ours["status"] == theirs["status"]
    assert {k: v for k, v in ours["tags"].items() if k != "mlflow.runName"} == {
        k: v for k, v in theirs["tags"].items() if k != "mlflow.runName"
    }
    assert ours["artifacts"] == theirs["artifacts"]
    if options.get("log_model"):
        assert ours["artifacts"], "log_model uploads checkpoints"
    assert theirs["name_version"][0] == experiment_id  # one experiment, two runs
    if theirs["checkpoints"] is not None:
        assert theirs["checkpoints"][2:] == ours["checkpoints"][2:] and theirs["checkpoints"][0] == experiment_id


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
def test_a_second_fit_resumes_the_run_by_id(store, tmp_path):
    first, _ = fit("phalanx", lambda loggers: loggers.MLFlowLogger(tracking_uri=store), tmp_path)
    run_id = first.logger.run_id
    second, _ = fit("phalanx", lambda loggers: loggers.MLFlowLogger(tracking_uri=store, run_id=run_id), tmp_path)
    assert second.logger.run_id == run_id
    record = mlflow_run(store, run_id)
    assert [step for step, _ in record["metrics"]["val_loss"]] == [3, 7, 3, 7]  # both fits, one run
    assert record["status"] == "FINISHED"


class _Fails(phalanx.TrainingModule):
    def __init__(self, error: type[BaseException]) -> None:
        super().__init__()
        self.error = error
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == 1:
            raise self.error("stop")
        self.log("loss", self.layer(batch[0]).pow(2).mean())
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize(("error", "status"), [(ValueError, "FAILED"), (KeyboardInterrupt, "KILLED")])
@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
def test_a_failed_or_interrupted_fit_ends_the_run_so(store, tmp_path, error, status):
    logger = MLFlowLogger(tracking_uri=store)
    trainer = phalanx.Trainer(
        accelerator="cpu", logger=logger, max_epochs=1, log_every_n_steps=1, default_root_dir=tmp_path
    )
    with pytest.raises(error):
        trainer.fit(_Fails(error), torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(8, 4)), 2))
    record = mlflow_run(store, logger.run_id)
    assert record["status"] == status
    assert [step for step, _ in record["metrics"]["loss"]] == [0]


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
def test_a_cohort_logs_to_one_run(store):
    logger = MLFlowLogger(tracking_uri=store, experiment_name="cohort")
    cohort = phalanx.Cohort(accelerator="cpu", strategy="single_device", loggers=logger)

    def loop(cohort: phalanx.Cohort) -> None:
        for step in range(3):
            cohort.log_dict({"loss": torch.tensor(1.0 / (step + 1)), "step_seen": float(step)}, step=step)

    cohort.launch(loop)
    record = mlflow_run(store, logger.run_id)
    assert record["metrics"]["loss"] == [(0, 1.0), (1, 0.5), (2, pytest.approx(1 / 3))]
    assert record["status"] == "FINISHED" and record["experiment"] == "cohort"


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
def test_a_pickled_copy_writes_to_the_same_run(store):
    logger = MLFlowLogger(tracking_uri=store)
    logger.log_metrics({"a": 1.0}, step=0)
    copy = pickle.loads(pickle.dumps(logger))
    assert copy._client is None  # connections are not pickled
    copy.log_metrics({"a": 2.0}, step=1)
    assert copy.run_id == logger.run_id
    assert mlflow_run(store, logger.run_id)["metrics"]["a"] == [(0, 1.0), (1, 2.0)]


@pytest.mark.parametrize(
    ("keywords", "error", "match"),
    [
        ({"log_model": "best"}, ValueError, r"log_model='best'\): pass True, False or 'all'"),
        ({"experiment_name": ""}, TypeError, r"experiment_name=''\): pass a non-empty str"),
        ({"tags": ["a"]}, TypeError, r"tags=\['a'\]\): pass a dict"),
        ({"run_id": 5}, TypeError, r"run_id=5\): pass a non-empty str or None"),
        ({"synchronous": "yes"}, TypeError, r"synchronous='yes'\): pass True, False or None"),
        ({"prefix": None}, TypeError, r"prefix=None\): pass a str"),
        ({"tracking_uri": None, "save_dir": None}, ValueError, "needs a tracking_uri or a save_dir"),
    ],
)
def test_arguments_are_refused_at_construction(tmp_path, monkeypatch, keywords, error, match):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    keywords = {"tracking_uri": f"sqlite:///{tmp_path}/x.db", **keywords}
    with pytest.raises(error, match=match):
        MLFlowLogger(**keywords)
    assert list(tmp_path.iterdir()) == []  # nothing created


def test_a_file_store_that_mlflow_would_refuse_is_refused_at_construction(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    from mlflow import environment_variables

    if getattr(environment_variables, "MLFLOW_ALLOW_FILE_STORE", None) is None:
        pytest.skip("this mlflow takes file stores")
    with pytest.raises(ValueError, match=r"refuses file: stores.*MLFLOW_ALLOW_FILE_STORE=true.*sqlite:///"):
        MLFlowLogger(save_dir=tmp_path / "mlruns")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    assert MLFlowLogger(save_dir=tmp_path / "mlruns").save_dir == str(tmp_path / "mlruns")


def test_the_tracking_uri_defaults_to_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/env.db")
    logger = MLFlowLogger()
    assert logger._tracking_uri == f"sqlite:///{tmp_path}/env.db" and logger.save_dir is None


def test_without_mlflow_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'phalanx\[trackers\]'"):
        MLFlowLogger()


def test_importing_the_loggers_imports_no_tracker():
    code = "import sys, phalanx, phalanx.loggers; print(sorted(m for m in ('mlflow', 'wandb') if m in sys.modules))"
    job = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=os.environ)
    assert job.stdout.strip() == "[]"


def test_other_ranks_create_nothing_and_name_rank_zeros_run(tmp_path, monkeypatch):
    from phalanx.utilities.rank_zero import rank_zero_only

    monkeypatch.setattr(rank_zero_only, "rank", 1)
    logger = MLFlowLogger(tracking_uri=f"sqlite:///{tmp_path}/never.db")
    logger.log_metrics({"x": 1.0}, step=0)
    logger.log_hyperparams({"a": 1})
    logger.finalize("success")
    assert logger.version == "" and logger.experiment.create_run() is None  # a do-nothing stand-in
    logger.adopt_shared_state({"run_id": "abc", "experiment_id": "7"})
    assert (logger.version, logger.name) == ("abc", "7")
    assert list(tmp_path.iterdir()) == []
