"""The frontend over real gRPC on loopback, in front of a fake scheduler (frontend_harness.py)."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2
from tokenizers import Tokenizer as HFTokenizer

from tests.frontend.frontend_harness import FAKE_SEED, MAX_MODEL_LEN, MODEL_ID, Harness, echo_token
from pagedserve import AsyncClient, Client, GenerationError
from services.core.tokenizer import Tokenizer

MULTIBYTE = "你好, 世界 😀🎉 café"


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return Tokenizer(tiny_llama)


@pytest.fixture(scope="module")
def harness(tiny_llama, tokenizer):
    harness = Harness(tiny_llama, tokenizer.vocab_size)
    assert harness.wait_for(lambda: harness.health() == health_pb2.HealthCheckResponse.SERVING)
    yield harness
    harness.close()


@pytest.fixture(scope="module")
def client(harness):
    with Client(harness.address) as client:
        yield client


def echo(prompt: list[int], max_tokens: int, sample_index: int = 0) -> list[int]:
    return [echo_token(prompt, sample_index, p) for p in range(max_tokens)]


def byte_token_ids(model_dir, text: str) -> list[int]:
    """One byte-level token per UTF-8 byte, so every multi-byte character spans several tokens."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in printable]
    char = {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(extra)}}
    vocab = HFTokenizer.from_file(str(model_dir / "tokenizer.json")).get_vocab()
    return [vocab[char[b]] for b in text.encode()]


def test_text_prompt_streams_text_equal_to_the_decoded_ids(harness, client, tokenizer):
    prompt_ids = tokenizer.encode(MULTIBYTE)
    stream = client.stream(MULTIBYTE, max_tokens=3 * len(prompt_ids), temperature=0)
    deltas = list(stream)
    result = stream.result
    assert harness.fake.submitted[-1].prompt_token_ids == prompt_ids
    assert result.token_ids == echo(prompt_ids, 3 * len(prompt_ids))
    assert result.text == tokenizer.decode(result.token_ids) == MULTIBYTE * 3
    assert "".join(d.text for d in deltas) == result.text and not any("\ufffd" in d.text for d in deltas)
    assert result.samples[0].finish_reason == "length"
    assert (result.num_prompt_tokens, result.num_completion_tokens) == (len(prompt_ids), 3 * len(prompt_ids))


def test_token_ids_prompt_splitting_multibyte_characters(harness, client, tiny_llama):
    prompt_ids = byte_token_ids(tiny_llama, "中文😀")  # 3 + 3 + 4 bytes
    deltas = list(client.stream(prompt_ids, max_tokens=len(prompt_ids), temperature=0))
    assert [d.token_ids for d in deltas] == [[t] for t in prompt_ids]  # one byte per message
    assert [d.text for d in deltas] == ["", "", "中", "", "", "文", "", "", "", "😀"]


def test_chat_prompt_is_rendered_with_the_template(harness, client, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Bonjour 👋"}]
    expected = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    result = client.generate(messages, max_tokens=4)
    assert list(harness.fake.submitted[-1].prompt_token_ids) == expected == client.tokenize(messages)
    assert result.token_ids == expected[:4]
    assert client.detokenize(expected, skip_special_tokens=False) == tokenizer.apply_chat_template(messages)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_is_cut_never_streamed_and_ends_the_sample_at_the_scheduler(harness, client, include):
    stream = client.stream("abc STOP def", max_tokens=40, stop=["STOP", "never"], include_stop_str_in_output=include,
                           request_id=f"stop-{include}")
    texts = [d.text for d in stream]
    sample = stream.result.samples[0]
    assert "".join(texts) == sample.text == ("abc STOP" if include else "abc ")
    assert (sample.finish_reason, sample.stop_reason) == ("stop", "STOP")
    # the sample is stopped, then the request cancelled, in that order on its SubmitMany call
    assert harness.wait_for(lambda: f"stop-{include}" in harness.fake.cancelled)
    assert (f"stop-{include}", 0) in harness.fake.aborts
    assert stream.result.num_completion_tokens == len(sample.token_ids) < 40


def test_two_samples_with_logprobs_and_seed(harness, client, tokenizer):
    prompt_ids = tokenizer.encode("twin samples")
    result = client.generate(prompt_ids, n=2, max_tokens=5, logprobs=2, prompt_logprobs=1, seed=7)
    assert [s.token_ids for s in result.samples] == [echo(prompt_ids, 5, 0), echo(prompt_ids, 5, 1)]
    assert [s.text for s in result.samples] == [tokenizer.decode(s.token_ids) for s in result.samples]
    for sample in result.samples:
        assert [lp.token_id for lp in sample.logprobs] == sample.token_ids
        assert all(len(lp.top) == 2 and lp.rank == 1 for lp in sample.logprobs)
    assert result.prompt_logprobs[0] is None and [lp.token_id for lp in result.prompt_logprobs[1:]] == prompt_ids[1:]
    assert (result.seed, result.num_completion_tokens) == (7, 10)
    assert client.generate(prompt_ids, max_tokens=1).seed == FAKE_SEED  # unset: the scheduler's choice


def test_list_models_and_tokenize(client, tokenizer):
    [model] = client.list_models()
    assert (model.id, model.max_model_len, model.vocab_size) == (MODEL_ID, MAX_MODEL_LEN, tokenizer.vocab_size)
    assert client.tokenize(MULTIBYTE) == tokenizer.encode(MULTIBYTE)
    assert client.detokenize(tokenizer.encode(MULTIBYTE)) == MULTIBYTE


def test_async_client_streams_and_cancelling_cancels_the_submit_call(harness):
    async def first_deltas():
        async with AsyncClient(harness.address) as client:
            stream = client.generate("a long echo", max_tokens=60, request_id="to-cancel")
            seen = []
            async for delta in stream:
                seen.append(delta)
                if len(seen) == 3:
                    stream.cancel()
                    break
            return seen

    assert len(asyncio.run(first_deltas())) == 3
    assert harness.wait_for(lambda: "to-cancel" in harness.fake.cancelled)
    assert harness.wait_for(lambda: harness.frontend.core.num_pending == 0)


def test_breaking_out_of_a_sync_stream_cancels_the_call(harness):
    with Client(harness.address) as client:
        for i, _ in enumerate(client.stream("a long echo", max_tokens=60, request_id="left-early")):
            if i == 2:
                break  # no explicit cancel(): leaving the loop is enough
    assert harness.wait_for(lambda: "left-early" in harness.fake.cancelled)


def test_concurrent_requests_share_one_scheduler_call_and_a_broken_one_is_replaced(harness):
    """Every request travels on one SubmitMany call (one message a step for all of them); when
    the scheduler drops that call, the requests on it are carried over to a new call as
    continuations (the tokens already streamed, the same seed) and finish as if nothing happened."""
    async def run_four():
        async with AsyncClient(harness.address) as client:
            return await asyncio.gather(*(client.complete(f"echo {i}", max_tokens=5) for i in range(4)))

    results = asyncio.run(run_four())
    assert [len(r.token_ids) for r in results] == [5] * 4
    assert harness.fake.num_calls == 1

    with Client(harness.address) as client:
        want = client.generate("a long echo", max_tokens=60, n=2, logprobs=1)
        stream = client.stream("a long echo", max_tokens=60, n=2, logprobs=1)
        next(iter(stream))
        harness.fake.drop_calls = True
        list(stream)
        assert stream.result.samples == want.samples and stream.result.seed == want.seed
        assert len(client.generate("echo again", max_tokens=3).token_ids) == 3
    assert harness.fake.num_calls == 2
    continuation = harness.fake.submitted[-2]
    assert continuation.params.HasField("seed") and continuation.params.seed == want.seed
    assert [c.sample_index for c in continuation.continued_samples] == [0, 1]
    assert all(0 < len(c.token_ids) < 60 for c in continuation.continued_samples)
    assert harness.wait_for(lambda: harness.frontend.core.num_pending == 0)
