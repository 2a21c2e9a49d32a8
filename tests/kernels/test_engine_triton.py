"""The whole engine on the Triton kernels (the interpreter on the CPU): parity and invariance."""
from __future__ import annotations

import pytest

from tests.conftest import greedy, make_llm, random_prompts
from tests.engine.test_engine_parity import check_parity


@pytest.mark.slow
def test_engine_on_triton_matches_transformers_and_is_batch_invariant(model_dir):
    """Kept small: the interpreter runs every kernel program in Python."""
    folder = model_dir("qwen3", "tiny")  # q/k norm: every kernel family is exercised
    prompts = random_prompts(4, 512, 1, 40, seed=11)
    llm = make_llm(folder, dtype="float32", kernel_backend="triton")
    params = greedy(6, logprobs=1)
    batch = llm.generate(prompts, params, use_tqdm=False)
    alone = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts[:2]]
    for a, b in zip(alone, batch):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
    tolerated = check_parity(folder, [o.outputs[0].token_ids for o in batch], prompts, max_new=6)
    assert len(tolerated) <= 1, tolerated
