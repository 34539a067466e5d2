"""Precision plugins: dtypes, autocast, loss scaling, clipping, the optimizer step and its closure."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

from phalanx.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision


class _RecordingBeforeStep:
    """The ``before_step`` callback a strategy passes on: records its calls and what the gradients looked like."""

    def __init__(
        self, events: list, model: nn.Module, clip: tuple | None = None, plugin: Precision | None = None
    ) -> None:
        self.events = events
        self.model = model
        self.clip = clip
        self.plugin = plugin
        self.grads_seen: list[torch.Tensor] = []

    def __call__(self, optimizer: torch.optim.Optimizer) -> None:
        self.events.append("before_optimizer_step")
        if self.clip is not None:
            self.plugin.clip_gradients(optimizer, *self.clip)
        self.grads_seen.append(self.model.weight.grad.clone())


def _model(seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(4, 1, bias=False)


def _scaled_plugin(init_scale: float = 1024.0) -> MixedPrecision:
    return MixedPrecision("16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu", init_scale=init_scale))


def _backward_closure(plugin: Precision, model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor):
    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = model(x).sum()
        plugin.backward(plugin.pre_backward(loss, model), model, optimizer)
        return loss

    return closure


# ------------------------------------------------------------------ dtypes


@pytest.mark.parametrize(
    ("plugin", "dtype"),
    [
        (DoublePrecision(), torch.float64),
        (HalfPrecision("16-true"), torch.float16),
        (HalfPrecision("bf16-true"), torch.bfloat16),
    ],
)
def test_true_precision_convert_module_casts_parameters_and_floating_buffers(
    plugin: Precision, dtype: torch.dtype
) -> None:
    module = nn.BatchNorm1d(3)
    converted = plugin.convert_module(module)
    assert converted.weight.dtype == dtype
    assert converted.running_mean.dtype == dtype
    assert converted.num_batches_tracked.dtype == torch.int64  # integer buffers are not floating: untouched


def test_base_precision_leaves_module_and_input_alone() -> None:
    module = nn.Linear(2, 2)
    data = {"x": torch.ones(2, dtype=torch.float64)}
    assert Precision().convert_module(module) is module
    assert module.weight.dtype == torch.float32
    assert Precision().convert_input(data)["x"].dtype == torch.float64


def test_convert_input_casts_only_floating_tensors_and_keeps_containers() -> None:
    Batch = collections.namedtuple("Batch", ["x", "y"])
    batch = {"pair": Batch(torch.ones(2), torch.tensor([1, 2])), "mask": [torch.tensor([True]), "label"]}
    converted = DoublePrecision().convert_input(batch)
    assert isinstance(converted["pair"], Batch)
    assert converted["pair"].x.dtype == torch.float64
    assert converted["pair"].y.dtype == torch.int64
    assert converted["mask"][0].dtype == torch.bool
    assert converted["mask"][1] == "label"
    assert HalfPrecision("bf16-true").convert_input(torch.ones(1, dtype=torch.float64)).dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("plugin", "dtype"), [(DoublePrecision(), torch.float64), (HalfPrecision("bf16-true"), torch.bfloat16)]
)
def test_tensor_init_context_sets_and_restores_default_dtype(plugin: Precision, dtype: torch.dtype) -> None:
    assert torch.get_default_dtype() == torch.float32
    with plugin.tensor_init_context():
        assert torch.get_default_dtype() == dtype
        assert torch.zeros(1).dtype == dtype
        assert nn.Linear(2, 2).weight.dtype == dtype
    assert torch.get_default_dtype() == torch.float32
    with plugin.module_init_context():
        assert torch.get_default_dtype() == dtype
    assert torch.get_default_dtype() == torch.float32


def test_tensor_init_context_restores_default_dtype_after_an_error() -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with DoublePrecision().tensor_init_context():
            raise RuntimeError("boom")
    assert torch.get_default_dtype() == torch.float32


def test_base_precision_contexts_change_nothing() -> None:
    plugin = Precision()
    with plugin.tensor_init_context(), plugin.forward_context():
        assert torch.get_default_dtype() == torch.float32
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32


# ------------------------------------------------------------------ autocast


def test_bf16_mixed_autocast_on_cpu_gives_bf16_matmuls_inside_forward_context_only() -> None:
    plugin = MixedPrecision("bf16-mixed", device="cpu")
    assert plugin.scaler is None
    model = nn.Linear(4, 3)
    x = torch.randn(2, 4)
    for context in (
        plugin.forward_context,
        plugin.train_step_context,
        plugin.val_step_context,
        plugin.test_step_context,
        plugin.predict_step_context,
    ):
        with context():
            assert model(x).dtype == torch.bfloat16
            assert (x @ x.T).dtype == torch.bfloat16
    assert model(x).dtype == torch.float32
    assert model.weight.dtype == torch.float32  # autocast never changes the stored parameters


def test_16_mixed_without_a_scaler_on_cpu_has_no_scaler_and_autocasts_to_float16() -> None:
    plugin = MixedPrecision("16-mixed", device="cpu")
    assert plugin.scaler is None
    with plugin.forward_context():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float16


@pytest.mark.parametrize(
    ("factory", "bad"),
    [(MixedPrecision, "32-true"), (MixedPrecision, "fp16"), (HalfPrecision, "16-mixed"), (HalfPrecision, "bf16")],
)
def test_invalid_precision_names_raise_and_name_the_valid_choices(factory: type, bad: str) -> None:
    with pytest.raises(ValueError, match=repr(bad)) as error:
        factory(bad) if factory is HalfPrecision else factory(bad, device="cpu")
    valid = ("'16-mixed'", "'bf16-mixed'") if factory is MixedPrecision else ("'16-true'", "'bf16-true'")
    assert all(name in str(error.value) for name in valid)


def test_a_grad_scaler_with_bf16_is_refused() -> None:
    with pytest.raises(ValueError, match="only useful with '16-mixed'"):
        MixedPrecision("bf16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu"))


# ------------------------------------------------------------------ loss scaling


def test_grad_scaler_on_cpu_is_enabled() -> None:
    plugin = _scaled_plugin(init_scale=512.0)
    assert plugin.scaler.is_enabled()
    assert plugin.scaler.get_scale() == 512.0


def test_pre_backward_scales_the_loss() -> None:
    plugin = _scaled_plugin(init_scale=1024.0)
    loss = torch.tensor(1.5)
    assert plugin.pre_backward(loss, None).item() == pytest.approx(1536.0)
    assert MixedPrecision("bf16-mixed", device="cpu").pre_backward(loss, None) is loss
    assert Precision().pre_backward(loss, None) is loss


def test_optimizer_step_with_scaler_steps_with_unscaled_gradients() -> None:
    x = torch.ones(1, 4)
    reference, model = _model(), _model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    ref_opt.zero_grad()
    reference(x).sum().backward()
    ref_opt.step()

    plugin = _scaled_plugin(init_scale=1024.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plugin.optimizer_step(optimizer, model, _backward_closure(plugin, model, optimizer, x))
    torch.testing.assert_close(model.weight, reference.weight)


def test_unscale_gradients_twice_in_one_step_is_harmless() -> None:
    plugin = _scaled_plugin(init_scale=8.0)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _backward_closure(plugin, model, optimizer, torch.ones(1, 4))()
    plugin.unscale_gradients(optimizer)
    unscaled = model.weight.grad.clone()
    plugin.unscale_gradients(optimizer)  # torch's unscale_ would raise "already been called" here
    torch.testing.assert_close(model.weight.grad, unscaled)
    torch.testing.assert_close(unscaled, torch.ones(1, 4))


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_clip_gradients_with_scaler_clips_unscaled_gradients_then_steps(algorithm: str) -> None:
    # True gradient: ones(1, 4) (norm 2). Scaled by 1024 it would be clipped to a very different value.
    plugin = _scaled_plugin(init_scale=1024.0)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    before = model.weight.detach().clone()
    closure = _backward_closure(plugin, model, optimizer, torch.ones(1, 4))
    closure()
    assert model.weight.grad.max().item() == pytest.approx(1024.0)  # scaled after backward
    result = plugin.clip_gradients(optimizer, 1.0 if algorithm == "norm" else 0.25, algorithm)
    if algorithm == "norm":
        assert result.item() == pytest.approx(2.0)  # the true norm, not 2048
        expected_grad = torch.full((1, 4), 0.5)
    else:
        assert result is None
        expected_grad = torch.full((1, 4), 0.25)
    torch.testing.assert_close(model.weight.grad, expected_grad, rtol=1e-4, atol=1e-4)
    # optimizer_step must not unscale a second time (torch raises "unscale_() has already been called").
    plugin.optimizer_step(optimizer, model, lambda: torch.tensor(1.0))
    torch.testing.assert_close(model.weight.detach(), before - expected_grad, rtol=1e-4, atol=1e-4)


def test_clipping_inside_the_before_optimizer_step_hook_sees_and_clips_unscaled_gradients() -> None:
    plugin = _scaled_plugin(init_scale=1024.0)
    model = _model()
    events: list = []
    before_step = _RecordingBeforeStep(events, model, clip=(1.0, "norm"), plugin=plugin)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    before = model.weight.detach().clone()
    for _ in range(3):  # several steps: the "already unscaled" bookkeeping must reset after each update()
        before = model.weight.detach().clone()
        plugin.optimizer_step(
            optimizer, model, _backward_closure(plugin, model, optimizer, torch.ones(1, 4)), before_step=before_step
        )
        torch.testing.assert_close(model.weight.detach(), before - 0.5, rtol=1e-4, atol=1e-4)
    assert events == ["before_optimizer_step"] * 3


def test_closure_returning_none_skips_the_step_in_automatic_mode_and_the_next_step_works() -> None:
    plugin = _scaled_plugin(init_scale=4.0)
    model = _model()
    model.automatic_optimization = True
    events: list = []
    before_step = _RecordingBeforeStep(events, model, clip=(1.0, "value"), plugin=plugin)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    before = model.weight.detach().clone()

    def closure_with_backward_but_returning_none() -> None:
        _backward_closure(plugin, model, optimizer, torch.ones(1, 4))()
        return None

    assert (
        plugin.optimizer_step(optimizer, model, closure_with_backward_but_returning_none, before_step=before_step)
        is None
    )
    torch.testing.assert_close(model.weight.detach(), before)  # no step
    assert events == ["before_optimizer_step"]  # hooks still ran
    # The hook clipped (and so unscaled) during the skipped step: the next step must still be able to unscale.
    plugin.optimizer_step(
        optimizer, model, _backward_closure(plugin, model, optimizer, torch.ones(1, 4)), before_step=before_step
    )
    torch.testing.assert_close(model.weight.detach(), before - 1.0)


def test_closure_returning_none_still_steps_in_manual_mode() -> None:
    plugin = _scaled_plugin(init_scale=4.0)
    model = _model()
    model.automatic_optimization = False
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    before = model.weight.detach().clone()
    _backward_closure(plugin, model, optimizer, torch.ones(1, 4))()
    plugin.optimizer_step(optimizer, model, lambda: None)
    torch.testing.assert_close(model.weight.detach(), before - 1.0)


def test_scaler_skips_the_step_on_inf_gradients_and_backs_off() -> None:
    plugin = _scaled_plugin(init_scale=1024.0)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    before = model.weight.detach().clone()

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = plugin.pre_backward(model(torch.ones(1, 4)).sum() * float("inf"), model)
        loss.backward()
        return loss

    plugin.optimizer_step(optimizer, model, closure)
    torch.testing.assert_close(model.weight.detach(), before)
    assert plugin.scaler.get_scale() < 1024.0


def test_lbfgs_with_a_scaler_is_refused() -> None:
    model = _model()
    with pytest.raises(TypeError, match="LBFGS"):
        _scaled_plugin().optimizer_step(torch.optim.LBFGS(model.parameters()), model, lambda: torch.tensor(0.0))


def test_scaler_state_round_trips_through_state_dict() -> None:
    plugin = _scaled_plugin(init_scale=1024.0)
    plugin.pre_backward(torch.tensor(1.0), None)  # the scale tensor is created lazily, on first use
    plugin.scaler.update(new_scale=37.0)
    state = plugin.state_dict()
    assert state["scale"] == 37.0
    restored = _scaled_plugin(init_scale=1024.0)
    restored.load_state_dict(state)
    assert restored.scaler.get_scale() == 37.0
    assert restored.state_dict() == state


def test_state_dict_without_scaler_is_empty_and_loading_it_is_a_no_op() -> None:
    plugin = MixedPrecision("bf16-mixed", device="cpu")
    assert plugin.state_dict() == {}
    plugin.load_state_dict({})
    assert Precision().state_dict() == {}


# ------------------------------------------------------------------ the base optimizer step and clipping


def test_optimizer_step_passes_the_closure_to_lbfgs() -> None:
    torch.manual_seed(0)
    model = nn.Linear(1, 1)
    x = torch.linspace(-1, 1, 16).unsqueeze(1)
    y = 3 * x + 1
    optimizer = torch.optim.LBFGS(model.parameters(), lr=1.0, max_iter=50)
    calls = []

    def closure() -> torch.Tensor:
        calls.append(1)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    loss = Precision().optimizer_step(optimizer, model, closure)
    assert len(calls) > 1  # LBFGS re-evaluated the closure
    assert loss is not None
    assert nn.functional.mse_loss(model(x), y).item() < 1e-6


def test_optimizer_step_calls_before_optimizer_step_after_the_closure() -> None:
    model = _model()
    events: list = []
    before_step = _RecordingBeforeStep(events, model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def closure() -> torch.Tensor:
        events.append("closure")
        optimizer.zero_grad()
        loss = model(torch.ones(1, 4)).sum()
        loss.backward()
        return loss

    result = Precision().optimizer_step(optimizer, model, closure, before_step=before_step)
    assert events == ["closure", "before_optimizer_step"]
    torch.testing.assert_close(before_step.grads_seen[0], torch.ones(1, 4))  # gradients were final in the hook
    assert isinstance(result, torch.Tensor)


def test_optimizer_step_gives_the_closure_to_optimizers_from_other_packages() -> None:
    # A SAM-like optimizer from outside torch.optim may evaluate the closure several times: it must get it.
    class TwoPassSGD(torch.optim.SGD):
        def step(self, closure=None):
            assert closure is not None
            closure()
            return super().step(closure)

    model = _model()
    events: list = []
    before_step = _RecordingBeforeStep(events, model)
    optimizer = TwoPassSGD(model.parameters(), lr=1.0)
    before = model.weight.detach().clone()

    def closure() -> torch.Tensor:
        events.append("closure")
        optimizer.zero_grad()
        loss = model(torch.ones(1, 4)).sum()
        loss.backward()
        return loss

    Precision().optimizer_step(optimizer, model, closure, before_step=before_step)
    assert events == ["closure", "before_optimizer_step"] * 2
    torch.testing.assert_close(model.weight.detach(), before - 1.0)


def test_optimizer_step_without_a_before_step_callback_and_with_bf16_mixed_works() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    before = model.weight.detach().clone()
    MixedPrecision("bf16-mixed", device="cpu").optimizer_step(
        optimizer, model, _backward_closure(Precision(), model, optimizer, torch.ones(1, 4))
    )
    torch.testing.assert_close(model.weight.detach(), before - 1.0)


def test_backward_uses_the_module_backward_hook_when_present() -> None:
    calls = []

    class WithHook(nn.Linear):
        def backward(self, loss: torch.Tensor, *args, **kwargs) -> None:
            calls.append(loss)
            loss.backward(*args, **kwargs)

    model = WithHook(2, 1)
    loss = model(torch.ones(1, 2)).sum()
    Precision().backward(loss, model, None)
    assert calls == [loss]
    assert model.weight.grad is not None


def test_clip_gradients_by_norm_and_by_value() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.weight.grad = torch.full((1, 4), 3.0)  # norm 6
    norm = Precision().clip_gradients(optimizer, 3.0, "norm")
    assert norm.item() == pytest.approx(6.0)
    torch.testing.assert_close(model.weight.grad, torch.full((1, 4), 1.5), rtol=1e-4, atol=1e-4)
    model.weight.grad = torch.tensor([[-5.0, 0.1, 2.0, 5.0]])
    assert Precision().clip_gradients(optimizer, 1.0, "value") is None
    torch.testing.assert_close(model.weight.grad, torch.tensor([[-1.0, 0.1, 1.0, 1.0]]))


def test_clip_gradients_with_zero_value_or_no_gradients_does_nothing() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert Precision().clip_gradients(optimizer, 1.0) is None  # no gradients yet
    model.weight.grad = torch.full((1, 4), 3.0)
    assert Precision().clip_gradients(optimizer, 0.0) is None
    torch.testing.assert_close(model.weight.grad, torch.full((1, 4), 3.0))


@pytest.mark.parametrize("plugin", [Precision(), MixedPrecision("bf16-mixed", device="cpu"), _scaled_plugin()])
def test_clip_gradients_with_an_invalid_algorithm_raises_even_without_gradients(plugin: Precision) -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="'norm' or 'value'"):
        plugin.clip_gradients(optimizer, 1.0, "nrom")
    model.weight.grad = torch.ones(1, 4)
    with pytest.raises(ValueError, match="'nrom'"):
        plugin.clip_gradients(optimizer, 1.0, "nrom")


@pytest.mark.parametrize("plugin", [DoublePrecision(), HalfPrecision("bf16-true")], ids=["64-true", "bf16-true"])
def test_true_precision_casts_floating_tensors_and_keeps_complex_and_integer_ones(plugin):
    module = nn.Linear(2, 2)
    module.phase = nn.Parameter(torch.tensor([1 + 2j, 3 - 4j]))
    module.register_buffer("count", torch.tensor([7]))
    converted = plugin.convert_module(module)
    assert converted.weight.dtype == plugin.dtype and converted.bias.dtype == plugin.dtype
    assert converted.phase.dtype == torch.complex64 and torch.equal(converted.phase, torch.tensor([1 + 2j, 3 - 4j]))
    assert converted.count.dtype == torch.int64 and converted.count.item() == 7
