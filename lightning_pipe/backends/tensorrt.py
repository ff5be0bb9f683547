"""The tensorrt stage backend: torch-tensorrt engines for inference and frozen stages.

torch-tensorrt is an optional extra (``pip install lightning_pipe[tensorrt]``), imported lazily by
the checker. TensorRT engines have no backward and hold a copy of the weights, so the checker
declines a stage that trains, whose inputs need gradients, or that is not on a CUDA device; an
engine is rebuilt when its input signature or the stage's weights change.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from typing import Any

import torch

from lightning_pipe.backends.base import BackendUnavailableError, StageContext
from lightning_pipe.backends.compilers import EagerCompiler
from lightning_pipe.backends.meta import TensorMeta, signature
from lightning_pipe.base import tree


@functools.cache
def import_torch_tensorrt() -> tuple[Any, str | None]:
    """``(torch_tensorrt, None)``, or ``(None, reason)`` when it cannot be imported (cached)."""
    try:
        import torch_tensorrt
    # without the TensorRT libraries the import raises a plain Exception, not ImportError
    except Exception as exc:
        reason = (
            f"torch_tensorrt cannot be imported ({type(exc).__name__}: {str(exc).strip() or 'no message'}); "
            "install the extra on a CUDA machine: pip install lightning_pipe[tensorrt]"
        )
        return None, reason
    return torch_tensorrt, None


class TensorRTCompiler(EagerCompiler):
    """Compiles the stage with ``torch_tensorrt.compile(ir="dynamo")`` per input signature.

    ``options`` go to ``torch_tensorrt.compile`` (``min_block_size``, ``torch_executed_ops``, ...).
    Op substitutions of the chain do not apply inside an engine.
    """

    always_accepts = False

    def check(self, inputs: Any, ctx: StageContext) -> str | None:
        _, reason = import_torch_tensorrt()
        if reason is not None:
            return reason
        metas = [m for m in tree.flatten(inputs)[0] if isinstance(m, TensorMeta)]
        off_cuda = sorted({str(m.device) for m in metas if m.device.type != "cuda"})
        if ctx.device.type != "cuda" or off_cuda:
            where = ", ".join(off_cuda) or str(ctx.device)
            return f"TensorRT runs on CUDA devices; stage {ctx.stage} runs on {where}"
        if ctx.mode == "train" and ctx.trainable:
            return (
                f"TensorRT engines have no backward and bake in the weights; stage {ctx.stage} has "
                f"{ctx.trainable} trainable parameters (freeze them to use tensorrt while training)"
            )
        if ctx.grad_enabled and any(m.requires_grad for m in metas):
            return f"TensorRT engines have no backward; stage {ctx.stage}'s inputs need gradients"
        return None

    def build(self) -> Callable[..., Any]:
        engines: dict[Hashable, tuple[Hashable, Any]] = {}  # input signature -> (weight versions, engine)
        module, options = self.module, {"ir": "dynamo", "min_block_size": 1} | self.options

        def run(*args: Any) -> Any:
            key = (signature(args), module.training)
            versions = tuple(p._version for p in module.parameters())  # bumped by in-place updates
            cached = engines.get(key)
            if cached is None or cached[0] != versions:
                trt, _ = import_torch_tensorrt()
                try:
                    engine = trt.compile(module, arg_inputs=list(args), **options)
                except Exception as exc:
                    raise BackendUnavailableError(
                        f"torch_tensorrt.compile failed: {type(exc).__name__}: {exc}"
                    ) from exc
                cached = engines[key] = (versions, engine)
            with torch.no_grad():
                return cached[1](*args)

        return run
