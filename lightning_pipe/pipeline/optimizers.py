"""`StageOptimizers`: an optimizer whose parameters live on the stages, each stage stepping its own part.

With ``transport="rpc"`` a stage's parameters, gradients and optimizer state stay in its worker
process. This object stands in for the optimizer the user built over the unsplit module (the
*template*, e.g. what ``configure_optimizers`` returns): every stage builds the same optimizer class
with the same hyperparameters per parameter group over its own parameters; the template's
``param_groups`` stay the place where hyperparameters change (LR schedulers write there) and changes
travel with the next step. Clipping uses the global norm over all stages, a GradScaler's inf check
covers all stages, and `state_dict` is the template's layout, so a checkpoint does not depend on
the transport. What returns nothing (the step, ``zero_grad``, clipping's scaling) is posted to the
stages (`Coordinator.post`): a stage's failure there is raised at the coordinator's next call or step.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any, Protocol

import torch

from lightning_pipe.base.errors import ConfigurationError
from lightning_pipe.comm.base import Communicator
from lightning_pipe.engine import CoordinatorLink, StageProtocol

Location = tuple[int, str]  # (rank, parameter name)


class StagedModel(Protocol):
    """What `StageOptimizers` needs of a pipeline (`lightning_pipe.Pipeline` is one)."""

    communicator: Communicator

    @property
    def coordinator(self) -> Any: ...  # engine.Coordinator: ``num_ranks``, ``call`` and ``post(name, *args, each=...)``

    @property
    def tied(self) -> list[list[tuple[int, str]]]: ...

    def parameter_locations(self) -> dict[int, tuple[int, str]]: ...


class StageOptimizers:
    """The per-stage parts of ``template``; parameters of ``template`` outside the pipeline stay with it."""

    def __init__(
        self, pipeline: StagedModel, template: torch.optim.Optimizer, names: dict[int, str] | None = None
    ) -> None:
        pipeline.communicator.parameters.check_stage_optimizers()  # refused where the stages share the module
        self.pipeline = pipeline
        self.template = template
        locations = pipeline.parameter_locations()
        if names is not None:  # the template's parameters by their names in the pipelined module (launched mode)
            by_name = {location[1]: location for location in reversed(list(locations.values()))}
            self._layout: list[list[Location | None]] = [
                [by_name.get(names.get(id(p), "")) for p in group["params"]] for group in template.param_groups
            ]
        else:
            self._layout = [[locations.get(id(p)) for p in group["params"]] for group in template.param_groups]
        self._outside = any(loc is None for layout in self._layout for loc in layout)
        # a tied weight (one parameter of the template) has a copy on several ranks: each steps its own copy
        self._copies: dict[Location, list[Location]] = {holders[0]: holders for holders in pipeline.tied}
        self._counted_elsewhere = [[n for holders in pipeline.tied for r, n in holders[1:] if r == rank]
                                   for rank in range(pipeline.coordinator.num_ranks)]  # fmt: skip
        ranks = pipeline.coordinator.num_ranks
        per_rank = [
            [
                {"hparams": hparams, "names": [n for loc in layout for r, n in self._holders(loc) if r == rank]}
                for hparams, layout in zip(self._hparams(), self._layout, strict=True)
            ]
            for rank in range(ranks)
        ]
        groups = [(g,) for g in per_rank]
        self._stages.call_each(StageProtocol.build_optimizer, groups, type(template), dict(template.defaults))
        self._pushed = copy.deepcopy(self._hparams())

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.template.param_groups

    def _holders(self, location: Location | None) -> list[Location]:
        """Every (rank, name) holding the parameter at ``location`` (several for a tied weight)."""
        if location is None:
            return []
        return self._copies.get(location, [location])

    @property
    def _stages(self) -> CoordinatorLink:
        """The stages' control calls. What returns nothing is posted (no round trip): the stages run it before
        the next call or step."""
        return self.pipeline.coordinator.stages

    def _hparams(self) -> list[dict[str, Any]]:
        return [{k: v for k, v in group.items() if k != "params"} for group in self.template.param_groups]

    def _changed(self) -> list[dict[str, Any]] | None:
        """The groups' hyperparameters if they changed since the stages last got them."""
        now = self._hparams()
        try:
            same = now == self._pushed
        except RuntimeError:  # tensors as hyperparameters: send them
            same = False
        if same:
            return None
        self._pushed = copy.deepcopy(now)
        return now

    def _local_grads(self) -> list[torch.Tensor]:
        """Gradients of the template's parameters that are not on a stage."""
        return [
            p.grad
            for group, layout in zip(self.template.param_groups, self._layout, strict=True)
            for p, loc in zip(group["params"], layout, strict=True)
            if loc is None and p.grad is not None
        ]

    # an optimizer's interface
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._stages.post(StageProtocol.optimizer_step, self._changed())
        # the parameters outside the pipeline; the stages' copies here have no gradient and are skipped
        # (an LR scheduler also learns that its optimizer stepped)
        self.template.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._stages.post(StageProtocol.zero_grad, set_to_none)
        self.template.zero_grad(set_to_none)

    # what Lightning's precision plugins do to gradients, over all stages
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Like ``torch.nn.utils.clip_grad_norm_`` over every stage's gradients; returns the total norm."""
        norm_type = float(norm_type)
        skips = [(skip,) for skip in self._counted_elsewhere]
        parts = self._stages.call_each(StageProtocol.grad_norm, skips, norm_type)
        local = self._local_grads()
        if math.isinf(norm_type):
            total = max(parts + [g.detach().abs().max().item() for g in local])
        else:
            local_sum = sum(float(torch.linalg.vector_norm(g.detach(), norm_type)) ** norm_type for g in local)
            total = (sum(parts) + local_sum) ** (1.0 / norm_type)
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            self._stages.post(StageProtocol.scale_grads, coef)
            for g in local:
                g.detach().mul_(coef)
        return torch.tensor(total)

    def clip_grad_value_(self, value: float) -> None:
        self._stages.post(StageProtocol.clamp_grads, float(value))
        for g in self._local_grads():
            g.detach().clamp_(-value, value)

    def unscale_(self, inv_scale: float) -> bool:
        """A GradScaler's unscale over all stages; True if any stage found an inf or nan."""
        found = any(self._stages.call(StageProtocol.unscale_grads, float(inv_scale)))
        for g in self._local_grads():
            g.detach().mul_(inv_scale)
            found = found or not bool(torch.isfinite(g).all())
        return found

    # checkpoints: the template's layout, gathered from the stages
    def state_dict(self) -> dict[str, Any]:
        parts = self._stages.call(StageProtocol.optimizer_state)
        local = self.template.state_dict() if self._outside else {"state": {}}
        state: dict[int, Any] = {}
        groups, index = [], 0
        for hparams, layout in zip(self._hparams(), self._layout, strict=True):
            ids = []
            for loc in layout:
                saved = local["state"].get(index) if loc is None else parts[loc[0]]["state"].get(loc[1])
                if saved is not None:
                    state[index] = saved
                ids.append(index)
                index += 1
            groups.append({**hparams, "params": ids})
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        groups = state_dict["param_groups"]
        sizes = [len(layout) for layout in self._layout]
        if [len(g["params"]) for g in groups] != sizes:
            raise ConfigurationError(
                f"the optimizer state has groups of {[len(g['params']) for g in groups]} parameters "
                f"but this optimizer's groups have {sizes}"
            )
        per_rank: list[dict[str, Any]] = [{} for _ in range(self.pipeline.coordinator.num_ranks)]
        local: dict[int, Any] = {}
        for layout, group in zip(self._layout, groups, strict=True):
            for loc, index in zip(layout, group["params"], strict=True):
                saved = state_dict["state"].get(index)
                if saved is None:
                    continue
                if loc is None:
                    local[index] = saved
                for rank, name in self._holders(loc):
                    per_rank[rank][name] = saved
        hparams = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        self._stages.call_each(StageProtocol.load_optimizer_state, [(part, hparams) for part in per_rank])
        self._load_template(local, hparams)

    def load_where_saved(
        self, load: Callable[[list[dict[str, Any]]], None], hparams: list[dict[str, Any]], outside: dict[int, Any]
    ) -> None:
        """Each rank reads its own state where it was saved (``load(hparams)`` asks them: launched mode, so that
        no process holds another's); ``outside``: the saved state of the template's own parameters, by position."""
        load(hparams)
        self._load_template(outside, hparams)

    def _load_template(self, outside: dict[int, Any], hparams: list[dict[str, Any]]) -> None:
        """The template's own parameters' state (by position) and every group's hyperparameters."""
        if self._outside:
            groups, start = [], 0
            for layout, values in zip(self._layout, hparams, strict=True):
                groups.append({**values, "params": list(range(start, start + len(layout)))})
                start += len(layout)
            self.template.load_state_dict({"state": outside, "param_groups": groups})
        else:
            for group, values in zip(self.template.param_groups, hparams, strict=True):
                group.update(values)
        self._pushed = copy.deepcopy(self._hparams())

    def outside_positions(self) -> list[int]:
        """The positions (in the template's order) of its parameters that are not on any stage."""
        flat = [loc for layout in self._layout for loc in layout]
        return [position for position, loc in enumerate(flat) if loc is None]
