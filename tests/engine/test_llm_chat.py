"""LLM.chat: conversations rendered with the model's chat template, tools shown as the HTTP API
shows them, one conversation or a list, outputs in order."""
from __future__ import annotations

import pytest

from tests.conftest import greedy, make_llm
from services.core.errors import InvalidArgument
from services.core.tokenizer import Tokenizer

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return make_llm(tiny_llama)


def test_chat_renders_the_template_and_equals_generate_on_its_tokens(llm, tiny_llama):
    tokenizer = Tokenizer(tiny_llama)
    text = tokenizer.apply_chat_template(CHAT, True, None)
    [chat] = llm.chat(CHAT, greedy(8), use_tqdm=False)
    [plain] = llm.generate([tokenizer.encode(text, add_special_tokens=False)], greedy(8), use_tqdm=False)
    assert chat.prompt == text and chat.prompt_token_ids == plain.prompt_token_ids
    assert chat.outputs[0].token_ids == plain.outputs[0].token_ids and len(chat.outputs[0].token_ids) == 8


def test_a_list_of_conversations_with_tools_and_one_params_each(llm):
    other = CHAT[1:] + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    first, second = llm.chat([CHAT, other], [greedy(3), greedy(5)], tools=[WEATHER], use_tqdm=False)
    assert "get_weather" in first.prompt and '"city": "Oslo"' in second.prompt and "sunny" in second.prompt
    assert (len(first.outputs[0].token_ids), len(second.outputs[0].token_ids)) == (3, 5)
    with pytest.raises(InvalidArgument, match=r"^messages\[1\]"):
        llm.chat([CHAT, []], greedy(3), use_tqdm=False)


def test_a_chat_template_of_its_own_with_kwargs(llm):
    template = "{% for m in messages %}{{ m.content }}|{% endfor %}{{ 'think' if enable_thinking else 'answer' }}:"
    [chat] = llm.chat(CHAT, greedy(2), use_tqdm=False, chat_template=template,
                      chat_template_kwargs={"enable_thinking": False})
    assert chat.prompt == "Be brief.|Weather in Oslo?|answer:"
