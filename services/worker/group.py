"""A tensor x pipeline parallel worker group: its transport and its lockstep.

Transport: torch.distributed (gloo by default; the backend is a parameter so that NCCL can come on
the GPU). The ranks meet at rank 0's address (WorkerConfig.group_address, "host:port"), each
told its rank (group_rank); nothing home-made travels but the step delta, as its protobuf bytes
(rule 6), broadcast from rank 0.

Lockstep: rank 0 is the worker the scheduler sees (it registers with the group's KV capacity, the
smallest of the ranks'). Each step it broadcasts the delta, and every rank runs the same
ModelRunner code on it: the same mirror of the sequences, the same batch, the same KV cache moves
on its own cache, the same forward pass (whose collectives therefore line up) and on stage 0 the
same logits; only rank 0's result is sent back. A pipelined step moves activations stage to stage
micro-batch by micro-batch (services/worker/pipeline.py); TIMERS gathers each rank's timers to rank 0.
A rank that fails or dies makes every collective fail: the group exits, and the scheduler recomputes
its sequences elsewhere (rule 5).
"""
from __future__ import annotations

import datetime
import socket
import time
from contextlib import contextmanager

import structlog
import torch
import torch.distributed as dist

from services.worker.parallel import Shard

log = structlog.get_logger("worker.group")

STEP, FORGET, STOP, TIMERS, LORA = 0, 1, 2, 3, 4  # what rank 0 broadcasts
TIMEOUT_S = 120  # a collective that waits longer means a rank is gone
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch 2.13 renamed it


def free_address(host: str = "127.0.0.1") -> str:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return f"{host}:{sock.getsockname()[1]}"


class GroupComm:
    """The collectives a sharded model needs (services/worker/models/llama.py), over torch.distributed."""

    def __init__(self, shard: Shard, address: str, dtype: torch.dtype, vocab_size: int, device: torch.device,
                 backend: str = "gloo", timeout_s: float = TIMEOUT_S):
        """Join the group at `address` as shard.rank. dtype: the activations that travel between stages;
        vocab_size: the whole vocabulary, split among the tensor ranks; device: where the buffers are."""
        self.shard = shard
        self.dtype, self._vocab_size, self.device = dtype, vocab_size, torch.device(device)
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a worker group: close the previous one first "
                               "(LLM.close(), or `with LLM(...) as llm:`)")
        dist.init_process_group(backend, init_method=f"tcp://{address}", rank=shard.rank,
                                world_size=shard.world_size, timeout=datetime.timedelta(seconds=timeout_s))
        tp, pp = shard.tp_size, shard.pp_size
        self.tp_group = None
        for stage in range(pp):  # every rank creates every group, in the same order
            group = dist.new_group(list(range(stage * tp, (stage + 1) * tp)))
            if stage == shard.pp_rank:
                self.tp_group = group
        self.comm_seconds = 0.0  # time spent in the model's collectives and sends (bench/parallel.py)
        self.busy_seconds = 0.0  # a pipelined pass's compute (services/worker/pipeline.py)
        self.forward_seconds = 0.0  # its whole pass, waits included: the rest is this stage's bubble

    @contextmanager
    def _counting(self, counter: str):
        """Add the block's wall time to the timer named `counter`."""
        start = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, counter, getattr(self, counter) + time.perf_counter() - start)

    def _timed(self):
        return self._counting("comm_seconds")

    def busy(self):
        return self._counting("busy_seconds")

    def forward_timed(self):
        return self._counting("forward_seconds")

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # ---- tensor parallel -------------------------------------------------------------------
    def gather_partials_into(self, local: torch.Tensor, out: torch.Tensor) -> None:
        """The row-parallel partials [G_local, T, N] of every tensor rank, in rank order, into out [G, T, N]."""
        with self._timed():
            _all_gather(out, local, group=self.tp_group)

    def gather_partials(self, local: torch.Tensor) -> torch.Tensor:
        out = torch.empty(local.shape[0] * self.shard.tp_size, *local.shape[1:], dtype=local.dtype, device=local.device)
        self.gather_partials_into(local.contiguous(), out)
        return out

    def gather_embeddings(self, rows: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Each token's embedding row from the rank whose vocabulary part holds it (copied, not summed)."""
        tp = self.shard.tp_size
        everything = torch.empty(tp * rows.shape[0], *rows.shape[1:], dtype=rows.dtype, device=rows.device)
        with self._timed():
            _all_gather(everything, rows.contiguous(), group=self.tp_group)
        everything = everything.view(tp, *rows.shape)
        vocab = self._vocab_size
        starts = torch.tensor([r * vocab // tp for r in range(1, tp)], dtype=input_ids.dtype, device=input_ids.device)
        owner = torch.bucketize(input_ids, starts, right=True)
        return everything[owner, torch.arange(input_ids.shape[0], device=owner.device)]

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[R, V_local] of every tensor rank -> [R, V], the parts side by side (padded to one width to travel)."""
        tp, vocab = self.shard.tp_size, self._vocab_size
        widths = [(r + 1) * vocab // tp - r * vocab // tp for r in range(tp)]
        width = max(widths)
        padded = torch.zeros(logits.shape[0], width, dtype=logits.dtype, device=logits.device)
        padded[:, :logits.shape[1]] = logits
        everything = torch.empty(tp * padded.shape[0], width, dtype=logits.dtype, device=logits.device)
        with self._timed():
            _all_gather(everything, padded, group=self.tp_group)
        everything = everything.view(tp, *padded.shape)
        return torch.cat([everything[r, :, :w] for r, w in enumerate(widths)], dim=1)

    # ---- pipeline parallel -----------------------------------------------------------------
    def isend_activations(self, x: torch.Tensor, residual: torch.Tensor, to_first: bool):
        """(x, residual) on their way to the same tensor rank of the next stage (of stage 0 from the last):
        a handle for wait_sends, which keeps the buffer alive until it has gone."""
        stage = 0 if to_first else self.shard.pp_rank + 1
        peer = stage * self.shard.tp_size + self.shard.tp_rank
        both = torch.stack([x, residual]).contiguous()
        with self._timed():
            return both, dist.isend(both, peer)

    def wait_sends(self, sends: list) -> None:
        with self._timed():
            for _, work in sends:
                work.wait()

    def recv_activations(self, num_tokens: int, hidden: int, from_last: bool = False) -> tuple[torch.Tensor, ...]:
        stage = self.shard.pp_size - 1 if from_last else self.shard.pp_rank - 1
        peer = stage * self.shard.tp_size + self.shard.tp_rank
        both = torch.empty(2, num_tokens, hidden, dtype=self.dtype, device=self.device)
        with self._timed():
            dist.recv(both, peer)
        return both[0], both[1]

    # ---- rank 0 -> every rank ----------------------------------------------------------------
    def broadcast(self, kind: int, payload: bytes = b"") -> None:
        header = torch.tensor([kind, len(payload)], dtype=torch.int64)
        dist.broadcast(header, 0)
        if payload:
            dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), 0)

    def receive(self) -> tuple[int, bytes]:
        header = torch.empty(2, dtype=torch.int64)
        dist.broadcast(header, 0)
        kind, size = int(header[0]), int(header[1])
        if not size:
            return kind, b""
        data = torch.empty(size, dtype=torch.uint8)
        dist.broadcast(data, 0)
        return kind, data.numpy().tobytes()

    def gather_timers(self) -> list[dict[str, float]] | None:
        """Every rank's timers (busy, forward, comm seconds so far), in rank order, on rank 0 (None elsewhere).
        Each rank calls it after rank 0 broadcast TIMERS."""
        mine = torch.tensor([self.busy_seconds, self.forward_seconds, self.comm_seconds], dtype=torch.float64)
        everyone = [torch.empty_like(mine) for _ in range(self.shard.world_size)] if self.shard.rank == 0 else None
        dist.gather(mine, everyone, dst=0)
        if everyone is None:
            return None
        return [dict(zip(("busy_seconds", "forward_seconds", "comm_seconds"), t.tolist())) for t in everyone]

    def min_over_ranks(self, value: int) -> int:
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        return int(tensor[0])
