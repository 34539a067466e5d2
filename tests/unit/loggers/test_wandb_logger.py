"""WandbLogger against real W&B offline runs (WANDB_MODE=offline, every wandb folder under tmp: nothing contacts the
network), read back with wandb's own reader (``wandb leet inspect --json``) and compared, name by name and step by step,
with what Lightning's WandbLogger records for the same project. wandb's service process is shut down after the module.
"""

from __future__ import annotations

import os
import pickle
import re
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from phalanx_distributed import processes_with_marker
from tracker_parity import (
    LIGHTNING_MISSING,
    assert_same_series,
    fit,
    framework,
    lightning_available,
    project_class,
    wandb_config,
    wandb_history,
    wandb_records,
)

from phalanx.loggers import WandbLogger
from phalanx.utilities.rank_zero import rank_zero_only

wandb = pytest.importorskip("wandb")


@pytest.fixture(scope="module", autouse=True)
def offline_wandb(tmp_path_factory):
    """Every wandb folder under tmp, offline, quiet; after the module no wandb service of this process is left."""
    home = tmp_path_factory.mktemp("wandb-home")
    with pytest.MonkeyPatch.context() as patch:
        for name in ("WANDB_API_KEY", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_RUN_ID"):
            patch.delenv(name, raising=False)
        for name, value in {
            "WANDB_MODE": "offline",
            "WANDB_SILENT": "true",
            "WANDB_CONSOLE": "off",
            "WANDB_DIR": str(home / "dir"),
            "WANDB_DATA_DIR": str(home / "data"),
            "WANDB_CACHE_DIR": str(home / "cache"),
            "WANDB_CONFIG_DIR": str(home / "config"),
            "WANDB_ARTIFACT_DIR": str(home / "artifacts"),
        }.items():
            patch.setenv(name, value)
        try:
            yield home
        finally:
            if wandb.run is not None:
                wandb.finish()
            wandb.teardown()
    assert not [c for c in processes_with_marker("wandb-core") if f"--pid {os.getpid()} " in f"{c} "]


@pytest.fixture(autouse=True)
def _rank_zero(monkeypatch):
    monkeypatch.setattr(rank_zero_only, "rank", 0)


def _finish(logger: Any) -> str:
    """End the run the logger left open (as Lightning's does) and return its id."""
    run_id = logger.version
    logger.experiment.finish()
    return run_id


def _artifacts(records: list[dict]) -> list[tuple]:
    """(artifact type, name without the run id, aliases, file names) of each artifact record, in order."""
    found = []
    for record in records:
        if record.get("type") == "artifact":
            artifact = record["artifact"]
            files = sorted(entry["path"] for entry in artifact["manifest"]["contents"])
            found.append((artifact["type"], artifact["name"].split("-")[0], tuple(artifact["aliases"]), tuple(files)))
    return found


def _record(name: str, root: Path, options: dict, trainer_options: dict) -> dict:
    trainer, _ = fit(
        name,
        lambda loggers: loggers.WandbLogger(project="parity", name=f"{name}-run", save_dir=root, **options),
        root,
        **trainer_options,
    )
    logger = trainer.logger
    dirpath = getattr(trainer.checkpoint_callback, "dirpath", None)
    run_id = _finish(logger)
    records = wandb_records(root, run_id)
    (run,) = [record["run"] for record in records if record.get("type") == "run"]
    return {
        "history": wandb_history(records),
        "config": wandb_config(records),
        "run": (run["project"], run.get("display_name"), run.get("tags", []), run.get("run_group")),
        "artifacts": _artifacts(records),
        "checkpoints": Path(dirpath).parts[-3:] if dirpath else None,
        "name_version": (logger.name, run_id),
    }


DEFAULTS_ON = {"enable_progress_bar": True, "enable_model_summary": True, "enable_checkpointing": True}
# (id, WandbLogger keywords, Trainer keywords); WANDB_MODE=offline keeps the log_model runs offline too
CASES = [
    ("offline-defaults", {"offline": True}, DEFAULTS_ON),
    (
        "prefix-config-tags-group",
        {"offline": True, "prefix": "p", "config": {"batch": 8}, "tags": ["a"], "group": "g"},
        {},
    ),
    ("log_model_all", {"log_model": "all"}, {"enable_checkpointing": True}),
    ("log_model_true", {"log_model": True}, {"enable_checkpointing": True}),
]


@pytest.mark.parametrize(("options", "trainer_options"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_runs_match_lightnings(tmp_path, monkeypatch, options, trainer_options):
    monkeypatch.setenv("WANDB_MODE", "offline")  # Lightning's offline=True sets it to "dryrun" for the process
    ours = _record("phalanx", tmp_path / "phalanx", options, trainer_options)
    prefix = f"{options['prefix']}-" if "prefix" in options else ""
    assert [step for step, _ in ours["history"][f"{prefix}val_loss"]] == [3, 7]
    assert ours["config"] == {"lr": 0.05, "hidden": 8, "note": "tiny", **options.get("config", {})}
    assert ours["run"][:2] == ("parity", "phalanx-run")
    assert bool(ours["artifacts"]) == bool(options.get("log_model"))
    if ours["checkpoints"] is not None:  # save_dir/project/run id/checkpoints, as Lightning names it
        assert ours["checkpoints"] == ("parity", ours["name_version"][1], "checkpoints")
    if not lightning_available():
        pytest.skip(LIGHTNING_MISSING)
    theirs = _record("lightning", tmp_path / "lightning", options, trainer_options)
    assert_same_series(ours["history"], theirs["history"], "W&B history")
    assert ours["config"] == theirs["config"]
    assert ours["run"][2:] == theirs["run"][2:]
    assert ours["artifacts"] == theirs["artifacts"]
    assert (ours["checkpoints"] is None) == (theirs["checkpoints"] is None)


def _watched_keys(records: list[dict]) -> tuple[set[str], int]:
    """The histogram names ``watch`` logged (wandb numbers the models a process watches: ``graph_N`` after the first)
    and how many history entries hold some."""
    keys, entries = set(), 0
    for record in records:
        if record.get("type") == "history":
            found = {
                re.sub(r"^(gradients|parameters)/graph_[0-9]+", r"\1/", key.rsplit(".", 1)[0])
                for key in record["history"]["item"]
                if key.startswith(("gradients/", "parameters/"))
            }
            keys |= found
            entries += bool(found)
    return keys, entries


def test_watch_logs_gradients_and_parameters_as_lightnings_does(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    seen = {}
    for name in ("phalanx", "lightning"):
        if name == "lightning" and not lightning_available():
            pytest.skip(LIGHTNING_MISSING)
        root = tmp_path / name
        logger = framework(name)[2].WandbLogger(project="watch", save_dir=root)
        torch.manual_seed(0)
        module = project_class(framework(name)[1])()
        logger.watch(module, log="all", log_freq=2)
        trainer, _ = fit(name, lambda loggers, logger=logger: logger, root, module=module)
        seen[name] = _watched_keys(wandb_records(root, _finish(trainer.logger)))
        keys, entries = seen[name]
        assert {"gradients/net.0.weight", "parameters/net.2.bias"} <= keys and entries > 0
    assert seen["phalanx"] == seen["lightning"]


def test_a_second_fit_resumes_the_run_by_id(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    for attempt in range(2):
        if attempt:
            # wandb names an offline run's folder by the second it started: a second fit within the same second would
            # write into the first one's folder and replace its records (seen in CI on a fast machine).
            time.sleep(1.01 - time.time() % 1)
        trainer, _ = fit(
            "phalanx", lambda loggers: loggers.WandbLogger(id="resumed1", offline=True, save_dir=tmp_path), tmp_path
        )
        assert _finish(trainer.logger) == "resumed1"
    records = wandb_records(tmp_path, "resumed1")
    assert [step for step, _ in wandb_history(records)["val_loss"]] == [3, 7, 3, 7]
    assert [record["run"].get("resume", False) for record in records if record.get("type") == "run"] == [True, True]


def test_tables_text_and_images_are_logged(tmp_path):
    logger = WandbLogger(project="media", save_dir=tmp_path, offline=True)
    logger.log_text("samples", columns=["input", "label"], data=[["a", "b"]], step=1)
    logger.log_image("pictures", images=[torch.rand(3, 8, 8), torch.rand(3, 8, 8)], step=2, caption=["x", "y"])
    with pytest.raises(ValueError, match=r"log_image\('pictures', caption=\.\.\.\): give one entry per item \(1\)"):
        logger.log_image("pictures", images=[torch.rand(3, 8, 8)], caption=["x", "y"])
    with pytest.raises(TypeError, match=r"log_image\('pictures', \.\.\.\) takes a list, got Tensor"):
        logger.log_image("pictures", images=torch.rand(3, 8, 8))
    records = wandb_records(tmp_path, _finish(logger))
    items = [record["history"]["item"] for record in records if record.get("type") == "history"]
    assert [(item["trainer/global_step"], item.get("samples._type"), item.get("pictures._type")) for item in items] == [
        (1, "table-file", None),
        (2, None, "images/separated"),
    ]


def test_a_pickled_copy_names_the_same_run(tmp_path):
    logger = WandbLogger(project="pickled", save_dir=tmp_path, offline=True)
    run_id = logger.experiment.id
    copy = pickle.loads(pickle.dumps(logger))
    assert copy._experiment is None and copy.version == run_id  # the copy resumes this run by id when it writes
    _finish(logger)


@pytest.mark.parametrize(
    ("keywords", "error", "match"),
    [
        ({"offline": True, "log_model": True}, ValueError, r"offline=True, log_model=True\): checkpoints are uploaded"),
        ({"log_model": "best"}, ValueError, r"log_model='best'\): pass True, False or 'all'"),
        ({"projekt": "x"}, TypeError, r"unexpected keyword arguments \['projekt'\].*'entity'"),
        ({"version": "a", "id": "b"}, ValueError, r"version='a', id='b'\): they are one option"),
        ({"save_dir": "a", "dir": "b"}, ValueError, r"save_dir='a', dir='b'\): they are one option"),
        ({"add_file_policy": "copy"}, ValueError, r"add_file_policy='copy'\): pass 'mutable' or 'immutable'"),
        ({"offline": "yes"}, TypeError, r"offline='yes'\): pass True or False"),
        ({"prefix": 3}, TypeError, r"prefix=3\): pass a str"),
    ],
)
def test_arguments_are_refused_at_construction(tmp_path, keywords, error, match):
    with pytest.raises(error, match=match):
        WandbLogger(**{"save_dir": tmp_path, **keywords})
    assert wandb.run is None


def test_watch_refuses_what_wandb_would_refuse_later(tmp_path):
    with pytest.raises(ValueError, match=r"watch\(log='weights'\): pass 'gradients', 'parameters', 'all' or None"):
        WandbLogger(save_dir=tmp_path, offline=True).watch(torch.nn.Linear(1, 1), log="weights")
    assert wandb.run is None


def test_other_ranks_create_no_run(tmp_path, monkeypatch):
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    logger = WandbLogger(save_dir=tmp_path / "w", offline=True)
    logger.log_metrics({"x": 1.0}, step=0)
    logger.log_hyperparams({"a": 1})
    logger.watch(torch.nn.Linear(1, 1))
    logger.adopt_shared_state({"id": "rank0run"})
    assert wandb.run is None and logger.version == "rank0run" and not (tmp_path / "w").exists()


def test_without_wandb_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'phalanx\[trackers\]'"):
        WandbLogger()
