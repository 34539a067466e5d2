"""Fault tolerance, side by side in one run: committed samples/s of ``ddp_ft`` under a failure every N s against a
failure-free run, the time from a replica's restart to its first committed step (by part), and today's path (``ddp``
restarted whole by torchrun, resuming with ``ckpt_path="auto"``) under the same failure schedule.

Three replica groups of one process (``ddp_ft``) or one 3-process ``ddp`` job, an MLP of two ``--hidden`` layers,
``--batch`` samples per process and step, SGD with momentum, CPU and gloo, one thread per process. A failure is a
SIGKILL of a random process every ``--fail-every`` seconds once training runs, postponed until a step was committed
since the previous failure (none in the last third of the steps: a group restarted after its peers finished has
nobody to heal from). For ``ddp_ft`` the lighthouse commits steps
with all 3 groups (``--min-replicas 3``, as the chaos tier: the survivors wait for the restart, every sample is
trained once) or with 2 (the survivors train on, the killed group's share of those steps is skipped); ``ddp``
loses every step since its last save (every ``--save-every`` steps) and restarts every process.
Committed samples/s: the samples of the steps the run kept, over the time from its first to its last step.
Usage: python bench/bench_fault_tolerance.py [--steps 1500] [--fail-every 30] [--hidden 512] [--batch 128]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "distributed" / "scripts"
sys.path[:0] = [path for path in (str(ROOT / "tests"), str(SCRIPTS)) if path not in sys.path]

import ft_chaos  # noqa: E402
from phalanx_distributed import clean_environment  # noqa: E402

#: The parts of a restart, each from the journal event before it (ft_chaos_job.py writes them).
PARTS = (("process start", "started"), ("import", "start"), ("set-up and quorum", "quorum"))
PARTS += (("reconfigure", "transfer start"), ("state transfer", "transfer end"), ("first step", "commit"))


def _lives(records: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    lives: list[list[dict[str, Any]]] = []
    for record in records:
        if record["event"] == "start":
            lives.append([])
        if lives:
            lives[-1].append(record)
    return lives


def _restart_parts(chaos: ft_chaos.Chaos, out: Path) -> list[dict[str, float]]:
    """For each restarted life that committed a step: seconds of each part, from its start to its first commit."""
    parts = []
    for group in range(3):
        starts = [s["time"] for s in chaos.starts if s["group"] == group]
        for life in _lives(ft_chaos.journal(out, group)):
            first = {}
            for record in life:
                first.setdefault(record["event"], record["time"])
            first["started"] = life[0]["started"]
            spawned = max((t for t in starts if t <= first["started"]), default=None)
            if spawned is None or spawned == starts[0] or "commit" not in first or "transfer end" not in first:
                continue  # the first life, or a life killed before it committed
            times, previous, row = first, spawned, {}
            for name, event in PARTS:
                row[name] = times[event] - previous
                previous = times[event]
            row["total"] = times["commit"] - spawned
            parts.append(row)
    return parts


def run_ft(out: Path, args: argparse.Namespace, failures: bool) -> dict[str, Any]:
    """One ``ddp_ft`` run of 3 groups; committed samples/s and, under failures, the restarts' parts."""
    out.mkdir(parents=True)
    every = (args.fail_every, args.fail_every) if failures else None
    chaos = ft_chaos.run_chaos(
        out,
        args.steps,
        args.seed,
        max_kills=args.max_kills if failures else 0,
        deadline_s=args.deadline,
        job_args=(str(args.hidden), str(args.batch)),
        kill_every_s=every,
        min_replicas=args.min_replicas,
    )
    return summarize_ft(out, chaos, args.batch)


def summarize_ft(out: Path, chaos: ft_chaos.Chaos, batch: int) -> dict[str, Any]:
    """Committed samples/s of a finished chaos run in ``out`` and the parts of each of its restarts."""
    commits: dict[int, tuple[int, float]] = {}
    for group in range(3):
        for record in ft_chaos.journal(out, group):
            if record["event"] == "commit":
                commits.setdefault(record["step"], (record["participants"], record["time"]))
    times = [t for _, t in commits.values()]
    samples = sum(participants for participants, _ in commits.values()) * batch
    return {
        "samples_per_s": samples / (max(times) - min(times)),
        "kills": len(chaos.kills),
        "seconds": chaos.seconds,
        "restarts": _restart_parts(chaos, out),
    }


def run_ddp(out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One 3-process ``ddp`` job under torchrun, restarted whole after each kill, resuming with ckpt_path="auto"."""
    out.mkdir(parents=True)
    environment = clean_environment(OMP_NUM_THREADS="1")
    environment["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), str(SCRIPTS), str(ROOT)])
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun), "--standalone", "--nproc-per-node", "3", "--max-restarts", "1000"]
    command += ["--monitor-interval", "0.2", str(ROOT / "bench" / "fault_tolerance" / "ddp_job.py"), str(out)]
    command += [str(args.steps), str(args.hidden), str(args.batch), str(args.save_every)]
    rng, begin, kills, killed = random.Random(args.seed), time.monotonic(), 0, set()
    journal = out / "ddp.jsonl"
    with (out / "torchrun.log").open("w") as log:
        job = subprocess.Popen(command, env=environment, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        next_kill, killed_life = None, None
        try:
            while job.poll() is None:
                if time.monotonic() - begin > args.deadline:
                    raise TimeoutError(f"the ddp baseline did not finish within {args.deadline} s")
                records = _records(journal)
                if records and next_kill is None:
                    next_kill = time.monotonic() + args.fail_every
                # A kill waits for the restarted job's first step (a rank 0 of a new life): failures that come faster
                # than a restart would never let the job finish.
                training = bool(records) and records[-1]["pid"] != killed_life
                due = next_kill is not None and time.monotonic() >= next_kill and kills < args.max_kills
                if due and training and records[-1]["step"] < args.steps * 2 // 3:
                    kills += _kill_rank(out, rng.randrange(3), killed)
                    next_kill, killed_life = time.monotonic() + args.fail_every, records[-1]["pid"]
                time.sleep(0.05)
        finally:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
            job.wait(timeout=60)
    if job.returncode != 0:
        raise AssertionError(
            f"the ddp baseline failed ({job.returncode}): {(out / 'torchrun.log').read_text()[-4000:]}"
        )
    records = _records(journal)
    times = [r["time"] for r in records]
    lost = len(records) - len({r["step"] for r in records})
    return {
        "samples_per_s": args.steps * 3 * args.batch / (max(times) - min(times)),
        "kills": kills,
        "seconds": time.monotonic() - begin,
        "steps_trained_again": lost,
        "steps": len({r["step"] for r in records}),
        "lives": len({r["pid"] for r in records}),
    }


def _records(journal: Path) -> list[dict[str, Any]]:
    """The ddp baseline's steps so far (a line torn by a kill is left out)."""
    records = []
    for line in journal.read_text().splitlines() if journal.exists() else []:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def _kill_rank(out: Path, rank: int, killed: set[int]) -> int:
    """SIGKILL the current process of ``rank`` (1), unless it is one killed before and not yet replaced (0)."""
    try:
        pid = int((out / f"rank{rank}.pid").read_text())
        if pid in killed:
            return 0
        os.kill(pid, signal.SIGKILL)
    except (OSError, ValueError):
        return 0
    killed.add(pid)
    return 1


def report(args: argparse.Namespace, results: dict[str, dict[str, Any]]) -> str:
    """The figures, as lines for bench/RESULTS.md."""
    base = results.get("ddp_ft, no failure", next(iter(results.values())))["samples_per_s"]
    lines = [
        f"{args.steps} steps, MLP 4->{args.hidden}->{args.hidden}->1, batch {args.batch} per process, 3 processes,"
        f" a failure every {args.fail_every} s; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs",
    ]
    for name, result in results.items():
        rate = result["samples_per_s"]
        lines.append(
            f"  {name:<30} {rate:9.0f} committed samples/s  ratio {rate / base:.3f}"
            f"  ({result['kills']} kills, {result['seconds']:.0f} s)"
        )
    restarts = results.get("ddp_ft, failures", {}).get("restarts")
    if restarts:
        lines.append(f"  ddp_ft restart to first committed step, median of {len(restarts)} restarts:")
        for name in [name for name, _ in PARTS] + ["total"]:
            lines.append(f"    {name:<18} {statistics.median(r[name] for r in restarts):6.2f} s")
    if "ddp restarted whole, failures" in results:
        again = results["ddp restarted whole, failures"]["steps_trained_again"]
        lines.append(f"  ddp steps trained again after its restarts (since the last save): {again}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--fail-every", type=float, default=30.0)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--save-every", type=int, default=50, help="steps between the ddp baseline's checkpoints")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-replicas", type=int, default=3, help="groups a ddp_ft step commits with (2: no wait)")
    parser.add_argument("--max-kills", type=int, default=10_000, help="at most this many failures per run")
    parser.add_argument("--deadline", type=float, default=1800.0, help="seconds any one run may take")
    parser.add_argument("--modes", default="ft_free,ft_failures,ddp", help="the runs to make, of the default's")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    os.environ["OMP_NUM_THREADS"] = "1"  # the groups' environment: one thread per process, as the baseline's ranks
    print(f"{platform.processor() or platform.machine()}, python {platform.python_version()}", flush=True)
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if "ft_free" in modes:
            results["ddp_ft, no failure"] = run_ft(Path(tmp) / "ft_free", args, failures=False)
        if "ft_failures" in modes:
            results["ddp_ft, failures"] = run_ft(Path(tmp) / "ft_chaos", args, failures=True)
        if "ddp" in modes:
            results["ddp restarted whole, failures"] = run_ddp(Path(tmp) / "ddp", args)
    print(report(args, results), flush=True)
    return results


if __name__ == "__main__":
    main()
