"""Shared pytest set-up: the test models live in phalanx_testing.py beside this file (importable from every test)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _restore_torch_globals():
    # Tests that change torch's global switches (deterministic algorithms, default dtype) must not leak them.
    dtype = torch.get_default_dtype()
    deterministic = torch.are_deterministic_algorithms_enabled()
    yield
    torch.set_default_dtype(dtype)
    torch.use_deterministic_algorithms(deterministic)
