"""Interleaved 1F1B (Megatron-LM): each rank holds several model chunks, so the pipeline fills faster."""

from __future__ import annotations

from lightning_pipe.base.errors import ScheduleError
from lightning_pipe.schedule.action import B, F
from lightning_pipe.schedule.base import ActionLists, Schedule


class Interleaved1F1B(Schedule):
    """1F1B over ``virtual_stages`` chunks per rank: rank ``r`` holds stages ``r, r + R, r + 2R, ...``.

    Microbatches go through a rank's chunks in groups of ``num_ranks``: forwards of chunk 0 for
    microbatches 0..R-1, then chunk 1 for the same group, and so on; backwards visit the chunks in
    reverse. Rank ``r`` warms up with ``2 (R - r - 1) + (V - 1) R`` forwards (``V > 1``), then alternates one
    forward and one backward. The bubble shrinks by ``virtual_stages`` against plain 1F1B at the
    price of more activations held and more messages. 2 ranks x 2 chunks x 4 microbatches::

        rank 0 | 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1     2B2     2B3 0B2 0B3
        rank 1 |     1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3

    Needs ``num_microbatches % num_ranks == 0`` when ``virtual_stages > 1`` (microbatches travel in
    groups of ``num_ranks``); with one chunk per rank it is plain 1F1B.
    """

    name = "interleaved-1f1b"

    def check(self) -> None:
        if self.virtual_stages > 1 and self.num_microbatches % self.num_ranks:
            raise ScheduleError(
                f"schedule='interleaved-1f1b' sends microbatches through the chunks in groups of the rank count, "
                f"but microbatches={self.num_microbatches} is not a multiple of {self.num_ranks} ranks; "
                f"use microbatches={_round_up(self.num_microbatches, self.num_ranks)} or virtual_stages=1"
            )

    def build(self) -> ActionLists:
        total = self.num_microbatches * self.virtual_stages
        lists: ActionLists = []
        for rank in range(self.num_ranks):
            if self.virtual_stages == 1:  # plain 1F1B
                warmup = self.num_ranks - rank - 1
            else:  # Megatron-LM's warm-up: enough forwards in flight to cover the other chunks
                warmup = 2 * (self.num_ranks - rank - 1) + (self.virtual_stages - 1) * self.num_ranks
            warmup = min(warmup, total)
            actions = [F(self._stage(rank, k, True), self._microbatch(k)) for k in range(warmup)]
            for k in range(total - warmup):
                forward = k + warmup
                actions.append(F(self._stage(rank, forward, True), self._microbatch(forward)))
                actions.append(B(self._stage(rank, k, False), self._microbatch(k)))
            for k in range(total - warmup, total):
                actions.append(B(self._stage(rank, k, False), self._microbatch(k)))
            lists.append(actions)
        return lists

    def _stage(self, rank: int, k: int, forward: bool) -> int:
        """Stage of a rank's ``k``-th forward (or backward)."""
        chunk = (k % (self.num_ranks * self.virtual_stages)) // self.num_ranks
        if not forward:
            chunk = self.virtual_stages - chunk - 1
        return chunk * self.num_ranks + rank

    def _microbatch(self, k: int) -> int:
        group = self.num_ranks * self.virtual_stages
        return (k // group) * self.num_ranks + k % self.num_ranks


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
