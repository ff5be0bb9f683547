"""A link's receive waited on by the thread that needs its messages, not handed over by a receiving thread.

Through a receiving thread a message wakes two threads; where one thread consumes all that a link brings (the
stage of a serving process in a two-process pipeline: `Wire`'s ``direct``), that thread waits on gloo itself
while its inbox is empty, as torch.distributed.pipelining's ranks do. gloo's wait cannot be interrupted, so
the receiving thread stays and the two share the receive through a `Baton`: the consumer takes it when it is
free; the thread takes it back once the consumer has left it for `GRACE` seconds (a long action, a
collective), so the link is read as before while the consumer does something else. A consumer waiting in gloo
wakes with the link's next frame (a message, or the peer's keep-alive): nothing else may deliver into its
inbox (docs/overhead.md, docs/internals.md).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from lightning_pipe.comm.base import Message, QueueInbox, deadline, remaining

GRACE = 0.005  # seconds the receiving thread leaves the link to the consumer after the consumer gave it back
LOOK = 0.05  # seconds between the receiving thread's looks while the consumer holds the baton


class Baton:
    """Who waits on a link's receive: nobody, the consumer, or the receiving thread."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._holder: str | None = None  # "consumer" or "thread"
        self._wanted = False  # the consumer waits on its inbox while the thread holds the baton
        self._returned = 0.0  # when the consumer last gave it back
        self._ended = False  # the link closed or broke

    # the consumer
    def take(self) -> bool:
        """Hold the baton if it is free (then wait on the link and `give_back`); else note that it is wanted."""
        with self._cond:
            if self._holder is None and not self._ended:
                self._holder = "consumer"
                return True
            self._wanted = True
            return False

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
                    self._cond.wait(LOOK)
            return False

    def thread_done(self) -> None:
        """After one frame: keep the baton, unless the consumer waits on its inbox (then it takes the next)."""
        with self._cond:
            if self._wanted:
                self._wanted = False
                self._holder = None
                self._returned = time.monotonic()

    def end(self) -> None:
        with self._cond:
            self._ended = True
            self._cond.notify_all()

    @property
    def ended(self) -> bool:
        return self._ended


def receive(inbox: QueueInbox, baton: Baton, pump: Callable[[], None], timeout: float | None) -> Message | None:
    """The inbox's next message for its one consumer, waiting on the link itself while the baton is free.

    A wait on the link ends with its next frame, not at ``timeout``: on an idle link the peer's keep-alive comes
    within `Wire.keepalive` seconds (or the link breaks, and the wire puts LOST into the inbox)."""
    until = deadline(timeout) if timeout is not None else None
    while True:
        message = inbox.get(0)
        if message is not None:
            return message
        if until is not None and remaining(until) <= 0:
            return None
        if baton.take():
            try:
                pump()
            finally:
                baton.give_back()
            continue
        message = inbox.get(remaining(until) if until is not None else None)
        baton.served()
        return message
