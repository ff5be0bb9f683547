"""Memory: what a pipeline holds and gives back, one module per concept, each at the level it serves.

- `allocator`: the process's ``malloc`` gives big freed blocks back (rpc workers, the process starting them, launched
  mode's processes); `pages`: pages of a mapped file or a whole tensor given back (`lightning_pipe.weights`);
  `walk`: a rank's stashed bytes over its action list (`lightning_pipe.schedule.auto`, `recompute`, `plan`).
- `stash`: what a stage keeps between a microbatch's forward and its backward, measured; `stage`: `StageMemory`,
  a stage worker's stash meter and which of its stages recompute (both serve the engine).
- `recompute`: the ``checkpoint=`` modes and what ``checkpoint="auto"`` decides; `plan`: the static plan behind
  ``PipeStrategy.plan()`` (`plan.plan`, `plan.MemoryPlan`); both import the engine.

This package imports none of its modules (the engine imports `stash` and `stage`): each is imported by its path.
"""
