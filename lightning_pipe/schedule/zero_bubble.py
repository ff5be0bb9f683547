"""Zero-bubble ZB-H1 (Qi et al., 2023): the backward is split so that weight gradients fill the bubbles."""

from __future__ import annotations

from lightning_pipe.base.errors import ScheduleError
from lightning_pipe.schedule.action import F, I, W
from lightning_pipe.schedule.base import ActionLists, Schedule


class ZeroBubbleH1(Schedule):
    """1F1B with each backward split into ``I`` (input gradient) and ``W`` (weight gradient).

    Only ``I`` lies on the critical path back to the first stage; ``W`` can wait. Rank ``r`` warms
    up with ``R - r`` forwards, postpones its first ``r`` weight gradients and runs the rest right
    after their ``I``; the postponed ones fill the cool-down. With F = I = W = 1 unit the bubble is
    ``(R - 1)`` units against ``3 (R - 1)`` for 1F1B, and no rank holds more than ``R`` activations
    (1F1B's peak on its first rank). 4 ranks x 6 microbatches, unit times::

        rank 0 | 0F0 0F1 0F2 0F3             0I0 0W0 0F4 0I1 0W1 0F5 0I2 0W2 0I3 0W3 0I4 0W4 0I5 0W5
        rank 1 |     1F0 1F1 1F2         1I0 1F3 1I1 1W0 1F4 1I2 1W1 1F5 1I3 1W2 1I4 1W3 1I5 1W4 1W5
        rank 2 |         2F0 2F1     2I0 2F2 2I1 2F3 2I2 2W0 2F4 2I3 2W1 2F5 2I4 2W2 2I5 2W3 2W4 2W5
        rank 3 |             3F0 3I0 3F1 3I1 3F2 3I2 3F3 3I3 3W0 3F4 3I4 3W1 3F5 3I5 3W2 3W3 3W4 3W5

    One stage per rank; use ``interleaved-1f1b`` for several.
    """

    name = "zero-bubble"
    splits_backward = True

    def check(self) -> None:
        if self.virtual_stages != 1:
            raise ScheduleError(
                f"schedule='zero-bubble' (ZB-H1) places one stage on each rank but virtual_stages="
                f"{self.virtual_stages}; use schedule='interleaved-1f1b' for several stages per rank"
            )

    def build(self) -> ActionLists:
        m_total, lists = self.num_microbatches, []
        for rank in range(self.num_ranks):
            warmup = min(self.num_ranks - rank, m_total)
            actions = [F(rank, m) for m in range(warmup)]
            forward, weight = warmup, 0
            for backward in range(m_total):
                actions.append(I(rank, backward))
                postpone = forward < m_total and backward < rank  # W fills the cool-down bubble instead
                if not postpone:
                    actions.append(W(rank, weight))
                    weight += 1
                if forward < m_total:
                    actions.append(F(rank, forward))
                    forward += 1
            actions.extend(W(rank, m) for m in range(weight, m_total))
            lists.append(actions)
        return lists
