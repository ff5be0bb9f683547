"""`Staging`: the CPU copy a background checkpoint write reads, in buffers kept from one save to the next.

DCP's ``async_save`` copies a process's part to CPU memory before it returns (staging); training goes on while a
thread writes the copy. With no stager given it makes a new ``DefaultStager`` for every save, so every save allocates
its copy afresh: on a CPU run that first touch of every page, more than the copy itself, is most of the time the
loop stands still. `Staging` keeps one ``DefaultStager`` for a fit instead: torch's stager caches the CPU copy of
each tensor's storage (by the storage, weakly) and copies into it at the next save, so only the first save of a fit
allocates. The copy stays synchronous (done when the save returns), so the write holds the state at the save
whatever the optimizer does next; the next save copies into the buffers only after the previous write completed
(`CheckpointWrites.wait`). The cost: each process keeps that copy (the size of its part: parameters and optimizer
state) from its first save to the end of the fit (`close`). Pinned memory and non-blocking copies where CUDA is
there (copies from the GPU), plain memory on a CPU run.
"""

from __future__ import annotations

from typing import Any

import torch


class Staging:
    """One ``DefaultStager`` (made at the first save that asks for it, closed by `close`)."""

    def __init__(self) -> None:
        self._stager: Any = None

    def stager(self) -> Any:
        """The stager of this fit's saves: copies each tensor into the buffer of the save before, where there is one."""
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            cuda = torch.cuda.is_available()
            options = StagingOptions(
                use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=cuda
            )
            self._stager = DefaultStager(options)
        return self._stager

    def close(self) -> None:
        """Release the kept copy (a write still in flight keeps the tensors it reads until it completes)."""
        stager, self._stager = self._stager, None
        if stager is not None:
            stager.close()
