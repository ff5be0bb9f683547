"""The built-in schedules: GPipe (synchronous) and 1F1B (semi-asynchronous)."""

from __future__ import annotations

from lightning_pipe.base.errors import ScheduleError
from lightning_pipe.schedule.action import B, F
from lightning_pipe.schedule.base import ActionLists, Schedule


class GPipe(Schedule):
    """All forwards, then the losses, then all backwards (the seeds' synchronous training).

    4 ranks x 4 microbatches, unit times::

        rank 0 | 0F0 0F1 0F2 0F3                         0B3 0B2 0B1 0B0
        rank 1 |     1F0 1F1 1F2 1F3                 1B3 1B2 1B1 1B0
        rank 2 |         2F0 2F1 2F2 2F3         2B3 2B2 2B1 2B0
        rank 3 |             3F0 3F1 3F2 3F3 3B3 3B2 3B1 3B0
    """

    name = "gpipe"
    loss_after_all_forwards = True

    def build(self) -> ActionLists:
        # with virtual stages a rank runs its stages in model order, then their backwards in reverse
        m = range(self.num_microbatches)
        lists: ActionLists = []
        for rank in range(self.num_ranks):
            stages = range(rank, self.num_stages, self.num_ranks)
            forwards = [F(s, i) for s in stages for i in m]
            backwards = [B(s, i) for s in reversed(stages) for i in reversed(m)]
            lists.append(forwards + backwards)
        return lists


class OneFOneB(Schedule):
    """Warm up with forwards, then alternate one forward and one backward (semi-asynchronous).

    Each microbatch's loss and backward start as soon as its output reaches the coordinator, so a
    rank holds at most ``num_ranks - rank`` activations instead of all of them::

        rank 0 | 0F0 0F1 0F2 0F3             0B0     0B1     0B2     0B3
        rank 1 |     1F0 1F1 1F2         1B0 1F3 1B1     1B2     1B3
        rank 2 |         2F0 2F1     2B0 2F2 2B1 2F3 2B2     2B3
        rank 3 |             3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3
    """

    name = "1f1b"

    def check(self) -> None:
        if self.virtual_stages != 1:
            raise ScheduleError(
                f"schedule='1f1b' places one stage on each rank but virtual_stages={self.virtual_stages}; "
                "use schedule='interleaved-1f1b' (or 'gpipe') for several stages per rank"
            )

    def build(self) -> ActionLists:
        lists: ActionLists = []
        m_total = self.num_microbatches
        for s in range(self.num_ranks):
            warmup = min(self.num_ranks - s - 1, m_total)
            actions = [F(s, i) for i in range(warmup)]
            forward, backward = warmup, 0
            while backward < m_total:
                if forward < m_total:
                    actions.append(F(s, forward))
                    forward += 1
                actions.append(B(s, backward))
                backward += 1
            lists.append(actions)
        return lists
