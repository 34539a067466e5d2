"""start_lighthouse: a torchft lighthouse in this process that accepts connections once it returns, and stops."""

from __future__ import annotations

import socket
import sys

import pytest

from phalanx.strategies import start_lighthouse

pytest.importorskip("torchft")


def test_the_lighthouse_accepts_connections_until_shut_down():
    with start_lighthouse(min_replicas=2) as lighthouse:
        assert lighthouse.address == f"http://localhost:{lighthouse.port}"
        with socket.create_connection(("localhost", lighthouse.port), timeout=5):
            pass
    lighthouse.shutdown()  # a second shutdown does nothing


@pytest.mark.parametrize("min_replicas", [0, -1, True, 1.5])
def test_bad_min_replicas_are_refused(min_replicas):
    with pytest.raises(ValueError, match=r"must be an int >= 1"):
        start_lighthouse(min_replicas=min_replicas)


def test_a_missing_torchft_is_refused_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchft._torchft", None)
    with pytest.raises(ImportError, match=r"start_lighthouse needs torchft.*pip install 'phalanx\[ft\]'"):
        start_lighthouse()
