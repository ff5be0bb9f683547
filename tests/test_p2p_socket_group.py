"""`p2p.socket_group`: a gloo group's send and receive over one TCP connection, matched by tag as gloo matches them.

Two threads of this process stand for the two processes (a `HashStore` for their rendezvous): no process starts.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

from lightning_pipe.comm.p2p.socket_group import SocketGroup, pair_on_loopback


def pair(timeout: float = 10.0) -> tuple[SocketGroup, SocketGroup]:
    store = dist.HashStore()
    with ThreadPoolExecutor(2) as pool:
        sockets = list(pool.map(lambda me: pair_on_loopback(store, "test", me, timeout), [0, 1]))
    assert all(s is not None for s in sockets), "two threads of one process reach each other on 127.0.0.1"
    return SocketGroup(sockets[0], 0, timeout), SocketGroup(sockets[1], 1, timeout)  # type: ignore[arg-type]


def test_receives_take_the_oldest_message_of_their_tag_posted_before_or_after_it_came() -> None:
    a, b = pair()
    try:
        frames = [torch.empty(64, dtype=torch.uint8) for _ in range(2)]
        works = [b.recv([f], 0, 0) for f in frames]  # posted ahead, as a wire's frame buffers
        a.send([torch.arange(5, dtype=torch.uint8)], 1, 0)  # smaller than its receive
        a.send([torch.tensor([1.5, -2.0])], 1, 7)  # another tag, before its receive is posted
        a.send([torch.arange(3, dtype=torch.uint8) + 10], 1, 0)
        works[0].wait()
        assert frames[0][:5].tolist() == [0, 1, 2, 3, 4]
        works[1].wait()  # reads past the message of tag 7, which is kept for its receive
        assert frames[1][:3].tolist() == [10, 11, 12]
        body = torch.empty(2)
        b.recv([body], 0, 7).wait()
        assert body.tolist() == [1.5, -2.0]
        # both directions on one connection, any dtype's bytes
        back = torch.empty(3, dtype=torch.bfloat16)
        work = a.recv([back], 1, 0)
        b.send([torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)], 0, 0)
        work.wait()
        assert back.tolist() == [1.0, 2.0, 3.0]
    finally:
        a.close()
        b.close()


def test_a_message_larger_than_its_receive_and_a_closed_peer_raise() -> None:
    a, b = pair()
    try:
        a.send([torch.zeros(8, dtype=torch.uint8)], 1, 0)
        with pytest.raises(RuntimeError, match="8 bytes for a receive of 4"):
            b.recv([torch.empty(4, dtype=torch.uint8)], 0, 0).wait()
        waiting = b.recv([torch.empty(4, dtype=torch.uint8)], 0, 0)
        threading.Timer(0.2, a.close).start()
        with pytest.raises(ConnectionError, match="closed by peer"):
            waiting.wait()
    finally:
        b.close()


def test_a_silent_peer_times_out() -> None:
    a, b = pair(timeout=0.3)
    try:
        with pytest.raises(RuntimeError, match="timed out after"):
            b.recv([torch.empty(4, dtype=torch.uint8)], 0, 0).wait()
    finally:
        a.close()
        b.close()


def test_a_reader_waiting_on_a_silent_peer_wakes_when_its_link_is_aborted() -> None:
    """A peer lost by other means (a heartbeat: its process stopped, its connection still open): `abort` ends the
    wait at once, where the group's timeout is long."""
    a, b = pair(timeout=60.0)
    try:
        waiting = b.recv([torch.empty(4, dtype=torch.uint8)], 0, 0)
        threading.Timer(0.2, b.abort).start()
        start = time.monotonic()
        with pytest.raises(ConnectionError, match="closed"):
            waiting.wait()
        assert time.monotonic() - start < 5
    finally:
        a.close()
        b.close()


def test_peers_that_cannot_reach_each_other_on_loopback_both_get_none(caplog: pytest.LogCaptureFixture) -> None:
    """Process 1 finds no listener of its peer's there (another machine, another network namespace): both fall back,
    and the log says so."""
    store = dist.HashStore()
    store.set("test-socket-port", "1")  # nothing listens on port 1: as if process 0 were elsewhere
    store.set("test-socket-token", "00" * 16)
    with caplog.at_level(logging.INFO, logger="lightning_pipe"):
        assert pair_on_loopback(store, "test", 1, 5.0) is None
    assert store.get("test-socket-outcome") == b"no"
    assert "runs on gloo" in caplog.text
