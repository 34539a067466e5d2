"""`phalanx run` without starting processes: its flags, what it refuses before launching, the variables it sets, the
launch it asks torchrun for, running the script in place inside a started job, and how a Cohort reads the variables
(``settings_from_run``). tests/distributed/test_run_command.py launches real processes."""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any

import pytest

from phalanx import Cohort
from phalanx import cli as phalanx_cli
from phalanx.utilities.run_variables import COHORT_DEFAULTS, RUN_MARKER, RUN_VARIABLES, settings_from_run

LAUNCH_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "GROUP_RANK",
)


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        RUN_MARKER,
        *RUN_VARIABLES.values(),
        *LAUNCH_VARIABLES,
        "SLURM_NTASKS",
        "LSB_JOBID",
        "OMPI_COMM_WORLD_SIZE",
    ):
        monkeypatch.setenv(name, "0")  # so that monkeypatch restores what was there
        monkeypatch.delenv(name)


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    body = "open(sys.argv[1], 'w').write(' '.join(sys.argv[2:]) + '|' + os.environ['PHALANX_RUN_DEVICES'])"
    path.write_text(f"import os, sys\n{body}\n")
    return path


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, int]]:
    seen: list[tuple[Any, int]] = []
    monkeypatch.setattr(phalanx_cli, "_torchrun", lambda args, processes: seen.append((args, processes)) or 0)
    return seen


def test_every_flag_and_the_script_arguments_are_read(script, launches):
    flags = ["--accelerator", "cpu", "--strategy", "ddp", "--devices", "2", "--num_nodes", "3", "--node_rank", "2"]
    flags += ["--main_address", "10.0.0.1", "--main_port", "4000", "--precision", "bf16-mixed"]
    assert phalanx_cli.main(["run", *flags, str(script), "--lr", "0.1", "-x"]) == 0
    [(args, processes)] = launches
    assert processes == 2
    assert (args.num_nodes, args.node_rank, args.main_address, args.main_port) == (3, 2, "10.0.0.1", 4000)
    assert (args.script, args.script_args) == (str(script), ["--lr", "0.1", "-x"])
    assert os.environ[RUN_MARKER] == "1"
    assert {name: os.environ.get(variable) for name, variable in RUN_VARIABLES.items()} == {
        "accelerator": "cpu", "strategy": "ddp", "devices": "2", "num_nodes": "3", "precision": "bf16-mixed",
    }  # fmt: skip


def test_flags_left_out_leave_the_scripts_settings_alone(script, launches):
    assert phalanx_cli.main(["run", "--devices", "3", "--accelerator", "cpu", str(script)]) == 0
    assert launches[0][1] == 3
    assert [name for name, variable in RUN_VARIABLES.items() if variable in os.environ] == [
        "accelerator",
        "devices",
        "num_nodes",
    ]
    assert os.environ[RUN_VARIABLES["devices"]] == "3"


@pytest.mark.parametrize(
    ("flags", "text"),
    [
        (["--strategy", "ddp_spawn"], "--strategy ddp_spawn starts processes itself, but phalanx run starts them"),
        (["--strategy", "ddp_notebook"], "--strategy ddp_notebook starts processes itself"),
        (["--num-nodes", "2", "--node-rank", "2"], "--node-rank 2 is not below --num-nodes 2"),
        (["--strategy", "ddpp"], "unknown --strategy ddpp; choose 'auto' or one of ['ddp', "),
        (["--strategy", "dp"], "--strategy dp (Lightning Fabric's) is not offered; use strategy='ddp'"),
        (["--precision", "17-true"], "precision='17-true' is not supported"),
        (["--accelerator", "abacus"], "Unknown accelerator 'abacus'"),
        (["--accelerator", "cpu", "--devices", "0,1"], "devices=[0, 1] is not valid for the cpu accelerator"),
    ],
    ids=["spawn", "notebook", "node-rank", "unknown-strategy", "dp", "precision", "accelerator", "devices"],
)
def test_what_cannot_launch_is_refused_before_any_process_starts(script, launches, capsys, flags, text):
    assert phalanx_cli.main(["run", *flags, str(script)]) == 2
    assert text in capsys.readouterr().err and launches == []
    assert RUN_MARKER not in os.environ


def test_a_missing_script_is_refused(tmp_path, launches, capsys):
    assert phalanx_cli.main(["run", str(tmp_path / "nowhere.py")]) == 2
    assert "the script" in capsys.readouterr().err and launches == []


@pytest.mark.parametrize("flag", ["--devices 0", "--num-nodes 0", "--main-port 70000", "--node-rank -1"])
def test_bad_numbers_are_usage_errors(script, flag):
    with pytest.raises(SystemExit) as exited:
        phalanx_cli.main(["run", *flag.split(), str(script)])
    assert exited.value.code == 2


@pytest.mark.parametrize(
    "cluster",
    [
        {
            "TORCHELASTIC_RUN_ID": "x",
            "RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_RANK": "0",
            "MASTER_ADDR": "h",
            "MASTER_PORT": "1",
        },
        {"SLURM_NTASKS": "1", "SLURM_JOB_NAME": "train"},
    ],
    ids=["torchrun", "slurm"],
)
def test_inside_a_started_job_the_script_runs_in_this_process(script, launches, monkeypatch, tmp_path, cluster):
    for name, value in cluster.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr("sys.argv", ["before"])
    monkeypatch.setattr("sys.path", list(__import__("sys").path))
    out = tmp_path / "ran.txt"
    assert phalanx_cli.main(["run", "--accelerator", "cpu", "--devices", "1", str(script), str(out), "a", "b"]) == 0
    assert launches == [] and out.read_text() == "a b|1"


# ---------------------------------------------------------------------------- the Cohort's side
def test_the_defaults_are_the_cohorts():
    parameters = inspect.signature(Cohort.__init__).parameters
    assert {name: parameters[name].default for name in COHORT_DEFAULTS} == COHORT_DEFAULTS


def _under_run(monkeypatch: pytest.MonkeyPatch, **values: str) -> None:
    monkeypatch.setenv(RUN_MARKER, "1")
    for name, value in values.items():
        monkeypatch.setenv(RUN_VARIABLES[name], value)


GIVEN = dict(COHORT_DEFAULTS)


@pytest.mark.parametrize(
    ("variables", "given", "expected"),
    [
        ({"devices": "2", "num_nodes": "1"}, {}, {"devices": 2, "num_nodes": 1}),
        ({"devices": "0,1"}, {}, {"devices": [0, 1]}),
        ({"devices": "-1"}, {}, {"devices": -1}),
        ({"devices": "auto", "strategy": "fsdp"}, {}, {"devices": "auto", "strategy": "fsdp"}),
        ({"precision": "bf16-mixed"}, {"precision": "bf16-mixed"}, {"precision": "bf16-mixed"}),  # the same value twice
        ({"devices": "2"}, {"devices": 2}, {"devices": 2}),
        ({"accelerator": "cpu"}, {"devices": 3}, {"accelerator": "cpu", "devices": 3}),  # only what the command set
    ],
)
def test_the_command_lines_values_replace_the_defaults(monkeypatch, variables, given, expected):
    _under_run(monkeypatch, **variables)
    assert settings_from_run({**GIVEN, **given}) == {**GIVEN, **given, **expected}


@pytest.mark.parametrize(
    ("variables", "given"),
    [
        ({"devices": "2"}, {"devices": 4}),
        ({"strategy": "ddp"}, {"strategy": "fsdp"}),
        ({"num_nodes": "2"}, {"num_nodes": 3}),
    ],
)
def test_an_argument_that_contradicts_the_command_line_is_refused(monkeypatch, variables, given):
    _under_run(monkeypatch, **variables)
    name = next(iter(given))
    with pytest.raises(
        ValueError, match=f"Cohort\\({name}=.*\\) conflicts with --{name.replace('_', '-')} .* given to phalanx run"
    ):
        settings_from_run({**GIVEN, **given})


def test_outside_phalanx_run_the_variables_are_ignored(monkeypatch):
    monkeypatch.setenv(RUN_VARIABLES["devices"], "2")  # without the marker: left from elsewhere
    assert settings_from_run(dict(GIVEN)) == GIVEN


def test_a_cohort_built_under_phalanx_run_uses_its_settings(monkeypatch):
    _under_run(monkeypatch, accelerator="cpu", devices="1", precision="64-true", strategy="single_device")
    cohort = Cohort()
    assert type(cohort.strategy).__name__ == "SingleDeviceStrategy"
    assert cohort.strategy.precision_plugin.precision == "64-true"
    with pytest.raises(ValueError, match="conflicts with --precision 64-true given to phalanx run"):
        Cohort(precision="bf16-mixed")
