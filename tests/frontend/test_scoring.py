"""Prompt scoring over HTTP (issue 45; docs/guide/scoring.md): completions' echo with logprobs over
the prompt's tokens, max_tokens 0, vLLM's prompt_logprobs on completions and chat, against a real
scheduler and worker (tiny random model, in process) that chunks every prompt (a 16-token budget)
and caches prefixes. Every logprob is compared to the bit with one engine pass over the whole
prompt, alone: chunked, batched, after a prefix-cache hit, streamed. (A preemption in the middle
of a chunked prompt: tests/engine/test_batch_invariance.py.)"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from services.core.tokenizer import Tokenizer
from test_http_api import raw
from test_http_cluster import serve
from tests.conftest import greedy, make_llm, random_prompts

PROMPTS = random_prompts(4, 512, min_len=5, max_len=40, seed=45, shared_prefix=20)  # > 16: chunked
TOP = 2
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def served(tiny_llama):
    yield from serve(tiny_llama, max_num_batched_tokens=16, block_size=16)


@pytest.fixture(scope="module")
def one_pass(tiny_llama):
    """Each prompt's logprobs and greedy tokens from one engine pass over it, alone."""
    llm = make_llm(tiny_llama)
    return [llm.generate([p], greedy(2, prompt_logprobs=TOP, logprobs=TOP), use_tqdm=False)[0] for p in PROMPTS]


def post(served, path: str, body: dict) -> tuple[int, dict]:
    status, data = raw(served.url + path, {"model": served.model, **body})
    return status, json.loads(data)


def legacy(entries, k: int = TOP) -> tuple[list, list]:
    """The engine's prompt logprobs as echo's token_logprobs and top token ids with their logprobs."""
    return ([None] + [lp.logprob for lp in entries[1:]], [None] + [lp.top[:k] for lp in entries[1:]])


def test_echo_with_max_tokens_0_scores_the_prompt_alone_with_one_passes_bits(served, one_pass, tiny_llama):
    """Four prompts in one request (batched, each chunked by the 16-token budget): each choice is
    its prompt, its tokens' logprobs those of one pass, the first null; nothing generated."""
    status, body = post(served, "/v1/completions", {"prompt": PROMPTS, "max_tokens": 0, "echo": True,
                                                    "logprobs": TOP})
    assert status == 200, body
    tokenizer = Tokenizer(tiny_llama)
    for choice, prompt, want in zip(body["choices"], PROMPTS, one_pass):
        assert choice["text"] == tokenizer.decode(prompt)
        assert choice["finish_reason"] == "length"
        logprobs = choice["logprobs"]
        assert logprobs["tokens"] == [tokenizer.decode([t], skip_special_tokens=False) for t in prompt]
        want_logprobs, want_top = legacy(want.prompt_logprobs)
        assert logprobs["token_logprobs"] == want_logprobs  # to the bit (JSON floats round-trip exactly)
        # (keyed by text, two top tokens of one text are one entry: the best is what harnesses read)
        assert [None if top is None else max(top.values()) for top in logprobs["top_logprobs"]] == \
            [None if t is None else t[0][1] for t in want_top]
        assert logprobs["text_offset"][0] == 0 and len(logprobs["text_offset"]) == len(prompt)
    assert body["usage"]["completion_tokens"] == 0
    assert body["usage"]["prompt_tokens"] == sum(map(len, PROMPTS))


def test_a_cached_prefix_is_scored_in_full_with_the_same_bits(served, one_pass):
    """The first prompt's blocks cached by a plain request first: its score is still whole and the
    same bits (a prefix-cache hit must not leave the cached positions without logprobs)."""
    status, _ = post(served, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 1})
    assert status == 200
    status, body = post(served, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 0, "echo": True,
                                                    "logprobs": TOP})
    assert status == 200
    assert body["choices"][0]["logprobs"]["token_logprobs"] == legacy(one_pass[1].prompt_logprobs)[0]


def test_echo_puts_the_prompt_before_the_completion_in_text_and_logprobs(served, one_pass, tiny_llama):
    tokenizer = Tokenizer(tiny_llama)
    text = tokenizer.decode(PROMPTS[0])  # a text prompt: echoed as given
    status, plain = post(served, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 2, "temperature": 0,
                                                     "logprobs": TOP, "ignore_eos": True})
    status, body = post(served, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 2, "temperature": 0,
                                                    "logprobs": TOP, "ignore_eos": True, "echo": True})
    assert status == 200
    choice, generated = body["choices"][0], plain["choices"][0]
    assert choice["text"] == text + generated["text"]
    n = len(PROMPTS[0])
    logprobs = choice["logprobs"]
    assert logprobs["token_logprobs"] == legacy(one_pass[0].prompt_logprobs)[0] + \
        generated["logprobs"]["token_logprobs"]
    assert logprobs["tokens"][n:] == generated["logprobs"]["tokens"]
    assert logprobs["top_logprobs"][n:] == generated["logprobs"]["top_logprobs"]
    assert generated["logprobs"]["token_logprobs"] == [lp.logprob for lp in one_pass[0].outputs[0].logprobs]
    offsets = logprobs["text_offset"]
    assert offsets == sorted(offsets) and offsets[n] == sum(len(t) for t in logprobs["tokens"][:n])

    status, streamed = raw(served.url + "/v1/completions", {
        "model": served.model, "prompt": PROMPTS[0], "max_tokens": 2, "temperature": 0, "ignore_eos": True,
        "echo": True, "logprobs": TOP, "stream": True})
    chunks = [json.loads(line[6:]) for line in streamed.decode().splitlines()
              if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    assert sum((c["choices"][0]["logprobs"]["token_logprobs"] for c in chunks), []) == logprobs["token_logprobs"]


def test_prompt_logprobs_in_vllms_shape_on_completions_and_chat(served, one_pass, tiny_llama):
    tokenizer = Tokenizer(tiny_llama)
    status, body = post(served, "/v1/completions", {"prompt": PROMPTS[2], "max_tokens": 1, "prompt_logprobs": 1})
    assert status == 200
    shown = body["choices"][0]["prompt_logprobs"]
    assert shown[0] is None and len(shown) == len(PROMPTS[2])
    for position, (entry, want) in enumerate(zip(shown[1:], one_pass[2].prompt_logprobs[1:]), 1):
        token = PROMPTS[2][position]
        assert entry[str(token)] == {"logprob": want.logprob, "rank": want.rank,
                                     "decoded_token": tokenizer.decode([token], skip_special_tokens=False)}
        best, best_logprob = want.top[0]
        assert entry[str(best)]["rank"] == 1 and entry[str(best)]["logprob"] == best_logprob
        assert len(entry) == (1 if token == best else 2)

    messages = [{"role": "user", "content": "Score me"}]
    status, chat = post(served, "/v1/chat/completions", {"messages": messages, "max_tokens": 1,
                                                         "prompt_logprobs": 0})
    assert status == 200
    status, tokens = post(served, "/tokenize", {"messages": messages})
    assert status == 200
    ids = tokens["tokens"]
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == len(ids) == tokens["count"]
    assert all(str(token) in entry for token, entry in zip(ids[1:], chat["prompt_logprobs"][1:]))


@pytest.mark.parametrize("body, param", [
    ({"max_tokens": 0}, "max_tokens"),  # 0 scores a prompt: it needs echo
    ({"max_tokens": 0, "echo": True, "min_tokens": 1}, "min_tokens"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"echo": "yes"}, "echo"),
    ({"echo": True, "prompt": [5, 512]}, "prompt"),  # a token id past the vocabulary, decoded for the echo
])
def test_bad_scoring_input_is_a_400_naming_the_field(served, body, param):
    status, answer = post(served, "/v1/completions", {"prompt": "hello", **body})
    assert status == 400 and answer["error"]["param"] == param, answer


def test_every_request_in_the_scoring_guide_is_served(served):
    """docs/guide/scoring.md's curl examples, each sent as it is written."""
    guide = (ROOT / "docs" / "guide" / "scoring.md").read_text()
    examples = re.findall(r"curl -s localhost:8000(/\S+) .*?-d '(\{.*?\})'", guide, re.S)
    assert len(examples) >= 6, "the examples were not found: the pattern is wrong"
    for path, body in examples:
        status, answer = post(served, path, json.loads(body))
        assert status == 200, (path, body, answer)


def test_tokenize_and_detokenize_in_vllms_shapes(served, tiny_llama):
    tokenizer = Tokenizer(tiny_llama)
    text = "Hello world, scored"
    status, body = post(served, "/tokenize", {"prompt": text, "return_token_strs": True})
    assert status == 200
    assert body["tokens"] == tokenizer.encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 2048
    assert body["token_strs"] == [tokenizer.decode([t], skip_special_tokens=False) for t in body["tokens"]]
    status, plain = post(served, "/tokenize", {"prompt": text, "add_special_tokens": False})
    assert plain["tokens"] == tokenizer.encode(text, add_special_tokens=False) and plain["token_strs"] is None
    status, back = post(served, "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and back == {"prompt": tokenizer.decode(body["tokens"])}

    messages = [{"role": "user", "content": "Hi"}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    status, chat = post(served, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert status == 200 and chat["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)


@pytest.mark.parametrize("path, body, param", [
    ("/detokenize", {"tokens": [512]}, "tokens"),  # past the vocabulary
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ("/tokenize", {"messages": [], "add_generation_prompt": True}, "messages"),
    ("/tokenize", {"prompt": "x", "tools": []}, "tools"),
])
def test_bad_tokenize_input_is_a_400_naming_the_field(served, path, body, param):
    status, answer = post(served, path, body)
    assert status == 400 and answer["error"]["param"] == param, answer
