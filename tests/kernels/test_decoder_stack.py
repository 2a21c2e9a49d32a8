"""The one-call decoder stack (kernels/csrc/decoder.c) gives the layer-by-layer path's bits."""
from __future__ import annotations

import pytest
import torch

from kernels import cpu_kernels
from kernels.decoder import DecoderStack
from kernels.linear import prepack
from kernels.build import host_tiers
from tests.conftest import greedy, make_llm, random_prompts, use_tier

pytestmark = pytest.mark.skipif(not cpu_kernels.is_available(), reason="needs the compiled kernels (a C compiler)")


def _models(llm):
    return [worker.runner.model for worker in llm.engine.workers.values()]


def _outputs(llm, prompts, params):
    return [[(o.token_ids, o.logprobs) for o in out.outputs] for out in llm.generate(prompts, params, use_tqdm=False)]


def _arch_tier_cases() -> list:
    """llama on every tier the engine can take here; qwen2 (q/k/v bias) and qwen3 (per-head q/k norm) on the
    first only: decoder.c has no tier-specific code, it passes the bias and the norm weights to the kernels
    the layer-by-layer path calls (each tier's own: test_cpu_rowwise.py), so another tier adds no case."""
    tiers = host_tiers()
    return [pytest.param((arch, tier), id=f"{tier}-{arch}") for tier in tiers
            for arch in (("llama", "qwen2", "qwen3") if tier == tiers[0] else ("llama",))]


@pytest.fixture(params=_arch_tier_cases())
def arch_tier(request):
    arch, tier = request.param
    for active in use_tier(tier):
        yield arch, active


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_same_tokens_and_logprobs_as_layer_by_layer(model_dir, arch_tier, dtype):
    arch, engine_tier = arch_tier
    folder = model_dir(arch, "tiny", dtype=dtype)
    prompts = random_prompts(10, 512, 1, 150, seed=7)
    params = greedy(10, logprobs=2)
    # chunked prefill: steps that mix prompt chunks with decode tokens
    engine_args = dict(dtype=dtype, max_num_batched_tokens=64, enable_chunked_prefill=True, cpu_isa=engine_tier)
    fused = make_llm(folder, **engine_args)
    layered = make_llm(folder, **engine_args)
    assert all(m.stack is not None for m in _models(fused))
    for model in _models(layered):
        model.stack = None
    assert _outputs(fused, prompts, params) == _outputs(layered, prompts, params)


def test_not_taken_where_it_cannot_run(model_dir):
    """The torch reference ops have no stack; a stack refuses weights not packed for the own GEMM."""
    llm = make_llm(model_dir("llama", "tiny"), kernel_backend="torch")
    assert all(m.stack is None for m in _models(llm))
    model = _models(make_llm(model_dir("llama", "tiny")))[0]
    layers = model.stack.layers
    for other in (prepack(torch.zeros(8, 8), library="dense"), prepack(torch.zeros(8, 8), library="gemm")):
        changed = [type(layer)(**{**layer.__dict__, "o": other}) for layer in layers]  # not packed; wrong shape
        assert DecoderStack.build(changed, model.final_norm.data, model.rotary_cache, model.stack.shape) is None
    for name in ("qkv", "o", "gate_up", "down"):  # dense weights of the right shape: no stack, and no crash
        weight = getattr(layers[0], name)
        dense = prepack(torch.zeros(tuple(weight.shape), dtype=weight.dtype), library="dense")
        changed = [type(layers[0])(**{**layers[0].__dict__, name: dense})] + list(layers[1:])
        assert DecoderStack.build(changed, model.final_norm.data, model.rotary_cache, model.stack.shape) is None
    assert DecoderStack.build(layers, model.final_norm.data, model.rotary_cache, model.stack.shape) is not None


def test_kv_caches_must_match_the_layers(model_dir):
    llm = make_llm(model_dir("llama", "tiny"))
    model, runner = _models(llm)[0], next(iter(llm.engine.workers.values())).runner
    x = torch.zeros(1, model.cfg.hidden_size)
    ints = [torch.zeros(1, dtype=torch.int64)] * 2
    with pytest.raises(ValueError, match="KV caches"):
        model.stack(x, runner.kv_cache.layers[:-1], *ints, torch.zeros(1, 1, dtype=torch.int64), *ints)
    assert not model.stack.runs(x.to(torch.bfloat16), runner.kv_cache.layers)  # another dtype: layer by layer


def test_other_caches_after_a_step_are_checked_and_described_anew(model_dir):
    """After the first step the stack trusts the caches it described by the pairs' identity: a list
    with another pair in it is checked again, and new caches get their own descriptors."""
    llm = make_llm(model_dir("llama", "tiny"))
    llm.generate(random_prompts(1, 512, 5, 6, seed=1), greedy(1), use_tqdm=False)
    model, runner = _models(llm)[0], next(iter(llm.engine.workers.values())).runner
    caches = runner.kv_cache.layers
    x = torch.randn(1, model.cfg.hidden_size)
    assert model.stack.runs(x, caches)
    swapped = list(caches)
    swapped[-1] = (caches[-1][0].to(torch.bfloat16), caches[-1][1])
    assert not model.stack.runs(x, swapped)
    fresh = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in caches]
    before = [k.clone() for k, _ in caches]
    zero, table = torch.zeros(1, dtype=torch.int64), torch.zeros(1, 1, dtype=torch.int64)
    assert model.stack.runs(x, fresh)
    model.stack(x, fresh, zero, zero, table, zero, zero)
    assert all(k[0, 0].abs().sum() > 0 for k, _ in fresh), "the K rows went elsewhere"
    assert all(torch.equal(k, old) for (k, _), old in zip(caches, before)), "the worker's caches were written"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_mixture_of_experts_gives_the_same_bits_in_one_call_layer_by_layer_and_expert_by_expert(model_dir, dtype):
    """Qwen3-MoE with int8 experts: decoder.c runs each layer's experts through moe.c's moe_forward, the
    layer-by-layer path calls moe_forward itself, and moe.py's own path (each step's route by moe_route, the
    experts' calls, the sum in torch) is what a worker group's tensor ranks run: the three give the same bits."""
    folder = model_dir("qwen3_moe", "tiny", dtype=dtype, experts_per_token=4)  # 4 a token: the sum's order matters
    prompts = random_prompts(6, 512, 1, 80, seed=11)
    params = greedy(8, logprobs=2)
    engine_args = dict(dtype=dtype, quantization="int8", activation_quant="int8", max_num_batched_tokens=64,
                       enable_chunked_prefill=True)
    fused, layered, expert_by_expert = (make_llm(folder, **engine_args) for _ in range(3))
    assert all(m.stack is not None for m in _models(fused))
    for model in _models(layered) + _models(expert_by_expert):
        model.stack = None
    for model in _models(expert_by_expert):
        for layer in model.layers:
            assert layer.mlp.descriptor() is not None
            layer.mlp._one_call = False  # moe.py's own path from here on
    want = _outputs(fused, prompts, params)
    assert _outputs(layered, prompts, params) == want
    assert _outputs(expert_by_expert, prompts, params) == want


def test_a_mixture_without_int8_experts_goes_layer_by_layer(model_dir):
    """fp32 experts have no quant_experts_int8 tables: moe_forward does not take them, nor the stack."""
    llm = make_llm(model_dir("qwen3_moe", "tiny"))
    assert all(m.stack is None and m.layers[0].mlp.descriptor() is None for m in _models(llm))
