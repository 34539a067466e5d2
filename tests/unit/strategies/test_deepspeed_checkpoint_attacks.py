"""Hostile and damaged DeepSpeed checkpoint directories against consolidation and against resuming through the engine.

The directories are written here in DeepSpeed's layout with DeepSpeed's real record classes (no engine is started).
Resuming uses a stand-in engine that reads every file of the tag directory the way ``DeepSpeedEngine.load_checkpoint``
does: through ``engine.checkpoint_engine.load``, DeepSpeed's own ``TorchCheckpointEngine`` (``weights_only=False``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")
pytest.importorskip("deepspeed")

from checkpoint_attacks import (
    DAMAGE_KINDS,
    SENTINEL,
    CliError,
    OpenedFiles,
    consolidate_through_cli,
    damage,
    payloads,
    splice,
    torch_file,
)  # noqa: E402
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine  # noqa: E402
from deepspeed.runtime.fp16.loss_scaler import LossScaler  # noqa: E402
from deepspeed.runtime.zero.config import ZeroStageEnum  # noqa: E402
from deepspeed.utils.tensor_fragment import fragment_address  # noqa: E402
from phalanx_testing import Regressor, loaders, quiet_trainer  # noqa: E402
from test_deepspeed_checkpoint import WORLD, Model, _zero2_directory  # noqa: E402

from phalanx.plugins.io.formats import consolidate  # noqa: E402
from phalanx.plugins.io.formats.deepspeed import STATE_FILE, load_deepspeed_checkpoint_as_full  # noqa: E402
from phalanx.plugins.io.torch_io import TorchCheckpointIO  # noqa: E402
from phalanx.strategies import DeepSpeedStrategy  # noqa: E402
from phalanx.trainer.checkpoint import COMPLETE_MARKER  # noqa: E402
from phalanx.utilities.exceptions import CheckpointError, UnsafeCheckpointError  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Detected pickle protocol 4")

REAL_TYPES = SimpleNamespace(LossScaler=LossScaler, ZeroStageEnum=ZeroStageEnum, fragment_address=fragment_address)
MODEL_FILE = "checkpoint/mp_rank_00_model_states.pt"
OPTIM_FILE = "checkpoint/zero_pp_rank_1_mp_rank_00_optim_states.pt"
PAYLOADS = list(payloads(Path("marker")))


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = _zero2_directory(tmp_path_factory.mktemp("base") / "ds.ckpt", Model(), REAL_TYPES)
    (directory / COMPLETE_MARKER).write_bytes(b"")
    return directory


def _copy(source: Path, tmp_path: Path) -> Path:
    target = tmp_path / "run" / "checkpoints" / source.name
    shutil.copytree(source, target)
    return target


def _state(directory: Path) -> dict[str, Any]:
    return torch.load(directory / STATE_FILE, weights_only=True)


# ---------------------------------------------------------------------------- readers
class _Engine:
    """Reads every file of the tag directory through ``checkpoint_engine.load``, as DeepSpeed's engine does."""

    has_moe_layers = False

    def __init__(self, universal: bool = False) -> None:
        self.checkpoint_engine = TorchCheckpointEngine()
        self.universal = universal
        self.loaded: dict[str, Any] = {}

    def load_universal_checkpoint(self) -> bool:
        return self.universal

    def load_checkpoint(self, load_dir: str, tag: str, **kwargs: Any) -> tuple[str, dict]:
        folder = os.path.join(load_dir, tag)
        for name in sorted(os.listdir(folder)):
            self.loaded[name] = self.checkpoint_engine.load(
                os.path.join(folder, name), map_location=torch.device("cpu")
            )
        return folder, {}


def _resume(directory: Path, engine: _Engine | None = None, **options: Any) -> _Engine:
    strategy = DeepSpeedStrategy(**options)
    engine = engine or _Engine()
    strategy._engine, strategy._engine_trains = engine, True
    strategy.load_model_state_dict(strategy.load_checkpoint(directory))  # what the Trainer does when fit resumes
    return engine


READERS: dict[str, Callable[[Path, Path], Any]] = {
    "load_deepspeed_checkpoint_as_full": lambda path, tmp: load_deepspeed_checkpoint_as_full(path),
    "consolidate": lambda path, tmp: consolidate(path),
    "TorchCheckpointIO": lambda path, tmp: TorchCheckpointIO().load_checkpoint(path),
    "Trainer.fit(ckpt_path=path)": lambda path, tmp: quiet_trainer(max_steps=1, default_root_dir=tmp / "run").fit(
        Regressor(), loaders()[0], ckpt_path=str(path)
    ),
    "Trainer.fit(ckpt_path='auto')": lambda path, tmp: quiet_trainer(max_steps=1, default_root_dir=tmp / "run").fit(
        Regressor(), loaders()[0], ckpt_path="auto"
    ),
    "load_from_checkpoint": lambda path, tmp: Regressor.load_from_checkpoint(path),
    "cli consolidate": consolidate_through_cli,
    "resume through the engine": lambda path, tmp: _resume(path),
}


@pytest.fixture(autouse=True)
def _two_processes(monkeypatch):
    # The directories were saved by two processes; resuming compares that with the strategy's world size.
    monkeypatch.setattr(DeepSpeedStrategy, "world_size", property(lambda self: WORLD))


def _refusal(reader: str) -> type[CheckpointError]:
    return CliError if reader == "cli consolidate" else UnsafeCheckpointError


def test_the_untouched_directory_is_read_and_resumed_with_deepspeeds_own_records(base, tmp_path):
    directory = _copy(base, tmp_path)
    assert load_deepspeed_checkpoint_as_full(directory)["global_step"] == 3
    engine = _Engine()
    original = engine.checkpoint_engine
    _resume(directory, engine)
    optim = engine.loaded["zero_pp_rank_0_mp_rank_00_optim_states.pt"]["optimizer_state_dict"]
    assert type(optim["loss_scaler"]) is LossScaler and optim["zero_stage"] is ZeroStageEnum.gradients
    assert type(optim["param_slice_mappings"][0]["a.weight"]) is fragment_address
    assert engine.checkpoint_engine is original  # DeepSpeed's reader is back once the resume is done
    assert not any(
        "deepspeed" in str(entry) for entry in torch.serialization.get_safe_globals()
    )  # the allow-list was scoped


# ---------------------------------------------------------------------------- item 1: hostile pickles
def _hostile_file(directory: Path, file: str, ops: bytes) -> None:
    key = {STATE_FILE: "global_step", MODEL_FILE: "module", OPTIM_FILE: "optimizer_state_dict"}[file]
    content = {"deepspeed": {"tag": "checkpoint", "zero_stage": 2, "world_size": WORLD}} if file == STATE_FILE else {}
    (directory / file).write_bytes(torch_file(splice({**content, key: {}, "hostile": SENTINEL}, ops, legacy=True)))


@pytest.mark.parametrize("reader", list(READERS))
@pytest.mark.parametrize("file", [STATE_FILE, MODEL_FILE, OPTIM_FILE])
@pytest.mark.parametrize("payload", PAYLOADS)
def test_hostile_deepspeed_files_are_refused_by_every_reader(base, tmp_path, payload, file, reader):
    marker = tmp_path / "marker"
    ops, offending = payloads(marker, legacy=True)[payload]
    directory = _copy(base, tmp_path)
    _hostile_file(directory, file, ops)
    with pytest.raises(_refusal(reader)) as refused:
        READERS[reader](directory, tmp_path)
    message = str(refused.value)
    assert str(directory / file) in message and offending in message, message
    assert not marker.exists()


def test_the_inert_stand_ins_run_no_code(base, tmp_path):
    """Consolidation maps DeepSpeed's names to records that only keep their arguments, and enums to plain values."""
    from checkpoint_attacks import call, old_global, text

    marker = tmp_path / "marker"
    directory = _copy(base, tmp_path)
    scaler_with_arguments = call(
        old_global("deepspeed.runtime.fp16.loss_scaler", "LossScaler"), text(f"touch {marker}", legacy=True)
    )
    (directory / OPTIM_FILE).write_bytes(
        torch_file(splice({"optimizer_state_dict": {"x": SENTINEL}}, scaler_with_arguments, legacy=True))
    )
    with pytest.raises(
        CheckpointError, match="do not fit together"
    ):  # the file reads as data; it is just not a partition
        load_deepspeed_checkpoint_as_full(directory)
    enum_of_a_list = call(old_global("deepspeed.runtime.zero.config", "ZeroStageEnum"), b"]")
    (directory / OPTIM_FILE).write_bytes(
        torch_file(splice({"optimizer_state_dict": {"x": SENTINEL}}, enum_of_a_list, legacy=True))
    )
    with pytest.raises(
        CheckpointError, match=f"{OPTIM_FILE}.*TypeError: a DeepSpeed enum value is an int or a str, not a list"
    ):
        load_deepspeed_checkpoint_as_full(directory)
    assert not marker.exists()


@pytest.mark.parametrize("reason", ["universal", "moe"])
def test_resumes_deepspeed_would_read_past_its_checkpoint_engine_need_the_opt_in(base, tmp_path, reason):
    directory = _copy(base, tmp_path)
    engine = _Engine(universal=reason == "universal")
    engine.has_moe_layers = reason == "moe"
    with pytest.raises(
        UnsafeCheckpointError, match=r"weights_only=False.*DeepSpeedStrategy\(allow_unsafe_checkpoint_load=True\)"
    ):
        _resume(directory, engine)
    assert engine.loaded == {}
    opted_in = _Engine(universal=reason == "universal")
    original = opted_in.checkpoint_engine
    _resume(directory, opted_in, allow_unsafe_checkpoint_load=True)  # the user's explicit choice: DeepSpeed's own reads
    assert opted_in.checkpoint_engine is original and len(opted_in.loaded) == 1 + WORLD
    with pytest.raises(TypeError, match="allow_unsafe_checkpoint_load must be True or False"):
        DeepSpeedStrategy(allow_unsafe_checkpoint_load="yes")


# ---------------------------------------------------------------------------- item 6: names leading outside
def _fingerprint(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def _set_tag(directory: Path, tag: Any) -> None:
    state = _state(directory)
    state["deepspeed"]["tag"] = tag
    torch.save(state, directory / STATE_FILE)


def _link(path: Path, target: Path) -> None:
    path.unlink() if path.is_file() or path.is_symlink() else shutil.rmtree(path)
    path.symlink_to(target)


HOSTILE = {
    "tag with ..": lambda d, out: _set_tag(d, "../../../outside/checkpoint"),
    "absolute tag": lambda d, out: _set_tag(d, str(out / "checkpoint")),
    "tag with a separator": lambda d, out: _set_tag(d, "checkpoint/../checkpoint"),
    "tag ..": lambda d, out: _set_tag(d, ".."),
    "tag that is not a string": lambda d, out: _set_tag(d, ["checkpoint"]),
    "tag directory linked outside": lambda d, out: _link(d / "checkpoint", out / "checkpoint"),
    "latest with ..": lambda d, out: (_set_tag(d, None), (d / "latest").write_text("../../../outside/checkpoint")),
    "absolute latest": lambda d, out: (_set_tag(d, None), (d / "latest").write_text(str(out / "checkpoint"))),
    "latest linked outside": lambda d, out: (_set_tag(d, None), _link(d / "latest", out / "latest")),
    "partition linked outside": lambda d, out: _link(d / OPTIM_FILE, out / OPTIM_FILE),
    "model file linked outside": lambda d, out: _link(d / MODEL_FILE, out / MODEL_FILE),
    "state file linked outside": lambda d, out: _link(d / STATE_FILE, out / STATE_FILE),
}
NAME_READERS = [
    "load_deepspeed_checkpoint_as_full",
    "TorchCheckpointIO",
    "Trainer.fit(ckpt_path=path)",
    "cli consolidate",
    "resume through the engine",
]


@pytest.mark.parametrize("reader", NAME_READERS)
@pytest.mark.parametrize("attack", list(HOSTILE))
def test_names_leading_outside_the_directory_are_refused(base, tmp_path, attack, reader):
    outside = tmp_path / "outside"
    _zero2_directory(outside, Model(), REAL_TYPES)  # a valid checkpoint a hostile name would pick up instead
    directory = _copy(base, tmp_path)
    HOSTILE[attack](directory, outside)
    before = _fingerprint(outside)
    with (
        OpenedFiles() as opened,
        pytest.raises(
            _refusal(reader),
            match=r"Refusing to read the checkpoint .*(not a plain file name|outside the checkpoint directory)",
        ),
    ):
        READERS[reader](directory, tmp_path)
    assert not [path for path in opened if path.startswith(str(outside.resolve()))]
    assert _fingerprint(outside) == before


# ---------------------------------------------------------------------------- item 8: damaged directories
@pytest.mark.parametrize(
    "reader", ["load_deepspeed_checkpoint_as_full", "cli consolidate", "resume through the engine"]
)
@pytest.mark.parametrize("kind", DAMAGE_KINDS)
@pytest.mark.parametrize("file", [MODEL_FILE, OPTIM_FILE, STATE_FILE])
def test_a_damaged_file_gives_one_checkpoint_error_naming_it(base, tmp_path, file, kind, reader):
    directory = _copy(base, tmp_path)
    damage(directory / file, kind)
    with pytest.raises(CheckpointError) as failed:
        READERS[reader](directory, tmp_path)
    assert Path(file).name in str(failed.value) and str(directory) in str(failed.value), str(failed.value)


@pytest.mark.parametrize("reader", ["load_deepspeed_checkpoint_as_full", "cli consolidate"])
@pytest.mark.parametrize("content", [b"", b"\xff\xfe\x00garbage", b"nonexistent"])
def test_a_damaged_latest_file_names_it(base, tmp_path, content, reader):
    directory = _copy(base, tmp_path)
    _set_tag(directory, None)
    (directory / "latest").write_bytes(content)
    with pytest.raises(CheckpointError, match=r"latest"):
        READERS[reader](directory, tmp_path)


@pytest.mark.parametrize("file", [MODEL_FILE, OPTIM_FILE])
def test_files_of_another_checkpoint_are_recognised(base, tmp_path, file):
    other = tmp_path / "other"
    model = Model()
    model.a = torch.nn.Linear(3, 7)  # another model: other shapes
    _zero2_directory(other, model, REAL_TYPES)
    directory = _copy(base, tmp_path)
    shutil.copyfile(other / file, directory / file)
    with pytest.raises(
        CheckpointError,
        match=r"ds.ckpt/checkpoint: .*(lies beyond the saved partitions|hold \[10, 14\] elements).*come from different"
        r" checkpoints",
    ):
        load_deepspeed_checkpoint_as_full(directory)


def test_a_partition_missing_for_the_resume_is_named_before_deepspeed_reads(base, tmp_path):
    directory = _copy(base, tmp_path)
    (directory / OPTIM_FILE).unlink()
    engine = _Engine()
    with pytest.raises(CheckpointError, match=r"is missing zero_pp_rank_1_mp_rank_00_optim_states.pt"):
        _resume(directory, engine)
    assert engine.loaded == {}  # DeepSpeed would have resumed without the optimizer state, silently


# ---------------------------------------------------------------------------- folders nested past any walk
NESTING = 1500  # deep enough to exhaust a recursive walk (issue 33, item 17)


@pytest.mark.parametrize("reader", list(READERS))
def test_folders_nested_deep_in_the_tag_directory_are_refused_by_every_reader(base, tmp_path, reader):
    directory = _copy(base, tmp_path)
    current = directory / "checkpoint" / "nest"
    for _ in range(NESTING):
        current.mkdir()
        current = current / "d"
    try:
        with pytest.raises(CheckpointError if reader != "cli consolidate" else CliError) as refused:
            READERS[reader](directory, tmp_path)
        assert "nests folders more than" in str(refused.value), str(refused.value)
    finally:
        for _ in range(NESTING):  # pytest's own clean-up would recurse through them
            current = current.parent
            if current.exists():
                current.rmdir()


# ---------------------------------------------------------------------------- a save that did not finish
# Every entry point; not the layout's own reader (load_deepspeed_checkpoint_as_full), which they call once the marker
# is checked, nor "auto", which passes over an incomplete directory (tests/unit/trainer/test_auto_resume.py).
ENTRY_POINTS = [
    name for name in READERS if name not in ("Trainer.fit(ckpt_path='auto')", "load_deepspeed_checkpoint_as_full")
]


@pytest.mark.parametrize("reader", ENTRY_POINTS)
def test_a_directory_without_its_complete_marker_is_refused_by_every_reader(base, tmp_path, reader):
    directory = _copy(base, tmp_path)
    (directory / COMPLETE_MARKER).unlink()  # as a save killed before its last step leaves it
    with pytest.raises(CheckpointError if reader != "cli consolidate" else CliError) as refused:
        READERS[reader](directory, tmp_path)
    message = " ".join(str(refused.value).split())
    assert "is an incomplete deepspeed checkpoint: it has no .complete marker" in message, message
