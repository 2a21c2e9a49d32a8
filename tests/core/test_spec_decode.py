"""Speculative decoding changes no bit: tokens and logprobs with it on equal those with it off.

Two kinds of drafts: the real drafters (ngram, suffix) on prompts that repeat themselves, and an
oracle that drafts the output speculation-off gave, corrupted at chosen places, so drafts are
accepted at every position and rejected at every position, under every feature the engine has.
"""
from __future__ import annotations

import json

import pytest

from services.core.config import SchedulerConfig, SpeculativeConfig
from services.core.drafters import GlobalSuffixTree, NgramDrafter, SuffixDrafter
from services.core.errors import InvalidArgument
from services.core.sampling_params import SamplingParams
from tests.conftest import make_llm, random_prompts
from tests.waits import is_idle

# drafted at every batch size (the default stops at 3 running): these tests are about the bits, not the speed
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "min_speculative_tokens": 4, "prompt_lookup_max": 4,
         "prompt_lookup_min": 1, "disable_by_batch_size": 0}
K = 4


def repetitive_prompts(num: int, seed: int) -> list[list[int]]:
    """Prompts that quote themselves, so lookups find matches."""
    return [p * 3 for p in random_prompts(num, 512, 4, 24, seed=seed)]


def results(outs) -> list:
    return [[(o.token_ids, o.logprobs, o.finish_reason, o.text) for o in out.outputs] for out in outs]


def oracle(llm, reference, corrupt_at=lambda position: position % 5 == 3, request_ids=None):
    """Give the engine (an LLM, or a core Scheduler) a drafter that drafts the speculation-off output,
    with a wrong token wherever corrupt_at(output position) says (the engine's own bookkeeping of
    acceptance stays). request_ids: the reference's, in order (default: the LLM's, "0", "1", ...)."""
    scheduler = getattr(llm, "scheduler", llm)
    request_ids = request_ids or [str(i) for i in range(len(reference))]
    want = {(request_id, o.index): o.token_ids for request_id, out in zip(request_ids, reference) for o in out.outputs}

    class Oracle:
        def __init__(self, seq_id):
            self.seq = scheduler.seqs[seq_id]

        def extend(self, tokens):
            pass

        def propose(self, k):
            done = len(self.seq.output_token_ids)
            truth = want[(self.seq.request.request_id, self.seq.sample_index)][done:done + k]
            return [(t + 1) % 512 if corrupt_at(done + i) else t for i, t in enumerate(truth)]

    scheduler.speculator._new_drafter = Oracle
    return llm


# ---- drafters ----------------------------------------------------------------------------
def test_ngram_drafts_what_followed_the_latest_earlier_occurrence_of_the_longest_match():
    drafter = NgramDrafter(min_n=1, max_n=3)
    drafter.extend([1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3])
    assert drafter.propose(3) == [7, 8, 5]  # "2 3" last occurred before 7 (the longer "5 2 3" never)
    drafter.extend([6])
    assert drafter.propose(2) == []  # 6 never occurred before
    drafter.extend([1, 2])
    assert drafter.propose(4) == [3, 7, 8, 5]  # "6 1 2" unseen; "1 2" latest before 3


def test_suffix_drafts_the_most_frequent_continuation_and_the_global_tree_stays_bounded():
    drafter = SuffixDrafter(max_depth=8, min_count=1, global_tree=None)
    drafter.extend([4, 5, 6, 4, 5, 6, 4, 5, 7, 4, 5])
    assert drafter.propose(2) == [6, 4]  # after "4 5": 6 twice, 7 once
    tree = GlobalSuffixTree(max_depth=8, max_tokens=10)
    tree.add([1, 2, 3, 4, 5, 6])
    with_global = SuffixDrafter(max_depth=8, min_count=1, global_tree=tree)
    with_global.extend([9, 1, 2])
    assert with_global.propose(3) == [3, 4, 5]  # from a past output
    tree.add([7, 8, 9, 7, 8])  # 11 tokens: the oldest output leaves
    assert tree.num_tokens == 5 and with_global.propose(3) == []
    assert not tree.trie.root.children.keys() - {7, 8, 9}


def test_speculative_config_is_spelled_as_vllm_spells_it():
    config = SchedulerConfig(speculative_config=json.dumps(NGRAM)).speculative_config
    assert config == SpeculativeConfig(**NGRAM) == SpeculativeConfig.of(NGRAM)
    assert SchedulerConfig(speculative_config="").speculative_config is None
    with pytest.raises(InvalidArgument, match=r"speculative_config: unknown key\(s\) \['draft_model'\]"):
        SchedulerConfig(speculative_config={"method": "ngram", "draft_model": "x"})
    with pytest.raises(InvalidArgument, match="^speculative_config: method: must be one of"):
        SpeculativeConfig.of({"method": "eagle"})
    with pytest.raises(InvalidArgument, match="^speculative_config: not JSON"):
        SpeculativeConfig.of("{method: ngram}")
    with pytest.raises(InvalidArgument, match=r"^speculative_config: min_speculative_tokens: must be in 1\.\.num_"):
        SpeculativeConfig.of({"num_speculative_tokens": 4, "min_speculative_tokens": 5})


def test_adaptive_draft_length_doubles_after_a_full_accept_and_falls_back_after_a_miss():
    """min_speculative_tokens: drafts start short, double while every draft is kept (up to
    num_speculative_tokens), and after a miss restart at max(min, kept + 1)."""
    from services.core.spec_decode import Speculator
    spec = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=7, min_speculative_tokens=2,
                                        prompt_lookup_max=2, prompt_lookup_min=1, min_acceptance_rate=0.0))
    tokens = list(range(1, 40)) + [1, 2]  # "1 2" occurred before, followed by 37 tokens: a draft as long as asked
    drafted = []
    for kept in [2, 4, 7, 7, 5, 6, 0, 2, 1]:  # how many of each draft the verify keeps (all of the first four)
        draft = spec.propose(0, tokens, 100)
        drafted.append(len(draft))
        spec.record(0, len(draft), min(kept, len(draft)))
    # 8 capped at 7; a miss keeping 5 -> 6, kept whole -> 7; keeping 0 -> 2; 2 of 2 -> 4
    assert drafted == [2, 4, 7, 7, 7, 6, 7, 2, 4]
    assert spec.stats.accepted_per_pos == [8, 7, 5, 5, 4, 3, 2]
    fixed = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=2,
                                         prompt_lookup_min=1))
    assert [len(fixed.propose(0, tokens, 100)) for _ in range(2)] == [3, 3]  # unset: the fixed length


# ---- the engine: on equals off -----------------------------------------------------------
@pytest.fixture(scope="module")
def prompts():
    return repetitive_prompts(4, seed=11)


PARAMS = {
    "greedy": SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=5),
    "seeded": SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=3, max_tokens=32, ignore_eos=True,
                             logprobs=5),
    # penalties and min_tokens read the drafts before each verified position as output tokens
    "penalties": SamplingParams(temperature=0.7, seed=5, max_tokens=40, min_tokens=30, repetition_penalty=1.3,
                                presence_penalty=0.5, frequency_penalty=0.3, logprobs=3, stop_token_ids=(7, 11)),
}


@pytest.fixture(scope="module")
def reference(tiny_llama, prompts):
    """Speculation off: what every run below must reproduce."""
    llm = make_llm(tiny_llama, dtype="float32")
    return {name: llm.generate(prompts, params, use_tqdm=False) for name, params in PARAMS.items()}


@pytest.mark.parametrize("name", list(PARAMS))
def test_oracle_drafts_give_the_same_tokens_and_logprobs(tiny_llama, prompts, reference, name):
    """Drafts accepted at every position and rejected at every position: the verify pass's logits
    are the decode steps' to the bit (k + 1 tokens in one chunk), and its samples the sampler's."""
    llm = oracle(make_llm(tiny_llama, dtype="float32", speculative_config=NGRAM), reference[name])
    assert results(llm.generate(prompts, PARAMS[name], use_tqdm=False)) == results(reference[name])
    stats = llm.scheduler.stats()
    assert all(n > 0 for n in stats.spec_decode_num_accepted_tokens_per_pos), stats
    assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens  # some were rejected
    assert is_idle(stats)


def test_a_verify_chunk_of_k_plus_1_tokens_gets_the_decode_steps_logits_to_the_bit(tiny_llama):
    """What exact verification stands on: a token's logits are the same bits whether it arrives in a
    decode step or in a k + 1-token verify chunk (the kernels' prefill/decode equality, rule 4)."""
    import torch

    from services.core.step import CachedSequence, NewSequence, StepDelta

    runner = make_llm(tiny_llama, dtype="float32", num_gpu_blocks=64).engine.workers["worker-0"].runner
    seen = []
    compute_logits = runner.model.compute_logits
    runner.model.compute_logits = lambda hidden: seen.append(compute_logits(hidden)) or seen[-1]
    prompt, params = random_prompts(1, 512, 30, 30, seed=4)[0], SamplingParams(temperature=0, max_tokens=64)

    def start(seq_id, blocks):
        new = NewSequence(seq_id=seq_id, prompt_token_ids=prompt, output_token_ids=[], block_ids=blocks,
                          num_computed_tokens=0, num_scheduled_tokens=len(prompt), params=params.with_seed(0))
        return runner.execute(StepDelta(step_id=0, new_seqs=[new])).outputs[0].token_ids[0]

    tokens = [start(0, [0, 1, 2])]
    decode_rows = []
    for i in range(K + 1):  # decode steps, one token each
        cached = CachedSequence(seq_id=0, new_token_ids=[tokens[-1]], new_block_ids=[],
                                num_computed_tokens=len(prompt) + i, num_scheduled_tokens=1)
        tokens.append(runner.execute(StepDelta(step_id=1 + i, cached_seqs=[cached])).outputs[0].token_ids[0])
        decode_rows.append(seen[-1][0])
    assert start(1, [3, 4, 5]) == tokens[0]
    cached = CachedSequence(seq_id=1, new_token_ids=[tokens[0]], new_block_ids=[], num_computed_tokens=len(prompt),
                            num_scheduled_tokens=K + 1, draft_token_ids=tokens[1:K + 1])
    out = runner.execute(StepDelta(step_id=9, cached_seqs=[cached])).outputs[0]
    assert out.token_ids == tokens[1:K + 2]  # every draft kept, then the sampler's own token
    verify_rows = seen[-1]
    assert verify_rows.shape[0] == K + 1
    for i in range(K + 1):
        assert torch.equal(verify_rows[i], decode_rows[i]), f"position {len(prompt) + i}"


@pytest.mark.parametrize("method", ["ngram", "ngram-adaptive", "suffix"])
def test_real_drafters_give_the_same_tokens_and_logprobs(tiny_llama, prompts, reference, method):
    config = {"ngram": NGRAM,
              "ngram-adaptive": {**NGRAM, "num_speculative_tokens": 7, "min_speculative_tokens": 2,
                                 "prompt_lookup_max": 8},
              "suffix": {"method": "suffix", "num_speculative_tokens": K, "suffix_global_max_tokens": 4096,
                         "disable_by_batch_size": 0}}[method]
    llm = make_llm(tiny_llama, dtype="float32", speculative_config=config)
    for name in ("greedy", "seeded") if method != "suffix" else ("greedy",):
        assert results(llm.generate(prompts, PARAMS[name], use_tqdm=False)) == results(reference[name]), name
    assert llm.scheduler.stats().spec_decode_num_accepted_tokens > 0


@pytest.mark.slow
@pytest.mark.parametrize("case", ["recompute", "swap", "prefix"])
def test_same_under_preemption_and_prefix_caching(tiny_llama, prompts, reference, case):
    engine_args = {"recompute": dict(num_gpu_blocks=20, preemption_mode="recompute"),
                   "swap": dict(num_gpu_blocks=20, preemption_mode="swap"),
                   "prefix": dict(enable_prefix_caching=True)}[case]
    llm = oracle(make_llm(tiny_llama, dtype="float32", speculative_config=NGRAM, **engine_args),
                 reference["seeded"])
    if case == "prefix":  # the first run caches the prompts' (and the outputs') blocks; the second hits them
        llm.generate(prompts, PARAMS["seeded"], use_tqdm=False)
        llm._ids = iter(range(100))  # the same request ids, for the oracle
    got = llm.generate(prompts, PARAMS["seeded"], use_tqdm=False)
    assert results(got) == results(reference["seeded"])
    stats = llm.scheduler.stats()
    if case == "prefix":
        assert stats.workers[0].prefix_cache_hits > 0
    else:
        assert llm.scheduler.num_preemptions > 0
    assert stats.spec_decode_num_accepted_tokens > 0
    assert is_idle(stats)


def test_parallel_samples_and_stop_strings(tiny_llama, prompts):
    """n > 1 (each child drafts on its own) and stop strings (a verify pass's tokens past the match
    are dropped, as the later steps would never have run)."""
    base = make_llm(tiny_llama, dtype="float32")
    probe = base.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    stop = probe[0].outputs[0].text[12:15]  # a string the output reaches mid-way
    params = [SamplingParams(n=3, temperature=1.0, seed=9, max_tokens=30, ignore_eos=True, logprobs=1),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=(stop,), logprobs=1)]
    want = base.generate(prompts[:2], params, use_tqdm=False)
    assert want[1].outputs[0].stop_reason == stop or want[1].outputs[0].finish_reason == "length"
    llm = oracle(make_llm(tiny_llama, dtype="float32", speculative_config=NGRAM), want,
                 corrupt_at=lambda position: position % 7 == 6)
    assert results(llm.generate(prompts[:2], params, use_tqdm=False)) == results(want)


def test_structured_outputs_check_drafts_with_the_grammar(tiny_llama):
    """Drafts outside the grammar are cut before sampling; the matcher is rolled back after the
    verify pass moved it along the drafts."""
    prompts = random_prompts(4, 512, 3, 30, seed=1)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=60,
                             structured_outputs={"regex": r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)"}) for s in range(4)]
    want = make_llm(tiny_llama, dtype="float32").generate(prompts, params, use_tqdm=False)
    llm = oracle(make_llm(tiny_llama, dtype="float32", speculative_config=NGRAM), want,
                 corrupt_at=lambda position: position % 4 == 2)
    assert results(llm.generate(prompts, params, use_tqdm=False)) == results(want)
    assert llm.scheduler.stats().spec_decode_num_accepted_tokens > 0


def test_a_request_whose_drafts_fail_pauses_for_longer_each_time_then_drafts_again():
    """Acceptance is judged per window of min_draft_tokens drafted tokens; below the rate, drafting pauses
    for min_draft_tokens generated tokens, then twice as long, and a window at the rate keeps drafting."""
    from services.core.spec_decode import Speculator
    spec = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_max=2,
                                        prompt_lookup_min=1, min_draft_tokens=4, min_acceptance_rate=0.5))
    tokens = [1, 2] * 4  # a repeating sequence: always a draft to propose
    drafted = []

    def step(accepted: int) -> None:
        draft = spec.propose(0, tokens, 8)
        if draft:
            spec.record(0, len(draft), min(accepted, len(draft)))
        drafted.append(len(draft))
        for _ in range(min(accepted, len(draft)) + 1):  # what the verify kept, then the sampler's token
            tokens.append(3 - tokens[-1])  # 1, 2, 1, 2, ...: the last two tokens always occurred before

    for accepted in [0] * 16 + [1] * 8:
        step(accepted)
    assert drafted == ([2, 2] + [0] * 4  # 0 of 4 accepted: a pause of 4 tokens
                       + [2, 2] + [0] * 8  # again: 8 tokens
                       + [2] * 8)  # then 1 of 2 accepted each step: at the rate, drafting goes on
    spec = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_max=2,
                                        prompt_lookup_min=1, min_draft_tokens=4, min_acceptance_rate=0.5))
    tokens, drafted = [1, 2] * 4, []
    for accepted in [0, 0] + [0] * 4 + [1] * 12:  # fails once, then half its drafts pass: never paused again
        step(accepted)
    assert drafted == [2, 2, 0, 0, 0, 0] + [2] * 12
    assert spec.stats.num_draft_tokens == 28 and spec.stats.num_accepted_tokens == 12


def test_no_drafts_at_batch_sizes_where_it_does_not_pay_and_for_requests_it_does_not_help(tiny_llama, prompts):
    llm = make_llm(tiny_llama, dtype="float32", speculative_config={**NGRAM, "disable_by_batch_size": 3})
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert llm.scheduler.stats().spec_decode_num_drafts == 0  # 4 running
    never = make_llm(tiny_llama, dtype="float32", speculative_config={**NGRAM, "min_draft_tokens": 8,
                                                                      "min_acceptance_rate": 1.0})
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    never = oracle(never, make_llm(tiny_llama, dtype="float32").generate(prompts[:1], params, use_tqdm=False),
                   corrupt_at=lambda position: True)
    never.generate(prompts[:1], params, use_tqdm=False)
    # judged after 8 drafted tokens (2 verifies): a pause of 8 generated tokens, then drafts again, each capped by
    # the tokens left (4 + 3 + 2, when the window is judged again and the next pause outlasts the request)
    assert never.scheduler.stats().spec_decode_num_draft_tokens == 8 + 4 + 3 + 2


@pytest.fixture(scope="module")
def default_model_off():
    """The real default model (SmolLM2-135M-Instruct, the weights it serves) on a copy-heavy prompt,
    greedy and seeded, speculation off: (folder, prompts, [(params, results)])."""
    from services.tools.default_model import ensure_default_model

    folder = ensure_default_model()
    off = make_llm(folder, num_gpu_blocks=64)
    code = "def add(first, second):\n    total = first + second\n    return total\n"
    chat = off.tokenizer.apply_chat_template([{"role": "user", "content": f"Repeat this code:\n{code}"}])
    prompts = [off.tokenizer.encode(chat + "```python\ndef add(", add_special_tokens=False)]
    params = [SamplingParams(temperature=0, max_tokens=16, logprobs=3),
              SamplingParams(temperature=0.8, seed=1, max_tokens=16, logprobs=3)]
    runs = [(p, results(off.generate(prompts, p, use_tqdm=False))) for p in params]
    off.close()
    return folder, prompts, runs


@pytest.mark.slow
def test_default_model_same_tokens_and_logprobs_with_drafts(default_model_off):
    """On equals off, greedy and seeded, with drafts really accepted (the n-gram drafter; the suffix drafter's
    real drafts are checked on the tiny model by test_real_drafters_give_the_same_tokens_and_logprobs)."""
    folder, prompts, runs = default_model_off
    with make_llm(folder, num_gpu_blocks=64, speculative_config=NGRAM) as on:
        for params, want in runs:
            assert results(on.generate(prompts, params, use_tqdm=False)) == want
        assert on.scheduler.stats().spec_decode_num_accepted_tokens > 0
