"""ModelCheckpoint file names: templates and arguments are checked at construction, and new names are claimed
exclusively, so runs sharing a folder never write (or keep) each other's checkpoints."""

import os
import time
from types import SimpleNamespace

import pytest
import torch
from phalanx_concurrency import in_processes, in_threads

from phalanx.callbacks import ModelCheckpoint
from phalanx.plugins.io.torch_io import TorchCheckpointIO
from phalanx.trainer.checkpoint import is_complete_checkpoint
from phalanx.utilities.rank_zero import rank_zero_only


@pytest.fixture(autouse=True)
def _rank_zero(monkeypatch):
    monkeypatch.setattr(rank_zero_only, "rank", 0)


# ---------------------------------------------------------------------- templates and arguments at construction
@pytest.mark.parametrize(
    ("filename", "match"),
    [
        ("{epoch", "unbalanced"),
        ("epoch}", "unbalanced"),
        ("{{epoch}}", "brace"),
        ("{}-{epoch}", "empty"),
        ("{epoch:{width}}", "nested"),
        ("{epoch:zz}", "format spec 'zz'"),
        ("{val_loss:q}", "format spec 'q'"),
        ("{epoch:.2s}", "format spec"),
        ("{val_loss!x}", "conversion '!x'"),
        ("{val_loss!}", "conversion '!'"),
        ("{ epoch}", "spaces"),
        ("run/{epoch}", "separator '/'"),
        ("../{epoch}", "separator '/'"),
        ("/tmp/{epoch}", "separator '/'"),
        ("..", "'.'"),
        (".hidden-{epoch}", "'.'"),
        ("", "empty"),
        ("a\0b", "NUL"),
        ("x" * 300, "255 bytes"),
        ("{epoch:>300}", "255 bytes"),
    ],
)
def test_bad_filename_is_refused_at_construction(filename, match):
    with pytest.raises(ValueError, match=match) as error:
        ModelCheckpoint(filename=filename)
    assert "filename=" in str(error.value)


@pytest.mark.parametrize(
    ("filename", "metrics", "expected"),
    [
        ("{epoch}", {"epoch": 3}, "epoch=3"),
        ("{epoch:02d}-{val_loss:.2f}", {"epoch": 3, "val_loss": torch.tensor(0.123)}, "epoch=03-val_loss=0.12"),
        ("{val/loss:.3f}", {"val/loss": 0.5}, "val_loss=0.500"),
        ("model-{epoch}", {"epoch": 1}, "model-epoch=1"),
        ("{val_loss!r}", {"val_loss": 0.25}, "val_loss=0.25"),
        ("{step:,}", {"step": 12345}, "step=12,345"),
        ("{count:d}", {"count": torch.tensor(7)}, "count=7"),
        ("{epoch:/>3}", {"epoch": 1}, "epoch=__1"),
    ],
)
def test_good_filenames_format(tmp_path, filename, metrics, expected):
    callback = ModelCheckpoint(dirpath=tmp_path, filename=filename)
    assert os.path.basename(callback.format_checkpoint_name(metrics)) == expected + ".ckpt"


def test_format_error_at_save_names_the_template(tmp_path):
    # "{loss:d}" is valid for an int metric; a float at save time is refused with the template and value named.
    callback = ModelCheckpoint(dirpath=tmp_path, filename="{loss:d}")
    with pytest.raises(ValueError, match=r"filename='\{loss:d\}'.*loss=0\.5"):
        callback.format_checkpoint_name({"loss": 0.5})
    with pytest.raises(ValueError, match="unbalanced"):
        callback.format_checkpoint_name({}, filename="{oops")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"dirpath": 3}, TypeError, "dirpath"),
        ({"dirpath": ""}, ValueError, "dirpath"),
        ({"dirpath": "a\0b"}, ValueError, "dirpath"),
        ({"dirpath": "{file}"}, ValueError, "not a folder"),
        ({"filename": 3}, TypeError, "filename"),
        ({"monitor": 3}, TypeError, "monitor"),
        ({"monitor": ""}, ValueError, "monitor"),
        ({"mode": None}, ValueError, "mode"),
        ({"verbose": "yes"}, TypeError, "verbose"),
        ({"save_weights_only": 1}, TypeError, "save_weights_only"),
        ({"save_last": "symlink"}, TypeError, "save_last"),
        ({"save_last": 1}, TypeError, "save_last"),
        ({"save_on_train_epoch_end": "x"}, TypeError, "save_on_train_epoch_end"),
        ({"enable_version_counter": None}, TypeError, "enable_version_counter"),
        ({"auto_insert_metric_name": 0}, TypeError, "auto_insert_metric_name"),
        ({"save_on_nonfinite": "no"}, TypeError, "save_on_nonfinite"),
        ({"save_top_k": 1.0}, ValueError, "save_top_k"),
        ({"every_n_train_steps": True}, ValueError, "every_n_train_steps"),
    ],
)
def test_bad_arguments_are_refused_at_construction(tmp_path, kwargs, error, match):
    (tmp_path / "file").write_text("not a folder")
    kwargs = {
        k: (v.format(file=tmp_path / "file") if isinstance(v, str) and "{file}" in v else v) for k, v in kwargs.items()
    }
    with pytest.raises(error, match=match):
        ModelCheckpoint(**kwargs)


# ---------------------------------------------------------------------- names claimed exclusively
class Strategy:
    def __init__(self, is_global_zero=True, rank_zero_answer=None):
        self.is_global_zero = is_global_zero
        self.rank_zero_answer = rank_zero_answer
        self.broadcasts = []

    def broadcast(self, obj, src=0):
        self.broadcasts.append(obj)
        # A rank other than 0 offers None and receives rank 0's name; any other broadcast passes through.
        if not self.is_global_zero and obj is None and self.rank_zero_answer is not None:
            return self.rank_zero_answer
        return obj

    def reduce_boolean_decision(self, decision, all=True):
        return decision

    def remove_checkpoint(self, path):
        TorchCheckpointIO().remove_checkpoint(path)


class RunTrainer(SimpleNamespace):
    """Saves a checkpoint holding this run's id and weights, slowly (as a large model would)."""

    def __init__(self, root, run, delay=0.0, strategy=None):
        strategy = strategy or Strategy()
        super().__init__(
            callback_metrics={},
            global_step=10,
            current_epoch=0,
            sanity_checking=False,
            fast_dev_run=False,
            state=SimpleNamespace(fn="fit"),
            validation_enabled=True,
            check_val_every_n_epoch=1,
            val_check_interval=0.5,  # several validations an epoch: saves come from on_validation_end
            loggers=[],
            log_dir=None,
            default_root_dir=str(root),
            is_global_zero=strategy.is_global_zero,
            strategy=strategy,
            ckpt_path=None,
        )
        self.run, self.delay = run, delay

    def save_checkpoint(self, filepath, weights_only=False):
        time.sleep(self.delay)  # serialising: the window in which a check-then-write name is taken by another run
        if self.is_global_zero:
            TorchCheckpointIO().save_checkpoint(
                {"run": self.run, "state_dict": {"w": torch.full((3,), float(self.run))}}, filepath
            )


def save_once(dirpath, run, barrier, delay=0.05):
    """One run's first save point, started together with the other runs' (returns its best and last paths)."""
    callback = ModelCheckpoint(dirpath=dirpath, save_last=True)
    trainer = RunTrainer(dirpath, run, delay)
    callback.setup(trainer, None, "fit")
    barrier.wait(timeout=10)
    callback.on_validation_end(trainer, None)
    return callback.best_model_path, callback.last_model_path


def assert_each_run_has_its_own_files(results, runs):
    best = {run: paths[0] for run, paths in results.items()}
    last = {run: paths[1] for run, paths in results.items()}
    assert sorted(results) == list(range(runs))
    assert len(set(best.values())) == runs and len(set(last.values())) == runs
    for run in range(runs):
        for path in (best[run], last[run]):
            checkpoint = torch.load(path, weights_only=True)
            assert checkpoint["run"] == run and torch.equal(checkpoint["state_dict"]["w"], torch.full((3,), float(run)))


def test_threads_saving_together_claim_distinct_names(tmp_path):
    runs = 4
    results = in_threads(lambda run, barrier: save_once(str(tmp_path), run, barrier), runs)
    assert_each_run_has_its_own_files(results, runs)
    names = sorted(os.listdir(tmp_path))
    assert names == sorted(
        ["epoch=0-step=10.ckpt"]
        + [f"epoch=0-step=10-v{v}.ckpt" for v in range(1, runs)]
        + ["last.ckpt"]
        + [f"last-v{v}.ckpt" for v in range(1, runs)]
    )


def test_processes_saving_together_claim_distinct_names(tmp_path):
    runs = 3
    results = in_processes(lambda run, barrier: save_once(str(tmp_path), run, barrier), runs)
    assert all(isinstance(paths, tuple) for paths in results.values()), results
    assert_each_run_has_its_own_files(results, runs)


def test_other_ranks_take_rank_zero_name_and_claim_nothing(tmp_path):
    answer = os.path.join(os.path.realpath(tmp_path), "from-rank-zero.ckpt")
    strategy = Strategy(is_global_zero=False, rank_zero_answer=None)
    callback = ModelCheckpoint(dirpath=tmp_path)
    trainer = RunTrainer(tmp_path, run=1, strategy=strategy)
    callback.setup(trainer, None, "fit")
    strategy.rank_zero_answer = answer
    callback.on_validation_end(trainer, None)
    assert callback.best_model_path == answer
    assert None in strategy.broadcasts  # this rank offered no name of its own
    assert os.listdir(tmp_path) == []  # and created no placeholder


def test_failed_save_leaves_no_placeholder(tmp_path):
    class Failing(RunTrainer):
        def save_checkpoint(self, filepath, weights_only=False):
            raise OSError("disk full")

    callback = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer = Failing(tmp_path, run=0)
    callback.setup(trainer, None, "fit")
    with pytest.raises(OSError, match="disk full"):
        callback.on_validation_end(trainer, None)
    assert os.listdir(tmp_path) == []


def test_a_claim_puts_nothing_under_the_final_name(tmp_path):
    from phalanx.callbacks._checkpoint_files import claim

    target = tmp_path / "epoch=0-step=1.ckpt"
    held = claim(str(target))
    assert held is not None and not os.path.lexists(target)
    assert [p.name for p in tmp_path.iterdir()] == [".epoch=0-step=1.ckpt.claim"]  # hidden, never a checkpoint
    assert claim(str(target)) is None  # held by a live save
    held.release()
    assert list(tmp_path.iterdir()) == [] and not is_complete_checkpoint(target)
    again = claim(str(target))
    assert again is not None
    again.release()


def _stale_claim(folder, name="epoch=0-step=1.ckpt"):
    """What a save killed mid-way leaves: its (unlocked) marker, a half-written temporary and a staging directory."""
    (folder / f".{name}.claim").write_bytes(b"")
    (folder / f".{name}.{'a' * 32}.tmp").write_bytes(b"half")
    (folder / f".{name}.{'b' * 32}.tmp").mkdir()
    (folder / f".{name}.{'b' * 32}.tmp" / "__0_0.distcp").write_bytes(b"shard")


def _live_claim(folder):
    from phalanx.callbacks._checkpoint_files import claim

    return claim(str(folder / "epoch=0-step=1.ckpt"))


def _planted_link(folder):
    (folder.parent / "outside").mkdir()
    os.symlink(folder.parent / "outside" / "created", folder / ".epoch=0-step=1.ckpt.claim")


# state of the name before a claim -> whether the claim wins, and what is left in the folder after it (and a release)
CLAIM_STATES = [
    ("nothing", lambda folder: None, True, []),
    (
        "the checkpoint is written",
        lambda f: (f / "epoch=0-step=1.ckpt").write_bytes(b"ckpt"),
        False,
        ["epoch=0-step=1.ckpt"],
    ),
    ("a live save holds it", _live_claim, False, [".epoch=0-step=1.ckpt.claim"]),
    ("a killed save left its claim", _stale_claim, True, []),
    (
        "a killed save left its claim after writing",
        lambda f: (_stale_claim(f), (f / "epoch=0-step=1.ckpt").write_bytes(b"c")),
        False,
        [f".epoch=0-step=1.ckpt.{'a' * 32}.tmp", f".epoch=0-step=1.ckpt.{'b' * 32}.tmp", "epoch=0-step=1.ckpt"],
    ),
    ("a link planted as the marker", _planted_link, False, [".epoch=0-step=1.ckpt.claim"]),
]


@pytest.mark.parametrize(("state", "make", "wins", "left"), CLAIM_STATES, ids=[c[0] for c in CLAIM_STATES])
def test_a_claim_wins_only_a_free_name_and_reclaims_a_killed_save(tmp_path, state, make, wins, left):
    from phalanx.callbacks._checkpoint_files import claim

    folder = tmp_path / "ckpts"
    folder.mkdir()
    holder = make(folder)
    held = claim(str(folder / "epoch=0-step=1.ckpt"))
    assert (held is not None) == wins
    if held is not None:
        assert not os.path.lexists(folder / "epoch=0-step=1.ckpt")  # nothing under the final name
        held.release()
    assert sorted(p.name for p in folder.iterdir()) == left
    assert not (tmp_path / "outside" / "created").exists()  # a planted link is never followed
    if holder is not None and hasattr(holder, "release"):
        holder.release()


def test_the_next_run_reclaims_what_killed_saves_left_and_keeps_live_claims(tmp_path):
    from phalanx.callbacks._checkpoint_files import claim, reclaim_abandoned

    _stale_claim(tmp_path, "epoch=0-step=1.ckpt")
    _stale_claim(tmp_path, "last.ckpt")
    live = claim(str(tmp_path / "epoch=0-step=2.ckpt"))
    (tmp_path / f".epoch=0-step=2.ckpt.{'c' * 32}.tmp").write_bytes(b"being written")
    reclaim_abandoned(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [".epoch=0-step=2.ckpt.claim", f".epoch=0-step=2.ckpt.{'c' * 32}.tmp"]
    )  # the live save's marker and temporary are untouched
    live.release()


def test_fsspec_names_are_claimed_too():
    import uuid

    import fsspec

    folder = f"memory://claims-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    try:
        first = ModelCheckpoint(dirpath=folder)
        second = ModelCheckpoint(dirpath=folder)
        paths = []
        for run, callback in enumerate((first, second)):
            trainer = RunTrainer(folder, run)
            trainer.save_checkpoint = lambda path, weights_only=False, run=run: TorchCheckpointIO().save_checkpoint(
                {"run": run}, path
            )
            callback.setup(trainer, None, "fit")
            callback.on_validation_end(trainer, None)
            paths.append(callback.best_model_path)
        assert paths == [f"{folder}/epoch=0-step=10.ckpt", f"{folder}/epoch=0-step=10-v1.ckpt"]
        for run, path in enumerate(paths):
            with fsspec.open(path, "rb") as handle:
                assert torch.load(handle, weights_only=True)["run"] == run
    finally:
        fs.rm(folder.split("://")[1], recursive=True)
