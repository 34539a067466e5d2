"""The GPT of issue 37's independent benchmark at CPU size, and a dynamo backend that records what it compiles.

The model is written as that benchmark wrote it (exact GELU, q/k/v split by one view and permute, the GPT held by the
TrainingModule as an attribute, its 12 blocks in a ModuleList: 12 blocks sharing one code object make dynamo's
recompile limit matter). :class:`Recorder` wraps ``aot_eager`` and keeps, for every graph dynamo hands it, whether
grad mode was on, whether any size is symbolic (dynamic), and the dtypes of every matmul's inputs in the forward and
backward graphs that AOTAutograd traced from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from functorch.compile import make_boxed_func
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import phalanx

LAYERS, WIDTH, HEADS, CONTEXT, VOCAB = 12, 32, 4, 16, 64
MATMULS = ("mm", "addmm", "bmm", "baddbmm")


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, HEADS, width // HEADS).permute(2, 0, 3, 1, 4)
        # The matmuls written out (not scaled_dot_product_attention) so that their dtypes show as bmm in the graphs.
        scores = (q @ k.transpose(-2, -1)) / (width // HEADS) ** 0.5
        causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        attended = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        return self.proj(attended.transpose(1, 2).reshape(batch, length, width))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, 4 * WIDTH)
        self.proj = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(WIDTH), Attention(), nn.LayerNorm(WIDTH), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, layers: int = LAYERS) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, WIDTH), nn.Embedding(CONTEXT, WIDTH)
        self.h = nn.ModuleList(Block() for _ in range(layers))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def next_token_loss(gpt: nn.Module, batch: Any) -> torch.Tensor:
    tokens, targets = batch
    logits = gpt(tokens)
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1))


class GPTModule(phalanx.TrainingModule):
    """The GPT as an attribute (``self.gpt``), called by the steps: the TrainingModule's own forward never runs.

    ``layers`` below 12 where the whole GPT is compiled: its graph grows with every block (tracing 12 takes minutes on
    a loaded 2-core machine), and the count matters only where blocks share one compiled code object.
    """

    def __init__(self, layers: int = LAYERS) -> None:
        super().__init__()
        self.gpt = GPT(layers)

    def configure_model(self) -> None:
        mesh = self.device_mesh  # model_parallel: shard each block, then the root, over the data-parallel ranks
        if mesh is not None and "data_parallel" in (mesh.mesh_dim_names or ()):
            from torch.distributed.fsdp import fully_shard  # only model_parallel runs reach it

            for block in self.gpt.h:
                fully_shard(block, mesh=mesh["data_parallel"])
            fully_shard(self, mesh=mesh["data_parallel"])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = next_token_loss(self.gpt, batch)
        self.log("loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", next_token_loss(self.gpt, batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def token_data(batches: int, batch_size: int, seed: int = 0) -> DataLoader:
    """Random next-token pairs from a CPU DataLoader."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batches * batch_size, CONTEXT + 1), generator=generator)
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch_size)


@dataclass
class Graph:
    """One graph dynamo compiled."""

    grad_enabled: bool
    dynamic: bool
    #: The input dtypes of each matmul of the forward graph, then of the backward graph (when one was traced).
    forward_matmuls: list[tuple[str, ...]] = field(default_factory=list)
    backward_matmuls: list[tuple[str, ...]] = field(default_factory=list)


def _matmul_dtypes(graph: torch.fx.GraphModule) -> list[tuple[str, ...]]:
    found = []
    for node in graph.graph.nodes:
        name = getattr(node.target, "__name__", "").split(".")[0]
        if node.op == "call_function" and name in MATMULS:
            inputs = [arg for arg in node.args if isinstance(arg, torch.fx.Node) and "val" in arg.meta]
            found.append(tuple(str(arg.meta["val"].dtype).removeprefix("torch.") for arg in inputs))
    return found


def _has_symbolic_sizes(graph: torch.fx.GraphModule) -> bool:
    for node in graph.graph.nodes:
        value = node.meta.get("example_value")
        if node.op == "placeholder" and isinstance(value, torch.SymInt):
            return True
        if node.op == "placeholder" and isinstance(value, torch.Tensor):
            if any(isinstance(size, torch.SymInt) for size in value.shape):
                return True
    return False


class Recorder:
    """A dynamo backend (``aot_eager`` underneath) that records a :class:`Graph` per compiled graph."""

    def __init__(self) -> None:
        self.graphs: list[Graph] = []

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        record = Graph(grad_enabled=torch.is_grad_enabled(), dynamic=_has_symbolic_sizes(graph))
        self.graphs.append(record)

        def forward(traced: torch.fx.GraphModule, inputs: list[Any]) -> Any:
            record.forward_matmuls = _matmul_dtypes(traced)
            return make_boxed_func(traced)

        def backward(traced: torch.fx.GraphModule, inputs: list[Any]) -> Any:
            record.backward_matmuls = _matmul_dtypes(traced)
            return make_boxed_func(traced)

        return aot_autograd(fw_compiler=forward, bw_compiler=backward)(graph, example_inputs)

    def matmul_dtypes(self) -> set[str]:
        """Every dtype that any matmul of any recorded graph takes as input."""
        return {
            dtype
            for graph in self.graphs
            for dtypes in graph.forward_matmuls + graph.backward_matmuls
            for dtype in dtypes
        }
