"""`StageInit`: how a stage makes its tensors where it runs, as the coordinator describes it to every stage.

The description crosses to other processes (it is part of a stage's build spec), so it names a path, not
an open file: each process opens the checkpoint or the weights itself and reads only its stage's keys.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import torch
from torch import nn

from lightning_pipe.base.dtensor_shards import is_fsdp_module, is_sharded
from lightning_pipe.weights.edited import EditedSource, StateEdits
from lightning_pipe.weights.keys import STRICT_FIX, WEIGHTS_FIX, compare_keys
from lightning_pipe.weights.materialize import Materialized, aliases_of, materialize, on_meta
from lightning_pipe.weights.slots import Slot, get, own_slots
from lightning_pipe.weights.sources import MODEL, Prefixed, WeightSource, is_distributed_checkpoint, open_source
from lightning_pipe.weights.tied import FirstHolder, first_holders

T = TypeVar("T")


@dataclass
class StageInit:
    """Where a stage's initial values come from.

    ``path`` is a Lightning checkpoint (a single file or a sharded folder; ``checkpoint=True``) or pretrained
    weights of the pipelined module (safetensors, a ``torch.save``d state dict, a DCP folder); ``prefix`` is
    the pipelined module's path in the checkpoint's keys (``"model."``). Tensors it holds are read from it
    (also into tensors that have values already, with ``overwrite``: a resumed run); tensors without values
    (built on meta) that it does not hold are initialised by their modules under ``seed`` and their names.
    ``aliases`` are the other names of tied tensors, ``firsts`` their first holders (`tied.first_holders`: a stage
    without it initialises the tensor as it does); ``init_owner`` a model of the pipelined module's class and
    configuration, on meta, that initialises modules without ``reset_parameters`` (HuggingFace's ``_init_weights``).
    The stages one process builds from one description (local mode's) make a tensor they share once: the later
    ones hold what the first made.
    ``strict`` (the LightningModule's ``strict_loading``): a tensor of the stage the path does not hold raises
    before anything is read, in every process (`lightning_pipe.weights.keys`); ``weights_only`` is how a
    ``torch.save`` file is opened (None: torch's default, never retried unsafely); ``edits``: what the user's
    ``on_load_checkpoint`` did to the checkpoint's ``state_dict`` (`StateEdits`), read through.
    """

    path: str | None = None
    checkpoint: bool = False
    prefix: str = ""
    seed: int = 0
    overwrite: bool = True
    aliases: dict[str, list[str]] = field(default_factory=dict)
    init_owner: nn.Module | None = None
    strict: bool = True  # as Lightning's strict_loading: a tensor the path does not hold raises
    weights_only: bool | None = None
    edits: StateEdits | None = None
    firsts: dict[str, FirstHolder] = field(default_factory=dict)
    #: where this process put the tensors it made from this description: id of a meta tensor -> (it, a slot holding
    #: its real one); not sent. Slots, not tensors: a reference to a tensor would keep it, and FSDP's swap of a
    #: module's tensors refuses one that has a weak reference
    _made: dict[int, tuple[torch.Tensor, Slot]] = field(default_factory=dict, init=False, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("_made", "_lock")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _made={}, _lock=threading.Lock())

    def for_module(self, module: nn.Module) -> StageInit:
        """This description for the pipelined ``module``: with the names its tied tensors share, and (for a model
        that initialises its modules itself, HuggingFace's) a meta copy of it to do so."""
        owner = self.init_owner
        if owner is None and callable(getattr(module, "_init_weights", None)) and on_meta(module):
            owner = _model_like(module)
        firsts = self.firsts or (first_holders(module) if on_meta(module) else {})
        return replace(self, aliases=self.aliases or aliases_of(module), init_owner=owner, firsts=firsts)

    def for_shards(self, modules: Iterable[nn.Module]) -> StageInit:
        """This description for a worker holding ``modules`` (shards of the pipelined module): the values the
        checkpoint hook gave travel to the worker whose tensors they are, no other."""
        if self.edits is None or not self.edits.given:
            return self
        keys: set[str] = set()
        for module in modules:
            for key in module.state_dict(keep_vars=True):
                keys.update(self.prefix + name for name in (key, *self.aliases.get(key, ())))
        narrowed = replace(self, edits=self.edits.only(keys))
        narrowed._made, narrowed._lock = self._made, self._lock  # the stages one process builds share tied tensors
        return narrowed

    def source(self) -> WeightSource | None:
        """The opened source, its keys those of the pipelined module (None: nothing to read)."""
        if self.path is None:
            return None
        opened = open_source(self.path, self.weights_only)
        if self.checkpoint:
            section = f"{MODEL}." if is_distributed_checkpoint(self.path) else ""
            if self.edits is None:
                return Prefixed(opened, section + self.prefix)
            return Prefixed(EditedSource(Prefixed(opened, section), self.edits), self.prefix)
        return Prefixed(opened, self.prefix) if self.prefix else opened

    def apply(self, modules: list[tuple[nn.Module, torch.device]]) -> Materialized:
        """Make the tensors of ``modules`` (a worker's shards, named as in the pipelined module, each with its
        device) what this says; a tensor two of them share (a tied weight) is made once."""
        if self.path is None and not any(on_meta(module) for module, _ in modules):
            return Materialized()  # nothing to read, nothing without values
        source = self.source()
        if source is not None and self.strict:
            self._check(source, [module for module, _ in modules])
        done = Materialized()
        with self._lock:
            made = self._earlier()
            metas = _meta_slots(module for module, _ in modules)
            try:
                for module, device in modules:
                    part = materialize(
                        module, device, source, self.seed, self.aliases, self.init_owner, self.overwrite, made,
                        done.wholes, firsts=self.firsts,
                    )  # fmt: skip
                    done.loaded += part.loaded
                    done.initialized += part.initialized
            finally:
                if source is not None:
                    source.close()
            self._made.update({tid: metas[tid] for tid in metas if tid in made})
        return done

    def _earlier(self) -> dict[int, torch.Tensor]:
        """What earlier stages of this process made from this description and still hold, by meta tensor's id."""
        made = {}
        for tid, (_, slot) in list(self._made.items()):
            tensor = get(slot)
            if tensor.is_meta:  # freed since
                del self._made[tid]
            else:
                made[tid] = tensor
        return made

    def _check(self, source: WeightSource, modules: list[nn.Module]) -> None:
        """Every tensor of ``modules`` is in ``source`` (by a name of it): else raise before reading, naming them.
        Keys of the source no module here has are other stages' (the coordinator checks those)."""
        expected = [key for module in modules for key in module.state_dict(keep_vars=True)]
        report = compare_keys(expected, source.keys(), self.aliases)
        report.unexpected = []
        try:
            report.check(True, source.describe(), STRICT_FIX if self.checkpoint else WEIGHTS_FIX)
        finally:
            if report.missing:
                source.close()


def _model_like(module: nn.Module) -> nn.Module | None:
    """A new model of ``module``'s class and configuration, on meta (a HuggingFace model: what its
    ``_init_weights`` reads), or None where the class is not built from a ``config``."""
    config = getattr(module, "config", None)
    if config is None:
        return None
    with torch.device("meta"):
        return type(module)(config)  # type: ignore[no-any-return]


def meta_copy(obj: T, modules: Iterable[nn.Module] | None = None) -> T:
    """A copy of ``obj`` (a module, or anything holding ``modules``) whose modules' parameters and buffers are on
    the meta device (shapes only): cheap to make, to pickle and to send, whatever the size of the model."""
    held = [obj] if modules is None and isinstance(obj, nn.Module) else list(modules or ())
    memo: dict[int, Any] = {}
    for module in held:
        for kept in filter(is_fsdp_module, module.modules()):  # sharded by an earlier run here: FSDP refuses a
            memo[id(kept)] = kept  # deep copy, and only this process, which holds it, builds a stage from it
        for tensor in [*module.parameters(), *module.buffers()]:
            if id(tensor) not in memo:
                empty = torch.empty_like(tensor, device="meta") if not is_sharded(tensor) else _whole_meta(tensor, memo)
                memo[id(tensor)] = (
                    nn.Parameter(empty, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else empty
                )
    return copy.deepcopy(obj, memo)


def _whole_meta(tensor: Any, memo: dict[int, Any]) -> torch.Tensor:
    """A DTensor (tensor parallel, FSDP) as a plain meta tensor of its whole shape; its device mesh, which holds
    this process's groups, copied as None (also where the module's tensor parallel hooks hold it): the process
    that receives the copy binds it to its own modules, meshes and hooks (`adopt`)."""
    memo[id(tensor.device_mesh)] = None
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")


def _meta_slots(modules: Iterable[nn.Module]) -> dict[int, tuple[torch.Tensor, Slot]]:
    """Each meta tensor of ``modules`` by id, with a slot holding it."""
    found: dict[int, tuple[torch.Tensor, Slot]] = {}
    for module in modules:
        for qualified, owner in module.named_modules(remove_duplicate=False):
            for _, slot in own_slots(qualified, owner):
                tensor = get(slot)
                if tensor.is_meta:
                    found.setdefault(id(tensor), (tensor, slot))
    return found
