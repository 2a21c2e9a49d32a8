"""Core dataclasses <-> internal protobuf messages round-trip exactly (floats included)."""
from __future__ import annotations

import pytest

from services.rpc import internal_codec
from services.core.errors import InvalidArgument
from services.core.sampling_params import SamplingParams
from services.core.sequence import SeqUpdate
from services.core.step import (CachedSequence, Logprobs, NewSequence, SeqOutput, StepDelta, StepResult,
                                WorkerInfo)

AWKWARD = 0.1 + 0.2  # not representable in float32: a float32 field would change it
PARAMS = SamplingParams(n=3, temperature=AWKWARD, top_k=7, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                        presence_penalty=-0.5, frequency_penalty=0.3, logit_bias={5: -2.5, 9: 1e-7}, seed=2**63 - 1,
                        max_tokens=33, min_tokens=2, stop_token_ids=[4, 8], ignore_eos=True, logprobs=0,
                        prompt_logprobs=20)


def lp(token: int, value: float) -> Logprobs:
    return Logprobs(token, value, 2, [(token + 1, value / 3), (token, value)])


def test_sampling_params_round_trip():
    assert internal_codec.params_from_proto(internal_codec.params_to_proto(PARAMS)) == PARAMS
    plain = SamplingParams()  # no seed, no logprobs: -1 / has_seed false on the wire
    msg = internal_codec.params_to_proto(plain)
    assert (msg.has_seed, msg.logprobs, msg.prompt_logprobs) == (False, -1, -1)
    assert internal_codec.params_from_proto(msg) == plain


def test_out_of_range_params_from_the_wire_name_the_field():
    msg = internal_codec.params_to_proto(PARAMS)
    msg.top_p = 1.5
    with pytest.raises(InvalidArgument) as error:
        internal_codec.params_from_proto(msg)
    assert error.value.field == "top_p"


def test_worker_info_round_trip():
    info = WorkerInfo("/models/x", "float32", 16, 100, 7, 512, 2048, (2, 0), "cpu", True)
    assert internal_codec.info_from_proto(internal_codec.info_to_proto(info)) == info


def test_step_delta_round_trip():
    new = NewSequence(3, [5, 6, 7], [9], [0, 4], 16, 2, PARAMS, PARAMS.seed, 1, 3)
    delta = StepDelta(12, [new], [CachedSequence(4, [8], [11], 20, 1)], [1, 2], [(1, 0)], [(0, 3)], [(4, 5)])
    assert internal_codec.delta_from_proto(internal_codec.delta_to_proto(delta)) == delta


def test_new_sequence_carries_its_seed_in_the_params():
    params = PARAMS.with_seed(None)
    new = NewSequence(0, [5], [], [0], 0, 1, params, 1234)
    back = internal_codec.delta_from_proto(internal_codec.delta_to_proto(StepDelta(1, [new])))
    assert back.new_seqs[0].seed == back.new_seqs[0].params.seed == 1234


def test_step_result_round_trip():
    result = StepResult(5, [SeqOutput(1, [7, 8], [lp(7, -AWKWARD), lp(8, -1e-30)]), SeqOutput(2, [9])],
                        {1: [None, lp(3, -2.0)], 2: [lp(4, -0.25)]})
    assert internal_codec.result_from_proto(internal_codec.result_to_proto(result)) == result


def test_seq_updates_round_trip_through_a_submit_response():
    updates = [SeqUpdate("r", 0, [7], [lp(7, -AWKWARD)], None, None, [None, lp(3, -1.5)], 2, 0, 42),
               SeqUpdate("r", 1, [8], [lp(8, -0.5)], "stop", 8, None, 2, 0, 42),
               SeqUpdate("r", 2, [], None, "length", None, None, 2, 0, 42)]
    response = internal_codec.updates_to_response(updates)
    assert response.deltas[1].finish_reason == "stop" and response.deltas[1].has_stop_token_id
    assert internal_codec.updates_from_response("r", response) == updates


def test_submit_request_round_trip():
    msg = internal_codec.submit_to_proto("req-1", [1, 2, 3], PARAMS, priority=-4)
    assert internal_codec.submit_from_proto(msg) == ("req-1", [1, 2, 3], PARAMS, -4)


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
