"""Partitioning: a model becomes shards placed on devices, each with its executor modules."""

from lightning_pipe.partition.balance import balance_by_cost
from lightning_pipe.partition.partitioner import METHODS, Partitioner, ShardedTask

__all__ = ["METHODS", "Partitioner", "ShardedTask", "balance_by_cost"]
