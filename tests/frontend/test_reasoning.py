"""Reasoning models (services/frontend/reasoning.py): the thinking read apart from the answer in
every API, streamed pieces joining into exactly the whole answer, and constraints after the
thinking. The real chat templates of Qwen3 and DeepSeek-R1 (tests/frontend/templates) on the
test tokenizer with their markers as tokens; a scripted fake scheduler emits exact token ids."""
from __future__ import annotations

import json

import anthropic
import numpy as np
import openai
import pytest

from services.core.errors import InvalidArgument
from services.core.structured import Constraint, GrammarCache, make_tokenizer
from services.core.tokenizer import Tokenizer
from services.frontend import reasoning, tool_calls
from services.frontend.reasoning import PARSERS, Thinking
from tests.frontend.reasoning_models import reasoning_model
from tests.frontend.test_http_api import http_harness

QWEN3, R1 = PARSERS["qwen3"], PARSERS["deepseek_r1"]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}

# (parser, starts inside the thinking, output, reasoning, content)
OUTPUTS = [
    (QWEN3, False, "<think>\nLet me add: 2 + 2 = 4.\n</think>\n\nIt is 4.", "Let me add: 2 + 2 = 4.", "It is 4."),
    (QWEN3, False, "It is 4, no thinking.", None, "It is 4, no thinking."),
    (QWEN3, False, "<thin k> is not a marker", None, "<thin k> is not a marker"),
    (QWEN3, False, "<think>cut short by max_tok", "cut short by max_tok", ""),
    (QWEN3, True, "already inside </thi", "already inside </thi", ""),
    (R1, True, "Okay, so 2 + 2.\n</think>\n\n**4**", "Okay, so 2 + 2.", "**4**"),
    (R1, True, "a < b </ c </think>answer < </think>", "a < b </ c", "answer < </think>"),
    (R1, True, "<think>\nWith its own start.\n</think>\nFour.", "With its own start.", "Four."),
]


def pieces_of(thinking: Thinking, text: str, sizes: int | None) -> tuple[str, str]:
    """(reasoning, content) joined from the reader fed `sizes` characters at a time (None: at once)."""
    reader = tool_calls.plan([], "none", None).stream()
    reader = thinking.reader(reader)
    step = sizes or len(text) or 1
    pieces = [p for i in range(0, len(text), step) for p in reader.feed(text[i:i + step])] + reader.finish()
    return reasoning.split(pieces)[0], "".join(p.text for p in pieces if p.kind == "content")


@pytest.mark.parametrize("parser, inside, text, expected_reasoning, expected_content", OUTPUTS)
def test_streamed_reasoning_joins_into_the_whole_answer(parser, inside, text, expected_reasoning, expected_content):
    thinking = Thinking(parser, inside)
    plan = tool_calls.plan([], "none", None)
    plan.thinking = thinking
    whole_reasoning, content, _ = plan.read(text)
    assert (whole_reasoning, content) == (expected_reasoning, expected_content)
    for size in (1, 2, 3, 7):
        assert pieces_of(thinking, text, size) == (whole_reasoning or "", content)


def test_tool_calls_are_read_from_the_answer_only():
    plan = tool_calls.plan([WEATHER], "auto", None)
    plan.thinking = Thinking(QWEN3, False)
    text = ('<think>I could write <tool_call>{"name": "get_weather", "arguments": {}}</tool_call> but '
            'I will not.</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    thought, content, calls = plan.read(text)
    assert thought.startswith("I could write <tool_call>") and content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]


def test_a_forced_tool_call_is_read_after_the_thinking():
    """A named tool choice: the grammar lets the model think, then the answer is the arguments."""
    plan = tool_calls.plan([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None)
    plan.thinking = Thinking(R1, True)
    thought, content, calls = plan.read('Oslo, surely.\n</think>\n\n{"city": "Oslo"}')
    assert (thought, content) == ("Oslo, surely.", None)
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Oslo"}')]
    grammar = reasoning.thinking_constraint(plan.thinking, plan.constraint(), None, lambda text: None)
    assert grammar.kind == "grammar" and '"</think>"' in grammar.spec and "%json" in grammar.spec


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return reasoning_model(tmp_path_factory.mktemp("qwen3"), "qwen3.jinja")


@pytest.fixture(scope="module")
def r1_dir(tmp_path_factory):
    return reasoning_model(tmp_path_factory.mktemp("r1"), "deepseek_r1.jinja")


def test_the_prompt_end_says_whether_the_model_thinks(qwen3_dir, r1_dir):
    """The real templates: Qwen3 lets the model open its thinking (or closes it when asked not to
    think); DeepSeek-R1 opens it in the prompt."""
    messages = [{"role": "user", "content": "2 + 2?"}]
    qwen3, r1 = Tokenizer(qwen3_dir), Tokenizer(r1_dir)
    assert reasoning.choose("auto", qwen3.template_source) is QWEN3
    assert reasoning.choose("auto", r1.template_source) is R1
    assert reasoning.choose("auto", "{{ messages }}") is None and reasoning.choose("", qwen3.template_source) is None
    assert Thinking.of(QWEN3, qwen3.apply_chat_template(messages)) == Thinking(QWEN3, False)
    off = qwen3.apply_chat_template(messages, template_kwargs={"enable_thinking": False})
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") and Thinking.of(QWEN3, off) is None
    assert Thinking.of(R1, r1.apply_chat_template(messages)) == Thinking(R1, True)
    with pytest.raises(InvalidArgument, match="reasoning_parser"):
        reasoning.choose("gpt_oss_typo", "")


def test_earlier_turns_reasoning_is_kept_or_dropped_as_the_template_says(qwen3_dir, r1_dir):
    turns = [{"role": "user", "content": "2 + 2?"},
             {"role": "assistant", "content": "4.", "reasoning_content": "Adding two and two."},
             {"role": "user", "content": "And 3 + 3?"}]
    qwen3 = Tokenizer(qwen3_dir).apply_chat_template(turns)
    assert "Adding two and two." not in qwen3 and "<|im_start|>assistant\n4.<|im_end|>" in qwen3  # an earlier query's
    tool_turn = turns[:2] + [{"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}]
    assert "<think>\nAdding two and two.\n</think>\n\n4." in Tokenizer(qwen3_dir).apply_chat_template(tool_turn)
    r1 = Tokenizer(r1_dir).apply_chat_template(turns[:1] + [{"role": "assistant", "content": "<think>x</think>4."}]
                                               + turns[2:])
    assert "<｜Assistant｜>4.<｜end▁of▁sentence｜>" in r1  # R1 drops it


# Constraints after the thinking: the grammar the worker's matcher runs (llguidance), checked here.

def _matcher(folder, constraint: Constraint):
    tokenizer = Tokenizer(folder)
    cache = GrammarCache(make_tokenizer(tokenizer.to_json(), tokenizer.vocab_size, (2,)))
    return tokenizer, cache.matcher(constraint)


def _allowed(matcher, vocab_size: int) -> list[int]:
    mask = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint32)
    return [i for i in range(vocab_size) if (int(mask[i // 32]) >> (i % 32)) & 1]


def _marker(tokenizer: Tokenizer):
    return lambda text: (ids[0] if len(ids := tokenizer.encode(text, False)) == 1 else None)


SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}


def test_a_json_schema_constrains_the_answer_after_free_thinking(qwen3_dir):
    tokenizer = Tokenizer(qwen3_dir)
    constraint = reasoning.thinking_constraint(Thinking(QWEN3, False), Constraint.json_schema(SCHEMA), None,
                                               _marker(tokenizer))
    tokenizer, matcher = _matcher(qwen3_dir, constraint)
    free = "<think>Not JSON at all: {[ 'x' ]\n and more.</think>\n\n"
    for token in tokenizer.encode(free + '{"answer": 4}', False):
        assert matcher.consume_token(token), tokenizer.decode([token])
    assert matcher.is_accepting()
    tokenizer, matcher = _matcher(qwen3_dir, constraint)  # and without thinking: the answer alone, still JSON
    assert not matcher.consume_token(tokenizer.encode("Hello", False)[0])


@pytest.mark.parametrize("constraint", [None, Constraint.choice(["yes", "no"])])
def test_the_budget_closes_the_thinking_at_n_tokens(r1_dir, constraint):
    tokenizer = Tokenizer(r1_dir)
    end = tokenizer.encode("</think>", False)[0]
    grammar = reasoning.thinking_constraint(Thinking(R1, True), constraint, 5, _marker(tokenizer))
    tokenizer, matcher = _matcher(r1_dir, grammar)
    thought = tokenizer.encode("one two three four five six seven", False)
    for token in thought[:5]:
        assert matcher.consume_token(token)
    assert _allowed(matcher, tokenizer.vocab_size) == [end]  # the engine can only close the thinking
    assert matcher.consume_token(end)
    answer = tokenizer.encode("yes", False)
    assert all(matcher.consume_token(t) for t in answer) and matcher.is_accepting()


# Over HTTP, with the official clients.

@pytest.fixture(scope="module")
def qwen3(qwen3_dir):
    harness = http_harness(qwen3_dir, reasoning_parser="auto")
    harness.tokenizer = Tokenizer(qwen3_dir)
    harness.oai = openai.OpenAI(base_url=harness.url + "/v1", api_key="unused", max_retries=0)
    harness.claude = anthropic.Anthropic(base_url=harness.url, api_key="unused", max_retries=0)
    yield harness
    harness.close()


def script(harness, text: str) -> None:
    harness.fake.script = harness.tokenizer.encode(text, False)


THOUGHT = "<think>\nThe user asks 2 + 2. That is 4.\n</think>\n\n"
ASK = [{"role": "user", "content": "2 + 2?"}]


def test_chat_completions_reasoning_content_whole_and_streamed(qwen3):
    script(qwen3, THOUGHT + "It is 4.")
    message = qwen3.oai.chat.completions.create(model="test-model", messages=ASK).choices[0].message
    assert (message.reasoning_content, message.content) == ("The user asks 2 + 2. That is 4.", "It is 4.")
    assert message.model_extra["reasoning"] == message.reasoning_content
    chunks = list(qwen3.oai.chat.completions.create(model="test-model", messages=ASK, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == message.reasoning_content
    assert "".join(d.content or "" for d in deltas) == message.content
    assert not any(d.model_extra.get("reasoning_content") and d.content for d in deltas)  # apart, never mixed


def test_chat_completions_usage_counts_the_reasoning_tokens(qwen3):
    """usage.completion_tokens_details.reasoning_tokens, whole and in the streamed usage chunk, counted
    as the Responses API counts them: every token generated inside the thinking, the end marker's too."""
    script(qwen3, THOUGHT + "It is 4.")
    thought_tokens = len(qwen3.tokenizer.encode("\nThe user asks 2 + 2. That is 4.\n</think>", False))
    kwargs = dict(model="test-model", messages=ASK, n=2)
    whole = qwen3.oai.chat.completions.create(**kwargs).usage
    assert whole.completion_tokens_details.reasoning_tokens == 2 * thought_tokens  # both choices'
    assert whole.completion_tokens == 2 * len(qwen3.tokenizer.encode(THOUGHT + "It is 4.", False))
    chunks = list(qwen3.oai.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage == whole
    script(qwen3, "It is 4.")
    off = qwen3.oai.chat.completions.create(model="test-model", messages=ASK,
                                            extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage.completion_tokens_details.reasoning_tokens == 0


def test_enable_thinking_false_renders_the_empty_block_and_gives_no_reasoning(qwen3):
    script(qwen3, "It is 4.")
    completion = qwen3.oai.chat.completions.create(model="test-model", messages=ASK,
                                                   extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = completion.choices[0].message
    assert message.content == "It is 4." and "reasoning_content" not in message.model_extra
    prompt = qwen3.tokenizer.decode(list(qwen3.fake.submitted[-1].prompt_token_ids), skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_a_response_format_reaches_the_worker_after_the_thinking(qwen3):
    script(qwen3, THOUGHT + '{"answer": 4}')
    message = qwen3.oai.chat.completions.create(
        model="test-model", messages=ASK, extra_body={"max_reasoning_tokens": 64},
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}).choices[0].message
    assert json.loads(message.content) == {"answer": 4} and message.reasoning_content.endswith("That is 4.")
    constraint = qwen3.fake.submitted[-1].params.structured_outputs
    assert constraint.kind == "grammar" and "think[max_tokens=64]" in constraint.spec


def test_messages_thinking_blocks_whole_and_streamed(qwen3):
    script(qwen3, THOUGHT + "It is 4.")
    kwargs = dict(model="test-model", max_tokens=100, messages=ASK,
                  thinking={"type": "enabled", "budget_tokens": 50})
    message = qwen3.claude.messages.create(**kwargs)
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert (message.content[0].thinking, message.content[1].text) == ("The user asks 2 + 2. That is 4.", "It is 4.")
    assert "think[max_tokens=50]" in qwen3.fake.submitted[-1].params.structured_outputs.spec
    with qwen3.claude.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert [b.model_dump(include={"type", "thinking", "text"}) for b in final.content] == \
        [b.model_dump(include={"type", "thinking", "text"}) for b in message.content]
    thinking_deltas = [e.delta.thinking for e in events if e.type == "content_block_delta"
                       and e.delta.type == "thinking_delta"]
    assert "".join(thinking_deltas) == message.content[0].thinking


def test_messages_thinking_disabled_turns_the_template_off(qwen3):
    script(qwen3, "It is 4.")
    message = qwen3.claude.messages.create(model="test-model", max_tokens=100, messages=ASK,
                                           thinking={"type": "disabled"})
    assert [b.type for b in message.content] == ["text"]
    prompt = qwen3.tokenizer.decode(list(qwen3.fake.submitted[-1].prompt_token_ids), skip_special_tokens=False)
    assert prompt.endswith("<think>\n\n</think>\n\n")


def test_responses_reasoning_items_whole_streamed_and_carried(qwen3):
    script(qwen3, THOUGHT + "It is 4.")
    response = qwen3.oai.responses.create(model="test-model", input="2 + 2?")
    assert [i.type for i in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == "The user asks 2 + 2. That is 4."
    assert response.output_text == "It is 4."
    thought_tokens = qwen3.tokenizer.encode("\nThe user asks 2 + 2. That is 4.\n</think>", False)
    assert response.usage.output_tokens_details.reasoning_tokens == len(thought_tokens)  # <think> opens it
    with qwen3.oai.responses.stream(model="test-model", input="2 + 2?") as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == response.output[0].content[0].text == final.output[0].content[0].text
    script(qwen3, "Six.")
    qwen3.oai.responses.create(model="test-model", input="<tool_response>\n6\n</tool_response>",
                               previous_response_id=response.id)
    prompt = qwen3.tokenizer.decode(list(qwen3.fake.submitted[-1].prompt_token_ids), skip_special_tokens=False)
    assert "<think>\nThe user asks 2 + 2. That is 4.\n</think>\n\nIt is 4.<|im_end|>" in prompt  # kept, as Qwen3's


def test_anthropic_2_16_sends_sampling_settings_in_extra_body(qwen3):
    """The newest anthropic client takes no temperature argument; extra_body's fields arrive as the
    body's own."""
    script(qwen3, "Four.")
    qwen3.claude.messages.create(model="test-model", max_tokens=10, messages=ASK,
                                 extra_body={"temperature": 0.25, "top_k": 7, "seed": 3})
    params = qwen3.fake.submitted[-1].params
    assert (round(params.temperature, 6), params.top_k, params.seed) == (0.25, 7, 3)


def test_grpc_deltas_carry_the_reasoning_apart(qwen3):
    import grpc

    from pagedserve.v1 import generate_pb2 as pb
    from pagedserve.v1 import generate_pb2_grpc

    script(qwen3, THOUGHT + "It is 4.")
    request = pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="2 + 2?")]),
                                 params=pb.SamplingParams(max_tokens=64))
    with grpc.insecure_channel(qwen3.address) as channel:
        responses = list(generate_pb2_grpc.GenerationStub(channel).Generate(request, timeout=10))
    deltas = [d for r in responses for d in r.samples]
    assert "".join(d.text for d in deltas) == THOUGHT + "It is 4."  # the raw text, as before
    assert "".join(d.reasoning_text for d in deltas) == "The user asks 2 + 2. That is 4."
    assert "".join(d.answer_text for d in deltas) == "It is 4."


def test_grpc_batch_deltas_carry_each_requests_reasoning_apart(qwen3):
    """GenerateBatch gives each request's deltas what Generate gives them: two chats (one with two
    samples, each read by its own reader) and a text prompt, whose deltas carry no reasoning."""
    import grpc

    from pagedserve.v1 import generate_pb2 as pb
    from pagedserve.v1 import generate_pb2_grpc

    script(qwen3, THOUGHT + "It is 4.")
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="2 + 2?")])
    requests = [pb.GenerateRequest(request_id="a", chat=chat, params=pb.SamplingParams(max_tokens=64)),
                pb.GenerateRequest(request_id="b", chat=chat, params=pb.SamplingParams(max_tokens=64, n=2)),
                pb.GenerateRequest(request_id="t", text="2 + 2?", params=pb.SamplingParams(max_tokens=64))]
    with grpc.insecure_channel(qwen3.address) as channel:
        messages = list(generate_pb2_grpc.GenerationStub(channel).GenerateBatch(iter(requests), timeout=10))
    assert not [e for m in messages for e in m.errors]
    deltas: dict[tuple[str, int], list] = {}
    for response in (r for m in messages for r in m.responses):
        for delta in response.samples:
            deltas.setdefault((response.request_id, delta.index), []).append(delta)
    assert sorted(deltas) == [("a", 0), ("b", 0), ("b", 1), ("t", 0)]
    for (request_id, _), sample in deltas.items():
        assert "".join(d.text for d in sample) == THOUGHT + "It is 4."
        reasoning_text, answer_text = "".join(d.reasoning_text for d in sample), "".join(d.answer_text for d in sample)
        if request_id == "t":
            assert (reasoning_text, answer_text) == ("", "")  # not a chat prompt
        else:
            assert (reasoning_text, answer_text) == ("The user asks 2 + 2. That is 4.", "It is 4.")


@pytest.mark.slow
def test_a_real_worker_closes_the_thinking_at_the_budget_then_answers_under_the_choice(model_dir, tmp_path):
    """A tiny random model behind a real scheduler and worker, DeepSeek-R1's template (the prompt
    opens the thinking): with a budget of 5 tokens the worker's grammar ends the thinking at the 5th
    token at the latest, and the answer is one of the choices, whatever the random weights want."""
    import shutil

    from tests.frontend.reasoning_models import MARKERS, VOCAB_SIZE
    from tests.frontend.test_http_cluster import serve

    model = tmp_path / "r1-tiny"
    shutil.copytree(model_dir("llama", "tiny", vocab_size=VOCAB_SIZE + len(MARKERS)), model)
    reasoning_model(model, "deepseek_r1.jinja")
    served = next(fixture := serve(model, {"reasoning_parser": "auto"}))
    try:
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)
        for seed in range(3):
            chat = client.chat.completions.create(
                model=served.model, messages=ASK, max_tokens=30, temperature=1.0, seed=seed, logprobs=True,
                extra_body={"max_reasoning_tokens": 5, "structured_outputs": {"choice": ["yes", "no"]}})
            tokens = [t.token for t in chat.choices[0].logprobs.content]
            assert "</think>" in tokens[:6], tokens
            assert chat.choices[0].message.content in ("yes", "no"), tokens
            assert chat.choices[0].message.reasoning_content == "".join(tokens[:tokens.index("</think>")]).strip()
    finally:
        fixture.close()


# gpt-oss's harmony format (services/frontend/harmony.py)

GPT_OSS = PARSERS["gpt_oss"]
HARMONY_OUTPUTS = [
    ("<|channel|>analysis<|message|>User asks 2 + 2.<|end|><|start|>assistant<|channel|>final<|message|>It is 4."
     "<|return|>", "User asks 2 + 2.", "It is 4.", []),
    ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
     'to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>', "Need the weather.", None,
     [("get_weather", {"city": "Oslo"})]),
    ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Bergen"}<|call|>',
     None, None, [("get_weather", {"city": "Bergen"})]),
    ("No harmony at all < here.", None, "No harmony at all < here.", []),
]


@pytest.mark.parametrize("text, expected_reasoning, expected_content, expected_calls", HARMONY_OUTPUTS)
def test_harmony_channels_streamed_join_into_the_whole(text, expected_reasoning, expected_content, expected_calls):
    plan = tool_calls.plan([WEATHER], "auto", None)
    plan.thinking = Thinking(GPT_OSS, False)
    thought, content, calls = plan.read(text)
    assert (thought, content) == (expected_reasoning, expected_content)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == expected_calls
    for size in (1, 3, 8):
        reader = plan.stream()
        pieces = [p for i in range(0, len(text), size) for p in reader.feed(text[i:i + size])] + reader.finish()
        assert reasoning.split(pieces)[0] == (thought or "")
        assert [c.arguments for c in reader.calls] == [c.arguments for c in calls]


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory):
    from tests.frontend.reasoning_models import harmony_model

    return harmony_model(tmp_path_factory.mktemp("gpt-oss"))


def test_harmony_budget_closes_the_analysis_then_the_final_channel_is_constrained(gpt_oss_dir):
    tokenizer = Tokenizer(gpt_oss_dir)
    assert reasoning.choose("auto", tokenizer.template_source) is GPT_OSS
    grammar = reasoning.thinking_constraint(Thinking(GPT_OSS, False), Constraint.choice(["yes", "no"]), 3,
                                            _marker(tokenizer))
    tokenizer, matcher = _matcher(gpt_oss_dir, grammar)
    ids = lambda text: tokenizer.encode(text, False)  # noqa: E731
    for token in ids("<|channel|>analysis<|message|>") + ids("one two three four")[:3]:
        assert matcher.consume_token(token)
    assert _allowed(matcher, tokenizer.vocab_size) == ids("<|end|>")
    for token in ids("<|end|><|start|>assistant<|channel|>final<|message|>yes"):
        assert matcher.consume_token(token), tokenizer.decode([token], skip_special_tokens=False)
    assert matcher.is_accepting()


def test_a_gpt_oss_folder_with_chat_template_jinja_gets_its_template(tmp_path):
    """gpt-oss's folders keep the template in chat_template.jinja, none in tokenizer_config.json: the chat
    path renders it, and the reasoning parser auto picks harmony from it."""
    from tests.frontend.reasoning_models import harmony_model

    folder = harmony_model(tmp_path / "gpt-oss")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "chat_template.jinja").write_text(config.pop("chat_template"), encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer(folder)
    assert reasoning.choose("auto", tokenizer.template_source) is GPT_OSS
    assert tokenizer.apply_chat_template(ASK).endswith("<|start|>assistant")


def test_gpt_oss_over_http_reads_the_analysis_channel_as_reasoning(gpt_oss_dir):
    harness = http_harness(gpt_oss_dir, reasoning_parser="auto")
    try:
        harness.fake.max_model_len = 512  # gpt-oss's system message is long in the test tokenizer's tokens
        assert harness.wait_for(lambda: harness.frontend.core.card.max_model_len == 512)
        harness.tokenizer = Tokenizer(gpt_oss_dir)
        script(harness, "<|channel|>analysis<|message|>Sum.<|end|><|start|>assistant<|channel|>final<|message|>4."
                        "<|return|>")
        client = openai.OpenAI(base_url=harness.url + "/v1", api_key="unused", max_retries=0)
        message = client.chat.completions.create(model="test-model", messages=ASK).choices[0].message
        assert (message.reasoning_content, message.content) == ("Sum.", "4.")
        chunks = list(client.chat.completions.create(model="test-model", messages=ASK, stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == "Sum."
        assert "".join(d.content or "" for d in deltas) == "4."
    finally:
        harness.close()


def test_a_template_may_date_its_system_message(qwen3_dir):
    """gpt-oss's template calls strftime_now (transformers gives templates that function)."""
    import datetime

    tokenizer = Tokenizer(qwen3_dir)
    tokenizer.set_template("Current date: {{ strftime_now('%Y-%m-%d') }}")
    assert tokenizer.apply_chat_template(ASK) == f"Current date: {datetime.date.today():%Y-%m-%d}"


def test_server_template_settings_and_a_request_template(qwen3_dir):
    """--default-chat-template-kwargs (a request's own win), --chat-template (a file replaces the model's),
    and a request's chat_template only when trusted."""
    from tests.frontend.reasoning_models import TEMPLATES

    tokenizer = Tokenizer(qwen3_dir)
    harness = http_harness(qwen3_dir, reasoning_parser="auto", default_chat_template_kwargs='{"enable_thinking": false}')
    try:
        harness.tokenizer = tokenizer
        script(harness, "4.")
        client = openai.OpenAI(base_url=harness.url + "/v1", api_key="unused", max_retries=0)
        prompt = lambda: tokenizer.decode(list(harness.fake.submitted[-1].prompt_token_ids), False)  # noqa: E731
        client.chat.completions.create(model="test-model", messages=ASK)
        assert prompt().endswith("<think>\n\n</think>\n\n")
        client.chat.completions.create(model="test-model", messages=ASK,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": True}})
        assert prompt().endswith("<|im_start|>assistant\n")
        with pytest.raises(openai.BadRequestError, match="chat_template: this server does not take"):
            client.chat.completions.create(model="test-model", messages=ASK, extra_body={"chat_template": "{{ 1 }}"})
    finally:
        harness.close()
    harness = http_harness(qwen3_dir, reasoning_parser="auto", chat_template=str(TEMPLATES / "deepseek_r1.jinja"),
                           trust_request_chat_template=True)
    try:
        harness.tokenizer = tokenizer
        script(harness, "Hm.</think>4.")
        client = openai.OpenAI(base_url=harness.url + "/v1", api_key="unused", max_retries=0)
        message = client.chat.completions.create(model="test-model", messages=ASK).choices[0].message
        assert (message.reasoning_content, message.content) == ("Hm.", "4.")  # R1's template: auto reads R1
        assert tokenizer.decode(list(harness.fake.submitted[-1].prompt_token_ids), False).endswith(
            "<｜User｜>2 + 2?<｜Assistant｜><think>\n")
        client.chat.completions.create(model="test-model", messages=ASK,
                                       extra_body={"chat_template": "Q: {{ messages[0].content }} A:"})
        assert tokenizer.decode(list(harness.fake.submitted[-1].prompt_token_ids), False) == "Q: 2 + 2? A:"
    finally:
        harness.close()


def test_gpt_oss_template_renders_earlier_thinking_in_a_tool_loop(gpt_oss_dir):
    """gpt-oss's real template: the generation prompt opens an assistant message; an earlier tool
    call's thinking (given as `thinking`, as the server passes reasoning_content) stays in the
    prompt until a final answer follows."""
    tokenizer = Tokenizer(gpt_oss_dir)
    turns = ASK + [{"role": "assistant", "content": "", "thinking": "Need a tool.", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}]},
        {"role": "tool", "content": "4"}]
    prompt = tokenizer.apply_chat_template(turns)
    assert prompt.endswith("<|start|>assistant")
    assert "<|start|>assistant<|channel|>analysis<|message|>Need a tool.<|end|>" in prompt
    assert '<|start|>assistant to=functions.add<|channel|>commentary json<|message|>{"a": 2, "b": 2}<|call|>' in prompt
