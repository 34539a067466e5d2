"""A small GPT loop written for Lightning Fabric, ported to phalanx.Cohort (see README.md here for the line-by-line
guide): AdamW, warmup + cosine learning rate, gradient accumulation with no_backward_sync, clipping, periodic save,
resume and validation averaged with all_reduce.

python examples/fabric_port/gpt_port.py --strategy ddp --devices 2 --out runs
python examples/fabric_port/gpt_port.py --strategy fsdp --devices 2 --out runs --check
(--check: after the run, a fresh Cohort resumes from the middle checkpoint and must end with the same weights;
rank 0 writes OUT/result.json)
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import phalanx

VOCAB, CONTEXT, WIDTH = 16, 8, 32


class Tokens(Dataset):
    """Sequences counting up modulo VOCAB from a random start: the next token is learnable."""

    def __init__(self, n: int, seed: int) -> None:
        starts = torch.randint(0, VOCAB, (n, 1), generator=torch.Generator().manual_seed(seed))
        self.data = (starts + torch.arange(CONTEXT + 1)) % VOCAB

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[index, :-1], self.data[index, 1:]


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, WIDTH)
        self.positions = nn.Embedding(CONTEXT, WIDTH)
        self.block = nn.TransformerEncoderLayer(WIDTH, nhead=2, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
        return self.head(self.block(self.tokens(tokens) + self.positions(positions), src_mask=mask, is_causal=True))


def learning_rate(step: int, steps: int, peak: float = 3e-3, warmup: int = 2) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return 0.5 * peak * (1 + math.cos(math.pi * (step - warmup) / max(steps - warmup, 1)))


def loss_of(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


def validate(cohort: phalanx.Cohort, model: Any, loader: Any) -> float:
    total, count = torch.zeros((), device=cohort.device), torch.zeros((), device=cohort.device)
    with torch.no_grad():
        for x, y in loader:
            total += loss_of(model, x, y) * len(x)
            count += len(x)
    return float(cohort.all_reduce(total, reduce_op="sum") / cohort.all_reduce(count, reduce_op="sum"))


def train(cohort: phalanx.Cohort, args: argparse.Namespace, resume: str | None = None) -> dict[str, Any]:
    cohort.seed_everything(0)
    with cohort.init_module():
        module = TinyGPT()
    model, optimizer = cohort.setup(module, torch.optim.AdamW(module.parameters(), lr=3e-3, weight_decay=0.01))
    train_loader, val_loader = cohort.setup_dataloaders(
        DataLoader(Tokens(128, seed=1), batch_size=4, shuffle=True), DataLoader(Tokens(32, seed=2), batch_size=8)
    )
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 0}
    if resume is not None:
        cohort.load(resume, state)
    step, losses, validation = state["step"], [], []
    epoch, skip = divmod(step * args.accumulate, len(train_loader))
    train_loader.set_epoch(epoch)
    micro = 0
    while step < args.steps:
        for index, (x, y) in enumerate(train_loader):
            if index < skip:
                continue
            micro += 1
            window_ends = micro % args.accumulate == 0
            with cohort.no_backward_sync(model, enabled=not window_ends):
                loss = loss_of(model, x, y)
                cohort.backward(loss / args.accumulate)
            if not window_ends:
                continue
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, args.steps)
            if args.max_norm:
                cohort.clip_gradients(model, optimizer, max_norm=args.max_norm)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            losses.append(float(loss.detach()))
            if step % args.save_every == 0:
                validation.append(validate(cohort, model, val_loader))
                cohort.save(
                    Path(args.out) / f"step-{step}.ckpt", {"model": model, "optimizer": optimizer, "step": step}
                )
            if step == args.steps:
                break
        skip = 0
    weights = {name: value.detach().float().clone() for name, value in cohort.strategy.module_state_dict().items()}
    return {"losses": losses, "validation": validation, "weights": weights}


def run(cohort: phalanx.Cohort, args: argparse.Namespace) -> None:
    straight = train(cohort, args)
    result: dict[str, Any] = {"losses": straight["losses"], "validation": straight["validation"]}
    if args.check:
        fresh = phalanx.Cohort(strategy=args.strategy, devices=args.devices, accelerator="cpu")
        fresh.launch()
        middle = str(Path(args.out) / f"step-{args.save_every}.ckpt")
        resumed = train(fresh, args, resume=middle)
        if cohort.is_global_zero:
            result["resume_difference"] = max(
                float((resumed["weights"][name] - value).abs().max()) for name, value in straight["weights"].items()
            )
    cohort.print(json.dumps({key: value for key, value in result.items() if key != "losses"}))
    if cohort.is_global_zero:
        (Path(args.out) / "result.json").write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="single_device")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--save-every", type=int, default=6)
    parser.add_argument("--max-norm", type=float, default=1.0, help="0: no clipping (DeepSpeed clips in its engine)")
    parser.add_argument("--out", default="fabric_port_runs")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    cohort = phalanx.Cohort(strategy=args.strategy, devices=args.devices, accelerator="cpu")
    cohort.launch(run, args)


if __name__ == "__main__":
    main()
