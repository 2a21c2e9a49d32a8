"""Request-body models for structured outputs and tool calling (OpenAI's and vLLM's names).

Types only: constraints are checked by services/core/structured.py and compiled by the frontend's
GrammarCheck; tools and tool_choice are checked by services/frontend/tool_calls.py.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.core.structured import MAX_CHOICES


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class JsonSchemaFormat(_Strict):
    name: str = Field(description="The schema's name (not used by the server).")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="A JSON schema; omitted: any JSON.")
    strict: bool | None = Field(None, description="Accepted; outputs always follow the schema exactly.")


class ResponseFormat(_Strict):
    """OpenAI's response_format."""

    model_config = ConfigDict(json_schema_extra={
        "if": {"properties": {"type": {"const": "json_schema"}}},
        "then": {"required": ["json_schema"], "properties": {"json_schema": {"not": {"type": "null"}}}}})

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


OPTIONS = ("json", "regex", "choice", "grammar", "json_object")


class StructuredOutputs(_Strict):
    """vLLM's structured_outputs: exactly one of these (json_object false counts as not given)."""

    model_config = ConfigDict(json_schema_extra={"oneOf": [
        {"required": [name], "properties": {name: {"not": {"enum": [None, False]}}}} for name in OPTIONS]})

    json_: dict[str, Any] | str | None = Field(None, alias="json", description="A JSON schema the output follows.")
    regex: str | None = Field(None, min_length=1,
                              description="A regular expression (Rust syntax) the whole output matches.")
    choice: list[Annotated[str, Field(min_length=1)]] | None = Field(
        None, min_length=1, max_length=MAX_CHOICES, description="The output is exactly one of these strings.")
    grammar: str | None = Field(None, min_length=1, description="A Lark grammar (llguidance's dialect), rule `start`.")
    json_object: bool | None = Field(None, description="Any JSON object.")

    def options(self) -> dict:
        return {"json": self.json_, "regex": self.regex, "choice": self.choice, "grammar": self.grammar,
                "json_object": self.json_object}


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON schema of the arguments object.")
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(_Strict):
    name: str
    arguments: str = Field(description="The arguments as JSON text.")


class ToolCallIn(_Strict):
    """A tool call of an earlier assistant message."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction
