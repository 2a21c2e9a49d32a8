"""The request and response bodies of the embeddings and scoring APIs (http/pooling_api.py):
OpenAI's /v1/embeddings, vLLM's /v1/score, and the Jina/Cohere rerank shape vLLM serves at
/rerank, /v1/rerank and /v2/rerank. Unknown fields are refused, as in models.py."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from services.frontend.http.models import Int, Strict, Text, TokenIds
from services.frontend.pooling import MAX_INPUTS

InputText = Annotated[Text, Field(min_length=1)]
Texts = Annotated[list[InputText], Field(min_length=1, max_length=MAX_INPUTS)]


class EmbeddingRequest(Strict):
    model: Text | None = Field(None, description="The served model's id; omitted: the served model.")
    input: InputText | Texts | TokenIds | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_INPUTS)] = \
        Field(description="A text, a list of texts, token ids, or a list of token-id lists; each at most "
                          "max_model_len tokens (a text with the model's special tokens added).")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="base64: each vector's little-endian float32 bytes, base64-encoded.")
    dimensions: Int(ge=1, le=1 << 20) | None = Field(
        None, description="Only for a Matryoshka model (is_matryoshka in its config.json): the first d values, "
                          "normalised again; any other model answers 400.")
    user: Text | None = Field(None, description="The caller's id, logged.")


class ScoreRequest(Strict):
    model: Text | None = Field(None, description="The served model's id; omitted: the served model.")
    text_1: InputText | Texts = Field(description="The query, or one query per text_2.")
    text_2: InputText | Texts = Field(description="The documents (as many as text_1 when it is a list).")
    instruction: Text | None = Field(None, description="A decoder reranker's task line (Qwen3-Reranker's "
                                                       "<Instruct>); ignored by a cross-encoder.")
    user: Text | None = None


class RerankRequest(Strict):
    model: Text | None = Field(None, description="The served model's id; omitted: the served model.")
    query: InputText
    documents: Texts
    top_n: Int(ge=0, le=MAX_INPUTS) | None = Field(None, description="The best n results; 0 or omitted: all.")
    return_documents: bool = Field(True, description="Each result carries its document's text.")
    instruction: Text | None = Field(None, description="A decoder reranker's task line; ignored by a cross-encoder.")
    user: Text | None = None


# ---- responses (for /openapi.json; the handlers build dicts) ------------------------
class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class Embedding(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str


class EmbeddingList(BaseModel):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class Score(BaseModel):
    object: Literal["score"]
    index: int
    score: float


class ScoreList(BaseModel):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[Score]
    usage: EmbeddingUsage


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    results: list[RerankResult]
    usage: RerankUsage
