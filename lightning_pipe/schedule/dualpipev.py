"""DualPipeV (DeepSeek-V3's DualPipe on half the devices): a V of two chunks per rank, one microbatch's
forward paired with another's backward."""

from __future__ import annotations

from collections import Counter, deque

from lightning_pipe.base.errors import ScheduleError
from lightning_pipe.schedule.action import Action, Kind
from lightning_pipe.schedule.base import ActionLists, Schedule
from lightning_pipe.schedule.placement import V
from lightning_pipe.schedule.zbv import check_two_chunks


class DualPipeV(Schedule):
    """Two chunks per rank in a V (stage ``r`` and ``2R - 1 - r`` on rank ``r``), as ``zbv``.

    After a warm-up of chunk-0 forwards and a few zero-bubble ``I W F`` rounds, the main phase pairs a
    forward of one chunk with a backward of the other (``F0 B1`` then ``F1 B0``): DeepSeek overlaps the
    pair's compute with the other's communication; here the pair runs as the forward, then the backward
    (the same gradients). The last backwards are split into ``I`` and ``W`` so that the weight gradients
    fill the drain. Needs ``microbatches >= 2 x ranks``. 2 ranks x 4 microbatches, unit times::

        rank 0 | 0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3B1 3F2 0B0 3B2 3F3 0B1 3B3 0I2 0W2 0I3 0W3
        rank 1 |     1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 2B2 1B2 2I3 1I3 2W3 1W3

    A rank holds at most ``2R + 1`` half-size activations; the step is as long as ZB-V's when the
    forward, input-backward and weight-backward cost the same.
    """

    name = "dualpipev"
    splits_backward = True
    placement = V

    def check(self) -> None:
        check_two_chunks(self)
        if self.num_microbatches < self.num_stages:
            raise ScheduleError(
                f"schedule='dualpipev' needs at least as many microbatches as stages ({self.num_stages}) to fill "
                f"both arms of the V, got microbatches={self.num_microbatches}; use microbatches={self.num_stages} "
                "or more, or schedule='zbv'"
            )

    def build(self) -> ActionLists:
        return [_RankOrder(self.num_ranks, self.num_microbatches, rank).actions for rank in range(self.num_ranks)]


class _RankOrder:
    """One rank's DualPipeV order, built phase by phase; each stage takes its microbatches in order."""

    def __init__(self, ranks: int, microbatches: int, rank: int) -> None:
        self.actions: list[Action] = []
        self._next: Counter[tuple[int, Kind]] = Counter()  # (stage, F or backward) -> next microbatch
        self._weights: deque[Action] = deque()  # W's owed by the I's run so far, oldest first
        down, up = rank, 2 * ranks - 1 - rank
        forward, full, split = Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT
        for _ in range(2 * (ranks - rank - 1)):  # 1: chunk 0 fills the way down
            self._add(down, forward)
        for _ in range(rank + 1):  # 2: forwards of both chunks
            self._add(down, forward)
            self._add(up, forward)
        for _ in range(ranks - rank - 1):  # 3: zero bubble on chunk 1: I, W, F
            self._add(up, split)
            self._weight()
            self._add(up, forward)
        for _ in range(microbatches - 2 * ranks + rank + 1):  # 4: the main phase, F0 B1 then F1 B0
            self._add(down, forward)  # on the last rank the first pair runs apart (no overlap): the same order
            self._add(up, full)
            self._add(up, forward)
            self._add(down, full)
        for _ in range(ranks - rank - 1):  # 5: B1, then F1 B0
            self._add(up, full)
            self._add(up, forward)
            self._add(down, full)
        halfway, zero_bubble = (rank + 1) // 2, False
        for i in range(rank + 1):  # 6: B1 B0, the second half split into I (W later) to fill the drain
            zero_bubble = zero_bubble or (i == halfway and rank % 2 == 1)
            self._add(up, split if zero_bubble else full)
            zero_bubble = zero_bubble or (i == halfway and rank % 2 == 0)
            self._add(down, split if zero_bubble else full)
        for _ in range(ranks - rank - 1):  # 7: W, then B0
            self._weight()
            self._add(down, split if zero_bubble else full)
        while self._weights:  # 8: the weight gradients left
            self._weight()

    def _add(self, stage: int, kind: Kind) -> None:
        """The stage's next microbatch of ``kind`` (a backward, ``B`` or ``I``, counts one sequence)."""
        key = (stage, Kind.FORWARD if kind is Kind.FORWARD else Kind.BACKWARD)
        action = Action(stage, kind, self._next[key])
        self._next[key] += 1
        self.actions.append(action)
        if kind is Kind.BACKWARD_INPUT:
            self._weights.append(Action(stage, Kind.BACKWARD_WEIGHT, action.microbatch))

    def _weight(self) -> None:
        """The oldest weight gradient owed, if any."""
        if self._weights:
            self.actions.append(self._weights.popleft())
