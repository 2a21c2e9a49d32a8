"""A llama.cpp-style mix served from its GGUF: each tensor its own type (K-quants, the 32-blocks, the
embedding and the output included), fused q/k/v and gate/up of different types (quant.QuantParts), row-
parallel K groups of whole super-blocks. Its greedy tokens are the same model's dequantized to fp32 and
served dense, and a request's tokens and logprobs do not depend on the batch."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from kernels import quant
from kernels.linear import invariant_linear
from kernels.ops import get_ops
from services.worker.loader import gguf_align, load_model
from tests.conftest import greedy, make_llm, random_prompts
from tests.engine.test_batch_invariance import run
from tests.kernels.quant_helpers import write_gguf

# 14 tensors over 2 layers, every served type at least once; o_proj (K 256) and down_proj (K 512) of K-quants
MIX = {
    "blk.0.attn_q.weight": "q4_k", "blk.0.attn_k.weight": "q5_0", "blk.0.attn_v.weight": "q6_k",
    "blk.0.attn_output.weight": "q3_k", "blk.0.ffn_gate.weight": "q2_k", "blk.0.ffn_up.weight": "iq4_xs",
    "blk.0.ffn_down.weight": "q5_k",
    "blk.1.attn_q.weight": "iq4_nl", "blk.1.attn_k.weight": "q5_1", "blk.1.attn_v.weight": "q4_0",
    "blk.1.attn_output.weight": "q4_1", "blk.1.ffn_gate.weight": "q8_0", "blk.1.ffn_up.weight": "q6_k",
    "blk.1.ffn_down.weight": "q4_k",
    "token_embd.weight": "q6_k", "output.weight": "q4_k",
}
SIZE = dict(hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=512, vocab_size=512)


@pytest.fixture(scope="module")
def folders(model_dir, tmp_path_factory):
    """(the mix's folder: config, tokenizer and the GGUF; the same weights dequantized, as safetensors)."""
    from safetensors.torch import save_file

    from services.worker.gguf_weights import read_tensors

    base = model_dir("llama", "tiny", **SIZE)
    mix = tmp_path_factory.mktemp("mix") / "model"
    shutil.copytree(base, mix)
    path = write_gguf(mix, mix / "tiny.mix.gguf", types=MIX)
    (mix / "model.safetensors").unlink()
    dense = tmp_path_factory.mktemp("mix-dense") / "model"
    shutil.copytree(mix, dense)
    (dense / path.name).unlink()
    tensors = {}
    for t in read_tensors(path, SIZE["num_heads"], SIZE["num_kv_heads"]):
        fmt = quant.FORMATS.get(t.type_name.lower())
        data = torch.from_numpy(np.array(t.data))
        tensors[t.hf_name] = (quant.dequantize_rows(data, fmt, t.shape[-1]) if fmt is not None
                              else data.float().reshape(t.shape)).contiguous()
    save_file(tensors, str(dense / "model.safetensors"))
    return mix, dense


def test_the_mix_loads_each_tensor_in_its_type(folders):
    mix, _ = folders
    assert gguf_align("gguf", mix) == (256, 256)  # o_proj and down_proj hold K-quants
    model = load_model(mix, torch.float32, torch.device("cpu"), get_ops("cpu", "cpu"), invariant_linear, "gguf")
    qkv = model.layers[0].attn.qkv_weight
    assert isinstance(qkv, quant.QuantParts) and qkv.format == "q4_k+q5_0+q6_k"
    assert model.layers[1].mlp.gate_up_weight.format == "q8_0+q6_k"
    assert model.embed.format == "q6_k" and model.lm_head.format == "q4_k"
    assert model.stack is not None  # the one-call decoder stack runs the mix


@pytest.mark.slow
def test_greedy_tokens_are_the_dequantized_models_and_batch_invariant(folders):
    mix, dense = folders
    prompts = random_prompts(6, SIZE["vocab_size"], 1, 40, seed=3)
    params = [greedy(12, logprobs=1) for _ in prompts]
    served = make_llm(mix, dtype="float32", quantization="gguf", activation_quant="none")  # fp32: the dequantized bits
    alone = run(served, prompts, params, one_at_a_time=True)
    assert run(served, prompts, params) == alone
    want = run(make_llm(dense, dtype="float32", quantization="none"), prompts, params)
    assert [[ids for ids, _ in out] for out in alone] == [[ids for ids, _ in out] for out in want]


def test_the_layer_by_layer_path_runs_the_mix_with_the_stacks_bits(folders):
    """Where the one-call decoder stack does not run (a mixture of experts, a step with LoRA rows), the
    layers' own forward multiplies the mix's fused q/k/v and gate/up of several types (QuantParts) with
    the same kernels: the same tokens and logprobs (it raised AttributeError on them: a Q4_K_M Qwen3-MoE
    file failed its first step)."""
    mix, _ = folders
    prompts = random_prompts(2, SIZE["vocab_size"], 4, 20, seed=4)
    params = [greedy(6, logprobs=1) for _ in prompts]
    served = make_llm(mix, dtype="float32", quantization="gguf")
    model = served.engine.workers["worker-0"].runner.model
    assert model.stack is not None
    want = run(served, prompts, params)
    model.stack = None
    assert run(served, prompts, params) == want
