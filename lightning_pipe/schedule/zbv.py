"""ZB-V (Qi et al., 2024): zero bubble with two chunks per rank placed in a V and split backwards."""

from __future__ import annotations

from lightning_pipe.base.errors import ScheduleError
from lightning_pipe.schedule.action import Action, F, I, W
from lightning_pipe.schedule.base import ActionLists, Schedule
from lightning_pipe.schedule.placement import V


def check_two_chunks(schedule: Schedule) -> None:
    """A V-shaped schedule runs exactly two chunks per rank: stage ``r`` and ``2R - 1 - r`` on rank ``r``."""
    if schedule.virtual_stages != 2:
        raise ScheduleError(
            f"schedule={schedule.name!r} places two stages on each rank in a V (stage r and 2R-1-r on rank r) but "
            f"virtual_stages={schedule.virtual_stages}; pass virtual_stages=2 and stages = 2 x ranks"
        )


class ZeroBubbleV(Schedule):
    """Each rank holds stage ``r`` (chunk 0, going down) and stage ``2R - 1 - r`` (chunk 1, coming back).

    The forward goes down the ranks through the first chunks and back up through the second, so the
    last stage (and the loss) sits on rank 0 next to the first, and the backward does the same in
    reverse. Each backward is split into ``I`` and ``W``. Rank ``r`` warms up with ``2 (R - r) - 1``
    forwards of chunk 0, then ``r`` pairs of chunk-1 and chunk-0 forwards, then ``R - r`` rounds of a
    chunk-1 forward with its ``I`` and ``W``; in the steady state it runs ``F I W`` of chunk 0 then of
    chunk 1; in the cool-down the ``I`` go first and the ``W`` fill the gaps. With F = I = W = 1 unit and
    ``microbatches >= 2 x ranks`` no rank is idle once the pipeline is full (zero bubble), and rank ``r``
    holds at most ``2 R`` half-size activations: 1F1B's peak on its first rank. 2 ranks x 4 microbatches::

        rank 0 | 0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 3I3 3W3 0I2 0W2 0I3 0W3
        rank 1 |     1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 1I2 2I3 1I3 1W2 2W3 1W3

    With fewer than ``2R - 1`` microbatches the missing ones are left out of the same order.
    """

    name = "zbv"
    splits_backward = True
    placement = V

    def check(self) -> None:
        check_two_chunks(self)

    def build(self) -> ActionLists:
        return [self._rank(rank) for rank in range(self.num_ranks)]

    def _rank(self, rank: int) -> list[Action]:
        ranks, total = self.num_ranks, self.num_microbatches
        planned = max(2 * ranks - 1, total)  # enough microbatches to fill the V; extra ones are dropped below
        down, up = rank, 2 * ranks - 1 - rank  # the rank's chunk-0 and chunk-1 stages
        f0 = f1 = b0 = b1 = 0
        actions: list[Action] = []
        for _ in range(2 * (ranks - rank) - 1):  # warm-up: chunk 0 fills the way down
            actions.append(F(down, f0))
            f0 += 1
        for _ in range(rank):
            actions += [F(up, f1), F(down, f0)]
            f0, f1 = f0 + 1, f1 + 1
        for _ in range(ranks - rank):  # chunk 1's first backwards come back at once
            actions += [F(up, f1), I(up, b1), W(up, b1)]
            f1, b1 = f1 + 1, b1 + 1
        while f1 < f0 or f0 < planned:  # steady state: F I W of chunk 0, then of chunk 1
            if f0 < planned:
                actions.append(F(down, f0))
                f0 += 1
            actions += [I(down, b0), W(down, b0), F(up, f1), I(up, b1), W(up, b1)]
            f1, b0, b1 = f1 + 1, b0 + 1, b1 + 1
        w0, w1 = b0, b1
        for _ in range(rank):  # cool-down: input gradients first, weight gradients fill the gaps
            actions += [I(down, b0), I(up, b1)]
            b0, b1 = b0 + 1, b1 + 1
        for _ in range(ranks - rank):
            actions += [I(down, b0), W(down, w0)]
            b0, w0 = b0 + 1, w0 + 1
        actions += [W(up, m) for m in range(w1, b1)] + [W(down, m) for m in range(w0, b0)]
        return [a for a in actions if a.microbatch < total]
