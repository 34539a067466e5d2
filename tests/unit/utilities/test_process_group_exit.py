"""Ending the process group at exit: registered once, gloo's threads get time without the GIL, then the group goes."""

import atexit
import socket
import threading
import time

import pytest
import torch

from phalanx.utilities import process_group_exit


@pytest.fixture
def one_process_group(monkeypatch):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    store = torch.distributed.TCPStore("127.0.0.1", port, 1, is_master=True)
    torch.distributed.init_process_group("gloo", rank=0, world_size=1, store=store)
    monkeypatch.setattr(process_group_exit, "_state", {"registered": False})
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def test_registers_the_exit_handler_once(monkeypatch, one_process_group):
    registered = []
    monkeypatch.setattr(atexit, "register", registered.append)
    process_group_exit.destroy_process_group_at_exit()
    process_group_exit.destroy_process_group_at_exit()
    assert registered == [process_group_exit._end_process_group]


def test_exit_lets_another_thread_take_the_gil_before_destroying_the_group(one_process_group):
    # Stands in for a gloo worker that needs the GIL to free a finished collective's tensors.
    ran_while_group_alive = []
    started = threading.Event()

    def worker():
        started.set()
        time.sleep(0.01)
        ran_while_group_alive.append(torch.distributed.is_initialized())

    thread = threading.Thread(target=worker)
    thread.start()
    started.wait()
    process_group_exit._end_process_group()
    thread.join()
    assert ran_while_group_alive == [True]
    assert not torch.distributed.is_initialized()


def test_nothing_to_do_without_a_process_group(monkeypatch):
    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    process_group_exit._end_process_group()
    assert slept == []
