"""Embedding and scoring requests at the frontend (transport-free): the inputs tokenized and
checked, each submitted to the scheduler as a pooling request (services/core/pooling.py), their
outputs gathered in input order. The HTTP API (http/pooling_api.py) and the gRPC servicer
(Embed, Score) are thin adapters over `embed` and `score`.

Every input is checked before anything reaches the scheduler (empty, outside the vocabulary, longer
than max_model_len: a 400 naming `input[i]`); the inputs of one request run concurrently, batched
by the scheduler with everything else; a full queue is a 429 as for completions.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass

import structlog

from services.core.errors import REFUSALS, Unavailable, check
from services.core.pooling import score_input, shorten
from services.core.sampling_params import SamplingParams
from services.core.admission import check_token_ids
from services.frontend.core import FrontendCore

log = structlog.get_logger("frontend")
MAX_INPUTS = 2048  # inputs in one embeddings request (OpenAI's limit), documents in one score/rerank
POOLING_PARAMS = {task: SamplingParams(pooling=task, max_tokens=1) for task in ("embed", "score")}


@dataclass(frozen=True)
class Pooled:
    data: list[float]
    num_prompt_tokens: int


Input = str | list[int]


async def embed(core: FrontendCore, inputs: list[Input], dimensions: int | None = None,
                field: str = "input") -> list[Pooled]:
    """One embedding per input (a text, with the tokenizer's special tokens, or token ids)."""
    check(0 < len(inputs) <= MAX_INPUTS, field, f"must hold 1 to {MAX_INPUTS} inputs, got {len(inputs)}")
    ids = [await _tokens(core, item, f"{field}[{i}]" if len(inputs) > 1 else field) for i, item in enumerate(inputs)]
    pooled = await _pool(core, ids, field, "embed")
    if dimensions is None:
        return pooled
    return [Pooled(shorten(p.data, dimensions, core.pooling_model.spec), p.num_prompt_tokens) for p in pooled]


async def score(core: FrontendCore, queries: list[str], documents: list[str], instruction: str | None = None,
                field: str = "documents") -> list[Pooled]:
    """Each (query, document)'s relevance: a cross-encoder's score, or a yes/no decoder reranker's P(yes)."""
    check(0 < len(documents) <= MAX_INPUTS, field, f"must hold 1 to {MAX_INPUTS} texts, got {len(documents)}")
    encoder = core.pooling_model.encoder
    ids = [score_input(core.tokenizer, encoder, q, d, instruction) for q, d in zip(queries, documents)]
    for i, tokens in enumerate(ids):
        await _check_input(core, tokens, f"{field}[{i}]")
    return await _pool(core, ids, field, "score")


async def _tokens(core: FrontendCore, item: Input, field: str) -> list[int]:
    if isinstance(item, str):
        check(len(item) > 0, field, "must not be empty")
        await core.check_text_fits(len(item), field)
        tokens = core.tokenizer.encode_pooling(item) if len(item) < 16384 else \
            await asyncio.to_thread(core.tokenizer.encode_pooling, item)
    else:
        tokens = list(item)
    await _check_input(core, tokens, field)
    return tokens


async def _check_input(core: FrontendCore, tokens: list[int], field: str) -> None:
    card = await core.model_card()
    check(len(tokens) > 0, field, "must not be empty")
    check(len(tokens) <= card.max_model_len, field, f"has {len(tokens)} tokens; max_model_len is {card.max_model_len}")
    check_token_ids(field, tokens, card.vocab_size)


async def _pool(core: FrontendCore, inputs: list[list[int]], field: str, task: str) -> list[Pooled]:
    """Every input as its own pooling request, at once; their outputs in input order."""
    core.check_open()
    core.check_pending()
    base, started = uuid.uuid4().hex, time.monotonic()
    core.num_pending += 1
    try:
        return list(await asyncio.gather(*(_one(core, f"{base}-{i}", ids, task) for i, ids in enumerate(inputs))))
    except REFUSALS as error:
        log.info("refused", request_id=base, error=type(error).__name__, details=str(error))
        raise
    finally:
        core.num_pending -= 1
        log.info("pooling_request", request_id=base, num_inputs=len(inputs),
                 num_prompt_tokens=sum(map(len, inputs)), seconds=round(time.monotonic() - started, 4))


async def _one(core: FrontendCore, request_id: str, ids: list[int], task: str) -> Pooled:
    async with aclosing(core.scheduler.submit(request_id, ids, POOLING_PARAMS[task], 0)) as steps:
        async for step in steps:
            for update in step.updates:
                if update.pooled is not None:
                    return Pooled(update.pooled, len(ids))
    raise Unavailable(f"the scheduler ended request {request_id} without its output")
