"""Interleaved zero bubble (ZB1P, Qi et al., 2024): interleaved 1F1B whose backwards are split into I and W."""

from __future__ import annotations

from collections import Counter

from lightning_pipe.base.errors import ScheduleError
from lightning_pipe.schedule.action import Action, Kind
from lightning_pipe.schedule.base import ActionLists, Schedule


class InterleavedZeroBubble(Schedule):
    """Interleaved 1F1B over ``virtual_stages`` chunks per rank (stage ``s`` on rank ``s % R``), with each
    backward split into ``I`` (input gradient, on the critical path) and ``W`` (weight gradient, deferred).

    Microbatches go through a rank's chunks in rounds of ``M / max(1, M // R)`` microbatches. Rank ``r``
    warms up with ``(V - 1) x round + R - 1 - r`` forwards, then runs one forward and one ``I`` at a time;
    its first ``r`` weight gradients are put off and fill the cool-down, the others follow one ``I`` behind.
    2 ranks x 2 chunks x 4 microbatches, unit times::

        rank 0 | 0F0 0F1 2F0 2F1     2I0 2W0 0F2 2I1 2W1 0F3 0I0 0W0 2F2 0I1 0W1 2F3 2I2 2W2 2I3 2W3 0I2 0W2 0I3 0W3
        rank 1 |     1F0 1F1 3F0 3I0 3F1 3I1 3W0 1F2 1I0 3W1 1F3 1I1 1W0 3F2 3I2 1W1 3F3 3I3 3W2 1I2 3W3 1I3 1W2 1W3

    With F = 1 and I = W = 1 (a chunk costing ``1 / V``) the bubble is ZB-H1's divided by the chunks,
    ``(R - 1) / (3 V M + R - 1)``, and a rank holds at most ``R`` whole-stage activations (``V R`` chunks).
    Needs ``num_microbatches`` to be a multiple of its round count ``max(1, M // R)``; with one chunk per
    rank it has ZB-H1's bubble and memory.
    """

    name = "interleaved-zero-bubble"
    splits_backward = True

    def check(self) -> None:
        rounds = self._rounds()
        if self.num_microbatches % rounds:
            fits = [m for m in range(1, 4 * self.num_ranks + 1) if m % max(1, m // self.num_ranks) == 0]
            raise ScheduleError(
                f"schedule='interleaved-zero-bubble' sends microbatches through the chunks in {rounds} rounds "
                f"(microbatches // ranks) of equal size, but microbatches={self.num_microbatches} is not a multiple "
                f"of {rounds}; use a multiple of the rank count ({self.num_ranks}) or one of {fits}"
            )

    def build(self) -> ActionLists:
        return [self._rank(rank) for rank in range(self.num_ranks)]

    def _rounds(self) -> int:
        return max(1, self.num_microbatches // self.num_ranks)

    def _rank(self, rank: int) -> list[Action]:
        chunks, per_round = self.virtual_stages, self.num_microbatches // self._rounds()
        total = self.num_microbatches * chunks  # forwards (and backwards) of this rank
        warmup = min((chunks - 1) * per_round + self.num_ranks - 1 - rank, total)

        def forward_stage(k: int) -> int:  # the stage of the rank's k-th forward
            return (k // per_round) % chunks * self.num_ranks + rank

        def backward_stage(k: int) -> int:  # the stage of the rank's k-th backward
            return (chunks - 1 - (k // per_round) % chunks) * self.num_ranks + rank

        done: Counter[tuple[int, Kind]] = Counter()  # (stage, kind) -> microbatches it ran so far

        def next_of(stage: int, kind: Kind) -> Action:  # each stage takes its microbatches in order
            done[(stage, kind)] += 1
            return Action(stage, kind, done[(stage, kind)] - 1)

        actions = [next_of(forward_stage(k), Kind.FORWARD) for k in range(warmup)]
        inputs: list[int] = []  # stages of the I's run so far, in order: their W's follow in the same order
        weights = 0
        for k in range(total):
            if warmup + k < total:
                actions.append(next_of(forward_stage(warmup + k), Kind.FORWARD))
            stage = backward_stage(k)
            actions.append(next_of(stage, Kind.BACKWARD_INPUT))
            inputs.append(stage)
            if k >= rank:  # the first `rank` weight gradients wait for the cool-down
                actions.append(next_of(inputs[weights], Kind.BACKWARD_WEIGHT))
                weights += 1
        actions.extend(next_of(stage, Kind.BACKWARD_WEIGHT) for stage in inputs[weights:])
        return actions
