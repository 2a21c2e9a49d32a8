"""The public proto (pagedserve.v1) to the frontend's plain types and back."""
from __future__ import annotations

import collections
import dataclasses

from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet

from pagedserve.v1 import generate_pb2 as pb
from services.core.errors import InvalidArgument, check
from services.core.sampling_params import SamplingParams
from services.core.step import Logprobs
from services.core.structured import Constraint
from services.frontend.batch import BatchError, BatchItem
from services.frontend.reasoning import Thinking
from services.frontend.tool_stream import ToolCallStream
from services.frontend.types import (MAX_CHAT_MESSAGES, GenerateEvent, GenerateRequest, ModelCard, Prompt,
                                     SampleEvent, Summary)
from services.rpc.status import status_of

FINISH_REASONS = {None: pb.FINISH_REASON_UNSPECIFIED, "stop": pb.FINISH_REASON_STOP,
                  "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT}
# Optional scalar fields of pb.SamplingParams that map one to one onto SamplingParams.
_SCALAR_PARAMS = ("n", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty", "seed", "max_tokens", "min_tokens", "ignore_eos", "include_stop_str_in_output",
                  "logprobs", "prompt_logprobs", "skip_special_tokens")


def reject_unknown_fields(message: Message, path: str = "") -> None:
    """A field this server does not know (a newer client's) must not be silently ignored."""
    unknown = UnknownFieldSet(message)
    if len(unknown):
        raise InvalidArgument(path or "request", f"unknown field number {unknown[0].field_number}")
    for field, value in message.ListFields():
        if field.message_type is None or field.message_type.GetOptions().map_entry:
            continue
        for i, item in enumerate(value if field.is_repeated else [value]):
            name = f"{field.name}[{i}]" if field.is_repeated else field.name
            reject_unknown_fields(item, f"{path}.{name}" if path else name)


def generate_request_from_pb(request: pb.GenerateRequest) -> GenerateRequest:
    _check_chat_size(request)
    reject_unknown_fields(request)
    return GenerateRequest(prompt=_prompt_from_pb(request), params=params_from_pb(request.params),
                           request_id=request.request_id, model=request.model, priority=request.priority)


def tokenize_prompt_from_pb(request: pb.TokenizeRequest) -> Prompt:
    _check_chat_size(request)
    reject_unknown_fields(request)
    if request.WhichOneof("input") == "chat":
        return _chat_prompt(request.chat)
    if request.WhichOneof("input") is None:
        raise InvalidArgument("input", "one of text or chat is required")
    return Prompt(text=request.text, add_special_tokens=_get(request, "add_special_tokens", True))


def params_from_pb(params: pb.SamplingParams) -> SamplingParams:
    kwargs = {name: getattr(params, name) for name in _SCALAR_PARAMS if params.HasField(name)}
    return SamplingParams(**kwargs, logit_bias=dict(params.logit_bias), stop=tuple(params.stop),
                          stop_token_ids=tuple(params.stop_token_ids), structured_outputs=_constraint_from_pb(params))


def _constraint_from_pb(params: pb.SamplingParams) -> Constraint | None:
    """The oneof structured_outputs; vLLM's option names (json_schema travels as json)."""
    kind = params.WhichOneof("structured_outputs")
    if kind is None or (kind == "json_object" and not params.json_object):
        return None
    value = list(params.choice.choices) if kind == "choice" else getattr(params, kind)
    name = "json" if kind == "json_schema" else kind
    return dataclasses.replace(Constraint.from_options({name: value}, "params"), field=f"params.{kind}")


class ReasoningSplit:
    """One request's deltas read apart into reasoning_text and answer_text, each sample by its own
    reader of the thinking (services/frontend/reasoning.py), fed as the sample's text arrives."""

    def __init__(self, thinking: Thinking):
        self.readers = collections.defaultdict(lambda: thinking.reader(ToolCallStream("none", set())))

    def fill(self, response: pb.GenerateResponse, event: GenerateEvent) -> None:
        for delta, sample in zip(response.samples, event.samples):
            reader = self.readers[sample.index]
            pieces = reader.feed(sample.text) + (reader.finish() if sample.finish_reason is not None else [])
            delta.reasoning_text = "".join(p.text for p in pieces if p.kind == "reasoning")
            delta.answer_text = "".join(p.text for p in pieces if p.kind == "content")


def event_to_pb(event: GenerateEvent, split: ReasoningSplit | None = None) -> pb.GenerateResponse:
    """`split`: the request's reasoning reader (a chat prompt under a reasoning parser), else None."""
    response = pb.GenerateResponse(request_id=event.request_id, samples=[_sample_to_pb(s) for s in event.samples])
    if split is not None:
        split.fill(response, event)
    if event.prompt_logprobs is not None:
        response.prompt_logprobs.extend(
            pb.PromptLogprob(has_value=lp is not None, value=_logprob_to_pb(lp) if lp else None)
            for lp in event.prompt_logprobs)
    if event.summary is not None:
        response.summary.CopyFrom(_summary_to_pb(event.summary))
    return response


def batch_to_pb(items: list[BatchItem], splits: dict[str, ReasoningSplit | None]) -> pb.GenerateBatchResponse:
    """`splits`: each request's reasoning reader by request id, as event_to_pb takes it; a request's
    is dropped with its last event (the one with the summary)."""
    response = pb.GenerateBatchResponse()
    for item in items:
        if isinstance(item, BatchError):
            code, message = status_of(item.error)
            response.errors.append(pb.RequestError(request_id=item.request_id, index=item.index, code=code.value[0],
                                                   message=message))
        else:
            split = splits.pop(item.request_id, None) if item.summary is not None else splits.get(item.request_id)
            response.responses.append(event_to_pb(item, split))
    return response


def model_card_to_pb(card: ModelCard) -> pb.ModelInfo:
    return pb.ModelInfo(id=card.id, max_model_len=card.max_model_len, vocab_size=card.vocab_size)


def _prompt_from_pb(request: pb.GenerateRequest) -> Prompt:
    kind = request.WhichOneof("prompt")
    if kind == "chat":
        return _chat_prompt(request.chat)
    if kind == "token_ids":
        return Prompt(token_ids=list(request.token_ids.ids))
    if kind is None:
        raise InvalidArgument("prompt", "one of text, token_ids or chat is required")
    return Prompt(text=request.text, add_special_tokens=_get(request, "add_special_tokens", True))


def _check_chat_size(request: pb.GenerateRequest | pb.TokenizeRequest) -> None:
    """Before walking a chat's messages (a 4 MiB message holds 300,000 of them)."""
    num = len(request.chat.messages) if request.HasField("chat") else 0
    check(num <= MAX_CHAT_MESSAGES, "chat.messages", f"at most {MAX_CHAT_MESSAGES} messages, got {num}")


def _chat_prompt(chat: pb.ChatMessages) -> Prompt:
    return Prompt(messages=[{"role": m.role, "content": m.content} for m in chat.messages],
                  add_generation_prompt=_get(chat, "add_generation_prompt", True))


def _get(message: Message, name: str, default):
    return getattr(message, name) if message.HasField(name) else default


def _sample_to_pb(sample: SampleEvent) -> pb.SampleDelta:
    delta = pb.SampleDelta(index=sample.index, text=sample.text, token_ids=sample.token_ids,
                           logprobs=[_logprob_to_pb(lp) for lp in sample.logprobs or ()],
                           finish_reason=FINISH_REASONS[sample.finish_reason])
    if isinstance(sample.stop_reason, str):
        delta.stop_string = sample.stop_reason
    elif sample.stop_reason is not None:
        delta.stop_token_id = sample.stop_reason
    return delta


def _logprob_to_pb(lp: Logprobs) -> pb.Logprob:
    return pb.Logprob(token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank,
                      top=[pb.TopLogprob(token_id=t, logprob=p) for t, p in lp.top])


def _summary_to_pb(summary: Summary) -> pb.GenerateSummary:
    return pb.GenerateSummary(finish_reasons=[FINISH_REASONS[r] for r in summary.finish_reasons],
                              num_prompt_tokens=summary.num_prompt_tokens,
                              num_completion_tokens=summary.num_completion_tokens,
                              num_cached_tokens=summary.num_cached_tokens, seed=summary.seed)
