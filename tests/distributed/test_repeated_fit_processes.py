"""A second fit on a Trainer whose first fit ran in spawned or forked processes continues where rank 0 stopped."""

from __future__ import annotations

import json

import pytest
import torch
from phalanx_distributed import assert_ok, run_script

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")


@pytest.mark.parametrize("strategy", ["ddp_spawn", "ddp_fork"])
def test_second_fit_after_a_launched_one_continues_inside_the_interrupted_epoch(tmp_path, strategy):
    assert_ok(run_script("spawn_second_fit.py", str(tmp_path), strategy))
    main = json.loads((tmp_path / "main.json").read_text())
    assert main["world_size_before_fit"] == 2
    assert main["first"] == [1, 7] and main["second"] == [2, 12]
    assert main["same_as_one_fit"] is True  # stopped at step 7 and continued: the weights of one fit to step 12
