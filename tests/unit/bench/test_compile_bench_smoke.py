"""``bench/bench_compile.py`` (the CPU twin of the GPU benchmark's compiled runs) runs end to end, with the eager
backend and a few steps, so that a change cannot leave it broken; ``bench/RESULTS.md`` records its real runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
RUNS = ["loop", "loop_compiled_model", "loop_compiled_blocks", "phalanx", "phalanx_compiled"]
RUNS += ["ddp_loop_compiled_model", "ddp", "ddp_compiled"]
#: Graphs compiled in the last round (training only: the defaults are off, so nothing validates).
GRAPHS = {name: 0 if name in ("loop", "phalanx", "ddp") else 1 for name in RUNS}


def test_the_compile_benchmark_times_every_run_and_judges_the_targets(tmp_path: Path) -> None:
    command = [sys.executable, str(ROOT / "bench/bench_compile.py"), "--rounds", "2", "--steps", "2", "--warmup", "1"]
    command += ["--backend", "eager", "--runs", ",".join(RUNS)]
    environment = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, env=environment, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "shape=tiny (12 blocks, width 32" in done.stdout
    for name, graphs in GRAPHS.items():
        line = re.search(rf"^{name} +best +([\d.]+) ms/step .* graphs (\d+) +graph breaks (\d+)$", done.stdout, re.M)
        assert line, f"{name} missing from:\n{done.stdout}"
        assert float(line[1]) > 0 and (int(line[2]), int(line[3])) == (graphs, 0), line[0]
    baselines = ("faster compiled loop", "phalanx", "faster compiled DDP loop", "ddp")
    for run, baseline in zip(("phalanx_compiled",) * 2 + ("ddp_compiled",) * 2, baselines):
        assert re.search(rf"^{run} / {baseline}: [\d.]+ \(target <= [\d.]+: (met|missed)\)$", done.stdout, re.M)
    assert list(tmp_path.iterdir()) == [], "the benchmark left files behind"
