"""Tool-call parsing (tool_choice auto) and what the chat template is given, per template kind."""
from __future__ import annotations

import json

import pytest

from services.core.errors import InvalidArgument
from services.frontend import tool_calls

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
NAMES = {"get_weather", "get_time"}


@pytest.mark.parametrize("text, content, calls", [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>', None,
     [("get_weather", {"city": "Oslo"})]),
    ('Let me check.\n<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>\n'
     '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>', "Let me check.",
     [("get_weather", {}), ("get_time", {"zone": "UTC"})]),
    ('{"name": "get_time", "parameters": {"zone": "CET"}}', None, [("get_time", {"zone": "CET"})]),  # Llama 3.1
    ('[{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}]', None, [("get_time", {"zone": "UTC"})]),
    ('{"name": "rm_rf", "arguments": {}}', '{"name": "rm_rf", "arguments": {}}', []),  # not one of the tools
    ('<tool_call>{"name": "get_weather", "arguments": {"cit', None, None),  # cut short: the call so far
    ("Sunny in Oslo.", "Sunny in Oslo.", []),
])
def test_auto_parses_hermes_blocks_and_bare_json(text, content, calls):
    got_content, got_calls = tool_calls.plan([{"type": "function", "function": {"name": n}} for n in sorted(NAMES)],
                                        "auto", None).parse(text)
    if calls is None:  # cut short by max_tokens: the call has the arguments generated (as streamed)
        assert got_content is None and [(c.name, c.arguments) for c in got_calls] == [("get_weather", '{"cit')]
        return
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    assert len({c.id for c in got_calls}) == len(got_calls)


def test_tools_reach_a_template_that_uses_them_and_others_get_the_hermes_prompt():
    plan = tool_calls.plan([WEATHER], "auto", None)
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Oslo?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]
    out, given = tool_calls.template_messages(messages, plan, "{% for tool in tools %}...{{ m.tool_calls }}")
    assert given == [WEATHER] and out[0]["role"] == "system"
    assert out[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    out, given = tool_calls.template_messages(messages, plan, "{{ message['content'] }}")
    assert given is None and "<tools>" in out[0]["content"] and out[0]["content"].startswith("Be brief.")
    assert out[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    out, given = tool_calls.template_messages(messages, tool_calls.plan([WEATHER], "none", None), "{{ tools }}")
    assert given is None and "<tools>" not in out[0]["content"]


def test_required_and_named_constraints():
    required = json.loads(tool_calls.plan([WEATHER], "required", False).constraint().spec)
    assert required["maxItems"] == 1 and required["items"]["anyOf"][0]["properties"]["name"] == {"const": "get_weather"}
    named = tool_calls.plan([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None)
    assert named.constraint().spec == json.dumps({"type": "object"})
    assert named.parse('{"city": "Oslo"}')[1][0].arguments == '{"city": "Oslo"}'
    with pytest.raises(InvalidArgument, match=r"^tools\[0\].function.name"):
        tool_calls.plan([{"type": "function", "function": {"name": "bad name!"}}], "auto", None)


TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
NAMED = {"type": "function", "function": {"name": "get_time"}}


@pytest.mark.parametrize("choice, text", [
    ("auto", 'Let me see. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Os\\"lo", "days": [1, 2]}}\n'
             '</tool_call>\n<tool_call>{"arguments": {"zone": "UTC"}, "name": "get_time"}</tool_call>'),
    ("auto", '[{"name": "get_time", "parameters": {"zone": "CET"}}, {"name": "get_weather", "arguments": {}}]'),
    ("auto", '{"answer": {"name": "get_time"}} is not a call <tool_c'),
    ("auto", "a < b and <tool_call> is not json"),
    ("required", '[{"name":"get_weather","arguments":{"city":"}{][","n":-1.5e3,"ok":true}},'
                 '{"name":"get_time","arguments":{}}]'),
    (NAMED, '{"zone": "UTC", "nested": {"a": [1, {"b": null}]}}'),
])
def test_streamed_pieces_join_into_the_whole_answer(choice, text):
    """Fed a character at a time, the reader's content and argument pieces join into exactly what
    parse() of the whole text gives, and a call's arguments arrive in more than one piece."""
    plan = tool_calls.plan([WEATHER, TIME_TOOL], choice, None)
    content, calls = plan.parse(text)
    reader = plan.stream()
    pieces = [p for char in text for p in reader.feed(char)] + reader.finish()
    streamed_content = "".join(p.text for p in pieces if p.kind == "content")
    assert (streamed_content.strip() or None if calls else streamed_content) == content
    starts = [p for p in pieces if p.kind == "call"]
    assert [(p.index, p.name) for p in starts] == [(i, c.name) for i, c in enumerate(calls)]
    num_pieces = []
    for i, call in enumerate(calls):
        arguments = [p.text for p in pieces if p.kind == "arguments" and p.index == i]
        assert "".join(arguments) == call.arguments
        json.loads(call.arguments)
        num_pieces.append(len(arguments))
    assert not calls or max(num_pieces) > 1  # (arguments read before the name come at once)
    assert reader.calls == calls or [c.arguments for c in reader.calls] == [c.arguments for c in calls]
    if text.startswith('{"answer"') or text.startswith("a <"):
        assert calls == [] and content == text
