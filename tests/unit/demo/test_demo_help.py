"""``phalanx demo --help`` promises only what the demo does and states each default once."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from phalanx.cli import build_parser


@pytest.fixture(scope="module")
def demo_help() -> str:
    parser = build_parser()
    demo = next(a for a in parser._subparsers._group_actions if a.dest == "command").choices["demo"]
    return " ".join(demo.format_help().split())  # argparse wraps at the terminal width


def test_each_option_states_its_default_once(demo_help):
    options = re.split(r"(?= --[a-z-]+ [A-Z_]+ | --no-progress-bar )", demo_help.split("options:")[1])
    options = [option for option in options if option.strip().startswith("--")]
    assert len(options) == 8
    for option in options:
        assert option.count("default:") == 1, option


def test_the_default_root_dir_is_described_not_shown_as_none(demo_help):
    assert "(default: phalanx_demo under the system temp dir)" in demo_help
    assert "(default: None)" not in demo_help


def test_the_help_promises_no_run_time_it_cannot_keep(demo_help):
    assert "well under a minute" not in demo_help
    assert "--max-steps 100" in demo_help


def test_the_command_line_help_is_the_same():
    result = subprocess.run(
        [sys.executable, "-m", "phalanx", "demo", "--help"], capture_output=True, text=True, check=True
    )
    assert "(default: None)" not in result.stdout and "well under a minute" not in " ".join(result.stdout.split())
