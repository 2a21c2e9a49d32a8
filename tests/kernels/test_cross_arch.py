"""The kernels cross-compiled for aarch64 (the generic tier, NEON) and run under qemu-user:
tests/kernels/csrc/kernel_check.c runs each kernel on inputs made here, and the outputs are
compared with the PyTorch references computed here, bit for bit with the host's avx2 tier, and bit
for bit between a whole batch and its rows run alone (or from another position). Small shapes: 11 rows x 100 x 37 (odd K, a
partial panel) for the GEMM, 20 tokens over 3 KV blocks of 8 for attention, rows of 80
(not a multiple of 16) for the row-wise ops, 1000-wide argmax, fp32 and bf16 each.

Needs Debian's gcc-aarch64-linux-gnu and qemu-user (.ci/run installs them where it can);
skipped, saying so, where they are missing."""
from __future__ import annotations

import pytest
import torch

from kernels import build, cpu_kernels
from kernels.activation import silu_and_mul_ref
from kernels.attention import paged_attention_ref
from kernels.cpu_kernels import pack_gemm_weight
from kernels.norm import rms_norm_ref
from kernels.rotary import apply_rotary_ref
from tests.kernels import aarch64

M, N, K, T, H, I, HEADS, KV_HEADS, D, BLOCK, NUM_BLOCKS, MAX_BLOCKS, V = 11, 100, 37, 20, 80, 40, 4, 2, 32, 8, 5, 4, 1000
DTYPES = (torch.float32, torch.bfloat16)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(aarch64.MISSING is not None, reason=str(aarch64.MISSING))]


@pytest.fixture(scope="module")
def run_on_aarch64(tmp_path_factory):
    """The kernels and the harness as one static aarch64 executable; inputs -> (stdout, outputs)."""
    folder = tmp_path_factory.mktemp("aarch64")
    exe = aarch64.check_executable("kernel_check.c", folder / "kernel_check")
    return lambda blob: aarch64.run(exe, blob, folder)


def _bytes(t: torch.Tensor) -> bytes:
    t = t.contiguous()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()


class _Reader:
    def __init__(self, data: bytes):
        self.data, self.at = data, 0

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        count = 1
        for n in shape:
            count *= n
        size = count * torch.empty(0, dtype=dtype).element_size()
        raw = bytearray(self.data[self.at:self.at + size])
        self.at += size
        return torch.frombuffer(raw, dtype=dtype).reshape(shape).clone()


def _inputs(gen: torch.Generator) -> tuple[bytes, dict]:
    r = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    parts, saved = [torch.tensor([M, N, K, T, H, I, HEADS, KV_HEADS, D, BLOCK, NUM_BLOCKS, MAX_BLOCKS, V])], {}
    for dtype in DTYPES:
        x, w, b = r(M, K).to(dtype), r(N, K).to(dtype), r(N).to(dtype)
        parts += [x, pack_gemm_weight(w), b]
        saved[("linear", dtype)] = x, w, b
    positions = torch.randperm(T, generator=gen)
    angles = torch.arange(T)[:, None] * torch.rand(D // 2, generator=gen)[None]
    rotary = torch.cat([angles.cos(), angles.sin()], -1)  # [T, D] fp32
    for dtype in DTYPES:
        x, res, w, gate_up = r(T, H).to(dtype), r(T, H).to(dtype), r(H).to(dtype), r(T, 2 * I).to(dtype)
        q, k = r(T, HEADS, D).to(dtype), r(T, KV_HEADS, D).to(dtype)
        parts += [x, res, w, gate_up, q, k, rotary, positions]
        saved[("rowwise", dtype)] = x, res, w, gate_up, q, k
    tables = torch.randperm(NUM_BLOCKS, generator=gen)[:MAX_BLOCKS]
    for dtype in DTYPES:
        q, kc, vc = r(T, HEADS, D).to(dtype), r(NUM_BLOCKS, BLOCK, KV_HEADS, D).to(dtype), \
            r(NUM_BLOCKS, BLOCK, KV_HEADS, D).to(dtype)
        k, v, slots = r(T, KV_HEADS, D).to(dtype), r(T, KV_HEADS, D).to(dtype), torch.randperm(NUM_BLOCKS * BLOCK,
                                                                                               generator=gen)[:T]
        parts += [q, kc, vc, tables, k, v, slots]
        saved[("attention", dtype)] = q, kc, vc, k, v, slots
    logits = r(T, V)
    logits[3, 17] = logits[3, 900] = 100.0  # a tie: the first index
    parts.append(logits)
    saved.update(rotary=(rotary, positions), tables=tables, logits=logits)
    return b"".join(_bytes(p) for p in parts), saved


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=2e-2)
    torch.testing.assert_close(got.float(), want.float(), **tolerance, msg=lambda m: f"{what} {dtype}: {m}")


def _avx2_bits(got: torch.Tensor, host: callable, what: str) -> None:
    """aarch64's output has the bits the host's avx2 tier gives the same inputs (where the host runs it):
    every tier's fused multiply-adds are vec.h's, the compiler contracts nothing."""
    if "avx2" not in build.host_tiers():
        return
    with cpu_kernels.use_isa("avx2"):
        want = host()
    assert torch.equal(got.view(-1), want.view(-1)), f"{what} {got.dtype}: aarch64's bits differ from avx2's"


def test_every_kernel_on_aarch64_matches_the_reference_and_its_own_bits(run_on_aarch64, fresh_seed):
    blob, saved = _inputs(torch.Generator().manual_seed(fresh_seed))
    stdout, data = run_on_aarch64(blob)
    assert "kernel_check: generic-neon" in stdout  # the NEON path of the generic tier ran
    out = _Reader(data)
    for dtype in DTYPES:  # GEMM: the reference, and the same bits alone, in a batch, from row 3
        x, w, b = saved[("linear", dtype)]
        full, alone, tail = (out.take((M, N), dtype) for _ in range(3))
        _close(full, x.double() @ w.double().T + b.double(), dtype, "linear")
        _avx2_bits(full, lambda: cpu_kernels.linear_cpu(x, pack_gemm_weight(w), N, K, b), "linear")
        assert torch.equal(full, alone) and torch.equal(full, tail), f"linear {dtype}: bits depend on the batch"
    rotary, positions = saved["rotary"]
    for dtype in DTYPES:
        x, res, w, gate_up, q, k = saved[("rowwise", dtype)]
        normed, new_res, normed_alone, res_alone = (out.take((T, H), dtype) for _ in range(4))
        want_normed, want_res = rms_norm_ref(x, w, 1e-5, res)
        _close(normed, want_normed, dtype, "rms_norm")
        assert torch.equal(new_res, want_res)
        _avx2_bits(normed, lambda: cpu_kernels.rms_norm_cpu(x, w, 1e-5, res)[0], "rms_norm")
        assert torch.equal(normed, normed_alone) and torch.equal(new_res, res_alone)
        act, act_alone = out.take((T, I), dtype), out.take((T, I), dtype)
        _close(act, silu_and_mul_ref(gate_up), dtype, "silu_and_mul")
        _avx2_bits(act, lambda: cpu_kernels.silu_and_mul_cpu(gate_up), "silu_and_mul")
        assert torch.equal(act, act_alone)
        q_out, k_out = out.take((T, HEADS, D), dtype), out.take((T, KV_HEADS, D), dtype)
        want_q, want_k = apply_rotary_ref(q, k, positions, rotary)
        _close(q_out, want_q, dtype, "rotary q")
        _close(k_out, want_k, dtype, "rotary k")
        _avx2_bits(torch.cat([q_out.flatten(), k_out.flatten()]), lambda: torch.cat(
            [t.flatten() for t in cpu_kernels.apply_rotary_cpu(q, k, positions, rotary)]), "rotary")
    tables = saved["tables"]
    for dtype in DTYPES:
        q, kc, vc, k, v, slots = saved[("attention", dtype)]
        prefill, decode = out.take((T, HEADS, D), dtype), out.take((T, HEADS, D), dtype)
        want = paged_attention_ref(q, kc, vc, tables[None], torch.tensor([T]), torch.tensor([0, T]), 0.125)
        _close(prefill, want, dtype, "paged_attention")
        _avx2_bits(prefill, lambda: cpu_kernels.paged_attention_cpu(
            q, kc, vc, tables[None], torch.tensor([T]), torch.tensor([0, T]), 0.125), "paged_attention")
        assert torch.equal(prefill, decode), f"attention {dtype}: a token's bits depend on its batch"
        want_k, want_v = kc.clone().view(-1, KV_HEADS, D), vc.clone().view(-1, KV_HEADS, D)
        want_k[slots], want_v[slots] = k, v
        got_k, got_v = (out.take((NUM_BLOCKS, BLOCK, KV_HEADS, D), dtype) for _ in range(2))
        assert torch.equal(got_k.view(-1, KV_HEADS, D), want_k) and torch.equal(got_v.view(-1, KV_HEADS, D), want_v)
    assert torch.equal(out.take((T,), torch.int64), saved["logits"].argmax(-1))
    assert out.at == len(data)
