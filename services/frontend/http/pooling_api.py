"""Embeddings and reranking over HTTP: OpenAI's POST /v1/embeddings, vLLM's POST /v1/score, and
the Jina/Cohere rerank shape vLLM serves (POST /rerank, /v1/rerank, /v2/rerank). Thin adapters
over services/frontend/pooling.py; errors are OpenAI's shape (400 naming the field, 429 when full)."""
from __future__ import annotations

import base64
import time
import uuid

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from services.core.errors import check
from services.frontend import pooling
from services.frontend.core import FrontendCore
from services.frontend.http import schemas
from services.frontend.http.pooling_models import (EmbeddingList, EmbeddingRequest, RerankRequest, RerankResponse,
                                                   ScoreList, ScoreRequest)
from services.frontend.http.respond import CLIENT_CLOSED, unless_disconnected

ERRORS = schemas.errors(400, 401, 404, 413, 429, 503)


def add_routes(app: FastAPI, core: FrontendCore) -> None:
    @app.post("/v1/embeddings", response_model=EmbeddingList, responses=ERRORS)
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        """One embedding per input, in input order (OpenAI's embeddings.create)."""
        request.state.request_id = f"embd-{uuid.uuid4().hex}"
        core.check_pooling_model(body.model or "")
        inputs = body.input if isinstance(body.input, list) and body.input and not isinstance(body.input[0], int) \
            else [body.input]
        pooled = await unless_disconnected(request, pooling.embed(core, inputs, body.dimensions))
        if pooled is None:
            return Response(status_code=CLIENT_CLOSED)
        data = [{"object": "embedding", "index": i, "embedding": _encode(p.data, body.encoding_format)}
                for i, p in enumerate(pooled)]
        return JSONResponse({"object": "list", "data": data, "model": core.model_id, "usage": _usage(pooled)})

    @app.post("/v1/score", response_model=ScoreList, responses=ERRORS)
    async def score(body: ScoreRequest, request: Request) -> Response:
        """Each text_2's relevance to text_1 (one query for all, or pairwise), as vLLM's /v1/score."""
        request_id = request.state.request_id = f"score-{uuid.uuid4().hex}"
        core.check_pooling_model(body.model or "")
        documents = body.text_2 if isinstance(body.text_2, list) else [body.text_2]
        if isinstance(body.text_1, list):
            check(len(body.text_1) in (1, len(documents)), "text_1",
                  f"{len(body.text_1)} texts for {len(documents)} in text_2 (one, or as many)")
            queries = body.text_1 * len(documents) if len(body.text_1) == 1 else body.text_1
        else:
            queries = [body.text_1] * len(documents)
        pooled = await unless_disconnected(request, pooling.score(core, queries, documents, body.instruction,
                                                                  "text_2"))
        if pooled is None:
            return Response(status_code=CLIENT_CLOSED)
        return JSONResponse({"id": request_id, "object": "list", "created": int(time.time()), "model": core.model_id,
                             "data": [{"object": "score", "index": i, "score": p.data[0]} for i, p in enumerate(pooled)],
                             "usage": _usage(pooled)})

    async def rerank(body: RerankRequest, request: Request) -> Response:
        """The documents by relevance to the query, best first (the Jina/Cohere shape vLLM serves)."""
        request_id = request.state.request_id = f"rerank-{uuid.uuid4().hex}"
        core.check_pooling_model(body.model or "")
        pooled = await unless_disconnected(request, pooling.score(core, [body.query] * len(body.documents),
                                                                  body.documents, body.instruction))
        if pooled is None:
            return Response(status_code=CLIENT_CLOSED)
        order = sorted(range(len(pooled)), key=lambda i: (-pooled[i].data[0], i))
        if body.top_n:
            order = order[:body.top_n]
        results = [{"index": i, "relevance_score": pooled[i].data[0],
                    **({"document": {"text": body.documents[i]}} if body.return_documents else {})} for i in order]
        return JSONResponse({"id": request_id, "model": core.model_id, "results": results,
                             "usage": {"total_tokens": sum(p.num_prompt_tokens for p in pooled)}})

    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.post(path, response_model=RerankResponse, responses=ERRORS)(rerank)


def _encode(vector: list[float], encoding_format: str):
    if encoding_format == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()


def _usage(pooled: list[pooling.Pooled]) -> dict:
    tokens = sum(p.num_prompt_tokens for p in pooled)
    return {"prompt_tokens": tokens, "total_tokens": tokens}
