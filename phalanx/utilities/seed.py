"""Seeding and capturing/restoring the random number generators."""

from __future__ import annotations

import logging
import os
import random
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from phalanx.utilities.rank_zero import rank_zero_only, rank_zero_warn

_MAX_SEED = 2**32 - 1
#: Where seed_everything leaves its seed and workers flag: phalanx's names and Lightning's (which spawned processes,
#: user code and Lightning-era tools read).
SEED_VARIABLES = ("PHALANX_GLOBAL_SEED", "PL_GLOBAL_SEED")
WORKERS_VARIABLES = ("PHALANX_SEED_WORKERS", "PL_SEED_WORKERS")
log = logging.getLogger("phalanx")


def seed_everything(seed: int | None = None, workers: bool = False, verbose: bool = True) -> int:
    """Seed Python's, NumPy's (if imported) and torch's generators and return the seed.

    Without ``seed`` it is read from ``PL_GLOBAL_SEED`` (or ``PHALANX_GLOBAL_SEED``), else it is 0, with a warning, as
    in Lightning 2.6. The seed and ``workers`` are left in ``PHALANX_GLOBAL_SEED`` / ``PL_GLOBAL_SEED`` and
    ``PHALANX_SEED_WORKERS`` / ``PL_SEED_WORKERS`` (spawned processes and ``reset_seed`` read them). With
    ``workers=True``, dataloader workers seeded by phalanx derive a distinct, reproducible seed from this seed, their
    worker id and the global rank. ``verbose`` logs "Seed set to ..." (INFO, logger ``phalanx``) on every process.
    """
    if seed is None:
        seed = _seed_from_environment(verbose)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if not 0 <= seed <= _MAX_SEED:
        raise ValueError(f"seed must be in [0, {_MAX_SEED}], got {seed}")
    if verbose:
        log.info(_rank_prefixed(f"Seed set to {seed}"))
    for name in SEED_VARIABLES:
        os.environ[name] = str(seed)
    for name in WORKERS_VARIABLES:
        os.environ[name] = "1" if workers else "0"
    random.seed(seed)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(seed)
    torch.manual_seed(seed)
    if _xla_runtime_running():  # XLA's generators are not torch's (an XLA replica not yet started seeds at set-up)
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(seed)
    return seed


def _seed_from_environment(verbose: bool) -> int:
    if not any(os.environ.get(name) for name in SEED_VARIABLES) and verbose:
        rank_zero_warn("No seed found, seed set to 0")
    return sampler_seed()


def sampler_seed() -> int:
    """The seed distributed samplers shuffle with: the one ``seed_everything`` left, or one exported by hand under
    Lightning's ``PL_GLOBAL_SEED`` (read first, as Lightning's samplers do) or ``PHALANX_GLOBAL_SEED``; else 0."""
    for name in reversed(SEED_VARIABLES):
        value = os.environ.get(name)
        if value:
            try:
                return int(value)
            except ValueError:
                raise ValueError(
                    f"{name}={value!r} is not a valid seed; set it to an int in [0, {_MAX_SEED}]."
                ) from None
    return 0


def _rank_prefixed(message: str) -> str:
    # The rank a launcher gave this process, when one did (Lightning prefixes its seed line the same way).
    for name in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        if os.environ.get(name, "").isdigit():
            return f"[rank: {int(os.environ[name])}] {message}"
    return message


def reset_seed() -> None:
    """Seed the generators again with the seed (and ``workers``) ``seed_everything`` last set, quietly; nothing when
    it was never called (its variables are unset)."""
    seed = next((os.environ[name] for name in SEED_VARIABLES if os.environ.get(name)), None)
    if seed is None:
        return
    workers = any(os.environ.get(name) == "1" for name in WORKERS_VARIABLES)
    seed_everything(int(seed), workers=workers, verbose=False)


def worker_init_fn(worker_id: int, rank: int | None = None) -> None:
    """Seed one dataloader worker's torch, Python and NumPy generators, distinct per worker, rank and epoch.

    Lightning's ``pl_worker_init_function``: the Trainer and the Cohort set it on loaders without a
    ``worker_init_fn`` after ``seed_everything(workers=True)``; ``rank`` defaults to this process's global rank.
    """
    rank = rank_zero_only.rank if rank is None else rank
    # torch gives each worker initial_seed() = base_seed + worker_id, where base_seed is drawn afresh for every
    # epoch from the (seeded) main process: mixing it with the rank makes seeds differ across ranks and epochs.
    base_seed = torch.initial_seed() - worker_id
    mixed = torch.Generator().manual_seed(hash((base_seed, worker_id, rank)) & 0x7FFF_FFFF_FFFF_FFFF)
    seeds = torch.randint(0, _MAX_SEED, (3,), generator=mixed).tolist()
    torch.manual_seed(seeds[0])
    random.seed(seeds[1])
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(seeds[2])


#: Lightning's name of :func:`worker_init_fn`.
pl_worker_init_function = worker_init_fn


def collect_rng_states() -> dict[str, Any]:
    """Snapshot the global generators as plain values and tensors (loadable with ``weights_only=True``)."""
    version, internal, gauss = random.getstate()
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": [version, list(internal), gauss]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["torch.cuda"] = torch.cuda.get_rng_state_all()
    if "numpy" in sys.modules:
        kind, keys, pos, has_gauss, cached = sys.modules["numpy"].random.get_state()
        states["numpy"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    xla_seed = _xla_rng_state()
    if xla_seed is not None:
        states["xla"] = xla_seed
    return states


def _xla_runtime_running() -> bool:
    # Only a process that already runs XLA has an XLA generator to save; asking torch_xla for it otherwise would start
    # the runtime, after which torch_xla's launcher refuses to start replicas. torch_xla is never imported here.
    torch_xla = sys.modules.get("torch_xla")
    return torch_xla is not None and bool(torch_xla._XLAC._xla_runtime_is_initialized())


def _xla_rng_state() -> int | None:
    """The XLA generator's state (a plain int) of this thread's default XLA device, when XLA runs in this process."""
    if not _xla_runtime_running():
        return None
    import torch_xla.core.xla_model as xm

    return int(xm.get_rng_state())


def restore_rng_states(states: dict[str, Any]) -> None:
    """Restore generators from :func:`collect_rng_states`'s output."""
    torch.set_rng_state(states["torch"])
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    if "torch.cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["torch.cuda"])
    if "numpy" in states:
        import numpy as np

        kind, keys, pos, has_gauss, cached = states["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "xla" in states and _xla_runtime_running():  # an XLA checkpoint resumed elsewhere leaves XLA alone
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(int(states["xla"]))


@contextmanager
def isolate_rng() -> Iterator[None]:
    """Run a block and put the global generators (torch's, CUDA's once started, Python's, NumPy's) back as they were
    before it, even when it raises: what the block draws changes no draw after it."""
    states = collect_rng_states()
    try:
        yield
    finally:
        restore_rng_states(states)
