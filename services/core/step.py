"""The scheduler -> worker contract (docs/ARCHITECTURE.md rule 3): a step is a delta.

A worker holds a mirror of each running sequence it was sent. The first step that
schedules a sequence on a worker carries it in full (`NewSequence`); later steps carry
only what changed (`CachedSequence`). A sequence that is preempted, swapped out or
moved is forgotten by the worker (`finished_seq_ids`) and re-sent in full when it
runs again. Block ids are the scheduler's; the worker only obeys them (rule 2).

Async scheduling: a delta with `async_next_step` tells the worker that its next step will be
this one's continuation, which it may run before that delta arrives (services/core/async_scheduling.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from services.core.sampling_params import SamplingParams


@dataclass(kw_only=True)
class NewSequence:
    """A sequence the worker has not seen (or was told to forget), sent in full."""

    seq_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty when resumed after preemption / moved
    block_ids: list[int]  # the whole block table
    num_computed_tokens: int  # tokens whose K/V are already in the cache (prefix hit, swap-in)
    num_scheduled_tokens: int  # tokens to run this step, from num_computed_tokens on
    params: SamplingParams  # its seed always set (the request's, assigned at admission if it had none)
    sample_index: int = 0  # which of the request's n samples this is
    num_samples: int = 1  # >1: sample this many first tokens (parallel sampling fork)
    lora_name: str = ""  # the LoRA adapter it runs under; "": the base model
    lora_path: str = ""  # its folder where loaded at run time (the worker loads it unless held); "": --lora-modules


@dataclass(kw_only=True)
class CachedSequence:
    """A sequence the worker holds: only what changed since its last step."""

    seq_id: int
    new_token_ids: list[int]  # tokens appended by the scheduler since the last step
    new_block_ids: list[int]  # blocks appended to the table (after num_kept_blocks)
    num_computed_tokens: int
    num_scheduled_tokens: int  # drafts included
    # speculative decoding (services/core/spec_decode.py): tokens to verify after the sequence's last
    # one, run in this step; the output is the drafts kept and then the sampler's own token
    draft_token_ids: list[int] = field(default_factory=list)
    # the table keeps this many blocks before new_block_ids are appended (blocks of rejected drafts
    # were given back); None: all it holds
    num_kept_blocks: int | None = None


@dataclass(kw_only=True)
class StepDelta:
    step_id: int
    new_seqs: list[NewSequence] = field(default_factory=list)
    cached_seqs: list[CachedSequence] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)  # forget these first
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, device)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst), copy-on-write
    async_next_step: bool = False  # the next step is this one's continuation (async scheduling)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.new_seqs) + sum(
            s.num_scheduled_tokens for s in self.cached_seqs)

    @property
    def is_empty(self) -> bool:
        return not (self.new_seqs or self.cached_seqs or self.finished_seq_ids or self.blocks_to_swap_out
                    or self.blocks_to_swap_in or self.blocks_to_copy)


@dataclass(kw_only=True)
class Logprobs:
    """Log-probabilities of the raw model distribution at one position."""

    token_id: int
    logprob: float  # of token_id
    rank: int  # 1 = most likely
    top: list[tuple[int, float]]  # the top k (token id, logprob), best first


@dataclass(kw_only=True)
class SeqOutput:
    """What a step produced for one sequence that reached the end of its tokens."""

    seq_id: int
    # one sampled token; num_samples of them at a fork; after drafts, the drafts kept and then the
    # sampler's own token at the first one rejected (or after the last)
    token_ids: list[int]
    logprobs: list[Logprobs] | None = None  # one per token id, when asked
    # a pooling request (SamplingParams.pooling): its prompt's pooled output (token_ids empty): the
    # embedding (task embed) or the scores (task score); services/worker/pooler.py
    pooled: list[float] | None = None


@dataclass
class StepResult:
    step_id: int
    outputs: list[SeqOutput] = field(default_factory=list)
    # seq_id -> logprobs of the prompt tokens run this step (position 0 has none: None)
    prompt_logprobs: dict[int, list[Logprobs | None]] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class WorkerInfo:
    """What a worker tells the scheduler when it registers."""

    model: str
    dtype: str
    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    vocab_size: int
    max_model_len: int  # the model's max_position_embeddings
    eos_token_ids: tuple[int, ...]
    device: str
    batch_invariant: bool
    task: str = "generate"  # generate, embed or score (services/core/pooling.py)
    # a pooling request runs its whole prompt in one step with no cached prefix (an encoder; mean or
    # CLS pooling): the scheduler never chunks it
    pooling_whole: bool = False
    lora_names: tuple[str, ...] = ()  # its LoRA adapters (--lora-modules), of which it holds the last max_cpu_loras
    max_cpu_loras: int = 0  # LoRA adapters it holds at once, loading others on demand; 0: no --enable-lora
