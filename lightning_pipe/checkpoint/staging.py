"""`Staging`: the CPU copy a background checkpoint write reads, in buffers kept from one save to the next, made in a
thread.

DCP's ``async_save`` with no stager makes a new ``DefaultStager`` for every save, which allocates its copy afresh (on
a CPU run, touching those pages first costs more than the copy). `Staging` keeps one for a fit: torch's stager caches
the CPU copy of each tensor's storage and copies into it at the next save, so only the first save of a fit allocates;
and it copies in a thread of its own (``StagingOptions(use_async_staging=True)``): ``async_save`` returns at once,
and what changes the saved tensors waits for the copy first (`lightning_pipe.checkpoint.background`). The cost: each
process keeps that copy (its parameters and optimizer state) until the end of the fit (`close`). Pinned memory and
non-blocking copies on a side stream where CUDA is there, plain memory on a CPU run.
"""

from __future__ import annotations

from typing import Any

import torch


class Staging:
    """One ``DefaultStager`` (made at the first save that asks for it, closed by `close`)."""

    def __init__(self) -> None:
        self._stager: Any = None

    def stager(self) -> Any:
        """The stager of this fit's saves: copies each tensor, in its thread, into the buffer of the save before,
        where there is one."""
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            cuda = torch.cuda.is_available()
            options = StagingOptions(
                use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=cuda
            )
            self._stager = DefaultStager(options)
        return self._stager

    def close(self) -> None:
        """Release the kept copy (a write still in flight keeps the tensors it reads until it completes)."""
        stager, self._stager = self._stager, None
        if stager is not None:
            stager.close()
