"""The tuner on DDP's 2 CPU processes against Lightning 2.6 in the same processes (one launch of
tests/distributed/scripts/tuner_job.py): lr_find through the Tuner and through the callback (which stops early on both
ranks) gives Lightning's rates, losses and suggestion on every rank, and the fit after it Lightning's weights;
scale_batch_size (power through the Tuner, binsearch through the callback, an out-of-memory error raised above a size)
finds the size Lightning finds on one device, which Lightning refuses to search on DDP, and the fit after it trains as
Lightning's DDP fit at that size. Nothing is left in the root folder: with the Trainer's defaults (the callback's LR
sweep) the fit's own checkpoint is its one file, as Lightning's is."""

from __future__ import annotations

import json

import pytest
import torch
from phalanx_distributed import assert_ok, run_script

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
pytest.importorskip("pytorch_lightning", reason="Lightning 2.6 is the oracle of this file")

LR_CASES = ("lr_find_tuner", "lr_find_callback")
SIZE_CASES = ("power_tuner", "binsearch_callback")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("tuner")
    assert_ok(run_script("tuner_job.py", str(out), timeout=400))
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("case", LR_CASES + SIZE_CASES)
@pytest.mark.parametrize("key", ["lr", "loss", "suggestion", "size", "model_lr", "model_batch_size", "global_step"])
def test_each_rank_finds_what_lightning_finds(ranks, case, key, rank):
    assert ranks[rank]["phalanx"][case][key] == ranks[rank]["lightning"][case][key]


@pytest.mark.parametrize("case", LR_CASES + SIZE_CASES)
def test_the_fit_after_tuning_ends_with_lightnings_weights_on_both_ranks(ranks, case):
    ours = [rank["phalanx"][case]["weights"] for rank in ranks]
    assert ours[0] == ours[1]
    assert ours == [rank["lightning"][case]["weights"] for rank in ranks]
    # Rank 0's listing: rank 0 removes a checkpoint the fit replaced, which rank 1 may list before that is done.
    assert ranks[0]["phalanx"][case]["checkpoints"] == ranks[0]["lightning"][case]["checkpoints"]


@pytest.mark.parametrize("case", LR_CASES)
def test_every_rank_takes_rank_zeros_curve_and_suggestion(ranks, case):
    first, second = (rank["phalanx"][case] for rank in ranks)
    assert (first["lr"], first["loss"], first["suggestion"]) == (second["lr"], second["loss"], second["suggestion"])
    assert first["suggestion"] is not None and first["model_lr"] == first["suggestion"] == second["model_lr"]


def test_the_callback_sweep_stops_early_on_both_ranks_and_leaves_the_fits_checkpoint_only(ranks):
    lengths = [len(rank["phalanx"]["lr_find_callback"]["lr"]) for rank in ranks]
    assert lengths[0] == lengths[1] < 24  # of num_training_steps=24: the loss diverged
    assert ranks[0]["phalanx"]["lr_find_callback"]["checkpoints"] == ["epoch=2-step=24.ckpt"]


@pytest.mark.parametrize("case", SIZE_CASES)
def test_the_batch_size_is_searched_on_ddp_where_lightning_refuses(ranks, case):
    for rank in ranks:
        assert "not supported with distributed strategies" in rank["lightning"][case]["ddp_refusal"]
        assert rank["phalanx"][case]["size"] == rank["phalanx"][case]["model_batch_size"] < 16  # 16 runs out of memory
