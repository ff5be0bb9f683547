"""`Resume`: a checkpoint a fit starts from, read where each part of it lives.

Lightning reads ``ckpt_path=`` in one piece (``torch.load``) and then hands the module's and the optimizers'
states to the strategy. Under `PipeStrategy` the checkpoint is opened instead (`lightning_pipe.checkpoint.reader`:
a single file mapped into memory, or a sharded folder), Lightning gets what it restores itself (loops,
callbacks, schedulers, the precision plugin's state), and the tensors are read where they live: each stage
reads its own when it is built (`StageInit`), the coordinator reads the LightningModule's tensors outside the
pipeline, and each stage reads its optimizer state by parameter name (launched mode) or the coordinator
assembles the optimizers' states (one process: local and rpc).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_pipe.checkpoint.lazy_state import lazy_state_dict
from lightning_pipe.checkpoint.reader import (
    CheckpointReader,
    FileCheckpoint,
    OptimizerLayout,
    ShardedCheckpoint,
    open_checkpoint,
)
from lightning_pipe.weights import StageInit, materialize
from lightning_pipe.weights.edited import EditedSource, StateEdits
from lightning_pipe.weights.sources import MODEL, PathLike, WeightSource, is_distributed_checkpoint


class Resume:
    """The checkpoint at ``path``, open until the fit has taken what it needs (`close`)."""

    def __init__(self, path: PathLike, weights_only: bool | None = None) -> None:
        self.path = str(path)
        self.sharded = is_distributed_checkpoint(path)
        self.weights_only = weights_only  # every process opens the file as the coordinator did
        self.reader: CheckpointReader = open_checkpoint(path, weights_only=weights_only)
        self.stored: dict[str, Any] = {}  # the state_dict handed to the checkpoint hooks, as stored
        self.edits: StateEdits | None = None  # what ``on_load_checkpoint`` did to it (`edited`)

    def for_lightning(self, optimizers: int) -> dict[str, Any]:
        """What Lightning restores itself; the tensors are placeholders the strategy's hooks read through.

        The ``state_dict`` a user's ``on_load_checkpoint`` sees holds every tensor unread: a single file's mapped
        tensors, a folder's `LazyTensor` s; what the hook leaves in it is what the stages read (`edited`).
        """
        checkpoint = self.reader.lightning_state()
        if isinstance(self.reader, FileCheckpoint):
            self.stored = dict(self.reader.content.get(MODEL, {}))
        elif isinstance(self.reader, ShardedCheckpoint):
            self.stored = lazy_state_dict(self.reader.folder, MODEL)
        checkpoint[MODEL] = dict(self.stored)  # the hooks' to edit; ``stored`` stays as the checkpoint holds it
        count = self.reader.optimizer_count()
        if count:  # none (a weights-only checkpoint): Lightning's own restore says so when a fit needs them
            saved = self.reader.content.get("optimizer_states") if isinstance(self.reader, FileCheckpoint) else None
            checkpoint["optimizer_states"] = saved if saved is not None else [{} for _ in range(count)]
        return checkpoint

    def edited(self, state_dict: Any) -> None:
        """The checkpoint's ``state_dict`` as the checkpoint hooks left it: what every reading of the model's state
        reads from now on (its keys, the stages' tensors, the optimizers' states by name)."""
        self.edits = StateEdits.between(self.stored, state_dict) if isinstance(state_dict, dict) else None
        self.stored = {}

    def model(self) -> WeightSource:
        """The module's tensors by the LightningModule's keys, as the checkpoint hooks left them."""
        source = self.reader.model()
        return source if self.edits is None else EditedSource(source, self.edits)

    def stage_init(self, prefix: str, seed: int, strict: bool) -> StageInit:
        """How each stage reads its tensors from this checkpoint (``prefix``: the pipelined module's path)."""
        return StageInit(
            path=self.path, checkpoint=True, prefix=prefix, seed=seed, overwrite=True, strict=strict,
            weights_only=self.weights_only, edits=self.edits,
        )  # fmt: skip

    def load_outside(self, lightning_module: nn.Module, pipelined: nn.Module, device: torch.device, seed: int) -> None:
        """The LightningModule's tensors outside the pipelined module, read (or made real) on ``device``."""
        inside = {id(m) for m in pipelined.modules()}
        materialize(lightning_module, device, self.model(), seed, overwrite=True, skip=inside)

    def stored_name(self, key: str) -> str:
        """The name the checkpoint stores the parameter ``key``'s tensors under (a hook may have renamed it)."""
        return key if self.edits is None else self.edits.stored_name(key)

    def set_layouts(self, layouts: list[OptimizerLayout]) -> None:
        """The optimizers' parameter orders: what a single file's positions stand for (a folder names them)."""
        if isinstance(self.reader, FileCheckpoint):
            self.reader.layouts = list(layouts)

    def check_groups(self, layouts: list[OptimizerLayout], strict: bool = True) -> None:
        """Each saved optimizer's parameter groups against the optimizer's (``layouts``), as torch's
        ``Optimizer.load_state_dict`` checks them, and (``strict``: the LightningModule's ``strict_loading``) the
        parameters a folder names against the optimizer's: raises before any state is read."""
        for index, layout in enumerate(layouts[: self.reader.optimizer_count()]):
            saved = self.reader.group_sizes(index)
            if saved is None:
                continue
            what = f"{self.path}: optimizer {index}'s loaded state dict"
            if len(saved) != len(layout):
                raise ValueError(
                    f"{what} has a different number of parameter groups ({len(saved)}, the optimizer has "
                    f"{len(layout)}): configure_optimizers must build the optimizer the checkpoint was saved with"
                )
            for group, (size, keys) in enumerate(zip(saved, layout, strict=True)):
                if size != len(keys):
                    raise ValueError(
                        f"{what} contains a parameter group that doesn't match the size of optimizer's group "
                        f"(group {group}: {size} saved, {len(keys)} in the optimizer)"
                    )
            if strict and isinstance(self.reader, ShardedCheckpoint):  # a folder names each state's parameter
                self._check_names(index, self.reader.layout(index), layout)

    def _check_names(self, index: int, saved: OptimizerLayout, layout: OptimizerLayout) -> None:
        """The parameters a folder saved optimizer ``index``'s state for are the optimizer's (by key): a state saved
        under a name the optimizer does not have would not be read, and is not dropped silently."""
        stored, ours = {k for keys in saved for k in keys}, {self.stored_name(k) for keys in layout for k in keys}
        if stored == ours:
            return
        extra, missing = sorted(stored - ours), sorted(ours - stored)
        raise ValueError(
            f"{self.path}: optimizer {index}'s state was saved for parameters the optimizer does not have "
            f"({', '.join(extra[:3]) or 'none'}{' ...' if len(extra) > 3 else ''}) and not for some it has "
            f"({', '.join(missing[:3]) or 'none'}{' ...' if len(missing) > 3 else ''}): configure_optimizers must "
            "build the optimizer over the parameters the checkpoint was saved with, under the same names (a module "
            "compiled by torch.compile before saving names them with '_orig_mod.')"
        )

    def optimizer_states(self, layouts: list[OptimizerLayout]) -> list[dict[str, Any]]:
        """Each optimizer's whole state as torch's ``state_dict`` holds it (state by position in ``layouts``)."""
        self.set_layouts(layouts)
        states = []
        for index, layout in enumerate(layouts):
            state: dict[int, Any] = {}
            position = 0
            for keys in layout:
                for key in keys:
                    saved = self.optimizer_state(index, key)
                    if saved:
                        state[position] = {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in saved.items()}
                    position += 1
            groups, start = [], 0
            for keys, hparams in zip(layout, self.reader.optimizer_groups(index), strict=True):
                groups.append({**hparams, "params": list(range(start, start + len(keys)))})
                start += len(keys)
            states.append({"state": state, "param_groups": groups})
        return states

    def optimizer_state(self, index: int, key: str) -> dict[str, torch.Tensor]:
        """The state optimizer ``index`` saved for the parameter the model names ``key`` (a single file stores it by
        position, a folder by the name the checkpoint hooks may have changed)."""
        named = isinstance(self.reader, ShardedCheckpoint)
        return self.reader.optimizer_state(index, self.stored_name(key) if named else key)

    def stage_aliases(self, prefix: str, aliases: dict[str, list[str]], keys: list[str]) -> dict[str, list[str]]:
        """``aliases`` (the pipelined module's other names of tied tensors) with, for each parameter the checkpoint
        hooks renamed (``keys``: the pipelined module's), the name a folder stores its optimizer state under: what
        a stage reads its optimizer state by."""
        if self.edits is None or not isinstance(self.reader, ShardedCheckpoint):
            return aliases
        found = {k: list(v) for k, v in aliases.items()}
        for key in keys:
            stored = self.stored_name(prefix + key)
            if stored == prefix + key:
                continue
            if not stored.startswith(prefix):
                raise ValueError(
                    f"on_load_checkpoint moved {stored!r} of {self.path} to {prefix + key!r}, into the pipelined "
                    f"module from outside it ({prefix!r}): its optimizer state cannot be read there; consolidate the "
                    "folder into one file (lightning-pipe consolidate) and resume from the file"
                )
            found[key] = [stored[len(prefix) :], *found.get(key, [])]
        return found

    def groups(self, index: int) -> list[dict[str, Any]]:
        return self.reader.optimizer_groups(index)

    def close(self) -> None:
        self.reader.close()


def optimizer_layouts(lightning_module: nn.Module, optimizers: list[torch.optim.Optimizer]) -> list[OptimizerLayout]:
    """Each optimizer's parameters by their LightningModule key, per group, in the optimizer's order (what a
    single-file checkpoint's positions stand for)."""
    names: dict[int, str] = {}
    for name, param in lightning_module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), name)
    layouts = []
    for optimizer in optimizers:  # a parameter the module does not hold (an optimizer's own) keeps its position
        flat = iter(range(10**9))
        layouts.append(
            [
                [names.get(id(p), f"<parameter {next(flat)}>") for p in group["params"]]
                for group in optimizer.param_groups
            ]
        )
    return layouts
