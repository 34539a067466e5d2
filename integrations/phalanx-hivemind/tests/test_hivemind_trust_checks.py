"""The checks on what peers send, without a swarm: hivemind's classes built without starting them, fed hostile
averaged tensors and hostile state streams (real hivemind messages), so that every case runs in milliseconds.

The same attacks from real peers on localhost are in test_hivemind_trust.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from types import SimpleNamespace

import pytest

hivemind = pytest.importorskip("hivemind", reason="phalanx-hivemind's tests need hivemind")
import torch  # noqa: E402
from hivemind.compression import serialize_torch_tensor  # noqa: E402
from hivemind.proto import averaging_pb2  # noqa: E402
from hivemind.utils.serializer import MSGPackSerializer  # noqa: E402
from hivemind.utils.streaming import split_for_streaming  # noqa: E402
from phalanx_hivemind import SwarmTrustError, SwarmTrustWarning, trust  # noqa: E402
from phalanx_hivemind.guarded import GuardedOptimizer, GuardedStateAverager, _MarkingEvent  # noqa: E402
from phalanx_hivemind.strategy import HivemindStrategy  # noqa: E402

# This peer's state: two parameters, one optimizer statistic (what get_current_state sends, in its order).
OWN = [torch.full((4, 3), 0.5), torch.full((3,), 0.5), torch.zeros(4, 3)]
SPECS = [
    trust.TensorSpec.of("parameter 0", OWN[0]),
    trust.TensorSpec.of("parameter 1", OWN[1]),
    trust.TensorSpec.of("optimizer tensor 0", OWN[2]),
]
METADATA = {"epoch": 7, "group_bits": "", "optimizer_metadata": []}


def _stream(tensors, metadata=METADATA, pad: int = 0):
    """The messages a peer sends for a state (metadata with the first part), as rpc_download_state makes them."""
    messages = []
    for tensor in tensors:
        serialized = serialize_torch_tensor(tensor)
        serialized.buffer += b"\0" * pad
        for part in split_for_streaming(serialized, 1 << 16):
            messages.append(averaging_pb2.DownloadData(tensor_part=part))
    if metadata is not None:
        messages[0].metadata = MSGPackSerializer.dumps(metadata)
    return messages


def _unstarted(cls):
    """An instance of one of hivemind's classes whose __init__ never ran (no process, nothing to shut down)."""
    instance = object.__new__(cls)
    instance._parent_pid = -1  # hivemind's __del__ shuts down only what its own process started
    return instance


def _averager(streams: dict[str, list], max_ratio: float | None = 10.0) -> GuardedStateAverager:
    """A GuardedStateAverager that was never started: its peers answer with ``streams``."""
    averager = _unstarted(GuardedStateAverager)
    averager.next_chunk_timeout = None
    averager.state_specs, averager.num_parameter_specs, averager.max_ratio = SPECS, 2, max_ratio
    averager.serializer, averager.prefix, averager._p2p = MSGPackSerializer, "run_state_averager", None

    class Stub:
        def __init__(self, peer: str) -> None:
            self.peer = peer

        async def rpc_download_state(self, request):
            async def messages():
                for message in streams[self.peer]:
                    yield message

            return messages()

    averager.get_stub = lambda p2p, peer, namespace: Stub(peer)
    averager._peers_sharing_state = lambda: list(streams)
    return averager


def _download(averager: GuardedStateAverager, reference_norm: float | None = None):
    future = SimpleNamespace(result=None, done=lambda: future.result is not None)
    future.set_result = lambda value: setattr(future, "result", value)
    asyncio.run(averager._load_state_from_peers(future, timeout=5.0, reference_norm=reference_norm))
    return future.result


# (id, the tampering peer's messages, what the refusal says)
HOSTILE_STATES = [
    ("nan", _stream([torch.full((4, 3), math.nan), *OWN[1:]]), "its parameter 0 holds non-finite values"),
    ("inf", _stream([OWN[0], torch.full((3,), math.inf), OWN[2]]), "its parameter 1 holds non-finite values"),
    ("wrong_shape", _stream([torch.zeros(5, 3), *OWN[1:]]), r"its parameter 0 has shape \[5, 3\], this peer's"),
    ("broadcastable", _stream([torch.zeros(1, 3), *OWN[1:]]), r"its parameter 0 has shape \[1, 3\]"),
    ("wrong_dtype", _stream([OWN[0].double(), *OWN[1:]]), r"its parameter 0 is a \[4, 3\] torch.float64 tensor"),
    ("integers", _stream([OWN[0].long(), *OWN[1:]]), "torch.int64 tensor, this peer's is"),
    ("extra_tensor", _stream([*OWN, torch.zeros(1 << 16)]), "it sent more than the 3 tensors"),
    ("missing_tensor", _stream(OWN[:2]), "it sent 2 tensors; this peer's state has 3"),
    ("padded_buffer", _stream(OWN, pad=1 << 17), "its parameter 0 took more than"),
    ("metadata_not_a_dict", _stream(OWN, metadata=[1, 2]), "its metadata is a list, not a dict"),
]


@pytest.mark.parametrize(("messages", "refusal"), [c[1:] for c in HOSTILE_STATES], ids=[c[0] for c in HOSTILE_STATES])
def test_a_hostile_state_is_refused_and_the_next_peer_is_tried(messages, refusal) -> None:
    averager = _averager({"QmHostile": messages, "QmHonest": _stream(OWN)})
    metadata, tensors, refusals = _download(averager)
    assert metadata == METADATA and len(tensors) == 3
    assert all(torch.equal(got, own) for got, own in zip(tensors, OWN))
    assert len(refusals) == 1
    assert refusals[0].startswith("peer QmHostile (")
    assert refusal in refusals[0] or __import__("re").search(refusal, refusals[0]), refusals[0]


def test_when_every_peer_is_refused_the_download_brings_nothing() -> None:
    nan_state = HOSTILE_STATES[0][1]
    metadata, tensors, refusals = _download(_averager({"QmA": nan_state, "QmB": nan_state}))
    assert (metadata, tensors) == (None, None)
    assert [r.split(" (")[0] for r in refusals] == ["peer QmA", "peer QmB"]


@pytest.mark.parametrize(("scale", "refused"), [(1.0, False), (9.0, False), (1000.0, True)])
def test_a_peer_that_stepped_with_the_swarm_refuses_a_state_far_larger_than_its_own(scale, refused) -> None:
    large = [OWN[0] * scale, OWN[1] * scale, OWN[2]]
    own_norm = trust.norm_of(OWN[:2])
    metadata, tensors, refusals = _download(_averager({"QmLarge": _stream(large)}), reference_norm=own_norm)
    assert (metadata is None) == refused
    if refused:
        assert "its parameters have norm" in refusals[0] and "above max_averaged_state_ratio=10" in refusals[0]
    # A joining peer (no reference: its weights are nobody's) takes any finite state of the right shapes.
    assert _download(_averager({"QmLarge": _stream(large)}))[0] == METADATA


@pytest.mark.parametrize(
    ("averaged", "own", "ratio", "expected"),
    [
        (1.0, 1.0, 100.0, None),
        (99.0, 1.0, 100.0, None),
        (101.0, 1.0, 100.0, "101 times this peer's own (1), above max_averaged_grad_ratio=100"),
        (math.nan, 1.0, 100.0, "hold non-finite values"),
        (math.inf, 1.0, None, "hold non-finite values"),
        (1e30, 1.0, None, None),  # the ratio check turned off
        (5.0, 0.0, 100.0, None),  # this peer contributed nothing: only finiteness
    ],
)
def test_averaged_problem(averaged, own, ratio, expected) -> None:
    problem = trust.averaged_problem("the averaged gradients", averaged, own, ratio, "max_averaged_grad_ratio")
    assert problem is None if expected is None else expected in problem


def test_norm_of_sees_non_finite_values_and_skips_integers() -> None:
    assert trust.norm_of([torch.full((4,), 2.0), torch.tensor([10**6])]) == pytest.approx(4.0)
    assert math.isnan(trust.norm_of([torch.ones(3), torch.tensor([math.nan])]))
    assert trust.norm_of([torch.tensor([math.inf])]) == math.inf


class _Buffers:
    """hivemind's averaged-tensor buffers: ``get_tensors()`` is a context manager yielding them."""

    def __init__(self, tensors) -> None:
        self.tensors = tensors

    @contextlib.contextmanager
    def get_tensors(self):
        yield self.tensors


def _optimizer(averaged, own_norm: float, ratio: float | None = 100.0) -> GuardedOptimizer:
    optimizer = _unstarted(GuardedOptimizer)
    grads = _Buffers(averaged)
    grads.local_norm, grads.used = own_norm, 0
    grads.notify_used_averaged_gradients = lambda: setattr(grads, "used", grads.used + 1)
    optimizer.grad_averager, optimizer.max_averaged_grad_ratio = grads, ratio
    optimizer.state_averager = SimpleNamespace(local_epoch=3)
    optimizer.dht = SimpleNamespace(peer_id="QmSelf")
    optimizer._grad_round = SimpleNamespace(result=lambda timeout=None: {"QmSelf": None, "QmPoisoner": None})
    optimizer._local_fallback, optimizer.skip_next_optimizer_step = False, False
    return optimizer


# (id, averaged gradient, this peer's own gradient norm, refused, what the warning says)
GRADIENT_CASES = [
    ("honest", [torch.full((10,), 0.1)], 0.2, False, None),
    ("poisoned_1e4", [torch.full((10,), 1e4)], 0.2, True, "above max_averaged_grad_ratio=100"),
    ("nan", [torch.full((10,), math.nan)], 0.2, True, "hold non-finite values"),
    ("inf", [torch.tensor([1.0, math.inf])], 0.2, True, "hold non-finite values"),
]


@pytest.mark.parametrize(
    ("averaged", "own", "refused", "warning"), [c[1:] for c in GRADIENT_CASES], ids=[c[0] for c in GRADIENT_CASES]
)
def test_absurd_averaged_gradients_skip_the_optimizer_step(monkeypatch, averaged, own, refused, warning) -> None:
    loaded = []
    monkeypatch.setattr(hivemind.Optimizer, "_load_averaged_gradients_into_optimizer_", lambda self: loaded.append(1))
    optimizer = _optimizer(averaged, own)
    if refused:
        with pytest.warns(SwarmTrustWarning, match="refused the gradients averaged for swarm step 3 with") as caught:
            optimizer._load_averaged_gradients_into_optimizer_()
        message = str(caught[0].message)
        assert warning in message and "QmPoisoner" in message and "skips this swarm step's optimizer step" in message
        assert (loaded, optimizer.grad_averager.used, optimizer.skip_next_optimizer_step) == ([], 1, True)
    else:
        optimizer._load_averaged_gradients_into_optimizer_()
        assert (loaded, optimizer.skip_next_optimizer_step) == ([1], False)


def test_a_peers_own_gradients_are_not_checked_against_themselves(monkeypatch) -> None:
    monkeypatch.setattr(hivemind.Optimizer, "_load_local_gradients_into_optimizer", lambda self: None)
    loaded = []
    monkeypatch.setattr(hivemind.Optimizer, "_load_averaged_gradients_into_optimizer_", lambda self: loaded.append(1))
    optimizer = _optimizer([torch.full((10,), 1e4)], 0.2)
    monkeypatch.setattr(
        hivemind.Optimizer,
        "_load_local_gradients_into_optimizer",
        lambda self: self._load_averaged_gradients_into_optimizer_(),
    )
    optimizer._load_local_gradients_into_optimizer()
    assert loaded == [1] and not optimizer.skip_next_optimizer_step


def _state_averager(averaged, own, reuse_tensors: bool = False) -> GuardedStateAverager:
    averager = _unstarted(GuardedStateAverager)
    averager.get_tensors = _Buffers(averaged).get_tensors
    averager._local_tensors = lambda: iter(own)
    averager.max_ratio, averager.local_epoch, averager._loading_state = 10.0, 5, False
    averager.reuse_tensors, averager.main_parameters = reuse_tensors, own
    averager.optimizer = SimpleNamespace(param_groups=[{"params": averaged}])
    averager.finished_averaging_round = _MarkingEvent()
    return averager


# (id, averaged parameters, refused, what the message says)
STATE_CASES = [
    ("honest", [torch.full((4, 3), 0.52)], False, None),
    ("poisoned_1e4", [torch.full((4, 3), 1e4)], True, "above max_averaged_state_ratio=10"),
    ("nan", [torch.full((4, 3), math.nan)], True, "hold non-finite values"),
]


@pytest.mark.parametrize(
    ("averaged", "refused", "message"), [c[1:] for c in STATE_CASES], ids=[c[0] for c in STATE_CASES]
)
def test_absurd_averaged_parameters_are_not_applied(monkeypatch, averaged, refused, message) -> None:
    applied = []
    monkeypatch.setattr(
        hivemind.optim.state_averager.TrainingStateAverager,
        "_apply_averaging_results_",
        lambda self: applied.append(self),
    )
    averager = _state_averager(averaged, [torch.full((4, 3), 0.5)])
    if refused:
        with pytest.warns(SwarmTrustWarning, match="refused the parameters averaged at swarm step 5") as caught:
            averager._apply_averaging_results_()
        assert message in str(caught[0].message) and "keeps its own parameters" in str(caught[0].message)
        assert applied == []
    else:
        averager._apply_averaging_results_()
        assert applied == [averager]


@pytest.mark.parametrize(
    ("averaged", "refused", "message"), [c[1:] for c in STATE_CASES], ids=[c[0] for c in STATE_CASES]
)
def test_offloaded_parameters_averaged_in_place_stop_the_peer(monkeypatch, averaged, refused, message) -> None:
    applied = []
    cls = hivemind.optim.state_averager.TrainingStateAverager
    monkeypatch.setattr(cls, "_apply_optimizer_parameters_", lambda self: applied.append(self))
    averager = _state_averager(averaged, [torch.full((4, 3), 0.5)], reuse_tensors=True)
    averager._apply_optimizer_parameters_()  # after a local optimizer step: no averaging round finished, no check
    averager.finished_averaging_round.set()  # hivemind's averaging thread, when a round ends
    if refused:
        with pytest.raises(SwarmTrustError, match=f"refused the parameters of swarm step 5: .*{message}.*it stops"):
            averager._apply_optimizer_parameters_()
        assert applied == [averager]
        averager.finished_averaging_round.set()
        averager._loading_state = True  # a downloaded state was checked as it arrived
    averager._apply_optimizer_parameters_()
    assert applied == [averager, averager]


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"max_averaged_grad_ratio": 0.5}, r"max_averaged_grad_ratio=0.5\) must be a finite number >= 1, or None"),
        ({"max_averaged_state_ratio": math.inf}, r"max_averaged_state_ratio=inf\) must be a finite number >= 1"),
        ({"max_averaged_grad_ratio": "100"}, r"max_averaged_grad_ratio='100'\) must be a finite number"),
        ({"authorizer": object()}, r"must be a hivemind.utils.auth.AuthorizerBase \(with methods sign_request"),
    ],
)
def test_bad_trust_options_are_refused_by_name(kwargs, error) -> None:
    with pytest.raises((ValueError, TypeError), match=error):
        HivemindStrategy(16, **kwargs)


def test_trust_option_defaults_and_the_authorizer_reaches_the_dht(monkeypatch) -> None:
    strategy = HivemindStrategy(16)
    assert (strategy.max_averaged_grad_ratio, strategy.max_averaged_state_ratio, strategy.authorizer) == (
        100.0,
        10.0,
        None,
    )
    assert HivemindStrategy(16, max_averaged_grad_ratio=None).max_averaged_grad_ratio is None

    class Authorizer(hivemind.utils.auth.AuthorizerBase):
        async def sign_request(self, request, service_public_key): ...
        async def validate_request(self, request):
            return True

        async def sign_response(self, response, request): ...
        async def validate_response(self, response, request):
            return True

    seen = {}

    class FakeDHT:
        def __init__(self, **kwargs):
            seen.update(kwargs)

        def get_visible_maddrs(self):
            return []

    monkeypatch.setattr(hivemind, "DHT", FakeDHT)
    authorizer = Authorizer()
    HivemindStrategy(16, authorizer=authorizer)._start_dht()
    assert seen["authorizer"] is authorizer
    seen.clear()
    HivemindStrategy(16)._start_dht()
    assert "authorizer" not in seen
