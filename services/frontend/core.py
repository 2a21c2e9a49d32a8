"""The frontend's transport-free core: tokenize, validate, stream a request's events.

The gRPC servicer and the HTTP API are thin adapters over `FrontendCore`; every
check happens here, before anything reaches the scheduler.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING

import structlog

from services.core.admission import check_prompt, check_token_ids
from services.core.errors import REFUSALS, InvalidArgument, ResourceExhausted, Unavailable, check
from services.core.pooling import PoolingModel
from services.core.widths import INT32_MAX, INT32_MIN, check_int
from services.core.structured import GrammarLimits
from services.core.tokenizer import Tokenizer
from services.frontend.grammar_check import GrammarCheck
from services.frontend.metrics import FrontendMetrics
from services.frontend.reasoning import ReasoningParser, Thinking
from services.frontend.request_events import RequestEvents
from services.frontend.types import CHAT_ROLES, GenerateEvent, GenerateRequest, ModelCard, Prompt, UnknownModel

if TYPE_CHECKING:  # the core itself stays free of grpc
    from services.frontend.scheduler_client import SchedulerClient

log = structlog.get_logger("frontend")
STATS_TIMEOUT_S = 5.0
# Longer texts (token lists, chats) are tokenized (decoded, rendered) on a thread, off the event loop.
INLINE_CHARS = 16384
INLINE_MESSAGES = 64
THINKING_TAIL_TOKENS = 8  # the prompt's last tokens, read for an open or closed thinking marker


class FrontendCore:
    def __init__(self, tokenizer: Tokenizer, scheduler: SchedulerClient, model_id: str, max_pending: int = 0,
                 grammar_limits: GrammarLimits = GrammarLimits(), reasoning_parser: ReasoningParser | None = None,
                 template_kwargs: dict | None = None):
        self.tokenizer, self.scheduler, self.model_id = tokenizer, scheduler, model_id
        self.reasoning_parser = reasoning_parser  # None: outputs are all answer
        self.template_kwargs = template_kwargs or {}  # the server's default chat_template_kwargs
        self.trust_request_chat_template = False  # a request's own chat_template is refused
        self.max_pending = max_pending  # 0: no limit
        self.metrics = FrontendMetrics(model_id)
        self.num_pending = 0
        self.draining = False
        self.card: ModelCard | None = None  # known once a worker registered at the scheduler
        self.grammar_check = GrammarCheck(tokenizer, grammar_limits)
        self.pooling_model = PoolingModel()  # the model folder's, for embeddings and scores (frontend/pooling.py)
        self.loras: dict[str, str] = {}  # LoRA adapter name -> folder (--lora-modules): models a request may name
        self.lora_dir, self.allow_any_lora_path = "", False  # where POST /v1/load_lora_adapter may load from

    async def refresh(self) -> bool:
        """Ask the scheduler for the served model's limits; True when a worker is ready."""
        stats = await self.scheduler.stats(timeout=STATS_TIMEOUT_S)
        ready = stats.num_workers > 0 and stats.max_model_len > 0
        self.card = ModelCard(id=self.model_id, max_model_len=stats.max_model_len, vocab_size=stats.vocab_size,
                              batch_invariant=stats.batch_invariant) if ready else None
        return ready

    async def model_card(self) -> ModelCard:
        if self.card is None and not await self.refresh():
            raise Unavailable("no worker has registered with the scheduler yet (a worker the scheduler refused, "
                              "e.g. one it cannot reach at its --advertise-host, logs registration_refused with why)")
        return self.card

    def check_model(self, model: str) -> str:
        """The LoRA adapter a request's model names ("" for the base model); UnknownModel for anything else."""
        if model and model != self.model_id and model not in self.loras:
            raise UnknownModel(model, self.model_id)
        return model if model in self.loras else ""

    def check_pooling_model(self, model: str) -> None:
        """An embeddings or score request's model: the base model's id (or none); a LoRA adapter is refused
        (adapters serve generation only: docs/guide/embeddings.md)."""
        if self.check_model(model):
            raise InvalidArgument("model", f"{model!r} is a LoRA adapter: adapters serve generation only, "
                                           f"embeddings and scores come from the base model {self.model_id!r}")

    def served_name(self, model: str) -> str:
        """The model a response names: the request's LoRA adapter, else the base model's id."""
        return self.check_model(model) or self.model_id

    def render(self, prompt: Prompt) -> str:
        """The prompt's text: as given, or chat messages rendered with the chat template."""
        if prompt.messages is None:
            check(prompt.text is not None, "prompt", "one of text, token_ids or messages is required")
            return prompt.text
        check(len(prompt.messages) > 0, "messages", "must not be empty")
        for i, message in enumerate(prompt.messages):
            check(message.get("role") in CHAT_ROLES, f"messages[{i}].role",
                  f"unknown role {message.get('role')!r}; expected one of {', '.join(CHAT_ROLES)}")
        return self.tokenizer.apply_chat_template(prompt.messages, prompt.add_generation_prompt, prompt.tools,
                                                  {**self.template_kwargs, **(prompt.template_kwargs or {})},
                                                  prompt.chat_template)

    def thinking(self, prompt_ids: list[int]) -> Thinking | None:
        """How a chat's output reads under the reasoning parser: None without one, or when the
        rendered prompt ends with the thinking closed (Qwen3's `enable_thinking: false`)."""
        if self.reasoning_parser is None:
            return None
        tail = self.tokenizer.decode(prompt_ids[-THINKING_TAIL_TOKENS:], skip_special_tokens=False)
        return Thinking.of(self.reasoning_parser, tail)

    def marker_token(self, text: str) -> int | None:
        """The one token id a reasoning marker is, or None when it takes several."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    async def tokenize(self, prompt: Prompt) -> list[int]:
        """The token ids of a text or chat prompt (a chat template brings its own special tokens).
        A text too long to fit max_model_len is refused before it is tokenized; a long one is
        tokenized on a thread, so one huge prompt never holds up the event loop."""
        num_chars = _num_chars(prompt)
        if num_chars <= INLINE_CHARS and len(prompt.messages or ()) <= INLINE_MESSAGES:
            return self._encode(prompt)
        await self._check_text_fits(prompt, num_chars)
        return await asyncio.to_thread(self._encode, prompt)

    def _encode(self, prompt: Prompt) -> list[int]:
        add_special_tokens = prompt.add_special_tokens and prompt.messages is None
        return self.tokenizer.encode(self.render(prompt), add_special_tokens)

    async def _check_text_fits(self, prompt: Prompt, num_chars: int) -> None:
        await self.check_text_fits(num_chars, "prompt" if prompt.messages is None else "messages")

    async def check_text_fits(self, num_chars: int, field: str) -> None:
        """No token stands for more than `max_token_chars` characters, so a longer text than
        max_model_len of them cannot fit, whatever its tokens; `field`: the text's name."""
        limit = (await self.model_card()).max_model_len * self.tokenizer.max_token_chars
        check(num_chars <= limit, field, f"has {num_chars} characters; at most {limit} can fit in max_model_len "
                                         f"{self.card.max_model_len} tokens")

    async def detokenize(self, token_ids: list[int], skip_special_tokens: bool = True, field: str = "token_ids") -> str:
        """`field`: the name the client gave the token ids (an error names it)."""
        vocab_size = self.card.vocab_size if self.card else self.tokenizer.vocab_size

        def decode() -> str:
            check_token_ids(field, token_ids, vocab_size)
            return self.tokenizer.decode(token_ids, skip_special_tokens)
        return decode() if len(token_ids) <= INLINE_CHARS else await asyncio.to_thread(decode)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateEvent]:
        """The request's events; the last carries the summary. Raises InvalidArgument (before
        anything reaches the scheduler), ResourceExhausted or Unavailable."""
        try:
            request_id, prompt_ids = await self._admit(request)
        except REFUSALS as error:
            log.info("refused", request_id=request.request_id, error=type(error).__name__, details=str(error))
            raise
        tracker = RequestEvents(request_id, prompt_ids, request.params, self.tokenizer)
        self.num_pending += 1
        timer, status = self.metrics.timer(), "ok"
        try:
            async with aclosing(self.scheduler.submit(request_id, prompt_ids, request.params,
                                                      request.priority, self.check_model(request.model))) as steps:
                async for step in steps:
                    timer.on_queue_time(step.queue_time_s)
                    event = tracker.apply(step.updates)
                    timer.on_event(event)
                    for index in tracker.stopped:
                        self.scheduler.stop_sample(request_id, index)
                    if tracker.finished:
                        break
                    if event.samples or event.prompt_logprobs:
                        yield event
                else:
                    event = GenerateEvent(request_id=request_id)  # the scheduler ended the stream early
            event.summary = tracker.summary()
            yield event
        except BaseException as exc:
            status = type(exc).__name__
            raise
        finally:
            self.num_pending -= 1
            summary = tracker.summary()
            timer.finish(summary)
            log.info("request", request_id=request_id, status=status, num_prompt_tokens=summary.num_prompt_tokens,
                     num_completion_tokens=summary.num_completion_tokens, finish_reasons=summary.finish_reasons,
                     seconds=round(time.monotonic() - timer.started, 4))

    async def _admit(self, request: GenerateRequest) -> tuple[str, list[int]]:
        """Every check before the scheduler sees the request; its id and prompt ids."""
        self.check_open()
        self.check_model(request.model)
        check_int("priority", request.priority, INT32_MIN, INT32_MAX)
        prompt = request.prompt
        prompt_ids = list(prompt.token_ids) if prompt.token_ids is not None else await self.tokenize(prompt)
        card = await self.model_card()
        check_prompt(prompt_ids, card.max_model_len, card.vocab_size)
        request.params.check_vocab(card.vocab_size)
        check_room(card, len(prompt_ids), request.params.max_tokens, request.max_tokens_field)
        if request.params.structured_outputs is not None:
            await self.grammar_check.check(request.params.structured_outputs, card.vocab_size)
        self.check_pending()
        return request.request_id or uuid.uuid4().hex, prompt_ids

    def check_open(self) -> None:
        """Unavailable once draining: a request admitted now could not finish before the process stops."""
        if self.draining:
            raise Unavailable("the frontend is shutting down")

    def check_pending(self) -> None:
        """ResourceExhausted at max_pending requests in flight (0: no limit)."""
        if self.max_pending and self.num_pending >= self.max_pending:
            raise ResourceExhausted(f"{self.num_pending} requests pending, the limit is {self.max_pending}")


def check_room(card: ModelCard, num_prompt_tokens: int, max_tokens: int, field: str = "max_tokens") -> None:
    """The prompt and max_tokens fit in max_model_len; `field`: the name the client gave max_tokens."""
    room = card.max_model_len - num_prompt_tokens
    check(max_tokens <= room, field, f"{max_tokens} with a {num_prompt_tokens}-token prompt exceeds max_model_len "
                                     f"{card.max_model_len}; at most {room}")


def _num_chars(prompt: Prompt) -> int:
    if prompt.messages is None:
        return len(prompt.text or "")
    return sum(len(m.get("content")) for m in prompt.messages if isinstance(m.get("content"), str))
