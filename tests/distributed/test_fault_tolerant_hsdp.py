"""strategy='hsdp_ft': FSDP inside replica groups of two processes, torchft across two groups (a lighthouse in this
process). One process of group 1 is killed with SIGKILL, the whole group ends, group 0 trains on alone, and the
restarted group heals shard by shard from group 0's processes; every process ends with the weights of one process
trained on the committed batches, and group 0's checkpoint resumes on 'fsdp'."""

from __future__ import annotations

import re
import signal

import pytest
import torch
from ft_harness import read_json, steered_kill_and_rejoin

pytest.importorskip("torchft")


@pytest.fixture(scope="module")
def hsdp_ft(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    out = tmp_path_factory.mktemp("hsdp_ft_groups")
    run = steered_kill_and_rejoin(out, "hsdp_ft")
    run["initial"] = {path.name: read_json(path) for path in sorted(out.glob("initial.group*.json"))}
    run["reference"] = run["job"].reference_fit(out, run["initial"]["initial.group0.rank0.json"])
    run["out"] = out
    return run


def _close(got: list[list[float]], want: list[list[float]]) -> float:
    return max(abs(a - b) for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True))


def test_every_group_starts_from_the_same_weights(hsdp_ft):
    initial = list(hsdp_ft["initial"].values())
    assert len(initial) >= 4, sorted(hsdp_ft["initial"])  # both processes of both groups' first lives
    for weights in initial[1:]:
        assert _close(weights, initial[0]) == 0.0


def test_every_process_ends_with_the_weights_of_one_process_on_the_committed_batches(hsdp_ft):
    assert len(hsdp_ft["results"]) == 4, sorted(hsdp_ft["results"])
    for name, result in hsdp_ft["results"].items():
        assert result["global_step"] == hsdp_ft["max_steps"], name
        assert _close(result["weights"], hsdp_ft["reference"]) < 1e-6, f"{name} differs from the reference"


def test_the_processes_of_a_group_hold_the_parameters_once_between_them(hsdp_ft):
    results = hsdp_ft["results"]
    for group in range(2):
        held = [results[f"group{group}.rank{rank}.json"]["local_bytes"] for rank in range(2)]
        whole = results[f"group{group}.rank0.json"]["model_bytes"]
        # FSDP splits each parameter's first dimension in two (the last layer's single row stays on rank 0).
        assert sum(held) == whole and max(held) < whole and min(held) <= whole // 2, (group, held, whole)


def test_the_survivor_committed_steps_alone_and_with_the_restarted_group(hsdp_ft):
    sizes = [len(indices) for indices in hsdp_ft["steps"]]
    both, alone = 2 * 2 * hsdp_ft["batch"], 2 * hsdp_ft["batch"]
    assert len(sizes) == hsdp_ft["max_steps"] and sizes[0] == both and alone in sizes and sizes[-1] == both, sizes
    indices = [index for step in hsdp_ft["steps"] for index in step]
    assert len(set(indices)) == len(indices)  # no sample trained twice by committed steps


def test_killing_one_process_ends_its_group_and_the_restart_heals_from_a_peer(hsdp_ft):
    survivor, first_life, restarted = hsdp_ft["logs"]
    assert hsdp_ft["killed_code"] == 1, first_life[-3000:]
    assert f"a process of this job exited with status {-signal.SIGKILL}; stopping the others" in first_life
    left = survivor.index("Replica group(s) [1] left the quorum")
    assert "replica group 0 trains on with replica groups [0]." in survivor[left:]
    assert "Replica group(s) [1] joined the quorum" in survivor[left:]
    healed = re.search(r"Replica group 1 healed from a peer \(no checkpoint read\).*global_step=(\d+)", restarted)
    assert healed and int(healed.group(1)) >= 2, restarted[-3000:]
    assert "Restoring states from the checkpoint" not in restarted  # the state came from the peer, not a file


def test_group_zero_checkpoint_resumes_on_fsdp(hsdp_ft, tmp_path):
    import phalanx

    (checkpoint,) = hsdp_ft["results"]["group0.rank0.json"]["checkpoints"]
    assert not hsdp_ft["results"]["group1.rank0.json"]["checkpoints"]  # replica group 0 alone writes
    saved = torch.load(checkpoint, map_location="cpu", weights_only=False)
    assert saved["global_step"] == hsdp_ft["max_steps"] and saved["optimizer_states"][0]["state"]
    job = hsdp_ft["job"]
    model = job.MomentumNet()
    trainer = phalanx.Trainer(
        strategy="fsdp", accelerator="cpu", devices=1, max_steps=hsdp_ft["max_steps"], default_root_dir=str(tmp_path)
    )
    train = job.DataLoader(job.IndexedRegression(n=job.SAMPLES), batch_size=job.BATCH)
    try:
        trainer.fit(model, train, ckpt_path=checkpoint)  # at max_steps already: it restores and trains no further
        assert trainer.global_step == hsdp_ft["max_steps"]
        assert _close(job.full_weights(model), hsdp_ft["reference"]) < 1e-6
    finally:
        # FSDP keeps its one-process group after fit (its module stays sharded on it); this test process goes on.
        torch.distributed.destroy_process_group()
