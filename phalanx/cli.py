"""The ``phalanx`` command line.

Each command lives in a subparser whose ``func`` default is the function that runs it; to add one
(for example ``phalanx checkpoint consolidate``), write an ``_add_<name>_parser(subparsers)`` function
and call it from :func:`build_parser`. Heavy imports (torch, phalanx) belong inside the command
functions so that ``phalanx --help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

_MAX_SEED = 2**32 - 1


# ---------------------------------------------------------------------------- argument types
def parse_devices(value: str) -> int | str | list[int]:
    """``"auto"``, a device count (``"2"``, or ``"-1"`` for all) or device indices (``"0,1"``, ``"1,"``)."""
    text = value.strip().lower()
    if text == "auto":
        return "auto"
    if "," in text:
        parts = [p.strip() for p in text.split(",") if p.strip()]
        try:
            indices = [int(p) for p in parts]
        except ValueError:
            indices = []
        if not indices or any(i < 0 for i in indices):
            raise argparse.ArgumentTypeError(
                f"invalid device list {value!r}: expected non-negative indices separated by commas, e.g. '0,1'"
            )
        if len(set(indices)) != len(indices):
            raise argparse.ArgumentTypeError(f"invalid device list {value!r}: an index appears twice")
        return indices
    try:
        count = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid devices value {value!r}: expected 'auto', a positive count, -1 (all) or indices like '0,1'"
        ) from None
    if count == 0 or count < -1:
        raise argparse.ArgumentTypeError(f"invalid devices value {value!r}: the count must be positive (or -1 for all)")
    return count


def _positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}") from None
    if number <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return number


def _seed(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer seed, got {value!r}") from None
    if not 0 <= number <= _MAX_SEED:
        raise argparse.ArgumentTypeError(f"the seed must be in [0, {_MAX_SEED}], got {number}")
    return number


# ---------------------------------------------------------------------------- demo
# Kept in sync with phalanx.demo.run.DEFAULT_MAX_STEPS (not imported here: that would import torch).
DEMO_DEFAULT_MAX_STEPS = 900


class _DefaultsOnceFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: ...)" to an option's help unless the help already says what happens by default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _add_demo_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="train a tiny character-level transformer on a bundled text file",
        description=(
            "Train a small character-level transformer on a text file shipped with phalanx, print the "
            "validation loss as it falls, then print a generated sample. The default 900 steps take about a "
            "minute on a laptop's CPU (more on a busy one); --max-steps 100 gives a first look in seconds."
        ),
        formatter_class=_DefaultsOnceFormatter,
    )
    parser.add_argument("--strategy", default="auto", help="training strategy, e.g. auto, ddp, fsdp")
    parser.add_argument(
        "--devices",
        type=parse_devices,
        default="auto",
        help="'auto', a device count (-1 for all) or comma-separated device indices such as '0,1'",
    )
    parser.add_argument("--accelerator", default="auto", help="auto, cpu, cuda, mps, ...")
    parser.add_argument("--precision", default="32-true", help="e.g. 32-true, bf16-mixed, 16-mixed")
    parser.add_argument(
        "--max-steps", type=_positive_int, default=DEMO_DEFAULT_MAX_STEPS, help="number of optimizer steps"
    )
    parser.add_argument("--seed", type=_seed, default=42, help="random seed")
    parser.add_argument(
        "--default-root-dir",
        default=None,
        help="directory for anything the Trainer writes (default: phalanx_demo under the system temp dir)",
    )
    parser.add_argument("--no-progress-bar", action="store_true", help="do not show the progress bar")
    parser.set_defaults(func=_run_demo_command)


def _run_demo_command(args: argparse.Namespace) -> int:
    from phalanx.demo.run import run_demo  # lazy for import time: only `phalanx demo` loads the demo

    try:
        run_demo(
            strategy=args.strategy,
            devices=args.devices,
            accelerator=args.accelerator,
            precision=args.precision,
            max_steps=args.max_steps,
            seed=args.seed,
            default_root_dir=args.default_root_dir,
            enable_progress_bar=not args.no_progress_bar,
        )
    except (ValueError, TypeError, OSError) as err:
        # The options reach the Trainer, which refuses bad ones with a ValueError/TypeError naming them; an
        # unwritable --default-root-dir surfaces as an OSError.
        return _error("phalanx demo", str(err))
    return 0


# ---------------------------------------------------------------------------- checkpoint
def _add_checkpoint_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "checkpoint", help="work with checkpoints", description="Work with phalanx checkpoints."
    )
    commands = parser.add_subparsers(dest="checkpoint_command", metavar="<checkpoint command>")
    consolidate = commands.add_parser(
        "consolidate",
        help="turn a sharded checkpoint directory into one checkpoint file",
        description=(
            "Read a checkpoint directory written by FSDPStrategy(state_dict_type='sharded'), ModelParallelStrategy or"
            " DeepSpeedStrategy and write one ordinary phalanx checkpoint file with whole tensors, which any strategy"
            " (single device, DDP, ...) can load or resume from. Needs no GPU and no process group."
        ),
    )
    consolidate.add_argument("directory", help="the checkpoint directory")
    consolidate.add_argument("output", help="the checkpoint file to write (e.g. model.ckpt); it must not exist yet")
    consolidate.add_argument("--overwrite", action="store_true", help="replace OUTPUT if it is an existing file")
    consolidate.set_defaults(func=_run_consolidate_command)
    parser.set_defaults(
        func=lambda args: _error(
            "phalanx checkpoint", "choose a checkpoint command: consolidate (see phalanx checkpoint --help)"
        )
    )


def _consolidate_output_problem(directory: Any, output: Any, overwrite: bool) -> str | None:
    """Why ``output`` cannot receive the consolidated ``directory`` (None: it can); nothing is written."""
    target = output.absolute()
    if target.resolve() == directory.resolve():
        return (
            f"the output {output} is the input directory itself; name a new file, e.g."
            f" {directory.name}.consolidated.ckpt"
        )
    if directory.resolve() in target.resolve().parents:
        return (
            f"the output {output} is inside the input directory {directory}, which must stay unchanged; write it"
            " elsewhere"
        )
    if target.is_dir():
        return f"the output {output} is an existing directory; name a file to write, e.g. {output / 'model.ckpt'}"
    # Lazy for import time: the checkpoint IO is only loaded by `phalanx checkpoint`.
    from phalanx.plugins.io.directory import target_refusal

    refusal = target_refusal(target)
    if refusal is not None:
        return f"the output {output} is {refusal}, which writing the checkpoint would replace; name a regular file"
    for parent in target.parents:
        if parent.exists():
            if not parent.is_dir():
                return f"the output {output} is below {parent}, which is a file, not a directory"
            break
    if target.exists() and not overwrite:
        return f"the output {output} exists; pass --overwrite to replace it, or name a new file"
    return None


def _run_consolidate_command(args: argparse.Namespace) -> int:
    from pathlib import Path

    name = "phalanx checkpoint consolidate"
    directory, output = Path(args.directory), Path(args.output)
    if not directory.exists():
        return _error(
            name,
            f"{directory} is not a directory: nothing exists at that path (expected a sharded checkpoint directory)",
        )
    if not directory.is_dir():
        hint = " It is a file; a single-file checkpoint needs no consolidation." if directory.is_file() else ""
        return _error(name, f"{directory} is not a directory (a sharded checkpoint is a directory).{hint}")
    # Lazy for import time: only `phalanx consolidate` loads the checkpoint readers (and torch.distributed.checkpoint).
    from phalanx.plugins.io.formats import consolidate, detect_directory, not_a_checkpoint
    from phalanx.plugins.io.torch_io import TorchCheckpointIO
    from phalanx.utilities.exceptions import CheckpointError

    try:
        layout = detect_directory(directory)
    except OSError as err:
        return _error(name, f"cannot read {directory}: {err.strerror or err}")
    if layout is None:
        # Reads nothing: it only says which files a known layout misses, or names every layout phalanx reads.
        return _error(name, str(not_a_checkpoint(directory)))
    problem = _consolidate_output_problem(directory, output, args.overwrite)
    if problem is not None:
        return _error(name, problem)

    try:
        checkpoint = consolidate(directory)
    except CheckpointError as err:
        return _error(name, str(err))
    except OSError as err:
        return _error(
            name, f"cannot read {directory}: {err.strerror or err} ({getattr(err, 'filename', None) or directory})"
        )
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # noqa: BLE001 - a damaged directory fails in many ways inside torch's readers
        # (DCP's CheckpointException is a BaseException): report it, never a traceback.
        return _error(name, f"{directory} is not a checkpoint phalanx can read ({type(err).__name__}: {_summary(err)})")
    try:
        TorchCheckpointIO().save_checkpoint(checkpoint, output)
    except CheckpointError as err:  # the disk filling, a quota, a FIFO put there meanwhile: the message names it
        return _error(name, str(err))
    except OSError as err:
        return _error(name, f"cannot write {output}: {err.strerror or err}")
    tensors = len(checkpoint.get("state_dict", {}))
    print(f"wrote {output}: {tensors} module tensors, step {checkpoint.get('global_step', '?')}")
    return 0


def _summary(error: BaseException) -> str:
    """The first and the last line of ``error``'s message (torch's checkpoint errors carry a whole remote traceback)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip() and not line.startswith("Traceback")]
    if len(lines) <= 1:
        return lines[0] if lines else ""
    return f"{lines[0]} ... {lines[-1]}"


def _error(command: str, message: str) -> int:
    """Print one ``error:`` line on stderr; return the exit status of a usage error."""
    print(f"{command}: error: {' '.join(message.split())}", file=sys.stderr)
    return 2


# ---------------------------------------------------------------------------- run
#: Registry names whose strategy starts its own processes: under `phalanx run` the processes are already started.
_STARTS_ITS_OWN_PROCESSES = ("spawn", "fork", "notebook")


def _non_negative_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value!r}") from None
    if number < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value!r}")
    return number


def _port(value: str) -> int:
    number = _non_negative_int(value)
    if not 1 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number in [1, 65535], got {value!r}")
    return number


def _add_run_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "run",
        help="launch a Cohort script on several processes (Fabric's `fabric run`)",
        description=(
            "Start SCRIPT in one process per device of this node (through torchrun's launcher) with the Cohort settings"
            " given here: a Cohort(...) in the script that leaves an argument at its default takes the value from the"
            " command line. Inside a SLURM, LSF or MPI job step or a torchrun worker, whose launcher already started"
            " the processes, SCRIPT runs in this process instead. SCRIPT_ARGS go to the script."
        ),
        formatter_class=_DefaultsOnceFormatter,
    )
    parser.add_argument("--accelerator", default=None, help="cpu, cuda, mps, auto, ... (default: the script's)")
    parser.add_argument(
        "--strategy", default=None, help="ddp, fsdp, deepspeed, model_parallel, ... (default: the script's)"
    )
    parser.add_argument(
        "--devices", type=parse_devices, default=1, help="devices per node: a count, -1 (all), 'auto' or indices '0,1'"
    )
    parser.add_argument("--num-nodes", "--num_nodes", dest="num_nodes", type=_positive_int, default=1, help="machines")
    parser.add_argument(
        "--node-rank", "--node_rank", dest="node_rank", type=_non_negative_int, default=0, help="this machine's index"
    )
    parser.add_argument(
        "--main-address", "--main_address", dest="main_address", default="127.0.0.1", help="the node_rank 0 machine"
    )
    parser.add_argument("--main-port", "--main_port", dest="main_port", type=_port, default=29400, help="its port")
    parser.add_argument("--precision", default=None, help="32-true, bf16-mixed, 16-mixed, ... (default: the script's)")
    parser.add_argument("script", help="the Python script that builds the Cohort")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    parser.set_defaults(func=_run_run_command)


def _run_problem(args: argparse.Namespace) -> str | None:
    """Why ``args`` cannot launch (None: they can); checked before any process starts."""
    from pathlib import Path

    # Lazy for import time: only `phalanx run` loads strategy resolution (and torch).
    from phalanx.strategies.registry import STRATEGY_REGISTRY
    from phalanx.strategies.resolve import NOT_OFFERED_STRATEGIES, normalize_precision, resolve_accelerator

    if not Path(args.script).is_file():
        return f"the script {args.script} does not exist (expected the path of a Python file)"
    if args.node_rank >= args.num_nodes:
        return f"--node-rank {args.node_rank} is not below --num-nodes {args.num_nodes}; the nodes count from 0"
    if args.strategy is not None and any(word in args.strategy.lower() for word in _STARTS_ITS_OWN_PROCESSES):
        return (
            f"--strategy {args.strategy} starts processes itself, but phalanx run starts them; use its plain form"
            " (e.g. ddp for ddp_spawn) or run the script with python"
        )
    strategy = (args.strategy or "auto").lower()
    if strategy in NOT_OFFERED_STRATEGIES and strategy not in STRATEGY_REGISTRY:
        return f"--strategy {args.strategy} (Lightning Fabric's) is not offered; use {NOT_OFFERED_STRATEGIES[strategy]}"
    if strategy != "auto" and strategy not in STRATEGY_REGISTRY:
        return f"unknown --strategy {args.strategy}; choose 'auto' or one of {STRATEGY_REGISTRY.available()}"
    try:
        if args.precision is not None:
            normalize_precision(args.precision)
        resolve_accelerator(args.accelerator or "auto")
    except (ValueError, TypeError) as err:
        return str(err)
    return None


def _run_run_command(args: argparse.Namespace) -> int:
    import os

    problem = _run_problem(args)
    if problem is not None:
        return _error("phalanx run", problem)
    # Lazy for import time: only `phalanx run` loads the cluster environments and strategy resolution.
    from phalanx.plugins.environments import DefaultEnvironment, detect_cluster_environment
    from phalanx.strategies.resolve import resolve_accelerator
    from phalanx.utilities.run_variables import RUN_MARKER, RUN_VARIABLES, devices_text

    # Inside a job step that srun, jsrun, mpirun or torchrun started, the processes exist: the script runs here.
    started = not isinstance(detect_cluster_environment(), DefaultEnvironment)
    processes = 1
    if not started:
        try:
            processes = len(resolve_accelerator(args.accelerator or "auto").get_parallel_devices(args.devices))
        except (ValueError, TypeError) as err:
            return _error("phalanx run", str(err))
    given = {"accelerator": args.accelerator, "strategy": args.strategy, "precision": args.precision}
    given.update(devices=devices_text(args.devices), num_nodes=str(args.num_nodes))
    os.environ[RUN_MARKER] = "1"
    for name, value in given.items():
        if value is not None:
            os.environ[RUN_VARIABLES[name]] = str(value)
    return _run_script_here(args.script, args.script_args) if started else _torchrun(args, processes)


def _run_script_here(script: str, script_args: list[str]) -> int:
    import os
    import runpy

    sys.argv = [script, *script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python script.py` does
    runpy.run_path(script, run_name="__main__")
    return 0


def _torchrun(args: argparse.Namespace, processes: int) -> int:
    # Lazy for import time: torch's launcher loads torch.distributed.
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(
            [
                f"--nproc-per-node={processes}",
                f"--nnodes={args.num_nodes}",
                f"--node-rank={args.node_rank}",
                f"--master-addr={args.main_address}",
                f"--master-port={args.main_port}",
                args.script,
                *args.script_args,
            ]
        )
    except ChildFailedError as failed:
        ranks = sorted(failed.failures)
        print(f"phalanx run: error: {args.script} failed on rank(s) {ranks} (their output is above)", file=sys.stderr)
        return 1
    return 0


# ---------------------------------------------------------------------------- the CLI class for scripts
# Lightning's `from lightning.pytorch.cli import LightningCLI` becomes `from phalanx.cli import LightningCLI`: these
# names come from phalanx.command_line, loaded on first use (it imports torch and jsonargparse).
_COMMAND_LINE_NAMES = (
    "ArgsType",
    "LightningArgumentParser",
    "LightningCLI",
    "LRSchedulerCallable",
    "LRSchedulerType",
    "LRSchedulerTypeTuple",
    "LRSchedulerTypeUnion",
    "OptimizerCallable",
    "PhalanxArgumentParser",
    "PhalanxCLI",
    "ReduceLROnPlateau",
    "SaveConfigCallback",
    "instantiate_class",
)


def __getattr__(name: str) -> Any:
    import importlib  # lazy for import time: `phalanx --help` must not load torch

    if name in _COMMAND_LINE_NAMES:
        return getattr(importlib.import_module("phalanx.command_line"), name)
    # Lazy for import time: only a missing name loads the table's helpers.
    from phalanx.utilities.lightning_names import NotOffered, missing_name_error

    instead = (
        "PhalanxCLI(load_from_checkpoint_support=True), which builds the module from a checkpoint's hyperparameters"
    )
    raise missing_name_error(__name__, name, {"instantiate_module": NotOffered(instead)})


# ---------------------------------------------------------------------------- entry point
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="phalanx", description="phalanx command line tools")
    subparsers = parser.add_subparsers(dest="command", metavar="<command>")
    _add_demo_parser(subparsers)
    _add_run_parser(subparsers)
    _add_checkpoint_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``phalanx`` command line with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    func = getattr(args, "func", None)
    if func is None:
        return _error("phalanx", "choose a command: demo, run or checkpoint (see phalanx --help)")
    return int(func(args) or 0)
