#!/usr/bin/env bash
# The GPU tier in one command, from the repository root: bash tests/gpu/run.sh [pytest options]
# Every test skips without CUDA; the world-size-2 cases run only where two GPUs are visible.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python)}"
exec "$PYTHON" -m pytest tests/gpu -q -p no:randomly "$@"
