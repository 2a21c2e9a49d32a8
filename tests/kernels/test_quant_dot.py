"""Quantized weights with int8 activations (kernels/csrc/quant_dot.c): the numpy reference's bits on
every tier this CPU builds (AVX-512 VNNI, AVX-512 without VNNI, AVX2, generic), whatever the batch,
the row's place in it or the thread count; the row-parallel K groups; and the served models: the
same tokens and logprobs on every tier an engine can be forced to."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from kernels import build, cpu_kernels, quant
from kernels.row_parallel import RowParallelWeight, fold_reference, split_quant
from services.core.config import AUTO_ACTIVATION_QUANT, WorkerConfig
from services.core.errors import InvalidArgument
from services.worker.loader import resolve_activation_quant
from tests.conftest import greedy, make_llm, random_prompts
from tests.kernels.quant_helpers import host_tiers
from tests.kernels.test_quant import make_weight

FORMATS = ["q4_0", "q4_1", "q8_0", "int8"]
DTYPES = [torch.float32, torch.bfloat16]


def _tiers() -> list[str]:
    tiers = host_tiers()
    if "avx512" in tiers:  # the vpmaddubsw path on an AVX-512 CPU, as one without VNNI builds it
        tiers.insert(1, "avx512-novnni")
    return tiers


@pytest.fixture(scope="module")
def libs():
    """Every tier's build (the reference is computed once per case, then each tier is compared)."""
    return {tier: quant.declare(cpu_kernels.tier_library(tier)) for tier in _tiers()}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def _hard_rows(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Activations with the blocks that test the rounding rule: zeros, tiny, huge, exact ties."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 8
    x[0, :min(k, 32)] = 0  # a zero block
    if k >= 64:
        x[0, 32:64] = 1e-38  # below 2^-120: quantized to zeros
    if m > 1 and k >= 32:
        x[1, :32] = torch.arange(32) - 15.5  # amax 16.5: many x * 127 / amax land near halves
        x[1, -1] = 3e4
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(6, 70, 576), (1, 9, 64), (13, 33, 1536)], ids=str)
def test_every_tier_gives_the_references_bits(libs, fmt, dtype, shape):
    m, n, k = shape
    weight, values = make_weight(fmt, n, k, dtype)
    weight = weight.with_activations(True)
    x, bias = _hard_rows(m, k, dtype, seed=n), torch.randn(n).to(dtype)
    want = quant.int8_linear_reference(x, weight, bias).to(dtype)
    for tier, lib in libs.items():
        got = quant.run_kernel(lib, x, weight, bias)
        assert torch.equal(_bits(got), _bits(want)), tier
    exact = x.float() @ values.T + bias.float()  # and it is the product, to int8 activations' error
    assert (got.float() - exact).norm() < 0.03 * exact.norm()


@pytest.mark.parametrize("in_features", [45, 31])
def test_int8_weights_of_any_width(libs, in_features):
    weight, _ = make_weight("int8", 17, in_features, torch.float32)
    weight = weight.with_activations(True)
    x = _hard_rows(3, in_features, torch.float32, seed=in_features)
    want = quant.int8_linear_reference(x, weight, None)
    for tier, lib in libs.items():
        assert torch.equal(quant.run_kernel(lib, x, weight, None), want), tier


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("tier", _tiers())
def test_a_rows_bits_do_not_depend_on_the_batch_or_threads(libs, fmt, tier):
    lib = libs[tier]
    weight, _ = make_weight(fmt, 100, 576, torch.float32, seed=3)
    weight = weight.with_activations(True)
    assert_rows_independent(lib, _hard_rows(11, 576, torch.float32, seed=5), weight)


def assert_rows_independent(lib, x: torch.Tensor, weight) -> None:
    """Each row of x gives the bits it gives in the whole batch: alone on one thread, and in a slice."""
    whole = quant.run_kernel(lib, x, weight, None)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for i in range(x.shape[0]):
            assert torch.equal(quant.run_kernel(lib, x[i:i + 1], weight, None)[0], whole[i])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(quant.run_kernel(lib, x[3:9], weight, None), whole[3:9])


@pytest.mark.parametrize("fmt", FORMATS)
def test_interleaved_rows_give_the_bits_of_rows_in_order(libs, fmt):
    """int8 activations interleave the weight's rows by groups of 16 (quant_dot.c's header): the same
    outputs, bit for bit, on every tier, and the same rows back for the lookup and the fp32 path."""
    weight, _ = make_weight(fmt, 40, 576, torch.float32, seed=7)  # two whole groups, then 8 rows in order
    interleaved = weight.with_activations(True)
    assert interleaved.interleaved and not torch.equal(interleaved.data[:32], weight.data[:32])
    assert torch.equal(interleaved.data[32:], weight.data[32:])
    in_order = replace(weight, int8_activations=True)
    x = _hard_rows(5, 576, torch.float32, seed=2)
    for tier, lib in libs.items():
        assert torch.equal(quant.run_kernel(lib, x, interleaved, None), quant.run_kernel(lib, x, in_order, None)), tier
    ids = torch.tensor([[0, 15, 16], [31, 33, 39]])
    assert torch.equal(interleaved[ids], weight[ids])  # the embedding lookup of a tied lm_head
    assert torch.equal(interleaved.row_data(), weight.data)
    back = interleaved.with_activations(False)
    assert not back.interleaved and torch.equal(back.data, weight.data)


def test_the_rounding_rule():
    x = torch.tensor([[127.0, -63.5, 0.5, -0.5, 1.5, 2.5] + [0.0] * 26, [float("inf")] + [1.0] * 31])
    q, d, total, sx = quant.quantize_activations_reference(x)
    assert q[0, 0, :6].tolist() == [127, -64, 0, 0, 2, 2]  # x * 127 / amax rounded half to even
    assert d[0, 0] == np.float32(1.0) and total[0, 0] == 67 and sx[0, 0] == np.float32(67)
    assert np.isnan(d[1, 0]) and not q[1].any()  # a non-finite block: its outputs are NaN


def test_fma32_rounds_once():
    a, b = np.float32(1 + 2 ** -12), np.float32(1 - 2 ** -12)  # a b = 1 - 2^-24: not an fp32 value
    assert quant.fma32(a, b, np.float32(-1)) == np.float32(-(2 ** -24))  # a * b + c would give 0
    rng = np.random.default_rng(0)
    a, b, c = (rng.standard_normal(10000).astype(np.float32) for _ in range(3))
    want = [float(np.float32(x)) for x in (np.longdouble(a) * b + c)]  # 64-bit mantissa: then one rounding
    assert np.array_equal(quant.fma32(a, b, c), np.array(want, np.float32)) or np.finfo(np.longdouble).nmant < 63


@pytest.mark.parametrize("fmt", ["q4_1", "int8"])
def test_row_parallel_groups_fold_the_groups_chains(fmt):
    weight, _ = make_weight(fmt, 40, 576, torch.float32, seed=9)
    parts = split_quant(weight.with_activations(True), 3)
    rows = _hard_rows(5, 576, torch.float32, seed=2)
    got = RowParallelWeight.build(parts, 3)(rows, None)
    want = fold_reference(torch.stack([quant.int8_linear_reference(rows[:, g * 192:(g + 1) * 192], p, None)
                                       for g, p in enumerate(parts)]), torch.float32)
    assert torch.equal(got, want)


def test_the_setting():
    assert WorkerConfig().activation_quant == "auto"
    with pytest.raises(InvalidArgument, match="activation_quant"):
        WorkerConfig(activation_quant="int4")
    assert resolve_activation_quant("auto", "none") == "none"  # dense weights: nothing to round
    assert AUTO_ACTIVATION_QUANT in ("none", "int8")  # quantized weights' default (docs/guide/models.md, 'Int8 activations')
    assert resolve_activation_quant("auto", "gguf") == AUTO_ACTIVATION_QUANT
    assert resolve_activation_quant("auto", "int8") == AUTO_ACTIVATION_QUANT
    assert resolve_activation_quant("none", "gguf") == "none"  # the old behaviour, asked for
    assert resolve_activation_quant("int8", "gguf") == "int8"
    with pytest.raises(InvalidArgument, match="activation_quant"):
        resolve_activation_quant("int8", "none")


# ---- served models ----------------------------------------------------------------------------
def _run(llm, prompts, params, one_at_a_time=False) -> list:
    from tests.engine.test_batch_invariance import run

    return run(llm, prompts, params, one_at_a_time)


# Every engine tier: the other kernels (attention, norms, rotary, the GEMM) give the same bits on each
# (tests/kernels/test_tier_bits.py), the generic tier's fused multiply-adds by fmaf where the CPU has no
# FMA instruction, so with int8 activations the tokens and logprobs are the same on every tier.
TIERS = list(build.host_tiers())


def _across_tiers(folder, prompts, params, **args) -> list:
    """Each engine tier's outputs (cpu_isa forced)."""
    from tests.conftest import use_tier

    results = []
    for tier in TIERS:
        for _ in use_tier(tier):
            results.append((tier, _run(make_llm(folder, cpu_isa=tier, **args), prompts, params)))
    return results


@pytest.fixture(scope="module")
def gguf_folder(model_dir, tmp_path_factory):
    import shutil

    from tests.kernels.quant_helpers import write_gguf

    folder = tmp_path_factory.mktemp("tiny-gguf-int8act") / "model"
    # head_dim 32: o_proj's and down_proj's K groups (4 of 32 columns) are whole GGUF blocks
    shutil.copytree(model_dir("llama", "tiny", head_dim=32), folder)
    write_gguf(folder, folder / "tiny.Q4_1.gguf")
    return folder


@pytest.fixture(scope="module")
def kquant_file(model_dir, tmp_path_factory):
    """A folder (config, tokenizer) holding a GGUF file as llama-quantize's Q4_0 writes one: Q4_0 layers, a Q6_K
    embedding and output (hidden 256: whole super-blocks)."""
    import shutil

    from tests.kernels.quant_helpers import write_gguf

    folder = tmp_path_factory.mktemp("tiny-kquant") / "model"
    shutil.copytree(model_dir("llama", "tiny", hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                              intermediate_size=512), folder)
    return write_gguf(folder, folder / "tiny.Q4_0.gguf", linear_type="q4_0", embed_type="q6_k",
                      types={"output.weight": "q6_k"})


def test_auto_takes_int8_activations_for_a_file_of_k_quants(gguf_folder, kquant_file):
    """auto: int8 for a GGUF file holding a super-block type (its header alone says), the setting of the rest
    otherwise; a name asked for wins, and dense weights have nothing to round."""
    from services.worker.loader import holds_super_blocks

    assert holds_super_blocks(kquant_file) and not holds_super_blocks(gguf_folder / "tiny.Q4_1.gguf")
    assert resolve_activation_quant("auto", "gguf", kquant_file) == "int8"
    assert resolve_activation_quant("auto", "gguf", gguf_folder / "tiny.Q4_1.gguf") == AUTO_ACTIVATION_QUANT
    assert resolve_activation_quant("none", "gguf", kquant_file) == "none"
    assert resolve_activation_quant("auto", "none", kquant_file) == "none"


def test_a_k_quant_file_is_served_with_int8_activations_by_default(kquant_file):
    """The worker resolves auto from the file it serves (and says so): a K-quant file's default is the tokens
    and logprobs of int8 activations asked for by name, not those of fp32 activations."""
    from structlog.testing import capture_logs

    prompts = random_prompts(3, 512, 4, 40, seed=6)
    params = [greedy(8, logprobs=2) for _ in prompts]
    with capture_logs() as logs, make_llm(kquant_file.parent) as llm:
        assert next(iter(llm.engine.workers.values())).activation_quant == "int8"
        default = _run(llm, prompts, params)
    assert [e["activation_quant"] for e in logs if e["event"] == "worker_ready"] == ["int8"]
    with make_llm(kquant_file.parent, activation_quant="int8") as llm:
        assert _run(llm, prompts, params) == default
    with make_llm(kquant_file.parent, activation_quant="none") as llm:
        assert _run(llm, prompts, params) != default


@pytest.mark.parametrize("quantization", ["gguf", "int8", "none"])
def test_auto_resolves_per_weights_and_the_worker_reports_it(gguf_folder, quantization):
    """activation_quant left at auto: AUTO_ACTIVATION_QUANT for quantized weights, none for dense ones;
    the worker's attribute and its worker_ready log line say which, and it serves the tokens and
    logprobs of that setting asked for by name (and not those of the other one)."""
    from structlog.testing import capture_logs

    want = "none" if quantization == "none" else AUTO_ACTIVATION_QUANT
    prompts = random_prompts(3, 512, 4, 40, seed=5)
    params = [greedy(8, logprobs=2) for _ in prompts]
    with capture_logs() as logs, make_llm(gguf_folder, quantization=quantization) as llm:
        assert next(iter(llm.engine.workers.values())).activation_quant == want
        default = _run(llm, prompts, params)
    assert [e["activation_quant"] for e in logs if e["event"] == "worker_ready"] == [want]
    with make_llm(gguf_folder, quantization=quantization, activation_quant=want) as llm:
        assert _run(llm, prompts, params) == default
    if quantization != "none":
        other = "none" if want == "int8" else "int8"
        with make_llm(gguf_folder, quantization=quantization, activation_quant=other) as llm:
            assert _run(llm, prompts, params) != default  # the other setting, asked for by name, is live


@pytest.mark.slow
@pytest.mark.skipif(len(TIERS) < 2, reason="this CPU runs one tier")
@pytest.mark.parametrize("quantization,dtype", [("gguf", "float32"), ("int8", "bfloat16")], ids=str)
def test_tiny_model_same_tokens_and_logprobs_on_every_tier(gguf_folder, quantization, dtype):
    """Greedy requests and 3 seeded sampled ones: the same tokens and logprobs on every tier, generic included."""
    from services.core.sampling_params import SamplingParams

    prompts = random_prompts(6, 512, 1, 90, seed=11)
    params = [greedy(12, logprobs=3) for _ in prompts[:3]]
    params += [SamplingParams(temperature=0.8, top_p=0.9, seed=seed, max_tokens=12, logprobs=3, ignore_eos=True)
               for seed in (1, 2, 3)]
    args = dict(dtype=dtype, quantization=quantization, activation_quant="int8")
    results = _across_tiers(gguf_folder, prompts, params, **args)
    first_tier, first = results[0]
    for tier, outputs in results[1:]:
        assert outputs == first, f"{tier} differs from {first_tier}"
    tier = build.host_tiers()[0]
    alone = _run(make_llm(gguf_folder, cpu_isa=tier, max_num_batched_tokens=40, **args), prompts, params,
                 one_at_a_time=True)
    assert alone == first  # one at a time, in chunks of 40: the same bits as batched
    fp_activations = _run(make_llm(gguf_folder, **{**args, "activation_quant": "none"}), prompts, params)
    assert fp_activations != first  # the switch is live


@pytest.mark.slow
@pytest.mark.skipif(len(TIERS) < 2, reason="this CPU runs one tier")
def test_default_model_same_tokens_and_logprobs_on_every_tier():
    from services.core.tokenizer import Tokenizer
    from services.tools.default_model import ensure_default_model

    folder = ensure_default_model()
    tokenizer = Tokenizer(folder)
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": c}]))
               for c in ("What is the capital of France?",)]
    params = [greedy(8, logprobs=2) for _ in prompts]
    results = _across_tiers(folder, prompts, params, activation_quant="int8")
    first_tier, first = results[0]
    for tier, outputs in results[1:]:
        assert outputs == first, f"{tier} differs from {first_tier}"
