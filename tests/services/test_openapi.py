"""/openapi.json tells the truth: schemathesis generates requests from it, valid ones (positive)
and invalid ones (negative), against a real frontend (HTTP on a free port, the fake echo
scheduler): no 5xx, every status, content type and body is one the schema documents, and every
schema-invalid request is refused with a 4xx. Bounded: a fixed number of examples per operation."""
from __future__ import annotations

import hypothesis
import pytest
import schemathesis
from schemathesis.checks import not_a_server_error
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
    harness = http_harness(tiny_llama)
    yield harness
    harness.close()


def operations(served) -> list:
    schema = schemathesis.openapi.from_url(served.url + "/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


@pytest.mark.parametrize("mode", [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE])
def test_every_response_is_one_the_schema_documents(served, mode):
    """(schemathesis' own pytest plugin does not run under this pytest; its strategies do.)"""
    found = operations(served)
    assert len(found) == 11
    failures, tested = [], []
    for operation in found:

        @hypothesis.settings(deadline=None, max_examples=MAX_EXAMPLES, derandomize=True, database=None,
                             suppress_health_check=list(hypothesis.HealthCheck), phases=[hypothesis.Phase.generate])
        @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
        def check(case) -> None:
            try:
                case.call_and_validate(checks=CHECKS, timeout=30)
            except Exception as error:  # noqa: BLE001 - collected: one report for every operation
                failures.append(f"{operation.label}: {error}"[:2000])

        try:
            check()
            tested.append(operation.label)
        except hypothesis.errors.Unsatisfiable:  # negative: nothing to make invalid (no body, any path)
            assert mode is schemathesis.GenerationMode.NEGATIVE
    assert failures == []
    assert {"POST /v1/completions", "POST /v1/chat/completions", "POST /v1/responses", "POST /v1/messages",
            "POST /v1/messages/count_tokens"} <= set(tested)


def test_the_schema_states_sampling_params_own_ranges(served):
    """The ranges the schema states are SamplingParams' (which checks them for gRPC too): a value
    at each stated bound is accepted by SamplingParams, one just past it refused."""
    import json

    from test_http_api import raw
    properties = json.loads(raw(served.url + "/openapi.json")[1])["components"]["schemas"]["CompletionRequest"][
        "properties"]
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
            extra = {"min_tokens": 0} if name == "max_tokens" else {"max_tokens": 2**32 - 1} if name == "min_tokens" \
                else {}
            SamplingParams(**extra, **{name: kind(spec[bound]) + inside})  # accepted
            with pytest.raises(ValueError):
                SamplingParams(**extra, **{name: kind(spec[bound]) + outside})
            checked += 1
    assert checked >= 20
