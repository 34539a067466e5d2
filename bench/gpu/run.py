"""The GPU benchmark of issues 26 and 37 in one command: ``python bench/gpu/run.py`` (under 8 minutes on one H100).

Two GPT-2-small-shaped transformers (``--shape``: "project", 163 M parameters, vocabulary 50257, tokens made on the
device; "independent", written as issue 37's independent benchmark wrote it, vocabulary 50304, batches from a CPU
DataLoader; both T=1024, B=8, bf16-mixed, fused AdamW) under the hand-written loop, phalanx (defaults off and on) and
Lightning (when ``import lightning`` works, project shape), interleaved; compiled: the loop compiled whole and per
block, and phalanx's ``compile=True``; phalanx's strategies at world size 1 (and 2 with two GPUs, project shape).
Each run is a fresh process (``worker.py``). Writes one JSON line per run to ``--out`` and appends a dated table to
``bench/RESULTS.md``. ``--device cpu --tiny`` is the CI smoke mode (small models, a few steps).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from report import append_table  # the script's folder is on sys.path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent

CORE = ("loop", "phalanx", "phalanx_defaults", "lightning")
STRATEGIES = ("ddp", "fsdp", "model_parallel", "deepspeed_stage_2")
#: The loop compiled whole (``model.compile()``, the loss outside) and per block; phalanx with ``compile=True``.
COMPILED = ("loop_compiled_model", "loop_compiled_blocks", "phalanx_compiled")
SHAPES = ("project", "independent")
#: Runs only on the project's shape: Lightning and the strategies (issue 26 measured them; the shapes differ little).
PROJECT_ONLY = ("lightning", *STRATEGIES)


def run_spec(name: str, args: argparse.Namespace, devices: int = 1, shape: str = "project") -> dict[str, Any]:
    """What a run named ``name`` (e.g. "phalanx_defaults", "fsdp_ws2", "loop_compiled_blocks") trains with."""
    unit = next((unit for unit in ("model", "blocks") if name.endswith(f"_compiled_{unit}")), None)
    compiled = name.endswith("_compiled") or unit is not None
    base = name.removesuffix(f"_compiled_{unit}").removesuffix("_ws2").removesuffix("_compiled")
    base = base.removesuffix("_defaults")
    kind = base if base in ("loop", "lightning") else "phalanx"
    steps, warmup, profile = (args.steps, args.warmup, args.profile_steps)
    if compiled:
        warmup += args.compile_warmup  # the first compiled steps include compilation and any recompiles
    return {
        "name": name,
        "shape": shape,
        "kind": kind,
        "strategy": base if kind == "phalanx" and base != "phalanx" else "single_device",
        "devices": devices,
        "compiled": compiled,
        "unit": unit,
        "defaults": name.endswith("_defaults"),
        "device": args.device,
        "tiny": args.tiny,
        "steps": steps,
        "warmup": warmup,
        "profile_steps": profile,
    }


def plan(args: argparse.Namespace, gpus: int) -> list[dict[str, Any]]:
    """The runs in order: per repeat, the core and compiled runs of every shape interleaved (A B C A' B' C' ...); the
    strategies after the first repeat, so that the time guard cuts a repeat rather than a comparison; then world
    size 2."""
    shapes = args.shape.split(",")
    if args.runs:
        names = args.runs.split(",")
        valid = [*CORE, *COMPILED, *STRATEGIES, *(f"{name}_ws2" for name in STRATEGIES)]
        unknown = [name for name in names if name not in valid]
        if unknown:
            raise SystemExit(f"--runs names unknown runs {unknown}. Valid run names: {', '.join(valid)}.")
        return [
            run_spec(name, args, 2 if name.endswith("_ws2") else 1, shape)
            for shape in shapes
            for name in names
            if shape == "project" or name.removesuffix("_ws2") not in PROJECT_ONLY
        ]
    core = [name for name in CORE if name != "lightning" or importlib.util.find_spec("lightning") is not None]
    strategies = [s for s in STRATEGIES if not s.startswith("deepspeed") or importlib.util.find_spec("deepspeed")]
    one_repeat = [
        run_spec(name, args, shape=shape)
        for shape in shapes
        for name in [*core, *COMPILED]
        if shape == "project" or name not in PROJECT_ONLY
    ]
    specs = one_repeat + [run_spec(name, args) for name in strategies if "project" in shapes]
    specs += one_repeat * (args.repeats - 1)
    if gpus >= 2 and "project" in shapes:
        specs += [run_spec(f"{name}_ws2", args, devices=2) for name in strategies]
    return specs


def run_one(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Start ``worker.py`` for ``spec`` in a fresh process and return its RESULT line (or a failure record)."""
    command = [sys.executable, str(HERE / "worker.py"), json.dumps(spec)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    began = time.monotonic()
    # A session of its own, so a timeout also ends the ranks a multi-GPU run started.
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT, start_new_session=True
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        return {**spec, "status": "timeout", "reason": f"over {timeout:.0f} s", "stderr_tail": stderr[-1500:]}
    wall = round(time.monotonic() - began, 1)
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            return {**json.loads(line.removeprefix("RESULT ")), "wall_s": wall}
    return {**spec, "status": "failed", "returncode": process.returncode, "wall_s": wall, "stderr_tail": stderr[-1500:]}


def gpu_count(device: str) -> int:
    if device != "cuda":
        return 0
    import torch

    return torch.cuda.device_count()


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="small models and 3 timed steps (the CI smoke mode)")
    parser.add_argument(
        "--shape", default=",".join(SHAPES), help=f"comma-separated model shapes, from {', '.join(SHAPES)}"
    )
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run (default 30; 3 with --tiny)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 10; 1 with --tiny)")
    parser.add_argument("--compile-warmup", type=int, default=10, help="extra warm-up steps for compiled runs")
    parser.add_argument("--profile-steps", type=int, default=None, help="profiled steps after the window (default 3)")
    parser.add_argument("--repeats", type=int, default=2, help="interleaved repeats of the core and compiled runs")
    parser.add_argument(
        "--runs", default="", help="comma-separated run names instead of the full plan, e.g. loop,phalanx"
    )
    parser.add_argument("--budget", type=float, default=420.0, help="seconds; runs that would start later are skipped")
    parser.add_argument("--run-timeout", type=float, default=180.0, help="seconds one run may take")
    parser.add_argument("--out", type=Path, default=HERE / "results.jsonl")
    parser.add_argument("--results-md", type=Path, default=ROOT / "bench" / "RESULTS.md")
    args = parser.parse_args(argv)
    unknown = [shape for shape in args.shape.split(",") if shape not in SHAPES]
    if unknown:
        raise SystemExit(f"--shape names unknown shapes {unknown}. Valid shapes: {', '.join(SHAPES)}.")
    for name, full, tiny in (("steps", 30, 3), ("warmup", 10, 1), ("profile_steps", 3, 1)):
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)
    if args.tiny:
        args.compile_warmup = min(args.compile_warmup, 1)
    return args


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse(argv)
    specs = plan(args, gpu_count(args.device))
    began = time.monotonic()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    results = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as out:
        for spec in specs:
            left = args.budget - (time.monotonic() - began)
            if left < 20:
                result = {**spec, "status": "skipped", "reason": f"time guard: {args.budget:.0f} s budget spent"}
            else:
                result = run_one(spec, min(args.run_timeout, left))
            result["benchmark_started"] = started  # tells this invocation's lines apart from earlier ones in --out
            print(
                json.dumps({k: result.get(k) for k in ("name", "shape", "status", "ms_per_step", "wall_s")}), flush=True
            )
            out.write(json.dumps(result) + "\n")
            out.flush()
            results.append(result)
    skipped = sum(r["status"] == "skipped" for r in results)
    if skipped:
        print(f"time guard: {skipped} of {len(results)} runs skipped after {args.budget:.0f} s", flush=True)
    append_table(results, args.results_md)
    return results


if __name__ == "__main__":
    main()
