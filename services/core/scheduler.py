"""The scheduler's shared part: admission, seeds, the waiting queue, placement, continuations.

Each worker's own scheduling (its running and swapped sequences, its block manager, its step's
delta, applying its result) is a WorkerScheduler (services/core/worker_scheduler.py). A new or
recomputed sequence is placed when it starts waiting (`enqueue`): on the worker that holds the
longest run of its prompt's blocks in its prefix cache, ties broken by load; a worker whose step is
stalled, or that has no room, is chosen last (services/core/placement.py). A worker takes what was placed on it when it schedules its
next step (`schedule_worker`), in policy order, and also what waits for a worker that is stalled,
gone or full. Workers step independently: `schedule_worker` / `update` per worker, in any
interleaving; `schedule` schedules every worker one after another (the in-process engine). Pure
Python.
"""
from __future__ import annotations

from collections import Counter
import itertools
import random
import time
from collections.abc import Callable

from services.core.admission import check_prompt, check_token_ids
from services.core.config import SchedulerConfig
from services.core.errors import ResourceExhausted, check
from services.core.kv_events import AllBlocksCleared, KVCacheEvent, KVEventLog
from services.core.placement import best_worker, has_room
from services.core.policy import WaitingQueue, policy_key
from services.core.sampling_params import SamplingParams
from services.core.seeding import new_request_seed
from services.core.sequence import ContinuedSample, Request, Sequence, SeqStatus, SeqUpdate
from services.core.spec_decode import Speculator
from services.core.stats import SchedulerStats, WorkerStats
from services.core.step import StepDelta, StepResult, WorkerInfo
from services.core.stop import finish_reason  # the one stop rule, which each WorkerScheduler applies
from services.core.widths import INT32_MAX, INT32_MIN, check_int
from services.core.worker_scheduler import StepPlan, WorkerScheduler

__all__ = ["Scheduler", "StepPlan", "WorkerScheduler", "finish_reason"]


class Scheduler:
    """Admission and placement over one WorkerScheduler per worker; each worker's step is
    `schedule_worker` then `update` with its result. Subclasses change a step through named hooks:
    `plan_next_step` (services/core/async_scheduling.py's AsyncScheduler overrides it)."""

    def __new__(cls, config: SchedulerConfig | None = None, *args, **kwargs):
        if cls is Scheduler and config is not None and config.async_scheduling:  # as vLLM picks its AsyncScheduler: by the setting
            from services.core.async_scheduling import AsyncScheduler

            cls = AsyncScheduler
        return super().__new__(cls)

    def __init__(self, config: SchedulerConfig):
        check(config.max_model_len is not None, "max_model_len", "settle it first (SchedulerConfig.for_model)")
        self.config = config
        self.workers: dict[str, WorkerScheduler] = {}
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue(config.scheduling_policy)
        self.seqs: dict[int, Sequence] = {}
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self.step_id = 0  # of the last step scheduled on any worker
        self.num_preemptions = 0
        # seeds for requests that bring none: reproducible from the engine seed, like vLLM's
        self._seeds = random.Random(config.seed) if config.seed is not None else None
        # speculative decoding: drafts verified exactly (services/core/spec_decode.py)
        self.speculator = Speculator(config.speculative_config) if config.speculative_config else None
        # KV-cache events (services/core/kv_events.py): each worker's log, kept across its reset, and its
        # rank (data_parallel_rank on the wire): the order it first registered, kept for its id
        events = config.kv_events_config
        self.kv_events: dict[str, KVEventLog] | None = {} if events and events.enable_kv_cache_events else None
        self.worker_ranks: dict[str, int] = {}
        # LoRA adapters served: name -> the folder its workers load it from on demand ("": each worker's own
        # --lora-modules), and its id on KV-cache events; kept while workers come and go
        self.loras: dict[str, str] = {}
        self.lora_ids: dict[str, int] = {}

    @property
    def running(self) -> dict[int, Sequence]:
        return {seq_id: seq for ws in self.workers.values() for seq_id, seq in ws.running.items()}

    @property
    def swapped(self) -> dict[int, Sequence]:
        return {seq_id: seq for ws in self.workers.values() for seq_id, seq in ws.swapped.items()}

    @property
    def num_running(self) -> int:
        return sum(len(ws.running) for ws in self.workers.values())

    @property
    def _inflight(self) -> dict[str, StepPlan]:
        """Each worker's step that is out (scheduled, its result not applied yet)."""
        return {w: ws.inflight for w, ws in self.workers.items() if ws.inflight is not None}

    # ---- workers ---------------------------------------------------------------
    def add_worker(self, worker_id: str, info: WorkerInfo) -> None:
        """Take a worker, or refuse it (InvalidArgument) when it does not fit the others."""
        check(info.block_size == self.config.block_size, "block_size",
              f"worker {worker_id} has block size {info.block_size}, the scheduler {self.config.block_size}")
        for ws in self.workers.values():  # the first worker's, as every worker is like the others
            check(info.vocab_size == ws.info.vocab_size, "vocab_size",
                  f"worker {worker_id} has vocab size {info.vocab_size}, the others {ws.info.vocab_size}")
            break
        check(info.max_model_len >= self.config.max_model_len, "max_model_len",
              f"worker {worker_id} supports {info.max_model_len} tokens, the scheduler serves "
              f"{self.config.max_model_len}")
        self.workers[worker_id] = WorkerScheduler(worker_id, info, self.config, self)
        self.worker_ranks.setdefault(worker_id, len(self.worker_ranks))
        for name in info.lora_names:  # its --lora-modules, served from now on unless unloaded
            if name not in self.loras:
                self.register_lora(name, "")

    def remove_worker(self, worker_id: str) -> int:
        """Drop a dead worker; its sequences go back to waiting and are recomputed elsewhere, and
        what waited for it is placed again. Their streamed tokens stay: recompute continues after
        them. Returns how many moved."""
        ws = self.workers.pop(worker_id, None)
        if ws is None:
            return 0
        for seq_id in self.waiting:
            if self.seqs[seq_id].placed == worker_id:
                self._place(self.seqs[seq_id])  # None while no worker is left: placed when one joins
        moved = ws.evict()
        for seq in moved:
            self.enqueue(seq)
        if self.kv_events is not None:
            self.kv_events[worker_id].append(AllBlocksCleared())
        return len(moved)

    def reset_worker(self, worker_id: str) -> int:
        """The worker answered that it does not hold a sequence it was sent (it lost its state, as a
        worker restarted at the same address before the scheduler noticed): re-send in full. Its
        sequences go back to waiting and are recomputed, their streamed tokens kept (on it or on
        another worker); its block pool starts empty, since none of its cached blocks can be trusted;
        and its next step first tells it to forget every sequence it may still mirror. Returns how
        many sequences are re-sent."""
        ws = self.workers[worker_id]
        held = list(ws.running) + list(ws.swapped)
        moved = self.remove_worker(worker_id)
        self.add_worker(worker_id, ws.info)
        self.workers[worker_id].pending_forget = held
        return moved

    def drain_kv_events(self) -> list[tuple[int, list[KVCacheEvent]]]:
        """(worker rank, its events in order) for each worker with events since the last drain;
        a worker gone for good is forgotten once its last events (AllBlocksCleared) are out."""
        drained = [(self.worker_ranks[worker_id], log.drain()) for worker_id, log in self.kv_events.items() if log]
        for worker_id in [w for w in self.kv_events if w not in self.workers]:
            del self.kv_events[worker_id]
        return drained

    # ---- requests --------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0, continued: tuple[ContinuedSample, ...] = (), lora_name: str = "") -> Request:
        """Admit a request; `continued` non-empty: a continuation (ContinuedSample), which runs
        just the samples it names, each from its own tokens; lora_name: the LoRA adapter it runs under
        (loaded on the workers by whoever admits it), "" for the base model."""
        # params were checked when built (SamplingParams(...), or the scheduler service's decoding of a Submit)
        check_int("priority", priority, INT32_MIN, INT32_MAX)  # the LLM's callers reach here unchecked
        check(request_id not in self.requests, "request_id", f"{request_id!r} is already running")
        vocab_size = next(iter(self.workers.values())).info.vocab_size if self.workers else None  # equal on each
        check_prompt(prompt_token_ids, self.config.max_model_len, vocab_size, "prompt_token_ids",
                     generates=not params.pooling)  # a pooling request generates nothing: it may take the whole length
        self._check_against_workers(prompt_token_ids, params)
        if lora_name and self.workers:
            check(lora_name in self.loras, "model", f"LoRA adapter {lora_name!r} is not loaded")
            check(any(ws.serves_loras for ws in self.workers.values()), "model",
                  f"LoRA adapter {lora_name!r}: no worker runs with --enable-lora")
        # A burst arrives before any step runs: the requests that free seats will take are not waiting
        free_seats = max(0, len(self.workers) * self.config.max_num_seqs - self.num_running)
        if len(self.waiting) >= self.config.max_waiting_requests + free_seats:
            raise ResourceExhausted(f"{len(self.waiting)} requests are waiting and no seat is free; try again later")
        check(params.seed is not None or not continued, "seed", "a continuation must carry the request's seed")
        if params.seed is None:
            params = params.with_seed(self._seeds.getrandbits(63) if self._seeds else new_request_seed())
        request = Request(request_id=request_id, prompt_token_ids=list(prompt_token_ids), params=params,
                          arrival=next(self._arrivals), priority=priority, lora_name=lora_name,
                          lora_id=self.lora_ids.get(lora_name))
        if continued:
            self._continue(request, continued)
        else:
            self.enqueue(self.new_seq(request, 0))
        self.requests[request_id] = request
        return request

    def register_lora(self, name: str, path: str, lora_id: int | None = None) -> int:
        """Serve adapter `name` from now on: a worker that does not hold it loads it from `path` when a request
        under it is placed there ("": its own --lora-modules). Its id on KV-cache events: lora_id (vLLM's
        lora_int_id) unless another adapter has it, else the smallest free one from 1; a name keeps its id."""
        taken = {i for n, i in self.lora_ids.items() if n != name}
        lora_id = self.lora_ids.get(name, lora_id)
        if lora_id is None or lora_id in taken:
            lora_id = next(i for i in itertools.count(1) if i not in taken)
        self.loras[name], self.lora_ids[name] = path, lora_id
        return lora_id

    def set_worker_loras(self, worker_id: str, lora_names) -> None:
        """The LoRA adapters a worker now holds, least recently used first (after it loaded or dropped one)."""
        self.workers[worker_id].lora_names = dict.fromkeys(lora_names)

    def retire_lora(self, name: str) -> list[str]:
        """Before an adapter is unloaded: refused (naming lora_name) while requests under it run or wait;
        else it is served no more, so no new request is admitted under it. Returns the workers to unload it
        from (every one: a worker may have loaded it on demand)."""
        check(name in self.loras, "lora_name", f"adapter {name!r} is not loaded")
        num_requests = sum(1 for request in self.requests.values() if request.lora_name == name)
        check(num_requests == 0, "lora_name", f"adapter {name!r} has {num_requests} requests running or waiting; "
                                              f"unload it once they finish")
        del self.loras[name], self.lora_ids[name]
        for ws in self.workers.values():
            ws.lora_names.pop(name, None)
        return list(self.workers)

    def _continue(self, request: Request, continued: tuple[ContinuedSample, ...]) -> None:
        """A continuation's samples, each waiting to be recomputed from prompt + its own tokens
        (as after a preemption); none is forked: each sample index is named at most once."""
        params, num_prompt = request.params, len(request.prompt_token_ids)
        indices = [sample.sample_index for sample in continued]
        check(len(set(indices)) == len(indices) and all(0 <= i < params.n for i in indices), "continued_samples",
              f"sample indices must be distinct and in [0, n={params.n}), got {indices}")
        for sample in continued:
            check(len(sample.token_ids) < params.max_tokens and num_prompt + len(sample.token_ids) <
                  self.config.max_model_len, "continued_samples",
                  f"sample {sample.sample_index} has {len(sample.token_ids)} tokens: no room left under "
                  f"max_tokens {params.max_tokens} or max_model_len {self.config.max_model_len}")
            if self.workers:
                check_token_ids("continued_samples", sample.token_ids,
                                next(iter(self.workers.values())).info.vocab_size)
        request.forked = True
        for sample in continued:
            seq = self.new_seq(request, sample.sample_index)
            seq.output_token_ids = list(sample.token_ids)
            self.enqueue(seq)

    def _check_against_workers(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Token ids the params name are the model's, and a request some worker's KV cache can hold (one
        that none can hold would wait forever)."""
        if not self.workers:
            return  # nothing registered yet: the transport answers UNAVAILABLE
        params.check_vocab(next(iter(self.workers.values())).info.vocab_size)  # equal on every worker
        if self._check_pooling(prompt_token_ids, params):
            return
        num_prompt, max_tokens = len(prompt_token_ids), params.max_tokens
        capacity = max(slot.info.num_gpu_blocks for slot in self.workers.values()) * self.config.block_size
        check(num_prompt < capacity, "prompt",
              f"{num_prompt} tokens do not fit in the largest worker's KV cache ({capacity} tokens)")
        total = min(num_prompt + max_tokens, self.config.max_model_len)
        check(total <= capacity, "max_tokens",
              f"prompt ({num_prompt}) + max_tokens ({max_tokens}) need {total} tokens of KV cache; "
              f"the largest worker holds {capacity}")

    def _check_pooling(self, prompt_token_ids: list[int], params: SamplingParams) -> bool:
        """The model's task decides what a request may ask: a pooler serves only pooling requests
        and a generator only generation. A whole-prompt pooler (an encoder) must fit its prompt in one
        step and in a worker's cache. True: a pooling request, checked."""
        info = next(iter(self.workers.values())).info  # every worker serves the one model
        if not params.pooling:
            check(info.task == "generate", "task", f"this model is served for {info.task}, not to generate "
                                                   f"(use the {info.task} API)")
            return False
        check(info.task == params.pooling, "task", f"this model is served for {info.task}, not to "
                                                   f"{params.pooling} (start its workers with --task {params.pooling})")
        num_prompt = len(prompt_token_ids)
        capacity = max(slot.info.num_gpu_blocks for slot in self.workers.values()) * self.config.block_size
        check(num_prompt <= capacity, "input", f"{num_prompt} tokens do not fit in the largest worker's KV "
                                               f"cache ({capacity} tokens)")
        check(not info.pooling_whole or num_prompt <= self.config.max_num_batched_tokens, "input",
              f"{num_prompt} tokens: this model pools a whole input in one step, at most "
              f"max_num_batched_tokens ({self.config.max_num_batched_tokens})")
        return True

    def abort(self, request_id: str) -> list[SeqUpdate]:
        request = self.requests.get(request_id)
        if request is None:
            return []
        updates = []
        for seq in request.seqs:
            if not seq.is_finished:
                self.finish(seq, "abort")
                updates.append(self.update_of(seq, [], None))
        self.requests.pop(request_id, None)
        return updates

    def stop_sample(self, request_id: str, sample_index: int) -> None:
        """End one sample early because the frontend matched a stop string."""
        request = self.requests.get(request_id)
        if request is None:
            return
        for seq in request.seqs:
            if seq.sample_index == sample_index and not seq.is_finished:
                self.finish(seq, "stop")

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- scheduling ------------------------------------------------------------
    def schedule(self) -> dict[str, StepDelta]:
        """Every worker's next step, one worker after another (the in-process engine steps so)."""
        deltas = {}
        for worker_id in list(self.workers):
            delta = self.schedule_worker(worker_id)
            if delta is not None:
                deltas[worker_id] = delta
        return deltas

    def schedule_worker(self, worker_id: str) -> StepDelta | None:
        """One worker's next step (None: it has nothing to do); `update` applies its result. Any
        other worker may be mid-step meanwhile."""
        self.step_id += 1
        return self.workers[worker_id].schedule(self.step_id)

    def update(self, worker_id: str, result: StepResult) -> list[SeqUpdate]:
        """Apply a worker's step result; returns what changed for each sample."""
        return self.workers[worker_id].update(result)

    def plan_next_step(self, plan: StepPlan) -> bool:
        """Hook: whether the worker may run this step's continuation before its next delta arrives
        (StepDelta.async_next_step). Called before the delta is filled. Here never: each step
        runs to its end before the next is planned."""
        return False

    def admit_waiting(self, ws: WorkerScheduler, plan: StepPlan, below: tuple | None = None,
                      make_room: Callable[[Sequence], bool] | None = None) -> None:
        """Start on ws, in policy order, what waits for it, and what waits for a worker that is
        stalled or has no room for it; stop at the first that does not fit now. `below`: only
        sequences whose policy key is smaller; `make_room(seq)`: asked when seq does not fit, it
        preempts something for it and answers True, or answers False (the priority policy's,
        WorkerScheduler._admit_outranking)."""
        if not self.waiting or (not ws.has_seat() and make_room is None):
            return
        now = time.monotonic()
        for seq_id in self.waiting:
            seq = self.seqs[seq_id]
            if below is not None and policy_key(self.config.scheduling_policy, seq) >= below:
                return
            if not ws.serves(seq.request) or not ws.has_lora_slot(seq.request.lora_name):
                continue  # another adapter's slot may free up; those behind it need not wait for it
            owner = self.workers.get(seq.placed) or self._place(seq)
            if owner is not ws and not (owner is None or owner.is_stalled(now) or not has_room(owner, seq)):
                continue
            while not ws.admit(seq, plan):
                if make_room is None or not make_room(seq):
                    break
            else:
                self._dequeue(seq)
                continue
            if owner is ws:
                return  # its own next one waits for room here: none placed behind it passes it

    def waits_for(self, ws: WorkerScheduler) -> bool:
        """Whether a sequence placed on ws waits."""
        return ws.num_waiting > 0

    # ---- placement -------------------------------------------------------------
    def _place(self, seq: Sequence) -> WorkerScheduler | None:
        """Place a waiting sequence (services/core/placement.py says how); None while no worker serves it."""
        candidates = [ws for ws in self.workers.values() if ws.serves(seq.request)]
        if not candidates:
            return None
        ws = best_worker(candidates, seq, self.config, time.monotonic())
        seq.placed = ws.worker_id
        ws.num_waiting += 1
        return ws

    # ---- sequences -------------------------------------------------------------
    def new_seq(self, request: Request, sample_index: int) -> Sequence:
        seq = Sequence(seq_id=next(self._seq_ids), request=request, sample_index=sample_index)
        request.seqs.append(seq)
        self.seqs[seq.seq_id] = seq
        return seq

    def enqueue(self, seq: Sequence) -> None:
        """seq waits (new, preempted, or moved off a worker), placed on a worker."""
        seq.status = SeqStatus.WAITING
        self._place(seq)
        self.waiting.push(seq)

    def _dequeue(self, seq: Sequence) -> None:
        self.waiting.remove(seq.seq_id)
        owner = self.workers.get(seq.placed)
        if owner is not None:
            owner.num_waiting -= 1
        seq.placed = None

    def finish(self, seq: Sequence, reason: str) -> None:
        if self.speculator is not None:
            self.speculator.forget(seq.seq_id, seq.output_token_ids if reason != "abort" else None)
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
        self._dequeue(seq)
        ws = self.workers.get(seq.worker_id)
        if ws is not None:
            ws.release(seq)
        seq.forget_on_worker()
        request = seq.request
        if all(s.is_finished for s in request.seqs) and (request.forked or request.params.n == 1):
            self.requests.pop(request.request_id, None)
            for s in request.seqs:
                self.seqs.pop(s.seq_id, None)

    def pooled_update(self, seq: Sequence, pooled: list[float]) -> SeqUpdate:
        """A pooling request's end: its pooled output, and the prompt's figures for usage."""
        self.finish(seq, "stop")
        request = seq.request
        return SeqUpdate(request_id=request.request_id, sample_index=0, token_ids=[], finish_reason="stop",
                         num_prompt_tokens=len(request.prompt_token_ids), num_cached_tokens=request.num_cached_tokens,
                         seed=request.seed, pooled=pooled)

    def update_of(self, seq: Sequence, tokens: list[int], logprobs) -> SeqUpdate:
        request = seq.request
        done_prompt = seq.sample_index == 0 and len(seq.output_token_ids) == 1 and tokens
        prompt_logprobs = request.prompt_logprobs if done_prompt and request.params.prompt_logprobs is not None else None
        return SeqUpdate(request_id=request.request_id, sample_index=seq.sample_index, token_ids=tokens,
                         logprobs=logprobs, finish_reason=seq.finish_reason, stop_token_id=seq.stop_reason,
                         prompt_logprobs=prompt_logprobs, num_prompt_tokens=len(request.prompt_token_ids),
                         num_cached_tokens=request.num_cached_tokens, seed=request.seed)

    # ---- stats -----------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        workers = tuple(WorkerStats(worker_id=w, num_running=len(ws.running), num_waiting=ws.num_waiting,
                                    num_swapped=len(ws.swapped), num_steps=ws.num_steps, step_time_s=ws.step_time_s,
                                    **vars(ws.blocks.stats))
                        for w, ws in sorted(self.workers.items()))
        spec = self.speculator.stats if self.speculator is not None else None
        return SchedulerStats(num_waiting=len(self.waiting), num_running=self.num_running,
                              num_swapped=sum(len(ws.swapped) for ws in self.workers.values()),
                              num_preemptions=self.num_preemptions, workers=workers,
                              max_model_len=self.config.max_model_len, **self._lora_stats(),
                              **(spec.as_stats() if spec is not None else {}))

    def _lora_stats(self) -> dict:
        """Per LoRA adapter: its sequences running and waiting (SchedulerStats.lora_*)."""
        running, waiting = Counter(), Counter()
        for ws in self.workers.values():
            running.update(seq.request.lora_name for seq in ws.running.values() if seq.request.lora_name)
        waiting.update(self.seqs[i].request.lora_name for i in self.waiting if self.seqs[i].request.lora_name)
        names = tuple(sorted(running.keys() | waiting.keys()))
        return dict(lora_names=names, lora_num_running=tuple(running[n] for n in names),
                    lora_num_waiting=tuple(waiting[n] for n in names))
