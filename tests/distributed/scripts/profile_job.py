"""A two-process fit with a profiler and a ThroughputMonitor: each rank writes its own report (and trace).

Usage: python profile_job.py OUT_DIR STRATEGY PROFILER, STRATEGY 'ddp' or 'ddp_spawn', PROFILER 'simple' or 'pytorch'.
The reports go to OUT_DIR/profiles, the CSV logs to OUT_DIR/logs; each rank writes rank{N}.json with its log_dir.
"""

import sys
from pathlib import Path

from ddp_common import IndexedRegression, Net
from torch.utils.data import DataLoader

import phalanx
from phalanx.callbacks import ThroughputMonitor
from phalanx.loggers import CSVLogger
from phalanx.profilers import PyTorchProfiler, SimpleProfiler

BATCH = 4


def batch_size(batch) -> int:
    return batch[0].size(0)  # a module-level function: ddp_spawn pickles the callbacks for its workers


def main() -> None:
    out, strategy, kind = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    profiles = out / "profiles"
    profiler = SimpleProfiler(profiles, "perf") if kind == "simple" else PyTorchProfiler(profiles, "perf")
    trainer = phalanx.Trainer(
        strategy=strategy,
        devices=2,
        accelerator="cpu",
        max_steps=6,
        log_every_n_steps=1,
        logger=CSVLogger(save_dir=out, name="logs"),
        profiler=profiler,
        callbacks=[ThroughputMonitor(batch_size_fn=batch_size, window_size=2)],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(Net(), DataLoader(IndexedRegression(n=48), batch_size=BATCH))


if __name__ == "__main__":
    main()
