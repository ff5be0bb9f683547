"""Checkpoint files: reading one a stage at a time, writing a sharded folder, resuming, a stage's part, consolidating.

Lightning-free and below the engine: the strategy's handlers (`lightning_pipe.strategy.checkpoints`,
`checkpoint_writer`, `rpc_checkpoints`) and the stage worker use it; it reads tensors through `lightning_pipe.weights`.
"""

from lightning_pipe.checkpoint.consolidate import consolidate
from lightning_pipe.checkpoint.reader import CheckpointReader, FileCheckpoint, ShardedCheckpoint, open_checkpoint
from lightning_pipe.checkpoint.resume import Resume

__all__ = ["CheckpointReader", "FileCheckpoint", "Resume", "ShardedCheckpoint", "consolidate", "open_checkpoint"]
