"""RichProgressBar and RichModelSummary: the bars and the summary table show what Lightning's show (same
descriptions, counts, metrics and rows), on rank 0 only; rich is imported only when something is drawn, and without it
the error names the extra to install."""

from __future__ import annotations

import io
import re
import subprocess
import sys

import callback_project as project
import pytest
import torch
from torch.utils.data import DataLoader

import phalanx
from phalanx.callbacks import ModelSummary, RichModelSummary, RichProgressBar, RichProgressBarTheme
from phalanx.callbacks import rich_model_summary as summary_module

pytest.importorskip("rich", reason="rich is not installed: nothing to draw with")


@pytest.fixture(autouse=True)
def fresh_global_console(monkeypatch):
    """A new rich global console per test: Lightning's bar reconfigures it to write to the test's buffer."""
    import rich

    monkeypatch.setattr(rich, "_console", None)


def _bar_lines(text: str) -> list[str]:
    """The bars' lines, with what depends on the clock (times, speeds) left out."""
    lines = [line.rstrip() for line in text.splitlines() if "━" in line]
    lines = [re.sub(r"\d+:\d\d:\d\d", "T", line) for line in lines]
    return [re.sub(r"[\d.]+it/s", "S", line) for line in lines]


def _drawn(framework: str, root) -> str:
    _, trainer_class, callbacks = project.framework_parts(framework)
    out = io.StringIO()
    console = {"file": out, "width": 160, "force_terminal": False, "color_system": None}
    bar = callbacks.RichProgressBar(refresh_rate=1, console_kwargs=console)
    torch.manual_seed(0)
    model = project.module_class(framework)()
    trainer = trainer_class(
        accelerator="cpu", max_epochs=2, logger=False, enable_checkpointing=False, enable_model_summary=False,
        callbacks=[bar], default_root_dir=root,
    )  # fmt: skip
    trainer.fit(model, DataLoader(project.data(), batch_size=4), DataLoader(project.data(12, 1), batch_size=4))
    trainer.validate(model, DataLoader(project.data(12, 1), batch_size=4), verbose=False)
    trainer.predict(model, DataLoader(project.data(12, 1), batch_size=4))
    return out.getvalue()


def test_the_bars_show_what_lightnings_show(tmp_path):
    pytest.importorskip("pytorch_lightning", reason="pytorch-lightning is the oracle of this row")
    theirs = _bar_lines(_drawn("lightning", tmp_path / "lightning"))
    ours = _bar_lines(_drawn("phalanx", tmp_path / "phalanx"))
    assert ours == theirs
    assert ours[0].startswith("Epoch 1/1  ") and "10/10" in ours[0] and "val_loss:" in ours[0]


def test_with_the_defaults_the_summary_is_a_rich_one_and_the_bars_draw_on_rank_0_only(tmp_path, capsys):
    out = io.StringIO()
    bar = RichProgressBar(console_kwargs={"file": out, "width": 120}, theme=RichProgressBarTheme(metrics_format=".1f"))
    trainer = phalanx.Trainer(accelerator="cpu", max_epochs=1, default_root_dir=tmp_path, callbacks=[bar])
    assert [type(cb) for cb in trainer.callbacks if isinstance(cb, ModelSummary)] == [RichModelSummary]
    trainer.fit(project.module_class("phalanx")(), DataLoader(project.data(), batch_size=4))
    assert "Epoch 0/0" in out.getvalue() and re.search(r"v_num: 0 train_loss: \d+\.\d$", out.getvalue(), re.M)
    assert "Total params" in capsys.readouterr().out
    hidden = RichProgressBar(console_kwargs={"file": io.StringIO()})
    hidden.disable()  # what the Trainer does on every rank but 0
    trainer = phalanx.Trainer(accelerator="cpu", max_epochs=1, default_root_dir=tmp_path, callbacks=[hidden])
    trainer.fit(project.module_class("phalanx")(), DataLoader(project.data(), batch_size=4))
    assert hidden.progress is None and hidden._console is None


def _summary_rows(text: str) -> list[list[str]]:
    rows = [[cell.strip() for cell in line.strip("│").split("│")] for line in text.splitlines() if line.startswith("│")]
    return [row[:5] for row in rows]


def test_the_summary_shows_lightnings_rows(capsys):
    pl = pytest.importorskip("pytorch_lightning", reason="pytorch-lightning is the oracle of this row")
    from pytorch_lightning.utilities.model_summary import summarize

    model = project.module_class("lightning")()
    data = summarize(model, max_depth=2)
    pl.callbacks.RichModelSummary.summarize(
        data._get_summary_data(), data.total_parameters, data.trainable_parameters, data.model_size,
        data.total_training_modes, data.total_flops,
    )  # fmt: skip
    theirs = capsys.readouterr().out
    RichModelSummary(max_depth=2)._show(project.module_class("phalanx")())
    ours = capsys.readouterr().out
    assert _summary_rows(ours) == _summary_rows(theirs)
    assert len(_summary_rows(ours)) == 4  # net and its three layers
    labels = ("Trainable params", "Non-trainable params", "Total params", "Total estimated model params size (MB)")
    mine, their = _totals(ours), _totals(theirs)
    assert {label: mine[label] for label in labels} == {label: their[label] for label in labels}
    assert mine["Trainable params"] == "49"


def _totals(text: str) -> dict[str, str]:
    return dict(re.findall(r"^([A-Z][^:\n]*): (\S+)", text, re.M))


def test_import_phalanx_callbacks_does_not_import_rich():
    code = "import sys, phalanx.callbacks; print('rich' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


@pytest.mark.parametrize("make", [RichProgressBar, RichModelSummary])
def test_without_rich_the_error_names_the_extra(monkeypatch, make):
    monkeypatch.setattr(summary_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(
        ModuleNotFoundError, match=r"needs the rich package, which is not installed: pip install 'phalanx\[rich\]'"
    ):
        make()


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: RichProgressBar(refresh_rate=-1), "refresh_rate=-1 must be an int >= 0"),
        (lambda: RichModelSummary(max_depth=-2), "`max_depth` must be an int >= -1"),
        (lambda: RichModelSummary(header_styl="bold"), r"unexpected keyword argument\(s\) \['header_styl'\]"),
    ],
)
def test_bad_arguments_are_refused(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()
