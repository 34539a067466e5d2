"""A model compiled in place by the user (``model.compile(backend=...)``, on the model or on a submodule) together
with ``compile=`` is refused by the Trainer and the Cohort, as a model wrapped by ``torch.compile`` is: the run's
compilation would replace the user's backend and options without a word. Without ``compile=`` the user's compilation
is the one that runs; the run's own compilation from an earlier stage does not count as the user's."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch._dynamo
from phalanx_testing import Regressor, loaders, quiet_trainer
from torch._dynamo.testing import CompileCounter

import phalanx


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


#: Where the user compiled in place, and what the refusal names.
IN_PLACE: dict[str, tuple[Callable[[Regressor, Any], None], str]] = {
    "the model": (lambda model, backend: model.compile(backend=backend), "The model was compiled in place"),
    "a submodule": (lambda model, backend: model.net.compile(backend=backend), "submodule 'net' was compiled"),
    "a leaf": (lambda model, backend: model.net[0].compile(backend=backend), "submodule 'net.0' was compiled"),
}
OPTIONS = [True, {"backend": "eager"}, {"fullgraph": False}]


def _trainer_fit(model: Regressor, compile: Any, root: Path) -> None:
    quiet_trainer(max_steps=2, compile=compile, default_root_dir=root).fit(model, loaders(n=16)[0])


def _cohort_setup(model: Regressor, compile: Any, root: Path) -> None:
    cohort = phalanx.Cohort(accelerator="cpu", strategy="single_device", devices=1, compile=compile)
    cohort.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))


DRIVERS = {"Trainer": (_trainer_fit, "Trainer"), "Cohort": (_cohort_setup, "Cohort")}


@pytest.mark.parametrize("options", OPTIONS, ids=repr)
@pytest.mark.parametrize("where", list(IN_PLACE))
@pytest.mark.parametrize("driver", list(DRIVERS))
def test_compile_given_for_a_model_compiled_in_place_is_refused(tmp_path: Path, driver: str, where: str, options):
    run, owner = DRIVERS[driver]
    compile_in_place, named = IN_PLACE[where]
    model, counter = Regressor(), CompileCounter()
    compile_in_place(model, counter)
    with pytest.raises(ValueError, match=rf"{named}.*{owner} has compile=\.\.\. too, which would replace"):
        run(model, options, tmp_path)
    assert counter.frame_count == 0  # nothing ran, with either compilation


@pytest.mark.parametrize("where", list(IN_PLACE))
def test_without_compile_the_users_own_compilation_runs(tmp_path: Path, where: str) -> None:
    model, counter = Regressor(), CompileCounter()
    IN_PLACE[where][0](model, counter)
    compiled = {name: module._compiled_call_impl for name, module in model.named_modules()}
    _trainer_fit(model, None, tmp_path)
    assert {name: module._compiled_call_impl for name, module in model.named_modules()} == compiled
    if where == "the model":
        assert counter.frame_count >= 1  # the user's backend compiled what ran


def test_the_runs_own_compilation_is_not_taken_for_the_users(tmp_path: Path) -> None:
    trainer = quiet_trainer(max_steps=2, compile={"backend": "eager"}, default_root_dir=tmp_path)
    model = Regressor()
    trainer.fit(model, loaders(n=16)[0])
    trainer.fit_loop.max_steps = 4
    trainer.fit(model, loaders(n=16)[0])  # compiled in place by the first fit: compiled again, not refused
    assert trainer.global_step == 4
