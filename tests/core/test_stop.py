"""The one stop rule (services.core.stop): the finish reasons it gives, and that the scheduler,
which ends sequences, and the worker, which predicts their end for its early step, agree."""
from __future__ import annotations

import pytest

from services.core import stop
from services.core.config import SchedulerConfig
from services.core.sampling_params import SamplingParams
from services.core.scheduler import Scheduler
from services.core.step import SeqOutput, StepResult, WorkerInfo
from services.core.stop import Finish, finish_reason

EOS = (2,)
P = SamplingParams  # every case: temperature 0

# (params, token, output tokens so far counting it, prompt + output, max_model_len) -> finish
CASES = [
    (P(max_tokens=8), 5, 1, 4, 64, None),
    (P(max_tokens=8), 2, 1, 4, 64, Finish("stop")),  # EOS
    (P(max_tokens=8, ignore_eos=True), 2, 1, 4, 64, None),
    (P(max_tokens=8, min_tokens=3), 2, 2, 5, 64, None),  # EOS before min_tokens
    (P(max_tokens=8, min_tokens=3), 2, 3, 6, 64, Finish("stop")),
    (P(max_tokens=8, stop_token_ids=[7]), 7, 1, 4, 64, Finish("stop", 7)),
    (P(max_tokens=8, stop_token_ids=[7], min_tokens=5), 7, 1, 4, 64, Finish("stop", 7)),  # the sampler masks it
    (P(max_tokens=8, stop_token_ids=[7], ignore_eos=True), 7, 1, 4, 64, Finish("stop", 7)),
    (P(max_tokens=3), 5, 3, 6, 64, Finish("length")),
    (P(max_tokens=3), 2, 3, 6, 64, Finish("stop")),  # EOS wins over length on the last token
    (P(max_tokens=3, stop_token_ids=[2]), 2, 3, 6, 64, Finish("stop", 2)),
    (P(max_tokens=8), 5, 2, 64, 64, Finish("length")),  # max_model_len
    (P(max_tokens=8), 5, 2, 64, None, None),  # the worker's view: no max_model_len
]


@pytest.mark.parametrize("params, token, num_out, num_tokens, max_len, expected", CASES)
def test_the_stop_rule(params, token, num_out, num_tokens, max_len, expected):
    assert finish_reason(params, token, num_out, EOS, num_tokens, max_len) == expected


@pytest.mark.parametrize("params, token, num_out, num_tokens, max_len, expected",
                         [c for c in CASES if c[4] is not None])
def test_the_scheduler_ends_sequences_by_the_stop_rule(params, token, num_out, num_tokens, max_len, expected):
    """A request whose prompt is num_tokens - num_out tokens, driven to its num_out-th token."""
    sched = Scheduler(SchedulerConfig(max_model_len=max_len, block_size=16))
    sched.add_worker("w", WorkerInfo(model="m", dtype="float32", block_size=16, num_gpu_blocks=64, num_cpu_blocks=0,
                                     vocab_size=100, max_model_len=max_len, eos_token_ids=EOS, device="cpu",
                                     batch_invariant=True))
    sched.add_request("r", [9] * (num_tokens - num_out), params)
    updates = []
    for i in range(num_out):
        delta = sched.schedule()["w"]
        seq_id = (delta.new_seqs or delta.cached_seqs)[0].seq_id
        updates += sched.update("w", StepResult(delta.step_id, [SeqOutput(seq_id=seq_id, token_ids=[token if i == num_out - 1 else 5])]))
    last = updates[-1]
    assert (last.finish_reason, last.stop_token_id) == ((expected.reason, expected.stop_token_id) if expected else
                                                      (None, None))
    assert all(u.finish_reason is None for u in updates[:-1])


def test_the_scheduler_and_the_worker_use_the_one_rule():
    from services.core import scheduler
    from services.worker import async_scheduling
    assert scheduler.finish_reason is stop.finish_reason
    assert async_scheduling.finish_reason is stop.finish_reason
