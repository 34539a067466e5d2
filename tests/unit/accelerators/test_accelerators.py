"""Accelerators: parsing the Trainer's ``devices`` argument, availability, precisions, registration."""

from __future__ import annotations

import pytest
import torch

from phalanx.accelerators import ACCELERATOR_REGISTRY, Accelerator, CPUAccelerator, CUDAAccelerator, MPSAccelerator


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


# ------------------------------------------------------------------ CPU


@pytest.mark.parametrize(
    ("devices", "expected"), [("auto", 1), (1, 1), (3, 3), ("2", 2), (" 4 ", 4), (-1, 1), ("-1", 1)]
)
def test_cpu_parse_devices(devices: object, expected: int) -> None:
    assert CPUAccelerator.parse_devices(devices) == expected


@pytest.mark.parametrize("devices", [0, -2, "0", "-3"])
def test_cpu_parse_devices_rejects_non_positive_counts(devices: object) -> None:
    with pytest.raises(ValueError, match=">= 1"):
        CPUAccelerator.parse_devices(devices)


def test_cpu_parse_devices_rejects_a_list_and_says_to_pass_an_int() -> None:
    with pytest.raises(ValueError, match=r"pass a positive int") as error:
        CPUAccelerator.parse_devices([0])
    assert "[0]" in str(error.value)


@pytest.mark.parametrize("devices", [True, False, 2.0, None, "two", "0,1"])
def test_cpu_parse_devices_rejects_other_types(devices: object) -> None:
    with pytest.raises(ValueError, match="not valid for the cpu accelerator"):
        CPUAccelerator.parse_devices(devices)


def test_cpu_parallel_devices_and_availability() -> None:
    assert CPUAccelerator.get_parallel_devices(3) == [torch.device("cpu")] * 3
    assert CPUAccelerator.is_available()
    assert CPUAccelerator.auto_device_count() == 1
    assert "bf16-mixed" in CPUAccelerator.supported_precisions()
    assert CPUAccelerator().get_device_stats(torch.device("cpu")) == {}


# ------------------------------------------------------------------ CUDA (device count faked)


@pytest.mark.parametrize(
    ("devices", "expected"),
    [
        ([0, 1], [0, 1]),
        ([1], [1]),
        ((1, 0), [1, 0]),
        ("0,1", [0, 1]),
        ("1,", [1]),
        (" 0, 1 ", [0, 1]),
        (-1, [0, 1]),
        ("-1", [0, 1]),
        ("auto", [0, 1]),
        (1, [0]),
        (2, [0, 1]),
        ("2", [0, 1]),
    ],
)
def test_cuda_parse_devices(two_gpus: None, devices: object, expected: list[int]) -> None:
    assert CUDAAccelerator.parse_devices(devices) == expected


def test_cuda_parse_devices_too_many_says_how_many_the_machine_has(two_gpus: None) -> None:
    with pytest.raises(ValueError, match="asks for 3 cuda devices, but this machine has 2"):
        CUDAAccelerator.parse_devices(3)


@pytest.mark.parametrize("devices", [[2], [0, 2], "0,2", [-1]])
def test_cuda_parse_devices_out_of_range_index_names_valid_indices(two_gpus: None, devices: object) -> None:
    with pytest.raises(ValueError, match=r"valid indices are \[0, 1\]"):
        CUDAAccelerator.parse_devices(devices)


@pytest.mark.parametrize("devices", [[0, 0], "1,1", (1, 0, 1)])
def test_cuda_parse_devices_rejects_duplicates(two_gpus: None, devices: object) -> None:
    with pytest.raises(ValueError, match="more than once"):
        CUDAAccelerator.parse_devices(devices)


@pytest.mark.parametrize("devices", [0, "0", -2])
def test_cuda_parse_devices_rejects_non_positive_counts(two_gpus: None, devices: object) -> None:
    with pytest.raises(ValueError, match="at least one cuda device"):
        CUDAAccelerator.parse_devices(devices)


@pytest.mark.parametrize("devices", [[], [True], [0.0], "a,b", True, 1.5, None])
def test_cuda_parse_devices_rejects_malformed_input(two_gpus: None, devices: object) -> None:
    with pytest.raises(ValueError):
        CUDAAccelerator.parse_devices(devices)


def test_cuda_parallel_devices_and_availability(two_gpus: None) -> None:
    assert CUDAAccelerator.get_parallel_devices("1,") == [torch.device("cuda", 1)]
    assert CUDAAccelerator.get_parallel_devices(-1) == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert CUDAAccelerator.is_available()
    assert CUDAAccelerator.auto_device_count() == 2


def test_cuda_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert not CUDAAccelerator.is_available()
    assert "bf16-mixed" not in CUDAAccelerator.supported_precisions()
    with pytest.raises(ValueError, match="this machine has 0"):
        CUDAAccelerator.parse_devices(1)
    with pytest.raises(ValueError, match="at least one"):
        CUDAAccelerator.parse_devices("auto")  # 'auto' with no GPU: no silent empty list


def test_cuda_setup_device_rejects_a_cpu_device() -> None:
    with pytest.raises(ValueError, match="non-CUDA device"):
        CUDAAccelerator().setup_device(torch.device("cpu"))


# ------------------------------------------------------------------ MPS


def test_mps_without_mps_has_no_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert not MPSAccelerator.is_available()
    assert MPSAccelerator.auto_device_count() == 0
    with pytest.raises(ValueError, match="this machine has 0"):
        MPSAccelerator.parse_devices(1)
    assert "64-true" not in MPSAccelerator.supported_precisions()


def test_mps_with_one_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("platform.system", lambda: "Darwin")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert MPSAccelerator.parse_devices(1) == [0]
    assert MPSAccelerator.parse_devices("auto") == [0]
    with pytest.raises(ValueError, match=r"valid indices are \[0\]"):
        MPSAccelerator.parse_devices([1])


# ------------------------------------------------------------------ registry


@pytest.mark.parametrize(("name", "cls"), [("cpu", CPUAccelerator), ("CUDA", CUDAAccelerator), ("mps", MPSAccelerator)])
def test_builtin_accelerators_are_registered(name: str, cls: type) -> None:
    assert name in ACCELERATOR_REGISTRY
    assert ACCELERATOR_REGISTRY.get_class(name) is cls
    assert isinstance(ACCELERATOR_REGISTRY.get(name), cls)
    assert ACCELERATOR_REGISTRY.description(name)


def test_accelerator_base_is_abstract() -> None:
    with pytest.raises(TypeError):
        Accelerator()  # type: ignore[abstract]
