"""Structured outputs in the engine (tiny random-weight model, temperature 1, many seeds): every
output is valid, and a seeded constrained output is the same alone, in a batch, after preemption
(recompute and swap) and under async scheduling, because the matcher is rebuilt from the tokens."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from services.core.errors import InvalidArgument
from services.core.sampling_params import SamplingParams
from services.core.structured import Constraint
from tests.conftest import make_llm, random_prompts
from tests.worker.test_async_scheduling import run_async

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 8},
    "age": {"type": "integer", "minimum": 18, "maximum": 99},
    "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{2,4}$"}, "minItems": 1, "maxItems": 3},
    "boss": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/ref"}]}},
    "required": ["name", "age", "role", "tags", "boss"], "additionalProperties": False,
    "$defs": {"ref": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9}},
                      "required": ["id"], "additionalProperties": False}}}
LONG = {"type": "array", "items": {"type": "string", "minLength": 6, "maxLength": 12}, "minItems": 6, "maxItems": 6}
EMAIL = r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)"
ARITH = 'start: expr\nexpr: term (("+" | "-") term)*\nterm: NUM | "(" expr ")"\nNUM: /[0-9]{1,2}/'
ARITH_RE = re.compile(r"[0-9()+\-]+")
NUM_SEEDS = 6


def sampled(llm, options: dict, max_tokens: int = 120, num: int = NUM_SEEDS, prompts=None):
    prompts = prompts or random_prompts(num, 512, 3, 30, seed=1)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=max_tokens, structured_outputs=options)
              for s in range(num)]
    return [out.outputs[0] for out in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return make_llm(tiny_llama, dtype="float32")


@pytest.mark.slow
def test_every_constraint_kind_at_temperature_1_gives_valid_outputs(llm):
    for out in sampled(llm, {"json": PERSON}):
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), PERSON)
    for out in sampled(llm, {"regex": EMAIL}):
        assert out.finish_reason == "stop" and re.fullmatch(EMAIL, out.text), out.text
    choices = ["alpha", "beta", "gamma delta", "ε"]
    texts = [out.text for out in sampled(llm, {"choice": choices})]
    assert set(texts) <= set(choices) and len(set(texts)) > 1
    for out in sampled(llm, {"grammar": ARITH}, max_tokens=200):
        if out.finish_reason == "stop":  # an expression the grammar derives, balanced parentheses
            assert ARITH_RE.fullmatch(out.text) and out.text.count("(") == out.text.count(")"), out.text
    objects = sampled(llm, {"json_object": True}, max_tokens=200)
    assert all(out.text.startswith("{") for out in objects)
    assert all(isinstance(json.loads(out.text), dict) for out in objects if out.finish_reason == "stop")


def test_parallel_samples_each_follow_the_constraint(llm):
    [out] = llm.generate([[5, 6, 7]], SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=40,
                                                        structured_outputs={"regex": EMAIL}), use_tqdm=False)
    assert len({o.text for o in out.outputs}) > 1
    assert all(re.fullmatch(EMAIL, o.text) for o in out.outputs)


def constrained(i: int) -> SamplingParams:
    options = [{"json": LONG}, {"json": PERSON}, {"regex": EMAIL}][i % 3]
    return SamplingParams(temperature=1.0, seed=40 + i, max_tokens=100, structured_outputs=options)


def free(i: int) -> SamplingParams:
    return SamplingParams(temperature=0.9, seed=70 + i, max_tokens=60, ignore_eos=True)


def tokens(llm, prompts, params):
    return [[o.token_ids for o in out.outputs] for out in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.slow
def test_seeded_constrained_outputs_alone_in_a_batch_and_after_preemption(tiny_llama):
    prompts = random_prompts(8, 512, 20, 100, seed=8)
    params = [constrained(i) if i < 4 else free(i) for i in range(8)]
    llm = make_llm(tiny_llama, dtype="float32", enable_prefix_caching=False)
    alone = [tokens(llm, [p], [sp])[0] for p, sp in zip(prompts[:4], params)]
    assert tokens(llm, prompts, params)[:4] == alone
    for mode in ("recompute", "swap"):
        small = make_llm(tiny_llama, dtype="float32", num_gpu_blocks=20, preemption_mode=mode)
        assert tokens(small, prompts, params)[:4] == alone, mode
        assert small.scheduler.num_preemptions > 0, mode
    jsonschema.validate(json.loads(llm.tokenizer.decode(alone[0][0])), LONG)


def test_async_scheduling_advances_the_matcher_consistently(tiny_llama):
    """The early step samples under the mask of the token it assumes; the matcher is rolled
    back when the mirror drops that token, so plain and async-scheduled steps give the same tokens."""
    prompts = random_prompts(3, 512, 3, 40, seed=5)
    params = [constrained(i) for i in range(3)]
    worker, got = run_async(tiny_llama, prompts, params)
    want = make_llm(tiny_llama, dtype="float32").generate(prompts, params, use_tqdm=False)
    for steps, out in zip(got, want):
        assert [t for ids, _ in steps for t in ids] == out.outputs[0].token_ids
    assert worker.runner.async_steps.num_used >= 8


def test_the_engine_refuses_a_constraint_that_does_not_compile_before_running_anything(llm):
    with pytest.raises(InvalidArgument, match=r"^structured_outputs\.regex: cannot compile"):
        llm.generate(["x"], SamplingParams(structured_outputs={"regex": "(unclosed"}), use_tqdm=False)
    assert not llm.scheduler.has_unfinished()


def test_bad_constraints_name_the_field():
    with pytest.raises(InvalidArgument, match="^structured_outputs: exactly one"):
        SamplingParams(structured_outputs={"regex": "a", "json": {}})
    with pytest.raises(InvalidArgument, match=r"^structured_outputs\.choice"):
        SamplingParams(structured_outputs={"choice": []})
    with pytest.raises(InvalidArgument, match="^min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs={"regex": "a+"})
    with pytest.raises(InvalidArgument, match="^structured_outputs.json: invalid json"):
        Constraint("json", "{nope", "structured_outputs.json").grammar()


def test_the_matcher_follows_the_mirror_back_and_forth(tiny_llama):
    """A matcher that consumed tokens the mirror then dropped (an early step the next delta did not confirm)
    or replaced gives the mask of a fresh matcher fed the mirror's tokens."""
    import torch

    from services.worker.grammar import Grammars

    llm = make_llm(tiny_llama, dtype="float32")
    grammars = Grammars(tiny_llama, llm.engine.workers["worker-0"].info.vocab_size, (2,))
    constraint = Constraint.json_schema(PERSON)
    text = '{"name": "ab", "age": 42, "role": "user", "tags": ["xy"], "boss": null}'
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    other = llm.tokenizer.encode('{"name": "zz", "age": 19', add_special_tokens=False)

    def mask_after(grammar, tokens):
        logits = torch.zeros(1, grammars.vocab_size)
        grammars.mask(logits, [(0, grammar, tokens)])
        return logits.isfinite()

    moved = grammars.start(constraint, 1)
    for back_and_forth in (ids, ids[:5], ids[:9], other, ids[:3]):
        assert torch.equal(mask_after(moved, back_and_forth), mask_after(grammars.start(constraint, 2), back_and_forth))
    assert not moved.failed and mask_after(moved, ids)[0].sum() < 5  # only the end may follow a whole document
