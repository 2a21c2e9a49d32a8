"""Errors the core raises. Each names the field at fault so every transport can map it."""


class InvalidArgument(ValueError):
    """A parameter a caller chose is out of range. `field` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class ResourceExhausted(RuntimeError):
    """The server is full (queue limit reached); the caller may retry later."""


class Unavailable(RuntimeError):
    """The server cannot take requests now (no worker registered, or shutting down)."""


class UnknownSequence(KeyError):
    """A step delta named a sequence the worker does not hold (docs/ARCHITECTURE.md rule 3)."""


# What a request can be refused with, as opposed to a bug: each transport passes these on to the
# client with their own status, and fails one request (not the call) with them.
REFUSALS = (InvalidArgument, ResourceExhausted, Unavailable)


def check(condition: bool, field: str, message: str) -> None:
    """Raise InvalidArgument(field, message) unless condition holds."""
    if not condition:
        raise InvalidArgument(field, message)
