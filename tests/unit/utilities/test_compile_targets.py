"""What each compile unit compiles in a module (``phalanx.utilities.compile``), the ``"unit"`` key of ``compile={...}``
checked and kept away from torch.compile, and the set-up log line naming what was compiled."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from phalanx.utilities.compile import (
    check_compile,
    compile_in_place,
    compile_targets,
    compiler_for,
    describe_targets,
    model_unit,
    split_unit,
)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.linear(x)


class OtherBlock(Block):
    """Another block type (an encoder's beside a decoder's)."""


class Stack(nn.Module):
    """Blocks in a ModuleList (the GPT a TrainingModule keeps as an attribute)."""

    def __init__(self, kind: type = Block) -> None:
        super().__init__()
        self.h = nn.ModuleList([kind(), kind()])
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.h:
            x = block(x)
        return self.head(x)


class NanoGPT(nn.Module):
    """Blocks in a ModuleDict's ModuleList (``self.transformer.h``): neither container has a forward of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict({"h": nn.ModuleList([Block(), Block()]), "ln_f": nn.LayerNorm(4)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.transformer["h"]:
            x = block(x)
        return self.transformer["ln_f"](x)


class Holder(nn.Module):
    """The module a Trainer sets up, holding ``children`` as attributes."""

    def __init__(self, **children: nn.Module) -> None:
        super().__init__()
        for name, child in children.items():
            self.add_module(name, child)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class Seq2Seq(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder, self.decoder = Stack(Block), Stack(OtherBlock)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))


MODELS: list[tuple[str, Any, str, list[str]]] = [
    # (case, a module factory, the "model" unit's name ('' is the module itself), the "blocks" unit's names)
    ("gpt as an attribute", lambda: Holder(gpt=Stack()), "gpt", ["gpt.h.0", "gpt.h.1"]),
    ("blocks on the module itself", lambda: Stack(), "", ["h.0", "h.1"]),
    ("nanoGPT's ModuleDict", lambda: Holder(gpt=NanoGPT()), "gpt", ["gpt.transformer.h.0", "gpt.transformer.h.1"]),
    (
        "encoder and decoder",
        lambda: Holder(model=Seq2Seq(), loss=nn.MSELoss()),
        "model",
        ["model.encoder.h.0", "model.encoder.h.1", "model.decoder.h.0", "model.decoder.h.1"],
    ),  # fmt: skip
    ("root Sequential of blocks", lambda: nn.Sequential(Block(), Block()), "", ["0", "1"]),
    ("no repeated blocks", lambda: Holder(net=nn.Sequential(nn.Linear(4, 4), nn.ReLU())), "", [""]),
]


def _names(module: nn.Module, targets: list[nn.Module]) -> list[str]:
    names = {id(child): name for name, child in module.named_modules()}
    return [names[id(target)] for target in targets]


@pytest.mark.parametrize(("case", "make", "model", "blocks"), MODELS, ids=[row[0] for row in MODELS])
def test_each_unit_compiles_its_modules(case: str, make: Any, model: str, blocks: list[str]) -> None:
    module = make()
    assert _names(module, [model_unit(module)]) == [model]
    assert _names(module, compile_targets(module, "model")) == [model]
    assert _names(module, compile_targets(module, "blocks")) == blocks


@pytest.mark.parametrize(("case", "make", "model", "blocks"), MODELS, ids=[row[0] for row in MODELS])
@pytest.mark.parametrize("unit", ["model", "blocks"])
def test_compiling_in_place_keeps_the_state_dict_and_the_outputs(
    case: str, make: Any, model: str, blocks: list[str], unit: str
) -> None:
    torch._dynamo.reset()
    module = make()
    x = torch.randn(3, 4)
    eager, keys = module(x), list(module.state_dict())
    targets = compile_in_place(module, compiler_for({"backend": "eager"}, None, "Trainer"), unit)  # type: ignore[arg-type]
    for target in targets:
        # The module itself gets a compiled forward (the strategies redirect its steps through its call).
        compiled = "forward" in module.__dict__ if target is module else target._compiled_call_impl is not None
        assert compiled
    assert list(module.state_dict()) == keys
    torch.testing.assert_close(module(x), eager)
    torch._dynamo.reset()


@pytest.mark.parametrize(("case", "make", "model", "blocks"), MODELS, ids=[row[0] for row in MODELS])
@pytest.mark.parametrize("unit", ["model", "blocks"])
def test_compiling_again_at_a_later_stage_never_compiles_a_compiled_callable(
    case: str, make: Any, model: str, blocks: list[str], unit: str
) -> None:
    """fit, then test: each stage compiles the unit in place again; it must start from the module's own call."""
    given: list[Any] = []
    made: list[Any] = []

    def compiler(function: Any) -> Any:
        given.append(function)

        def compiled(*args: Any, **kwargs: Any) -> Any:
            return function(*args, **kwargs)

        made.append(compiled)
        return compiled

    module = make()
    x = torch.randn(3, 4)
    eager = module(x)
    for _ in range(2):
        compile_in_place(module, compiler, unit)  # type: ignore[arg-type]
    assert len(given) == 2 * len(compile_targets(module, unit))
    assert not any(function in made for function in given)
    torch.testing.assert_close(module(x), eager)


@pytest.mark.parametrize(
    ("value", "options", "unit"),
    [
        (True, {}, None),
        ({"backend": "eager"}, {"backend": "eager"}, None),
        ({"unit": "blocks"}, {}, "blocks"),
        ({"backend": "aot_eager", "unit": "model"}, {"backend": "aot_eager"}, "model"),
    ],
)
def test_the_unit_is_read_by_phalanx_and_never_reaches_torch_compile(value: Any, options: dict, unit: Any) -> None:
    checked = check_compile(value, "Trainer")
    assert checked is not None
    assert split_unit(checked) == (options, unit)
    compiler = compiler_for(checked, None, "Trainer")
    assert compiler is not None and compiler.keywords == options  # type: ignore[attr-defined]


@pytest.mark.parametrize("unit", ["block", "layers", "", 1])
def test_an_unknown_unit_is_refused_with_the_valid_units(unit: Any) -> None:
    with pytest.raises(ValueError, match=r"Trainer\(compile=\{'unit': .*\}\) is not valid; choose 'model' or 'blocks'"):
        check_compile({"unit": unit}, "Trainer")


@pytest.mark.parametrize(
    ("make", "unit", "reason", "line"),
    [
        (lambda: Holder(gpt=Stack()), "model", "DDPStrategy's default", "compiling gpt (Stack) in place"),
        (lambda: Stack(), "model", "DDPStrategy's default", "compiling Stack (Stack) in place"),
        (lambda: Holder(gpt=Stack()), "blocks", "compile={'unit': ...}", "compiling 2 blocks (gpt.h.0 ... gpt.h.1)"),
    ],
)
def test_the_log_line_names_the_unit_the_reason_and_what_was_compiled(
    make: Any, unit: str, reason: str, line: str
) -> None:
    module = make()
    text = describe_targets(module, compile_targets(module, unit), unit, reason)  # type: ignore[arg-type]
    assert text.startswith(f"torch.compile: unit {unit!r} ({reason}): ")
    assert line in text
