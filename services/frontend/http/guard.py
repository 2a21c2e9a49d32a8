"""The ASGI layer in front of every route: API key (Authorization: Bearer, or x-api-key), body-size
limit, one log line per request. Refusals under /v1/messages are in Anthropic's error shape.

Both checks run before FastAPI reads or parses anything: a wrong key is refused from the
headers alone, and a body is read in full (up to the limit) before it is parsed.
"""
from __future__ import annotations

import hmac
import time

import structlog

from services.frontend.http.errors import anthropic_error_body, error_body, in_anthropic_shape

log = structlog.get_logger("http")
OPEN_PATHS = ("/health",)  # no API key needed


class Guard:
    def __init__(self, app, api_key: str, max_body_bytes: int):
        self.app = app
        self.api_key = api_key.encode()  # empty: no key needed
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, status = time.monotonic(), [0]

        async def send_and_note(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self._guarded(scope, receive, send_and_note)
        finally:
            log.info("http_request", method=scope["method"], path=scope["path"], status=status[0],
                     request_id=scope.get("state", {}).get("request_id"), seconds=round(time.monotonic() - started, 4))

    async def _guarded(self, scope, receive, send) -> None:
        anthropic = in_anthropic_shape(scope["path"])
        if self.api_key and scope["path"] not in OPEN_PATHS and not self._authorized(scope):
            message = "Incorrect or missing API key (Authorization: Bearer KEY, or x-api-key: KEY)"
            return await _refuse(send, 401, anthropic_error_body(401, message) if anthropic else
                                 error_body(message, "invalid_request_error", "invalid_api_key"))
        if scope["method"] in ("POST", "PUT", "PATCH"):
            body = await self._read_body(scope, receive)
            if body is None:
                message = f"the request body is over the limit of {self.max_body_bytes} bytes"
                return await _refuse(send, 413, anthropic_error_body(413, message) if anthropic else
                                     error_body(message, "invalid_request_error", "request_too_large"))
            receive = _replay(body, receive)
        await self.app(scope, receive, send)

    def _authorized(self, scope) -> bool:
        """Authorization: Bearer KEY (OpenAI's clients), or x-api-key: KEY (Anthropic's)."""
        headers = dict(scope["headers"])
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key):
            return True
        return hmac.compare_digest(headers.get(b"x-api-key", b"").strip(), self.api_key)

    async def _read_body(self, scope, receive) -> bytes | None:
        """The whole body, or None as soon as it is known to be over the limit."""
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return None
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                return None
            more = message.get("more_body", False)
        return b"".join(chunks)


def _replay(body: bytes, receive):
    """A receive that gives the body read already, then passes on (to see a disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed():
        return pending.pop() if pending else await receive()
    return replayed


async def _refuse(send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
