"""Speculative decoding through the services: drafts verified on a worker over gRPC, under async
scheduling and a worker crash (its sequences replayed on the other), give the in-process tokens
and logprobs of a run without speculation."""
from __future__ import annotations


from tests.conftest import random_prompts
from tests.core.test_spec_decode import NGRAM, oracle
from tests.cluster import VOCAB, Cluster, assert_same, mixed_params, reference, run


def test_drafts_verified_over_grpc_with_async_scheduling_and_a_worker_crash(model_dir):
    model = model_dir("llama", "tiny")
    prompts = [p * 2 for p in random_prompts(8, VOCAB, 10, 30, seed=6)]
    params = [mixed_params(i, max_tokens=32) for i in range(8)]
    want = reference(model, prompts, params)
    request_ids = [f"s{i}" for i in range(len(prompts))]

    async def main():
        async with Cluster(model, speculative_config=NGRAM, async_scheduling=True, num_workers=2) as cluster:
            oracle(cluster.scheduler.loop.core, want, request_ids=request_ids)
            got, stats = await cluster.generate_killing(list(zip(request_ids, prompts, params)), after_messages=4)
        for g, w in zip(got, want):
            assert_same(g, w)  # same ids and logprobs, and no token streamed twice
        assert stats.spec_decode_num_accepted_tokens > 0 and stats.spec_decode_num_drafts > 0
        assert len(stats.spec_decode_num_accepted_tokens_per_pos) == NGRAM["num_speculative_tokens"]

    run(main())


def test_metrics_carry_the_counters_under_vllm_names():
    from services.core.stats import SchedulerStats
    from services.frontend.metrics import FrontendMetrics

    stats = SchedulerStats(spec_decode_num_drafts=3, spec_decode_num_draft_tokens=12,
                           spec_decode_num_accepted_tokens=7, spec_decode_num_accepted_tokens_per_pos=(3, 2, 1, 1))
    text = FrontendMetrics("m").render(stats).decode()
    for line in ('pagedserve:spec_decode_num_drafts_total{model_name="m"} 3.0',
                 'pagedserve:spec_decode_num_draft_tokens_total{model_name="m"} 12.0',
                 'pagedserve:spec_decode_num_accepted_tokens_total{model_name="m"} 7.0',
                 'pagedserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 2.0'):
        assert line in text, line
