"""The sampler: semantics of each parameter, seeded draws, and batch invariance (rule 4)."""
import random
from collections import Counter

import pytest
import torch
from hypothesis import given, settings, strategies as st

from services.core import seeding
from services.core.sampling_params import SamplingParams
from services.worker import sampler
from services.worker.sampler import SamplingRow, prompt_logprobs, sample

EOS = (2,)


def make_row(params=None, seed=7, sample_index=0, position=10, prompt=(), output=(), **kwargs):
    params = (params or SamplingParams(**kwargs)).with_seed(seed)
    return SamplingRow(params=params, sample_index=sample_index, position=position,
                       prompt_token_ids=list(prompt), output_token_ids=list(output))


def draws(logits, params, num_draws=2000, seed=3):
    """Tokens sampled from one row of logits at positions 0..num_draws-1 (one batch)."""
    rows = [make_row(params, seed=seed, position=p) for p in range(num_draws)]
    return [token for token, _ in sample(logits.expand(num_draws, -1), rows, EOS)]


# --- greedy ---

def test_greedy_is_argmax_and_ties_go_to_the_lowest_id():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -2.0, -0.5, -3.0]])
    rows = [make_row(temperature=0) for _ in range(3)]
    assert [token for token, _ in sample(logits, rows, EOS)] == [1, 0, 2]


# --- seeded draws ---

def test_same_seed_index_position_gives_the_same_token_and_others_vary():
    logits = torch.zeros(1, 1000)
    one = [sample(logits, [make_row(seed=5, sample_index=1, position=40)], EOS)[0][0] for _ in range(3)]
    assert len(set(one)) == 1
    by_position = {sample(logits, [make_row(seed=5, position=p)], EOS)[0][0] for p in range(50)}
    by_index = {sample(logits, [make_row(seed=5, sample_index=i)], EOS)[0][0] for i in range(50)}
    by_seed = {sample(logits, [make_row(seed=s)], EOS)[0][0] for s in range(50)}
    assert min(len(by_position), len(by_index), len(by_seed)) > 40


def test_uniform_is_a_pure_function_in_the_unit_interval():
    values = [seeding.uniform(11, i % 3, p) for i in range(3) for p in range(3000)]
    assert values == [seeding.uniform(11, i % 3, p) for i in range(3) for p in range(3000)]
    assert all(0.0 <= v < 1.0 for v in values)
    assert abs(sum(values) / len(values) - 0.5) < 0.02
    assert len(set(values)) == len(values)
    assert 0 <= seeding.new_request_seed() < 2**63


def test_sampled_frequencies_match_the_distribution():
    probs = torch.tensor([0.30, 0.20, 0.15, 0.12, 0.10, 0.08, 0.04, 0.01])
    num_draws = 8000
    counts = Counter(draws(probs.log()[None], SamplingParams(), num_draws))
    chi2 = sum((counts[t] - num_draws * p) ** 2 / (num_draws * p) for t, p in enumerate(probs.tolist()))
    assert chi2 < 30  # 7 degrees of freedom: p(chi2 > 30) < 1e-4


def test_temperature_sharpens_and_flattens():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    cold = Counter(draws(logits, SamplingParams(temperature=0.25)))
    hot = Counter(draws(logits, SamplingParams(temperature=4.0)))
    assert cold[0] > 0.95 * 2000 and hot[0] < 0.4 * 2000 and hot[3] > 0.1 * 2000


# --- filters keep exactly the intended sets ---

PROBS = torch.tensor([0.05, 0.30, 0.02, 0.20, 0.20, 0.13, 0.10])  # ids by rank: 1, (3, 4), 5, 6, 0, 2


@pytest.mark.parametrize("params, kept", [
    (SamplingParams(top_k=3), {1, 3, 4}),
    (SamplingParams(top_k=1), {1}),
    (SamplingParams(top_k=0), set(range(7))),
    (SamplingParams(top_p=0.45), {1, 3}),  # a tie at the edge: the lower id goes first
    (SamplingParams(top_p=0.71), {1, 3, 4, 5}),
    (SamplingParams(top_p=0.01), {1}),
    (SamplingParams(min_p=0.5), {1, 3, 4}),
    (SamplingParams(min_p=0.4), {1, 3, 4, 5}),
    (SamplingParams(top_k=4, top_p=0.5, min_p=0.1), {1, 3}),
])
def test_filters_keep_exactly_the_intended_tokens(params, kept):
    assert set(draws(PROBS.log()[None], params)) == kept


def test_top_p_over_a_flat_vocabulary_keeps_the_lowest_ids():
    # 4000 equal tokens: the nucleus is ties all the way down, past the fast path's candidates.
    probs = torch.full((2, 4000), 1 / 4000)
    sampler._top_p_mask(probs, [0.25 + 0.5 / 4000, 1.0])
    assert probs[0].nonzero()[:, 0].tolist() == list(range(1001))
    assert torch.equal(probs[1], torch.full((4000,), 1 / 4000))


# --- logits processors ---

def test_repetition_penalty_matches_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(0)
    logits = torch.randn(1, 50) * 3
    prompt, output = [3, 7, 7, 12, 40], [12, 0, 49, 8]
    ours = sampler._process(logits, [make_row(prompt=prompt, output=output, repetition_penalty=1.3)], EOS)
    theirs = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + output]), logits.clone())
    assert torch.equal(ours, theirs)


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.zeros(1, 10)
    row = make_row(prompt=[1, 5], output=[4, 4, 4, 6], presence_penalty=0.5, frequency_penalty=0.25)
    x = sampler._process(logits, [row], EOS)[0]
    assert x[4].item() == pytest.approx(-1.25) and x[6].item() == pytest.approx(-0.75)
    assert x[[0, 1, 2, 3, 5, 7, 8, 9]].eq(0).all()


def test_logit_bias_can_force_a_token():
    logits = torch.randn(4, 300)
    rows = [make_row(temperature=t, logit_bias={123: 100.0}, seed=s) for t, s in [(0, 1), (1.0, 2), (1.5, 3), (0.7, 4)]]
    assert [token for token, _ in sample(logits, rows, EOS)] == [123] * 4


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_blocks_eos_and_stop_token_ids(temperature):
    logits = torch.zeros(1, 20)
    logits[0, [2, 9]] = 50.0  # EOS and a stop token id dominate
    params = SamplingParams(temperature=temperature, min_tokens=3, stop_token_ids=(9,))
    early = [sample(logits, [make_row(params, output=[5] * n, position=p)], EOS)[0][0]
             for n in range(3) for p in range(30)]
    assert not {2, 9} & set(early)
    assert sample(logits, [make_row(params, output=[5] * 3)], EOS)[0][0] in (2, 9)


# --- logprobs ---

def test_logprobs_report_the_raw_distribution():
    torch.manual_seed(1)
    logits = torch.randn(3, 500)
    logits[1, [10, 20, 30]] = 9.0  # a three-way tie at the top
    rows = [make_row(temperature=0.9, logprobs=5, repetition_penalty=2.0, prompt=[1, 2]),
            make_row(temperature=0, logprobs=3, logit_bias={30: 1.0}),
            make_row(temperature=1.0, logprobs=0)]
    raw = logits.log_softmax(-1)
    for i, (token, lp) in enumerate(sample(logits, rows, EOS)):
        assert lp.token_id == token and lp.logprob == raw[i, token].item()
        assert lp.rank == 1 + int((raw[i] > raw[i, token]).sum())
        k = rows[i].params.logprobs
        best = raw[i].sort(descending=True, stable=True)
        assert lp.top == list(zip(best.indices[:k].tolist(), best.values[:k].tolist()))
    assert sample(logits, rows, EOS)[1][1].top == [(10, raw[1, 10].item()), (20, raw[1, 20].item()),
                                                   (30, raw[1, 30].item())]
    assert sample(logits, rows, EOS)[1][1].token_id == 30
    assert sample(logits, rows, EOS)[1][1].rank == 1


def test_prompt_logprobs_one_entry_per_position():
    torch.manual_seed(2)
    logits = torch.randn(6, 100)
    next_ids = [5, 17, 99, 0, 5, 42]
    entries = prompt_logprobs(logits, next_ids, 2)
    raw = logits.log_softmax(-1)
    assert [e.token_id for e in entries] == next_ids
    for i, e in enumerate(entries):
        assert e.logprob == raw[i, next_ids[i]].item()
        assert e.rank == 1 + int((raw[i] > raw[i, next_ids[i]]).sum())
        assert [t for t, _ in e.top] == raw[i].topk(2).indices.tolist()


# --- batch invariance ---

def mixed_params():
    return [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=50, repetition_penalty=1.2, logprobs=5),
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.0, top_k=50),
        SamplingParams(temperature=0.7, min_p=0.1, logprobs=3),
        SamplingParams(temperature=1.2, presence_penalty=0.8, frequency_penalty=0.4),
        SamplingParams(temperature=1.0, logit_bias={17: 5.0, 40000: 3.0}, logprobs=20),
        SamplingParams(temperature=0.5, top_p=0.5, min_p=0.02),
        SamplingParams(temperature=0, repetition_penalty=1.5, logprobs=1),
        SamplingParams(temperature=1.5, top_k=1000, top_p=0.95),
        SamplingParams(temperature=0.3, min_tokens=5, stop_token_ids=(3,)),
        SamplingParams(temperature=2.0, top_p=0.99, logprobs=0),
        SamplingParams(temperature=1.0, top_k=5, presence_penalty=-1.0),
        SamplingParams(temperature=0.9, top_p=0.8, repetition_penalty=0.8, frequency_penalty=1.0),
        SamplingParams(temperature=1.0, top_p=0.3, logit_bias={5: -100.0}),
    ]


def assert_invariant(logits, rows, seed=0):
    alone = [sample(logits[i:i + 1], [row], EOS)[0] for i, row in enumerate(rows)]
    assert sample(logits, rows, EOS) == alone
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    shuffled = sample(logits[order], [rows[i] for i in order], EOS)
    assert [shuffled[order.index(i)] for i in range(len(rows))] == alone
    pairs = sample(logits[:2], rows[:2], EOS)
    assert pairs == alone[:2]


def test_batch_invariance_over_a_real_vocabulary():
    torch.manual_seed(3)
    vocab = 49152
    logits = torch.randn(16, vocab) * torch.linspace(0.5, 6.0, 16)[:, None]  # flat to peaked
    rows = [make_row(params, seed=100 + i, sample_index=i % 3, position=50 + i, prompt=range(i, 400 + i),
                     output=[7, 7, 17, i]) for i, params in enumerate(mixed_params())]
    assert_invariant(logits, rows)


row_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.3, 1.0, 1.7]),
    top_k=st.sampled_from([-1, 1, 3, 40, 299]),
    top_p=st.sampled_from([1.0, 0.95, 0.5, 0.1]),
    min_p=st.sampled_from([0.0, 0.05, 0.5]),
    repetition_penalty=st.sampled_from([1.0, 1.3]),
    presence_penalty=st.sampled_from([0.0, 1.0]),
    logit_bias=st.sampled_from([(), ((4, 3.0),)]),
    logprobs=st.sampled_from([None, 0, 4]),
)


@settings(max_examples=40, deadline=None)
@given(st.lists(row_params, min_size=1, max_size=9), st.integers(0, 2**32), st.sampled_from([8, 300, 600]))
def test_batch_invariance_random_rows(params, seed, vocab):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(params), vocab, generator=gen) * 3
    logits[:, :4] = logits[:, :1]  # ties
    rows = [make_row(p, seed=seed + i, position=i, prompt=[0, 1, 4], output=[4, 5]) for i, p in enumerate(params)]
    assert_invariant(logits, rows, seed)
    assert all(0 <= token < vocab for token, _ in sample(logits, rows, EOS))

