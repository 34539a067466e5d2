"""HostCopies: numbers for display read from host copies, never by waiting for the device. A copy still on its way
(simulated: an event the test releases) leaves the previous numbers shown; ``wait=True`` waits for it."""

from __future__ import annotations

import pickle

import pytest
import torch

from phalanx.testing.step_counts import StepWindow
from phalanx.utilities import host_copies
from phalanx.utilities.host_copies import HostCopies


class _Event:
    """A copy's event that arrives when the test says so (``synchronize`` makes it arrive)."""

    def __init__(self) -> None:
        self.arrived = False
        self.waits = 0

    def query(self) -> bool:
        return self.arrived

    def synchronize(self) -> None:
        self.waits += 1
        self.arrived = True


@pytest.fixture
def slow_device(monkeypatch):
    """Copies behave as a busy GPU's: each is done only once the test releases its event."""
    events: list[_Event] = []

    def start_copy(host, values):
        host.copy_(values)
        events.append(_Event())
        return events[-1]

    monkeypatch.setattr(host_copies, "start_copy", start_copy)
    return events


@pytest.mark.parametrize(
    ("metrics", "shown"),
    [
        ({"loss": torch.tensor(0.25)}, {"loss": 0.25}),
        ({"acc": torch.tensor(0.5, dtype=torch.float64), "n": torch.tensor(3)}, {"acc": 0.5, "n": 3}),
        ({"half": torch.tensor(1.5, dtype=torch.bfloat16)}, {"half": 1.5}),
        ({"name": "abc", "count": 4, "loss": torch.tensor(2.0)}, {"name": "abc", "count": 4, "loss": 2.0}),
        ({"vector": torch.tensor([1.0, 2.0]), "loss": torch.tensor([0.5])}, {"vector": "[1.0, 2.0]", "loss": 0.5}),
        ({"flag": torch.tensor(True)}, {"flag": 1}),
        ({}, {}),
    ],
    ids=[
        "float32",
        "float64-and-int",
        "bfloat16",
        "mixed-with-plain-values",
        "vector-and-one-element",
        "bool",
        "empty",
    ],
)
def test_cpu_values_are_shown_at_once_as_python_numbers_in_their_order(metrics, shown):
    read = HostCopies().read(metrics)
    assert read == shown
    assert list(read) == list(shown)
    assert all(not isinstance(value, torch.Tensor) for value in read.values())
    assert isinstance(read.get("n", 0), int) and isinstance(read.get("loss", 0.0), float)


def test_later_reads_show_the_new_values_and_adapt_to_new_keys():
    copies = HostCopies()
    assert copies.read({"loss": torch.tensor(1.0)}) == {"loss": 1.0}
    assert copies.read({"loss": torch.tensor(2.0), "acc": torch.tensor(0.5)}) == {"loss": 2.0, "acc": 0.5}
    assert copies.read({"acc": torch.tensor(0.75)}) == {"acc": 0.75}


def test_a_copy_still_on_its_way_leaves_the_previous_numbers_shown(slow_device):
    copies = HostCopies()
    assert copies.read({"loss": torch.tensor(1.0)}) == {}  # the first copy has not arrived: nothing to show yet
    slow_device[-1].arrived = True
    # The first copy arrived: it is shown; a second copy starts.
    assert copies.read({"loss": torch.tensor(2.0)}) == {"loss": 1.0}
    assert len(slow_device) == 2
    # The device is behind: no third copy is started on top of the one on its way, and the old number stays.
    assert copies.read({"loss": torch.tensor(3.0)}) == {"loss": 1.0}
    assert len(slow_device) == 2
    slow_device[-1].arrived = True
    assert copies.read({"loss": torch.tensor(4.0)}) == {"loss": 2.0}
    assert all(event.waits == 0 for event in slow_device)


def test_wait_shows_the_newest_values_waiting_for_them(slow_device):
    copies = HostCopies()
    copies.read({"loss": torch.tensor(1.0)})
    assert copies.read({"loss": torch.tensor(5.0)}, wait=True) == {"loss": 5.0}
    assert [event.waits for event in slow_device] == [1, 1]


def test_reads_after_the_first_do_no_host_device_synchronisation():
    # The first read allocates the host buffer and its NumPy view; every later read is a copy and a memory read.
    copies = HostCopies()
    copies.read({"loss": torch.tensor(1.0), "acc": torch.tensor(0.5)})
    window = StepWindow(warmup=1, steps=3)
    for step in range(window.total_steps):
        window.at_step(step)
        assert copies.read({"loss": torch.tensor(float(step)), "acc": torch.tensor(0.5)})["loss"] == float(step)
    window.close()
    counts = window.result()
    assert counts.syncs == 0, counts.sync_calls


def test_a_pickled_reader_starts_empty_and_reads_correctly():
    copies = HostCopies()
    copies.read({"loss": torch.tensor(1.0)})
    copy = pickle.loads(pickle.dumps(copies))
    assert copy.read({"loss": torch.tensor(7.0)}) == {"loss": 7.0}
    assert copies.read({"loss": torch.tensor(3.0)}) == {"loss": 3.0}


@pytest.mark.parametrize(
    "modes",
    [("inference", "normal"), ("normal", "inference"), ("inference", "inference"), ("no_grad", "normal")],
    ids=lambda modes: "-then-".join(modes),
)
def test_reads_inside_and_outside_inference_mode_follow_each_other(modes):
    """A validation redraws inside inference mode, training outside it: the buffer made at the first read must take the
    copies of the next read whichever mode each runs in (an inference tensor refuses in-place copies outside it)."""
    contexts = {"inference": torch.inference_mode, "normal": torch.enable_grad, "no_grad": torch.no_grad}
    copies = HostCopies()
    leaf = torch.tensor(1.5, requires_grad=True)
    for step, mode in enumerate(modes):
        with contexts[mode]():
            assert copies.read({"loss": leaf * (step + 1)}) == {"loss": 1.5 * (step + 1)}
