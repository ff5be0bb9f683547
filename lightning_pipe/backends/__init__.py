"""Backends: how a shard's forward executes (eager, inductor, tensorrt) and which ops are substituted."""

from lightning_pipe.backends.base import Backend, BackendError, BackendUnavailableError, StageContext
from lightning_pipe.backends.compilers import EagerCompiler, InductorCompiler
from lightning_pipe.backends.config import BackendArg, BackendPlan, resolve_backends
from lightning_pipe.backends.executable import CoordinatorOps, StageExecutable, build_executables
from lightning_pipe.backends.meta import TensorMeta
from lightning_pipe.backends.registry import (
    available_backends,
    default_backends,
    get_backend,
    register_backend,
    substitute,
    unregister_backend,
)
from lightning_pipe.backends.tensorrt import TensorRTCompiler, import_torch_tensorrt
from lightning_pipe.backends.trace import ExecutionTrace, OpCounter, StageTrace

__all__ = [
    "Backend",
    "BackendArg",
    "BackendError",
    "BackendPlan",
    "BackendUnavailableError",
    "CoordinatorOps",
    "EagerCompiler",
    "ExecutionTrace",
    "InductorCompiler",
    "OpCounter",
    "StageContext",
    "StageExecutable",
    "StageTrace",
    "TensorMeta",
    "TensorRTCompiler",
    "available_backends",
    "build_executables",
    "default_backends",
    "get_backend",
    "import_torch_tensorrt",
    "register_backend",
    "resolve_backends",
    "substitute",
    "unregister_backend",
]
