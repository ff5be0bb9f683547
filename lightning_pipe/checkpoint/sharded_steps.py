"""A sharded checkpoint folder written by processes that share no process group: DCP's save, step by step.

Under ``transport="rpc"`` the coordinator carries DCP's plans over its control calls (DCP's public planner and
storage writer do the steps of its collective ``save``); the folder is `save_sharded`'s. Participant 0 leads::

    leader (the script's process)         each other participant (a stage worker)
    plan()                                 plan()        -> its local plan
    global_plan([own, *theirs])            <- plans, one each
    write(plans[0])                        write(plan)   -> its write results
    finish(metadata, [own, *theirs])
"""

from __future__ import annotations

from typing import Any

from lightning_pipe.weights.sources import PathLike


class FolderPart:
    """One process's part of the folder ``path``: ``state`` as `sharded.sharded_state` gives it."""

    def __init__(self, path: PathLike, state: dict[str, Any], index: int) -> None:
        from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter

        self.index = index
        self.state = state
        self.writer = FileSystemWriter(str(path))
        self.planner = DefaultSavePlanner()

    @property
    def leads(self) -> bool:
        return self.index == 0

    def plan(self) -> Any:
        """This part's local plan (DCP's ``SavePlan``: what it holds, by key)."""
        self.planner.set_up_planner(state_dict=self.state, storage_meta=self.writer.storage_meta(),
                                    is_coordinator=self.leads)  # fmt: skip
        self.writer.set_up_storage_writer(self.leads, rank=self.index, use_collectives=True)
        return self.writer.prepare_local_plan(self.planner.create_local_plan())

    def global_plan(self, plans: list[Any]) -> tuple[list[Any], Any]:
        """The leader: every part's plan (in participant order) made final, and the folder's metadata."""
        assert self.leads, "the participant numbered 0 makes the global plan"
        final, metadata = self.planner.create_global_plan(plans)
        return self.writer.prepare_global_plan(final), metadata

    def write(self, plan: Any) -> list[Any]:
        """Write this part's files as the global ``plan`` says; what it wrote (DCP's ``WriteResult`` list)."""
        writes = self.writer.write_data(self.planner.finish_plan(plan), self.planner)
        writes.wait()
        results: list[Any] = writes.value()
        self.state = {}  # the tensors are written: hold them no longer
        return results

    def finish(self, metadata: Any, results: list[list[Any]]) -> None:
        """The leader: the folder's ``.metadata``, from every part's write results (in participant order)."""
        self.writer.finish(metadata=metadata, results=results)
