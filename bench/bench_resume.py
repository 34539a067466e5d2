"""Resuming a run: a whole ``trainer.fit(model, ckpt_path=...)`` against loading the same state by hand.

A model of ``--mib`` MiB of float32 weights (``Linear(2048, 2048)`` layers) with AdamW, whose checkpoint (weights and
both Adam moments, about 3x ``--mib``) phalanx wrote after one step. Each measurement runs in a fresh child process:

- "by hand": ``torch.load(path, weights_only=True)``, then ``load_state_dict`` on the model and the optimizer;
- "fit, resumed": ``Trainer(...).fit(model, ckpt_path=path)`` until the first training batch starts;
- "fit, fresh": the same fit without ``ckpt_path``, so that "resumed - fresh" is what resuming adds to a fit.

The Trainer keeps its defaults except the logger, progress bar and checkpointing (which would only add their own
set-up to both fits). "Peak above" is the child's peak resident memory (``VmHWM``), at the end of the load or when
the first batch starts, minus its resident memory just before the timed part, the model (and the hand-written loop's
optimizer) already built. Rounds are interleaved; each figure is the best of
``--repeats``, the file system synced before each child.
Usage: python bench/bench_resume.py [--mib 256] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, os, sys, time, warnings
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import phalanx

op, mib, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
torch.set_num_threads(1)
warnings.filterwarnings("ignore")
WIDTH = 2048


def status(field):
    with open("/proc/self/status") as handle:
        return next(int(line.split()[1]) * 1024 for line in handle if line.startswith(field))


class Wide(phalanx.TrainingModule):
    def __init__(self):
        super().__init__()
        count = max(1, mib * 2**20 // (4 * WIDTH**2))
        self.layers = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(count)])

    def training_step(self, batch, batch_idx):
        return self.layers(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class FirstBatch(phalanx.Callback):
    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if not hasattr(self, "at"):
            self.at, self.peak = time.perf_counter(), status("VmHWM")


def trainer(max_steps, *callbacks):
    return phalanx.Trainer(
        accelerator="cpu", max_steps=max_steps, logger=False, enable_progress_bar=False,
        enable_checkpointing=False, callbacks=list(callbacks), default_root_dir=os.path.dirname(path),
    )


loader = DataLoader(TensorDataset(torch.randn(8, WIDTH)), batch_size=4)
torch.optim.AdamW(nn.Linear(1, 1).parameters())  # torch's first optimizer imports torch._dynamo (1 s): not a resume's
model = Wide()
result = {}
if op == "write":
    run = trainer(1)
    run.fit(model, loader)
    run.save_checkpoint(path)
else:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3) if op == "by hand" else None
    with open("/proc/self/clear_refs", "w") as handle:  # VmHWM starts again from the current resident size
        handle.write("5")
    before = status("VmRSS")
    start = time.perf_counter()
    if op == "by hand":
        checkpoint = torch.load(path, weights_only=True, map_location="cpu")
        model.load_state_dict(checkpoint["state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer_states"][0])
        del checkpoint
        result["seconds"] = time.perf_counter() - start
        result["peak_above"] = status("VmHWM") - before
        assert optimizer.state, "the optimizer state was not loaded"
    else:
        first = FirstBatch()
        run = trainer(2, first)
        run.fit(model, loader, ckpt_path=path if op == "fit, resumed" else None)
        result["seconds"], result["peak_above"] = first.at - start, first.peak - before
        assert run.global_step == 2, run.global_step
print("RESULT " + json.dumps(result))
"""

OPS = ["by hand", "fit, resumed", "fit, fresh"]


def run(op: str, mib: int, path: str) -> dict[str, float]:
    environment = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    child = subprocess.run(
        [sys.executable, "-c", CHILD, op, str(mib), path],
        capture_output=True,
        text=True,
        env=environment,
        cwd=os.path.dirname(
            path
        ),  # "-c" puts the working directory first on sys.path: it must not hold another phalanx
    )
    line = next((line for line in child.stdout.splitlines() if line.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{op} failed:\n{child.stderr[-3000:]}")
    return json.loads(line[len("RESULT ") :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d %H:%M')}")
    results: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as directory:
        path = os.path.join(directory, "state.ckpt")
        run("write", args.mib, path)
        size = os.path.getsize(path) / 2**30
        for _ in range(args.repeats):
            for op in OPS:
                os.sync()
                results.setdefault(op, []).append(run(op, args.mib, path))
    best = {op: min(r["seconds"] for r in runs) for op, runs in results.items()}
    print(f"\n{args.mib} MiB of weights, a {size:.2f} GiB checkpoint, best of {args.repeats}")
    for op, runs in results.items():
        peak = max(r["peak_above"] for r in runs) / 2**30
        print(f"{op:<14} {best[op]:7.3f} s | peak above {peak:+.2f} GiB")
    added = best["fit, resumed"] - best["fit, fresh"]
    print(f"resuming adds {added:.3f} s to a fit: {added / best['by hand']:.2f}x loading by hand")


if __name__ == "__main__":
    main()
