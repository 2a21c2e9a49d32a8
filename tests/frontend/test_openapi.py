"""/openapi.json tells the truth: schemathesis generates requests from it, valid ones (positive)
and invalid ones (negative), against a real frontend (HTTP on a free port, the fake echo
scheduler): no 5xx, every status, content type and body is one the schema documents, and every
schema-invalid request is refused with a 4xx. Bounded: a fixed number of examples per operation."""
from __future__ import annotations

import json
import re
import urllib.request

import hypothesis
import pytest
import schemathesis
from schemathesis.checks import not_a_server_error
from schemathesis.core.errors import InvalidSchema
from schemathesis.specs.openapi.checks import (content_type_conformance, negative_data_rejection,
                                         response_schema_conformance, status_code_conformance)

from services.core.sampling_params import SamplingParams
from test_http_api import http_harness

pytestmark = pytest.mark.slow
MAX_EXAMPLES = 30  # per operation and mode
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]


@pytest.fixture(scope="module")
def served(tiny_llama):
    # a reasoning parser and request templates on: every new field (chat_template, max_reasoning_tokens,
    # thinking budgets, reasoning items) reaches the code it drives
    harness = http_harness(tiny_llama, reasoning_parser="qwen3", trust_request_chat_template=True)
    yield harness
    harness.close()


# a pooling model's operations, checked against one that serves them (tests/frontend/test_pooling_http.py)
POOLING_PATHS = ("/v1/embeddings", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank")


def operations(served, paths: tuple[str, ...] | None = None) -> list:
    """The schema's operations: those of `paths`, or all but the pooling ones (this module's model generates)."""
    schema = schemathesis.openapi.from_url(served.url + "/openapi.json")
    found = [result.ok() for result in schema.get_all_operations()]
    return [op for op in found if (op.path in paths if paths else op.path not in POOLING_PATHS)]


@pytest.mark.parametrize("mode", [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE])
def test_every_response_is_one_the_schema_documents(served, mode):
    """Positive mode also checks that every schema-valid request gets a 200 (refusal(): but for the limits no
    schema can state), on the same requests. (schemathesis' own pytest plugin does not run under this pytest;
    its strategies do.)"""
    found = operations(served)
    assert len(found) == 13
    failures, tested, refused = [], [], []
    for operation in found:

        @hypothesis.settings(deadline=None, max_examples=MAX_EXAMPLES, derandomize=True, database=None,
                             suppress_health_check=list(hypothesis.HealthCheck), phases=[hypothesis.Phase.generate])
        @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
        def check(case) -> None:
            response = case.call(timeout=30)
            try:
                case.validate_response(response, checks=CHECKS, transport_kwargs={"timeout": 30})
            except Exception as error:  # noqa: BLE001 - collected: one report for every operation
                failures.append(f"{operation.label}: {error}"[:2000])
            if mode is schemathesis.GenerationMode.POSITIVE and (why := refusal(operation, case, response)):
                refused.append(why)

        try:
            try:
                check()
            except schemathesis.core.errors.InvalidSchema:
                # schemathesis could not build one mutation ("cannot generate an array with 1 demanded
                # elements": count_tokens' messages, under some seeds): its limit, not the server's
                # answer. The same operation, drawn from another seed.
                assert mode is schemathesis.GenerationMode.NEGATIVE
                hypothesis.seed(1)(check)()
            tested.append(operation.label)
        except hypothesis.errors.Unsatisfiable:  # negative: nothing to make invalid (no body, any path)
            assert mode is schemathesis.GenerationMode.NEGATIVE
        except InvalidSchema as error:  # negative: schemathesis' generator gave up on one mutation (the
            # examples drawn before it were sent and checked); the draws follow the whole schema, so adding
            # operations made count_tokens' 'Cannot generate an array with 1 demanded elements' come up
            assert mode is schemathesis.GenerationMode.NEGATIVE and str(error).startswith("Cannot generate"), error
            tested.append(operation.label)
    assert failures == []
    assert refused == [], "\n".join(refused)
    assert {"POST /v1/completions", "POST /v1/chat/completions", "POST /v1/responses", "POST /v1/messages",
            "POST /v1/messages/count_tokens", "POST /tokenize", "POST /detokenize"} <= set(tested)


def test_every_integer_bound_is_stated_inclusively(served):
    """An integer's bounds as minimum/maximum: a generator reading `exclusiveMaximum` as OpenAPI 3.0's
    boolean drops the bound (schemathesis once sent a seed of 2**63 the schema's `exclusiveMaximum`
    excluded, and the 400 failed the positive-mode test now and then)."""
    found = []

    def walk(node, path):
        if isinstance(node, dict):
            if node.get("type") == "integer" and ("exclusiveMaximum" in node or "exclusiveMinimum" in node):
                found.append(path)
            for key, value in node.items():
                walk(value, f"{path}/{key}")
        elif isinstance(node, list):
            for index, value in enumerate(node):
                walk(value, f"{path}/{index}")

    with urllib.request.urlopen(served.url + "/openapi.json", timeout=30) as response:
        walk(json.load(response), "")
    assert found == []


def test_the_schema_states_sampling_params_own_ranges():
    """The ranges the request model states are SamplingParams' (which checks them for gRPC too): a
    value at each stated bound is accepted by SamplingParams, one just past it refused. (A served
    schema narrows some to the served model's: state_served_limits.)"""
    from services.frontend.http.models import CompletionRequest
    properties = CompletionRequest.model_json_schema()["properties"]
    checked = 0
    for name in SamplingParams.field_names():
        spec = next((s for s in properties.get(name, {}).get("anyOf", [properties.get(name, {})])
                     if s.get("type") in ("integer", "number")), None)
        if spec is None:
            continue
        step, kind = (1, int) if spec["type"] == "integer" else (1e-6, float)  # the schema writes 1.0 for 1
        for bound, inside, outside in (("minimum", 0, -step), ("maximum", 0, step),
                                       ("exclusiveMinimum", step, 0), ("exclusiveMaximum", -step, 0)):
            if bound not in spec:
                continue
            if (name, bound) == ("max_tokens", "minimum"):
                continue  # completions' 0 (with echo: the prompt scored alone) is no SamplingParams value
            extra = {"min_tokens": 0} if name == "max_tokens" else {"max_tokens": 2**32 - 1} if name == "min_tokens" \
                else {}
            SamplingParams(**extra, **{name: kind(spec[bound]) + inside})  # accepted
            with pytest.raises(ValueError):
                SamplingParams(**extra, **{name: kind(spec[bound]) + outside})
            checked += 1
    assert checked >= 20


# The limits no JSON Schema can state: each compares a value with another or needs more than a
# schema (a tokenizer, a JSON parser). The schema's descriptions say them in words.
NOT_EXPRESSIBLE = {
    r"^(max_tokens|max_completion_tokens|max_output_tokens): \d+ with a \d+-token prompt exceeds max_model_len":
        "the prompt's length in tokens (the schema bounds max_tokens by max_model_len - 1 alone)",
    r"^(prompt|messages): has \d+ (tokens|characters)": "the prompt's length in tokens (a chat's too)",
    r"^min_tokens: must be in \[0, max_tokens\]": "one number bounded by another",
    r"^seed: Input should be less than or equal to 9223372036854775807":
        "an integer bound past 2**53 for a JSON double: a whole-number float at 2**63 compares equal to 2**63-1",
    r"^messages\[\d+\]\.tool_calls: function\.arguments must be JSON text": "JSON inside a string",
    r"^tools: function names must be unique": "uniqueness of a member of the items",
    r"^tool_choice(\.function)?\.name: .* is not one of the tools": "a value equal to another's",
    r"^input\[\d+\]\.arguments: must be JSON text": "JSON inside a string",
    r"^previous_response_id: no stored response": "the id of a response the server stored",
    r"^(structured_outputs|response_format\.json_schema|tools\[\d+\]\.function\.parameters)\S*: "
    r".*(grammar|regex|schema|compile|json)":
        "a grammar, regular expression or JSON schema (or JSON text) that compiles",
    r"^chat_template: is not a valid Jinja template|^messages: chat template refused the messages":
        "a Jinja template that compiles and renders",
    r"^prompt: must not be empty": "a chat template that renders something",
}


def refusal(operation, case, response) -> str | None:
    """Positive mode: whatever /openapi.json allows, the server does (a 400 for a schema-valid body
    is a limit the schema hides: an empty prompt, a user message without content, top_logprobs
    without logprobs, a token id past the vocabulary, the served model's id...), but for the few
    limits JSON Schema cannot state (NOT_EXPRESSIBLE). What to report for a refused request, or None."""
    if "{response_id}" in operation.path and response.status_code == 404:
        return None  # a stored response's id: no schema can name the ids the server holds
    message = response.json()["error"]["message"] if response.status_code == 400 else ""
    if response.status_code != 200 and not any(re.search(p, message) for p in NOT_EXPRESSIBLE):
        return f"{operation.label} {response.status_code} {response.text[:300]} <- {case.body!r:.600}"
    return None


def test_the_schema_says_a_chat_without_max_tokens_may_fill_the_context(served):
    import json

    from test_http_api import raw
    properties = json.loads(raw(served.url + "/openapi.json")[1])["components"]["schemas"][
        "ChatCompletionRequest"]["properties"]
    assert "whole context" in properties["max_completion_tokens"]["description"]
    assert "context leaves" in properties["max_tokens"]["description"]
