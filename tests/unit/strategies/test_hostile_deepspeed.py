"""Hostile DeepSpeed checkpoint directories against every reader, each run in a child with an address-space limit and
an alarm (tests/bounded_child.py): file names and world sizes that claim more ranks than there are files, tensors
that claim more elements than their bytes, the same bytes named by many tensors, FIFOs where files are expected.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")
pytest.importorskip("deepspeed")

import test_deepspeed_checkpoint_attacks as attacks  # noqa: E402
from bounded_child import Outcome, run_bounded  # noqa: E402
from test_deepspeed_checkpoint_attacks import MODEL_FILE, OPTIM_FILE, READERS, _copy  # noqa: E402

from phalanx.plugins.io.formats.deepspeed import load_deepspeed_checkpoint_as_full  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore:Detected pickle protocol 4"),
    pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX's"),
]

base = attacks.base  # the module's fixtures: its directory, and the two processes that saved it
_two_processes = attacks._two_processes

CLAIM = 1 << 29  # elements a hostile tensor claims: more than the child's address-space headroom
ALIASES = 12000  # module entries made of the same stored bytes (small ones: each copy stays on one thread)


def _tamper(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    content = torch.load(path, weights_only=False)  # written by this test's fixture with DeepSpeed's own classes
    change(content)
    torch.save(content, path)


def _aliased_module(module: dict[str, Any]) -> None:
    shared = torch.zeros(1 << 13, dtype=torch.bfloat16)  # one tensor object: torch.save writes its bytes once
    module.update({f"alias.{index}": shared for index in range(ALIASES)})


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


# name -> (the attack on a copy of the directory, what the refusal says, the readers that meet it)
ALL = ["load_deepspeed_checkpoint_as_full", "TorchCheckpointIO", "Trainer.fit(ckpt_path=path)", "cli consolidate"]
ATTACKS: dict[str, tuple[Callable[[Path], None], str, list[str]]] = {
    "an empty partition file naming rank 99999999999": (
        lambda d: (d / "checkpoint" / "zero_pp_rank_99999999999_mp_rank_00_optim_states.pt").write_bytes(b""),
        r"names rank 99999999999, but only 3 partition files are present",
        [*ALL, "resume through the engine"],
    ),
    "dp_world_size 2**40 in the model states": (
        lambda d: _tamper(d / MODEL_FILE, lambda states: states.update(dp_world_size=1 << 40)),
        r"saved by 1099511627776 processes, 2 partitions present",
        ALL,
    ),
    "a one-element master-weight partition expanded to 2**29": (
        lambda d: _tamper(
            d / OPTIM_FILE,
            lambda states: states["optimizer_state_dict"]["single_partition_of_fp32_groups"].__setitem__(
                0, torch.zeros(1).expand(CLAIM)
            ),
        ),
        r"claims 536870912 elements",
        [*ALL, "resume through the engine"],
    ),
    "one bfloat16 tensor named by 12000 module entries": (
        lambda d: _tamper(d / MODEL_FILE, lambda states: _aliased_module(states["module"])),
        r"Refusing to consolidate .* \(4 times the \d+ bytes its files hold\)",
        ALL,
    ),
    "a partition file that is a FIFO": (
        lambda d: _fifo(d / OPTIM_FILE),
        r"named pipe \(FIFO\), not a regular file",
        [*ALL, "resume through the engine"],
    ),
    "a 'latest' file that is a FIFO": (
        lambda d: (_tamper_tag(d), _fifo(d / "latest")),
        r"named pipe \(FIFO\), not a regular file|latest is missing or not a regular file",
        ALL,
    ),
}


def _tamper_tag(directory: Path) -> None:
    """The state file names no tag, so that readers look for it in 'latest'."""
    from phalanx.plugins.io.formats.deepspeed import STATE_FILE

    _tamper(directory / STATE_FILE, lambda state: state["deepspeed"].update(tag=None))


def _assert_refused(outcome: Outcome, message: str) -> None:
    assert outcome.error in ("CheckpointError", "UnsafeCheckpointError", "CliError"), str(outcome)
    assert re.search(message, outcome.message), str(outcome)


CASES = [(attack, reader) for attack, (_, _, readers) in ATTACKS.items() for reader in readers]


@pytest.mark.parametrize(("attack", "reader"), CASES, ids=[f"{a}-{r}" for a, r in CASES])
def test_a_hostile_deepspeed_directory_is_refused_within_bounded_memory_and_time(base, tmp_path, attack, reader):
    directory = _copy(base, tmp_path)
    make, message, _ = ATTACKS[attack]
    make(directory)
    _assert_refused(run_bounded(lambda: READERS[reader](directory, tmp_path)), message)


def test_the_untouched_directory_consolidates_within_its_budget(base, tmp_path):
    whole = load_deepspeed_checkpoint_as_full(_copy(base, tmp_path))
    assert whole["state_dict"] and whole["optimizer_states"]
