"""The one sampler: logits -> token ids (and logprobs), batch-invariant (docs/ARCHITECTURE.md rule 4).

A row's token and logprobs are a pure function of (logits row, params, seed,
sample_index, position, its tokens): never of its batch neighbours, their number or its
place among them. Three things make that hold on the CPU:
- random rows draw one uniform from `seeding.uniform` and invert the CDF of their own
  probabilities, so no generator state is shared;
- only ops measured to give a row the same bits for 1 or many rows are used on whole
  rows: elementwise ops, gather/scatter, log_softmax, softmax, amax, argmax, topk,
  cumsum (serial along the row), counts of booleans (exact) and float64 sums over fixed
  256-wide blocks (many outputs, so torch never splits one output's reduction);
- a full-row float `sum` is never used: with one output torch splits it across threads
  and the bits change with the batch size.
Every tensor is made on the logits' device (a CUDA worker samples on the GPU); the uniforms are
computed on the host from (seed, sample_index, position), so they are the same on every device.
Processing order per row is vLLM's: logit_bias, min_tokens, repetition penalty,
presence/frequency penalties; then greedy argmax, or temperature, top_k, softmax,
min_p, top_p and the draw. Logprobs are always those of the raw logits.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import torch
import torch.nn.functional as F

from kernels.cpu_kernels import argmax_cpu
from services.core import seeding
from services.core.sampling_params import SamplingParams
from services.core.step import Logprobs

BLOCK = 256  # width of the fixed blocks the CDF is summed over
TOP_P_CANDIDATES = 64  # top_p first looks for its nucleus among this many tokens (all rows at once)
TOP_P_CANDIDATES_SLOW = 2048  # then, row by row, among this many, then among all


@dataclass(kw_only=True)
class SamplingRow:
    """One row of logits to sample from, and what decides the draw."""

    params: SamplingParams  # its seed always set: a draw is a function of (seed, sample_index, position)
    sample_index: int
    position: int  # index in the sequence of the token being sampled
    prompt_token_ids: list[int]
    output_token_ids: list[int]


def sample(logits: torch.Tensor, rows: list[SamplingRow],
           eos_token_ids: tuple[int, ...]) -> list[tuple[int, Logprobs | None]]:
    """Sample one token per row of `logits` [R, V]; logprobs where the row asks for them."""
    logits = logits.float()
    token_ids = sample_tokens(logits, rows, eos_token_ids).tolist()
    asked = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    logprobs: list[Logprobs | None] = [None] * len(rows)
    if asked:
        raw = logits[asked].log_softmax(-1)
        found = _logprobs(raw, [token_ids[i] for i in asked], [rows[i].params.logprobs for i in asked])
        for i, entry in zip(asked, found):
            logprobs[i] = entry
    return list(zip(token_ids, logprobs))


def sample_tokens(logits: torch.Tensor, rows: list[SamplingRow], eos_token_ids: tuple[int, ...]) -> torch.Tensor:
    """The sampled token of each row of `logits` [R, V] (fp32), as [R] int64 on the logits' device."""
    processed = _process(logits, rows, eos_token_ids)  # [R, V]
    tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    greedy = [i for i, row in enumerate(rows) if row.params.greedy]
    if greedy:  # torch's argmax (first index on ties); the compiled one on the CPU
        tokens[greedy] = argmax_cpu(_take_rows(processed, greedy))
    randoms = [i for i, row in enumerate(rows) if not row.params.greedy]
    if randoms:
        tokens[randoms] = _sample_random(_take_rows(processed, randoms), [rows[i] for i in randoms])
    return tokens


def prompt_logprobs(logits: torch.Tensor, next_token_ids: list[int], k: int) -> list[Logprobs]:
    """Logprobs of next_token_ids[i] under logits[i] [N, V], with the top k of each row."""
    return _logprobs(logits.float().log_softmax(-1), next_token_ids, [k] * len(next_token_ids))


def _take_rows(x: torch.Tensor, idx: list[int]) -> torch.Tensor:
    """x[idx] without the copy when idx is every row in order."""
    return x if len(idx) == x.shape[0] else x[idx]


# --- logits processors (in place on a copy; each touches only its (row, token) pairs) ---

def _process(logits: torch.Tensor, rows: list[SamplingRow], eos_token_ids: tuple[int, ...]) -> torch.Tensor:
    if not any(_needs_processing(row) for row in rows):
        return logits
    x = logits.clone()
    _add_logit_bias(x, rows)
    _mask_min_tokens(x, rows, eos_token_ids)
    _apply_repetition_penalty(x, rows)
    _apply_presence_frequency(x, rows)
    return x


def _needs_processing(row: SamplingRow) -> bool:
    p = row.params
    return bool(p.logit_bias or len(row.output_token_ids) < p.min_tokens or p.repetition_penalty != 1.0
                or p.presence_penalty or p.frequency_penalty)


def _pairs(entries: list[tuple[int, int, float]], device: torch.device) -> tuple[torch.Tensor, ...]:
    rows, tokens, values = zip(*entries)
    return (torch.tensor(rows, device=device), torch.tensor(tokens, device=device),
            torch.tensor(values, dtype=torch.float32, device=device))


def _token_counts(token_lists: list[list[int]], vocab: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The distinct (row, token) pairs of the lists (row i: token_lists[i]) and their counts."""
    lengths = torch.tensor([len(t) for t in token_lists], device=device)
    rows = torch.arange(len(token_lists), device=device).repeat_interleave(lengths)
    tokens = torch.tensor(list(chain.from_iterable(token_lists)), dtype=torch.long, device=device)
    keys, counts = torch.unique(rows * vocab + tokens, return_counts=True)
    return keys // vocab, keys % vocab, counts


def _add_logit_bias(x: torch.Tensor, rows: list[SamplingRow]) -> None:
    entries = [(i, token, bias) for i, row in enumerate(rows)
               for token, bias in dict(row.params.logit_bias).items()]  # a repeated token: last wins
    if entries:
        r, t, bias = _pairs(entries, x.device)
        x[r, t] = x[r, t] + bias


def _mask_min_tokens(x: torch.Tensor, rows: list[SamplingRow], eos_token_ids: tuple[int, ...]) -> None:
    entries = [(i, token, 0.0) for i, row in enumerate(rows)
               if len(row.output_token_ids) < row.params.min_tokens
               for token in set(eos_token_ids) | set(row.params.stop_token_ids)]
    if entries:
        r, t, _ = _pairs(entries, x.device)
        x[r, t] = float("-inf")


def _apply_repetition_penalty(x: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Hugging Face semantics over prompt and output tokens: positive / p, else * p."""
    if all(row.params.repetition_penalty == 1.0 for row in rows):
        return
    penalties = torch.tensor([row.params.repetition_penalty for row in rows], dtype=torch.float32, device=x.device)
    r, t, _ = _token_counts([row.prompt_token_ids + row.output_token_ids
                             if row.params.repetition_penalty != 1.0 else [] for row in rows], x.shape[1], x.device)
    seen, penalty = x[r, t], penalties[r]
    x[r, t] = torch.where(seen > 0, seen / penalty, seen * penalty)


def _apply_presence_frequency(x: torch.Tensor, rows: list[SamplingRow]) -> None:
    """OpenAI semantics over output tokens: logit -= presence + frequency * count."""
    if not any(row.params.presence_penalty or row.params.frequency_penalty for row in rows):
        return
    presence = torch.tensor([row.params.presence_penalty for row in rows], dtype=torch.float64, device=x.device)
    frequency = torch.tensor([row.params.frequency_penalty for row in rows], dtype=torch.float64, device=x.device)
    r, t, counts = _token_counts([row.output_token_ids if row.params.presence_penalty or row.params.frequency_penalty
                                  else [] for row in rows], x.shape[1], x.device)
    x[r, t] = x[r, t] - (presence[r] + frequency[r] * counts).float()


# --- random rows: temperature, top_k, softmax, min_p, top_p, inverse-CDF draw ---
# Each filter works in place on a tensor this module made, by a per-row threshold.

def _sample_random(x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    params = [row.params for row in rows]
    temperature = torch.tensor([[p.temperature] for p in params], dtype=torch.float32, device=x.device)  # [R, 1]
    x = x / temperature
    _top_k_mask(x, [p.top_k for p in params])
    probs = x.softmax(-1)  # [R, V]
    _min_p_mask(probs, [p.min_p for p in params])
    _top_p_mask(probs, [p.top_p for p in params])
    u = torch.tensor([seeding.uniform(row.params.seed, row.sample_index, row.position) for row in rows],
                     dtype=torch.float64, device=x.device)  # from the host: the same on every device
    return _inverse_cdf(probs, u)


def _top_k_mask(x: torch.Tensor, top_ks: list[int]) -> None:
    """Keep logits >= each row's k-th largest; k <= 0 or k >= V: off."""
    num_rows, vocab = x.shape
    idx = [i for i, k in enumerate(top_ks) if 0 < k < vocab]
    if not idx:
        return
    ks = torch.tensor([top_ks[i] for i in idx], device=x.device)
    kth = torch.full((num_rows, 1), float("-inf"), device=x.device)
    kth[idx] = _take_rows(x, idx).topk(max(top_ks[i] for i in idx)).values.gather(1, (ks - 1)[:, None])
    x.masked_fill_(x < kth, float("-inf"))


def _min_p_mask(probs: torch.Tensor, min_ps: list[float]) -> None:
    """Keep tokens with p >= min_p * max p."""
    if any(min_ps):
        floor = torch.tensor([[m] for m in min_ps], dtype=torch.float32, device=probs.device)
        floor = floor * probs.amax(-1, keepdim=True)
        probs.masked_fill_(probs < floor, 0.0)


def _top_p_mask(probs: torch.Tensor, top_ps: list[float]) -> None:
    """Keep the smallest most-likely prefix (stable order: ties by lower id) with mass >= top_p."""
    idx = [i for i, top_p in enumerate(top_ps) if top_p < 1.0]
    if not idx:
        return
    sub = _take_rows(probs, idx)  # [r, V]
    target = torch.tensor([top_ps[i] for i in idx], dtype=torch.float64, device=probs.device)
    target = target * _block_sums(sub).cumsum(-1)[:, -1]
    # Fast path: the nucleus lies within the top candidates, with no tie at its edge.
    top = sub.topk(min(TOP_P_CANDIDATES, sub.shape[1])).values.double()  # [r, C] descending
    n = torch.searchsorted(top.cumsum(-1), target[:, None])  # [r, 1] first index reaching target
    edge = top.gather(1, n.clamp(max=top.shape[1] - 1)).float()
    fast = ((n[:, 0] < top.shape[1]) & ((sub >= edge).sum(-1) == n[:, 0] + 1)).tolist()
    floor = torch.zeros(probs.shape[0], 1, device=probs.device)
    floor[[i for i, ok in zip(idx, fast) if ok]] = edge[torch.tensor(fast, device=probs.device)]
    probs.masked_fill_(probs < floor, 0.0)
    for j, i in enumerate(idx):
        if not fast[j]:
            probs[i].masked_fill_(~_nucleus(probs[i], float(target[j])), 0.0)


def _nucleus(row: torch.Tensor, target: float) -> torch.Tensor:
    """Slow path of top_p for one row [V]: more candidates, then all; ties at the edge go to lower ids."""
    for size in (min(TOP_P_CANDIDATES_SLOW, len(row)), len(row)):
        ordered = row.topk(size).values.double()  # descending
        cdf = ordered.cumsum(0)
        if cdf[-1] >= target:
            break
    n = int(torch.searchsorted(cdf, torch.tensor([target], dtype=torch.float64, device=row.device)))
    n = min(n, int((row > 0).sum()) - 1)  # rounding may leave target just above the total
    edge = ordered[n].float()
    keep = row > edge
    ties = (row == edge).nonzero()[:, 0]
    keep[ties[: n + 1 - int(keep.sum())]] = True
    return keep


def _block_sums(probs: torch.Tensor) -> torch.Tensor:
    """Float64 sums of probs [R, V] over fixed BLOCK-wide blocks: [R, NB]."""
    pad = -probs.shape[1] % BLOCK
    blocks = F.pad(probs, (0, pad)) if pad else probs
    return blocks.view(probs.shape[0], -1, BLOCK).sum(-1, dtype=torch.float64)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The first token whose cumulative probability exceeds u * total, per row.

    probs [R, V] (zero: removed), u [R] float64 in [0, 1). The CDF is taken in two
    levels, over blocks then within the chosen block, in token-id order and float64.
    """
    num_rows, vocab = probs.shape
    block_cdf = _block_sums(probs).cumsum(-1)  # [R, NB]
    target = (u * block_cdf[:, -1])[:, None]  # [R, 1]
    last_block = torch.searchsorted(block_cdf, block_cdf[:, -1:].contiguous())  # last block with mass
    block = torch.minimum(torch.searchsorted(block_cdf, target, right=True), last_block)  # [R, 1]
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    pad = -vocab % BLOCK
    padded = F.pad(probs, (0, pad)) if pad else probs
    inner = padded.view(num_rows, -1, BLOCK)[torch.arange(num_rows, device=probs.device), block[:, 0]]  # [R, BLOCK]
    inner_cdf = inner.double().cumsum(-1)
    last = torch.searchsorted(inner_cdf, inner_cdf[:, -1:].contiguous())  # last token with mass
    offset = torch.minimum(torch.searchsorted(inner_cdf, target - before, right=True), last)
    return (block * BLOCK + offset)[:, 0]


# --- logprobs ---

def _logprobs(logprobs: torch.Tensor, token_ids: list[int], ks: list[int]) -> list[Logprobs]:
    """Entries from log_softmax rows [N, V]: the token's logprob and rank, the top k (ties: lower id)."""
    ks = [min(k, logprobs.shape[1]) for k in ks]
    device = logprobs.device
    chosen = logprobs.gather(1, torch.tensor(token_ids, device=device)[:, None])  # [N, 1]
    ranks = ((logprobs > chosen).sum(-1) + 1).tolist()
    top = logprobs.topk(max(max(ks), 1))  # [N, K] descending
    kth = top.values.gather(1, torch.tensor([[max(k, 1) - 1] for k in ks], device=device))  # [N, 1]
    num_at_least = (logprobs >= kth).sum(-1).tolist()  # more than k: ties at the k-th value
    entries = []
    for i, (token, k) in enumerate(zip(token_ids, ks)):
        ids = (logprobs[i] >= kth[i]).nonzero()[:, 0] if 0 < k < num_at_least[i] else top.indices[i, :k]
        pairs = sorted(zip(logprobs[i, ids].tolist(), ids.tolist()), key=lambda p: (-p[0], p[1]))
        best = [(token_id, value) for value, token_id in pairs[:k]]
        entries.append(Logprobs(token_id=token, logprob=chosen[i, 0].item(), rank=ranks[i], top=best))
    return entries
