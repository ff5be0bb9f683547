"""Writing a checkpoint in launched mode without any process holding the whole state.

- `write_sharded` (the default, ``PipeStrategy(save_distributed_checkpoint=True)``): one folder written with
  torch.distributed.checkpoint, every process its own stage (with FSDP, its shard) and its stages' generator states;
  the coordinators add the tensors outside the pipeline, the optimizers' groups and parameter order, and global rank
  0 Lightning's loop and callback state (``meta.pt``). Each coordinator asks its pipeline's processes to write (a
  control call all of them serve at once; with ``async_checkpoint`` in a fit it is posted, not waited for).
- `write_single_file` (``save_distributed_checkpoint=False``): one ``torch.save``-compatible file: the folder
  first, then global rank 0 makes one file of it a tensor at a time (`lightning_pipe.checkpoint.consolidate`).
`LaunchedCheckpoints` chooses between them for each save, and publishes the result once complete
(`lightning_pipe.checkpoint.publish`; ``async_checkpoint``: written in the background, docs/internals.md).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_pipe.base.errors import ConfigurationError
from lightning_pipe.checkpoint.background import CheckpointWrites
from lightning_pipe.checkpoint.consolidate import consolidate
from lightning_pipe.checkpoint.publish import prepare, publish, temporary_path
from lightning_pipe.checkpoint.reader import META_FILE
from lightning_pipe.checkpoint.sharded import prepare_folder
from lightning_pipe.checkpoint.stage_part import CoordinatorPart
from lightning_pipe.engine.stage_protocol import StageProtocol
from lightning_pipe.pipeline.pipeline import Pipeline
from lightning_pipe.strategy.layout import Layout
from lightning_pipe.strategy.modes.launched_collectives import CoordinatorCollectives
from lightning_pipe.strategy.modes.mode_parts import ModeParts
from lightning_pipe.strategy.modes.whole_file import in_fit
from lightning_pipe.strategy.pipe_config import PipeConfig
from lightning_pipe.weights.edited import StateEdits


class LaunchedCheckpoints:
    """Launched mode's saves: every process its part, through ``writes`` (this process's writes in flight).

    ``layout``: this process's place; ``parts``: the strategy's parts (the state, the pipeline, this process's
    stage); ``collectives``: among the coordinators; ``config``: ``save_distributed_checkpoint`` is read.
    """

    def __init__(
        self,
        config: PipeConfig,
        layout: Layout,
        writes: CheckpointWrites,
        parts: ModeParts,
        collectives: CoordinatorCollectives,
    ) -> None:
        self.config = config
        self.layout = layout
        self.writes = writes
        self.host, self.state, self.builder, self.stage = parts.host, parts.state, parts.builder, parts.stage
        self.collectives = collectives

    def save(self, checkpoint: dict[str, Any], path: Path) -> None:
        """A folder every process writes its part of (`write_sharded`), or one file made of it a tensor at a time;
        written under a temporary name that global rank 0 publishes once DCP finished (every part written), in the
        background with ``async_checkpoint`` (the save before it written and published first)."""
        path = Path(self.collectives.broadcast(str(path)))
        self.writes.wait()  # this process's previous save: written (and on global rank 0 published) before this one
        first = self.layout.global_rank == 0
        state = self.state
        prefix = state.prefix()
        edits = state.save_edits(checkpoint)  # what the on_save_checkpoint hooks did to the shapes they saw
        if self.layout.coordinates:
            part = state.coordinator_part(prefix, edits)
        else:  # a process serving a stage saves after the fit: the values its hooks added too
            part = CoordinatorPart(model=dict(edits.given) if edits is not None else {})
        pipeline, here, worker = self.builder.pipeline, self.layout.coordinator, self.stage.worker
        posted = self.writes.in_background and pipeline is not None
        if posted:  # this process's stage makes its part later, while the coordinator steps these
            part = replace(
                part, model=self.writes.hold(part.model), optimizer_state=self.writes.hold(part.optimizer_state)
            )

        def save(folder: Path) -> None:
            if posted:
                self.writes.expect(folder)  # the write in flight: publish follows it
            write_sharded(folder, prefix, checkpoint, part, first, pipeline, here, worker, edits, posted)

        if self.config.save_distributed_checkpoint is not False:  # None (the default) or True: a folder
            temporary = prepare(path) if first else temporary_path(path)
            self._together(pipeline)  # a leftover temporary folder goes before any process writes: removed while
            save(temporary)  # another process made it, it failed that one's save (FileExistsError in DCP)
            if first:
                self.writes.then(lambda: publish(temporary, path))
        else:
            write_single_file(save, path, first, self.writes)
        if not in_fit(self.host.lightning_module):
            self.writes.finish()  # no training to overlap: the checkpoint is there when save_checkpoint returns
        self._together(pipeline)  # published (rank 0) before any process starts its next save of the same name

    def _together(self, pipeline: Pipeline | None) -> None:
        """Every process that saves waits for the others: the coordinators while a fit runs (the processes serving
        stages write when their coordinator asks, after this), every process of the run after a fit (each calls
        ``trainer.save_checkpoint`` itself, as with DDP)."""
        if pipeline is not None or not dist.is_initialized():
            self.collectives.barrier()
        else:
            self.collectives.wait(None)  # the default group: every process of the run


def write_sharded(
    path: Path,
    prefix: str,
    checkpoint: dict[str, Any],
    coordinator: CoordinatorPart,
    first: bool,
    pipeline: Pipeline | None,
    here: int,
    worker: Any,
    edits: StateEdits | None = None,
    posted: bool = False,
) -> None:
    """This process's part of the folder ``path``: in a fit, the coordinator asks its pipeline's processes to
    write theirs (``here``: the pipeline rank in this process, which adds ``coordinator``'s part; ``posted``: without
    waiting for them, Lightning's state written here); after a fit every process writes its own (each calls
    ``trainer.save_checkpoint``, as with DDP) from its last stage ``worker``. ``first`` (global rank 0) prepares the
    folder and writes Lightning's state: what ``checkpoint`` holds besides tensors. ``edits``: what the
    ``on_save_checkpoint`` hooks did to the state_dict (``coordinator`` has them applied already; every process
    applies them to its own part).
    """
    if first:
        prepare_folder(path)  # before any process writes: each waits for all in DCP's planning
        meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        if posted:
            torch.save(meta, path / META_FILE)  # now: the loop's state changes before the stage makes its part
        else:
            coordinator.meta = meta
    if pipeline is not None:
        names = edits.only(()) if edits is not None else None  # the values the hooks gave: the coordinator's part
        each = [(coordinator if rank == here else None, names) for rank in range(pipeline.coordinator.num_ranks)]
        if posted:
            pipeline.coordinator.stages.post_each(StageProtocol.save_sharded, each, str(path), prefix)
        else:
            pipeline.coordinator.stages.call_each(StageProtocol.save_sharded, each, str(path), prefix)
        return
    if worker is None:
        raise ConfigurationError(
            "trainer.save_checkpoint(...) in launched mode writes each process's stage, and no stage was built in "
            "this process yet: save during or after a fit"
        )
    worker.checkpoints.call_save_sharded(str(path), prefix, coordinator, edits)


def write_single_file(save: Callable[[Path], None], path: Path, first: bool, writes: CheckpointWrites) -> None:
    """The checkpoint as one file at ``path``: written as a sharded folder next to it (``save(folder)``, every
    process its part), then made one file by global rank 0 (``first``) a tensor at a time and published, the folder
    removed; with ``writes`` asynchronous, after the folder's write completes, in the background."""
    folder = path.with_name(f".{path.name}.shards")
    save(folder)
    if first:

        def make_file() -> None:
            temporary = prepare(path)
            consolidate(folder, temporary)
            shutil.rmtree(folder)
            publish(temporary, path)

        writes.then(make_file)
