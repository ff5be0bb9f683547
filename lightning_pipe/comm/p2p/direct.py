"""A link's receive waited on by the thread that needs its messages, not handed over by a receiving thread.

Through a receiving thread a message wakes two threads; where one thread consumes all that a link brings (the
stage of a serving process in a two-process pipeline: `Wire`'s ``direct``), that thread waits on gloo itself
while its inbox is empty, as torch.distributed.pipelining's ranks do. gloo's wait cannot be interrupted, so
the receiving thread stays and the two share the receive through a `Baton`: the consumer takes it when it is
free; the thread takes it back once the consumer has left it for `GRACE` seconds (a long action, a
collective), so the link is read as before while the consumer does something else. A consumer waiting in gloo
wakes with the link's next frame: another thread that puts a message into its inbox (`WakingInbox`) pokes the
peer, which answers with a keep-alive (docs/overhead.md, docs/internals.md).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from lightning_pipe.comm.base import Message, QueueInbox, deadline, remaining

TAKEN, ARRIVED, BUSY = "taken", "arrived", "busy"  # what `Baton.take` found
GRACE = 0.005  # seconds the receiving thread leaves the link to the consumer after the consumer gave it back
LOOK = 0.05  # seconds between the receiving thread's looks while the consumer holds the baton


class DirectLink(NamedTuple):
    """A link its consumer reads itself: the baton they share, a read of one frame, a wake of the waiting consumer."""

    baton: Baton
    pump: Callable[[], None]
    wake: Callable[[], None]


class Baton:
    """Who waits on a link's receive: nobody, the consumer, or the receiving thread."""

    def __init__(self, look: float = LOOK) -> None:
        self.look = look  # seconds between the receiving thread's looks while the consumer holds the baton
        self._cond = threading.Condition(threading.Lock())  # a plain lock: cheaper than the default RLock
        self._holder: str | None = None  # "consumer" or "thread"
        self._consumer = 0  # the consumer's thread while it holds the baton
        self._woken = False  # a put already woke the consumer's present wait (one poke per wait)
        self._wanted = False  # the consumer waits on its inbox while the thread holds the baton
        self._returned = 0.0  # when the consumer last gave it back
        self._ended = False  # the link closed or broke

    # the consumer
    def take(self, inbox: QueueInbox) -> str:
        """`TAKEN`: the consumer holds the baton (it waits on the link, then gives it back); `ARRIVED`: its inbox
        is not empty; `BUSY`: the receiving thread holds it (and hands it over after its next frame)."""
        with self._cond:  # with the inbox's puts (`WakingInbox`): a message put meanwhile is seen, or it wakes us
            if not inbox.empty():
                return ARRIVED
            if self._holder is None and not self._ended:
                self._holder, self._consumer, self._woken = "consumer", threading.get_ident(), False
                return TAKEN
            self._wanted = True
            return BUSY

    def give_back(self) -> None:
        with self._cond:
            self._holder = None
            self._returned = time.monotonic()

    def served(self) -> None:
        """The consumer's inbox woke it: the thread need not hand the baton over any more."""
        self._wanted = False

    # the receiving thread
    def take_for_thread(self) -> bool:
        """Block until the consumer has left the baton for `GRACE` seconds, then hold it; False once the link ended."""
        with self._cond:
            while not self._ended:
                if self._holder == "thread":  # kept after its last frame (`thread_done`)
                    return True
                if self._holder is None:
                    idle = time.monotonic() - self._returned
                    if idle >= GRACE:
                        self._holder = "thread"
                        return True
                    self._cond.wait(GRACE - idle)
                else:  # the consumer waits on the link: look again later (its give_back wakes no one)
                    self._cond.wait(self.look)
            return False

    def thread_done(self) -> None:
        """After one frame: keep the baton, unless the consumer waits on its inbox (then it takes the next)."""
        with self._cond:
            if self._wanted:
                self._wanted = False
                self._holder = None
                self._returned = time.monotonic()

    def put(self, inbox: QueueInbox, message: Message) -> bool:
        """Put ``message`` into the consumer's inbox; whether the consumer waits on the link (to be woken)."""
        with self._cond:
            QueueInbox.put(inbox, message)
            wake = self._holder == "consumer" and not self._woken and threading.get_ident() != self._consumer
            self._woken |= wake
            return wake

    def end(self) -> None:
        with self._cond:
            self._ended = True
            self._cond.notify_all()

    @property
    def ended(self) -> bool:
        return self._ended


class WakingInbox(QueueInbox):
    """The inbox of a link's one consumer: a message another thread puts in while the consumer waits on the link
    (its own process's coordinator, a stop, a lost peer) wakes it through ``wake`` (a poke of the peer)."""

    def __init__(self, baton: Baton, wake: Callable[[], None]) -> None:
        super().__init__()
        self.baton, self.wake = baton, wake

    def put(self, message: Message) -> None:
        put_waking(self, self.baton, self.wake, message)


def put_waking(inbox: QueueInbox, baton: Baton, wake: Callable[[], None], message: Message) -> None:
    """Put ``message`` into a consumer's ``inbox`` (any `QueueInbox`), waking the consumer if it waits on the link."""
    if baton.put(inbox, message):
        wake()


def receive(inbox: QueueInbox, baton: Baton, pump: Callable[[], None], timeout: float | None) -> Message | None:
    """The inbox's next message for its one consumer, waiting on the link itself while the baton is free.

    A wait on the link ends with its next frame, not at ``timeout``: another thread's message wakes it
    (`WakingInbox`), and on an idle link the peer's keep-alive comes within `Wire.keepalive` seconds (or the
    link breaks, and the wire puts LOST into the inbox)."""
    until = deadline(timeout) if timeout is not None else None
    while True:
        message = inbox.get(0)
        if message is not None:
            return message
        if until is not None and remaining(until) <= 0:
            return None
        taken = baton.take(inbox)
        if taken == ARRIVED:
            continue
        if taken == TAKEN:
            try:
                pump()
            finally:
                baton.give_back()
            continue
        message = inbox.get(remaining(until) if until is not None else None)
        baton.served()
        return message
