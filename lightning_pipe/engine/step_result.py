"""`StepResult`: what a step of the coordinator returns, and the records of each rank's timeline."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

from lightning_pipe.schedule import Schedule

Record = tuple[str, float, float]  # (action or "action part", start, end), time.perf_counter() seconds


class Records(list[Record]):
    """A rank's records of one step, pickled as one bytes object of the plain pickler: a step's end crosses to the
    coordinator's process every step, and the by-value pickler of control messages (`comm.by_value`) calls Python
    for each of their hundreds of strings and numbers (pickling 64 actions and their parts: 130 us against 40)."""

    def __reduce__(self) -> tuple[Callable[[bytes], list[Record]], tuple[bytes]]:
        return _records, (pickle.dumps(list(self), protocol=pickle.HIGHEST_PROTOCOL),)


def _records(data: bytes) -> list[Record]:
    records: list[Record] = pickle.loads(data)
    return records


class StepResult:
    """What a step returns: per-microbatch losses (train) or outputs (eval), and each rank's timeline.

    ``records`` and ``parts`` of a rank the train step did not wait for (`Coordinator.train_step`)
    are waited for when first read.
    """

    def __init__(
        self,
        losses: list[Any] | None = None,
        outputs: list[Any] | None = None,
        records: list[list[Record]] | None = None,
        schedule: Schedule | None = None,
        parts: list[list[Record]] | None = None,
        settle: Callable[[], None] | None = None,
    ) -> None:
        self.losses = [] if losses is None else losses
        self.outputs = [] if outputs is None else outputs
        self.schedule = schedule
        self._records = [] if records is None else records
        #: per rank, the parts of each action ("1F0 idle", start, end): see `lightning_pipe.pipeline.timeline`
        self._parts = [] if parts is None else parts
        self._settle = settle
        #: the step's seconds as ``schedule="auto"`` predicted them when it chose (None: no prediction)
        self.predicted: float | None = None

    @property
    def records(self) -> list[list[Record]]:
        """Per rank, its actions ("1F0", start, end)."""
        self._settled()
        return self._records

    @property
    def parts(self) -> list[list[Record]]:
        self._settled()
        return self._parts

    def _settled(self) -> None:
        if self._settle is not None:
            settle, self._settle = self._settle, None
            settle()
