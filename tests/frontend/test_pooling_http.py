"""Embeddings and reranking through the three services (a scheduler, a worker and a frontend in
process, tiny random BERT models): the official openai client, the same bits alone or batched,
vLLM's score and rerank shapes with sentence-transformers' order, the public gRPC Embed and Score,
and the limits (400 naming the field, 429 when full)."""
from __future__ import annotations

import base64
import json
import shutil

import grpc
import numpy as np
import openai
import pytest

from pagedserve import Client, GenerationError
from test_http_api import raw
from test_http_cluster import serve
from tests.conftest import make_llm, random_prompts

TEXTS = ["the quick brown fox", "paged attention keeps the KV cache in blocks", "a", "hello world " * 20]
QUERY = "how does the scheduler place a request"
DOCUMENTS = [  # a small fixed set; the expected order is sentence-transformers' for the same model
    "The scheduler places each request on the worker holding its longest cached prefix.",
    "A fox jumped over the lazy dog.",
    "Workers step at their own pace, one loop each.",
    "Blocks are freed when a request finishes.",
    "The frontend tokenizes the prompt and checks every parameter.",
    "Placement breaks ties by load, then free blocks, then step time.",
]


@pytest.fixture(scope="module")
def matryoshka_bert(model_dir, tmp_path_factory):
    """The tiny BERT, its config.json saying which shorter vectors it serves (vLLM's matryoshka_dimensions)."""
    folder = tmp_path_factory.mktemp("matryoshka") / "bert"
    shutil.copytree(model_dir("bert"), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 32, 64]}))
    return folder


@pytest.fixture(scope="module")
def embedder(matryoshka_bert):
    yield from serve(matryoshka_bert, max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def client(embedder):
    return openai.OpenAI(base_url=embedder.url + "/v1", api_key="unused", max_retries=0)


def test_openai_client_embeddings_match_sentence_transformers(embedder, client, model_dir):
    from sentence_transformers import SentenceTransformer

    created = client.embeddings.create(model=embedder.model, input=TEXTS)  # the client asks for base64
    got = np.array([d.embedding for d in created.data])
    want = SentenceTransformer(str(model_dir("bert")), device="cpu").encode(TEXTS, convert_to_numpy=True)
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cos.min() >= 0.99999
    assert [d.index for d in created.data] == [0, 1, 2, 3]
    floats = client.embeddings.create(model=embedder.model, input=TEXTS[0], encoding_format="float")
    assert floats.data[0].embedding == got[0].tolist()  # float32 bits either way
    assert created.usage.prompt_tokens == created.usage.total_tokens > len(TEXTS)


def test_token_ids_and_batches_give_the_same_bits(embedder, client):
    prompts = random_prompts(12, 512, min_len=2, max_len=100, seed=11)
    batched = client.embeddings.create(model=embedder.model, input=prompts, encoding_format="float")
    for i in (0, 5, 11):
        alone = client.embeddings.create(model=embedder.model, input=prompts[i], encoding_format="float")
        assert alone.data[0].embedding == batched.data[i].embedding
    status, body = raw(embedder.url + "/v1/embeddings", {"input": TEXTS[1], "encoding_format": "base64"})
    vector = np.frombuffer(base64.b64decode(json.loads(body)["data"][0]["embedding"]), "<f4")
    with Client(f"127.0.0.1:{embedder.frontend.port}") as grpc_client:
        vectors = grpc_client.embed([TEXTS[1], prompts[5]])
        with pytest.raises(GenerationError) as error:
            grpc_client.embed([[5] * 600])
    assert status == 200 and vectors[0] == vector.tolist()
    assert vectors[1] == batched.data[5].embedding
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT and error.value.field == "inputs"


def test_dimensions_give_the_renormalised_prefix_as_llm_embed(embedder, client, matryoshka_bert):
    full = client.embeddings.create(model=embedder.model, input=TEXTS, encoding_format="float")
    short = client.embeddings.create(model=embedder.model, input=TEXTS, dimensions=16)  # base64
    floats = client.embeddings.create(model=embedder.model, input=TEXTS, dimensions=16, encoding_format="float")
    for whole, part, part_floats in zip(full.data, short.data, floats.data):
        head = np.asarray(whole.embedding[:16], dtype=np.float64)
        np.testing.assert_array_max_ulp(np.float32(part.embedding), np.float32(head / np.linalg.norm(head)), maxulp=1)
        assert part.embedding == part_floats.embedding and len(part.embedding) == 16
    llm = make_llm(matryoshka_bert, dtype="float32", max_num_batched_tokens=256)
    assert [o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False, dimensions=16)] == \
        [d.embedding for d in short.data]


@pytest.fixture(scope="module")
def gguf_embedder(model_dir, tmp_path_factory):
    """A BERT served from its GGUF file alone (--model bert.gguf --task embed), as llama.cpp converts it."""
    from tests.gguf_files import write_bert_gguf

    path = write_bert_gguf(model_dir("bert_wordpiece"), tmp_path_factory.mktemp("gguf") / "bert.gguf", "f16")
    yield from serve(path, worker_config={"task": "embed"}, max_num_batched_tokens=256)


def test_a_gguf_encoder_serves_the_folders_vectors(gguf_embedder, model_dir):
    from sentence_transformers import SentenceTransformer

    client = openai.OpenAI(base_url=gguf_embedder.url + "/v1", api_key="unused", max_retries=0)
    created = client.embeddings.create(model=gguf_embedder.model, input=TEXTS, encoding_format="float")
    st = SentenceTransformer(str(model_dir("bert_wordpiece")), device="cpu")
    got, want = np.array([d.embedding for d in created.data]), st.encode(TEXTS, convert_to_numpy=True)
    assert ((got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)).min() >= 0.99999
    assert created.usage.prompt_tokens == sum(len(st.tokenizer(t)["input_ids"]) for t in TEXTS)  # the file's tokenizer


@pytest.mark.parametrize("body, param", [
    ({"input": "hi", "dimensions": 8}, "dimensions"),  # not one of its matryoshka_dimensions
    ({"input": "hi", "dimensions": 65}, "dimensions"),  # longer than the vector
    ({"input": ["fine", [5] * 600]}, "input[1]"),  # past max_model_len (512)
    ({"input": [3, 9999]}, "input"),  # outside the vocabulary
    ({"input": ""}, "input"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "hi", "model": "other"}, "model"),
])
def test_bad_embedding_requests_name_the_field(embedder, body, param):
    status, reply = raw(embedder.url + "/v1/embeddings", body)
    assert status in (400, 404) and json.loads(reply)["error"]["param"] == param


def test_full_queue_and_wrong_task_are_refused(embedder):
    core = embedder.frontend.core
    core.max_pending, core.num_pending = 1, 1  # as if one request were pending
    try:
        status, _ = raw(embedder.url + "/v1/embeddings", {"input": "hi"})
    finally:
        core.max_pending, core.num_pending = 0, 0
    assert status == 429
    status, reply = raw(embedder.url + "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert status == 400 and json.loads(reply)["error"]["param"] == "task"
    status, reply = raw(embedder.url + "/v1/rerank", {"query": "q", "documents": ["d"]})
    assert status == 400 and json.loads(reply)["error"]["param"] == "task"
    core.loras = {"sql": "/srv/loras/sql"}  # as if the frontend had --lora-modules: adapters serve generation only
    try:
        status, reply = raw(embedder.url + "/v1/embeddings", {"input": "hi", "model": "sql"})
    finally:
        core.loras = {}
    assert status == 400 and json.loads(reply)["error"]["param"] == "model"


@pytest.fixture(scope="module")
def reranker(model_dir):
    yield from serve(model_dir("bert_classifier"))


def test_rerank_and_score_follow_the_cross_encoder(reranker, model_dir):
    from sentence_transformers import CrossEncoder

    cross = CrossEncoder(str(model_dir("bert_classifier")), device="cpu")
    want = cross.rank(QUERY, DOCUMENTS)
    for path in ("/rerank", "/v1/rerank"):
        status, body = raw(reranker.url + path, {"query": QUERY, "documents": DOCUMENTS, "top_n": 4})
        results = json.loads(body)["results"]
        assert status == 200 and [r["index"] for r in results] == [w["corpus_id"] for w in want[:4]]
        assert results[0]["document"]["text"] == DOCUMENTS[want[0]["corpus_id"]]
        np.testing.assert_allclose([r["relevance_score"] for r in results], [w["score"] for w in want[:4]], atol=1e-6)
    status, body = raw(reranker.url + "/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS[:3]})
    scores = [d["score"] for d in json.loads(body)["data"]]
    np.testing.assert_allclose(scores, cross.predict([(QUERY, d) for d in DOCUMENTS[:3]]), atol=1e-6)
    with Client(f"127.0.0.1:{reranker.frontend.port}") as grpc_client:
        np.testing.assert_allclose(grpc_client.score(QUERY, DOCUMENTS[:3]), scores, atol=1e-7)  # fp32 on the wire
    status, body = raw(reranker.url + "/v1/score", {"text_1": ["a", "b"], "text_2": ["x", "y", "z"]})
    assert status == 400 and json.loads(body)["error"]["param"] == "text_1"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_schemathesis_finds_no_server_error_in_the_pooling_operations(embedder, reranker, mode):
    """/openapi.json's embeddings, score and rerank operations against servers of each task: no 5xx,
    every status, content type and body one the schema documents, every schema-invalid body a 4xx."""
    import hypothesis
    import schemathesis
    from test_openapi import CHECKS, operations

    generation = getattr(schemathesis.GenerationMode, mode.upper())
    failures = []
    for served, paths in ((embedder, ("/v1/embeddings",)), (reranker, ("/v1/score", "/v1/rerank", "/rerank"))):
        found = operations(served, paths)
        assert len(found) == len(paths)
        for operation in found:

            @hypothesis.settings(deadline=None, max_examples=8, derandomize=True, database=None,
                                 suppress_health_check=list(hypothesis.HealthCheck), phases=[hypothesis.Phase.generate])
            @hypothesis.given(case=operation.as_strategy(generation_mode=generation))
            def check(case) -> None:
                try:
                    case.call_and_validate(checks=CHECKS, timeout=30)
                except Exception as error:  # noqa: BLE001 - collected: one report for every operation
                    failures.append(f"{operation.label}: {error}"[:2000])

            check()
    assert failures == []
