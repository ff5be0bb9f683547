"""A module's own initialisation of its tensors without values: seeded by its name, every element accounted for.

`initialize` runs a module's ``reset_parameters()`` (HuggingFace: the model's ``_init_weights``) under a generator
seeded by the run's seed and the module's name, and raises, naming them, for the tensors it was to set and left
fully or partly unwritten (`lightning_pipe.weights.written`: judged by what was written, not by the values left,
so a buffer rightly set to zeros is initialised and a mask made in ``__init__`` on meta is not).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from lightning_pipe.base.errors import ConfigurationError
from lightning_pipe.rng import derive_seed
from lightning_pipe.weights.slots import Slot, get
from lightning_pipe.weights.written import Writes


def initialize(
    owner: nn.Module, qualified: str, seed: int, init_owner: nn.Module | None, unset: Mapping[str, Slot]
) -> None:
    """Initialise ``owner`` (at ``qualified`` in the model): every tensor in ``unset`` (key -> where it is held)
    must be written in full, or this raises naming it and the fix."""
    init = init_function(owner, init_owner)
    if init is None:
        raise ConfigurationError(
            f"{', '.join(list(unset)[:3])} of {type(owner).__name__} ({qualified or 'the root module'}) have no "
            "values (built on the meta device), are not in the weights or checkpoint given, and the module has no "
            "reset_parameters() to initialise them: give it a reset_parameters(), pass weights= or ckpt_path= "
            "holding them, or build the model without init_module(empty_init=True) / configure_model"
        )
    with Writes(get(slot) for slot in unset.values()) as writes:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(derive_seed(seed, "init", qualified) % (2**63))
            init()
    left = {}
    for key, slot in unset.items():
        tensor = get(slot)
        written = None if tensor.is_meta else writes.written(tensor)  # None, not meta: assigned a new tensor
        if tensor.is_meta or (written is not None and written < tensor.numel()):
            left[key] = (tensor, written or 0)
    if left:
        raise ConfigurationError(_unwritten(owner, qualified, left))


def init_function(owner: nn.Module, init_owner: nn.Module | None) -> Callable[[], object] | None:
    """A HuggingFace model initialises its modules itself (``_init_weights``); other modules reset themselves."""
    hf_init = getattr(init_owner, "_init_weights", None)
    if callable(hf_init):
        return lambda: hf_init(owner)
    reset = getattr(owner, "reset_parameters", None)
    return reset if callable(reset) else None


def _unwritten(owner: nn.Module, qualified: str, left: Mapping[str, tuple[torch.Tensor, int]]) -> str:
    each = []
    for key, (tensor, written) in list(left.items())[:5]:
        kind = "parameter" if isinstance(tensor, nn.Parameter) else "buffer"
        if tensor.is_meta:
            what = "left on the meta device"
        else:
            what = f"{written or 'none'} of its {tensor.numel()} elements written"
        each.append(f"{key} ({str(tensor.dtype).removeprefix('torch.')} {kind}, {what})")
    return (
        f"{', '.join(list(left)[:5])} of {type(owner).__name__} ({qualified or 'the root module'}) still hold "
        f"uninitialised memory after its initialisation (reset_parameters() / _init_weights): {'; '.join(each)}. "
        "The model was built without values (init_module(empty_init=True) / configure_model), so a tensor made in "
        "__init__ holds nothing, and the checkpoint or weights do not hold these. Make the module's "
        "reset_parameters() set every element of every parameter and buffer (non-persistent buffers too, such as a "
        "mask made in __init__), register the buffer as persistent so that the checkpoint holds it, or give its "
        "values in ckpt_path= / weights="
    )
