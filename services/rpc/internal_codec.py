"""The one conversion module between the core dataclasses and the internal protobuf messages.

Generated `*_pb2` code stops at the gRPC edge (CONTRIBUTING.md, house style): the two codecs
(this one, and services/frontend/public_codec.py for the public API), the servicers, the servers
that register them, and the clients (scheduler_client, worker_client, registrar, pagedserve.client);
the tools talk to a deployment as clients do. Everything else (core, the step loop, the model
runner, the frontend's core) sees dataclasses only: tests/tools/test_protos.py checks. Floats are
protobuf doubles, so every value round-trips exactly. Optional ints travel as -1 (logprobs),
as proto3 `optional` (seed, as in the public proto) or with a has_* flag (stop token id).
"""
from __future__ import annotations

import dataclasses

from pagedserve.internal.v1 import common_pb2, scheduler_pb2, worker_pb2
from services.core.sampling_params import SamplingParams
from services.core.sequence import ContinuedSample, SeqUpdate
from services.core.stats import SchedulerStats, WorkerStats
from services.core.structured import Constraint
from services.core.step import (CachedSequence, Logprobs, NewSequence, SeqOutput, StepDelta, StepResult,
                                WorkerInfo)

# ---- sampling parameters ---------------------------------------------------------


def params_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    """The fields the scheduler and workers use; stop strings and detokenization stay at the frontend."""
    return common_pb2.SamplingParams(
        n=params.n, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, min_p=params.min_p,
        repetition_penalty=params.repetition_penalty, presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        logit_bias=[common_pb2.LogitBias(token_id=t, bias=b) for t, b in params.logit_bias],
        seed=params.seed, max_tokens=params.max_tokens,
        min_tokens=params.min_tokens, stop_token_ids=params.stop_token_ids, ignore_eos=params.ignore_eos,
        logprobs=_opt_to_proto(params.logprobs), prompt_logprobs=_opt_to_proto(params.prompt_logprobs),
        structured_outputs=_constraint_to_proto(params.structured_outputs), pooling=params.pooling)


def params_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Not checked here: submit_from_proto checks a Submit's, a worker takes the scheduler's as they are."""
    return SamplingParams.unchecked(
        n=msg.n, temperature=msg.temperature, top_k=msg.top_k, top_p=msg.top_p, min_p=msg.min_p,
        repetition_penalty=msg.repetition_penalty, presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty, logit_bias=tuple((b.token_id, b.bias) for b in msg.logit_bias),
        seed=msg.seed if msg.HasField("seed") else None, max_tokens=msg.max_tokens, min_tokens=msg.min_tokens,
        stop_token_ids=tuple(msg.stop_token_ids), ignore_eos=msg.ignore_eos,
        logprobs=_opt_from_proto(msg.logprobs), prompt_logprobs=_opt_from_proto(msg.prompt_logprobs),
        structured_outputs=Constraint(msg.structured_outputs.kind, msg.structured_outputs.spec)
        if msg.HasField("structured_outputs") else None, pooling=msg.pooling)


def _constraint_to_proto(constraint: Constraint | None) -> common_pb2.Constraint | None:
    return None if constraint is None else common_pb2.Constraint(kind=constraint.kind, spec=constraint.spec)


def _opt_to_proto(value: int | None) -> int:
    return -1 if value is None else value


def _opt_from_proto(value: int) -> int | None:
    return None if value < 0 else value

# ---- logprobs and worker info ----------------------------------------------------


def logprobs_to_proto(lp: Logprobs) -> common_pb2.Logprobs:
    return common_pb2.Logprobs(token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank,
                               top=[common_pb2.TokenLogprob(token_id=t, logprob=p) for t, p in lp.top])


def logprobs_from_proto(msg: common_pb2.Logprobs) -> Logprobs:
    return Logprobs(token_id=msg.token_id, logprob=msg.logprob, rank=msg.rank,
                    top=[(t.token_id, t.logprob) for t in msg.top])


def optional_logprobs_to_proto(entries: list[Logprobs | None]) -> list[common_pb2.OptionalLogprobs]:
    return [common_pb2.OptionalLogprobs(has_value=False) if lp is None else
            common_pb2.OptionalLogprobs(has_value=True, value=logprobs_to_proto(lp)) for lp in entries]


def optional_logprobs_from_proto(entries) -> list[Logprobs | None]:
    return [logprobs_from_proto(e.value) if e.has_value else None for e in entries]


def info_to_proto(info: WorkerInfo) -> common_pb2.WorkerInfo:
    return common_pb2.WorkerInfo(
        model=info.model, dtype=info.dtype, block_size=info.block_size, num_gpu_blocks=info.num_gpu_blocks,
        num_cpu_blocks=info.num_cpu_blocks, vocab_size=info.vocab_size, max_model_len=info.max_model_len,
        eos_token_ids=info.eos_token_ids, device=info.device, batch_invariant=info.batch_invariant,
        lora_names=info.lora_names, task=info.task, pooling_whole=info.pooling_whole,
        max_cpu_loras=info.max_cpu_loras)


def info_from_proto(msg: common_pb2.WorkerInfo) -> WorkerInfo:
    return WorkerInfo(model=msg.model, dtype=msg.dtype, block_size=msg.block_size, num_gpu_blocks=msg.num_gpu_blocks,
                      num_cpu_blocks=msg.num_cpu_blocks, vocab_size=msg.vocab_size, max_model_len=msg.max_model_len,
                      eos_token_ids=tuple(msg.eos_token_ids), device=msg.device, batch_invariant=msg.batch_invariant,
                      lora_names=tuple(msg.lora_names), task=msg.task or "generate", pooling_whole=msg.pooling_whole,
                      max_cpu_loras=msg.max_cpu_loras)

# ---- step delta and result (scheduler <-> worker) -------------------------------


def delta_to_proto(delta: StepDelta) -> worker_pb2.StepRequest:
    return worker_pb2.StepRequest(
        step_id=delta.step_id, new_seqs=[_new_seq_to_proto(s) for s in delta.new_seqs],
        cached_seqs=[worker_pb2.CachedSequence(
            seq_id=s.seq_id, new_token_ids=s.new_token_ids, new_block_ids=s.new_block_ids,
            num_computed_tokens=s.num_computed_tokens, num_scheduled_tokens=s.num_scheduled_tokens,
            draft_token_ids=s.draft_token_ids, num_kept_blocks=s.num_kept_blocks)
            for s in delta.cached_seqs],
        finished_seq_ids=delta.finished_seq_ids, blocks_to_swap_out=_pairs_to_proto(delta.blocks_to_swap_out),
        blocks_to_swap_in=_pairs_to_proto(delta.blocks_to_swap_in), blocks_to_copy=_pairs_to_proto(delta.blocks_to_copy),
        async_next_step=delta.async_next_step)


def delta_from_proto(msg: worker_pb2.StepRequest) -> StepDelta:
    return StepDelta(
        step_id=msg.step_id, new_seqs=[_new_seq_from_proto(s) for s in msg.new_seqs],
        cached_seqs=[CachedSequence(seq_id=s.seq_id, new_token_ids=list(s.new_token_ids),
                                    new_block_ids=list(s.new_block_ids), num_computed_tokens=s.num_computed_tokens,
                                    num_scheduled_tokens=s.num_scheduled_tokens,
                                    draft_token_ids=list(s.draft_token_ids),
                                    num_kept_blocks=s.num_kept_blocks if s.HasField("num_kept_blocks") else None)
                    for s in msg.cached_seqs],
        finished_seq_ids=list(msg.finished_seq_ids), blocks_to_swap_out=_pairs_from_proto(msg.blocks_to_swap_out),
        blocks_to_swap_in=_pairs_from_proto(msg.blocks_to_swap_in), blocks_to_copy=_pairs_from_proto(msg.blocks_to_copy),
        async_next_step=msg.async_next_step)


def delta_to_bytes(delta: StepDelta) -> bytes:
    """A step delta as the StepRequest bytes a worker group's rank 0 broadcasts (services/worker/group.py)."""
    return delta_to_proto(delta).SerializeToString()


def delta_from_bytes(data: bytes) -> StepDelta:
    message = worker_pb2.StepRequest()
    message.ParseFromString(data)
    return delta_from_proto(message)


def _new_seq_to_proto(seq: NewSequence) -> worker_pb2.NewSequence:
    return worker_pb2.NewSequence(
        seq_id=seq.seq_id, prompt_token_ids=seq.prompt_token_ids, output_token_ids=seq.output_token_ids,
        block_ids=seq.block_ids, num_computed_tokens=seq.num_computed_tokens,
        num_scheduled_tokens=seq.num_scheduled_tokens, params=params_to_proto(seq.params), sample_index=seq.sample_index,
        num_samples=seq.num_samples, lora_name=seq.lora_name, lora_path=seq.lora_path)


def _new_seq_from_proto(msg: worker_pb2.NewSequence) -> NewSequence:
    params = params_from_proto(msg.params)
    return NewSequence(seq_id=msg.seq_id, prompt_token_ids=list(msg.prompt_token_ids),
                       output_token_ids=list(msg.output_token_ids), block_ids=list(msg.block_ids),
                       num_computed_tokens=msg.num_computed_tokens, num_scheduled_tokens=msg.num_scheduled_tokens,
                       params=params, sample_index=msg.sample_index, num_samples=msg.num_samples,
                       lora_name=msg.lora_name, lora_path=msg.lora_path)


def _pairs_to_proto(pairs: list[tuple[int, int]]) -> list[worker_pb2.BlockPair]:
    return [worker_pb2.BlockPair(src=a, dst=b) for a, b in pairs]


def _pairs_from_proto(pairs) -> list[tuple[int, int]]:
    return [(p.src, p.dst) for p in pairs]


def result_to_proto(result: StepResult) -> worker_pb2.StepResponse:
    return worker_pb2.StepResponse(
        step_id=result.step_id,
        outputs=[worker_pb2.SeqOutput(seq_id=o.seq_id, token_ids=o.token_ids,
                                      logprobs=[logprobs_to_proto(lp) for lp in o.logprobs or ()], pooled=o.pooled)
                 for o in result.outputs],
        prompt_logprobs=[worker_pb2.PromptLogprobsChunk(seq_id=seq_id, entries=optional_logprobs_to_proto(entries))
                         for seq_id, entries in result.prompt_logprobs.items()])


def result_from_proto(msg: worker_pb2.StepResponse) -> StepResult:
    return StepResult(
        msg.step_id,
        [SeqOutput(seq_id=o.seq_id, token_ids=list(o.token_ids),
                   logprobs=[logprobs_from_proto(lp) for lp in o.logprobs] or None, pooled=list(o.pooled) or None) for o in msg.outputs],
        {c.seq_id: optional_logprobs_from_proto(c.entries) for c in msg.prompt_logprobs})

# ---- scheduler -> frontend stream -------------------------------------------------


def updates_to_response(updates: list[SeqUpdate]) -> scheduler_pb2.SubmitResponse:
    """One step's updates for one request (all with the same request_id) as one stream message."""
    first = updates[0]
    prompt_logprobs = next((u.prompt_logprobs for u in updates if u.prompt_logprobs is not None), [])
    return scheduler_pb2.SubmitResponse(
        deltas=[scheduler_pb2.SampleDelta(
            sample_index=u.sample_index, token_ids=u.token_ids,
            logprobs=[logprobs_to_proto(lp) for lp in u.logprobs or ()], finish_reason=u.finish_reason or "",
            stop_token_id=u.stop_token_id, pooled=u.pooled) for u in updates],
        seed=first.seed, num_prompt_tokens=first.num_prompt_tokens, num_cached_tokens=first.num_cached_tokens,
        prompt_logprobs=optional_logprobs_to_proto(prompt_logprobs))


def updates_from_response(request_id: str, msg: scheduler_pb2.SubmitResponse) -> list[SeqUpdate]:
    """The inverse, for clients of the scheduler (the frontend folds these like LLM.generate does)."""
    prompt_logprobs = optional_logprobs_from_proto(msg.prompt_logprobs) if msg.prompt_logprobs else None
    return [SeqUpdate(request_id=request_id, sample_index=d.sample_index, token_ids=list(d.token_ids),
                      logprobs=[logprobs_from_proto(lp) for lp in d.logprobs] or None,
                      finish_reason=d.finish_reason or None,
                      stop_token_id=d.stop_token_id if d.HasField("stop_token_id") else None,
                      prompt_logprobs=prompt_logprobs if d.sample_index == 0 else None,
                      num_prompt_tokens=msg.num_prompt_tokens, num_cached_tokens=msg.num_cached_tokens, seed=msg.seed,
                      pooled=list(d.pooled) or None)
            for d in msg.deltas]


def submit_to_proto(request_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0,
                    continued: tuple[ContinuedSample, ...] = (), lora_name: str = "") -> scheduler_pb2.SubmitRequest:
    return scheduler_pb2.SubmitRequest(
        request_id=request_id, prompt_token_ids=prompt_token_ids, params=params_to_proto(params), priority=priority,
        lora_name=lora_name,
        continued_samples=[scheduler_pb2.ContinuedSample(sample_index=c.sample_index, token_ids=c.token_ids)
                           for c in continued])


def submit_from_proto(msg: scheduler_pb2.SubmitRequest
                      ) -> tuple[str, list[int], SamplingParams, int, tuple[ContinuedSample, ...], str]:
    """The scheduler service's input: its params are checked here, once, as SamplingParams(...) checks a
    caller's (a worker's copy, params_from_proto alone, is the scheduler's as they are)."""
    continued = tuple(ContinuedSample(c.sample_index, tuple(c.token_ids)) for c in msg.continued_samples)
    params = params_from_proto(msg.params)
    params.validate()
    return msg.request_id, list(msg.prompt_token_ids), params, msg.priority, continued, msg.lora_name


# ---- stats (GetStats) ----------------------------------------------------------
# The dataclasses' fields are the messages' fields, name for name.

def stats_to_proto(stats: SchedulerStats) -> scheduler_pb2.GetStatsResponse:
    fields = {f: getattr(stats, f) for f in _SCALAR_FIELDS}
    return scheduler_pb2.GetStatsResponse(workers=[scheduler_pb2.WorkerStats(**vars(w)) for w in stats.workers],
                                          **fields)


def stats_from_proto(msg: scheduler_pb2.GetStatsResponse) -> SchedulerStats:
    workers = tuple(WorkerStats(**{f: getattr(w, f) for f in _WORKER_FIELDS}) for w in msg.workers)
    return SchedulerStats(workers=workers, **{f: _plain(getattr(msg, f)) for f in _SCALAR_FIELDS})


def _plain(value):
    """A repeated field as a tuple (the dataclass is frozen and compared by value)."""
    return value if isinstance(value, (int, float, str, bool)) else tuple(value)


_SCALAR_FIELDS = tuple(f.name for f in dataclasses.fields(SchedulerStats) if f.name != "workers")
_WORKER_FIELDS = tuple(f.name for f in dataclasses.fields(WorkerStats))
