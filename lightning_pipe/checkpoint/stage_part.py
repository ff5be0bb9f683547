"""`StageCheckpoint`: a stage worker's part of a checkpoint: what it writes of a sharded folder, what it reads.

In launched mode every process writes its own part of a checkpoint folder (torch.distributed.checkpoint,
a collective over the whole world) and reads only its own part of one, so no process ever holds a
whole model or a whole optimizer state. The coordinator starts both with a control call that every
rank serves at once (`lightning_pipe.checkpoint.sharded`, `lightning_pipe.checkpoint.reader`). Under
``transport="rpc"`` the ranks share no process group with the coordinator: it carries DCP's plans over two
control calls, ``plan_part`` and ``write_part`` (`lightning_pipe.checkpoint.sharded_steps`); the folder is the
same. Keys are the LightningModule's: ``prefix`` (the pipelined module's path, ``"model."``) before a shard's own names.
A launched part also holds its stages' generator states, as they are when this process reaches the save (after its
step), so the coordinator need not ask every process for them first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from lightning_pipe.base.dtensor_shards import is_sharded
from lightning_pipe.checkpoint.background import CheckpointWrites
from lightning_pipe.checkpoint.reader import OptimizerLayout, open_checkpoint
from lightning_pipe.checkpoint.sharded import OptimizerPart, sharded_state
from lightning_pipe.checkpoint.sharded_steps import FolderPart
from lightning_pipe.weights.edited import StateEdits


@dataclass
class CoordinatorPart:
    """What the coordinator's own process adds to its part of a sharded checkpoint: the LightningModule's
    tensors outside the pipeline and their optimizer state, each optimizer's groups and layout, and (one
    process of the run) Lightning's loop and callback state."""

    model: dict[str, torch.Tensor] = field(default_factory=dict)
    optimizer_state: dict[str, dict[str, Any]] = field(default_factory=dict)
    groups: list[dict[str, Any]] | None = None
    layout: OptimizerLayout | None = None
    meta: dict[str, Any] | None = None

    def edited(self, edits: StateEdits) -> CoordinatorPart:
        """This part as the ``on_save_checkpoint`` hooks left the checkpoint: keys renamed or dropped (the optimizer
        state follows its parameter's name), and the values the hooks gave, which this process holds."""
        layout = None if self.layout is None else [[edits.new_name(k) for k in group] for group in self.layout]
        return CoordinatorPart(
            model={**edits.apply(self.model), **edits.given},
            optimizer_state={edits.new_name(k): s for k, s in self.optimizer_state.items()},
            groups=self.groups,
            layout=layout,
            meta=self.meta,
        )


class WorkerOptimizer(Protocol):
    """What a stage's part of a checkpoint reads of the worker: its optimizer and its parameters by name
    (`lightning_pipe.engine.state_calls.StageStateCalls` is the worker's)."""

    def has_optimizer(self) -> bool: ...

    def optimizer(self) -> tuple[torch.optim.Optimizer, list[list[str]]]:
        """The optimizer and, per parameter group, the names of its parameters in order."""
        ...

    def named_parameters(self) -> dict[str, nn.Parameter]: ...

    def call_random_state(self) -> dict[int, dict[str, torch.Tensor]]:
        """Each of the worker's stages' generator states, by stage index."""
        ...


class StageCheckpoint:
    """Serves ``save_sharded``, ``plan_part``, ``write_part`` and ``load_optimizer_from`` over the worker's shards
    and its optimizer."""

    def __init__(self, shards: dict[int, Any], state: WorkerOptimizer) -> None:
        self.shards = shards
        self.state = state
        self.writes = CheckpointWrites()  # this process's writes (launched mode gives its own: async_checkpoint)
        self.part: FolderPart | None = None  # a folder being written step by step (between plan_part and write_part)

    def _model(self, prefix: str, edits: StateEdits | None) -> dict[str, torch.Tensor]:
        """The shards' tensors; the buffers (which a forward may update before the next optimizer step) as the
        writes hold them (`CheckpointWrites.hold`: copied now where the copy is made in the background)."""
        model: dict[str, torch.Tensor] = {}
        for shard in self.shards.values():
            state = shard.module.state_dict()
            params = {name for name, _ in shard.module.named_parameters()}
            held = self.writes.hold({k: v for k, v in state.items() if k not in params})
            model.update({prefix + k: held.get(k, v) for k, v in state.items()})
        return model if edits is None else edits.apply(model)

    def staged(self) -> None:
        """Before the saved tensors change: the copy of the write in flight made (`CheckpointWrites.staged`)."""
        self.writes.staged()

    def _optimizer_state(self, prefix: str, edits: StateEdits | None) -> dict[str, dict[str, Any]]:
        if not self.state.has_optimizer():
            return {}
        optimizer, names = self.state.optimizer()
        flat = [prefix + n for group in names for n in group]
        rename = edits.new_name if edits is not None else str
        return {rename(flat[i]): s for i, s in optimizer.state_dict()["state"].items()}

    def call_save_sharded(
        self, path: str, prefix: str, coordinator: CoordinatorPart | None = None, edits: StateEdits | None = None
    ) -> None:
        """Write this process's part of the folder ``path`` (every process of the world at once), under the keys
        the ``on_save_checkpoint`` hooks left (``edits``; the coordinator's part has them already), with its stages'
        generator states."""
        self.writes.before_save()
        try:
            part = coordinator or CoordinatorPart()
            model = {**part.model, **self._model(prefix, edits)}
            optimizers = []
            if self.state.has_optimizer() or part.layout is not None:
                state = {**self._optimizer_state(prefix, edits), **part.optimizer_state}
                optimizers.append(OptimizerPart(state, part.groups, part.layout))
            random = self.state.call_random_state()
        except BaseException as error:
            self.writes.not_begun(error)  # a save expected of this process (`CheckpointWrites.expect`) fails
            raise
        self.writes.save_sharded(path, model, optimizers, part.meta, random)

    def call_plan_part(
        self, path: str, prefix: str, optimizer: bool, index: int, edits: StateEdits | None = None
    ) -> Any:
        """Plan this rank's part of the folder ``path`` as participant ``index`` (DCP's local plan, returned), with
        its optimizer state unless ``optimizer`` is False (``trainer.save_checkpoint(weights_only=True)``), under
        the keys the ``on_save_checkpoint`` hooks left (``edits``)."""
        with_state = optimizer and self.state.has_optimizer()
        optimizers = [OptimizerPart(self._optimizer_state(prefix, edits))] if with_state else []
        self.part = FolderPart(path, sharded_state(self._model(prefix, edits), optimizers), index)
        return self.part.plan()

    def call_write_part(self, plan: Any) -> list[Any]:
        """Write the part `call_plan_part` planned, as the global ``plan`` says; DCP's write results."""
        part, self.part = self.part, None
        if part is None:
            raise RuntimeError("write_part without plan_part: the coordinator plans a folder before writing it")
        return part.write(plan)

    def call_load_optimizer_from(
        self,
        path: str,
        prefix: str,
        layout: OptimizerLayout,
        hparams: list[dict[str, Any]],
        aliases: dict[str, list[str]],
    ) -> None:
        """Read this rank's optimizer state from the checkpoint ``path`` by parameter name (a shard of each state
        where FSDP shards the parameter), and the groups' hyperparameters."""
        self.staged()
        optimizer, names = self.state.optimizer()
        params = self.state.named_parameters()
        reader = open_checkpoint(path, [layout])
        try:
            by_index: dict[int, dict[str, Any]] = {}
            index = 0
            for group in names:
                for name in group:
                    for key in (name, *aliases.get(name, ())):
                        saved = reader.optimizer_state(0, prefix + key)
                        if saved:
                            by_index[index] = {k: _like(params[name], v) for k, v in saved.items()}
                            for value in saved.values():
                                reader.release(value)
                            break
                    index += 1
            groups, start = [], 0
            for group, values in zip(names, hparams, strict=True):
                groups.append({**values, "params": list(range(start, start + len(group)))})
                start += len(group)
            optimizer.load_state_dict({"state": by_index, "param_groups": groups})
        finally:
            reader.close()


def _like(param: torch.Tensor, value: Any) -> Any:
    """A saved optimizer state as ``param`` holds it: its own copy (the saved one may map a file), and where
    the parameter is a shard of a whole (FSDP), the same shard of the saved whole."""
    if not isinstance(value, torch.Tensor):
        return value
    if is_sharded(param) and tuple(value.shape) == tuple(param.shape):
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        piece = value[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
        local = piece.to(param.to_local().device, copy=True)
        return DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())
    return value.to(param.device, copy=True)
