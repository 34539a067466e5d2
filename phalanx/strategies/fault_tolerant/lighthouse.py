"""A torchft lighthouse in this process, for tests, notebooks and one-machine runs (``start_lighthouse``)."""

from __future__ import annotations

import argparse
import socket
import time
from datetime import timedelta
from typing import Any

from phalanx.strategies.fault_tolerant.torchft_import import require_torchft


class Lighthouse:
    """A running torchft LighthouseServer: ``address`` for the replica groups; ``shutdown()`` or ``with`` stops it."""

    def __init__(self, server: Any, host: str, port: int) -> None:
        self._server: Any = server
        self.host = host
        self.port = port

    @property
    def address(self) -> str:
        """What each replica group passes as ``FaultTolerance(lighthouse=...)`` or TORCHFT_LIGHTHOUSE."""
        return f"http://{self.host}:{self.port}"

    def shutdown(self) -> None:
        """Stop serving (again: nothing)."""
        if self._server is not None:
            self._server.shutdown()
            self._server = None

    def __enter__(self) -> Lighthouse:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


def _wait_until_listening(host: str, port: int, timeout: timedelta) -> None:
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError as error:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"The lighthouse did not accept connections on {host}:{port} within {timeout}: {error}."
                ) from None
            time.sleep(0.05)


def start_lighthouse(
    min_replicas: int = 1,
    port: int = 0,
    host: str = "localhost",
    join_timeout: timedelta = timedelta(seconds=1),
    heartbeat_timeout: timedelta = timedelta(seconds=5),
    quorum_tick: timedelta = timedelta(milliseconds=100),
    start_timeout: timedelta = timedelta(seconds=30),
) -> Lighthouse:
    """Serve a torchft lighthouse on ``port`` (0: a free one) of every interface; returns once it accepts connections.

    ``min_replicas`` replica groups must join before the first quorum; after that a quorum forms ``join_timeout`` after
    a change, with the groups then present (at least ``min_replicas``). A group that sent no heartbeat for
    ``heartbeat_timeout`` is left out of the next quorum.
    """
    if isinstance(min_replicas, bool) or not isinstance(min_replicas, int) or min_replicas < 1:
        raise ValueError(f"start_lighthouse(min_replicas={min_replicas!r}) must be an int >= 1.")
    torchft = require_torchft("start_lighthouse")
    server = torchft.LighthouseServer(
        bind=f"[::]:{port}",
        min_replicas=min_replicas,
        join_timeout_ms=int(join_timeout.total_seconds() * 1000),
        quorum_tick_ms=int(quorum_tick.total_seconds() * 1000),
        heartbeat_timeout_ms=int(heartbeat_timeout.total_seconds() * 1000),
    )
    bound_port = int(server.address().rsplit(":", 1)[1])
    lighthouse = Lighthouse(server, host, bound_port)
    try:
        _wait_until_listening(host, bound_port, start_timeout)
    except BaseException:
        lighthouse.shutdown()
        raise
    return lighthouse


def main(argv: list[str] | None = None) -> None:
    """``python -m phalanx.strategies.fault_tolerant.lighthouse --min-replicas 2 --port 29510``: serve until Ctrl-C."""
    parser = argparse.ArgumentParser(description="Serve a torchft lighthouse for phalanx's fault-tolerant strategies.")
    parser.add_argument("--min-replicas", type=int, default=1, help="replica groups needed for the first quorum")
    parser.add_argument("--port", type=int, default=29510, help="port to serve on (0: any free one)")
    parser.add_argument("--join-timeout-ms", type=int, default=1000, help="wait for more groups after a change")
    arguments = parser.parse_args(argv)
    lighthouse = start_lighthouse(
        arguments.min_replicas, arguments.port, join_timeout=timedelta(milliseconds=arguments.join_timeout_ms)
    )
    print(f"lighthouse serving at {lighthouse.address} (Ctrl-C stops it)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        lighthouse.shutdown()


if __name__ == "__main__":
    main()
