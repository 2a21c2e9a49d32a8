"""Core errors <-> gRPC statuses, both directions in one place (no try/except per method:
CONTRIBUTING.md, house style).

Out: `status_of` turns a core error into its status and message; `@rpc_errors` wraps a grpc.aio
handler (a coroutine or an async generator) and aborts the call with it. An INVALID_ARGUMENT's
message is "field: message", naming the field at fault.
In: `code_of` reads a status code carried as a number (RequestNews.error_code, the public
RequestError.code), `split_details` the field of an INVALID_ARGUMENT's message (both defined in
pagedserve/status.py, which the public client imports without any server module), `core_error`
turns a status back into the core error that maps to it (the frontend's side of the scheduler),
`scheduler_lost` tells a scheduler that went away from one that refused, and `worker_forgot` a
worker that lost a sequence (FAILED_PRECONDITION) from one that failed. The frontend and the
scheduler classify the statuses they receive here, never by codes or phrases of their own.
"""
from __future__ import annotations

import functools
import inspect

import grpc
import structlog

from pagedserve.status import code_of, split_details
from services.core.errors import InvalidArgument, ResourceExhausted, Unavailable, UnknownSequence

log = structlog.get_logger("rpc")

STATUS_OF = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    UnknownSequence: grpc.StatusCode.FAILED_PRECONDITION,
}


# the way back: DEADLINE_EXCEEDED (the scheduler took too long) is as unavailable as UNAVAILABLE
CORE_ERROR_OF = {grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted, grpc.StatusCode.UNAVAILABLE: Unavailable,
                 grpc.StatusCode.DEADLINE_EXCEEDED: Unavailable}
LOST_CODES = (grpc.StatusCode.UNAVAILABLE,)  # the call's status when the scheduler (or the way to it) went away
# what gRPC itself (not the scheduler) says when a connection dies under a call, with INTERNAL or
# UNKNOWN: a scheduler killed mid-step ended calls with INTERNAL "Internal error from Core"
TRANSPORT_ERRORS = ("Internal error from Core", "Stream removed", "RST_STREAM", "Socket closed")
__all__ = ["code_of", "split_details", "status_of", "core_error", "scheduler_lost", "worker_forgot",
           "StatusError", "rpc_errors", "DecodeErrors"]


def status_of(error: Exception) -> tuple[grpc.StatusCode, str]:
    for kind, code in STATUS_OF.items():
        if isinstance(error, kind):
            if isinstance(error, InvalidArgument):
                return code, f"{error.field}: {error.message}"
            message = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
            return code, message
    return grpc.StatusCode.INTERNAL, f"{type(error).__name__}: {error}"


def scheduler_lost(code: grpc.StatusCode, details: str | None = None) -> bool:
    """Whether a status the scheduler's side ended with says the scheduler went away (UNAVAILABLE, or
    gRPC's own words for a connection that died under the call), not that it refused: its own
    errors name an exception type instead (status_of). Without `details` (a status the scheduler
    itself reported in a message) only the code counts."""
    return code in LOST_CODES or (details is not None and code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
                                  and any(phrase in details for phrase in TRANSPORT_ERRORS))


def worker_forgot(code: grpc.StatusCode) -> bool:
    """Whether a worker's status says it does not hold a sequence it was sent (UnknownSequence's
    status: worker.proto asks for a re-send in full), rather than that the worker failed."""
    return code == STATUS_OF[UnknownSequence]


def not_served(code: grpc.StatusCode) -> bool:
    """Whether a peer answered that it does not serve the method called (an older release's server)."""
    return code == grpc.StatusCode.UNIMPLEMENTED


class StatusError(RuntimeError):
    """A status with no core error of its own (INTERNAL: a step failed), as core_error returns it."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code = code


def core_error(code: grpc.StatusCode, details: str | None, source: str) -> Exception:
    """A status `source` (e.g. "scheduler") answered, as the core error that maps back to it;
    StatusError for a status no core error maps to."""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidArgument(*split_details(details))
    kind = CORE_ERROR_OF.get(code)
    if kind is None:
        return StatusError(code, f"{source}: {details or code.name}")
    return kind(f"{source}: {details or code.name}")


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


class _Undecodable:
    """What a request's bytes became when they are not the method's message."""

    def __init__(self, error: Exception):
        self.error = error


def _tolerant(deserialize):
    def parse(data: bytes):
        try:
            return deserialize(data)
        except Exception as error:  # noqa: BLE001 - protobuf's DecodeError, or whatever a parser raises
            return _Undecodable(error)
    return parse


def _undecodable_message(request: _Undecodable) -> str:
    return f"the request is not a valid protobuf message of this method: {request.error}"


class DecodeErrors(grpc.aio.ServerInterceptor):
    """A request whose bytes do not parse as the method's message gets INVALID_ARGUMENT (grpc's own
    answer is INTERNAL or UNKNOWN, a server fault it is not). Parsing happens where it always did;
    only its failure is carried to the handler, which then never runs."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        name = ("stream_" if handler.request_streaming else "unary_") + \
            ("stream" if handler.response_streaming else "unary")
        checking = _checking_stream if handler.request_streaming else _checking_unary
        return handler._replace(request_deserializer=_tolerant(handler.request_deserializer),
                                **{name: checking(getattr(handler, name))})


def _checking_unary(behavior):
    """The handler, called only with a request that parsed (grpc.aio tells a response stream
    from a single response by the handler's kind, so the wrapper is of the same kind)."""
    if inspect.isasyncgenfunction(behavior):
        async def stream(request, context):
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _undecodable_message(request))
            async for response in behavior(request, context):
                yield response
        return stream

    async def unary(request, context):
        if isinstance(request, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _undecodable_message(request))
        return await behavior(request, context)
    return unary


def _checking_stream(behavior):
    """The handler over the requests that parse; the first that does not ends the call with
    INVALID_ARGUMENT (raised where the handler reads it, so services.rpc.status maps it)."""
    async def checked(request_iterator):
        async for request in request_iterator:
            if isinstance(request, _Undecodable):
                raise InvalidArgument("request", _undecodable_message(request))
            yield request

    if inspect.isasyncgenfunction(behavior):
        async def stream(request_iterator, context):
            async for response in behavior(checked(request_iterator), context):
                yield response
        return stream

    async def unary(request_iterator, context):
        return await behavior(checked(request_iterator), context)
    return unary
