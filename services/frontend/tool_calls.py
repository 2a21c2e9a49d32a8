"""Tool calling in chat completions: what the model is shown, what it may emit, how it is read.

- `tool_choice` "none" (or no tools): plain chat; the tools are not shown.
- "auto": the tools reach the chat template (`tools=`); a template that does not use them gets
  them in a system message in the Hermes format. The output is read as it is generated
  (services/frontend/tool_stream.py): Hermes / Qwen2.5 / Qwen3 `<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>` blocks, or, as a fallback, an output that is nothing but such a
  JSON object (or a list of them; `parameters` is accepted for `arguments`, as Llama 3.1 emits).
  Anything else is content.
- "required": the output is constrained by a JSON schema to a list of calls
  `[{"name": one of the tools, "arguments": valid against its parameters}]` (one call unless
  `parallel_tool_calls`), so it always parses and its arguments are always valid.
- a named function: the output is constrained to that function's arguments object.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from services.frontend.reasoning import ReasoningReader, Thinking
from services.core.errors import InvalidArgument, check
from services.core.structured import Constraint
from services.frontend.tool_stream import ToolCallStream

NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
MAX_TOOLS = 128
HERMES_SYSTEM = (
    "You may call one or more functions to assist with the user query. The functions are given "
    "inside <tools></tools> tags:\n<tools>\n{tools}\n</tools>\n\nFor each function call, return a JSON "
    "object with the function name and arguments inside <tool_call></tool_call> tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def to_openai(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


@dataclass(kw_only=True)
class ToolPlan:
    """What a request's tools and tool_choice mean for its prompt, constraint and parsing."""

    tools: list[dict]  # OpenAI tool definitions, validated
    mode: str  # none, auto, required or named
    name: str = ""  # the named function
    parallel: bool = True
    thinking: Thinking | None = None  # a reasoning model's: its thinking is read apart, before the answer

    def constraint(self) -> Constraint | None:
        if self.mode == "named":
            return Constraint.json_schema(self._parameters(self.name), "tool_choice")
        if self.mode != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                   "arguments": self._parameters(t["function"]["name"])},
                  "required": ["name", "arguments"], "additionalProperties": False} for t in self.tools]
        schema = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return Constraint.json_schema(schema, "tools")

    def stream(self) -> ToolCallStream | ReasoningReader:
        """A reader of this request's output, fed as it is generated (services/frontend/tool_stream.py);
        a reasoning model's thinking is read first (services/frontend/reasoning.py), its tool calls
        from the answer only."""
        reader = ToolCallStream(self.mode, {t["function"]["name"] for t in self.tools}, self.name,
                                lambda name: ToolCall(name, ""))
        return self.thinking.reader(reader) if self.thinking is not None else reader

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a finished output: the same reader fed the whole text."""
        return self.read(text)[1:]

    def read(self, text: str) -> tuple[str | None, str | None, list[ToolCall]]:
        """(reasoning, content, tool calls) of a finished output; reasoning None without a reasoning
        parser or when the model gave none."""
        reader = self.stream()
        pieces = reader.feed(text) + reader.finish()
        reasoning = "".join(p.text for p in pieces if p.kind == "reasoning") or None
        content = "".join(p.text for p in pieces if p.kind == "content")
        return reasoning, (content.strip() or None) if reader.calls else content, reader.calls

    def _parameters(self, name: str) -> dict:
        tool = next(t for t in self.tools if t["function"]["name"] == name)
        return tool["function"].get("parameters") or {"type": "object"}


@dataclass(frozen=True)
class ToolFields:
    """Where an API's request carries a tool's name and parameters and a named tool choice's name,
    so an error names the field the client wrote ({i}: the tool's index). Chat completions' by default."""

    name: str = "tools[{i}].function.name"
    parameters: str = "tools[{i}].function.parameters"
    choice_name: str = "tool_choice.function.name"


def plan(tools: list[dict] | None, tool_choice, parallel_tool_calls: bool | None,
         fields: ToolFields = ToolFields()) -> ToolPlan:
    """Validate tools and tool_choice (chat completions' plain dicts, whichever API carried them)."""
    tools = tools or []
    check(len(tools) <= MAX_TOOLS, "tools", f"at most {MAX_TOOLS} tools, got {len(tools)}")
    for i, tool in enumerate(tools):
        function = tool.get("function") or {}
        check(isinstance(function.get("name"), str) and NAME.match(function["name"]) is not None,
              fields.name.format(i=i), "must be 1 to 64 letters, digits, '_', '.' or '-'")
        check(isinstance(function.get("parameters", {}), dict), fields.parameters.format(i=i),
              "must be a JSON schema object")
    names = [t["function"]["name"] for t in tools]
    check(len(set(names)) == len(names), "tools", "function names must be unique")
    choice = "auto" if tool_choice is None and tools else (tool_choice or "none")
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        check(name in names, fields.choice_name, f"{name!r} is not one of the tools")
        return ToolPlan(tools=tools, mode="named", name=name, parallel=parallel)
    check(choice in ("none", "auto", "required"), "tool_choice",
          "must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}")
    check(choice == "none" or tools, "tool_choice", f"{choice!r} needs tools")
    return ToolPlan(tools=tools, mode=choice, parallel=parallel)


def template_messages(messages: list[dict], tool_plan: ToolPlan, template: str) -> tuple[list[dict], list | None]:
    """The messages and `tools` argument for the chat template. A template that knows `tools` /
    `tool_calls` gets them as they are; another gets the Hermes format as text."""
    knows_tools = "tools" in template
    knows_calls = "tool_calls" in template
    out = []
    for i, message in enumerate(messages):
        message = dict(message)
        if message["role"] == "developer":
            message["role"] = "system"
        calls = message.pop("tool_calls", None) or []
        if calls:
            check(message["role"] == "assistant", f"messages[{i}].tool_calls", "only assistant messages carry them")
            if knows_calls:
                message["tool_calls"] = [_template_call(c, i) for c in calls]
            else:
                message["content"] = "\n".join([message["content"]] * bool(message["content"]) + [
                    "<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                  "arguments": _template_call(c, i)["function"]["arguments"]},
                                                 ensure_ascii=False) + "\n</tool_call>" for c in calls])
        out.append(message)
    if tool_plan.mode == "none" or not tool_plan.tools:
        return out, None
    if knows_tools:
        return out, tool_plan.tools
    system = HERMES_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tool_plan.tools))
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + system}
    else:
        out.insert(0, {"role": "system", "content": system})
    return out, None


def _template_call(call: dict, i: int) -> dict:
    """An assistant message's tool call with its arguments as a dict (what templates expect)."""
    function = call.get("function") or {}
    try:
        arguments = json.loads(function.get("arguments") or "{}")
    except ValueError:
        raise InvalidArgument(f"messages[{i}].tool_calls", "function.arguments must be JSON text") from None
    return {"id": call.get("id", ""), "type": "function",
            "function": {"name": function.get("name", ""), "arguments": arguments}}
