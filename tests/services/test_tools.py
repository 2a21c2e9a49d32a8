"""Tool-call parsing (tool_choice auto) and what the chat template is given, per template kind."""
from __future__ import annotations

import json

import pytest

from services.core.errors import InvalidArgument
from services.frontend import tools

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
    ('<tool_call>{"name": "get_weather", "arguments": {"cit', None, None),  # cut short: content
    ("Sunny in Oslo.", "Sunny in Oslo.", []),
])
def test_auto_parses_hermes_blocks_and_bare_json(text, content, calls):
    got_content, got_calls = tools.parse_auto(text, NAMES)
    if calls is None:
        assert (got_content, got_calls) == (text, [])
        return
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    assert len({c.id for c in got_calls}) == len(got_calls)


def test_tools_reach_a_template_that_uses_them_and_others_get_the_hermes_prompt():
    plan = tools.plan([WEATHER], "auto", None)
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Oslo?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]
    out, given = tools.template_messages(messages, plan, "{% for tool in tools %}...{{ m.tool_calls }}")
    assert given == [WEATHER] and out[0]["role"] == "system"
    assert out[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    out, given = tools.template_messages(messages, plan, "{{ message['content'] }}")
    assert given is None and "<tools>" in out[0]["content"] and out[0]["content"].startswith("Be brief.")
    assert out[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    out, given = tools.template_messages(messages, tools.plan([WEATHER], "none", None), "{{ tools }}")
    assert given is None and "<tools>" not in out[0]["content"]


def test_required_and_named_constraints():
    required = json.loads(tools.plan([WEATHER], "required", False).constraint().spec)
    assert required["maxItems"] == 1 and required["items"]["anyOf"][0]["properties"]["name"] == {"const": "get_weather"}
    named = tools.plan([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None)
    assert named.constraint().spec == json.dumps({"type": "object"})
    assert named.parse('{"city": "Oslo"}')[1][0].arguments == '{"city": "Oslo"}'
    with pytest.raises(InvalidArgument, match=r"^tools\[0\].function.name"):
        tools.plan([{"type": "function", "function": {"name": "bad name!"}}], "auto", None)
