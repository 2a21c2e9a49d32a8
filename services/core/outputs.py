"""What `LLM.generate` returns, and the collector that builds it from scheduler updates."""
from __future__ import annotations

from dataclasses import dataclass, field

from services.core.detokenizer import IncrementalDetokenizer
from services.core.sampling_params import SamplingParams
from services.core.sequence import SeqUpdate
from services.core.step import Logprobs
from services.core.tokenizer import Tokenizer


@dataclass(kw_only=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string
    logprobs: list[Logprobs] | None = None


@dataclass(kw_only=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    seed: int = 0
    prompt_logprobs: list[Logprobs | None] | None = None
    num_cached_tokens: int = 0
    finished: bool = False


class OutputCollector:
    """Follows one request: detokenizes each sample and reports stop-string hits."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 tokenizer: Tokenizer | None):
        self.params = params
        self.output = RequestOutput(request_id=request_id, prompt=prompt, prompt_token_ids=list(prompt_token_ids),
                                    outputs=[CompletionOutput(index=i,
                                                              logprobs=[] if params.logprobs is not None else None)
                                     for i in range(params.n)])
        self.detoks = [IncrementalDetokenizer(tokenizer, prompt_token_ids, params) if tokenizer else None
                       for _ in range(params.n)]

    def apply(self, update: SeqUpdate) -> bool:
        """Fold one update in; True when a stop string ended this sample (abort it upstream)."""
        out, detok = self.output.outputs[update.sample_index], self.detoks[update.sample_index]
        self.output.seed, self.output.num_cached_tokens = update.seed, update.num_cached_tokens
        if update.prompt_logprobs is not None:
            self.output.prompt_logprobs = update.prompt_logprobs
        if out.finish_reason is not None:
            return False
        stopped = False
        # token by token: an update of several tokens (speculative decoding) reads as that many
        # steps would, and a stop string ends the sample at its token, the later ones dropped
        for i, token in enumerate(update.token_ids):
            out.token_ids.append(token)
            if update.logprobs and out.logprobs is not None:
                out.logprobs.append(update.logprobs[i])
            if detok is not None:
                delta = detok.add([token])
                out.text += delta.text
                if delta.stop is not None:
                    out.finish_reason, out.stop_reason, stopped = "stop", delta.stop, True
                    break
        if update.finish_reason and out.finish_reason is None:
            out.finish_reason, out.stop_reason = update.finish_reason, update.stop_token_id
            if detok is not None:
                out.text += detok.finish()
        self.output.finished = all(o.finish_reason is not None for o in self.output.outputs)
        return stopped


@dataclass(kw_only=True)
class PoolingOutput:
    """A pooling request's result (services/core/pooling.py): `embedding` (task embed) or `score`
    (task score; a classifier with several labels: `data` holds each label's probability)."""

    data: list[float]

    @property
    def embedding(self) -> list[float]:
        return self.data

    @property
    def score(self) -> float:
        return self.data[0]


@dataclass(kw_only=True)
class PoolingRequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    finished: bool = True
