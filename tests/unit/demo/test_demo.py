"""Tests of the ``phalanx demo``: data, model, command line and a short end-to-end run (all in-process)."""

from __future__ import annotations

import math

import pytest
import torch

from phalanx.cli import DEMO_DEFAULT_MAX_STEPS, build_parser, main, parse_devices
from phalanx.demo.data import CORPUS_PATH, CharDataModule
from phalanx.demo.model import CharTransformer
from phalanx.demo.run import DEFAULT_MAX_STEPS, run_demo, val_check_interval_for


@pytest.fixture(scope="module")
def datamodule() -> CharDataModule:
    dm = CharDataModule(block_size=16, batch_size=4)
    dm.setup("fit")
    return dm


def _tiny_model(vocab_size: int = 11, block_size: int = 16) -> CharTransformer:
    torch.manual_seed(0)
    return CharTransformer(vocab_size=vocab_size, block_size=block_size, n_embd=32, n_head=4, n_layer=2)


# ---------------------------------------------------------------------------- data
def test_corpus_is_shipped_and_sized():
    raw = CORPUS_PATH.read_bytes()
    assert 40_000 <= len(raw) <= 100_000
    raw.decode("ascii")  # plain ASCII: a small vocabulary


def test_encode_decode_round_trip(datamodule):
    text = datamodule.text[1000:1300]
    ids = datamodule.encode(text)
    assert len(ids) == len(text)
    assert all(0 <= i < datamodule.vocab_size for i in ids)
    assert datamodule.decode(ids) == text
    assert datamodule.decode(torch.tensor(ids)) == text
    assert datamodule.chars == sorted(set(datamodule.text))
    assert 30 <= datamodule.vocab_size <= 100


def test_split_is_90_10_and_contiguous(datamodule):
    n = len(datamodule.text)
    n_train, n_val = datamodule.train_data.numel(), datamodule.val_data.numel()
    assert n_train + n_val == n
    assert abs(n_val / n - 0.1) < 0.01
    assert datamodule.decode(datamodule.train_data) + datamodule.decode(datamodule.val_data) == datamodule.text


def test_windows_are_shifted_by_one(datamodule):
    x, y = datamodule.train_dataset[123]
    assert x.shape == y.shape == (16,)
    assert torch.equal(x[1:], y[:-1])
    assert torch.equal(x, datamodule.train_data[123:139])
    # Validation windows are fixed, non-overlapping chunks of the validation text.
    vx0, _ = datamodule.val_dataset[0]
    vx1, _ = datamodule.val_dataset[1]
    assert torch.equal(torch.cat([vx0, vx1]), datamodule.val_data[:32])
    last_x, last_y = datamodule.val_dataset[len(datamodule.val_dataset) - 1]
    assert last_y.shape == (16,)
    with pytest.raises(IndexError):
        datamodule.val_dataset[len(datamodule.val_dataset)]


def test_dataloaders(datamodule):
    x, y = next(iter(datamodule.train_dataloader()))
    assert x.shape == y.shape == (4, 16)
    assert x.dtype == torch.long
    val_batches = list(datamodule.val_dataloader())
    assert sum(b[0].shape[0] for b in val_batches) == len(datamodule.val_dataset)


def test_custom_text_and_unknown_character():
    dm = CharDataModule(block_size=4, batch_size=2, text="abcabcabcabcabcabcabcabc")
    assert dm.vocab_size == 3
    assert dm.encode("cab") == [2, 0, 1]
    with pytest.raises(KeyError):
        dm.encode("z")


# ---------------------------------------------------------------------------- model
def test_hyperparameters_are_saved():
    model = CharTransformer(vocab_size=7, lr=1e-3)
    assert model.hparams.vocab_size == 7
    assert model.hparams.lr == 1e-3
    assert model.hparams.block_size == 64
    assert model.hparams.n_layer == 2


def test_forward_shape_and_initial_loss():
    model = _tiny_model()
    idx = torch.randint(0, 11, (3, 16))
    assert model(idx).shape == (3, 16, 11)
    assert model(idx[:, :5]).shape == (3, 5, 11)
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 17, dtype=torch.long))
    # With small initial weights the predictions are near uniform.
    loss = model._loss((idx, torch.randint(0, 11, (3, 16))))
    assert abs(loss.item() - math.log(11)) < 0.3


def test_attention_is_causal():
    model = _tiny_model().eval()
    idx = torch.randint(0, 11, (2, 16))
    changed = idx.clone()
    changed[:, 9] = (changed[:, 9] + 1) % 11
    with torch.no_grad():
        before, after = model(idx), model(changed)
    torch.testing.assert_close(before[:, :9], after[:, :9], rtol=0, atol=1e-6)
    assert not torch.allclose(before[:, 9:], after[:, 9:])


def test_generate_length_determinism_and_mode():
    model = _tiny_model()
    model.train()
    prompt = torch.randint(0, 11, (2, 3))
    out = model.generate(prompt, 40, generator=torch.Generator().manual_seed(1))  # longer than block_size
    assert out.shape == (2, 43)
    assert torch.equal(out[:, :3], prompt)
    assert int(out.min()) >= 0 and int(out.max()) < 11
    again = model.generate(prompt, 40, generator=torch.Generator().manual_seed(1))
    assert torch.equal(out, again)
    assert model.training  # generate restores the mode it found
    greedy = model.generate(prompt, 5, temperature=0.0)
    assert torch.equal(greedy, model.generate(prompt, 5, temperature=0.0))


def test_training_step_and_optimizer(datamodule):
    model = CharTransformer(vocab_size=datamodule.vocab_size, block_size=16, n_embd=32)
    optimizer = model.configure_optimizers()
    assert isinstance(optimizer, torch.optim.AdamW)
    assert optimizer.param_groups[0]["lr"] == model.hparams.lr
    n_params = sum(p.numel() for p in model.parameters())
    assert sum(p.numel() for g in optimizer.param_groups for p in g["params"]) == n_params
    batch = next(iter(datamodule.train_dataloader()))
    losses = []
    for _ in range(5):  # the same batch: the loss must go down (checked directly, without a Trainer)
        loss = model._loss(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


# ---------------------------------------------------------------------------- command line
def test_parse_demo_defaults():
    args = build_parser().parse_args(["demo"])
    assert args.command == "demo"
    assert (args.strategy, args.devices, args.accelerator, args.precision) == ("auto", "auto", "auto", "32-true")
    assert args.max_steps == DEMO_DEFAULT_MAX_STEPS == DEFAULT_MAX_STEPS
    assert args.seed == 42
    assert args.default_root_dir is None
    assert callable(args.func)


def test_parse_demo_flags():
    args = build_parser().parse_args(
        "demo --strategy ddp --devices 0,1 --accelerator cpu --precision bf16-mixed --max-steps 10 --seed 7 "
        "--default-root-dir /tmp/x --no-progress-bar".split()
    )
    assert args.strategy == "ddp"
    assert args.devices == [0, 1]
    assert args.accelerator == "cpu"
    assert args.precision == "bf16-mixed"
    assert args.max_steps == 10
    assert args.seed == 7
    assert args.default_root_dir == "/tmp/x"
    assert args.no_progress_bar


@pytest.mark.parametrize(
    ("value", "expected"), [("auto", "auto"), ("AUTO", "auto"), ("2", 2), ("-1", -1), ("0,1", [0, 1]), ("1,", [1])]
)
def test_parse_devices(value, expected):
    assert parse_devices(value) == expected


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--devices", "two"],
        ["demo", "--devices", "0"],
        ["demo", "--devices", "-3"],
        ["demo", "--devices", "0,0"],
        ["demo", "--devices", "a,b"],
        ["demo", "--max-steps", "0"],
        ["demo", "--seed", "-1"],
        ["demo", "--bogus"],
        ["nonsense"],
    ],
)
def test_bad_arguments_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err
    assert "Traceback" not in err


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "demo" in capsys.readouterr().err


def test_help_exits_cleanly(capsys):
    with pytest.raises(SystemExit) as info:
        main(["demo", "--help"])
    assert info.value.code == 0
    assert "--max-steps" in capsys.readouterr().out


def test_trainer_configuration_errors_are_reported_without_traceback(capsys):
    assert main(["demo", "--strategy", "no-such-strategy", "--max-steps", "1", "--no-progress-bar"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("phalanx demo: error:")
    assert "no-such-strategy" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(("max_steps", "expected"), [(30, 5), (900, 150), (1000, 125), (1, 1), (7, 1), (97, 17)])
def test_val_check_interval(max_steps, expected):
    assert val_check_interval_for(max_steps) == expected


# ---------------------------------------------------------------------------- end to end
def test_run_demo_short(tmp_path, capsys):
    result = run_demo(max_steps=30, enable_progress_bar=False, default_root_dir=tmp_path, accelerator="cpu")
    losses = result["val_losses"]
    assert len(losses) == 6
    assert result["val_steps"] == [5, 10, 15, 20, 25, 30]
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0]
    sample = result["sample"]
    assert isinstance(sample, str) and len(sample) == 200
    vocabulary = set(CharDataModule().chars)
    assert set(sample) <= vocabulary
    out = capsys.readouterr().out
    assert "step 30: val_loss" in out
    assert sample in out
