"""A continuation (SubmitRequest.continued_samples) over real gRPC: a request resubmitted with the
tokens it already streamed goes on with exactly the tokens and logprobs of an undisturbed run."""
from __future__ import annotations

import grpc
import pytest

from services.core.sampling_params import SamplingParams
from services.core.sequence import ContinuedSample
from services.rpc import internal_codec
from tests.conftest import greedy
from tests.services.cluster import Cluster, Generation, OneRequestCall, run

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


@pytest.mark.parametrize("cut", [0.0, 0.4])
def test_a_continuation_goes_on_with_the_tokens_and_logprobs_of_an_undisturbed_run(model, cut):
    async def main():
        cluster = await Cluster(model).start(num_workers=1)
        try:
            for name, params in CASES.items():
                whole = await cluster.generate(f"{name}-whole", PROMPT, params)
                continued = split(whole, params, cut)
                params = params.with_seed(params.seed if params.seed is not None else 0)
                rest = await continue_request(cluster, f"{name}-rest", params, continued)
                assert sorted(rest.samples) == list(range(params.n)), name
                for c in continued:
                    want, got = whole.samples[c.sample_index], rest.samples[c.sample_index]
                    assert list(c.token_ids) + got.token_ids == want.token_ids, (name, c.sample_index)
                    assert got.logprobs == want.logprobs[len(c.token_ids):], name  # exact floats
                    assert got.finish_reason == want.finish_reason, name
            stats = await cluster.stats()
            assert all(w.num_free_gpu_blocks == w.num_gpu_blocks for w in stats.workers)
        finally:
            await cluster.close()

    run(main())


def test_a_continuation_runs_only_the_samples_it_names(model):
    """n=2 with sample 1 already finished at the frontend: only sample 0 runs, and the stream ends."""
    params = CASES["n2"]

    async def main():
        cluster = await Cluster(model).start(num_workers=1)
        try:
            whole = await cluster.generate("whole", PROMPT, params)
            rest = await continue_request(cluster, "rest", params, (ContinuedSample(0, tuple(whole.samples[0].token_ids[:5])),))
            assert list(rest.samples) == [0]
            assert whole.samples[0].token_ids[:5] + rest.samples[0].token_ids == whole.samples[0].token_ids
        finally:
            await cluster.close()

    run(main())


@pytest.mark.parametrize("continued, field", [
    ((ContinuedSample(0, tuple(range(3, 27))),), "continued_samples"),   # no room left under max_tokens 24
    ((ContinuedSample(2, (5,)),), "continued_samples"),                  # n is 2
    ((ContinuedSample(0, (5,)), ContinuedSample(0, (6,))), "continued_samples"),
    ((ContinuedSample(0, (9999,)),), "continued_samples"),              # outside the vocabulary
])
def test_a_bad_continuation_is_refused_naming_the_field(model, continued, field):
    async def main():
        cluster = await Cluster(model).start(num_workers=1)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await continue_request(cluster, "bad", CASES["n2"], continued)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert error.value.details().startswith(field)
            stats = await cluster.stats()
            assert stats.num_waiting == 0 and stats.num_running == 0
        finally:
            await cluster.close()

    run(main())


def test_a_continuation_without_a_seed_is_refused(model):
    async def main():
        cluster = await Cluster(model).start(num_workers=1)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await continue_request(cluster, "bad", SamplingParams(max_tokens=8), (ContinuedSample(0, (5,)),))
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "seed" in error.value.details()
        finally:
            await cluster.close()

    run(main())

