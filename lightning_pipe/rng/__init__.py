"""Per-stage random generators: stages draw from their own seeded streams, replayable and checkpointed."""

from lightning_pipe.rng.detect import random_calls, randomness
from lightning_pipe.rng.generators import RandomState, StageGenerators, derive_seed, replaying, run_seed
from lightning_pipe.rng.routing import RandomRouting, routing_active
from lightning_pipe.rng.stage_random import StageRandom

__all__ = [
    "RandomRouting",
    "RandomState",
    "StageGenerators",
    "StageRandom",
    "derive_seed",
    "random_calls",
    "randomness",
    "replaying",
    "routing_active",
    "run_seed",
]
