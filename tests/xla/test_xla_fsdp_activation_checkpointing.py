"""xla_fsdp's activation_checkpointing_policy on PJRT CPU devices: on one device the checkpointed layers run their
forward again in the backward pass and the run matches plain CPU PyTorch; where replicas are threads of one process
(2 CPU devices), where torch_xla's recomputation failed, it is refused with a message, not left to fail or hang."""

from __future__ import annotations

from pathlib import Path

from xla_helpers import run_scenario

SCRIPT = Path(__file__).with_name("xla_fsdp_scenarios.py")


def test_checkpointed_layers_are_recomputed_and_the_run_matches_plain_pytorch(tmp_path: Path) -> None:
    result = run_scenario("checkpointed_activations", tmp_path, devices=1, script=SCRIPT)
    steps, calls = result["calls"]
    assert steps == 8 and result["cpu_calls"] == [8, 8, 8]
    # The first layer's input needs no gradient, so torch_xla does not checkpoint it; the others run twice a step.
    assert calls == [steps, 2 * steps, 2 * steps]
    assert result["param_diff"] < 1e-6  # measured: 6e-8
    assert result["restored_forwards"]  # the module's own forward methods are back after fit


def test_replica_threads_are_refused_with_the_reason(tmp_path: Path) -> None:
    result = run_scenario("checkpointed_activations", tmp_path, devices=2, script=SCRIPT)
    assert result["refused"].startswith("ValueError: XLAFSDPStrategy(activation_checkpointing_policy=...) is not")
    assert "threads of one process" in result["refused"] and "leave the policy out" in result["refused"]
