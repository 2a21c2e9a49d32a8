"""Every integer a client sends is checked against the width that carries it (services/core/widths.py):
at each width's edge, and one past it, a request is accepted (200 / OK) or refused with a 400 /
INVALID_ARGUMENT naming the field, never a 500. The integer fields are found by walking the public
request models (/openapi.json's request bodies, the public proto's GenerateRequest), so a field added
later is covered too. A real frontend over real sockets, in front of the fake echo scheduler, which
gets the internal protos the frontend encodes (where a too-wide top_k used to fail)."""
from __future__ import annotations

import json

import grpc
import hypothesis
import pytest
from hypothesis import strategies as st

from pagedserve.v1 import generate_pb2, generate_pb2_grpc
from test_http_api import http_harness, raw

EDGES = sorted({sign * 2**bits + delta for bits in (31, 32, 63, 64) for sign in (1, -1) for delta in (-1, 0, 1)}
               | {-1, 0, 1})
pytestmark = pytest.mark.slow  # about 12 s: some 600 requests
BASE = {"/v1/completions": {"prompt": [5, 6, 7], "max_tokens": 2},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}}
BODY_MODELS = {"/v1/completions": "CompletionRequest", "/v1/chat/completions": "ChatCompletionRequest"}


@pytest.fixture(scope="module")
def served(tiny_llama):
    harness = http_harness(tiny_llama)
    yield harness
    harness.close()


@pytest.fixture(scope="module")
def slots(served) -> list[tuple[str, tuple]]:
    """(path, slot) for every integer in every request body the schema documents."""
    components = json.loads(raw(served.url + "/openapi.json")[1])["components"]["schemas"]
    found = [(path, slot) for path, model in BODY_MODELS.items()
             for slot in integer_slots({"$ref": f"#/components/schemas/{model}"}, components)]
    names = {slot[0] for _, slot in found}
    assert {"top_k", "seed", "n", "max_tokens", "min_tokens", "logprobs", "top_logprobs", "logit_bias",
            "priority", "prompt", "stop_token_ids", "max_completion_tokens"} <= names, names
    return found


def integer_slots(schema: dict, components: dict, slot: tuple = (), seen: frozenset = frozenset()):
    """Where an integer goes: a tuple of property names, "[]" for a list's item, "{}" for an object's
    key that must be an integer as a string (logit_bias)."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        if name not in seen:
            yield from integer_slots(components[name], components, slot, seen | {name})
        return
    for member in schema.get("anyOf", []) + schema.get("oneOf", []):
        yield from integer_slots(member, components, slot, seen)
    if schema.get("type") == "integer":
        yield slot
    elif schema.get("type") == "array" and "items" in schema:
        yield from integer_slots(schema["items"], components, (*slot, "[]"), seen)
    elif schema.get("type") == "object":
        if not slot:  # the body's own fields; a nested object's integers would need its other fields
            for name, spec in schema.get("properties", {}).items():
                yield from integer_slots(spec, components, (name,), seen)
        elif any("[0-9]" in pattern for pattern in schema.get("patternProperties", {})):
            yield (*slot, "{}")


def body_with(path: str, slot: tuple, value: int) -> dict:
    inner = value
    for part in reversed(slot[1:]):
        inner = [inner] if part == "[]" else {str(inner): 1.0}
    return {**BASE[path], slot[0]: inner}


def assert_accepted_or_named(served, path: str, slot: tuple, value: int) -> None:
    status, answer = raw(served.url + path, body_with(path, slot, value))
    assert status in (200, 400), (path, slot, value, status, answer[:300])
    if status == 400:
        error = json.loads(answer)["error"]
        assert (error["param"] or "").split(".")[0].split("[")[0] == slot[0] or error["message"].startswith(
            f"{slot[0]}:"), (path, slot, value, error)


def test_an_integer_at_each_widths_edge_is_accepted_or_a_400_naming_the_field(served, slots):
    """Before: top_k 2**31 was a 500 ValueError: Value out of range, in completions, chat and streams."""
    for path, slot in slots:
        for value in EDGES:
            assert_accepted_or_named(served, path, slot, value)
    status, answer = raw(served.url + "/v1/chat/completions", {**BASE["/v1/chat/completions"], "top_k": 2**31,
                                                                "stream": True})
    assert status == 400 and json.loads(answer)["error"]["param"] == "top_k"


def test_any_integer_anywhere_in_a_request_is_accepted_or_a_400_naming_the_field(served, slots):
    @hypothesis.settings(max_examples=150, deadline=None, derandomize=True, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(where=st.sampled_from(slots), value=st.integers() | st.sampled_from(EDGES))
    def check(where, value):
        assert_accepted_or_named(served, *where, value)

    check()


def grpc_integer_fields(descriptor, prefix: tuple = ()):
    """(path of field names, field descriptor) for every integer in the public GenerateRequest."""
    from google.protobuf.descriptor import FieldDescriptor as F
    for field in descriptor.fields:
        if field.type == F.TYPE_MESSAGE and field.message_type.GetOptions().map_entry:
            yield (*prefix, field.name), field.message_type.fields_by_name["key"]
        elif field.type == F.TYPE_MESSAGE and len(prefix) < 2:
            yield from grpc_integer_fields(field.message_type, (*prefix, field.name))
        elif field.cpp_type in (F.CPPTYPE_INT32, F.CPPTYPE_INT64, F.CPPTYPE_UINT32, F.CPPTYPE_UINT64):
            yield (*prefix, field.name), field


def test_every_integer_of_the_public_grpc_request_at_its_edges_is_ok_or_invalid_argument(served):
    """The proto carries its own widths; every value it can carry must reach the client as OK or
    INVALID_ARGUMENT naming the field (not INTERNAL when the frontend re-encodes it internally)."""
    from google.protobuf.descriptor import FieldDescriptor as F
    bounds = {F.CPPTYPE_INT32: (-2**31, 2**31 - 1), F.CPPTYPE_INT64: (-2**63, 2**63 - 1),
              F.CPPTYPE_UINT32: (0, 2**32 - 1), F.CPPTYPE_UINT64: (0, 2**64 - 1)}
    fields = list(grpc_integer_fields(generate_pb2.GenerateRequest.DESCRIPTOR))
    assert {"priority", "n", "top_k", "seed", "max_tokens", "logprobs"} <= {p[-1] for p, _ in fields}, fields
    with grpc.insecure_channel(served.address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        for path, field in fields:
            low, high = bounds[field.cpp_type]
            for value in sorted({low, low + 1, -1 if low < 0 else 0, 1, high - 1, high} | {
                    e for e in EDGES if low <= e <= high}):
                request = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[5, 6, 7]))
                request.params.max_tokens = 2
                set_field(request, path, field, value)
                try:
                    list(stub.Generate(request, timeout=10))
                except grpc.RpcError as error:
                    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (path, value, error.details())
                    oneof = generate_pb2.GenerateRequest.DESCRIPTOR.fields_by_name[path[0]].containing_oneof
                    names = {*path, oneof.name} if oneof else set(path)  # token_ids is "the prompt"
                    assert error.details().split(":")[0] in names, (path, value, error.details())


def set_field(request, path: tuple, field, value: int) -> None:
    target = request
    for name in path[:-1]:
        target = getattr(target, name)
    container = getattr(target, path[-1]) if field.name == "key" or field.is_repeated \
        else None
    if field.name == "key":  # a map's key
        container[value] = 1.0
    elif container is not None:
        container.append(value)
    else:
        setattr(target, path[-1], value)
