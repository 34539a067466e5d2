"""What dynamo compiles on one process for issue 37's model (``tests/phalanx_compile.py``), asked either way, at each
precision, with the Trainer's defaults on: as few graphs as a hand-written loop, no graph break, no recompilation
after the first epoch, a static training graph, and matmuls in the precision's dtype.

Found on this CPU (aot_eager; issue 37): the sanity check compiled the model first, under inference mode and with the
validation batches' sizes; dynamo then compiled training as a recompilation and marked every size that differed
dynamic, so training ran a dynamic-shape graph that a hand-written loop (which compiles for training first) never
runs. The sanity check now runs eagerly. The 12 blocks share one code object without a recompilation per block
(dynamo does not guard on the block instance), and the matmuls were bfloat16 under 'bf16-mixed' either way.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo
from phalanx_compile import LAYERS, GPTModule, Recorder, next_token_loss, token_data
from torch._dynamo.utils import counters

import phalanx

TRAIN_BATCH, VAL_BATCH = 2, 3  # validation batches of another size, as a user's often are
#: The whole GPT is traced as one graph: 3 blocks keep that quick; 12 blocks share one code object per block.
LAYERS_PER_UNIT = {"model": 3, "blocks": LAYERS}
DTYPES = {"32-true": {"float32"}, "bf16-mixed": {"bfloat16"}}


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    # One thread: aot_eager's many small kernels took seconds a step with two threads on this shared 2-core machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    torch.set_num_threads(threads)


class _GraphsPerEpoch(phalanx.Callback):
    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self.counts: list[int] = []

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        self.counts.append(len(self.recorder.graphs))


def _fit(tmp_path: Path, how: str, unit: str, precision: str) -> tuple[Recorder, _GraphsPerEpoch]:
    """Two epochs with the Trainer's defaults (sanity check, validation, logger, checkpoints, bar, summary)."""
    recorder = Recorder()
    per_epoch = _GraphsPerEpoch(recorder)
    torch.manual_seed(0)
    model: Any = GPTModule(LAYERS_PER_UNIT[unit])
    options: dict[str, Any] = {}
    if how == "fit(torch.compile(model))":
        model = torch.compile(model, backend=recorder)
    else:
        options["compile"] = {"backend": recorder, **({"unit": "blocks"} if how == "unit=blocks" else {})}
    trainer = phalanx.Trainer(
        accelerator="cpu", devices=1, precision=precision, max_epochs=2, callbacks=[per_epoch],
        default_root_dir=str(tmp_path), **options,
    )  # fmt: skip
    trainer.fit(model, token_data(4, TRAIN_BATCH), token_data(2, VAL_BATCH, seed=1))
    return recorder, per_epoch


@functools.lru_cache(maxsize=None)
def _loop(unit: str, precision: str) -> Recorder:
    """A hand-written loop on the same model: compiled whole or per block, trained, then validated (once per case)."""
    torch._dynamo.reset()
    recorder = Recorder()
    torch.manual_seed(0)
    gpt = GPTModule(LAYERS_PER_UNIT[unit]).gpt
    for target in [gpt] if unit == "model" else list(gpt.h):
        target.compile(backend=recorder)
    optimizer = torch.optim.AdamW(gpt.parameters(), lr=1e-3)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed")
    for _ in range(2):
        for batch in token_data(4, TRAIN_BATCH):
            with autocast:
                next_token_loss(gpt, batch).backward()
            optimizer.step()
            optimizer.zero_grad()
        with torch.inference_mode(), autocast:
            for batch in token_data(2, VAL_BATCH, seed=1):
                next_token_loss(gpt, batch)
    return recorder


@pytest.mark.parametrize(
    ("how", "unit", "precision"),
    [
        ("compile={...}", "model", "bf16-mixed"),
        ("compile={...}", "model", "32-true"),
        ("fit(torch.compile(model))", "model", "bf16-mixed"),
        ("unit=blocks", "blocks", "bf16-mixed"),
    ],
)
def test_a_compiled_fit_compiles_what_a_hand_written_loop_compiles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str, unit: str, precision: str
) -> None:
    monkeypatch.chdir(tmp_path)
    recorder, per_epoch = _fit(tmp_path, how, unit, precision)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == len(recorder.graphs)
    graphs = recorder.graphs
    assert graphs and graphs[0].grad_enabled, "the sanity check compiled before training"
    training = [graph for graph in graphs if graph.grad_enabled]
    assert not [graph for graph in training if graph.dynamic], "training runs a graph with dynamic sizes"
    assert per_epoch.counts == [per_epoch.counts[0]] * 2  # nothing compiles after the first epoch
    loop = _loop(unit, precision)
    assert [graph.grad_enabled for graph in graphs] == [graph.grad_enabled for graph in loop.graphs] == [True, False]
    # Every matmul of the blocks (and of the head, in the whole model) runs in the precision's dtype, as in the loop.
    assert recorder.matmul_dtypes() == loop.matmul_dtypes() == DTYPES[precision]
    assert [len(graph.forward_matmuls) for graph in graphs] == [len(graph.forward_matmuls) for graph in loop.graphs]


@pytest.mark.parametrize("how", ["compile={...}", "cohort.setup(torch.compile(model))"])
def test_the_cohort_compiles_once_for_training_in_bfloat16(how: str) -> None:
    recorder = Recorder()
    torch.manual_seed(0)
    module = GPTModule(LAYERS_PER_UNIT["model"])
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    if how == "compile={...}":
        cohort = phalanx.Cohort(accelerator="cpu", devices=1, precision="bf16-mixed", compile={"backend": recorder})
        model, optimizer = cohort.setup(module, optimizer)
    else:
        cohort = phalanx.Cohort(accelerator="cpu", devices=1, precision="bf16-mixed")
        model, optimizer = cohort.setup(torch.compile(module, backend=recorder), optimizer)
    for batch in token_data(3, TRAIN_BATCH):
        with cohort.autocast():
            loss = next_token_loss(model.gpt, batch)
        cohort.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    assert module.gpt._compiled_call_impl is not None  # the model unit: the GPT that holds the blocks
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert [graph.grad_enabled for graph in recorder.graphs] == [True]
    assert recorder.matmul_dtypes() == {"bfloat16"}
