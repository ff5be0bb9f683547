"""The baton a link's consumer and its receiving thread share (`lightning_pipe.comm.p2p.direct`), without processes:
the frames are a fake link's, delivered by whoever holds the baton."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from lightning_pipe.comm.base import Message, QueueInbox
from lightning_pipe.comm.p2p import direct
from lightning_pipe.comm.p2p.direct import Baton

GRACE = 0.5  # longer than the real one: who reads the link must not depend on this machine's load


@pytest.fixture(autouse=True)
def _grace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(direct, "GRACE", GRACE)


class FakeLink:
    """Frames arrive on a queue; ``pump`` (under the baton) waits for one and delivers it, noting which thread did."""

    def __init__(self, inbox: QueueInbox) -> None:
        self.inbox, self.frames = inbox, queue.SimpleQueue()
        self.pumped_by: list[str] = []
        self.busy = threading.Lock()  # held while pumping: two pumps at once would be the bug the baton prevents

    def pump(self) -> None:
        assert self.busy.acquire(blocking=False), "two threads waited on the link at once"
        try:
            frame = self.frames.get(timeout=10)
            self.pumped_by.append(threading.current_thread().name)
            if frame is not None:
                self.inbox.put(frame)
        finally:
            self.busy.release()


def thread_loop(baton: Baton, link: FakeLink, stop: threading.Event) -> None:
    while not stop.is_set() and baton.take_for_thread():
        link.pump()
        baton.thread_done()


def test_the_consumer_waits_on_the_link_itself_while_its_inbox_is_empty() -> None:
    inbox = QueueInbox()
    link, baton, stop = FakeLink(inbox), Baton(), threading.Event()
    baton.give_back()  # as after the consumer's last frame: the thread leaves the link to it for GRACE
    thread = threading.Thread(target=thread_loop, args=(baton, link, stop), name="receiving", daemon=True)
    thread.start()
    try:
        for i in range(20):  # a quick consumer: each message arrives while it waits, and it takes it itself
            link.frames.put(Message("activation", microbatch=i))
            message = direct.receive(inbox, baton, link.pump, timeout=5)
            assert message is not None and message.microbatch == i
        assert link.pumped_by == ["MainThread"] * 20
    finally:
        baton.end()
        link.frames.put(None)
        thread.join(5)
    assert not thread.is_alive(), "the receiving thread ends with the link"


def test_the_receiving_thread_reads_the_link_while_the_consumer_is_away_and_hands_it_back() -> None:
    inbox = QueueInbox()
    link, baton, stop = FakeLink(inbox), Baton(), threading.Event()
    thread = threading.Thread(target=thread_loop, args=(baton, link, stop), name="receiving", daemon=True)
    thread.start()
    try:
        for i in range(3):  # the consumer is away (a long action): the thread delivers into the inbox
            link.frames.put(Message("activation", microbatch=i))
        until = time.monotonic() + 5
        while len(link.pumped_by) < 3 and time.monotonic() < until:
            time.sleep(0.01)
        assert link.pumped_by == ["receiving"] * 3
        for i in range(3):  # what came meanwhile is in the inbox
            assert direct.receive(inbox, baton, link.pump, timeout=5).microbatch == i  # type: ignore[union-attr]
        # the thread holds the baton, blocked on the link: the consumer waits on its inbox, the thread hands the
        # baton over after the next frame, and the consumer reads the one after that itself
        feeder = threading.Timer(0.2, lambda: link.frames.put(Message("activation", microbatch=3)))
        feeder.start()
        assert direct.receive(inbox, baton, link.pump, timeout=5).microbatch == 3  # type: ignore[union-attr]
        assert link.pumped_by[-1] == "receiving"
        link.frames.put(Message("activation", microbatch=4))
        assert direct.receive(inbox, baton, link.pump, timeout=5).microbatch == 4  # type: ignore[union-attr]
        assert link.pumped_by[-1] == "MainThread"
        time.sleep(GRACE * 3)  # the consumer leaves: the thread takes the link back
        link.frames.put(Message("activation", microbatch=5))
        assert inbox.get(5).microbatch == 5  # type: ignore[union-attr]
        assert link.pumped_by[-1] == "receiving"
    finally:
        baton.end()
        link.frames.put(None)
        thread.join(5)
    assert not thread.is_alive()


def test_a_consumer_times_out_on_an_empty_inbox_once_the_link_ended() -> None:
    inbox, baton = QueueInbox(), Baton()
    baton.end()
    start = time.monotonic()
    assert direct.receive(inbox, baton, lambda: None, timeout=0.05) is None
    assert time.monotonic() - start < 1


def test_a_message_another_thread_puts_in_wakes_the_consumer_waiting_on_the_link() -> None:
    baton = Baton()
    pokes: list[str] = []

    def wake() -> None:  # the wire pokes the peer, which answers with a keep-alive: a frame without a message
        pokes.append(threading.current_thread().name)
        link.frames.put(None)

    inbox = direct.WakingInbox(baton, wake)
    link = FakeLink(inbox)
    putter = threading.Timer(0.2, lambda: inbox.put(Message("step", step=7)))  # the coordinator's thread
    putter.start()
    start = time.monotonic()
    message = direct.receive(inbox, baton, link.pump, timeout=5)  # the consumer waits on the (silent) link
    assert message is not None and message.step == 7 and time.monotonic() - start < 2
    assert len(pokes) == 1 and pokes[0] != "MainThread"
    link.frames.put(Message("activation", microbatch=0))  # the consumer's own deliveries wake no one
    assert direct.receive(inbox, baton, link.pump, timeout=5).microbatch == 0  # type: ignore[union-attr]
    assert len(pokes) == 1
    putter.join(5)


def test_several_messages_put_during_one_wait_poke_the_peer_once() -> None:
    baton, pokes = Baton(), []
    inbox = direct.WakingInbox(baton, lambda: pokes.append(1))
    assert baton.take(inbox) == direct.TAKEN  # the consumer waits on the link
    done = threading.Event()

    def coordinator() -> None:  # the microbatches of a step, put one by one by another thread
        for i in range(5):
            inbox.put(Message("input", microbatch=i))
        done.set()

    threading.Thread(target=coordinator, daemon=True).start()
    assert done.wait(5)
    assert len(pokes) == 1
    baton.give_back()
    assert baton.take(inbox) == direct.ARRIVED  # the consumer finds them before it waits again
