"""A pipeline-parallel forward pass over micro-batches, so that the stages do not take turns.

A step's batch is cut into micro-batches of whole sequences (`split`, the same cut on every rank:
each has the same batch). Stage 0 embeds micro-batch 0, runs its layers and sends it on, then
micro-batch 1 while stage 1 runs micro-batch 0, and so on; the last stage sends each micro-batch's
(x, residual) back to stage 0, which applies the final norm and keeps the logits and the sampling
(services/worker/parallel.py). Sends are asynchronous, so a stage computes the next micro-batch while
the last one travels; every rank waits for its sends before the step ends.

A sequence's numbers do not depend on its micro-batch: the kernels are batch-invariant (rule 4), the
attention reads only its own sequence, and the rows come back in the batch's order. One micro-batch
is the plain stage-after-stage pass.

`GroupComm.busy_seconds` counts the time a rank computes here (embedding, layers, final norm) and
`forward_seconds` the whole pass: their ratio is the stage's share of the step, the rest is its
bubble (bench/parallel.py).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch


def split(query_start_loc: list[int], parts: int) -> list[tuple[int, int]]:
    """Contiguous sequence ranges [s0, s1): at most `parts` of them, none empty, cut where the
    running token count passes each 1/parts of the batch's tokens (a long prefill is one part)."""
    num_seqs, total = len(query_start_loc) - 1, query_start_loc[-1]
    parts = max(1, min(parts, num_seqs))
    bounds = [0]
    for p in range(1, parts):
        left = parts - p  # parts still to cut after this bound: each needs a sequence
        s = bounds[-1] + 1
        while s < num_seqs - left and query_start_loc[s] * parts < total * p:
            s += 1
        bounds.append(s)
    bounds.append(num_seqs)
    return list(zip(bounds, bounds[1:]))


def forward(model, input_ids: torch.Tensor, kv_caches, meta, micro_batches: int) -> torch.Tensor | None:
    """model (services/worker/models/llama.py) on this rank's stage, over micro-batches: stage 0's result
    is the final-normed hidden [T, hidden] of the whole batch; the other stages' is None."""
    comm, shard = model.comm, model.shard
    hidden = model.cfg.hidden_size
    starts = meta.query_start_loc.tolist()
    ranges = split(starts, micro_batches)
    sends = []
    with comm.forward_timed():
        for s0, s1 in ranges:
            t0, t1 = starts[s0], starts[s1]
            if shard.first_stage:
                with comm.busy():
                    x, residual = model.embed_tokens(input_ids[t0:t1]), None
            else:
                x, residual = comm.recv_activations(t1 - t0, hidden)
            with comm.busy(), _lora_rows(model, t0, t1):
                x, residual = model.run_layers(x, residual, kv_caches, meta.select(s0, s1), final_norm=False)
            sends.append(comm.isend_activations(x, residual, to_first=shard.last_stage))
        out = None
        if shard.first_stage:
            parts = []
            for s0, s1 in ranges:
                x, residual = comm.recv_activations(starts[s1] - starts[s0], hidden, from_last=True)
                with comm.busy():
                    parts.append(model.ops.rms_norm(x, model.final_norm, model.cfg.rms_norm_eps, residual)[0])
            out = parts[0] if len(parts) == 1 else torch.cat(parts)
        comm.wait_sends(sends)
    return out


@contextmanager
def _lora_rows(model, t0: int, t1: int):
    """The step's LoRA rows (services/worker/lora.py) of the micro-batch's tokens [t0, t1), counted from t0."""
    lora = model.lora
    batch = lora.batch if lora is not None else None
    if batch is None:
        yield
        return
    lora.batch = batch.select(t0, t1)
    try:
        yield
    finally:
        lora.batch = batch
