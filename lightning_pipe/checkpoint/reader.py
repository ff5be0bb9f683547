"""Reading a Lightning checkpoint one stage at a time: a single file or a sharded folder, the same interface.

A stage asks for its own tensors by the LightningModule's keys (``"model.3.weight"``) and for its optimizer
state by the same names. Two layouts on disk:

- a single file (``torch.save``; what a plain Trainer writes): ``state_dict`` by key, ``optimizer_states``
  by position in each optimizer's parameter list (`OptimizerLayout`: only ``configure_optimizers`` knows it).
- a folder written by torch.distributed.checkpoint (`lightning_pipe.checkpoint.sharded`, or Lightning's
  ``ModelParallelStrategy``: the same keys): tensors under ``state_dict.<key>``, ``optimizer_<i>.state.<key>.<name>``,
  each group's hyperparameters and parameter order under ``optimizer_<i>.param_groups.<group>.<name>``
  (``params``: the keys), Lightning's loop and callback state in ``meta.pt``; the stages' generator states in
  ``meta.pt`` too, or where it says `IN_PARTS` (launched mode), each stage's in the parts (`RANDOM_STATES`).
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_pipe.base.errors import ConfigurationError
from lightning_pipe.weights.keys import visible
from lightning_pipe.weights.sources import (
    MODEL,
    DcpSource,
    PathLike,
    Prefixed,
    TorchFileSource,
    WeightSource,
    is_distributed_checkpoint,
    unsafe_file_message,
)

META_FILE = "meta.pt"  # Lightning's name for the non-tensor part of a sharded checkpoint (ModelParallelStrategy)
OptimizerLayout = list[list[str]]  # per parameter group, the keys of its parameters in the optimizer's order
OURS = "lightning_pipe"  # the checkpoint's top-level key of what PipeStrategy adds (``random_state``, ``schedule``)
#: where a sharded folder's parts hold their stages' generator states: ``<this>.<stage index>.<generator key>``
RANDOM_STATES = f"{OURS}.random_state.stages"
#: ``meta.pt``'s ``lightning_pipe.random_state.stages`` when the parts hold them (every process writes its own)
IN_PARTS = "in the parts"


def optimizer_key(index: int) -> str:
    return f"optimizer_{index}"


class CheckpointReader:
    """A Lightning checkpoint, read by key (`model`) and by parameter name (`optimizer_state`)."""

    path: Path

    def model(self, prefix: str = "") -> WeightSource:
        """The module's tensors; keys are the LightningModule's without ``prefix`` (the pipelined module's path)."""
        raise NotImplementedError

    def optimizer_state(self, index: int, key: str) -> dict[str, torch.Tensor]:
        """The state optimizer ``index`` keeps for the parameter ``key`` (empty when it has none)."""
        raise NotImplementedError

    def optimizer_groups(self, index: int) -> list[dict[str, Any]]:
        """The hyperparameters of optimizer ``index``'s parameter groups (without their parameters)."""
        raise NotImplementedError

    def lightning_state(self) -> dict[str, Any]:
        """Everything Lightning restores besides the tensors: loops, callbacks, epoch, hyperparameters, ..."""
        raise NotImplementedError

    def optimizer_count(self) -> int:
        """How many optimizers' states the checkpoint holds (0: it holds the model only)."""
        raise NotImplementedError

    def group_sizes(self, index: int) -> list[int] | None:
        """How many parameters each of optimizer ``index``'s saved groups had (None: not recorded)."""
        raise NotImplementedError

    def release(self, value: Any) -> None:
        """The caller copied ``value`` (a tensor this reader returned) and does not read it again."""

    def close(self) -> None:
        """Let go of the file (a single file stays mapped until then)."""


class FileCheckpoint(CheckpointReader):
    """A single-file checkpoint, mapped (``torch.load(mmap=True)``): a stage's reads touch only its own pages."""

    def __init__(self, path: PathLike, layouts: Sequence[OptimizerLayout] = (), weights_only: bool | None = None):
        self.path = Path(path)
        self.file = TorchFileSource(self.path, section=MODEL, weights_only=weights_only)
        self.layouts = list(layouts)

    @property
    def content(self) -> dict[str, Any]:
        return self.file.content

    def model(self, prefix: str = "") -> WeightSource:
        return Prefixed(self.file, prefix)

    def optimizer_state(self, index: int, key: str) -> dict[str, torch.Tensor]:
        position = self._position(index, key)
        states = self.content.get("optimizer_states", [])
        if position is None or index >= len(states):
            return {}
        return dict(states[index]["state"].get(position, {}))

    def optimizer_groups(self, index: int) -> list[dict[str, Any]]:
        states = self.content.get("optimizer_states", [])
        if index >= len(states):
            return []
        return [{k: v for k, v in group.items() if k != "params"} for group in states[index]["param_groups"]]

    def lightning_state(self) -> dict[str, Any]:
        return {k: v for k, v in self.content.items() if k not in (MODEL, "optimizer_states")}

    def optimizer_count(self) -> int:
        return len(self.content.get("optimizer_states") or ())

    def group_sizes(self, index: int) -> list[int] | None:
        return [len(group["params"]) for group in self.content["optimizer_states"][index]["param_groups"]]

    def release(self, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            self.file.release(value)

    def close(self) -> None:
        self.file.close()

    def _position(self, index: int, key: str) -> int | None:
        if index >= len(self.layouts):
            raise ValueError(
                f"reading optimizer {index}'s state from {self.path} needs its parameter order (a single-file "
                "checkpoint stores the state by position)"
            )
        flat = [k for group in self.layouts[index] for k in group]
        return flat.index(key) if key in flat else None


class ShardedCheckpoint(CheckpointReader):
    """A folder of torch.distributed.checkpoint shards: a stage reads its keys (and chunks) only."""

    def __init__(self, path: PathLike, weights_only: bool | None = None) -> None:
        self.path = Path(path)
        self.folder = DcpSource(self.path)
        self._weights_only = weights_only
        self._states: dict[int, dict[str, list[str]]] = {}
        self._groups: dict[int, list[dict[str, Any]]] = {}

    def model(self, prefix: str = "") -> WeightSource:
        return Prefixed(self.folder, f"{MODEL}.{prefix}")

    def optimizer_state(self, index: int, key: str) -> dict[str, torch.Tensor]:
        names = self._state_names(index).get(key, [])
        base = f"{optimizer_key(index)}.state.{key}."
        got = self.folder.read([base + n for n in names])
        return {n: got[base + n] for n in names}

    def load_optimizer_state(self, index: int, targets: dict[str, dict[str, Any]]) -> None:
        """Fill ``targets`` (``{key: {state name: tensor or DTensor}}``) in place: a sharded target reads its chunk."""
        flat = {f"{optimizer_key(index)}.state.{k}.{n}": t for k, states in targets.items() for n, t in states.items()}
        self.folder.load_into(flat)

    def state_shapes(self, index: int, key: str) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """The global shape and dtype of each tensor state optimizer ``index`` saved for ``key``."""
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        base = f"{optimizer_key(index)}.state.{key}."
        shapes = {}
        for name in self._state_names(index).get(key, []):
            meta = self.folder.metadata[base + name]
            if isinstance(meta, TensorStorageMetadata):
                shapes[name] = (meta.size, meta.properties.dtype)
        return shapes

    def optimizer_groups(self, index: int) -> list[dict[str, Any]]:
        return [{k: v for k, v in group.items() if k != "params"} for group in self._param_groups(index)]

    def optimizer_count(self) -> int:
        prefixes = {key.split(".", 1)[0] for key in self.folder.metadata}
        count = 0
        while optimizer_key(count) in prefixes:
            count += 1
        return count

    def group_sizes(self, index: int) -> list[int] | None:
        layout = self.layout(index)
        return [len(keys) for keys in layout] if layout else None

    def layout(self, index: int) -> OptimizerLayout:
        key = f"{optimizer_key(index)}.layout"  # a folder written by an earlier lightning_pipe
        if key in self.folder.metadata:
            return list(self.folder.objects(key)[key])
        return [list(group.get("params", ())) for group in self._param_groups(index)]

    def _param_groups(self, index: int) -> list[dict[str, Any]]:
        """Optimizer ``index``'s groups as saved: ``param_groups.<group>.<name>`` (``params``: the group's keys), as
        Lightning's ModelParallelStrategy and this package write them, or one value (an earlier lightning_pipe)."""
        if index not in self._groups:
            base = f"{optimizer_key(index)}.param_groups"
            got = self.folder.objects(base)
            if base in got:
                groups = [dict(group) for group in got[base]]
            else:
                numbered: dict[int, dict[str, Any]] = {}
                for flat, value in got.items():
                    number, _, name = flat[len(base) + 1 :].partition(".")
                    numbered.setdefault(int(number), {})[name] = value
                groups = [numbered[n] for n in sorted(numbered)]
            self._groups[index] = groups
        return self._groups[index]

    def lightning_state(self) -> dict[str, Any]:
        meta = self.path / META_FILE
        if not meta.is_file():
            return {}
        load: dict[str, Any] = {} if self._weights_only is None else {"weights_only": self._weights_only}
        try:
            state: dict[str, Any] = torch.load(meta, map_location="cpu", **load)
        except pickle.UnpicklingError as error:  # never retried unsafely (`unsafe_file_message`)
            if self._weights_only is False:
                raise
            raise ConfigurationError(unsafe_file_message(meta, error)) from error
        random = state.get(OURS, {}).get("random_state") if isinstance(state.get(OURS), dict) else None
        if isinstance(random, dict) and random.get("stages") == IN_PARTS:
            state[OURS] = {**state[OURS], "random_state": {**random, "stages": self.random_states()}}
        return state

    def random_states(self) -> dict[int, dict[str, torch.Tensor]]:
        """The stages' generator states the parts hold (`RANDOM_STATES`), by stage index and generator key."""
        keys = [key for key in self.folder.metadata if key.startswith(f"{RANDOM_STATES}.")]
        states: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in self.folder.read(keys).items():
            index, _, generator = key[len(RANDOM_STATES) + 1 :].partition(".")
            states.setdefault(int(index), {})[generator] = value
        return dict(sorted(states.items()))

    def state_names(self, index: int, key: str) -> list[str]:
        """The names of the states optimizer ``index`` saved for ``key`` (tensors and other values)."""
        return self._state_names(index).get(key, [])

    def _state_names(self, index: int) -> dict[str, list[str]]:
        """Per parameter key, the names of the states optimizer ``index`` saved for it."""
        if index not in self._states:
            base = f"{optimizer_key(index)}.state."
            names: dict[str, list[str]] = {}
            for flat in self.folder.metadata:
                if flat.startswith(base):
                    key, _, name = flat[len(base) :].rpartition(".")
                    names.setdefault(key, []).append(name)
            self._states[index] = names
        return self._states[index]


def open_checkpoint(
    path: PathLike, layouts: Sequence[OptimizerLayout] = (), weights_only: bool | None = None
) -> CheckpointReader:
    """The reader for ``path``: a sharded folder or a single file (``layouts``: each optimizer's parameter order)."""
    visible(path, "the checkpoint")
    if is_distributed_checkpoint(path):
        return ShardedCheckpoint(path, weights_only)
    return FileCheckpoint(path, layouts, weights_only)
