"""Partitioning: a model becomes shards placed on devices, each with its executor modules."""

from lightning_pipe.partition.balance import balance_by_cost
from lightning_pipe.partition.partitioner import METHODS, Partitioner, ShardedTask
from lightning_pipe.partition.traced import TracedPartitioner
from lightning_pipe.partition.tracer import CallArgs, TraceError

__all__ = ["METHODS", "CallArgs", "Partitioner", "ShardedTask", "TraceError", "TracedPartitioner", "balance_by_cost"]
