"""Core errors -> gRPC statuses, in one place for every servicer (STYLE.md: no try/except per method).

`@rpc_errors` wraps a grpc.aio handler (a coroutine or an async generator) and aborts the
call with the status that matches the core error. The message names the field at fault.
"""
from __future__ import annotations

import functools
import inspect

import grpc
import structlog

from services.core.errors import InvalidArgument, ResourceExhausted, Unavailable, UnknownSequence

log = structlog.get_logger("rpc")

STATUS_OF = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    UnknownSequence: grpc.StatusCode.FAILED_PRECONDITION,
}


def status_of(error: Exception) -> tuple[grpc.StatusCode, str]:
    for kind, code in STATUS_OF.items():
        if isinstance(error, kind):
            message = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
            return code, message
    return grpc.StatusCode.INTERNAL, f"{type(error).__name__}: {error}"


async def _abort(context: grpc.aio.ServicerContext, method: str, error: Exception) -> None:
    code, message = status_of(error)
    if code is grpc.StatusCode.INTERNAL:
        log.exception("rpc_failed", method=method)
    await context.abort(code, message)


def rpc_errors(handler):
    """Map the core errors a handler raises to gRPC statuses (INTERNAL for anything else)."""
    name = handler.__name__
    if inspect.isasyncgenfunction(handler):
        @functools.wraps(handler)
        async def stream(self, request, context):
            try:
                async for response in handler(self, request, context):
                    yield response
            except Exception as error:  # noqa: BLE001 - the one place errors become statuses
                if isinstance(error, grpc.aio.AbortError):
                    raise
                await _abort(context, name, error)
        return stream

    @functools.wraps(handler)
    async def unary(self, request, context):
        try:
            return await handler(self, request, context)
        except Exception as error:  # noqa: BLE001 - the one place errors become statuses
            if isinstance(error, grpc.aio.AbortError):
                raise
            await _abort(context, name, error)
    return unary
