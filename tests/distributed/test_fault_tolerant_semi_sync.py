"""strategy='ddp_ft' with DiLoCo (torchft's, FaultTolerance(semi_sync=...)) across two real replica groups of one
process; group 1 kills itself mid-period and is restarted, rejoins from group 0's live state, and both end with the
weights of a one-process replay of DiLoCo written here."""

from __future__ import annotations

import copy
import re
import signal
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from ft_harness import GroupLife, check_exit_codes, group_environment, group_results, import_script, script_life, stop

pytest.importorskip("torchft")

GROUPS = 2
KILLED, KILL_AT_STEP = 1, 4  # group 1 dies after its first step of the second period (steps 4, 5, 6; synced at 6)
WAIT_S = 300  # bound on every wait of the fixture (DiLoCo's runs are longer): a hang fails the test, not CI


def _job():  # the job script's constants and model
    return import_script("ft_semi_sync_job")


def _start(out: Path, group: int, life: int, lighthouse: str, **extra: str) -> GroupLife:
    environment = group_environment(group, GROUPS, lighthouse, **extra)
    return script_life(out, "ft_semi_sync_job.py", group, life, environment)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    from phalanx.strategies.fault_tolerant import start_lighthouse

    out = tmp_path_factory.mktemp("ddp_ft_diloco")
    # Quorums of both groups only: group 0's synchronisation after the kill waits for the restarted group 1.
    with start_lighthouse(min_replicas=GROUPS, join_timeout=timedelta(milliseconds=200)) as lighthouse:
        lives = [
            _start(
                out, group, 0, lighthouse.address, **({"KILL_AT_STEP": str(KILL_AT_STEP)} if group == KILLED else {})
            )
            for group in range(GROUPS)
        ]
        try:
            killed_code = lives[KILLED].wait(WAIT_S)
            lives[KILLED] = _start(out, KILLED, 1, lighthouse.address)
            codes = [life.wait(WAIT_S) for life in lives]
        finally:
            stop(lives)
    check_exit_codes(out, [killed_code], [-signal.SIGKILL])
    check_exit_codes(out, codes, [0] * GROUPS)
    return {
        "results": group_results(out, GROUPS),
        "restart_log": (out / f"group{KILLED}.life1.log").read_text(),
    }


def _batches(job, group: int) -> list[list[int]]:
    """Group ``group``'s batches: its share of the samples (every GROUPS-th from ``group`` on), in batches."""
    share = list(range(group, job.SAMPLES, GROUPS))
    return [share[start : start + job.BATCH] for start in range(0, len(share), job.BATCH)]


def _replay(job) -> list[torch.Tensor]:
    """DiLoCo by hand, one process: each group takes SYNC_EVERY inner steps on its batches, then the outer optimizer
    steps with the groups' mean pseudo-gradient. In the period of the kill only group 0's counts, and group 1 goes on
    with group 0's weights and inner optimizer state (what it received when it rejoined)."""
    import phalanx

    data = job.IndexedRegression(n=job.SAMPLES)
    phalanx.seed_everything(7)
    start = [p.detach().clone() for p in job.MomentumNet().parameters()]  # group 0's, which group 1 receives at once
    models = [torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)) for _ in range(2)]
    global_weights = [p.clone() for p in start]
    inner = [torch.optim.SGD(model.parameters(), **job.INNER) for model in models]
    outer_params = [torch.nn.Parameter(p.clone()) for p in start]
    outer = torch.optim.SGD(outer_params, **job.OUTER)
    for model in models:
        torch.nn.utils.vector_to_parameters(torch.nn.utils.parameters_to_vector(start), model.parameters())
    batches = [_batches(job, group) for group in range(GROUPS)]
    for period in range(job.STEPS // job.SYNC_EVERY):
        lost = period == (KILL_AT_STEP - 1) // job.SYNC_EVERY
        for step in range(period * job.SYNC_EVERY, (period + 1) * job.SYNC_EVERY):
            for group, (model, optimizer) in enumerate(zip(models, inner)):
                x, y, _ = data[batches[group][step]]
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                optimizer.step()
        if lost:  # group 1 died mid-period and rejoined with group 0's state at its synchronisation
            models[1].load_state_dict(models[0].state_dict())
            inner[1].load_state_dict(copy.deepcopy(inner[0].state_dict()))  # a copy, as received over the network
        pseudo = [
            sum(global_weights[i] - list(model.parameters())[i].detach() for model in models) / GROUPS
            for i in range(len(start))
        ]
        for parameter, weights, gradient in zip(outer_params, global_weights, pseudo):
            parameter.data.copy_(weights)
            parameter.grad = gradient
        outer.step()
        global_weights = [p.detach().clone() for p in outer_params]
        for model in models:
            with torch.no_grad():
                for parameter, weights in zip(model.parameters(), global_weights):
                    parameter.copy_(weights)
    return global_weights


def test_every_group_ends_with_the_weights_of_a_one_process_diloco_replay(run):
    job = _job()
    expected = [p.flatten().tolist() for p in _replay(job)]
    for group, result in enumerate(run["results"]):
        assert result["global_step"] == job.STEPS
        for got, want in zip(result["weights"], expected):
            assert max(abs(a - b) for a, b in zip(got, want)) < 1e-6, f"group {group} differs from the replay"


def test_the_killed_group_heals_from_a_peer_after_the_synchronisation_it_missed(run):
    job = _job()
    healed = re.search(r"healed from a peer \(no checkpoint read\).*continues at global_step=(\d+)", run["restart_log"])
    assert healed, run["restart_log"][-3000:]
    assert int(healed.group(1)) == 2 * job.SYNC_EVERY  # after group 0's step 6: it never retrains 5 and 6
    steps = run["results"][KILLED]["steps"]  # both lives: steps 1-4, then 7-9 from the received position on
    assert steps == [batch for index, batch in enumerate(_batches(job, KILLED)[: job.STEPS]) if index not in (4, 5)]
