"""Models served from quantized weights: a GGUF's blocks as the file has them, int8 made at load.
The loader is checked against the dequantized weights, and the batch-invariance cases run on
both quantized paths (same tokens and logprobs alone, batched, preempted, chunked)."""
from __future__ import annotations

import shutil

import pytest
import torch

from kernels.linear import invariant_linear
from kernels.ops import get_ops
from kernels.row_parallel import RowParallelWeight
from kernels.quant import QuantWeight
from services.core.errors import InvalidArgument
from services.worker.loader import load_model, resolve_quantization
from tests.conftest import greedy, make_llm, random_prompts
from tests.engine.test_batch_invariance import run
from tests.kernels.quant_helpers import write_gguf

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def gguf_folder(model_dir, tmp_path_factory):
    """The tiny model's folder with a Q4_1 GGUF (Q8_0 embedding) beside its safetensors."""
    folder = tmp_path_factory.mktemp("tiny-gguf") / "model"
    shutil.copytree(model_dir("llama", "tiny"), folder)
    write_gguf(folder, folder / "tiny.Q4_1.gguf")
    return folder


def _dequantized_twin(model):
    """The same model with every QuantWeight replaced by its dense fp32 values."""
    for module in model.modules():
        for name, value in list(vars(module).items()):
            if isinstance(value, QuantWeight):
                setattr(module, name, value.dequantize())
    return model


def _forward(model, tokens):
    from services.worker.models.llama import AttentionMetadata

    num = len(tokens)
    cfg = model.cfg
    caches = [(torch.zeros(4, 16, cfg.num_kv_heads, cfg.head_dim), torch.zeros(4, 16, cfg.num_kv_heads, cfg.head_dim))
              for _ in range(cfg.num_layers)]
    meta = AttentionMetadata(positions=torch.arange(num), slot_mapping=torch.arange(num),
                             block_tables=torch.tensor([[0, 1, 2, 3]]), seq_lens=torch.tensor([num]),
                             query_start_loc=torch.tensor([0, num]))
    hidden = model(torch.tensor(tokens), caches, meta)
    return model.compute_logits(hidden)


def test_auto_serves_the_folders_gguf(gguf_folder, model_dir):
    assert resolve_quantization("auto", gguf_folder) == "gguf"
    assert resolve_quantization("auto", model_dir("llama", "tiny")) == "none"
    with pytest.raises(InvalidArgument, match="quantization"):
        resolve_quantization("gguf", model_dir("llama", "tiny"))


def test_gguf_blocks_are_kept_and_give_the_dequantized_models_logits(gguf_folder):
    ops = get_ops("cpu", "cpu")
    model = load_model(gguf_folder, torch.float32, CPU, ops, invariant_linear, "gguf")
    qkv = model.layers[0].attn.qkv_weight
    assert isinstance(qkv, QuantWeight) and qkv.format == "q4_1" and qkv.shape == (64 + 2 * 32, 64)
    assert isinstance(model.embed, QuantWeight) and model.embed.format == "q8_0"
    if model.cfg.tie_word_embeddings:  # the lm_head multiplies by the file's Q8_0 embedding
        assert model.lm_head is model.embed
    else:  # output.weight, as the file has it
        assert isinstance(model.lm_head, QuantWeight) and model.lm_head.format == "q4_1"
    assert model.stack is not None  # the one-call decoder stack runs the quantized weights
    tokens = [5, 17, 300, 2, 99, 41]
    got = _forward(model, tokens)
    want = _forward(_dequantized_twin(load_model(gguf_folder, torch.float32, CPU, get_ops("torch", "cpu"),
                                                 invariant_linear, "gguf")), tokens)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_int8_is_close_to_the_checkpoint(model_dir):
    folder = model_dir("llama", "tiny")
    ops = get_ops("cpu", "cpu")
    quantized = load_model(folder, torch.float32, CPU, ops, invariant_linear, "int8")
    down = quantized.layers[1].mlp.down_weight  # row-parallel: int8 per output channel and K group
    assert isinstance(down, RowParallelWeight) and all(isinstance(p, QuantWeight) for p in down.parts)
    assert isinstance(quantized.lm_head, QuantWeight)  # streamed once per step: quantized too
    assert not isinstance(quantized.embed, QuantWeight)  # the lookup keeps the checkpoint's dtype
    dense = load_model(folder, torch.float32, CPU, ops, invariant_linear, "none")
    tokens = [7, 8, 9, 100, 250]
    got, want = _forward(quantized, tokens), _forward(dense, tokens)
    assert (got - want).abs().max() < 0.05 * want.abs().max()


def test_a_gguf_tensor_type_that_is_not_served_is_named(gguf_folder, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(gguf_folder, folder)
    (folder / "tiny.Q4_1.gguf").unlink()
    write_gguf(folder, folder / "tiny.f16.gguf", linear_type="f16", types={"token_embd.weight": "q8_1"})
    with pytest.raises(InvalidArgument, match="embed_tokens.*Q8_1.*Q4_K"):
        load_model(folder, torch.float32, CPU, get_ops("cpu", "cpu"), invariant_linear, "gguf")


@pytest.mark.slow
@pytest.mark.parametrize("activation_quant", ["none", "int8"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("quantization", ["gguf", "int8"])
def test_quantized_paths_are_batch_invariant(gguf_folder, quantization, dtype, activation_quant):
    prompts = random_prompts(12, 512, 1, 120, seed=7)
    params = [greedy(16, logprobs=2) for _ in prompts]
    args = dict(dtype=dtype, quantization=quantization, activation_quant=activation_quant)
    alone = run(make_llm(gguf_folder, **args), prompts, params, one_at_a_time=True)
    assert run(make_llm(gguf_folder, **args), prompts, params) == alone
    chunked = make_llm(gguf_folder, max_num_batched_tokens=40, **args)
    assert run(chunked, prompts, params) == alone
    preempted = make_llm(gguf_folder, num_gpu_blocks=24, preemption_mode="swap", **args)
    assert run(preempted, prompts, params) == alone
    assert preempted.scheduler.num_preemptions > 0
