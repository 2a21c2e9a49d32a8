"""The OpenAI-compatible HTTP API: a thin FastAPI layer over FrontendCore.generate, the
same path the gRPC servicer takes (validation, stop strings, metrics all happen there)."""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from services.core.errors import REFUSALS, Unavailable
from services.frontend.core import STATS_TIMEOUT_S, FrontendCore
from services.frontend.http import (lora_api, messages_api, openai_requests, pooling_api, responses_api, schemas,
                                   tokenize_api)
from services.frontend.http.errors import error_body, install_error_handlers
from services.frontend.http.guard import Guard
from services.frontend.http.models import ChatCompletionRequest, CompletionRequest
from services.frontend.http.tool_responses import ToolChatRenderer
from services.frontend.http.responses import ChatRenderer, CompletionRenderer, Renderer, collect, sse
from services.frontend.http.streams import merge, start
from services.frontend.response_store import ResponseStore
from services.frontend.types import GenerateRequest, ModelCard

DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks that its client is still there


def build_app(core: FrontendCore, is_ready: Callable[[], bool], api_key: str = "",
              max_body_bytes: int = 1 << 21, response_store: ResponseStore | None = None) -> Guard:
    app = FastAPI(title="pagedserve", summary="OpenAI-compatible API of the pagedserve frontend",
                  docs_url=None, redoc_url=None)
    install_error_handlers(app)
    schemas.describe(app, lambda: core.card)

    @app.get("/health", response_model=None, responses={
        200: {"model": schemas.Health, "description": "Ready."},
        503: {"model": schemas.Health, "description": "Not ready (no worker yet, or draining)."}})
    async def health() -> Response:
        """200 while the scheduler has a ready worker and the frontend is not draining, else 503."""
        ready = is_ready() and not core.draining
        return JSONResponse({"status": "ok" if ready else "unavailable"}, status_code=200 if ready else 503)

    @app.get("/metrics", response_model=None, responses={
        200: {"description": "Prometheus text format.", "content": {CONTENT_TYPE_LATEST.split(";")[0]: {
            "schema": {"type": "string"}}}}, **schemas.errors(401)})
    async def metrics() -> Response:
        try:
            stats = await core.scheduler.stats(timeout=STATS_TIMEOUT_S)
        except Unavailable:
            stats = None
        return Response(core.metrics.render(stats), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=schemas.ModelList, responses=schemas.errors(401, 503))
    async def models() -> dict:
        card = await core.model_card()  # the base, then its LoRA adapters (vLLM's parent / root)
        adapters = [{**_model_body(card), "id": name, "root": path, "parent": card.id} for name, path in core.loras.items()]
        return {"object": "list", "data": [_model_body(card), *adapters]}

    @app.get("/v1/models/{model_id:path}", response_model=schemas.Model, responses=schemas.errors(401, 404, 503))
    async def model(model_id: str) -> dict:
        """The served model or one of its LoRA adapters; 404 (model_not_found) for any other id."""
        card = await core.model_card()
        if core.check_model(model_id):
            return {**_model_body(card), "id": model_id, "root": core.loras[model_id], "parent": card.id}
        return _model_body(card)

    @app.post("/v1/completions", response_model=None, responses=schemas.completion_responses(schemas.Completion))
    async def completions(body: CompletionRequest, request: Request) -> Response:
        request_id = request.state.request_id = f"cmpl-{uuid.uuid4().hex}"
        requests = openai_requests.completion_requests(body, request_id)
        renderer = CompletionRenderer(
            id=request_id, model=core.served_name(body.model or ""), fingerprint=await _fingerprint(core),
            tokenizer=core.tokenizer, n=requests[0].params.n, prompt_logprobs=body.prompt_logprobs,
            top_k=body.logprobs, echoes=await openai_requests.echo_prompts(core, requests) if body.echo else None,
            score_only=body.max_tokens == 0)
        return await _respond(core, requests, renderer, body, body.logprobs is not None, request)

    @app.post("/v1/chat/completions", response_model=None,
              responses=schemas.completion_responses(schemas.ChatCompletion))
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        request_id = request.state.request_id = f"chatcmpl-{uuid.uuid4().hex}"
        generate_request, tool_plan = await openai_requests.chat_request(core, body, request_id)
        shared = dict(id=request_id, model=core.served_name(body.model or ""), fingerprint=await _fingerprint(core),
                      tokenizer=core.tokenizer, n=generate_request.params.n, prompt_logprobs=body.prompt_logprobs)
        plain = tool_plan.mode == "none" and tool_plan.thinking is None
        renderer = ChatRenderer(**shared) if plain else ToolChatRenderer(**shared, plan=tool_plan)
        return await _respond(core, [generate_request], renderer, body, body.logprobs, request)

    store = response_store if response_store is not None else ResponseStore()  # (an empty store is falsy)
    responses_api.add_routes(app, core, store, _unless_disconnected)
    messages_api.add_routes(app, core, _unless_disconnected)
    tokenize_api.add_routes(app, core)
    pooling_api.add_routes(app, core, _unless_disconnected)
    lora_api.add_routes(app, core)
    return Guard(app, api_key, max_body_bytes)


def _model_body(card: ModelCard) -> dict:
    return {"id": card.id, "object": "model", "created": int(time.time()), "owned_by": "pagedserve",
            "max_model_len": card.max_model_len}


async def _fingerprint(core: FrontendCore) -> str:
    """Names the deterministic mode: equal fingerprints and seeds give equal tokens."""
    card = await core.model_card()
    return "pagedserve-batch-invariant" if card.batch_invariant else "pagedserve-nondeterministic"


async def _respond(core: FrontendCore, requests: list[GenerateRequest], renderer: Renderer, body,
                   logprobs: bool, request: Request) -> Response:
    """Start every prompt's generation first, so a refusal is an error status, not a broken stream.
    A request waits for its first event while it is queued, so the disconnect watch starts before:
    a client that leaves a queued request, streamed or not, aborts it at once."""
    streams = await _unless_disconnected(request, start([core.generate(r) for r in requests]))
    if streams is None:
        return Response(status_code=499)
    events = merge(streams)
    if not body.stream:
        try:
            result = await _unless_disconnected(request, collect(renderer, events, len(requests), logprobs))
        finally:
            await events.aclose()  # a client that left: closing the streams aborts the generations
        return Response(status_code=499) if result is None else JSONResponse(result)
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    return StreamingResponse(_errors_as_events(sse(renderer, events, len(requests), include_usage, logprobs)),
                             media_type="text/event-stream", headers={"cache-control": "no-cache"})


async def _unless_disconnected(request: Request, work):
    """The work's result, or None once the client has gone away (the work is then cancelled).
    A streamed response notices a disconnect when it writes; a non-streamed one must look."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                return None
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def _errors_as_events(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """Once streaming has begun the status is sent: a later failure becomes an error event."""
    try:
        async for chunk in chunks:
            yield chunk
    except REFUSALS as error:
        yield f"data: {error_body(str(error), 'service_unavailable', 'unavailable').decode()}\n\n"
        yield "data: [DONE]\n\n"
