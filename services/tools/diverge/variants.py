"""The variants: each changes one variable from the batch-1 baseline (the chapter's method).

`expect` says what the engine promises: IDENTICAL variants must give the baseline's tokens with
bit-equal logprobs (docs/ARCHITECTURE.md rule 4), and fail the command when they do not;
MAY_DIFFER ones are shown so the user sees what each cause does, and fail only when `--fail-on`
names them.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from services.core.errors import InvalidArgument

IDENTICAL, MAY_DIFFER = "identical", "may differ"
# how the variant's requests are laid out
ALONE, BATCH, PREFIX = "alone", "batch", "prefix"
# where they run
ENGINE, TRANSFORMERS, CLUSTER, CLUSTER_KILL = "engine", "transformers", "cluster", "cluster-kill"

CHUNK_SIZES = (8, 13, 64)  # 13: chunks that end inside a block
BLOCK_SIZES = (8, 16, 32)
BATCH_SIZES = (8, 64)
PREEMPTION_BATCH = 8  # each prompt the latest of 8: the first to be preempted


@dataclass(frozen=True, kw_only=True)
class Variant:
    name: str
    group: str  # for --variants / --fail-on: a name or a group selects
    changes: str  # what differs from the baseline, one line for the report
    expect: str = IDENTICAL
    engine_args: dict = field(default_factory=dict)  # on top of the baseline's
    layout: str = ALONE
    batch_size: int = 1
    reverse: bool = False  # the batch in reverse order: every request at another position
    tiny_cache: bool = False  # a KV cache too small for the batch: preemptions
    own_reference: bool = False  # compared with its own batch-1 run (same engine args), not the baseline
    where: str = ENGINE
    greedy_only: bool = False


def tier_variants(tiers: list[str], baseline_tier: str | None, kernels: str) -> list[Variant]:
    """One variant per kernel tier this host runs, beside the one the baseline picked, and the
    PyTorch reference kernels when the baseline runs compiled ones. Tiers may differ from each
    other in bits (docs/ARCHITECTURE.md, kernels: each is batch-invariant on its own), so they are
    shown, not failed."""
    out = [Variant(name=f"tier-{tier}", group="tier", changes=f"kernel tier {tier}", expect=MAY_DIFFER,
                   engine_args={"cpu_isa": tier})
           for tier in tiers if tier != baseline_tier]
    if kernels != "torch":
        out.append(Variant(name="kernels-torch", group="tier",
                           changes="the PyTorch reference kernels (another attention and norm implementation)",
                           expect=MAY_DIFFER, engine_args={"kernel_backend": "torch"}))
    return out


def local_variants(block_size: int, dtype: str, num_threads: int, tiers: list[str],
                   baseline_tier: str | None, kernels: str) -> list[Variant]:
    """Every variant the in-process engine runs, for a baseline with this block size, dtype
    ("float32" or "bfloat16") and thread count."""
    other_dtype = "bfloat16" if dtype == "float32" else "float32"
    threads = sorted({1, 2, os.cpu_count() or 1} - {num_threads})
    return [
        *(Variant(name=f"batch-{n}", group="batch", changes=f"in a batch of {n} with random neighbours", layout=BATCH,
                  batch_size=n)
          for n in BATCH_SIZES),
        Variant(
            name="position", group="batch", changes=f"batch of {BATCH_SIZES[-1]} in reverse order: another position",
            layout=BATCH, batch_size=BATCH_SIZES[-1], reverse=True),
        Variant(name="preempt-recompute", group="preemption", changes="preempted and recomputed (a tiny KV cache)",
                engine_args={"preemption_mode": "recompute"}, layout=BATCH, batch_size=PREEMPTION_BATCH,
                tiny_cache=True),
        Variant(name="preempt-swap", group="preemption", changes="preempted and swapped out and in (a tiny KV cache)",
                engine_args={"preemption_mode": "swap"}, layout=BATCH, batch_size=PREEMPTION_BATCH,
                tiny_cache=True),
        *(Variant(name=f"chunk-{n}", group="chunked", changes=f"prompt prefilled in chunks of {n} tokens",
                  engine_args={"enable_chunked_prefill": True, "max_num_batched_tokens": n}) for n in CHUNK_SIZES),
        Variant(name="prefix-hit", group="prefix", changes="prompt's prefix served from the prefix cache",
                engine_args={"enable_prefix_caching": True}, layout=PREFIX),
        *(Variant(name=f"block-{n}", group="block", changes=f"KV block size {n}", engine_args={"block_size": n})
          for n in BLOCK_SIZES if n != block_size),
        *(Variant(name=f"threads-{n}", group="threads", changes=f"{n} CPU threads", engine_args={"num_threads": n})
          for n in threads),
        Variant(name="spec-ngram", group="speculative",
                changes="speculative decoding, n-gram drafts (4) verified exactly, in a batch of 8",
                engine_args={"speculative_config": {"method": "ngram", "num_speculative_tokens": 4,
                                                    "prompt_lookup_max": 4, "prompt_lookup_min": 1,
                                                    "disable_by_batch_size": 0}},  # drafts in the batch too
                layout=BATCH, batch_size=PREEMPTION_BATCH),
        Variant(name="spec-suffix", group="speculative",
                changes="speculative decoding, suffix-tree drafts (4, with a global tree) verified exactly, alone",
                engine_args={"speculative_config": {"method": "suffix", "num_speculative_tokens": 4,
                                                    "suffix_global_max_tokens": 65536}}),
        *(Variant(name=f"{kind}-2", group="parallel", changes=f"a worker group: {what} over 2 ranks",
                  engine_args={f"{kind_arg}_parallel_size": 2})
          for kind, kind_arg, what in (("tp", "tensor", "each layer split"), ("pp", "pipeline", "the layers split"))),
        Variant(name=other_dtype, group="dtype", changes=f"weights and activations in {other_dtype}", expect=MAY_DIFFER,
                engine_args={"dtype": other_dtype}),
        *tier_variants(tiers, baseline_tier, kernels),
        Variant(name="no-invariance", group="invariance",
                changes=f"batch_invariant=False, batch of {BATCH_SIZES[-1]} against batch 1 (both without)",
                expect=MAY_DIFFER, engine_args={"batch_invariant": False}, layout=BATCH, batch_size=BATCH_SIZES[-1],
                own_reference=True),
        Variant(name="transformers", group="transformers", changes="Hugging Face transformers, fp32, greedy",
                expect=MAY_DIFFER, where=TRANSFORMERS, greedy_only=True),
    ]


def cluster_variants(with_kill: bool) -> list[Variant]:
    out = [Variant(name="cluster", group="cluster", changes="a running cluster: another process, another worker",
                   where=CLUSTER)]
    if with_kill:
        out.append(Variant(name="worker-killed", group="cluster",
                           changes="its worker killed mid-request, recomputed on another", where=CLUSTER_KILL))
    return out


def select(variants: list[Variant], spec: str, flag: str) -> list[Variant]:
    """`spec`: comma-separated names or groups; "all", "none", or "invariant" (the IDENTICAL ones)."""
    words = {w.strip() for w in spec.split(",") if w.strip()}
    known = {v.name for v in variants} | {v.group for v in variants} | {"all", "none", "invariant"}
    unknown = sorted(words - known)
    if unknown:
        raise InvalidArgument(flag, f"unknown variants or groups {unknown}; known: {', '.join(sorted(known))}")
    return [v for v in variants if "all" in words or v.name in words or v.group in words
            or ("invariant" in words and v.expect == IDENTICAL)]
