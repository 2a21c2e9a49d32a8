"""The same requests give bit-identical token ids and logprobs however they are batched."""
from __future__ import annotations

import pytest

from services.core.sampling_params import SamplingParams
from kernels.build import host_tiers
from tests.conftest import greedy, make_llm, random_prompts, use_tier
from tests.waits import is_idle

MAX_NEW = 24


def run(llm, prompts, params, one_at_a_time=False):
    if one_at_a_time:
        outs = [llm.generate([p], [sp], use_tqdm=False)[0] for p, sp in zip(prompts, params)]
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    return [[(o.token_ids, o.logprobs) for o in out.outputs] for out in outs]


# every kernel tier this CPU executes (kernels/cpu_kernels.py), each invariant on its own
TIERS = [pytest.param((dtype, tier), id=f"{tier}-{dtype}") for tier in host_tiers() for dtype in ("float32", "bfloat16")]


@pytest.fixture(scope="module", params=TIERS)
def setup(request, model_dir):
    dtype, tier = request.param
    folder = model_dir("llama", "tiny", dtype=dtype)
    prompts = random_prompts(32, 512, 1, 200, seed=3)
    params = [greedy(MAX_NEW, logprobs=2) for _ in prompts]
    for _ in use_tier(tier):  # the engines below take cpu_isa=tier; the tier before comes back after
        baseline = run(make_llm(folder, dtype=dtype, cpu_isa=tier), prompts, params, one_at_a_time=True)
        yield folder, dtype, prompts, params, baseline, tier


@pytest.mark.slow
@pytest.mark.parametrize("case", ["batch", "recompute", "swap", "chunked"])
def test_invariant_to_batching_and_preemption(setup, case):
    folder, dtype, prompts, params, baseline, tier = setup
    engine_args = {
        "batch": {},
        "recompute": dict(num_gpu_blocks=40, preemption_mode="recompute"),
        "swap": dict(num_gpu_blocks=40, preemption_mode="swap", swap_space_bytes=64 << 20),
        "chunked": dict(max_num_batched_tokens=48, enable_chunked_prefill=True),
    }[case]
    llm = make_llm(folder, dtype=dtype, cpu_isa=tier, **engine_args)
    got = run(llm, prompts, params)
    if case in ("recompute", "swap"):
        assert llm.scheduler.num_preemptions > 0
    assert got == baseline
    assert is_idle(llm.scheduler.stats())


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [8, 32])
def test_invariant_to_block_size(setup, block_size):
    """Keys are reduced in fixed tiles of 128 whatever the block size, so the bits agree."""
    folder, dtype, prompts, params, baseline, tier = setup
    llm = make_llm(folder, dtype=dtype, cpu_isa=tier, block_size=block_size, num_gpu_blocks=1280 // block_size,
                   preemption_mode="recompute")
    assert run(llm, prompts, params) == baseline


@pytest.mark.slow
def test_invariant_to_prefix_cache_hits(model_dir):
    folder = model_dir("llama", "tiny")
    prompts = random_prompts(16, 512, 1, 40, seed=4, shared_prefix=100)
    params = [greedy(MAX_NEW, logprobs=2) for _ in prompts]
    alone = run(make_llm(folder, enable_prefix_caching=False), prompts, params, one_at_a_time=True)
    llm = make_llm(folder, enable_prefix_caching=True)
    cached = run(llm, prompts[:1], params[:1]) + run(llm, prompts[1:], params[1:])
    stats = llm.scheduler.stats().worker("worker-0")
    assert stats.prefix_cache_hits > 0
    assert cached == alone


@pytest.mark.slow
def test_invariant_on_another_worker(model_dir):
    folder = model_dir("llama", "tiny")
    prompts = random_prompts(8, 512, 1, 100, seed=5)
    params = [greedy(MAX_NEW) for _ in prompts]
    one = run(make_llm(folder), prompts, params)
    two = make_llm(folder, num_workers=2)
    assert run(two, prompts, params) == one


SEEDED = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, repetition_penalty=1.2, seed=1234,
                        max_tokens=MAX_NEW, ignore_eos=True, logprobs=1)


def others(n: int) -> list[SamplingParams]:
    kinds = [dict(temperature=0), dict(temperature=1.0, seed=7), dict(temperature=0.5, min_p=0.1, seed=8),
             dict(temperature=1.2, presence_penalty=0.5, frequency_penalty=0.3, seed=9),
             dict(temperature=0.7, top_k=5, seed=10)]
    return [SamplingParams(max_tokens=MAX_NEW - i % 7, ignore_eos=True, **kinds[i % len(kinds)]) for i in range(n)]


def test_seeded_sampling_alone_vs_in_batch_vs_preempted(model_dir):
    folder = model_dir("llama", "tiny")
    prompts = random_prompts(16, 512, 5, 120, seed=6)
    alone = run(make_llm(folder), prompts[:1], [SEEDED])[0]
    crowd = run(make_llm(folder), prompts, [SEEDED] + others(15))[0]
    small = make_llm(folder, num_gpu_blocks=24, preemption_mode="recompute")
    preempted = run(small, prompts, [SEEDED] + others(15))[0]
    assert small.scheduler.num_preemptions > 0
    assert alone == crowd == preempted
    assert len(set(alone[0][0])) > 3  # a real sample, not a constant stream


def test_parallel_samples_fork_and_match_single_seeds(model_dir):
    folder = model_dir("llama", "tiny")
    prompt = random_prompts(1, 512, 37, 37, seed=7)[0]
    llm = make_llm(folder)
    params = SamplingParams(n=3, temperature=1.0, seed=99, max_tokens=12, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    samples = [o.token_ids for o in out.outputs]
    assert len({tuple(s) for s in samples}) == 3  # different streams
    single = llm.generate([prompt], SamplingParams(temperature=1.0, seed=99, max_tokens=12, ignore_eos=True),
                          use_tqdm=False)[0]
    assert single.outputs[0].token_ids == samples[0]  # sample 0 of n is the n=1 stream
    assert is_idle(llm.scheduler.stats())


def test_parallel_samples_survive_a_chunked_prefill(model_dir):
    """A prompt prefilled over several steps still forks into n samples at its last chunk,
    the same ones as in one step."""
    folder = model_dir("llama", "tiny")
    prompt = random_prompts(1, 512, 37, 37, seed=7)[0]
    params = SamplingParams(n=3, temperature=1.0, seed=99, max_tokens=6, ignore_eos=True)
    whole = make_llm(folder).generate([prompt], params, use_tqdm=False)[0]
    chunked = make_llm(folder, max_num_batched_tokens=8).generate([prompt], params, use_tqdm=False)[0]
    assert [o.token_ids for o in chunked.outputs] == [o.token_ids for o in whole.outputs]
    assert len(chunked.outputs) == 3


def test_a_fork_copy_lands_before_its_block_is_swapped_out(model_dir):
    """A step may both copy a forked block (copy-on-write) and swap the child's blocks out: the
    copy must come first, or the swapped-out block misses the copied K/V."""
    from services.core.step import StepDelta
    llm = make_llm(model_dir("llama", "tiny"), swap_space_bytes=1 << 20)
    runner = next(iter(llm.engine.workers.values())).runner
    k_cache, v_cache = runner.kv_cache.layers[0]
    k_cache[3].fill_(1.5)
    v_cache[3].fill_(-2.5)
    runner.execute(StepDelta(step_id=1, blocks_to_copy=[(3, 7)], blocks_to_swap_out=[(7, 0)]))
    cpu_k, cpu_v = runner.kv_cache.cpu_layers[0]
    assert bool((cpu_k[0] == 1.5).all()) and bool((cpu_v[0] == -2.5).all())


def test_the_engine_seed_makes_unseeded_requests_reproducible(model_dir):
    """As vLLM's `seed`: requests without a seed get seeds drawn from the engine's seed."""
    folder = model_dir("llama", "tiny")
    prompts = random_prompts(4, 512, 5, 40, seed=8)
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)

    def outputs(seed):
        outs = make_llm(folder, seed=seed).generate(prompts, params, use_tqdm=False)
        return [(o.seed, o.outputs[0].token_ids) for o in outs]

    first = outputs(0)
    assert outputs(0) == first
    assert len({s for s, _ in first}) == 4  # each request its own seed
    assert [s for s, _ in outputs(1)] != [s for s, _ in first]


def test_prompt_logprobs_survive_a_preemption_in_the_middle_of_a_chunked_prompt(model_dir):
    """A recomputed prompt's chunks need not end where the preempted run's did: each position's
    prompt logprob is kept once, none lost and none twice."""
    folder = model_dir("llama", "tiny")
    prompts = random_prompts(8, 512, min_len=5, max_len=60, seed=4, shared_prefix=12)
    params = greedy(8, prompt_logprobs=1)
    want = make_llm(folder).generate(prompts, params, use_tqdm=False)
    llm = make_llm(folder, max_num_batched_tokens=48, num_gpu_blocks=14, block_size=16)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert llm.scheduler.num_preemptions > 0
    assert [len(o.prompt_logprobs) for o in got] == [len(p) for p in prompts]
    assert [(o.prompt_logprobs, o.outputs[0].token_ids) for o in got] == \
        [(o.prompt_logprobs, o.outputs[0].token_ids) for o in want]
