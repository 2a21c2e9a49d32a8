"""The OpenAI HTTP API of a real frontend, driven by the official openai client, in front of
the fake echo scheduler (frontend_harness.py): shapes, parameters, streaming, metrics."""
from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import openai
import pytest

from tests.frontend.frontend_harness import MAX_MODEL_LEN, MODEL_ID, Harness, echo_token
from pagedserve import Client
from services.core.tokenizer import Tokenizer
from services.launch.deployment import free_ports

MULTIBYTE = "你好, 世界 😀 café"


def http_harness(model_path, **config) -> Harness:
    harness = Harness(model_path, Tokenizer(model_path).vocab_size, http_port=free_ports(1)[0], **config)
    assert harness.wait_for(lambda: harness.frontend.serving)
    harness.url = f"http://127.0.0.1:{harness.frontend.http.port}"
    return harness


def raw(url: str, body=None, headers: dict | None = None, data: bytes | None = None) -> tuple[int, bytes]:
    """Status and body of one request (the openai client hides some of both)."""
    data = data if data is not None else (json.dumps(body).encode() if body is not None else None)
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def metric(text: str, name: str, **labels) -> float:
    """One sample's value from the Prometheus text (0 when absent)."""
    for line in text.splitlines():
        match = re.fullmatch(rf"{re.escape(name)}(?:\{{(.*)\}})? (\S+)", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            return float(match.group(2))
    return 0.0


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return Tokenizer(tiny_llama)


@pytest.fixture(scope="module")
def harness(tiny_llama):
    harness = http_harness(tiny_llama)
    yield harness
    harness.close()


@pytest.fixture(scope="module")
def client(harness):
    return openai.OpenAI(base_url=harness.url + "/v1", api_key="unused", max_retries=0)


def echo(prompt: list[int], max_tokens: int, sample_index: int = 0) -> list[int]:
    return [echo_token(prompt, sample_index, p) for p in range(max_tokens)]


def test_completion_text_usage_and_fingerprint(client, tokenizer):
    prompt_ids = tokenizer.encode(MULTIBYTE)
    result = client.completions.create(model=MODEL_ID, prompt=MULTIBYTE, max_tokens=2 * len(prompt_ids))
    [choice] = result.choices
    assert choice.text == tokenizer.decode(echo(prompt_ids, 2 * len(prompt_ids))) == MULTIBYTE * 2
    assert (choice.finish_reason, result.model, result.object) == ("length", MODEL_ID, "text_completion")
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (len(prompt_ids), 2 * len(prompt_ids))
    assert result.usage.total_tokens == 3 * len(prompt_ids)
    assert result.system_fingerprint == "pagedserve-nondeterministic"  # the fake reports batch_invariant false


def test_streamed_text_equals_the_whole_and_ends_with_usage_then_done(harness, client):
    kwargs = dict(model=MODEL_ID, prompt="stream me, " + MULTIBYTE, max_tokens=20, seed=3)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])
    status, body = raw(harness.url + "/v1/completions", {**kwargs, "stream": True})
    events = body.decode().split("\n\n")
    assert status == 200 and events[-2:] == ["data: [DONE]", ""] and all(e.startswith("data: ") for e in events[:-1])
    assert all("usage" not in json.loads(e[6:]) for e in events[:-2])  # no include_usage: no usage key


def test_prompt_lists_and_n_number_choices_prompt_major(harness, client, tokenizer):
    texts = ["first prompt", "second one"]
    result = client.completions.create(model=MODEL_ID, prompt=texts, n=2, max_tokens=4)
    expected = [tokenizer.decode(echo(tokenizer.encode(t), 4, j)) for t in texts for j in range(2)]
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    assert [c.text for c in result.choices] == expected
    assert result.usage.completion_tokens == 16
    ids = [[5, 6, 7], [8, 9]]
    by_ids = client.completions.create(model=MODEL_ID, prompt=ids, max_tokens=3)
    assert [c.text for c in by_ids.choices] == [tokenizer.decode(echo(p, 3)) for p in ids]
    assert client.completions.create(model=MODEL_ID, prompt=ids[0], max_tokens=2).usage.prompt_tokens == 3
    assert list(harness.fake.submitted[-1].prompt_token_ids) == ids[0]


def test_streamed_prompt_list_merges_every_choice(client, tokenizer):
    texts = ["alpha beta", "gamma"]
    chunks = list(client.completions.create(model=MODEL_ID, prompt=texts, n=2, max_tokens=5, stream=True))
    texts_by_index = {}
    for chunk in chunks:
        [choice] = chunk.choices
        texts_by_index[choice.index] = texts_by_index.get(choice.index, "") + choice.text
    assert texts_by_index == {i * 2 + j: tokenizer.decode(echo(tokenizer.encode(t), 5, j))
                              for i, t in enumerate(texts) for j in range(2)}


def test_chat_renders_the_template_and_defaults_max_tokens_to_the_context_left(harness, client, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Bonjour 👋"}]
    expected = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    result = client.chat.completions.create(model=MODEL_ID, messages=messages)
    submitted = harness.fake.submitted[-1]
    assert list(submitted.prompt_token_ids) == expected
    assert submitted.params.max_tokens == MAX_MODEL_LEN - len(expected) == result.usage.completion_tokens
    assert result.choices[0].message.role == "assistant" and result.object == "chat.completion"
    chunks = list(client.chat.completions.create(model=MODEL_ID, messages=messages, max_completion_tokens=6,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == tokenizer.decode(expected[:6])
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_strings_cut_the_text_and_finish_with_stop(client):
    for stream in (False, True):
        response = client.completions.create(model=MODEL_ID, prompt="abc STOP def", max_tokens=40, stop="STOP",
                                             stream=stream)
        chunks = list(response) if stream else [response]
        assert "".join(c.choices[0].text for c in chunks) == "abc "
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_logprobs_in_both_shapes(client, tokenizer):
    completion = client.completions.create(model=MODEL_ID, prompt="log probs", max_tokens=3, logprobs=2)
    logprobs = completion.choices[0].logprobs
    token_ids = echo(tokenizer.encode("log probs"), 3)
    assert logprobs.tokens == [tokenizer.decode([t], skip_special_tokens=False) for t in token_ids]
    assert logprobs.token_logprobs == [-0.5] * 3 and all(len(top) <= 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0
    chat = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=3, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(entry.top_logprobs) == 2 for entry in content)
    assert all(entry.bytes == list(entry.token.encode()) for entry in content)
    assert client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=2).choices[0].logprobs is None


def test_openai_and_vllm_parameters_reach_the_scheduler(harness, client):
    client.completions.create(
        model=MODEL_ID, prompt="params", max_tokens=9, temperature=0.5, top_p=0.9, seed=11, presence_penalty=0.5,
        frequency_penalty=-0.5, logit_bias={"7": 2.0}, user="alice", stop=["x", "y"],
        extra_body=dict(top_k=5, min_p=0.1, repetition_penalty=1.2, min_tokens=2, ignore_eos=True,
                        stop_token_ids=[3], priority=4))
    submitted = harness.fake.submitted[-1]
    p = submitted.params
    assert (p.max_tokens, p.seed, p.top_k, p.min_tokens, p.ignore_eos, submitted.priority) == (9, 11, 5, 2, True, 4)
    assert (p.temperature, p.top_p, p.min_p, p.repetition_penalty) == pytest.approx((0.5, 0.9, 0.1, 1.2))
    assert (p.presence_penalty, p.frequency_penalty) == (0.5, -0.5)
    assert [(b.token_id, b.bias) for b in p.logit_bias] == [(7, 2.0)] and list(p.stop_token_ids) == [3]  # stop strings stay in the frontend


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
])
def test_priority_reaches_the_scheduler_from_every_http_api_and_a_bad_one_is_a_400_naming_it(harness, path, body):
    body = {"model": MODEL_ID, **body}
    status, _ = raw(harness.url + path, {**body, "priority": -3})
    assert status == 200 and harness.fake.submitted[-1].priority == -3
    for bad in (2 ** 31, "high", 1.5):
        status, answer = raw(harness.url + path, {**body, "priority": bad})
        assert status == 400 and b"priority" in answer, (bad, answer)


def test_list_models_and_openapi_lists_the_routes(harness, client):
    [model] = client.models.list().data
    assert (model.id, model.owned_by, model.max_model_len) == (MODEL_ID, "pagedserve", MAX_MODEL_LEN)
    status, body = raw(harness.url + "/openapi.json")
    schema = json.loads(body)
    assert status == 200
    assert {"/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics"} <= set(schema["paths"])
    completion = schema["components"]["schemas"]["CompletionRequest"]
    assert {"prompt", "max_tokens", "top_k", "stop_token_ids"} <= set(completion["properties"])
    assert completion["additionalProperties"] is False and completion["required"] == ["prompt"]


def test_metrics_count_http_and_grpc_requests(harness, client, tokenizer):
    before = raw(harness.url + "/metrics")[1].decode()
    client.completions.create(model=MODEL_ID, prompt=["one two", "three"], n=2, max_tokens=4)
    list(client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                        stream=True))
    with Client(f"127.0.0.1:{harness.frontend.port}") as grpc_client:
        grpc_client.generate("via grpc", max_tokens=5)
    status, after = raw(harness.url + "/metrics")
    after = after.decode()
    chat_ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "x"}]),
                                add_special_tokens=False)
    prompt_tokens = len(tokenizer.encode("one two")) + len(tokenizer.encode("three")) + len(chat_ids) + \
        len(tokenizer.encode("via grpc"))

    def moved(name: str, **labels) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert status == 200
    assert moved("pagedserve:prompt_tokens_total", model_name=MODEL_ID) == prompt_tokens
    assert moved("pagedserve:generation_tokens_total", model_name=MODEL_ID) == 16 + 3 + 5
    assert moved("pagedserve:request_success_total", finished_reason="length") == 4 + 1 + 1
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "time_per_output_token_seconds"):
        assert moved(f"pagedserve:{name}_count") == 4, name  # one per generation: 2 prompts, chat, gRPC
    assert moved("pagedserve:inter_token_latency_seconds_count") == 2 * 3 + 2 + 4  # token steps after the first
    assert metric(after, "pagedserve:kv_cache_usage_perc", worker="w0") == 0.0
    assert "pagedserve:num_requests_waiting" in after and "pagedserve:num_preemptions_total" in after


def test_logprob_bytes_are_each_tokens_own_and_rebuild_the_text(client, tokenizer):
    """A token that ends inside a character has text U+FFFD but its own bytes."""
    messages = [{"role": "user", "content": MULTIBYTE}]
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    chat = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=len(prompt_ids),
                                          logprobs=True, top_logprobs=1)
    entries = chat.choices[0].logprobs.content
    assert [e.token for e in entries] == [tokenizer.decode([t], skip_special_tokens=False) for t in prompt_ids]
    assert any("\ufffd" in e.token for e in entries)  # some token of MULTIBYTE ends mid-character
    rebuilt = b"".join(bytes(e.bytes) for e in entries).decode()
    assert rebuilt == tokenizer.decode(prompt_ids, skip_special_tokens=False)
    assert MULTIBYTE in rebuilt
    for entry in entries:
        assert bytes(entry.top_logprobs[0].bytes) == bytes(entry.bytes)  # the fake's top token is the sampled one


def test_one_model_by_id_and_404_for_another(harness, client):
    model = client.models.retrieve(MODEL_ID)
    assert (model.id, model.object, model.owned_by) == (MODEL_ID, "model", "pagedserve")
    status, body = raw(harness.url + "/v1/models/some/other-model")
    assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found"


def test_a_whole_number_float_is_an_integer_and_a_fraction_is_refused(harness):
    status, body = raw(harness.url + "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 4.0, "n": 2.0})
    assert status == 200, body
    assert json.loads(body)["usage"]["completion_tokens"] == 8
    status, body = raw(harness.url + "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 4.5})
    assert (status, json.loads(body)["error"]["param"]) == (400, "max_tokens")
