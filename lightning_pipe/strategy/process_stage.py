"""`ProcessStage`: in launched mode, this process's part of the model, and nothing more.

Every process of a launched run has its own copy of the LightningModule: the user's script built it,
eagerly or on the meta device. The coordinator cuts the pipelined module and sends each process the spec
of its stage as shapes only (`P2PCommunicator(send_values=False)`). Here the stage is bound to this
process's own modules (`adopt`, before the stage worker is built), so it trains the very tensors of this
process's LightningModule. With FSDP the stage is sharded over its replicas right there, while it is still on
meta (``fully_shard``), so the worker makes real only this process's shard of each parameter (from the
checkpoint, the weights, or the seed: `lightning_pipe.base.dtensor_shards`); with DDP the worker makes the
whole stage real and it is replicated over its replicas after. Everything else of this process's copy goes to
the meta device (`release`). After a fit each process's LightningModule holds its
own stage's trained tensors, as FSDP's and ModelParallelStrategy's sharded modules do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_pipe.base.errors import ConfigurationError
from lightning_pipe.engine.fsdp_deferral import ShardUnit, deferred, unavailable
from lightning_pipe.engine.stage_shards import StageShards
from lightning_pipe.strategy.arguments import FSDP_ARGUMENT, SELF_SHARDED
from lightning_pipe.strategy.patch import patch
from lightning_pipe.strategy.tensor_parallel import refuse_self_sharded
from lightning_pipe.weights import adopt, free_to_meta

DATA_PARALLEL = ("ddp", "fsdp")
#: where a pipelined module holds the stage modules a run in this process sharded with FSDP, by stage index (torch
#: cannot undo ``fully_shard``: a later run of the module, under this strategy or another, whose cut gives this process
#: the same stage runs those again, `reuse`). In the module's ``__dict__``, not a submodule (its state dict and modules
#: are as they were): the stages go with the module, in the same collection (a registry beside it kept them for a
#: collection more, alive into the next run: 0.44 of a later run's state against 0.28)
SHARDED_BEFORE = "_lightning_pipe_sharded_stages"


def sharded_before(pipelined: nn.Module | None) -> dict[int, nn.Module]:
    """The stage modules an earlier run in this process sharded with FSDP that ``pipelined`` holds, by stage index."""
    return {} if pipelined is None else pipelined.__dict__.get(SHARDED_BEFORE, {})


class ProcessStage:
    """Binds the stages built in this process to its LightningModule and frees the rest of it.

    ``data_parallel`` (``"ddp"`` or ``"fsdp"``) says how a stage is spread over its replicas; the launched
    world gives the groups (`replicate_over`). The strategy says which modules are this process's
    (`bind`), before a pipeline is built. A ``configure_model`` that calls ``fully_shard`` itself runs inside
    `deferring`: each stage is then sharded with the units it holds, whatever ``data_parallel`` says
    (`lightning_pipe.engine.fsdp_deferral`; one replica: nothing to shard over, each stage held whole).
    """

    def __init__(self, data_parallel: str = "ddp", mixed_precision: Callable[[], Any] | None = None) -> None:
        self.data_parallel = data_parallel
        self.mixed_precision = mixed_precision  # FSDP's policy for the Trainer's precision, asked when sharding
        self.lightning_module: nn.Module | None = None
        self.pipelined: nn.Module | None = None
        self.kept: list[torch.Tensor] = []  # the tensors of the stages built in this process
        #: the last stage worker built here: after its fit it still holds this process's stage optimizer, which a
        #: checkpoint written after the fit saves
        self.worker: Any = None
        self._group: Any = None  # the replicas of this process's stage (DDP's group)
        self._mesh: Any = None  # the same as a 1-D device mesh (FSDP's)
        self._shards: StageShards | None = None  # FSDP: the stage being built, sharded before it has values
        self.units: list[ShardUnit] | None = None  # configure_model's own fully_shard calls (None: it made none)
        self._said = False  # that the module shards itself is said once
        self._refused: ConfigurationError | None = None  # why a serving process's module cannot be cut (`bind`)

    @property
    def sharded(self) -> str | None:
        """What shards this process's stages with FSDP over their replicas: ``data_parallel="fsdp"`` (`FSDP_ARGUMENT`)
        or ``configure_model``'s own ``fully_shard`` calls (`SELF_SHARDED`: `units`, known once it ran), where there is
        a second replica to shard over (`replicate_over`); None: nothing. What every check of what FSDP stages cannot
        do asks (`lightning_pipe.strategy.arguments.check_sharded_stages`: one file, split backwards)."""
        if self._group is None:
            return None
        return FSDP_ARGUMENT if self.data_parallel == "fsdp" else SELF_SHARDED if self.units is not None else None

    @contextmanager
    def deferring(self, mesh: Any) -> Iterator[None]:
        """While ``configure_model`` runs: its ``fully_shard`` calls recorded in `units` (``mesh``: launched mode's
        device mesh, whose ``"data_parallel"`` dimension each call must shard over; None: no mesh, no deferral)."""
        if mesh is None:
            yield
            return
        with deferred(_over(mesh["data_parallel"])) as units:
            yield
        if units:  # an idempotent configure_model called again records nothing: the units stay
            self.units = units
            if not self._said:
                self._said = True
                rank_zero_info(_sharding_itself(mesh["data_parallel"].size()))

    def bind(self, lightning_module: nn.Module, pipelined: nn.Module, serving: bool = False) -> None:
        """This process's LightningModule and its pipelined module (what a stage sent here binds to). A module that
        cannot be cut is refused; in a process that serves a stage (``serving``) when a stage is built here: its
        coordinator refuses the same at setup and releases it with that error (raised here, the release would stay
        unread, for the next fit's serving to find)."""
        self._refused = None
        try:
            refuse_self_sharded(pipelined, unavailable(), ours=_held(sharded_before(pipelined)))
        except ConfigurationError as error:
            if not serving:
                raise
            self._refused = error
        self.lightning_module, self.pipelined = lightning_module, pipelined

    def replicate_over(self, group: Any, mesh: Any) -> None:
        """The stage's replicas: ``group`` (a process group) and ``mesh`` (the same as a device mesh); None: one."""
        self._group, self._mesh = group, mesh

    # the hooks of the point-to-point transport (`lightning_pipe.comm.p2p`)
    def prepare(self, spec: Any) -> None:
        """Before a stage worker is built here: its shards hold this process's own modules and tensors."""
        if self.pipelined is None:
            raise RuntimeError("ProcessStage.bind gives the pipelined module before a stage is built")
        if self._refused is not None:
            raise self._refused
        self.kept = []
        self._shards = None
        for shard in spec.shards:
            adopt(shard.module, self.pipelined)
        # an earlier run here sharded these stages: they run as they are
        earlier = reuse(spec.shards, sharded_before(self.pipelined))
        if self.sharded is not None or earlier:  # shard first: the worker makes shards real
            fresh = {s.index: s.module for s in spec.shards if s.index not in earlier} if self.sharded else {}
            policy = self.mixed_precision() if self.mixed_precision is not None and fresh else None
            self._shards = StageShards(fresh, self._mesh, policy, self.units, earlier=earlier)

    def built(self, worker: Any) -> None:
        """After: spread over the replicas, and remember what it holds (`release` keeps that)."""
        if self._shards is not None:
            worker.sharded(self._shards)
            assert self.pipelined is not None  # `prepare` ran
            self.pipelined.__dict__[SHARDED_BEFORE] = dict(self._shards.modules)
            self._shards = None
        elif self._group is not None:
            worker.replicate(self._group)
        self.kept = [t for shard in worker.shards.values() for t in _tensors(shard.module)]
        self.worker = worker

    def release(self, keep: Iterable[torch.Tensor] = ()) -> dict[int, torch.Tensor]:
        """Put everything of this process's LightningModule but its stage (and ``keep``) on meta.

        Returns each freed tensor's meta replacement by the id of the tensor it replaced (an optimizer
        built over the whole module swaps them in: `swap_parameters`).
        """
        if self.lightning_module is None:
            return {}
        return free_to_meta(self.lightning_module, [*self.kept, *keep])


def reuse(shards: list[Any], before: dict[int, nn.Module]) -> dict[int, nn.Module]:
    """The stage modules an earlier run here sharded with FSDP (``before``, by stage index) that ``shards`` (a later
    run's stages, bound to this process's modules) hold again, each put in its shard's place: FSDP's units and their
    shards are the earlier ones (torch has no call that undoes ``fully_shard``, and none is needed: the same stage
    runs again). A stage cut otherwise than before (another layout, another partition) over modules FSDP sharded is
    refused, naming the fix."""
    if not before:
        return {}
    reused: dict[int, nn.Module] = {}
    ours = _held(before)
    for shard in shards:
        earlier = before.get(shard.index)
        if earlier is not None and _same_stage(shard.module, earlier):
            shard.module = reused[shard.index] = earlier
        elif any(id(m) in ours for m in shard.module.modules()):
            raise ConfigurationError(_cut_anew(shard.index))
    return reused


def _held(before: dict[int, nn.Module]) -> set[int]:
    """The ids of the modules the stages an earlier run here sharded hold (``before``: their roots)."""
    return {id(m) for root in before.values() for m in root.modules()}


def _same_stage(cut: nn.Module, earlier: nn.Module) -> bool:
    """Whether ``cut`` (a later run's stage module) holds the very modules and tensors ``earlier`` held, by name."""
    mine = dict(cut.named_modules(remove_duplicate=False))
    theirs = dict(earlier.named_modules(remove_duplicate=False))
    if mine.keys() != theirs.keys() or any(mine[k] is not theirs[k] for k in mine if k):
        return False
    return [id(t) for t in (*cut.parameters(), *cut.buffers())] == [
        id(t) for t in (*earlier.parameters(), *earlier.buffers())
    ]


def _cut_anew(index: int) -> str:
    return (
        f"stage {index} of this run holds modules an earlier fit, validate, test or predict in this process sharded "
        "with FSDP over their replicas as part of another stage (data_parallel='fsdp', or configure_model's "
        "fully_shard), which torch cannot undo: a later run of the same module runs with the same stages (the same "
        "PipeStrategy stages, partition and number of processes). Otherwise save the fit "
        "(trainer.save_checkpoint(path), in every process) and give the later run a new LightningModule with it, e.g. "
        "trainer.validate(MyModule(), dataloader, ckpt_path=path)"
    )


def _over(data: Any) -> Callable[[dict[str, Any]], None]:
    """The check of a recorded ``fully_shard`` call's arguments: its mesh is ``data``, the stage's replicas."""

    def check(kwargs: dict[str, Any]) -> None:
        mesh = kwargs.get("mesh")
        if mesh is None or mesh != data:
            given = "no mesh (torch's default: every process)" if mesh is None else f"mesh={_describe(mesh)}"
            raise ConfigurationError(
                f"configure_model called fully_shard with {given}: under PipeStrategy each stage is sharded over its "
                f'replicas; pass mesh=self.device_mesh["data_parallel"] (here {_describe(data)})'
            )

    return check


def _describe(mesh: Any) -> str:
    names = getattr(mesh, "mesh_dim_names", None)
    return f"a DeviceMesh{tuple(mesh.shape)} over {names}" if hasattr(mesh, "shape") else repr(mesh)


def _sharding_itself(replicas: int) -> str:
    if replicas == 1:
        return (
            "configure_model sharded the model with fully_shard over one replica: nothing to shard, so PipeStrategy "
            "holds each stage whole in its process"
        )
    return (
        "configure_model sharded the model with fully_shard: PipeStrategy shards each stage over its "
        f"{replicas} replicas with the units it holds (as data_parallel='fsdp'; a unit over several stages, as the "
        "whole model, becomes each stage's root)"
    )


def swap_parameters(optimizer: torch.optim.Optimizer, stage_parameters: dict[int, str]) -> None:
    """Give ``optimizer`` meta stand-ins for the stages' parameters (``stage_parameters``: their ids): it then
    keeps none of their tensors alive and never steps them (the stages step their own)."""
    for group in optimizer.param_groups:
        group["params"] = [_stand_in(p) if id(p) in stage_parameters else p for p in group["params"]]


def _stand_in(param: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]


@contextmanager
def moving_own_to_cpu(module: nn.Module | None) -> Iterator[None]:
    """Lightning's teardown moves the module to the CPU with ``module.cpu()``, which cannot copy the meta tensors of
    the stages this process does not hold: while in here, ``module.cpu()`` moves what it has (`own_to_cpu`)."""
    if module is None:
        yield
        return
    restore = patch(module, "cpu", lambda: own_to_cpu(module))
    try:
        yield
    finally:
        restore()


def own_to_cpu(module: nn.Module) -> nn.Module:
    """``module.cpu()`` for the tensors that have values (meta ones stay; FSDP's shards stay where they are): what
    Lightning's teardown moves of a LightningModule that holds only this process's stage."""
    for owner in module.modules():
        for param in owner._parameters.values():
            if param is not None and param.device.type not in ("cpu", "meta") and type(param) is nn.Parameter:
                param.data = param.data.cpu()
        for name, buffer in owner._buffers.items():
            if buffer is not None and buffer.device.type not in ("cpu", "meta"):
                owner._buffers[name] = buffer.cpu()
    return module
