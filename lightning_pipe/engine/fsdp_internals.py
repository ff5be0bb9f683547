"""The one place that reads FSDP2's private state: its post-backward, run by hand after a pipeline's last backward.

FSDP2 has no public call for "run your post-backward now"; torch's own pipelining reaches into the same
private attributes. `check` verifies they exist as this code expects for the installed torch and
`post_backward` calls it first, so a torch that renamed them fails here, naming its version and what changed
(docs/internals.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_pipe.base.errors import PipeError

TESTED_WITH = "2.13"  # the newest torch this module was read against

# what `post_backward` reads: FSDPState -> _state_ctx.all_states (every FSDPState under the root) ->
# _fsdp_param_groups (or the older _fsdp_param_group) -> post_backward(); the root's final callback
STATE_CONTEXT = "_state_ctx"
ALL_STATES = "all_states"
PARAM_GROUPS = "_fsdp_param_groups"
PARAM_GROUP_BEFORE_2_6 = "_fsdp_param_group"
FINAL_CALLBACK = "_root_post_backward_final_callback"


class FsdpInternalsChanged(PipeError):
    """The installed torch's FSDP2 does not hold what `lightning_pipe.engine.fsdp_internals` reads."""


def check(root: Any) -> int:
    """Raise `FsdpInternalsChanged` unless the root FSDP module ``root`` holds every private attribute read here;
    returns how many parameter groups (FSDP units with parameters) it found under ``root``."""
    state = _state(root)
    if state is None:
        raise PipeError(f"{type(root).__name__} is not a module sharded with fully_shard: it has no FSDP state")
    context = _require(state, STATE_CONTEXT, "the FSDP state of the root module")
    units = _require(context, ALL_STATES, f"FSDPState.{STATE_CONTEXT}")
    if not isinstance(units, list):  # every unit's state, filled in at the root's first forward
        raise _changed(f"FSDPState.{STATE_CONTEXT}.{ALL_STATES} is {type(units).__name__}, not a list of states")
    from torch.distributed.fsdp import FSDPModule

    found: dict[int, Any] = {}
    for unit in [*units, *(_state(m) for m in root.modules() if isinstance(m, FSDPModule))]:
        for group in _groups(unit):
            if not callable(getattr(group, "post_backward", None)):
                raise _changed(f"{type(group).__name__} has no post_backward()")
            found[id(group)] = group
    if not callable(getattr(state, FINAL_CALLBACK, None)):
        raise _changed(f"FSDPState has no {FINAL_CALLBACK}()")
    return len(found)


def post_backward(root: Any) -> None:
    """FSDP's post-backward of every unit under the root FSDP module ``root`` (reduce-scatter of the gradients
    it accumulated), then the root's final callback, as autograd would have run them after a plain backward."""
    check(root)
    state = _state(root)
    for unit in getattr(getattr(state, STATE_CONTEXT), ALL_STATES):
        for group in _groups(unit):
            group.post_backward()
    final: Callable[[], None] = getattr(state, FINAL_CALLBACK)
    final()


def _state(root: Any) -> Any:
    from torch.distributed.fsdp import fully_shard

    state_of = getattr(fully_shard, "state", None)  # set on fully_shard by torch's @contract decorator
    if not callable(state_of):
        raise _changed("fully_shard.state(module) does not exist")
    return state_of(root)


def _groups(unit: Any) -> list[Any]:
    """The parameter groups of one FSDP state (a unit: one ``fully_shard`` call)."""
    groups = getattr(unit, PARAM_GROUPS, None)
    if groups is None:  # torch < 2.6: at most one group per state
        if not hasattr(unit, PARAM_GROUP_BEFORE_2_6):
            raise _changed(f"FSDPState has neither {PARAM_GROUPS} nor {PARAM_GROUP_BEFORE_2_6}")
        group = getattr(unit, PARAM_GROUP_BEFORE_2_6)
        return [] if group is None else [group]
    if not isinstance(groups, list):
        raise _changed(f"FSDPState.{PARAM_GROUPS} is {type(groups).__name__}, not a list")
    return groups


def _require(obj: Any, name: str, what: str) -> Any:
    if not hasattr(obj, name):
        raise _changed(f"{what} has no attribute {name}")
    return getattr(obj, name)


def _changed(what: str) -> FsdpInternalsChanged:
    return FsdpInternalsChanged(
        f"torch {torch.__version__} changed the FSDP2 internals that lightning_pipe reads to reduce a pipelined "
        f"stage's gradients once per step ({what}; lightning_pipe/engine/fsdp_internals.py, read against torch "
        f"{TESTED_WITH}); install a torch lightning_pipe supports (pyproject's torch range) or use "
        "PipeStrategy(data_parallel='ddp')"
    )
