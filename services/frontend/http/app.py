"""The OpenAI-compatible HTTP API: a thin FastAPI layer over FrontendCore.generate, the
same path the gRPC servicer takes (validation, stop strings, metrics all happen there)."""
from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from services.core.errors import Unavailable
from services.frontend.core import STATS_TIMEOUT_S, FrontendCore
from services.frontend.http import (lora_api, messages_api, openai_requests, pooling_api, responses_api, schemas,
                                   tokenize_api)
from services.frontend.http.errors import install_error_handlers
from services.frontend.http.guard import Guard
from services.frontend.http.models import ChatCompletionRequest, CompletionRequest
from services.frontend.http.respond import respond
from services.frontend.http.tool_responses import ToolChatRenderer
from services.frontend.http.responses import ChatRenderer, CompletionRenderer
from services.frontend.response_store import ResponseStore
from services.frontend.types import ModelCard


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
            score_only=body.max_tokens == 0, num_prompts=len(requests), with_logprobs=body.logprobs is not None,
            include_usage=_include_usage(body))
        return await respond(request, core, requests, renderer, body.stream)

    @app.post("/v1/chat/completions", response_model=None,
              responses=schemas.completion_responses(schemas.ChatCompletion))
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        request_id = request.state.request_id = f"chatcmpl-{uuid.uuid4().hex}"
        generate_request, tool_plan = await openai_requests.chat_request(core, body, request_id)
        shared = dict(id=request_id, model=core.served_name(body.model or ""), fingerprint=await _fingerprint(core),
                      tokenizer=core.tokenizer, n=generate_request.params.n, prompt_logprobs=body.prompt_logprobs,
                      with_logprobs=body.logprobs, include_usage=_include_usage(body))
        plain = tool_plan.mode == "none" and tool_plan.thinking is None
        renderer = ChatRenderer(**shared) if plain else ToolChatRenderer(**shared, plan=tool_plan)
        return await respond(request, core, [generate_request], renderer, body.stream)

    store = response_store if response_store is not None else ResponseStore()  # (an empty store is falsy)
    responses_api.add_routes(app, core, store)
    messages_api.add_routes(app, core)
    tokenize_api.add_routes(app, core)
    pooling_api.add_routes(app, core)
    lora_api.add_routes(app, core)
    return Guard(app, api_key, max_body_bytes)


def _model_body(card: ModelCard) -> dict:
    return {"id": card.id, "object": "model", "created": int(time.time()), "owned_by": "pagedserve",
            "max_model_len": card.max_model_len}


async def _fingerprint(core: FrontendCore) -> str:
    """Names the deterministic mode: equal fingerprints and seeds give equal tokens."""
    card = await core.model_card()
    return "pagedserve-batch-invariant" if card.batch_invariant else "pagedserve-nondeterministic"


def _include_usage(body: CompletionRequest | ChatCompletionRequest) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage
