"""Core dataclasses <-> internal protobuf messages round-trip exactly (floats included)."""
from __future__ import annotations

import pytest

from services.rpc import internal_codec
from services.core.errors import InvalidArgument
from services.core.sampling_params import SamplingParams
from services.core.sequence import ContinuedSample, SeqUpdate
from services.core.step import (CachedSequence, Logprobs, NewSequence, SeqOutput, StepDelta, StepResult,
                                WorkerInfo)

AWKWARD = 0.1 + 0.2  # not representable in float32: a float32 field would change it
PARAMS = SamplingParams(n=3, temperature=AWKWARD, top_k=7, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                        presence_penalty=-0.5, frequency_penalty=0.3, logit_bias={5: -2.5, 9: 1e-7}, seed=2**63 - 1,
                        max_tokens=33, min_tokens=2, stop_token_ids=[4, 8], ignore_eos=True, logprobs=0,
                        prompt_logprobs=20)


def lp(token: int, value: float) -> Logprobs:
    return Logprobs(token_id=token, logprob=value, rank=2, top=[(token + 1, value / 3), (token, value)])


def test_sampling_params_round_trip():
    assert internal_codec.params_from_proto(internal_codec.params_to_proto(PARAMS)) == PARAMS
    plain = SamplingParams()  # no seed, no logprobs: seed unset / -1 on the wire
    msg = internal_codec.params_to_proto(plain)
    assert (msg.HasField("seed"), msg.logprobs, msg.prompt_logprobs) == (False, -1, -1)
    assert internal_codec.params_from_proto(msg) == plain
    embed = SamplingParams(pooling="embed", max_tokens=1)
    assert internal_codec.params_from_proto(internal_codec.params_to_proto(embed)) == embed


def test_params_from_the_wire_are_checked_at_admission_not_each_time_they_are_decoded(monkeypatch):
    msg = internal_codec.params_to_proto(PARAMS)
    msg.top_p = 1.5
    checks = []
    monkeypatch.setattr(SamplingParams, "validate", lambda self: checks.append(self))
    decoded = internal_codec.params_from_proto(msg)  # the scheduler's decoding, a worker's (every resend)
    new = NewSequence(seq_id=0, prompt_token_ids=[5], output_token_ids=[], block_ids=[0], num_computed_tokens=0,
                      num_scheduled_tokens=1, params=PARAMS)
    internal_codec.delta_from_proto(internal_codec.delta_to_proto(StepDelta(step_id=1, new_seqs=[new])))
    assert checks == [] and decoded.top_p == 1.5
    monkeypatch.undo()
    with pytest.raises(InvalidArgument) as error:  # what Scheduler.add_request calls
        decoded.validate()
    assert error.value.field == "top_p"


def test_worker_info_round_trip():
    info = WorkerInfo(model="/models/x", dtype="float32", block_size=16, num_gpu_blocks=100, num_cpu_blocks=7,
                      vocab_size=512, max_model_len=2048, eos_token_ids=(2, 0), device="cpu", batch_invariant=True,
                      lora_names=("sql", "chat"), task="embed", pooling_whole=True, max_cpu_loras=4)
    assert internal_codec.info_from_proto(internal_codec.info_to_proto(info)) == info


def test_step_delta_round_trip():
    new = NewSequence(seq_id=3, prompt_token_ids=[5, 6, 7], output_token_ids=[9], block_ids=[0, 4],
                      num_computed_tokens=16, num_scheduled_tokens=2, params=PARAMS, sample_index=1,
                      num_samples=3, lora_name="sql", lora_path="/adapters/sql")
    cached = CachedSequence(seq_id=4, new_token_ids=[8], new_block_ids=[11], num_computed_tokens=20,
                            num_scheduled_tokens=1)
    delta = StepDelta(step_id=12, new_seqs=[new], cached_seqs=[cached], finished_seq_ids=[1, 2],
                      blocks_to_swap_out=[(1, 0)], blocks_to_swap_in=[(0, 3)], blocks_to_copy=[(4, 5)])
    assert internal_codec.delta_from_proto(internal_codec.delta_to_proto(delta)) == delta


def test_new_sequence_carries_its_seed_in_the_params_once():
    new = NewSequence(seq_id=0, prompt_token_ids=[5], output_token_ids=[], block_ids=[0], num_computed_tokens=0,
                      num_scheduled_tokens=1, params=PARAMS.with_seed(0))  # 0 is a seed, not "absent"
    message = internal_codec.delta_to_proto(StepDelta(step_id=1, new_seqs=[new]))
    assert message.new_seqs[0].params.HasField("seed")
    assert internal_codec.delta_from_proto(message).new_seqs[0].params.seed == 0


def test_step_result_round_trip():
    result = StepResult(5, [SeqOutput(seq_id=1, token_ids=[7, 8], logprobs=[lp(7, -AWKWARD), lp(8, -1e-30)]),
                            SeqOutput(seq_id=2, token_ids=[9], pooled=[0.5, -1.25, 2.0 ** -120])],
                        {1: [None, lp(3, -2.0)], 2: [lp(4, -0.25)]})
    assert internal_codec.result_from_proto(internal_codec.result_to_proto(result)) == result


def test_seq_updates_round_trip_through_a_submit_response():
    updates = [SeqUpdate(request_id="r", sample_index=0, token_ids=[7], logprobs=[lp(7, -AWKWARD)],
                         finish_reason=None, stop_token_id=None, prompt_logprobs=[None, lp(3, -1.5)], num_prompt_tokens=2,
                         num_cached_tokens=0, seed=42),
               SeqUpdate(request_id="r", sample_index=1, token_ids=[8], logprobs=[lp(8, -0.5)],
                         finish_reason="stop", stop_token_id=8, prompt_logprobs=None, num_prompt_tokens=2,
                         num_cached_tokens=0, seed=42),
               SeqUpdate(request_id="r", sample_index=2, token_ids=[], logprobs=None, finish_reason="length",
                         stop_token_id=None, prompt_logprobs=None, num_prompt_tokens=2, num_cached_tokens=0, seed=42)]
    response = internal_codec.updates_to_response(updates)
    assert response.deltas[1].finish_reason == "stop" and response.deltas[1].HasField("stop_token_id")
    assert internal_codec.updates_from_response("r", response) == updates
    pooled = [SeqUpdate(request_id="p", sample_index=0, token_ids=[], finish_reason="stop", num_prompt_tokens=3,
                        seed=1, pooled=[0.5, -1.25, 2.0 ** -120])]  # a pooling request's end: fp32 values exactly
    assert internal_codec.updates_from_response("p", internal_codec.updates_to_response(pooled)) == pooled


def test_submit_request_round_trip():
    msg = internal_codec.submit_to_proto("req-1", [1, 2, 3], PARAMS, priority=-4)
    assert internal_codec.submit_from_proto(msg) == ("req-1", [1, 2, 3], PARAMS, -4, (), "")
    continued = (ContinuedSample(1, (7, 8)), ContinuedSample(0, ()))
    msg = internal_codec.submit_to_proto("req-1", [1, 2, 3], PARAMS, priority=0, continued=continued, lora_name="sql")
    assert internal_codec.submit_from_proto(msg) == ("req-1", [1, 2, 3], PARAMS, 0, continued, "sql")


def test_stats_travel_typed_with_every_field_by_its_one_name():
    """GetStats carries the core's SchedulerStats field for field: a field renamed or added on
    one side only fails here instead of reaching /metrics as a silent 0."""
    import dataclasses

    from pagedserve.internal.v1 import scheduler_pb2
    from services.core.stats import SchedulerStats, WorkerStats

    assert {f.name for f in dataclasses.fields(SchedulerStats)} == set(scheduler_pb2.GetStatsResponse.DESCRIPTOR.fields_by_name)
    assert {f.name for f in dataclasses.fields(WorkerStats)} == set(scheduler_pb2.WorkerStats.DESCRIPTOR.fields_by_name)
    workers = tuple(WorkerStats(worker_id=f"w{i}", address=f"127.0.0.1:{5000 + i}", num_gpu_blocks=100 + i,
                                num_free_gpu_blocks=50 + i, num_cpu_blocks=10 + i, num_free_cpu_blocks=5 + i,
                                prefix_cache_queries=1000 + i, prefix_cache_hits=400 + i, num_running=3 + i)
                    for i in range(2))
    stats = SchedulerStats(num_waiting=1, num_running=2, num_swapped=3, num_preemptions=4, workers=workers,
                           num_steps=5, max_model_len=6, vocab_size=7, model="m", batch_invariant=True)
    assert internal_codec.stats_from_proto(internal_codec.stats_to_proto(stats)) == stats
