"""The local variants, run on the in-process engine (`LLM`): a fresh engine per variant, so
nothing but the variant's one change differs from the baseline."""
from __future__ import annotations

import gc
import random
from dataclasses import dataclass, field, replace

import torch

from services.core.errors import InvalidArgument
from services.core.sampling_params import SamplingParams
from pagedserve import LLM
from services.tools.diverge.cases import NEIGHBOUR_MAX_PROMPT, Case, neighbours
from services.tools.diverge.compare import Sample
from services.tools.diverge.variants import BATCH, BATCH_SIZES, PREFIX, Variant


@dataclass(kw_only=True)
class Run:
    """What one variant gave every prompt, and whether its condition really happened."""

    samples: dict[str, list[Sample]] = field(default_factory=dict)  # case id -> one per sample
    note: str = ""  # e.g. "12 preemptions"
    exercised: bool = True  # False: e.g. no preemption happened, so the variant proved nothing
    reference: dict[str, list[Sample]] | None = None  # its own reference, when not the baseline


def samples_of(output) -> list[Sample]:
    return [Sample.from_logprobs(o.token_ids, o.logprobs, output.seed, o.text) for o in output.outputs]


class EngineRuns:
    def __init__(self, model: str, base_args: dict, vocab_size: int, cases: list[Case], seed: int = 0):
        self.model, self.base_args, self.vocab_size, self.seed = model, dict(base_args), vocab_size, seed
        self.num_threads = torch.get_num_threads()  # a worker sets the process's count; put it back after each
        # KV cache for the biggest batch without preemption, instead of the default budget: an engine
        # per variant allocates and zeroes it
        max_tokens = max(c.params.max_tokens for c in cases)
        longest = max(max(len(c.prompt_token_ids) for c in cases), NEIGHBOUR_MAX_PROMPT) + 2 * max_tokens
        self.kv_tokens = BATCH_SIZES[-1] * (longest + 32)

    def llm(self, **overrides) -> LLM:
        args = {**self.base_args, **overrides}
        if args.get("num_gpu_blocks") is None and args.get("kv_cache_memory_bytes") is None:
            args["num_gpu_blocks"] = self.kv_tokens // args.get("block_size", 16)
        return LLM(self.model, **args)

    def baseline(self, cases: list[Case]) -> Run:
        return self.run(Variant(name="baseline", group="baseline", changes="batch 1"), cases)

    def run(self, variant: Variant, cases: list[Case]) -> Run:
        try:
            run = {BATCH: self._batch, PREFIX: self._prefix}.get(variant.layout, self._alone)(variant, cases)
            if variant.own_reference:
                run.reference = self._alone(replace(variant, layout="alone"), cases).samples
            return run
        finally:
            gc.collect()  # the engine's KV cache goes before the next one is allocated
            torch.set_num_threads(self.num_threads)

    def _alone(self, variant: Variant, cases: list[Case]) -> Run:
        try:
            llm = self.llm(**variant.engine_args)
        except InvalidArgument as error:
            if variant.group != "parallel":
                raise
            return Run(note=f"not run: {error}", exercised=False)  # a layout this model cannot take
        run = Run()
        with llm:  # a worker group's follower ranks stop here
            for case in cases:
                run.samples[case.id] = samples_of(llm.generate([list(case.prompt_token_ids)], [case.params],
                                                               use_tqdm=False)[0])
            _note_speculation(llm, run)
        chunk = variant.engine_args.get("max_num_batched_tokens")
        if chunk is not None:
            longer = sum(len(c.prompt_token_ids) > chunk for c in cases)
            run.note, run.exercised = f"{longer}/{len(cases)} prompts longer than a chunk", longer > 0
        return run

    def _batch(self, variant: Variant, cases: list[Case]) -> Run:
        """Groups of up to half the batch of the user's prompts, the rest random neighbours, in a
        random order (the same for a batch size whatever the variant), or reversed."""
        if variant.tiny_cache:
            return self._preempted(variant, cases)
        per_group = max(1, variant.batch_size // 2)
        groups = [cases[i:i + per_group] for i in range(0, len(cases), per_group)]
        llm, run = self.llm(**variant.engine_args), Run()
        for index, group in enumerate(groups):
            rng = random.Random(f"{self.seed}-{variant.batch_size}-{index}")
            batch = self._neighbours(variant.batch_size - len(group), group, rng) + \
                [(list(c.prompt_token_ids), c.params, c.id) for c in group]
            rng.shuffle(batch)
            self._generate(llm, batch[::-1] if variant.reverse else batch, run)
        _note_speculation(llm, run)
        return run

    def _preempted(self, variant: Variant, cases: list[Case]) -> Run:
        """Each prompt after batch_size - 1 neighbours whose prompts fill whole blocks, in a cache
        that holds the prompts and one block more: at the first decode step every neighbour needs
        a block, and the latest arrival (the user's prompt, under FCFS) is preempted."""
        block_size = self.base_args.get("block_size", 16)
        batches = []
        for index, case in enumerate(cases):
            rng = random.Random(f"{self.seed}-preempt-{index}")
            others = [([rng.randrange(3, self.vocab_size) for _ in range(block_size * rng.randint(1, 2))], sp, None)
                      for _, sp, _ in self._neighbours(variant.batch_size - 1, [case], rng)]
            batches.append(others + [(list(case.prompt_token_ids), case.params, case.id)])
        need = max(-(-(len(p) + sp.max_tokens) // block_size) for batch in batches for p, sp, _ in batch)
        held = max(sum(-(-len(p) // block_size) for p, _, _ in batch) for batch in batches)
        num_blocks = max(need, held + 1)
        llm, run = self.llm(**variant.engine_args, num_gpu_blocks=num_blocks), Run()
        requests = _track_requests(llm)
        for batch in batches:
            self._generate(llm, batch, run)
        users = requests[variant.batch_size - 1::variant.batch_size]  # the last of each batch
        preempted = sum(any(s.num_preemptions for s in r.seqs) for r in users)
        run.note = f"{preempted}/{len(cases)} prompts preempted ({llm.scheduler.num_preemptions} preemptions, " \
                   f"{num_blocks} KV blocks)"
        run.exercised = preempted > 0
        return run

    def _neighbours(self, num: int, group: list[Case], rng: random.Random):
        max_tokens = max(c.params.max_tokens for c in group)
        return [(p, sp, None) for p, sp in neighbours(num, self.vocab_size, max_tokens, rng)]

    @staticmethod
    def _generate(llm: LLM, batch: list[tuple[list[int], SamplingParams, str | None]], run: Run) -> None:
        outputs = llm.generate([p for p, _, _ in batch], [sp for _, sp, _ in batch], use_tqdm=False)
        for (_, _, case_id), output in zip(batch, outputs):
            if case_id is not None:
                run.samples[case_id] = samples_of(output)

    def _prefix(self, variant: Variant, cases: list[Case]) -> Run:
        """Before each prompt, a request sharing all of it but its last token fills the cache."""
        llm = self.llm(**variant.engine_args)
        run, hits = Run(), 0
        for case in cases:
            ids = list(case.prompt_token_ids)
            warm = ids[:-1] + [3 if ids[-1] != 3 else 4]  # the same prefix, another last token
            llm.generate([warm], [SamplingParams(temperature=0, max_tokens=1)], use_tqdm=False)
            output = llm.generate([ids], [case.params], use_tqdm=False)[0]
            run.samples[case.id] = samples_of(output)
            hits += output.num_cached_tokens > 0
        run.note, run.exercised = f"{hits}/{len(cases)} prompts hit the cache", hits > 0
        return run


def _track_requests(llm: LLM) -> list:
    """Every Request the engine admits from now on, in order (to read their preemption counts
    after they finished and left the scheduler)."""
    admitted, add = [], llm.scheduler.add_request

    def add_and_keep(*args, **kwargs):
        admitted.append(add(*args, **kwargs))
        return admitted[-1]

    llm.scheduler.add_request = add_and_keep
    return admitted


def _note_speculation(llm: LLM, run: Run) -> None:
    """A speculative variant's note: how many drafted tokens were accepted (exercised: some were)."""
    stats = llm.scheduler.stats()
    if llm.scheduler.speculator is not None:
        drafted, accepted = stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens
        run.note, run.exercised = f"{accepted}/{drafted} drafted tokens accepted", accepted > 0
