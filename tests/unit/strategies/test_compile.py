"""torch.compile with the Trainer and the Cohort on one process: what is compiled, parity with eager, checkpoints
that load either way, a bounded number of compilations, and refusals of bad ``compile=`` arguments."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader, TensorDataset

import phalanx
from phalanx.utilities.compile import repeated_blocks

WIDTH = 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


class Net(phalanx.TrainingModule):
    """Two repeated blocks and a head; logs from its step like a user's module."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def _data() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(32, WIDTH, generator=generator)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


def _trainer(tmp_path: Path, max_steps: int, **kwargs: Any) -> phalanx.Trainer:
    return phalanx.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        **kwargs,
    )


def _fit(tmp_path: Path, max_steps: int, model: Any = None, ckpt_path: Any = None, **kwargs: Any) -> phalanx.Trainer:
    torch.manual_seed(0)
    model = Net() if model is None else model
    trainer = _trainer(tmp_path, max_steps, limit_val_batches=0, **kwargs)
    trainer.fit(model, _data(), ckpt_path=ckpt_path)
    return trainer


def _weights(trainer: phalanx.Trainer) -> dict[str, torch.Tensor]:
    module = trainer.strategy.module
    assert module is not None
    return {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}


def _compiled(module: nn.Module) -> str | None:
    """Which unit was compiled in ``module`` (a Net): 'model' (its forward), 'blocks', or None."""
    assert isinstance(module, Net)
    blocks = [block._compiled_call_impl is not None for block in module.blocks]
    assert module._compiled_call_impl is None  # never its _call_impl: the strategies run training_step through it
    if "forward" in module.__dict__:
        assert not any(blocks)
        return "model"
    return "blocks" if all(blocks) else None


def _blocks_compiled(trainer: phalanx.Trainer) -> bool:
    """Whether the single-device strategy's unit ('model': Net's forward, which holds the blocks) was compiled."""
    module = trainer.strategy.module
    assert isinstance(module, Net)
    return _compiled(module) == "model"


def _assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=1e-5, msg=name)


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _container(*members: nn.Module) -> nn.Module:
    model = nn.Module()
    model.layers = nn.ModuleList(members)  # type: ignore[assignment]
    return model


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        (Net(), 2),  # ModuleList of two identical composite blocks
        (nn.Sequential(Block(), Block(), Block()), 3),  # the root itself is the container
        (nn.Sequential(nn.Linear(2, 2), nn.ReLU()), 0),  # mixed types: the whole module
        (_container(nn.Linear(2, 2), nn.Linear(2, 2)), 0),  # leaves, not blocks: the whole module
        (_container(Block()), 0),  # one block is not a repetition
        (_container(Block(), nn.Sequential(Block(), Block())), 2),  # mixed outside, the inner pair repeats
        (_container(nn.Sequential(Block(), Block()), nn.Sequential(Block(), Block())), 2),  # outermost wins
    ],
    ids=["net", "root-sequential", "mixed", "leaves", "single", "inner-pair", "outermost"],
)
def test_repeated_blocks_are_found_where_a_model_repeats_a_composite_block(model: nn.Module, expected: int) -> None:
    assert len(repeated_blocks(model)) == expected


@pytest.mark.parametrize(
    ("compile_", "error", "match"),
    [
        ("inductor", TypeError, r"pass True, False, None or a dict of torch.compile arguments"),
        (1, TypeError, r"pass True, False, None or a dict"),
        ({"backnd": "eager"}, ValueError, r"unknown key 'backnd'; torch.compile takes \['fullgraph'"),
        ({"fullgraph": "yes"}, TypeError, r"'fullgraph' takes bool"),
        ({"mode": 3}, TypeError, r"'mode' takes str or None"),
        ({"backend": "no-such-backend"}, ValueError, r"refused by torch.compile: Invalid backend"),
        ({"mode": "fastest"}, ValueError, r"refused by torch.compile: Unrecognized mode=fastest"),
        ({"mode": "default", "options": {}}, ValueError, r"Either mode or options"),
    ],
)
@pytest.mark.parametrize("owner", ["Trainer", "Cohort"])
def test_bad_compile_arguments_are_refused_with_the_valid_choices(
    owner: str, compile_: Any, error: type, match: str
) -> None:
    make = phalanx.Trainer if owner == "Trainer" else phalanx.Cohort
    with pytest.raises(error, match=rf"{owner}\(compile=.*{match}"):
        make(accelerator="cpu", devices=1, compile=compile_)


def test_a_compiled_model_with_compile_set_as_well_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"compiled with torch.compile and Trainer has compile=\.\.\. too"):
        _fit(tmp_path, 1, model=torch.compile(Net(), backend="eager"), compile={"backend": "eager"})


@pytest.mark.parametrize(
    "how",
    [{"compile": {"backend": "eager"}}, {"compile": {"backend": "aot_eager"}}, {"precompiled": "aot_eager"}],
    ids=["eager", "aot_eager", "fit(torch.compile(model))"],
)
def test_compiled_training_matches_eager_and_saves_plain_names(tmp_path: Path, how: dict[str, Any]) -> None:
    eager = _weights(_fit(tmp_path / "eager", 4))
    torch.manual_seed(0)
    model: Any = Net()
    if "precompiled" in how:
        model = torch.compile(model, backend=how["precompiled"])
    trainer = _fit(tmp_path / "compiled", 4, model=model, compile=how.get("compile"))
    assert isinstance(trainer.strategy.module, Net)  # the original module was set up, compiled in place
    assert _blocks_compiled(trainer)
    _assert_close(eager, _weights(trainer))
    saved = torch.load(next((tmp_path / "compiled").rglob("*.ckpt")), weights_only=False)
    assert not [key for key in saved["state_dict"] if "_orig_mod" in key]
    assert saved["state_dict"].keys() == eager.keys()


@pytest.mark.parametrize(
    ("first", "second"),
    [(None, {"backend": "aot_eager"}), ({"backend": "aot_eager"}, None)],
    ids=["eager-ckpt-to-compiled", "compiled-ckpt-to-eager"],
)
def test_checkpoints_resume_exactly_across_eager_and_compiled(tmp_path: Path, first: Any, second: Any) -> None:
    straight = _weights(_fit(tmp_path / "straight", 4))
    _fit(tmp_path / "first", 2, compile=first)
    ckpt = next((tmp_path / "first").rglob("*.ckpt"))
    resumed = _fit(tmp_path / "second", 4, ckpt_path=str(ckpt), compile=second)
    assert resumed.global_step == 4
    assert _blocks_compiled(resumed) == (second is not None)
    _assert_close(straight, _weights(resumed))


class _FramesAfterEachEpoch(phalanx.Callback):
    def __init__(self, counter: CompileCounter) -> None:
        self.counter = counter
        self.frames: list[int] = []

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        self.frames.append(self.counter.frame_count)


def test_steps_compile_a_bounded_number_of_times_without_graph_breaks(tmp_path: Path) -> None:
    counter = CompileCounter()
    frames = _FramesAfterEachEpoch(counter)
    torch.manual_seed(0)
    trainer = _trainer(tmp_path, 12, compile={"backend": counter}, callbacks=[frames], gradient_clip_val=1.0)
    trainer.fit(Net(), _data(), _data())
    # Epoch 1 compiles the model for training, then for validation (no grad; the sanity check runs eagerly); later
    # epochs and steps compile nothing.
    assert frames.frames[0] == 2
    assert frames.frames == [frames.frames[0]] * 3
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == frames.frames[0]


def test_cohort_compiles_with_compile_and_with_a_compiled_module() -> None:
    results = []
    for compile_, wrap in ((None, False), ({"backend": "aot_eager"}, False), (None, True)):
        torch._dynamo.reset()
        torch.manual_seed(0)
        cohort = phalanx.Cohort(accelerator="cpu", devices=1, compile=compile_)
        net = Net()
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        model, optimizer = cohort.setup(torch.compile(net, backend="aot_eager") if wrap else net, optimizer)
        for x, y in _data():
            loss = nn.functional.mse_loss(model(x), y)
            cohort.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        assert _compiled(net) == ("model" if compile_ is not None or wrap else None)
        results.append({name: t.detach().clone() for name, t in net.state_dict().items()})
    _assert_close(results[0], results[1])
    _assert_close(results[0], results[2])


def test_inductor_matches_eager(tmp_path: Path) -> None:
    eager = _weights(_fit(tmp_path / "eager", 2))
    compiled = _fit(tmp_path / "inductor", 2, compile=True)
    assert _blocks_compiled(compiled)
    _assert_close(eager, _weights(compiled))


@pytest.mark.parametrize("how", ["argument", "compiled_model"])
def test_compile_with_the_trainers_defaults_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """A user's run: validation loader and sanity check, default CSV logger and checkpoint folder, progress bar,
    inference_mode; compiled either way, it trains like eager and its saved checkpoint has the eager names."""
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    eager = phalanx.Trainer(accelerator="cpu", devices=1, max_epochs=1, default_root_dir=str(tmp_path / "eager"))
    eager.fit(Net(), _data(), _data())
    torch.manual_seed(0)
    model: Any = Net()
    options = {"backend": "aot_eager"}
    if how == "compiled_model":
        model, kwargs = torch.compile(model, **options), {}
    else:
        kwargs = {"compile": options}
    compiled = phalanx.Trainer(accelerator="cpu", devices=1, max_epochs=1, **kwargs)
    compiled.fit(model, _data(), _data())
    assert _blocks_compiled(compiled)
    _assert_close(_weights(compiled), _weights(eager))
    assert counters["graph_break"] == {}
    saved = sorted((tmp_path / "logs" / "version_0" / "checkpoints").glob("*.ckpt"))
    assert saved, "the default ModelCheckpoint wrote nothing"
    state = torch.load(saved[-1], weights_only=True)["state_dict"]
    assert not [key for key in state if "_orig_mod" in key]
    assert (tmp_path / "logs" / "version_0" / "metrics.csv").exists()
    assert compiled.validate(dataloaders=_data(), verbose=False)[0]["val_loss"] >= 0.0
