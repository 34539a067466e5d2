"""``run_demo``: train the character transformer on the shipped corpus and sample from it."""

from __future__ import annotations

import math
import os
import sys
import tempfile
from typing import Any

import torch

import phalanx
from phalanx.demo.data import CharDataModule
from phalanx.demo.model import CharTransformer
from phalanx.utilities.exceptions import MisconfigurationError

DEFAULT_MAX_STEPS = 900
DEFAULT_ROOT_DIR = os.path.join(tempfile.gettempdir(), "phalanx_demo")
NUM_VALIDATIONS = 6  # how many times validation runs over a whole demo
VAL_BATCHES = 4  # validation batches per validation (fixed windows: always the same text)
SAMPLE_PROMPT = "The "
SAMPLE_LENGTH = 200


def _write(message: str) -> None:
    # tqdm.write keeps an active progress bar intact; without a bar it is a plain print.
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        print(message, flush=True)
    else:
        tqdm.write(message, file=sys.stdout)
        sys.stdout.flush()


class ValLossRecorder(phalanx.Callback):
    """Records ``val_loss`` after every validation (and prints it on global rank 0)."""

    def __init__(self, verbose: bool = True) -> None:
        super().__init__()
        self.verbose = verbose
        self.val_losses: list[float] = []
        self.steps: list[int] = []

    def on_validation_end(self, trainer: Any, module: Any) -> None:
        if trainer.sanity_checking:
            return
        value = trainer.callback_metrics.get("val_loss")
        if value is None:
            return
        value = float(value)
        self.val_losses.append(value)
        self.steps.append(int(trainer.global_step))
        if self.verbose and trainer.is_global_zero:
            _write(f"step {trainer.global_step}: val_loss {value:.3f}")


def val_check_interval_for(max_steps: int, num_validations: int = NUM_VALIDATIONS) -> int:
    """Train batches between validations: about ``num_validations`` of them, if possible the last at ``max_steps``.

    Prefers a divisor of ``max_steps`` giving between ``num_validations`` and twice as many validations.
    """
    if max_steps <= 0:
        raise ValueError(f"max_steps must be positive, got {max_steps}")
    longest = max(1, math.ceil(max_steps / num_validations))
    shortest = max(1, math.ceil(max_steps / (2 * num_validations)))
    for interval in range(longest, shortest - 1, -1):
        if max_steps % interval == 0:
            return interval
    return longest


def run_demo(
    strategy: Any = "auto",
    devices: Any = "auto",
    accelerator: Any = "auto",
    precision: Any = "32-true",
    max_steps: int = DEFAULT_MAX_STEPS,
    seed: int = 42,
    default_root_dir: str | os.PathLike | None = None,
    enable_progress_bar: bool = True,
    batch_size: int = 32,
    verbose: bool = True,
) -> dict[str, Any]:
    """Train ``CharTransformer`` on the demo corpus; returns ``val_losses``, ``val_steps`` and ``sample``.

    ``sample`` is generated on global rank 0 only (an empty string on other ranks).
    """
    phalanx.seed_everything(seed)
    datamodule = CharDataModule(block_size=64, batch_size=batch_size)
    model = CharTransformer(vocab_size=datamodule.vocab_size, block_size=64)
    recorder = ValLossRecorder(verbose=verbose)
    interval = val_check_interval_for(max_steps)
    try:
        trainer = phalanx.Trainer(
            strategy=strategy,
            devices=devices,
            accelerator=accelerator,
            precision=precision,
            max_steps=max_steps,
            val_check_interval=interval,
            limit_val_batches=VAL_BATCHES,
            num_sanity_val_steps=0,
            enable_checkpointing=False,
            logger=False,
            callbacks=[recorder],
            enable_progress_bar=enable_progress_bar,
            default_root_dir=os.fspath(default_root_dir) if default_root_dir is not None else DEFAULT_ROOT_DIR,
        )
    except ValueError as err:
        raise MisconfigurationError(str(err)) from err
    trainer.fit(model, datamodule=datamodule)

    # Every rank generates the same sample from the same generator: a sharded model (FSDP) gathers its layers in
    # each forward pass, which needs all ranks; rank 0 prints it.
    device = next(model.parameters()).device
    if device.type == "xla":
        # torch has no random generator on XLA devices (and token-by-token sampling would compile a graph per length).
        device = torch.device("cpu")
        model.to(device)
    prompt = torch.tensor([datamodule.encode(SAMPLE_PROMPT)], dtype=torch.long, device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    out = model.generate(prompt, SAMPLE_LENGTH - len(SAMPLE_PROMPT), temperature=0.8, generator=generator)
    sample = datamodule.decode(out[0])
    if trainer.is_global_zero:
        if verbose:
            print("\n--- sample ---", flush=True)
            print(sample, flush=True)
            print("--------------", flush=True)
    return {
        "val_losses": list(recorder.val_losses),
        "val_steps": list(recorder.steps),
        "sample": sample,
    }
