"""A continuation (SubmitRequest.continued_samples) over real gRPC: a request resubmitted with the
tokens it already streamed goes on with exactly the tokens and logprobs of an undisturbed run."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from services.core.sampling_params import SamplingParams
from services.core.sequence import ContinuedSample
from services.rpc import internal_codec
from tests.conftest import greedy
from tests.cluster import Cluster, Generation, OneRequestCall, run

PROMPT = [5, 77, 301, 42, 9, 260, 13]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
CASES = {
    "greedy": greedy(24, logprobs=1),
    "seeded_with_penalties": SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=24, logprobs=2,
                                            repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4,
                                            ignore_eos=True),
    "n2": SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=24, logprobs=1, ignore_eos=True),
    "min_tokens": SamplingParams(temperature=1.2, seed=5, max_tokens=24, min_tokens=20, logprobs=0),
    "json_schema": SamplingParams(temperature=1.0, seed=3, max_tokens=40, logprobs=0,
                                  structured_outputs={"json": SCHEMA}),
}


@pytest.fixture(scope="module")
def model(model_dir):
    return model_dir("llama", "tiny")


async def continue_request(cluster: Cluster, request_id: str, params: SamplingParams,
                           continued: tuple[ContinuedSample, ...]) -> Generation:
    out = Generation()
    request = internal_codec.submit_to_proto(request_id, PROMPT, params, 0, continued)
    async for response in OneRequestCall(cluster.stub, request):
        out.add(request_id, response)
    return out


def split(whole: Generation, params: SamplingParams, cut: float) -> tuple[ContinuedSample, ...]:
    """Each sample's first `cut` share of tokens (sample i cut a little later than sample i-1)."""
    return tuple(ContinuedSample(i, tuple(whole.samples[i].token_ids[:int(len(whole.samples[i].token_ids) * cut) + i]))
                 for i in range(params.n))


@pytest.mark.slow
def test_a_continuation_goes_on_with_the_tokens_and_logprobs_of_an_undisturbed_run(model):
    """Cut at the start (sample 0 with no token yet, sample 1 with one) and after 40%; and n=2 with
    sample 1 finished at the frontend, so only sample 0 runs and the stream still ends."""
    async def main():
        async with Cluster(model, num_workers=1) as cluster:
            wholes = await asyncio.gather(*(cluster.generate(f"{name}-whole", PROMPT, params)
                                            for name, params in CASES.items()))
            for cut in (0.0, 0.4):
                splits = [split(whole, params, cut) for whole, params in zip(wholes, CASES.values())]
                rests = await asyncio.gather(*(
                    continue_request(cluster, f"{name}-{cut}", params.with_seed(params.seed or 0), continued)
                    for (name, params), continued in zip(CASES.items(), splits)))
                for name, params, whole, continued, rest in zip(CASES, CASES.values(), wholes, splits, rests):
                    assert sorted(rest.samples) == list(range(params.n)), name
                    for c in continued:
                        want, got = whole.samples[c.sample_index], rest.samples[c.sample_index]
                        assert list(c.token_ids) + got.token_ids == want.token_ids, (name, cut, c.sample_index)
                        assert got.logprobs == want.logprobs[len(c.token_ids):], (name, cut)  # exact floats
                        assert got.finish_reason == want.finish_reason, (name, cut)
            n2 = wholes[list(CASES).index("n2")]
            rest = await continue_request(cluster, "only-0", CASES["n2"],
                                          (ContinuedSample(0, tuple(n2.samples[0].token_ids[:5])),))
            assert list(rest.samples) == [0]
            assert n2.samples[0].token_ids[:5] + rest.samples[0].token_ids == n2.samples[0].token_ids
            await cluster.wait_idle()

    run(main())


BAD = [((ContinuedSample(0, tuple(range(3, 27))),), "continued_samples"),  # no room left under max_tokens 24
       ((ContinuedSample(2, (5,)),), "continued_samples"),                 # n is 2
       ((ContinuedSample(0, (5,)), ContinuedSample(0, (6,))), "continued_samples"),
       ((ContinuedSample(0, (9999,)),), "continued_samples")]              # outside the vocabulary


def test_a_bad_continuation_is_refused_naming_the_field(model):
    async def main():
        async with Cluster(model, num_workers=1) as cluster:
            for continued, field in BAD + [((ContinuedSample(0, (5,)),), "seed")]:
                params = CASES["n2"] if field != "seed" else SamplingParams(max_tokens=8)  # no seed
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await continue_request(cluster, "bad", params, continued)
                assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert error.value.details().startswith(field), error.value.details()
            stats = await cluster.stats()
            assert stats.num_waiting == 0 and stats.num_running == 0

    run(main())
