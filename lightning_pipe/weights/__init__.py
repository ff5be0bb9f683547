"""Where a stage's tensors come from and go to: sources, materialisation from meta, sharded checkpoints."""

from lightning_pipe.weights.materialize import Materialized, adopt, aliases_of, free_to_meta, materialize, on_meta
from lightning_pipe.weights.sources import (
    DcpSource,
    Prefixed,
    SafetensorsSource,
    TorchFileSource,
    WeightSource,
    is_distributed_checkpoint,
    open_source,
)
from lightning_pipe.weights.stage_init import StageInit, meta_copy

__all__ = [
    "DcpSource",
    "Materialized",
    "Prefixed",
    "SafetensorsSource",
    "StageInit",
    "TorchFileSource",
    "WeightSource",
    "adopt",
    "aliases_of",
    "free_to_meta",
    "is_distributed_checkpoint",
    "materialize",
    "meta_copy",
    "on_meta",
    "open_source",
]
