"""Two GPT-2-small-shaped decoders (pre-norm blocks, causal attention, untied head), written two ways, and their
synthetic tokens: the project's own ("project") and that of issue 37's independent benchmark ("independent")."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class Shape:
    """The transformer's size and the batch it trains on."""

    layers: int = 12
    width: int = 768
    heads: int = 12
    context: int = 1024
    batch: int = 8
    vocab: int = 50257
    #: How the model is written: "project" (:class:`GPT`) or "independent" (:class:`IndependentGPT`).
    style: str = "project"

    def as_dict(self) -> dict[str, int | str]:
        return asdict(self)


#: Issue 26's model (163 M parameters with an untied head) and a CPU-sized one for the smoke test.
FULL = Shape()
TINY = Shape(layers=2, width=64, heads=4, context=64, batch=2, vocab=512)
#: Issue 37's independent benchmark: vocabulary 50304 (a multiple of 64, whose head matmuls run fast), written apart.
INDEPENDENT = Shape(vocab=50304, style="independent")
#: Its CPU size keeps the 12 blocks (with 12 blocks sharing one code object, dynamo's cache size limit matters).
INDEPENDENT_TINY = Shape(layers=12, width=32, heads=4, context=16, batch=2, vocab=64, style="independent")
#: ``--shape`` names: (full, tiny).
SHAPES = {"project": (FULL, TINY), "independent": (INDEPENDENT, INDEPENDENT_TINY)}


class Block(nn.Module):
    """LayerNorm, causal self-attention, LayerNorm, 4x MLP with GELU; both with residuals."""

    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.heads = shape.heads
        self.norm1 = nn.LayerNorm(shape.width)
        self.qkv = nn.Linear(shape.width, 3 * shape.width)
        self.proj = nn.Linear(shape.width, shape.width)
        self.norm2 = nn.LayerNorm(shape.width)
        self.up = nn.Linear(shape.width, 4 * shape.width)
        self.down = nn.Linear(4 * shape.width, shape.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.down(F.gelu(self.up(self.norm2(x)), approximate="tanh"))


class GPT(nn.Module):
    """Token and position embeddings, ``shape.layers`` blocks, a final LayerNorm and an untied vocabulary head."""

    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.tokens = nn.Embedding(shape.vocab, shape.width)
        self.positions = nn.Embedding(shape.context, shape.width)
        self.blocks = nn.ModuleList(Block(shape) for _ in range(shape.layers))
        self.norm = nn.LayerNorm(shape.width)
        self.head = nn.Linear(shape.width, shape.vocab, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tokens(tokens) + self.positions(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class IndependentAttention(nn.Module):
    """Causal self-attention whose q, k, v come out of one view and permute (as the independent benchmark wrote it)."""

    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.heads = shape.heads
        self.qkv = nn.Linear(shape.width, 3 * shape.width)
        self.proj = nn.Linear(shape.width, shape.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        qkv = self.qkv(x).view(batch, length, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        return self.proj(attended.transpose(1, 2).reshape(batch, length, width))


class IndependentMLP(nn.Module):
    """4x MLP with the exact (erf) GELU."""

    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.fc = nn.Linear(shape.width, 4 * shape.width)
        self.proj = nn.Linear(4 * shape.width, shape.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class IndependentBlock(nn.Module):
    """Pre-norm attention and MLP, each a submodule of its own."""

    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(shape.width)
        self.attn = IndependentAttention(shape)
        self.ln_2 = nn.LayerNorm(shape.width)
        self.mlp = IndependentMLP(shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class IndependentGPT(nn.Module):
    """The same architecture as :class:`GPT`, written as issue 37's independent benchmark wrote it."""

    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.wte = nn.Embedding(shape.vocab, shape.width)
        self.wpe = nn.Embedding(shape.context, shape.width)
        self.h = nn.ModuleList(IndependentBlock(shape) for _ in range(shape.layers))
        self.ln_f = nn.LayerNorm(shape.width)
        self.lm_head = nn.Linear(shape.width, shape.vocab, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    @property
    def blocks(self) -> nn.ModuleList:
        return self.h

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build(shape: Shape) -> nn.Module:
    """The model of ``shape.style``."""
    return IndependentGPT(shape) if shape.style == "independent" else GPT(shape)


def next_token_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of predicting token t+1 from tokens up to t (inputs and targets are one sequence shifted)."""
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


class TokenBatches(torch.utils.data.Dataset):
    """``length`` batches of random tokens cycled from a small pool made once on ``device``: no host work per step
    (on the CPU for the independent style, whose batches reach the device through the loop or the framework)."""

    def __init__(self, shape: Shape, device: torch.device, length: int, pool: int = 4, seed: int = 0) -> None:
        generator = torch.Generator(device=device).manual_seed(seed)
        size = (pool, shape.batch, shape.context + 1)
        self.pool = torch.randint(0, shape.vocab, size, device=device, generator=generator)
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.pool[index % len(self.pool)]


def batches(shape: Shape, device: torch.device, length: int) -> torch.utils.data.DataLoader:
    """A loader of whole batches (``batch_size=None``): made on ``device`` for the project's style, on the CPU (pinned
    for a GPU) for the independent one, as its benchmark's CPU DataLoader gave them."""
    if shape.style != "independent":
        return torch.utils.data.DataLoader(TokenBatches(shape, device, length), batch_size=None, shuffle=False)
    pin = device.type == "cuda"
    return torch.utils.data.DataLoader(
        TokenBatches(shape, torch.device("cpu"), length), batch_size=None, shuffle=False, pin_memory=pin
    )
