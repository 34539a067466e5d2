"""The ranks of one DDP run agree on trainer.log_dir: rank 0 claims the version and every rank uses it, even when
another run claims the next version of the same folder between rank 0's claim and the other ranks' first look."""

from __future__ import annotations

import json
import os

import pytest
from phalanx_distributed import assert_ok, run_script


@pytest.mark.parametrize(("existing", "ours", "theirs"), [((), 0, 1), ((0, 1), 2, 3)])
def test_ranks_share_rank_zeros_version_while_another_run_claims_the_next(tmp_path, existing, ours, theirs) -> None:
    out, save_dir = tmp_path / "out", tmp_path / "save"
    out.mkdir()
    for version in existing:
        (save_dir / "logs" / f"version_{version}").mkdir(parents=True)
    assert_ok(run_script("log_version_job.py", str(out), str(save_dir)))
    rank0, rank1 = (json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1))
    expected = os.path.join(str(save_dir), "logs", f"version_{ours}")
    assert rank0["other_run"] == theirs  # the other run took the next version while this run set up
    for rank in (rank0, rank1):
        assert (rank["setup"], rank["after_fit"]) == (expected, expected), (rank0, rank1)
    assert (save_dir / "logs" / f"version_{ours}" / "metrics.csv").is_file()  # rank 0 logged there
    assert sorted(os.listdir(save_dir / "logs")) == sorted(f"version_{v}" for v in (*existing, ours, theirs))
    assert os.listdir(save_dir / "logs" / f"version_{theirs}") == []  # nothing of this run went into the other's
