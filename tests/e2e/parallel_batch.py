"""The batch the parallel-group tests run (test_parallel*.py): greedy and seeded rows side by side,
top-p, logprobs and prompt logprobs, twice over, on prompts with a shared prefix (prefix-cache hits),
on the tiny model with 4 layers and an engine whose KV cache is too small for everyone (preemption)
and whose step budget is under the longest prompt (chunked prefill)."""
from __future__ import annotations

from services.core.sampling_params import SamplingParams
from tests.conftest import random_prompts

# the tiny model with 4 layers: 4 heads, 2 KV heads (replicated at TP 4), MLP 128 -> 4 reduction groups
MODEL = dict(arch="llama", size="tiny", num_layers=4)
ENGINE = dict(max_num_batched_tokens=48, num_gpu_blocks=14, block_size=16, num_threads=1)


def batch_params(max_tokens: int) -> list[SamplingParams]:
    common = dict(max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    return [SamplingParams(temperature=0, **common), SamplingParams(temperature=0.8, seed=7, **common),
            SamplingParams(temperature=1.0, top_p=0.9, seed=11, **common),
            SamplingParams(temperature=0, prompt_logprobs=1, **common)] * 2


def batch_prompts(max_len: int, seed: int, shared_prefix: int) -> list[list[int]]:
    return random_prompts(8, 512, min_len=5, max_len=max_len, seed=seed, shared_prefix=shared_prefix)


def bits(outputs) -> list:
    """What the groups promise to keep: each sequence's token ids, logprobs and prompt logprobs."""
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs) for o in outputs]
