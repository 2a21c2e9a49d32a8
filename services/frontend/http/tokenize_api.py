"""vLLM's /tokenize and /detokenize (issue 45): what evaluation harnesses call to count and split
a prompt as the server does (lm-evaluation-harness's remote tokenizer, docs/guide/scoring.md).

/tokenize takes a text (`prompt`, special tokens added by default) or chat messages (rendered with
the chat template, as chat completions renders them; `add_generation_prompt` by default, special
tokens not added by default, as vLLM does) and answers {count, max_model_len, tokens, token_strs}.
/detokenize takes {tokens} and answers {prompt}. The same FrontendCore.tokenize and detokenize the
gRPC Tokenize and Detokenize call.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from fastapi import FastAPI
from pydantic import BaseModel, Discriminator, Field, Tag

from services.core.errors import check
from services.frontend.core import FrontendCore
from services.frontend.http import schemas
from services.frontend.http.models import TEMPLATE_KWARGS, ChatMessage, Strict, Text, TokenId
from services.frontend.http.openai_requests import _message
from services.frontend.types import MAX_CHAT_MESSAGES, Prompt

TOKEN_STRS = Field(False, description="Also return each token's text (as the logprobs' tokens show it).")


class TokenizeCompletionRequest(Strict):
    model: Text | None = Field(None, description="The served model's id; omitted: the served model.")
    prompt: Text = Field(description="The text to tokenize.")
    add_special_tokens: bool = Field(True, description="Add the tokenizer's special tokens (e.g. BOS).")
    return_token_strs: bool = TOKEN_STRS


class TokenizeChatRequest(Strict):
    model: Text | None = Field(None, description="The served model's id; omitted: the served model.")
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_CHAT_MESSAGES,
                                        description="Rendered with the chat template, as chat completions does.")
    add_generation_prompt: bool = Field(True, description="End with the assistant's turn opened.")
    continue_final_message: Literal[False] = Field(False, description="Not supported: only false.")
    add_special_tokens: bool = Field(False, description=(
        "Add the tokenizer's special tokens (e.g. BOS) before the rendered chat (templates bring their own)."))
    chat_template: Text | None = Field(None, description=(
        "A Jinja chat template to use instead of the model's (--trust-request-chat-template)."))
    chat_template_kwargs: dict[str, Any] | None = Field(None, json_schema_extra=TEMPLATE_KWARGS,
                                                        description="More variables for the chat template.")
    return_token_strs: bool = TOKEN_STRS


def _kind(body) -> str:
    """Which request a body is: a chat when it has messages (tags are no identifiers: no part of a param)."""
    has_messages = "messages" in body if isinstance(body, dict) else hasattr(body, "messages")
    return "chat-tokenize" if has_messages else "text-tokenize"


TokenizeRequest = Annotated[Union[Annotated[TokenizeCompletionRequest, Tag("text-tokenize")],
                                  Annotated[TokenizeChatRequest, Tag("chat-tokenize")]], Discriminator(_kind)]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeRequest(Strict):
    model: Text | None = Field(None, description="The served model's id; omitted: the served model.")
    tokens: list[TokenId] = Field(description="Token ids of the served model's vocabulary.")


class DetokenizeResponse(BaseModel):
    prompt: str


def add_routes(app: FastAPI, core: FrontendCore) -> None:
    @app.post("/tokenize", response_model=TokenizeResponse, responses=schemas.errors(400, 401, 404, 413, 503))
    async def tokenize(body: TokenizeRequest) -> dict:
        """A text's or a chat's token ids, as the server would generate from them."""
        core.check_model(body.model or "")
        card = await core.model_card()
        if isinstance(body, TokenizeCompletionRequest):
            tokens = await core.tokenize(Prompt(text=body.prompt, add_special_tokens=body.add_special_tokens))
        else:
            check(body.chat_template is None or core.trust_request_chat_template, "chat_template",
                  "this server does not take a request's chat template (--trust-request-chat-template)")
            prompt = Prompt(messages=[_message(i, m) for i, m in enumerate(body.messages)],
                            add_generation_prompt=body.add_generation_prompt, template_kwargs=body.chat_template_kwargs,
                            chat_template=body.chat_template)
            tokens = await core.tokenize(prompt)
            if body.add_special_tokens:  # the rendered chat, tokenized as a text is
                tokens = core.tokenizer.encode(core.render(prompt), add_special_tokens=True)
        strs = [core.tokenizer.decode([t], skip_special_tokens=False) for t in tokens] \
            if body.return_token_strs else None
        return {"count": len(tokens), "max_model_len": card.max_model_len, "tokens": tokens, "token_strs": strs}

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=schemas.errors(400, 401, 404, 413, 503))
    async def detokenize(body: DetokenizeRequest) -> dict:
        """The text of token ids (special tokens left out)."""
        core.check_model(body.model or "")
        await core.model_card()  # the vocabulary checked is the served model's
        return {"prompt": await core.detokenize(body.tokens, field="tokens")}
