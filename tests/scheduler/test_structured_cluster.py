"""Constrained requests over the scheduler and worker services: a worker killed mid-generation
leaves its constrained sequences to be recomputed on the other worker, whose matcher replays
their tokens, so every output is the in-process run's, bit for bit, and still valid."""
from __future__ import annotations

import json

import jsonschema

from services.core.sampling_params import SamplingParams
from tests.conftest import random_prompts
from tests.core.test_structured import EMAIL, LONG, PERSON
from tests.cluster import Cluster, reference, run


def test_killed_worker_constrained_requests_complete_identically(tiny_llama):
    prompts = random_prompts(6, 512, 10, 60, seed=9)
    options = [{"json": LONG}, {"json": PERSON}, {"regex": EMAIL}]
    params = [SamplingParams(temperature=1.0, seed=10 + i, max_tokens=100, structured_outputs=options[i % 3])
              for i in range(6)]
    want = reference(tiny_llama, prompts, params)

    async def main():
        async with Cluster(tiny_llama, num_workers=2) as cluster:
            requests = [(f"s{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
            got, _ = await cluster.generate_killing(requests, after_messages=4)
            return got

    got = run(main())
    for g, w in zip(got, want):
        assert g.samples[0].token_ids == w.outputs[0].token_ids
        assert g.samples[0].finish_reason == w.outputs[0].finish_reason == "stop"
    jsonschema.validate(json.loads(want[0].outputs[0].text), LONG)
