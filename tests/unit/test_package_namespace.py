"""What ``import phalanx`` shows a user: the public API only, ``phalanx.utilities``' rank-zero helpers, and no
missing-NumPy warning from torch (NumPy is a dependency)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

PUBLIC = ["Callback", "Cohort", "DataModule", "Trainer", "TrainingModule", "seed_everything"]
SUBPACKAGES = ["accelerators", "callbacks", "loggers", "plugins", "profilers", "strategies", "utilities"]
HELPERS = ["Any", "TYPE_CHECKING", "annotations", "importlib", "typing"]


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize(
    "touch",
    ["", "phalanx.Trainer", "phalanx.callbacks.ModelCheckpoint", "phalanx.TrainingModule; phalanx.Cohort"],
)
def test_dir_shows_the_public_api_only(touch):
    code = f"import phalanx\n{touch}\nprint(' '.join(n for n in dir(phalanx) if not n.startswith('__')))"
    assert _run(code).split() == sorted(PUBLIC + SUBPACKAGES)


@pytest.mark.parametrize("name", HELPERS)
def test_import_helpers_are_not_attributes(name):
    import phalanx

    assert not hasattr(phalanx, name)


def test_import_phalanx_still_loads_nothing_heavy():
    code = "import sys, phalanx; print(sorted(m for m in ('torch', 'numpy', 'typing_extensions') if m in sys.modules))"
    assert "torch" not in _run(code)


@pytest.mark.parametrize(
    "statement",
    [
        "from phalanx.utilities import rank_zero_only",
        "from phalanx.utilities import rank_zero_info, rank_zero_warn, rank_zero_debug",
        "from phalanx.utilities.rank_zero import rank_zero_only",
        "import phalanx; rank_zero_only = phalanx.utilities.rank_zero_only",
    ],
)
def test_rank_zero_only_imports_as_lightning_users_write_it(statement):
    namespace: dict = {}
    exec(statement, namespace)
    from phalanx.utilities.rank_zero import rank_zero_only

    assert namespace.get("rank_zero_only", rank_zero_only) is rank_zero_only


def test_numpy_is_a_dependency():
    text = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    dependencies = text.split("dependencies = [", 1)[1].split("]", 1)[0]
    assert '"numpy' in dependencies
