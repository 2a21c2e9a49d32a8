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
from tests.conftest import make_llm
from tests.e2e.parallel_batch import ENGINE, MODEL, batch_params, batch_prompts, bits
from tests.core.test_spec_decode import NGRAM, oracle
from tests.waits import is_idle

pytestmark = pytest.mark.slow

SPEC = NGRAM  # drafted at every batch size


def _params() -> list[SamplingParams]:
    return batch_params(max_tokens=16)


def _prompts() -> list[list[int]]:
    return batch_prompts(max_len=60, seed=4, shared_prefix=12)


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
    assert bits(got) == bits(reference)
    assert all(n > 0 for n in stats.spec_decode_num_accepted_tokens_per_pos), stats
    assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens  # some were rejected
    assert stats.num_preemptions > 0
    assert is_idle(stats)
