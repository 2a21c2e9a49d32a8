"""Speculative decoding on a tensor- and a pipeline-parallel worker group gives the tokens and logprobs
of one process with it off, bit for bit.

The groups are real (LLM(...) is rank 0 and starts the other ranks as processes meeting over gloo on
loopback, as in test_parallel.py). The drafts are the oracle's of tests/core/test_spec_decode.py: the
speculation-off output, wrong at every fifth position, so every rank's verify pass has drafts accepted
at every position and rejected at every position; greedy and seeded rows, logprobs, prompt logprobs,
and a KV cache too small for everyone (preemption with drafts in flight)."""
from __future__ import annotations

import pytest

from services.core.sampling_params import SamplingParams
from tests.conftest import make_llm, random_prompts
from tests.core.test_spec_decode import NGRAM, oracle
from tests.waits import is_idle

pytestmark = pytest.mark.slow

MODEL = dict(arch="llama", size="tiny", num_layers=4)
ENGINE = dict(max_num_batched_tokens=48, num_gpu_blocks=14, block_size=16, num_threads=1)
SPEC = NGRAM  # drafted at every batch size


def _params() -> list[SamplingParams]:
    common = dict(max_tokens=16, ignore_eos=True, logprobs=2)
    return [SamplingParams(temperature=0, **common), SamplingParams(temperature=0.8, seed=7, **common),
            SamplingParams(temperature=1.0, top_p=0.9, seed=11, **common),
            SamplingParams(temperature=0, prompt_logprobs=1, **common)] * 2


def _prompts() -> list[list[int]]:
    return random_prompts(8, 512, min_len=5, max_len=60, seed=4, shared_prefix=12)


def _bits(outputs) -> list:
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs) for o in outputs]


@pytest.fixture(scope="module")
def folder(model_dir):
    return model_dir(**MODEL)


@pytest.fixture(scope="module")
def reference(folder):
    """One process, speculation off."""
    with make_llm(folder, **ENGINE) as llm:
        return llm.generate(_prompts(), _params(), use_tqdm=False)


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_drafts_verified_on_a_worker_group_give_the_bits_of_one_process_without_them(folder, reference, tp, pp):
    with make_llm(folder, **ENGINE, speculative_config=SPEC, tensor_parallel_size=tp,
                  pipeline_parallel_size=pp) as llm:
        oracle(llm, reference)
        got = llm.generate(_prompts(), _params(), use_tqdm=False)
        stats = llm.scheduler.stats()
    assert _bits(got) == _bits(reference)
    assert all(n > 0 for n in stats.spec_decode_num_accepted_tokens_per_pos), stats
    assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens  # some were rejected
    assert stats.num_preemptions > 0
    assert is_idle(stats)
