"""The mixture-of-experts layer (services/worker/models/moe.py) on the weights each load mode gives its
experts: a step's rows grouped by expert and multiplied slice by slice into one buffer give every token
the bits of its experts' own calls on its row alone, summed in ascending expert id, whatever other
tokens share the step (docs/ARCHITECTURE.md rule 4)."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import make_llm

# 4 experts a token (gpt_oss: its own 4), so that the order of a token's sum matters; folder fp32: gemm.c's packed
# experts; int8 at load with int8 activations: quant_linear on interleaved
# rows; a Q8_0 file with fp32 activations: quant_linear on GGUF blocks; with int8 activations: every
# expert of a step in one call (quant_dot.c's quant_experts_int8), as int8 at load and Q4_0 / Q4_1 / Q5_1 files
GGUF_INT8 = dict(quantization="gguf", activation_quant="int8")
MODES = {"fp32": ({}, None), "int8": (dict(quantization="int8", activation_quant="int8"), None),
         "q8_0": (dict(quantization="gguf", activation_quant="none"), "q8_0"), "q8_0-int8": (GGUF_INT8, "q8_0"),
         "q4_0-int8": (GGUF_INT8, "q4_0"), "q4_1-int8": (GGUF_INT8, "q4_1"), "q5_1-int8": (GGUF_INT8, "q5_1"),
         "gpt_oss-int8": (dict(quantization="int8", activation_quant="int8"), None)}  # biased gate_up: its own calls


@pytest.fixture(scope="module", params=list(MODES))
def moe(request, model_dir, tmp_path_factory):
    from tests.gguf_files import write_gguf

    args, gguf = MODES[request.param]
    arch = request.param.split("-")[0] if "gpt_oss" in request.param else "qwen3_moe"
    folder = model_dir(arch, "tiny", num_layers=1, **({} if arch == "gpt_oss" else {"experts_per_token": 4}))
    path = write_gguf(folder, tmp_path_factory.mktemp("moe") / "moe.gguf", gguf) if gguf else folder
    llm = make_llm(path, num_threads=1, **args)
    return llm.engine.workers["worker-0"].runner.model.layers[0].mlp


def _alone(moe, row: torch.Tensor) -> torch.Tensor:
    """One token: each of its experts' own module on its row, weighted, added in ascending expert id."""
    weights, experts = moe.route(row)
    total = torch.zeros_like(row)
    for slot in experts[0].argsort().tolist():
        total = total + moe.experts[int(experts[0, slot])](row) * weights[0, slot]
    return total


def test_each_token_gets_the_bits_of_its_experts_on_its_row_alone(moe):
    x = torch.randn(16, moe.router_weight.shape[1], generator=torch.Generator().manual_seed(3))
    _, experts = moe.route(x)
    assert int(torch.bincount(experts.reshape(-1)).min()) >= 2  # every expert has rows of several tokens
    got = moe(x)
    want = torch.cat([_alone(moe, x[t:t + 1]) for t in range(x.shape[0])])
    assert torch.equal(got, want)
    assert torch.equal(moe(x[7:8]), got[7:8]) and torch.equal(moe(x[5:13]), got[5:13])


def test_a_step_without_tokens_gives_no_rows(moe):
    assert moe(torch.empty(0, moe.router_weight.shape[1])).shape == (0, moe.router_weight.shape[1])


def test_the_experts_in_one_call_give_the_same_bits_at_every_thread_count(moe):
    x = torch.randn(16, moe.router_weight.shape[1], generator=torch.Generator().manual_seed(5))
    want = moe(x)
    threads = torch.get_num_threads()
    try:
        for count in (2, 3):  # the threads' runs of (expert, outputs) cut elsewhere
            torch.set_num_threads(count)
            assert torch.equal(moe(x), want) and torch.equal(moe(x[2:3]), want[2:3])
    finally:
        torch.set_num_threads(threads)
    if getattr(moe.experts[0].gate_up_weight, "int8_activations", False):  # int8 activations: the one call ran
        biased = getattr(moe.experts[0], "gate_up_bias", None) is not None
        assert (moe._tables.gate_up is None) == biased and moe._tables.down is not None


def _route(lib, logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    experts, weights = torch.empty(logits.shape[0], k, dtype=torch.int64), torch.empty(logits.shape[0], k)
    assert lib.moe_route(logits.data_ptr(), logits.shape[0], logits.shape[1], k, int(normalize), experts.data_ptr(),
                         weights.data_ptr()) == 0
    return weights, experts


@pytest.mark.parametrize("normalize", [False, True])
def test_the_route_is_torchs_choice_with_the_same_bits_on_every_tier(normalize):
    """moe.c's moe_route, which the compiled kernels' every MoE path takes: the experts of torch's softmax and
    top-k (in ascending id), its weights within a few ulps of torch's, the same bits on every tier here; ties go
    to the lower id."""
    from kernels import cpu_kernels
    from kernels.build import testable_tiers

    logits = torch.randn(64, 128, generator=torch.Generator().manual_seed(2)) * 3
    probs = torch.softmax(logits, dim=-1)
    top, chosen = torch.topk(probs, 8, dim=-1)
    if normalize:
        top = top / top.sum(dim=-1, keepdim=True)
    order = chosen.argsort(dim=-1)
    routes = {tier: _route(cpu_kernels.tier_library(tier), logits, 8, normalize) for tier in testable_tiers()}
    weights, experts = next(iter(routes.values()))
    assert torch.equal(experts, chosen.gather(1, order))
    torch.testing.assert_close(weights, top.gather(1, order), rtol=1e-6, atol=0)  # Cephes exp: 2 ulp
    assert all(torch.equal(w, weights) and torch.equal(e, experts) for w, e in routes.values())
    tied = torch.zeros(2, 16)
    tied_weights, tied_experts = _route(cpu_kernels.library(), tied, 4, normalize)
    assert tied_experts.tolist() == [[0, 1, 2, 3]] * 2
    assert tied_weights.tolist() == [[0.25 if normalize else 1 / 16] * 4] * 2
