"""Looped BFS (Lamy-Poirier, 2022): breadth-first over several chunks per rank, earlier chunks first."""

from __future__ import annotations

from lightning_pipe.schedule.action import B, F
from lightning_pipe.schedule.base import ActionLists, Schedule


class LoopedBFS(Schedule):
    """Each rank runs every microbatch through its first chunk, then its next, then all backwards in reverse.

    Rank ``r`` holds stages ``r, r + R, ...`` (as ``interleaved-1f1b``). Where several microbatches are
    ready for a rank's chunks it prefers the earlier chunk and runs all its microbatches at once, so a
    rank holds all ``virtual_stages x microbatches`` activations (GPipe's memory) while the bubble
    shrinks with the chunks. Unlike ``gpipe``, each microbatch's loss is computed as soon as its output
    arrives. 2 ranks x 2 chunks x 4 microbatches, unit times::

        rank 0 | 0F0 0F1 0F2 0F3 2F0 2F1 2F2 2F3         2B3 2B2 2B1 2B0 0B3 0B2 0B1 0B0
        rank 1 |     1F0 1F1 1F2 1F3 3F0 3F1 3F2 3F3 3B3 3B2 3B1 3B0 1B3 1B2 1B1 1B0

    With one chunk per rank it is GPipe's order.
    """

    name = "looped-bfs"

    def build(self) -> ActionLists:
        microbatches = range(self.num_microbatches)
        lists: ActionLists = []
        for rank in range(self.num_ranks):
            stages = [s for s in range(self.num_stages) if self.rank_of(s) == rank]
            forwards = [F(s, m) for s in stages for m in microbatches]
            backwards = [B(s, m) for s in reversed(stages) for m in reversed(microbatches)]
            lists.append(forwards + backwards)
        return lists
