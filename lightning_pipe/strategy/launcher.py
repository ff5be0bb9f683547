"""`PipeLauncher`: Lightning's subprocess launcher, with the processes that do not coordinate serving their stage."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from typing_extensions import override


class PipeLauncher(_SubprocessScriptLauncher):
    """Lightning's subprocess launcher (a no-op spawn under torchrun or SLURM); serving ranks serve their stage.

    ``serve`` is what this process runs instead of the Trainer's function, given the Trainer: None where it
    coordinates.
    """

    def __init__(
        self, cluster_environment: Any, num_processes: int, num_nodes: int, serve: Callable[[Any], None] | None
    ) -> None:
        super().__init__(cluster_environment, num_processes, num_nodes)
        self.serve = serve

    @override
    def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        if self.serve is not None:
            return super().launch(self.serve, trainer)
        return super().launch(function, *args, trainer=trainer, **kwargs)
