"""Every registered built-in strategy and what it promises: the one table that the conformance run and the
per-strategy suites in tests/distributed read, so that a strategy missing from it fails once, here
(tests/unit/test_strategy_cases.py checks the table against the registry).

A row per registry name: its class, the suites whose guarantee it declares (``promises``, see SUITES), and how the
conformance kit builds it (``kit``: one or more runs, each through the Trainer with its defaults on and through the
Cohort). A suite runs exactly the rows that promise its guarantee; how it builds a row's strategy for its own job
stays in that job. A row that promises nothing names the row it is a variant of (one option changed).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

#: Each suite's test module in tests/distributed, and the guarantee it checks.
SUITES = {
    "conformance": ("test_conformance.py", "the Strategy contract, through the Trainer (defaults on) and the Cohort"),
    "defaults": ("test_defaults_tier.py", "every stage with the Trainer's defaults on; resumed with auto, last, best"),
    "resume": ("test_resume_matrix.py", "a checkpoint of any other strategy resumes here as the uninterrupted run"),
    "checkpoint_io": ("test_checkpoint_io_strategies.py", "every save, load and removal goes through the CheckpointIO"),
    "clip_norm": ("test_clip_norm_strategies.py", "clipping by total norm equals one process's"),
    "compile": ("test_compile_strategies.py", "compiled weights equal eager ones; checkpoints resume across the two"),
    "cohort": ("test_cohort_processes.py", "a Cohort loop equals Trainer.fit and torch's DDP; the Trainer resumes it"),
}
#: Registered built-ins that need torch_xla: the XLA tier (tests/xla) holds them to their promises.
XLA_TIER = ("single_xla", "xla", "xla_debug", "xla_fsdp", "xla_spmd", "xla_spmd_dp")
#: Registered built-ins that need a lighthouse and one job per replica group and have no kit run (issue 36): none now.
#: The kit runs one replica group of each: ddp_ft's of one process, a lighthouse in that process
#: (``build_one_replica_group``); hsdp_ft's of 2 processes, FSDP over both, a lighthouse in rank 0's process
#: (``build_one_sharded_group``). Several groups, a kill and a heal: tests/distributed/test_fault_tolerant_ddp.py and
#: test_fault_tolerant_hsdp.py hold them to exact parity with one process on the committed batches.
FAULT_TOLERANT_TIER: tuple[str, ...] = ()
TORCHFT = "torchft"


def build(class_name: str, **options: Any) -> Any:
    """``phalanx.strategies.<class_name>(**options)``, imported when a kit rank builds it (with functools.partial,
    a picklable factory)."""
    import phalanx.strategies

    return getattr(phalanx.strategies, class_name)(**options)


_LIGHTHOUSES: list[Any] = []  # the lighthouses of a kit rank that builds ddp_ft or hsdp_ft (kept while it lives)


def _one_group_lighthouse() -> str:
    """A lighthouse of its own for one replica group (group 0 of 1), started in this kit rank's process: a Cohort never
    tears its strategy down, so the manager of an earlier Cohort run in this process still heartbeats to its
    lighthouse, which would then wait for that group too. Returns its address."""
    from datetime import timedelta

    from phalanx.strategies.fault_tolerant import start_lighthouse

    # One group: its quorum forms at once (short join and tick times).
    ticks = {"join_timeout": timedelta(milliseconds=20), "quorum_tick": timedelta(milliseconds=10)}
    _LIGHTHOUSES.append(start_lighthouse(min_replicas=1, **ticks))
    return _LIGHTHOUSES[-1].address


def build_one_replica_group() -> Any:
    """``DDPFaultTolerantStrategy`` as replica group 0 of 1 (one process), with a lighthouse in this process."""
    from phalanx.strategies import DDPFaultTolerantStrategy, FaultTolerance

    return DDPFaultTolerantStrategy(fault_tolerance=FaultTolerance(0, 1, lighthouse=_one_group_lighthouse()))


def build_one_sharded_group() -> Any:
    """``HSDPFaultTolerantStrategy`` as replica group 0 of 1 on the kit's processes (FSDP over all of them). Rank 0
    starts the group's lighthouse in its process; the other ranks keep the default address, which they never use:
    torchft's Manager talks to the lighthouse from a group's rank 0 only (the others reach that rank's manager through
    the group's store)."""
    import os

    from phalanx.strategies import FaultTolerance, HSDPFaultTolerantStrategy

    rank_zero = os.environ.get("LOCAL_RANK", "0") == "0"  # the kit sets each rank's LOCAL_RANK before it builds
    options = FaultTolerance(0, 1, lighthouse=_one_group_lighthouse()) if rank_zero else FaultTolerance(0, 1)
    return HSDPFaultTolerantStrategy(fault_tolerance=options)


@dataclass(frozen=True)
class KitRun:
    """One conformance run: how each rank builds the strategy (picklable), on how many processes, and the checks
    that have nothing to verify there (skipped through every driver that has them; a driver's name: all its checks,
    the driver not being offered for the strategy)."""

    make: Callable[[], Any]
    processes: int
    skipped: frozenset[str]
    id: str


@dataclass(frozen=True)
class StrategyCase:
    """One registered built-in strategy and its declared guarantees."""

    name: str
    strategy_class: str
    promises: frozenset[str] = frozenset()
    kit: tuple[KitRun, ...] = ()
    sharded: bool = False  # its parameters are DTensor shards once set up (the resume matrix checks they really are)
    needs: str | None = None  # an optional package the suites skip without
    variant_of: str | None = None  # a row that promises nothing: the row whose strategy it varies
    launches: bool = False  # starts its own processes (spawn, fork): suites launch it from a function, the kit cannot


def _kit(make: Callable[[], Any], processes: int, skipped: set[str], id: str) -> KitRun:
    return KitRun(make, processes, frozenset(skipped), id)


NO_SYNC = {"no_sync"}  # one process, ranks that read the same data, or a strategy that accumulates itself
DEEPSPEED = "deepspeed"

CASES = (
    StrategyCase(
        "single_device", "SingleDeviceStrategy", frozenset({"conformance", "defaults", "resume", "clip_norm"}),
        kit=(_kit(partial(build, "SingleDeviceStrategy"), 1, NO_SYNC, "single_device-1"),),
    ),
    StrategyCase(
        "ddp", "DDPStrategy",
        frozenset({"conformance", "defaults", "resume", "checkpoint_io", "clip_norm", "compile", "cohort"}),
        kit=(
            _kit(partial(build, "DDPStrategy"), 1, NO_SYNC, "ddp-1"),
            _kit(partial(build, "DDPStrategy"), 2, set(), "ddp-2"),
        ),
    ),
    StrategyCase("ddp_spawn", "DDPStrategy", frozenset({"defaults", "cohort"}), launches=True),
    StrategyCase("ddp_fork", "DDPStrategy", frozenset({"defaults", "cohort"}), launches=True),
    StrategyCase("ddp_notebook", "DDPStrategy", variant_of="ddp_fork", launches=True),
    *(
        StrategyCase(f"{base}_find_unused_parameters_{flag}", "DDPStrategy", variant_of=base)
        for base in ("ddp", "ddp_spawn", "ddp_fork", "ddp_notebook")
        for flag in ("false", "true")
    ),
    StrategyCase(
        "fsdp", "FSDPStrategy",
        frozenset({"conformance", "defaults", "resume", "checkpoint_io", "clip_norm", "compile", "cohort"}),
        kit=(
            _kit(partial(build, "FSDPStrategy"), 2, set(), "fsdp-2"),
            _kit(partial(build, "FSDPStrategy", state_dict_type="sharded"), 2, set(), "fsdp_sharded_checkpoints-2"),
        ),
        sharded=True,
    ),
    StrategyCase("fsdp_cpu_offload", "FSDPStrategy", variant_of="fsdp"),
    StrategyCase(
        "model_parallel", "ModelParallelStrategy",
        frozenset({"conformance", "defaults", "resume", "checkpoint_io", "clip_norm", "compile"}),
        kit=(_kit(partial(build, "ModelParallelStrategy"), 2, NO_SYNC, "model_parallel-2"),),  # tensor parallel
        sharded=True,
    ),
    StrategyCase(
        "ddp_ft", "DDPFaultTolerantStrategy", frozenset({"conformance", "defaults", "resume"}),
        kit=(_kit(build_one_replica_group, 1, NO_SYNC, "ddp_ft-1"),),
        needs=TORCHFT,
    ),
    StrategyCase(
        "hsdp_ft", "HSDPFaultTolerantStrategy", frozenset({"conformance", "resume"}),
        # The Cohort is not offered (traits.cohort_unsupported): the kit reports its checks as skipped, saying why.
        kit=(_kit(build_one_sharded_group, 2, {"cohort"}, "hsdp_ft-2"),),
        sharded=True,
        needs=TORCHFT,
    ),
    StrategyCase("deepspeed", "DeepSpeedStrategy", frozenset({"defaults"}), needs=DEEPSPEED),
    *(
        StrategyCase(
            f"deepspeed_stage_{stage}", "DeepSpeedStrategy",
            frozenset({"conformance", "resume", "checkpoint_io", *extra}),
            kit=(_kit(partial(build, "DeepSpeedStrategy", stage=stage), 2, NO_SYNC, f"deepspeed_stage_{stage}-2"),),
            needs=DEEPSPEED,
        )
        for stage, extra in ((1, ()), (2, ("compile", "cohort")), (3, ("defaults",)))
    ),
    *(
        StrategyCase(name, "DeepSpeedStrategy", variant_of=base, needs=DEEPSPEED)
        for name, base in (
            ("deepspeed_stage_2_offload", "deepspeed_stage_2"),
            ("deepspeed_stage_3_offload", "deepspeed_stage_3"),
            ("deepspeed_stage_3_offload_nvme", "deepspeed_stage_3"),
        )
    ),
)  # fmt: skip


def case(name: str) -> StrategyCase:
    """The row of registry name ``name``."""
    found = [row for row in CASES if row.name == name]
    if not found:
        raise KeyError(f"{name!r} has no row in tests/strategy_cases.py; rows: {[row.name for row in CASES]}")
    return found[0]


def promising(suite: str) -> list[StrategyCase]:
    """The rows that promise ``suite``'s guarantee, in table order."""
    if suite not in SUITES:
        raise KeyError(f"no suite {suite!r}; suites: {list(SUITES)}")
    return [row for row in CASES if suite in row.promises]


def names(suite: str) -> list[str]:
    """The registry names that promise ``suite``'s guarantee."""
    return [row.name for row in promising(suite)]
