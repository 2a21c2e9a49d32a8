"""Request and sequence state, owned by the scheduler (the single source of truth, rule 1)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from services.core.block_pool import root_hash
from services.core.sampling_params import SamplingParams
from services.core.step import Logprobs


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(kw_only=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # seed always set (assigned at admission when the caller gave none)
    arrival: int  # admission order, the tie-breaker of every policy
    priority: int = 0  # lower runs first under the "priority" policy
    seqs: list[Sequence] = field(default_factory=list)
    forked: bool = False  # the n-1 parallel samples have been forked off sample 0
    prompt_logprobs: list[Logprobs | None] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    lora_name: str = ""  # the LoRA adapter it runs under ("": the base model); keys its prefix-cache blocks
    lora_id: int | None = None  # the adapter's id on KV-cache events (Scheduler.register_lora); None: the base

    @property
    def cache_root(self) -> bytes:
        """The parent hash of its first KV block: a base block is never reused under an adapter, nor one
        adapter's under another (services/core/block_pool.py root_hash)."""
        return root_hash(self.lora_name)

    @property
    def seed(self) -> int:
        return self.params.seed


@dataclass(frozen=True)
class ContinuedSample:
    """One sample of a continuation: a request that another scheduler (one that died) had
    started, resubmitted by its frontend with the output tokens it already streamed. The sample
    goes on from them as a recomputed sequence does after a preemption: its next token is drawn
    at its original position, min_tokens, max_tokens and the penalties count them, and a worker's
    grammar matcher replays them."""

    sample_index: int
    token_ids: tuple[int, ...]


@dataclass(kw_only=True)
class Sequence:
    """One sample of a request: prompt + its own output tokens."""

    seq_id: int
    request: Request
    sample_index: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprobs] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0
    worker_id: str | None = None  # where its blocks live (running or swapped)
    placed: str | None = None  # while waiting: the worker placement chose for it (None: not placed yet)
    num_tokens_on_worker: int = 0  # how much of it the worker's mirror holds (0: not held)
    num_blocks_on_worker: int = 0
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | None = None  # the stop token id that ended it
    num_preemptions: int = 0

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_token_ids) + len(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.request.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def forget_on_worker(self) -> None:
        self.num_tokens_on_worker = 0
        self.num_blocks_on_worker = 0


@dataclass(kw_only=True)
class SeqUpdate:
    """What one step (or an abort) changed for one sample, streamed towards the client."""

    request_id: str
    sample_index: int
    token_ids: list[int]  # new tokens
    logprobs: list[Logprobs] | None = None  # one per new token, when asked
    finish_reason: str | None = None
    stop_token_id: int | None = None  # the stop token id that ended it
    prompt_logprobs: list[Logprobs | None] | None = None  # once, when the prompt is done
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    seed: int = 0
    pooled: list[float] | None = None  # a pooling request's output (services/core/pooling.py), once, at its end
