"""One rank of a conformance run: through each driver, train, judge, (Trainer) run the collective checks, resume, and
write what it found."""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from phalanx.testing.report import FAILED, PASSED, SKIPPED, NotApplicable, RankResults

# Variables through which a cluster or launcher would tell this process its rank: the kit assigns ranks itself.
_LAUNCH_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "NODE_RANK",
    "GROUP_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)
_CLUSTER_PREFIXES = ("SLURM_", "LSB_", "JSM_", "OMPI_", "PMI_", "PMIX_", "MV2_", "TORCHELASTIC_")


class _Stopped(Exception):
    """This rank stops early for a reason its message explains (no traceback needed)."""


@dataclass(frozen=True)
class WorkerSpec:
    """What every rank needs (pickled to spawned processes, so ``make_strategy`` must be picklable)."""

    make_strategy: Callable[[], Any]
    processes: int
    checks: dict[str, tuple[str, ...]]  # driver -> its checks, in order
    directory: str
    port: int
    resume_atol: float


def worker_main(rank: int, spec: WorkerSpec) -> None:
    """Entry point of rank ``rank``: never raises; everything it finds goes to ``<directory>/rank<rank>.json``."""
    _isolate_environment(rank, spec)
    results = RankResults(Path(spec.directory), rank)
    try:
        _run_checks(rank, spec, results)
    except KeyboardInterrupt:
        results.fatal = "interrupted"
    except _Stopped as stopped:
        results.fatal = str(stopped)
    except BaseException as error:  # noqa: BLE001 - reported to the parent, which raises
        results.fatal = f"{type(error).__name__}: {error}\n" + "".join(traceback.format_exception(error)[-6:])
    finally:
        results.write()


def _isolate_environment(rank: int, spec: WorkerSpec) -> None:
    for name in list(os.environ):
        if name in _LAUNCH_VARIABLES or name.startswith(_CLUSTER_PREFIXES):
            del os.environ[name]
    # As a script launch would set them: the strategy's DefaultEnvironment sees an externally started rank.
    os.environ.update(
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(spec.port), "LOCAL_RANK": str(rank), "NODE_RANK": "0"}
    )
    import torch

    torch.set_num_threads(1)  # the ranks share the machine's cores; more threads each only oversubscribe them


def _judge(results: RankResults, driver: str, check: str, judge: Callable[[], None]) -> None:
    results.started(f"{driver}/{check}")
    try:
        judge()
    except NotApplicable as reason:
        results.record(driver, check, SKIPPED, str(reason))
    except AssertionError as error:
        results.record(driver, check, FAILED, str(error) or "assertion failed")
    except Exception as error:  # noqa: BLE001 - a check that crashes fails, with what it raised
        message = f"raised {type(error).__name__}: {error}\n" + "".join(traceback.format_exception(error)[-4:])
        results.record(driver, check, FAILED, message)
    else:
        results.record(driver, check, PASSED)


def _run_checks(rank: int, spec: WorkerSpec, results: RankResults) -> None:
    if "trainer" in spec.checks:
        _trainer_checks(rank, spec, results)
    if "cohort" in spec.checks:
        _cohort_checks(rank, spec, results)


def _trainer_checks(rank: int, spec: WorkerSpec, results: RankResults) -> None:
    # Lazy for import time: the runner's process imports this module but never loads the Trainer, about a second.
    from phalanx.testing import training
    from phalanx.testing.collectives import COLLECTIVE_CHECKS

    checks, processes, directory = spec.checks["trainer"], spec.processes, Path(spec.directory)
    resume = "checkpoint" in checks
    results.started("trainer: fit")
    first = training.run_fit(
        spec.make_strategy, processes, seed=0, root=directory / "trainer", record=True,
        save_at=training.SAVE_AT if resume else None, checkpoint=directory / "mid.ckpt", no_sync="no_sync" in checks,
    )  # fmt: skip
    judges: dict[str, Callable[[], None]] = {
        "lifecycle": lambda: training.judge_lifecycle(first, rank=rank, processes=processes),
        "hooks": lambda: training.judge_hooks(first),
        "no_sync": lambda: training.judge_no_sync(first, rank=rank),
    }
    _judge_selected(results, "trainer", checks, judges)
    _stop_if_failed(first, rank)
    after_fit = directory / "after_fit.ckpt"
    judges = {
        "teardown": lambda: training.judge_teardown(
            first, rank=rank, processes=processes, after_fit_checkpoint=after_fit
        )
    }
    for name, check in COLLECTIVE_CHECKS.items():
        judges[name] = lambda check=check: check(first.strategy, rank=rank, world_size=processes)  # type: ignore[misc]  # a default argument binds the loop variable; mypy cannot type such a lambda
    _judge_selected(results, "trainer", checks, judges)
    if resume:
        results.started("trainer: resumed fit")
        resumed = training.run_fit(
            spec.make_strategy, processes, seed=1, root=directory / "trainer", ckpt_path=directory / "mid.ckpt",
            capture_start=True, label=f"Trainer.fit(ckpt_path=<checkpoint saved at step {training.SAVE_AT}>)",
        )  # fmt: skip
        _judge(
            results, "trainer", "checkpoint", lambda: training.judge_checkpoint(first, resumed, atol=spec.resume_atol)
        )


def _cohort_checks(rank: int, spec: WorkerSpec, results: RankResults) -> None:
    # Lazy for import time: the runner's process imports this module but never loads the Cohort.
    from phalanx.testing import cohort_driver, training

    checks, processes, directory = spec.checks["cohort"], spec.processes, Path(spec.directory)
    reason = training.built_strategy(spec.make_strategy).traits.cohort_unsupported
    if reason is not None:
        for check in checks:
            results.record("cohort", check, SKIPPED, f"the Cohort is not offered for this strategy: {reason}")
        return
    resume = "checkpoint" in checks
    results.started("cohort: loop")
    first = cohort_driver.run_loop(
        spec.make_strategy, processes, seed=0, record=True, save_at=training.SAVE_AT if resume else None,
        checkpoint=directory / "cohort_mid.ckpt", no_sync="no_sync" in checks,
    )  # fmt: skip
    judges: dict[str, Callable[[], None]] = {
        "lifecycle": lambda: cohort_driver.judge_cohort_lifecycle(first, rank=rank, processes=processes),
        "no_sync": lambda: training.judge_no_sync(first, rank=rank),
    }
    _judge_selected(results, "cohort", checks, judges)
    _stop_if_failed(first, rank)
    if resume:
        results.started("cohort: resumed loop")
        resumed = cohort_driver.run_loop(
            spec.make_strategy, processes, seed=1, resume_from=directory / "cohort_mid.ckpt"
        )
        _judge(
            results, "cohort", "checkpoint", lambda: training.judge_checkpoint(first, resumed, atol=spec.resume_atol)
        )


def _stop_if_failed(run: Any, rank: int) -> None:
    if run.error is not None:
        # The other ranks may be waiting in a collective this one left: no further collective may start here.
        raise _Stopped(
            f"{run.label} raised {type(run.error).__name__} on rank {rank}; the remaining checks did not run."
        )


def _judge_selected(
    results: RankResults, driver: str, checks: tuple[str, ...], judges: dict[str, Callable[[], None]]
) -> None:
    for check, judge in judges.items():
        if check in checks:
            _judge(results, driver, check, judge)
