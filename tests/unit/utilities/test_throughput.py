"""The throughput arithmetic against Lightning's (lightning_fabric.utilities.throughput) on the same updates, the FLOP
count of torch's counter, and the peak FLOP/s table behind the MFU."""

from __future__ import annotations

import pytest
import torch

from phalanx.utilities.throughput import Throughput, compute_dtype, get_available_flops, measure_flops


def _updates(count: int, *, lengths: bool, flops: bool, seconds: float = 0.5, batch: int = 8) -> list[dict]:
    return [
        dict(
            time=seconds * i + 0.01 * i * i,  # batches that take longer and longer
            batches=i,
            samples=batch * i,
            lengths=3 * batch * i if lengths else None,
            flops=1000.0 + i if flops else None,
        )
        for i in range(1, count + 1)
    ]


CASES = [
    # (updates, window_size, world_size, available_flops)
    (_updates(1, lengths=False, flops=False), 2, 1, None),
    (_updates(5, lengths=False, flops=False), 3, 1, None),
    (_updates(5, lengths=True, flops=True), 3, 1, 1e6),
    (_updates(7, lengths=True, flops=True), 4, 2, 5e5),
    (_updates(3, lengths=True, flops=False), 100, 4, None),  # the window is not full: totals only
    (_updates(12, lengths=False, flops=True), 10, 8, None),
]


@pytest.mark.parametrize(("updates", "window", "world", "peak"), CASES)
def test_the_metrics_are_lightnings_names_and_values(updates, window, world, peak):
    lightning = pytest.importorskip("lightning_fabric.utilities.throughput")
    ours = Throughput(available_flops=peak, world_size=world, window_size=window)
    theirs = lightning.Throughput(available_flops=peak, world_size=world, window_size=window)
    for update in updates:
        ours.update(**update)
        theirs.update(**update)
    expected = theirs.compute()
    assert ours.compute() == pytest.approx(expected)
    assert set(ours.compute()) == set(expected)


def test_the_rates_over_a_full_window_by_hand():
    throughput = Throughput(available_flops=100.0, world_size=2, window_size=3)
    for i, seconds in enumerate([1.0, 2.0, 4.0], start=1):
        throughput.update(time=seconds, batches=i, samples=8 * i, lengths=64 * i, flops=30.0)
    metrics = throughput.compute()
    assert metrics["device/batches_per_sec"] == pytest.approx(2 / 3)  # 2 more batches in 3 s
    assert metrics["device/samples_per_sec"] == pytest.approx(16 / 3)
    assert metrics["device/items_per_sec"] == pytest.approx(128 / 3)
    assert metrics["samples_per_sec"] == pytest.approx(32 / 3)  # the world: 2 devices
    assert metrics["device/flops_per_sec"] == pytest.approx(60 / 3)  # the first update's FLOPs precede the window
    assert metrics["device/mfu"] == pytest.approx(20 / 100)


@pytest.mark.parametrize(
    ("update", "message"),
    [
        (dict(time=1.0, batches=2, samples=20), "time=1.0 does not increase"),
        (dict(time=2.0, batches=1, samples=20), "batches=1 does not increase"),
        (dict(time=2.0, batches=2, samples=1), "samples=1 is below batches=2"),
        (dict(time=2.0, batches=2, samples=20, lengths=3), "lengths=3 is below samples=20"),
    ],
)
def test_totals_that_do_not_grow_are_refused(update, message):
    throughput = Throughput(window_size=2)
    throughput.update(time=1.0, batches=1, samples=10)
    with pytest.raises(ValueError, match=message):
        throughput.update(**update)


@pytest.mark.parametrize(("argument", "value"), [("window_size", 1), ("world_size", 0), ("window_size", 2.5)])
def test_bad_sizes_are_refused(argument, value):
    with pytest.raises(ValueError, match=f"{argument}={value} is not valid"):
        Throughput(**{argument: value})


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("batch", [1, 8])
def test_measure_flops_is_torchs_count(batch, backward):
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
        x = torch.randn(batch, 32)
    loss = (lambda y: y.sum()) if backward else None
    forward = 2 * batch * (32 * 64 + 64 * 4)  # a multiply and an add per weight and sample
    # Backward: the weights' gradients and the inputs' of every layer but the first (x needs no gradient).
    backward_flops = 2 * forward - 2 * batch * 32 * 64
    assert measure_flops(model, lambda: model(x), loss) == forward + (backward_flops if backward else 0)


@pytest.mark.parametrize(
    ("name", "dtype", "matmul", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, "highest", 989.4e12),
        ("NVIDIA H100 80GB HBM3", torch.float32, "high", 494.7e12),  # on the tensor cores as tf32
        ("NVIDIA H100 80GB HBM3", torch.float32, "highest", 67e12),
        ("NVIDIA H100 PCIe", torch.float16, "highest", 756e12),
        ("NVIDIA H200", torch.bfloat16, "highest", 989.4e12),
        ("NVIDIA A100-SXM4-80GB", torch.bfloat16, "highest", 312e12),
        ("NVIDIA L4", torch.float16, "highest", 121e12),
        ("Tesla V100-SXM2-16GB", torch.float16, "highest", 125e12),
        ("Tesla T4", torch.bfloat16, "highest", None),  # no bfloat16 on a T4
        ("NVIDIA H100 NVL", torch.bfloat16, "highest", None),
        ("NVIDIA GeForce GTX 1080", torch.float32, "highest", None),
    ],
)
def test_the_peak_of_a_cuda_device(monkeypatch, name, dtype, matmul, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(matmul)
    try:
        assert get_available_flops(torch.device("cuda", 0), dtype) == peak
    finally:
        torch.set_float32_matmul_precision(previous)


def test_no_peak_off_cuda():
    assert get_available_flops(torch.device("cpu"), torch.float32) is None


@pytest.mark.parametrize(
    ("precision", "dtype"),
    [("32-true", torch.float32), ("bf16-mixed", torch.bfloat16), ("16-mixed", torch.float16),
     ("bf16-true", torch.bfloat16), ("64-true", torch.float64), ("transformer-engine", None)],
)  # fmt: skip
def test_the_compute_dtype_of_a_precision(precision, dtype):
    assert compute_dtype(precision) is dtype
