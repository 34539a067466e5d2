"""The evaluation and prediction batch hooks receive ``dataloader_idx`` only with several dataloaders (as in
Lightning), and a stage with no batch to run (``limit_*_batches=0``) is skipped, its hooks included."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from phalanx_testing import Regressor, quiet_trainer, regression_data
from torch.utils.data import DataLoader

import phalanx


class MultiLoaderRegressor(Regressor):
    """Steps that accept dataloader_idx, so that two dataloaders are valid."""

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.log("val_loss", torch.nn.functional.mse_loss(self(batch[0]), batch[1]))

    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.log("test_loss", torch.nn.functional.mse_loss(self(batch[0]), batch[1]))


_TAILS = {"without": [], "default": ["dataloader_idx=0"], "required": ["dataloader_idx"]}


def _hook(owner: str, end: bool, signature: str) -> Any:
    """A hook override with exactly the parameters Lightning users write (no *args, which would accept anything)."""
    head = ["self", *(["trainer", "pl_module"] if owner == "callback" else []), *(["outputs"] if end else [])]
    tail = _TAILS[signature]
    index = "dataloader_idx" if tail else "None"
    source = (
        f"def hook({', '.join([*head, 'batch', 'batch_idx', *tail])}):\n    self.calls.append((batch_idx, {index}))\n"
    )
    namespace: dict[str, Any] = {}
    exec(source, namespace)  # noqa: S102 - builds the signature under test
    return namespace["hook"]


def _run(stage: str, hook: str, owner: str, signature: str, loaders: int, tmp_path) -> list[tuple[int, Any]]:
    method = _hook(owner, hook.endswith("_end"), signature)
    module_class = type("Module", (MultiLoaderRegressor,), {hook: method} if owner == "module" else {})
    callback_class = type("Recorder", (phalanx.Callback,), {hook: method} if owner == "callback" else {})
    module, callback = module_class(), callback_class()
    target = module if owner == "module" else callback
    target.calls = []
    data = [DataLoader(regression_data(8), batch_size=4) for _ in range(loaders)]
    trainer = quiet_trainer(default_root_dir=tmp_path, callbacks=[callback])
    run = {"validation": trainer.validate, "test": trainer.test, "predict": trainer.predict}[stage]
    run(module, dataloaders=data if loaders > 1 else data[0])
    return target.calls


HOOKS = [
    (stage, f"on_{stage}_batch_{when}") for stage in ("validation", "test", "predict") for when in ("start", "end")
]
# (signature, number of dataloaders, the (batch_idx, dataloader_idx) seen, or the error raised)
CASES = [
    ("without", 1, [(0, None), (1, None)]),
    ("default", 1, [(0, 0), (1, 0)]),
    ("default", 2, [(0, 0), (1, 0), (0, 1), (1, 1)]),
    ("without", 2, "several .* dataloaders, so .* is called with dataloader_idx, which it does not take"),
    ("required", 1, "one .* dataloader, so .* is called without dataloader_idx, which it requires"),
    ("required", 2, [(0, 0), (1, 0), (0, 1), (1, 1)]),
]


@pytest.mark.parametrize(("stage", "hook"), HOOKS)
@pytest.mark.parametrize("owner", ["module", "callback"])
@pytest.mark.parametrize(("signature", "loaders", "expected"), CASES)
def test_batch_hooks_get_dataloader_idx_only_with_several_dataloaders(
    tmp_path, stage, hook, owner, signature, loaders, expected
):
    if isinstance(expected, str):
        with pytest.raises(RuntimeError, match=expected):
            _run(stage, hook, owner, signature, loaders, tmp_path)
    else:
        assert _run(stage, hook, owner, signature, loaders, tmp_path) == expected


def test_a_step_without_dataloader_idx_is_refused_with_several_dataloaders(tmp_path):
    data = [DataLoader(regression_data(8), batch_size=4) for _ in range(2)]
    with pytest.raises(RuntimeError, match=r"Regressor.validation_step\(\) is called with dataloader_idx"):
        quiet_trainer(default_root_dir=tmp_path).validate(Regressor(), dataloaders=data)


# ---------------------------------------------------------------------------- limit_*_batches=0
def _recording(name: str) -> Any:
    def hook(self: Any, *args: Any, **kwargs: Any) -> None:
        self.called.append(name)

    return hook


# A callback overriding every Callback hook (and setup/teardown), recording the order they are called in.
_HOOK_NAMES = [name for name in vars(phalanx.Callback) if name.startswith("on_") or name in ("setup", "teardown")]
HookRecorder = type("HookRecorder", (phalanx.Callback,), {name: _recording(name) for name in _HOOK_NAMES})


@pytest.mark.parametrize(
    ("stage", "limit", "expected"),
    [
        ("validate", "limit_val_batches", []),
        ("test", "limit_test_batches", []),
        ("predict", "limit_predict_batches", None),
    ],
)
@pytest.mark.parametrize("value", [0, 0.0])
def test_a_stage_with_no_batch_to_run_is_skipped(tmp_path, stage, limit, expected, value):
    recorder = HookRecorder()
    recorder.called = []
    trainer = quiet_trainer(default_root_dir=tmp_path, callbacks=[recorder], **{limit: value})
    data = [DataLoader(regression_data(8), batch_size=4) for _ in range(2)]
    result = getattr(trainer, stage)(MultiLoaderRegressor(), dataloaders=data)
    assert result == expected
    step_name = {"validate": "validation", "test": "test", "predict": "predict"}[stage]
    assert [name for name in recorder.called if step_name in name] == []
    assert recorder.called == ["setup", "teardown"]


@pytest.mark.parametrize("stage", ["validate", "test", "predict"])
def test_a_stage_limited_to_no_batch_needs_no_data(tmp_path, stage):
    limit = {"validate": "limit_val_batches", "test": "limit_test_batches", "predict": "limit_predict_batches"}[stage]
    trainer = quiet_trainer(default_root_dir=tmp_path, **{limit: 0})
    assert getattr(trainer, stage)(MultiLoaderRegressor()) == ([] if stage != "predict" else None)
    with pytest.raises(ValueError, match=rf"Trainer.{stage}\(\) needs data"):
        getattr(quiet_trainer(default_root_dir=tmp_path), stage)(MultiLoaderRegressor())
