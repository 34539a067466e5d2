"""hivemind 1.1.12's optimizer and averagers with the checks of ``trust`` on what other peers send.

Imported when a run starts (it imports hivemind). Three entry points of foreign data are covered:

- averaged gradients (``GuardedOptimizer``): non-finite, or far larger in norm than this peer's own gradient of the
  step: this peer skips that swarm step's optimizer step (the learning rate schedule and the step count go on);
- averaged parameters (``GuardedStateAverager``): non-finite, or far larger in norm than this peer's own: this peer
  keeps its own parameters for that round. With ``offload_optimizer=True`` hivemind averages the optimizer's own
  tensors in place, so nothing can be kept: the peer stops with ``SwarmTrustError``;
- a downloaded state (``GuardedStateAverager``): read tensor by tensor as it arrives, each checked against this peer's
  own (shape before decoding, bytes on the wire, then dtype and finiteness); the first mismatch drops that peer and the
  download goes on with the next peer. Nothing is unpickled (metadata is MessagePack, tensors raw buffers).
"""

from __future__ import annotations

import logging
import threading
import warnings
from typing import Any

import hivemind
import torch
from hivemind.averaging.averager import DecentralizedAverager
from hivemind.compression import deserialize_torch_tensor
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.state_averager import TrainingStateAverager, dump_optimizer_state
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture, get_logger
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.streaming import combine_from_streaming
from hivemind.utils.timed_storage import ValueWithExpiration

from phalanx_hivemind import trust

log = logging.getLogger("phalanx_hivemind")
#: The download loop below stands in for hivemind's: it logs its progress where hivemind's did (INFO).
download_log = get_logger("hivemind.averaging.averager")

GRAD_OPTION, STATE_OPTION = "max_averaged_grad_ratio", "max_averaged_state_ratio"


class GuardedOptimizer(hivemind.Optimizer):
    """``hivemind.Optimizer`` that refuses absurd averaged gradients and builds the guarded averagers."""

    def __init__(self, *, max_averaged_grad_ratio: float | None, max_averaged_state_ratio: float | None, **kwargs: Any):
        self.max_averaged_grad_ratio = max_averaged_grad_ratio
        self.max_averaged_state_ratio = max_averaged_state_ratio
        self._grad_round: Any = None
        self._local_fallback = False
        self.skip_next_optimizer_step = False
        if not kwargs.get("use_local_updates"):
            kwargs["grad_averager_factory"] = GuardedGradientAverager
        super().__init__(**kwargs)
        inner = self.state_averager.optimizer
        step = inner.step

        def step_unless_refused(*args: Any, **step_kwargs: Any) -> Any:
            # hivemind steps the torch optimizer in its own thread; a refused round leaves its parameters as they are.
            if self.skip_next_optimizer_step:
                self.skip_next_optimizer_step = False
                return None
            return step(*args, **step_kwargs)

        inner.step = step_unless_refused

    def _make_state_averager(self, **kwargs: Any) -> TrainingStateAverager:
        # The arguments hivemind 1.1.12 gives its own TrainingStateAverager, with the guarded class.
        return GuardedStateAverager(
            max_ratio=self.max_averaged_state_ratio,
            dht=self.dht,
            prefix=f"{self.run_id}_state_averager",
            min_matchmaking_time=self.matchmaking_time,
            allreduce_timeout=self.allreduce_timeout,
            shutdown_timeout=self.shutdown_timeout,
            offload_optimizer=self.offload_optimizer,
            custom_gradients=self.offload_optimizer,
            status_loglevel=self.status_loglevel,
            next_chunk_timeout=self.next_chunk_timeout,
            client_mode=self.client_mode,
            auxiliary=self.auxiliary,
            start=True,
            **kwargs,
        )

    def _average_gradients_and_load_into_optimizer(self, maybe_step_control: Any) -> None:
        self._grad_round = maybe_step_control
        try:
            super()._average_gradients_and_load_into_optimizer(maybe_step_control)
        finally:
            self._grad_round = None

    def _load_local_gradients_into_optimizer(self) -> None:
        self._local_fallback = True  # this peer's own gradients: nothing foreign to check
        try:
            super()._load_local_gradients_into_optimizer()
        finally:
            self._local_fallback = False

    def _load_averaged_gradients_into_optimizer_(self) -> None:
        if self._grad_round is not None and not self._local_fallback:
            with self.grad_averager.get_tensors() as averaged:
                averaged_norm = trust.norm_of(averaged)  # host buffers: no device read
            own = self.grad_averager.local_norm
            ratio = self.max_averaged_grad_ratio
            problem = trust.averaged_problem("the averaged gradients", averaged_norm, own, ratio, GRAD_OPTION)
            if problem is not None:
                self.skip_next_optimizer_step = True
                self.grad_averager.notify_used_averaged_gradients()
                _warn(
                    f"hivemind: refused the gradients averaged for swarm step {self.local_epoch} with"
                    f" {_peers_of(self._grad_round, self.dht.peer_id)}: {problem}. This peer skips this swarm step's"
                    " optimizer step (its parameters stay as they were)."
                )
                return
        super()._load_averaged_gradients_into_optimizer_()


class GuardedGradientAverager(GradientAverager):
    """Records the norm of this peer's own gradient of the step; downloads no state (hivemind ignores it)."""

    local_norm = 0.0

    def load_accumulators_into_averager_(self) -> None:
        super().load_accumulators_into_averager_()
        # From the accumulators on their own device (the host copy may still be in flight): one read per swarm step.
        scale = 1.0 / self.local_times_accumulated if self.local_times_accumulated else 0.0
        self.local_norm = trust.norm_of(self._grad_accumulators()) * scale

    def load_state_from_peers(self, wait: bool = True, timeout: float | None = None) -> None:
        # hivemind.Optimizer downloads the gradient averager's buffers and discards them: not downloading them at all
        # leaves a peer nothing unbounded to send.
        return None


class _CheckedDownload(DecentralizedAverager):
    """Between TrainingStateAverager and DecentralizedAverager: reports what the checked download refused."""

    def __init__(self, **kwargs: Any) -> None:
        self.state_specs = self._own_state_specs()  # before the averager's process starts: it reads them there
        self.last_refusals: list[str] = []
        super().__init__(**kwargs)

    def _own_state_specs(self) -> list[trust.TensorSpec]:
        raise NotImplementedError

    def _reference_norm(self) -> float | None:
        raise NotImplementedError

    def load_state_from_peers(self, wait: bool = True, timeout: float | None = None) -> Any:
        # As DecentralizedAverager's, with this peer's own parameter norm for the averager's process to compare with.
        future = MPFuture()
        request = dict(timeout=timeout, future=future, reference_norm=self._reference_norm())
        self._outer_pipe.send(("_load_state_from_peers", [], request))
        result = future.result(timeout=timeout)
        if result is None:
            return None
        metadata, tensors, refusals = result
        for refusal in refusals:  # kept over the retries of one download (reset by download.bound_state_download)
            if refusal not in self.last_refusals:
                self.last_refusals.append(refusal)
                _warn(f"hivemind: refused the state of {refusal}; trying the next peer.")
        return None if metadata is None else (metadata, tensors)


class GuardedStateAverager(TrainingStateAverager, _CheckedDownload):
    """TrainingStateAverager whose averaged and downloaded states are checked before they replace this peer's."""

    def __init__(self, *, max_ratio: float | None, **kwargs: Any) -> None:
        self.max_ratio = max_ratio
        self._loading_state = False
        super().__init__(**kwargs)
        self.finished_averaging_round = _MarkingEvent()  # nothing ran yet: hivemind's threads start at the first step

    def _own_state_specs(self) -> list[trust.TensorSpec]:
        # The tensors get_current_state sends, in its order: parameters, extra tensors, optimizer statistics.
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        specs = [trust.TensorSpec.of(f"parameter {name}", p) for name, p in zip(self.parameter_names, params)]
        self.num_parameter_specs = len(specs)
        specs += [trust.TensorSpec.of(f"extra tensor {i}", t) for i, t in enumerate(self.extra_tensors)]
        _, statistics = dump_optimizer_state(self.optimizer)
        return specs + [trust.TensorSpec.of(f"optimizer tensor {i}", t) for i, t in enumerate(statistics)]

    def _reference_norm(self) -> float | None:
        # A peer that stepped with the swarm holds the swarm's parameters: a state far larger than them is absurd. A
        # peer at step 0 holds weights nobody else has, and takes any finite state of the right shapes.
        if self.local_epoch == 0 or self.max_ratio is None:
            return None
        return trust.norm_of(self.main_parameters)

    def _apply_averaging_results_(self) -> None:
        with self.get_tensors() as averaged:
            averaged_norm = trust.norm_of(averaged)
        problem = self._averaged_state_problem(averaged_norm, trust.norm_of(self._local_tensors()))
        if problem is not None:
            _warn(
                f"hivemind: refused the parameters averaged at swarm step {self.local_epoch}: {problem}. This peer"
                " keeps its own parameters for this round."
            )
            return
        super()._apply_averaging_results_()

    def _apply_optimizer_parameters_(self) -> None:
        averaged = self.finished_averaging_round.consume_mark()
        if self.reuse_tensors and averaged and not self._loading_state:
            # Averaging wrote into the offloaded optimizer's own tensors; the module still holds the previous step's.
            offloaded = [p for group in self.optimizer.param_groups for p in group["params"]]
            problem = self._averaged_state_problem(trust.norm_of(offloaded), trust.norm_of(self.main_parameters))
            if problem is not None:
                raise trust.SwarmTrustError(
                    f"hivemind: refused the parameters of swarm step {self.local_epoch}: {problem}. With"
                    " offload_optimizer=True hivemind averages the optimizer's own tensors in place, so this peer"
                    " cannot keep its own: it stops. Restart it to download the swarm's state (checked), or leave"
                    " the swarm if a peer keeps sending such values."
                )
        super()._apply_optimizer_parameters_()

    def _averaged_state_problem(self, averaged: float, own: float) -> str | None:
        return trust.averaged_problem("the averaged parameters", averaged, own, self.max_ratio, STATE_OPTION)

    def load_state_from_peers(self, **kwargs: Any) -> Any:
        self._loading_state = True  # a downloaded state was checked tensor by tensor; its size may differ from ours
        try:
            return super().load_state_from_peers(**kwargs)
        finally:
            self._loading_state = False

    # ------------------------------------------------------------------ in the averager's process
    async def _load_state_from_peers(
        self, future: Any, timeout: float | None = None, reference_norm: float | None = None
    ) -> None:
        refusals: list[str] = []
        try:
            chunk_timeout = None if timeout is None else (self.next_chunk_timeout or timeout)
            for peer in self._peers_sharing_state():
                try:
                    download_log.info(f"Downloading parameters from peer {peer}")
                    state = await self._download_checked(peer, chunk_timeout)
                    if state is not None and reference_norm is not None:
                        self._check_parameter_norm(state[1], reference_norm)
                except trust.StateRefused as refusal:
                    refusals.append(f"peer {peer} ({refusal})")
                    continue
                except Exception as error:  # the peer left, timed out or broke the stream: try the next one
                    download_log.info(f"Failed to download state from {peer}: {type(error).__name__}: {error}")
                    continue
                if state is not None:
                    download_log.info(f"Finished downloading a checked state from {peer}")
                    future.set_result((*state, refusals))
                    return
        finally:
            if not future.done():
                future.set_result((None, None, refusals))

    def _check_parameter_norm(self, tensors: list, reference_norm: float) -> None:
        norm = trust.norm_of(tensors[: self.num_parameter_specs])
        problem = trust.averaged_problem("its parameters", norm, reference_norm, self.max_ratio, STATE_OPTION)
        if problem is not None:
            raise trust.StateRefused(problem)

    def _peers_sharing_state(self) -> list[PeerID]:
        key = f"{self._matchmaking.group_key_manager.prefix}.all_averagers"
        entries, _ = self.dht.get(key, latest=True) or ({}, None)
        if not isinstance(entries, dict):
            return []
        priority = {
            PeerID(peer): float(entry.value)
            for peer, entry in entries.items()
            if isinstance(entry, ValueWithExpiration) and isinstance(entry.value, (float, int))
        }
        return [peer for peer in sorted(priority, key=priority.__getitem__, reverse=True) if peer != self.peer_id]

    async def _download_checked(self, peer: PeerID, chunk_timeout: float | None) -> tuple[Any, list] | None:
        """The peer's (metadata, tensors), or None when it shares nothing; StateRefused at the first mismatch."""
        stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
        stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
        specs, metadata, tensors, parts, received = self.state_specs, None, [], [], 0
        async for message in aiter_with_timeout(stream, timeout=chunk_timeout):
            if message.metadata:
                if metadata is not None or len(message.metadata) > trust.MAX_METADATA_BYTES:
                    raise trust.StateRefused(f"it sent metadata twice or over {trust.MAX_METADATA_BYTES} bytes")
                metadata = self.serializer.loads(message.metadata)
            part = message.tensor_part
            if part.dtype and parts:  # a new tensor begins: the previous one is complete
                tensors.append(_decoded(specs[len(tensors)], parts))
                parts, received = [], 0
            if not parts:
                trust.check_header(specs, len(tensors), part.size)
            received += len(part.buffer)
            trust.check_wire_size(specs[len(tensors)], received)
            parts.append(part)
        if parts:
            tensors.append(_decoded(specs[len(tensors)], parts))
        if not metadata:
            return None
        if not isinstance(metadata, dict):
            raise trust.StateRefused(f"its metadata is a {type(metadata).__name__}, not a dict")
        trust.check_count(specs, len(tensors))
        return metadata, tensors


class _MarkingEvent(threading.Event):
    """hivemind's 'averaging round finished' event, remembering that a round finished until the result is applied
    (so that the offloaded parameters are checked after averaging only, not after every local step)."""

    def __init__(self) -> None:
        super().__init__()
        self.marked = False

    def set(self) -> None:
        self.marked = True
        super().set()

    def consume_mark(self) -> bool:
        marked, self.marked = self.marked, False
        return marked


def _decoded(spec: trust.TensorSpec, parts: list) -> torch.Tensor:
    try:
        tensor = deserialize_torch_tensor(combine_from_streaming(parts))
    except Exception as error:
        raise trust.StateRefused(f"its {spec.label} could not be decoded: {type(error).__name__}: {error}") from None
    return trust.check_tensor(spec, tensor)


def _peers_of(control: Any, own_id: Any) -> str:
    """The other peers of a finished averaging round, as far as hivemind tells (the poisoner is one of them)."""
    try:
        gathered = control.result(0)
        peers = sorted(str(peer) for peer in gathered if peer != own_id)
    except Exception:
        return "its group"
    return "peer(s) " + ", ".join(peers) if peers else "its group"


def _warn(message: str) -> None:
    log.warning(message)
    warnings.warn(message, trust.SwarmTrustWarning, stacklevel=3)
