"""The transport registry: ``transport=`` names and the factories of their communicators."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_pipe.base.errors import ConfigurationError
from lightning_pipe.comm import Communicator, LocalCommunicator

TRANSPORTS: dict[str, Callable[..., Communicator]] = {"local": LocalCommunicator}


def register_transport(name: str, factory: Callable[..., Communicator]) -> None:
    """Make ``factory(**options)`` available as ``transport=name``."""
    TRANSPORTS[name] = factory


def _rpc(**options: Any) -> Communicator:
    from lightning_pipe.comm.rpc import RpcCommunicator

    return RpcCommunicator(**options)


register_transport("rpc", _rpc)


def resolve_transport(transport: str | Communicator, options: dict[str, Any]) -> Communicator:
    """The communicator for ``transport``: an instance as given, a name built by its factory with ``options``."""
    if isinstance(transport, Communicator):
        if options:
            raise ConfigurationError(
                f"transport options {sorted(options)} belong in the constructor of the communicator passed as transport"
            )
        return transport
    try:
        factory = TRANSPORTS[transport]
    except KeyError:
        known = ", ".join(sorted(TRANSPORTS))
        raise ConfigurationError(f"unknown transport {transport!r}; available: {known}") from None
    try:
        return factory(**options)
    except TypeError as exc:
        raise ConfigurationError(f"transport={transport!r} does not take these options: {exc}") from None
