"""Exceptions raised by lightning_pipe: each names what went wrong and how to fix it."""

from __future__ import annotations


class PipeError(RuntimeError):
    """Base class of every error raised by lightning_pipe."""


class ConfigurationError(PipeError, ValueError):
    """A `PipeStrategy` argument is invalid; raised before any work starts."""


class PartitionError(ConfigurationError):
    """The model cannot be split as asked (too many stages, a bad balance, an unknown module)."""


class ScheduleError(ConfigurationError):
    """A schedule is unknown or its action lists are invalid."""


class StageError(PipeError):
    """An action failed inside a stage; carries the stage, the microbatch and the stage's traceback."""

    def __init__(
        self,
        stage: int,
        microbatch: int | None,
        action: str | None,
        error: str,
        traceback: str = "",
        host: str | None = None,
    ) -> None:
        self.stage = stage
        self.microbatch = microbatch
        self.action = action
        self.error = error
        self.remote_traceback = traceback
        self.host = host
        where = f"stage {stage}"
        if host:
            where += f" on {host}"
        what = f" in action {action}" if action else ""
        mb = f" (microbatch {microbatch})" if microbatch is not None else ""
        message = f"{where} failed{what}{mb}: {error}"
        if traceback:
            message += f"\n--- traceback in {where} ---\n{traceback.rstrip()}"
        super().__init__(message)

    def __reduce__(self):  # type: ignore[no-untyped-def]
        args = (self.stage, self.microbatch, self.action, self.error, self.remote_traceback, self.host)
        return (type(self), args)


class PipeTimeoutError(PipeError, TimeoutError):
    """A wait across threads or processes ran past `PipeStrategy(timeout=...)`."""


class TransportError(PipeError):
    """A communicator could not deliver a message or lost a stage worker."""
