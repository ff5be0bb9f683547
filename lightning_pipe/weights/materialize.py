"""A stage's tensors made real on its device: from a source, or by the modules' own initialisation.

Each stage of a model built on meta makes only its own tensors real: a tensor whose key is in the
`WeightSource` is read from it, any other gets its module's own initialisation under a generator seeded by
the run's seed and the module's name, so the initial model does not depend on how it is cut or where it runs.
`free_to_meta` sends what a process does not hold back to meta (docs/internals.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_pipe.base.dtensor_shards import (
    Wholes,
    copy_shard,
    empty_shard_like,
    is_fsdp_module,
    is_sharded,
    shard_of,
    whole_like,
)
from lightning_pipe.base.errors import ConfigurationError
from lightning_pipe.weights.module_init import initialize
from lightning_pipe.weights.slots import Slot, empty_like, get, own_slots, put
from lightning_pipe.weights.sources import WeightSource
from lightning_pipe.weights.tied import FirstHolder, initialize_as_first


@dataclass
class Materialized:
    """What `materialize` did: keys read from the source, modules initialised (by qualified name), and the whole
    tensors of sharded parameters it held on the way (`Wholes`: at most one module's at once)."""

    loaded: list[str] = field(default_factory=list)
    initialized: list[str] = field(default_factory=list)
    wholes: Wholes = field(default_factory=Wholes)


def on_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` has no values (is on the meta device)."""
    return any(t.is_meta for t in _tensors(module))


def materialize(
    module: nn.Module,
    device: torch.device | str,
    source: WeightSource | None = None,
    seed: int = 0,
    aliases: Mapping[str, Sequence[str]] | None = None,
    init_owner: nn.Module | None = None,
    overwrite: bool = False,
    made: dict[int, torch.Tensor] | None = None,
    wholes: Wholes | None = None,
    skip: set[int] | None = None,
    firsts: Mapping[str, FirstHolder] | None = None,
) -> Materialized:
    """Make every meta tensor of ``module`` real on ``device``; its keys are those of ``module.state_dict()``.

    ``aliases`` gives other keys of a tied tensor (HF's ``lm_head.weight`` is saved as
    ``transformer.wte.weight``); ``init_owner`` is the unsplit model whose ``_init_weights`` initialises modules
    without ``reset_parameters`` (HuggingFace). Tensors that are real already are left as they are, or, with
    ``overwrite``, get the source's values where it holds them. ``made`` (meta tensor's id -> its real
    tensor) carries what one call made to the next, for modules that share tensors: a tied tensor is read or
    initialised once, and no later module's initialisation writes it. ``firsts`` (`tied.first_holders` of the
    unsplit model) initialises a tied tensor whose first holder is not here as that holder does. Modules whose
    ids are in ``skip`` are left alone.

    Initialisation is accounted for (`module_init.initialize`): a tensor it was to set and left fully or partly
    unwritten raises, naming it.

    A sharded tensor (a DTensor: the stage was sharded with FSDP on meta) gets only this process's shard: read
    as a shard where the source can, else read or initialised whole, one module at a time, and cut to its shard
    (`lightning_pipe.base.dtensor_shards`); ``wholes`` counts the whole tensors held meanwhile.
    """
    device = torch.device(device)
    aliases = aliases or {}
    done = Materialized() if wholes is None else Materialized(wholes=wholes)
    skip = skip or set()
    if overwrite and source is not None:
        done.loaded += _overwrite(module, source, aliases, skip, done.wholes)
    made = {} if made is None else made  # id of a meta tensor -> its real one (a tied tensor is made once)
    firsts = firsts or {}
    for qualified, owner in module.named_modules(remove_duplicate=False):
        if id(owner) in skip:
            continue
        slots = [(key, slot, get(slot)) for key, slot in own_slots(qualified, owner) if get(slot).is_meta]
        if not slots:
            continue
        fresh: dict[int, tuple[str, Slot, torch.Tensor]] = {}  # tensors this module is the first to hold
        for key, slot, old in slots:
            if id(old) not in made:
                fresh.setdefault(id(old), (key, slot, old))
        found = {key: _find(key, source, aliases) for key, _, _ in fresh.values()}
        unset = {key: slot for key, slot, _ in fresh.values() if found[key] is None}
        staging = torch.device("cpu") if unset else device  # initialisation draws on the CPU, as everywhere
        for tid, (_, _, old) in fresh.items():
            made[tid] = _staged(old, staging, bool(unset), done.wholes)
        for _, slot, old in slots:
            if id(old) in fresh:
                put(slot, made[id(old)])
        if unset:
            for tid, (key, slot, _) in fresh.items():  # a tied tensor whose first holder is elsewhere: as it does
                first = firsts.get(key)
                if key in unset and first is not None and first.qualified != qualified:
                    made[tid] = initialize_as_first(first, made[tid], seed, init_owner)
                    put(slot, made[tid])
                    del unset[key]
            # the module's initialisation writes only what it is to initialise: a tensor an earlier module made (a
            # tied one) stays on meta meanwhile, and one read from the source or with values is set aside, so what
            # it draws does not depend on where the model was cut, and what was read or made is not written again
            if unset:
                held = _set_aside(owner, {id(made[tid]) for tid, (key, _, _) in fresh.items() if key in unset})
                try:
                    initialize(owner, qualified, seed, init_owner, unset)
                finally:
                    for slot, tensor in held:
                        put(slot, tensor)
            for tid, (_, slot, old) in fresh.items():  # an initialisation that assigned a new tensor: it is the value
                made[tid] = _moved(get(slot), device, old, done.wholes)
            done.initialized.append(qualified or "<root>")
        for _, slot, old in slots:
            put(slot, made[id(old)])
        for tid, (key, _, _) in fresh.items():
            name = found[key]
            if name is None or source is None:
                continue
            _copy_in(made[tid], source, name, key, done.wholes)
            done.loaded.append(key)
    return done


def _overwrite(
    module: nn.Module, source: WeightSource, aliases: Mapping[str, Sequence[str]], skip: set[int], wholes: Wholes
) -> list[str]:
    """Copy the source's values into the tensors of ``module`` that have values already."""
    loaded, seen = [], set()
    for qualified, owner in module.named_modules(remove_duplicate=False):
        if id(owner) in skip:
            continue
        for key, slot in own_slots(qualified, owner):
            tensor = get(slot)
            name = _find(key, source, aliases)
            if tensor.is_meta or id(tensor) in seen or name is None:
                continue
            seen.add(id(tensor))
            _copy_in(tensor, source, name, key, wholes)
            loaded.append(key)
    return loaded


def _copy_in(target: torch.Tensor, source: WeightSource, name: str, key: str, wholes: Wholes) -> None:
    if is_sharded(target) and source.read_shard(name, target):
        return  # only this process's shard was read
    value = source.get(name)
    if tuple(value.shape) != tuple(target.shape):
        raise ConfigurationError(
            f"{source.describe()}: {name!r} has shape {tuple(value.shape)} but the model's {key!r} has "
            f"{tuple(target.shape)}; the weights are of another model or configuration"
        )
    if is_sharded(target):
        wholes.hold(value)
        copy_shard(target, value)
        wholes.drop(value)
    else:
        with torch.no_grad():
            target.copy_(value)
    source.release(value)


def free_to_meta(module: nn.Module, keep: Iterable[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Put every parameter and buffer of ``module`` that is not in ``keep`` on the meta device; returns each meta
    replacement by the id of the tensor it replaced (a tensor is freed once nothing else holds it)."""
    kept = {id(t) for t in keep}
    replaced: dict[int, torch.Tensor] = {}
    for qualified, owner in module.named_modules(remove_duplicate=False):
        for _, slot in own_slots(qualified, owner):
            tensor = get(slot)
            if id(tensor) in kept or tensor.is_meta:
                continue
            if id(tensor) not in replaced:
                replaced[id(tensor)] = empty_like(tensor, torch.device("meta"))
            put(slot, replaced[id(tensor)])
    return replaced


def adopt(shard: nn.Module, local: nn.Module) -> None:
    """Make ``shard`` (a stage's module, as another process cut and sent it) hold ``local``'s own modules and
    tensors at the same paths: the stage then trains the objects of this process's copy of the model.

    A module of ``shard`` of the same type as ``local``'s at its path is replaced by it; any other (the
    containers a partitioner makes to hold a path) is entered.
    """
    _adopt(shard, local, "")


def _adopt(node: nn.Module, local: nn.Module, path: str) -> None:
    for name, child in list(node._modules.items()):
        if child is None:
            continue
        at = f"{path}{name}"
        target = _submodule(local, at)
        if target is not None and _same_class(target, child):
            node._modules[name] = target
        else:
            _adopt(child, local, at + ".")
    for store, is_param in ((node._parameters, True), (node._buffers, False)):
        for name in list(store):
            value = _attribute(local, f"{path}{name}")
            if isinstance(value, torch.Tensor) and (isinstance(value, nn.Parameter) == is_param):
                store[name] = value  # type: ignore[assignment]


def _same_class(local: nn.Module, sent: nn.Module) -> bool:
    """Whether ``sent`` (a module another process cut and sent) is ``local``'s class: the same class, or the same
    name where the class came by value from the training script (``__main__``), a new class object here."""
    a, b = type(local), type(sent)
    if is_fsdp_module(local):  # an earlier run here sharded it: FSDP2 made its class a subclass of the user's
        return any(_same_class_type(base, b) for base in a.__bases__)
    return _same_class_type(a, b)


def _same_class_type(a: type, b: type) -> bool:
    return a is b or (a.__module__, a.__qualname__) == (b.__module__, b.__qualname__)


def aliases_of(module: nn.Module) -> dict[str, list[str]]:
    """For each key of a tensor that several names share (tied weights), the other names of it."""
    names: dict[int, list[str]] = {}
    for qualified, owner in module.named_modules(remove_duplicate=False):
        for key, slot in own_slots(qualified, owner):
            names.setdefault(id(get(slot)), []).append(key)
    return {
        key: [other for other in group if other != key] for group in names.values() if len(group) > 1 for key in group
    }


def _staged(old: torch.Tensor, device: torch.device, whole: bool, wholes: Wholes) -> torch.Tensor:
    """Where ``old`` (a meta tensor) gets its values: a tensor like it on ``device``; for a sharded one, its shard,
    or (``whole``: its module initialises it) the whole tensor, cut to its shard once initialised (`_moved`)."""
    if not is_sharded(old):
        return empty_like(old, device)
    if not whole:
        return empty_shard_like(old, device)
    staged = whole_like(old, device)
    wholes.hold(staged)
    return staged


def _moved(tensor: torch.Tensor, device: torch.device, like: torch.Tensor, wholes: Wholes) -> torch.Tensor:
    """``tensor`` (made for the meta tensor ``like``, initialised) on ``device``: for a sharded ``like``, its shard."""
    if is_sharded(like):
        shard = shard_of(tensor, like, device)
        wholes.drop(tensor)
        return shard
    if tensor.device == device:
        return tensor
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(tensor.detach().to(device), requires_grad=tensor.requires_grad)
    return tensor.to(device)


def _set_aside(owner: nn.Module, keep: set[int]) -> list[tuple[Slot, torch.Tensor]]:
    """Put a meta tensor in place of each tensor with values of ``owner`` and its submodules whose id is not in
    ``keep``; returns each (slot, tensor) to put back."""
    held = []
    for _, module in owner.named_modules(remove_duplicate=False):
        for _, slot in own_slots("", module):
            tensor = get(slot)
            if not tensor.is_meta and id(tensor) not in keep:
                held.append((slot, tensor))
                empty = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")  # a DTensor's: its whole shape
                put(slot, nn.Parameter(empty, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else empty)
    return held


def _find(key: str, source: WeightSource | None, aliases: Mapping[str, Sequence[str]]) -> str | None:
    if source is None:
        return None
    for name in (key, *aliases.get(key, ())):
        if name in source:
            return name
    return None


def _submodule(root: nn.Module, path: str) -> nn.Module | None:
    try:
        return root.get_submodule(path)
    except AttributeError:
        return None


def _attribute(root: nn.Module, path: str) -> object:
    owner_path, _, name = path.rpartition(".")
    owner = _submodule(root, owner_path) if owner_path else root
    return None if owner is None else getattr(owner, name, None)


def _tensors(module: nn.Module) -> Iterable[torch.Tensor]:
    yield from module.parameters()
    yield from module.buffers()
