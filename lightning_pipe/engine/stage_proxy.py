"""`StageProxy`: the coordinator's side of the stage protocol: `StageProtocol`'s methods on every rank.

A call names the method itself (``stages.call(StageProtocol.grad_norm, 2.0)``), so a type checker
checks its arguments and its result, and go-to-definition lands on the method the worker runs;
the wire carries the method's name. `call` waits for every rank's result; `post` sends and goes on
(a rank runs what it was sent in order; a failure is raised at the coordinator's next wait).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

from lightning_pipe.engine.stage_protocol import StageProtocol

if TYPE_CHECKING:
    from lightning_pipe.engine.coordinator_link import CoordinatorLink

P = ParamSpec("P")
R = TypeVar("R")
Method = Callable[Concatenate[StageProtocol, P], R]


class StageProxy:
    """Every rank's `StageProtocol`, reached over the coordinator's link."""

    def __init__(self, link: CoordinatorLink) -> None:
        self._link = link

    def call(self, method: Method[P, R], *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """Run ``method(*args)`` on every rank; their results in rank order."""
        name = _name(method)
        return self._link.call(name, *_positional(method, args, kwargs))

    def call_each(self, method: Callable[..., R], per_rank: Sequence[tuple[Any, ...]], *args: Any) -> list[R]:
        """Run ``method(*args, *per_rank[r])`` on each rank ``r``: what only that rank needs."""
        name = _name(method)
        return self._link.call(name, *args, each=per_rank)

    def post(self, method: Method[P, Any], *args: P.args, **kwargs: P.kwargs) -> None:
        """Send ``method(*args)`` to every rank without waiting for it (see `CoordinatorLink.post`)."""
        name = _name(method)
        self._link.post(name, *_positional(method, args, kwargs))

    def post_each(self, method: Callable[..., Any], per_rank: Sequence[tuple[Any, ...]], *args: Any) -> None:
        """Send ``method(*args, *per_rank[r])`` to each rank ``r`` without waiting for it."""
        name = _name(method)
        self._link.post(name, *args, each=per_rank)

    def ping(self) -> list[int]:
        """Every rank's number, once it ran everything sent to it before."""
        return self.call(StageProtocol.ping)


def _name(method: Callable[..., Any]) -> str:
    name = method.__name__
    if getattr(StageProtocol, name, None) is not method:
        raise TypeError(f"{method!r} is not a control call of StageProtocol")
    return name


def _positional(method: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The call's arguments in order (the wire carries positional arguments only)."""
    if not kwargs:
        return args
    bound = inspect.signature(method).bind(None, *args, **kwargs)
    return tuple(bound.args[1:])
