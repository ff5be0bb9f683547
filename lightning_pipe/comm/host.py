"""`StageHost`: one stage worker, built from its spec, served, its crash reported as a `StageError`, stopped.

Every transport hosts its stages with it: the threads of ``transport="local"`` (`local`), the stages of an
rpc worker process and the rank the coordinator's process holds (`rpc.stages`, `rpc.home`), and launched
mode's ranks, in a serving process or a thread of the coordinator's (`p2p.serve`, `p2p.communicator`).
The worker class comes from the caller (comm never imports the engine): ``worker_cls(spec, endpoint)``
has ``serve()``, its event loop until a STOP, and ``runtimes``. A thread the host starts, it joins.
"""

from __future__ import annotations

import os
import threading
import traceback
from collections.abc import Callable
from typing import Any

import torch

from lightning_pipe.base.errors import PipeError, StageError, TransportError
from lightning_pipe.comm.base import Message, MessageKind
from lightning_pipe.comm.process_device import retarget

Hook = Callable[[Any], None]  # sees a spec before its worker is built, or a worker once built
Report = Callable[[StageError], None]  # told of a crash of the event loop


class StageHost:
    """The stage worker of ``spec`` on ``endpoint`` (an `Endpoint` with an ``inbox``), closed once its loop ends.

    Args:
        device: the device the stage is moved to before it is built (a slot's or a process's own), or None.
        prepare: sees the spec before the worker is built; ``on_build`` the worker once built.
        on_crash: told of the `StageError` of an event loop that broke (a process reports it to the coordinator).
    """

    def __init__(
        self,
        spec: Any,
        worker_cls: Any,
        endpoint: Any,
        device: str | None = None,
        prepare: Hook | None = None,
        on_build: Hook | None = None,
        on_crash: Report | None = None,
    ) -> None:
        self.spec = spec
        self.rank: int = spec.rank
        #: how errors name this worker: its first stage (a rank may hold several)
        self.stage: int = spec.shards[0].index if spec.shards else spec.rank
        self.endpoint = endpoint
        self.worker_cls = worker_cls
        self.device = device
        self.prepare = prepare
        self.on_build = on_build
        self.on_crash = on_crash
        self.worker: Any = None
        self.crash: StageError | None = None  # why the event loop broke, once it did
        self._thread: threading.Thread | None = None
        self._stopping = False  # a STOP was sent: the loop's end is expected

    @property
    def name(self) -> str:
        """The name of its thread."""
        return f"lightning_pipe-stage-{self.rank}"

    def build(self) -> StageError | None:
        """Build the worker; None once built, else the `StageError` naming the stage and its process, with the
        exception that failed as its ``__cause__`` (the caller raises it, here or across the wire)."""
        try:
            if self.device is not None:
                retarget(self.spec, self.device)
            if self.prepare is not None:
                self.prepare(self.spec)
            self.worker = self.worker_cls(self.spec, self.endpoint)
            if self.on_build is not None:
                self.on_build(self.worker)
            return None
        except Exception as exc:
            self.endpoint.close()
            failure = f"building the stage failed: {type(exc).__name__}: {exc}"
            error = StageError(self.stage, None, "build", failure, traceback.format_exc(), self.where())
            error.__cause__ = exc
            return error

    def describe(self) -> dict[str, Any]:
        """Where the built worker runs: its rank, this process's id and its devices."""
        devices = sorted({str(runtime.torch_device) for runtime in self.worker.runtimes.values()})
        return {"rank": self.rank, "pid": os.getpid(), "devices": devices}

    def where(self) -> str:
        return self.endpoint.host(self.rank)

    # serving
    def serve(self) -> None:
        """Serve the built worker in the calling thread until its STOP. A crash of its loop is reported
        (``on_crash``) and raised; a `TransportError` (a peer of the pipeline is lost) is raised as it is."""
        try:
            self.worker.serve()
        except TransportError:
            raise
        except BaseException as exc:
            self.crash = self._crashed(exc)
            if self.on_crash is not None:
                self.on_crash(self.crash)
            raise
        finally:
            self.endpoint.close()  # what still arrives for it is dropped

    def start(self, threads: int | None = None, built: Callable[[StageError | None], None] | None = None) -> None:
        """Serve the worker in a thread of its own (a daemon that `stop` joins). ``threads``: its intra-op
        threads. With ``built``, the thread builds the worker first and tells ``built`` the outcome."""
        self._thread = threading.Thread(target=self._run, args=(threads, built), name=self.name, daemon=True)
        self._thread.start()

    def _run(self, threads: int | None, built: Callable[[StageError | None], None] | None) -> None:
        if threads is not None:  # a new thread starts with OpenMP's default pool (every core)
            torch.set_num_threads(threads)
        if built is not None:
            failure = self.build()
            built(failure)
            if failure is not None:
                return
        try:
            self.serve()
        except BaseException:  # reported: `ended` and ``on_crash`` carry it; a lost peer is the endpoint's to raise
            return

    def ended(self) -> PipeError | None:
        """Why its thread's event loop ended unasked: the crash's `StageError`, or a `TransportError` (a lost
        peer, or the loop returned). None while it runs, after a STOP, or without a thread."""
        thread = self._thread
        if thread is None or thread.is_alive() or self._stopping:
            return None
        if self.crash is not None:
            return self.crash
        where = self.where()
        return TransportError(f"the event loop of stage {self.stage}{f' on {where}' if where else ''} ended")

    # stopping
    def request_stop(self) -> None:
        """Put a STOP into the worker's inbox: its loop leaves once its current action returns."""
        self._stopping = True
        self.endpoint.inbox.put(Message(MessageKind.STOP))  # also before a build in its thread ended

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for its thread; True once it ended (or none was started). One still busy is a
        daemon thread that ends when its current action returns."""
        thread = self._thread
        if thread is None or thread.ident is None:
            return True
        thread.join(max(0.0, timeout))
        return not thread.is_alive()

    def stop(self, timeout: float) -> bool:
        """`request_stop` and `join`."""
        self.request_stop()
        return self.join(timeout)

    def _crashed(self, exc: BaseException) -> StageError:
        if isinstance(exc, KeyboardInterrupt):  # Ctrl-C reaches every process of the run: no traceback to show
            return StageError(self.stage, None, None, "it was interrupted (KeyboardInterrupt)", "", self.where())
        error = f"its event loop crashed: {type(exc).__name__}: {exc}"
        return StageError(self.stage, None, None, error, traceback.format_exc(), self.where())
