"""Every HTTP error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

| status | when                                   | type                   | code               |
|--------|----------------------------------------|------------------------|--------------------|
| 400    | a parameter is invalid (param names it)| invalid_request_error  | invalid_parameter  |
| 401    | missing or wrong API key               | invalid_request_error  | invalid_api_key    |
| 404    | unknown model (param "model"), route or stored response | invalid_request_error | model_not_found / not_found |
| 405    | a route's wrong method; with Allow     | invalid_request_error  | method_not_allowed |
| 413    | body over the configured limit         | invalid_request_error  | request_too_large  |
| 429    | queue full (RESOURCE_EXHAUSTED); with Retry-After | rate_limit_error | queue_full      |
| 503    | no worker ready, or shutting down      | service_unavailable    | unavailable        |
| 500    | a bug                                  | internal_error         | internal_error     |

Under /v1/messages (the Anthropic Messages API) the same errors come in Anthropic's shape:
{"type": "error", "error": {"type": ANTHROPIC_TYPES[status], "message"}}.
"""
from __future__ import annotations

import json

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from services.core.errors import InvalidArgument, ResourceExhausted, Unavailable
from services.frontend.types import ResponseNotFound, UnknownModel

log = structlog.get_logger("http")
PYDANTIC_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict"}  # union members in an error's loc
RETRY_AFTER_S = 1  # a full queue drains in about a step; the client should come back soon


ANTHROPIC_PATHS = ("/v1/messages",)
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                   503: "overloaded_error"}


def anthropic_error_body(status: int, message: str) -> bytes:
    return json.dumps({"type": "error", "error": {"type": ANTHROPIC_TYPES.get(status, "api_error"),
                                                  "message": message}}).encode()


def in_anthropic_shape(path: str) -> bool:
    return path.startswith(ANTHROPIC_PATHS)


def error_body(message: str, type_: str, code: str | None, param: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}}).encode()


def error_response(status: int, message: str, type_: str, code: str | None, param: str | None = None) -> JSONResponse:
    return JSONResponse(json.loads(error_body(message, type_, code, param)), status_code=status)


def install_error_handlers(app: FastAPI) -> None:
    handlers = {InvalidArgument: _invalid_argument, RequestValidationError: _validation_error,
                ResourceExhausted: _resource_exhausted,
                Unavailable: lambda request, error: error_response(503, str(error), "service_unavailable", "unavailable"),
                HTTPException: _http_exception,
                Exception: _internal_error}
    for kind, handler in handlers.items():
        app.add_exception_handler(kind, _in_the_callers_shape(handler))


def _in_the_callers_shape(handler):
    """OpenAI's error shape, or Anthropic's under its paths (same status, headers and message)."""
    def handle(request: Request, error: Exception) -> JSONResponse:
        response = handler(request, error)
        if not in_anthropic_shape(request.url.path):
            return response
        message = json.loads(response.body)["error"]["message"]
        headers = {k: v for k, v in response.headers.items() if k in ("retry-after", "allow")}
        return JSONResponse(json.loads(anthropic_error_body(response.status_code, message)),
                            status_code=response.status_code, headers=headers)
    return handle


def _http_exception(request: Request, error: HTTPException) -> JSONResponse:
    """Starlette's own errors (404 no route, 405 wrong method), keeping their headers: a 405's Allow."""
    code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
    response = error_response(error.status_code, str(error.detail), "invalid_request_error", code)
    response.headers.update(error.headers or {})
    return response


def _resource_exhausted(request: Request, error: ResourceExhausted) -> JSONResponse:
    response = error_response(429, str(error), "rate_limit_error", "queue_full")
    response.headers["retry-after"] = str(RETRY_AFTER_S)
    return response


def _invalid_argument(request: Request, error: InvalidArgument) -> JSONResponse:
    if isinstance(error, UnknownModel):
        return error_response(404, str(error), "invalid_request_error", "model_not_found", "model")
    if isinstance(error, ResponseNotFound):
        return error_response(404, str(error), "invalid_request_error", "not_found")
    return error_response(400, str(error), "invalid_request_error", "invalid_parameter", error.field)


def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    """pydantic's most telling error, with its location as the parameter name (`messages[0].role`)."""
    first = min(error.errors(), key=_relevance)
    if first["type"] == "json_invalid":
        return error_response(400, f"the body is not valid JSON: {first['msg']}", "invalid_request_error",
                              "invalid_parameter")
    param = _param(first["loc"][1:] if first["loc"][:1] == ("body",) else first["loc"])
    message = f"{param}: {first['msg']}" if param else first["msg"]
    return error_response(400, message, "invalid_request_error", "invalid_parameter", param)


def _relevance(error: dict) -> tuple[bool, int]:
    """Of the errors of a union's members, the one about the value (a lone surrogate, a range)
    tells more than "not a string"; then the one that got deepest into the value."""
    return error["type"].endswith(("_type", "_parsing")), -len(error["loc"])


def _param(loc: tuple) -> str | None:
    if "[key]" in loc:  # a dict's key failed: the dict is the parameter, the bad key is in the message
        loc = loc[:loc.index("[key]") - 1]
    name = ""
    for part in loc:
        if isinstance(part, int):
            name += f"[{part}]"
        elif part in PYDANTIC_TYPE_TAGS or not part.isidentifier():
            continue  # which union member or validator failed: not part of the parameter's name
        else:
            name += f".{part}" if name else part
    return name or None


def _internal_error(request: Request, error: Exception) -> JSONResponse:
    log.error("http_internal_error", path=request.url.path, exc_info=error)
    return error_response(500, f"{type(error).__name__}: {error}", "internal_error", "internal_error")
