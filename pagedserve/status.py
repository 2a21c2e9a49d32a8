"""What a status carried on the public API means, for any client: the two readers the public client
(pagedserve/client.py) shares with the servers (services/rpc/status.py imports them from here and does
the rest of the decoding), so a client imports no server module.
"""
from __future__ import annotations

import grpc

_CODE_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


def code_of(value: int) -> grpc.StatusCode:
    """A status code carried as its number in a message (UNKNOWN for a number gRPC lacks)."""
    return _CODE_BY_VALUE.get(value, grpc.StatusCode.UNKNOWN)


def split_details(details: str | None) -> tuple[str, str]:
    """An INVALID_ARGUMENT's "field: message" as (field, message)."""
    field, _, message = (details or "").partition(": ")
    return field, message
