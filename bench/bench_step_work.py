"""The work one training step does, per strategy at world size 1, against a hand-written loop: counts, not timings.

Per step of a tiny MLP on the CPU (see phalanx/testing/step_counts.py): Python function calls, aten ops (every level,
backward included) and host-device syncs (``.item()``/``float()``/``bool()`` on a tensor, ``.cpu()``, ``.tolist()``,
``.numpy()``, ``torch.cuda.synchronize``). The window of ``--steps`` steps starts after 2 warm-up steps and lies in
one epoch (no epoch end, validation or checkpoint inside it); with the default ``--steps 50`` it holds one
``log_every_n_steps=50`` logger write. Each configuration runs in its own process, in a gloo group of one process.

Rows: the hand-written loop (plain, under DistributedDataParallel, under ``fully_shard``) and phalanx with each
strategy, with the defaults off (no logger, bar, checkpointing, summary, nothing logged) and on (defaults, with
``self.log("loss", loss)`` and with ``prog_bar=True``). In the ``prog_bar`` rows the bar redraws at every step (its
0.1 s throttle is set to 0), the worst case: a redraw shows values copied to the host without waiting for the device,
so it adds no sync.
Usage: python bench/bench_step_work.py [--steps 50] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys

LOOPS = ["none", "ddp", "fsdp"]
STRATEGIES = ["single_device", "ddp", "fsdp", "model_parallel", "deepspeed_stage_2"]
MODES = [("off", "none"), ("on", "log"), ("on", "prog_bar")]


def configurations() -> list[str]:
    """Every row of the table, by name."""
    rows = [f"loop:{wrap}" for wrap in LOOPS]
    rows += [f"{strategy}:{defaults}:{log}" for strategy in STRATEGIES for defaults, log in MODES]
    return rows


def run_one(name: str, steps: int) -> dict:
    """Count configuration ``name`` in this process."""
    import torch

    from phalanx.testing.step_counts import StepWindow, count_fit, count_loop

    torch.set_num_threads(1)
    window = StepWindow(warmup=2, steps=steps)
    kind, _, rest = name.partition(":")
    if kind == "loop":
        if rest != "none":
            torch.distributed.init_process_group("gloo", rank=0, world_size=1)
        counts = count_loop(window, wrap=rest)
    else:
        defaults, _, log_mode = rest.partition(":")
        if log_mode == "prog_bar":
            from phalanx.callbacks import progress

            progress.REFRESH_INTERVAL = 0.0  # every step redraws the bar, whatever the step time
        counts = count_fit(kind, window, defaults=defaults == "on", log_mode=log_mode, default_root_dir=os.getcwd())
    return {"name": name, "python_calls": counts.python_calls, "aten_ops": counts.aten_ops, "syncs": counts.syncs,
            "sync_calls": counts.sync_calls}  # fmt: skip


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--only", nargs="*", help="rows to run, e.g. loop:none fsdp:off:none")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(run_one(args.one, args.steps)))
        return
    import tempfile

    rows = []
    for name in args.only or configurations():
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1")
        env.setdefault("PYTHONPATH", os.getcwd())
        with tempfile.TemporaryDirectory() as workdir:
            done = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--one", name, "--steps", str(args.steps)],
                cwd=workdir, env=env, capture_output=True, text=True,
            )  # fmt: skip
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode or not lines:
            print(f"{name}: failed\n{done.stderr[-2000:]}", file=sys.stderr)
            continue
        rows.append(json.loads(lines[-1][len("RESULT ") :]))
    by_name = {row["name"]: row for row in rows}
    base = by_name.get("loop:none")
    print(f"per training step, window of {args.steps} steps after 2 warm-up steps, world size 1, CPU")
    print("| configuration | Python calls | aten ops | syncs | x loop calls | x loop ops | syncs by kind |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for row in rows:
        ratios = ("-", "-")
        if base:
            ratios = (f"{row['python_calls'] / base['python_calls']:.2f}", f"{row['aten_ops'] / base['aten_ops']:.2f}")
        kinds = ", ".join(f"{kind} {count:g}" for kind, count in row["sync_calls"].items()) or "-"
        print(
            f"| {row['name']} | {row['python_calls']:.1f} | {row['aten_ops']:.1f} | {row['syncs']:.2f} |"
            f" {ratios[0]} | {ratios[1]} | {kinds} |"
        )


if __name__ == "__main__":
    main()
