"""The real default model (SmolLM2-135M-Instruct, fp32 activations) matches transformers token for token."""
from __future__ import annotations

import pytest
import torch

from services.core.sampling_params import SamplingParams
from tests.conftest import make_llm

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "用一句话介绍你自己。",
]


@pytest.fixture(scope="module")
def default_model():
    from services.tools.default_model import ensure_default_model

    return ensure_default_model()


@pytest.mark.slow
def test_chat_greedy_matches_transformers(default_model):
    from transformers import AutoModelForCausalLM

    # fp32 activations: the GGUF's weights are the safetensors' exactly, so this is transformers' arithmetic;
    # the last lines ask the quickstart's question with the default settings (what `up` serves)
    llm = make_llm(default_model, dtype="float32", activation_quant="none")
    prompts = [llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": c}]))
               for c in CHATS]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)[0, len(prompt):].tolist()
        got = out.outputs[0].token_ids
        assert got == want[:len(got)], (llm.tokenizer.decode(got), llm.tokenizer.decode(want))
    assert "Paris" in outs[0].outputs[0].text
    llm.close()
    with make_llm(default_model) as served:
        assert "Paris" in served.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=32),
                                          use_tqdm=False)[0].outputs[0].text
