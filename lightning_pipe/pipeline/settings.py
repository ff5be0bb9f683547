"""`PipelineSettings`: the arguments a `Pipeline` and a `PipeStrategy` share, each defined once with its docstring.

A field here is a keyword of `Pipeline` and of `PipeStrategy` (`lightning_pipe.strategy.pipe_config.PipeConfig`
adds the strategy's own): both signatures are made from these dataclasses (`signature_of`), so adding an
argument is adding one field with its docstring. docs/usage.md's table lists the same names
(`tests/test_house_config.py` checks the three agree). torchtitan's ``JobConfig`` is the model.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_pipe.backends import BackendArg
from lightning_pipe.partition import Partitioner
from lightning_pipe.runtime import BaseRuntime


@dataclass(frozen=True)
class PipelineSettings:
    """How a model is split into stages and run: the arguments `Pipeline` and `PipeStrategy` share."""

    stages: int | None = None
    """Number of stages; under `PipeStrategy` default one per device (or one more than ``split_points``)."""
    schedule: Any = "1f1b"
    """``"gpipe"`` (all forwards, then losses, then backwards), ``"1f1b"``, ``"interleaved-1f1b"``,
    ``"zero-bubble"``, ``"looped-bfs"``, ``"interleaved-zero-bubble"``, ``"zbv"``, ``"dualpipev"`` (the last two with
    ``virtual_stages=2``), ``"async"`` (no flush between batches, each stage steps its own copy of the optimizer with
    weight stashing; transport ``"local"``; ``staleness`` reports what it measured), a `Schedule` subclass or a
    function returning per-rank action lists (docs/schedules.md). ``"auto"``: the first training step measures every
    stage, the second runs the registered schedule `simulate` predicts fastest
    (`lightning_pipe.pipeline.schedule_chooser`; the choice is logged as a table and kept in ``schedule_choice``)."""
    partition: str | Sequence[int] | Partitioner = "params"
    """``"uniform"``, ``"params"``, ``"memory"``, ``"time"``, layer counts such as ``[3, 5]``, or a `Partitioner`."""
    devices: Sequence[str | torch.device] | None = None
    """One device per stage; default: the Trainer's devices under `PipeStrategy`, else ``cpu`` for every stage."""
    checkpoint: Any = "auto"
    """Activation recomputation: ``"auto"`` (only the stages whose device lacks the memory for the planned
    activation peak; never on cpu; decided before the second training step of a fit and logged), ``"always"``,
    ``"except_last"`` or ``"never"``."""
    runtime: str | BaseRuntime | None = None
    """A registered device type or a `BaseRuntime` instance; default: by device type."""
    timeout: float = 300.0
    """Seconds any wait between the coordinator and the stages may take."""
    backend: BackendArg | Any = None
    """How stage forwards run: ``"eager"``, ``"inductor"``, ``"tensorrt"`` or a registered backend; a list gives one
    per stage, a tuple a fallback chain, a dict one per mode (``{"train": "inductor", "eval": "tensorrt"}``).
    See `lightning_pipe.backends`."""
    strict: bool = False
    """Raise instead of falling back (with a logged reason) when a requested backend cannot run a stage."""
    split_points: Sequence[str] | None = None
    """Names of submodules before which a new stage starts (``["blocks.2"]``). A pipelined module that is not an
    ``nn.Sequential`` is traced on its first call and cut there, or where ``partition`` balances it; its forward may
    take several positional and keyword arguments and return a tensor, tuple or dict. Without ``stages``, one stage
    more than split points."""
    virtual_stages: int = 1
    """Stages per worker (``interleaved-1f1b`` and the other chunked schedules): stage ``s`` runs on worker
    ``s % (stages // virtual_stages)``, or in a V (``zbv``, ``dualpipev``: stages ``r`` and ``2P - 1 - r`` on worker
    ``r``)."""
    runner: str = "parallel"
    """``"parallel"`` (a thread per worker, fixed order), ``"dataflow"`` (each worker runs whichever action is ready)
    or ``"linear"`` (one thread walks one global order)."""
    coordinator: str | None = None
    """With ``transport="rpc"``, ``"HOST:PORT"`` where workers on other machines join."""
    token: str | None = None
    """With ``transport="rpc"``, the secret workers must present (default ``$LIGHTNING_PIPE_TOKEN``)."""
    compress: Any = None
    """With ``transport="rpc"``, how activations and gradients cross between processes: ``None``, ``"bf16"`` /
    ``"fp16"`` (lossy casts), ``"zstd"`` (lossless, extra ``compress``), ``"bf16+zstd"``, ``"fp16+zstd"`` or a codec
    object (`lightning_pipe.comm.compress.Codec`)."""

    @property
    def transport_options(self) -> dict[str, Any]:
        """What the rpc transport is given: ``coordinator``, ``token`` and ``compress`` where set."""
        given = (("coordinator", self.coordinator), ("token", self.token), ("compress", self.compress))
        return {name: value for name, value in given if value is not None}

    @classmethod
    def names(cls) -> list[str]:
        """The fields' names, in order: the arguments these settings take."""
        return [f.name for f in dataclasses.fields(cls) if f.init]

    @classmethod
    def from_keywords(cls, owner: str, keywords: Mapping[str, Any]) -> Any:
        """The settings of ``keywords``; one that is no field raises ``TypeError`` as Python does, naming the
        closest field (``owner``: whose argument it was, e.g. ``"PipeStrategy"``)."""
        known = cls.names()
        for name in keywords:
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else "; the arguments: docs/usage.md"
                raise TypeError(f"{owner}() got an unexpected keyword argument {name!r}{hint}")
        return cls(**keywords)


def signature_of(
    settings: type[PipelineSettings],
    leading: Iterable[inspect.Parameter] = (),
    trailing: Iterable[inspect.Parameter] = (),
    positional: int = 1,
) -> inspect.Signature:
    """A constructor's signature made from ``settings``: ``leading`` parameters (``self``, a module), the first
    ``positional`` fields by position or keyword, the rest keyword-only with their defaults, then ``trailing``."""
    fields = [f for f in dataclasses.fields(settings) if f.init]
    made = [
        inspect.Parameter(
            f.name,
            inspect.Parameter.POSITIONAL_OR_KEYWORD if i < positional else inspect.Parameter.KEYWORD_ONLY,
            default=f.default if f.default is not dataclasses.MISSING else inspect.Parameter.empty,
            annotation=f.type,
        )
        for i, f in enumerate(fields)
    ]
    return inspect.Signature([*leading, *made, *trailing])


def keyword(name: str, default: Any = None) -> inspect.Parameter:
    """A keyword-only parameter of a made signature (``trailing``)."""
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default)
