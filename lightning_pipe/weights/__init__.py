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

__all__ = [
    "DcpSource",
    "Materialized",
    "Prefixed",
    "SafetensorsSource",
    "TorchFileSource",
    "WeightSource",
    "adopt",
    "aliases_of",
    "free_to_meta",
    "is_distributed_checkpoint",
    "materialize",
    "on_meta",
    "open_source",
]
