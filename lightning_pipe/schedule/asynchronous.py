"""Asynchronous 1F1B (PipeDream-2BW style): no flush between batches, each stage updates on its own."""

from __future__ import annotations

from lightning_pipe.base.errors import ScheduleError
from lightning_pipe.schedule.base import ActionLists, Schedule
from lightning_pipe.schedule.schedules import OneFOneB


class AsyncOneFOneB(Schedule):
    """1F1B over a whole stream of batches: the next batch's forwards fill the previous one's drain.

    ``build()`` gives one batch (the same lists as ``1f1b``, for grids and validation); ``stream(n)``
    gives ``n`` batches back to back as one task graph, which the engine runs without a flush.
    Every stage steps its optimizer after each ``num_microbatches`` backwards, and a microbatch's
    forward and backward use the same stashed weight version (`lightning_pipe.engine.versions`),
    so a stage ``s`` of ``R`` trains with a staleness of at most ``ceil((R - s - 1) / microbatches)``
    updates (``1`` when microbatches >= stages - 1). 2 ranks x 2 microbatches x 2 batches::

        rank 0 | 0F0 0F1     0B0 0F2 0B1 0F3 0B2     0B3
        rank 1 |     1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3

    A step of batch 1 (microbatches 2, 3) starts while batch 0 still drains; rank 0's forward of
    microbatch 2 runs on version 0 (stale by one update), microbatch 3 on version 1.
    """

    name = "async"
    asynchronous = True

    def check(self) -> None:
        if self.virtual_stages != 1:
            raise ScheduleError(
                f"schedule='async' places one stage on each rank but virtual_stages={self.virtual_stages}"
            )

    def build(self) -> ActionLists:
        return OneFOneB(self.num_ranks, self.num_microbatches).build()

    def stream(self, num_batches: int) -> ActionLists:
        """The action lists of ``num_batches`` batches in a row (microbatch ``b * M + i`` is batch ``b``)."""
        return OneFOneB(self.num_ranks, self.num_microbatches * num_batches).actions()
