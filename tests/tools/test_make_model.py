"""The random-model maker: HF-loadable folders, byte-identical rebuilds, a real tokenizer."""
import hashlib
import json

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.tools import make_tokenizer
from services.tools.make_model import main, make_model, num_parameters

ARCHS = ["llama", "qwen2", "qwen3", "gemma3", "phi3", "qwen3_moe", "mixtral"]
MODEL_TYPES = {"gemma3": "gemma3_text"}  # transformers' model_type where it is not the arch's name
PROMPTS = ["Hello, how are you?", "The old lighthouse", "def fibonacci(n):", "今天天气很好", "1 2 3 4 5"]


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {arch: make_model(root / arch, arch=arch, size="tiny", seed=0) for arch in ARCHS}


def _file_hashes(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_loads_every_weight_and_runs_a_forward(tiny_models, arch):
    model, info = AutoModelForCausalLM.from_pretrained(
        tiny_models[arch], dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    assert model.config.model_type == MODEL_TYPES.get(arch, arch)
    ids = AutoTokenizer.from_pretrained(tiny_models[arch])(PROMPTS[0], return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 512)
    assert 1.0 < logits.std().item() < 5.0  # spread of a few units, as designed


def test_greedy_decoding_differs_between_prompts(tiny_models):
    folder = tiny_models["llama"]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    continuations, gaps = set(), []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=2,
                                 output_scores=True, return_dict_in_generate=True)
        continuations.add(tuple(out.sequences[0, ids.shape[1]:].tolist()))
        gaps += [(s[0].topk(2).values[0] - s[0].topk(2).values[1]).item() for s in out.scores]
    assert len(continuations) == len(PROMPTS)
    assert torch.tensor(gaps).median() > 0.2  # near-ties of the top two logits are rare


def test_same_arguments_give_identical_bytes(tmp_path):
    kwargs = dict(arch="qwen3", size="small", seed=7, tie_word_embeddings=True, rope_scaling_llama3=True)
    first = _file_hashes(make_model(tmp_path / "a", **kwargs))
    make_tokenizer.tokenizer_json.cache_clear()  # train the tokenizer again too
    second = _file_hashes(make_model(tmp_path / "b", **kwargs))
    assert first == second
    assert set(first) == {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                          "tokenizer_config.json", "special_tokens_map.json"}
    other_seed = _file_hashes(make_model(tmp_path / "c", **{**kwargs, "seed": 8}))
    assert other_seed["model.safetensors"] != first["model.safetensors"]
    assert other_seed["tokenizer.json"] == first["tokenizer.json"]


def test_tokenizer_round_trips_utf8_and_knows_chatml_tokens(tiny_models):
    folder = tiny_models["qwen2"]
    text = "Hello 世界 🌍 café"
    hf = AutoTokenizer.from_pretrained(folder)
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert hf.decode(hf(text).input_ids) == text
    assert raw.decode(raw.encode(text).ids) == text
    assert raw.encode(text).ids == hf(text).input_ids
    assert [raw.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    assert (hf.eos_token, hf.eos_token_id, hf.bos_token_id) == ("<|im_end|>", 2, 1)
    assert len(hf) == raw.get_vocab_size() == json.loads((folder / "config.json").read_text())["vocab_size"]
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == [2, 0]


def test_chat_template_renders_chatml(tiny_models):
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["llama"])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 世界"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                        "<|im_start|>user\nHi 世界<|im_end|>\n<|im_start|>assistant\n")
    plain = tokenizer.apply_chat_template(messages, tokenize=False)
    assert plain.endswith("<|im_end|>\n")
    ids = tokenizer(rendered, add_special_tokens=False).input_ids
    assert ids[0] == 1 and ids.count(2) == 2  # special tokens are single ids


def test_cli_writes_the_overridden_model(tmp_path, capsys):
    out = tmp_path / "cli"
    main(["--arch", "qwen2", "--size", "tiny", "--seed", "3", "--dtype", "bfloat16", "--hidden-size", "32",
          "--num-layers", "1", "--vocab-size", "300", "--tie-word-embeddings", "--rope-scaling-llama3",
          "--out", str(out)])
    assert "parameters" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (32, 1, 300)
    assert config["tie_word_embeddings"] and config["torch_dtype"] == "bfloat16"
    assert config["rope_scaling"]["rope_type"] == "llama3"
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16 and "lm_head.weight" not in _safetensors_names(out)


def _safetensors_names(folder):
    raw = (folder / "model.safetensors").read_bytes()
    return set(json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])) - {"__metadata__"}


def test_preset_sizes():
    assert num_parameters("llama", "1b") == 1_038_682_112  # Llama-3.2-1B with a 32000 vocab
    assert 90e6 < num_parameters("llama", "bench") < 110e6
    with pytest.raises(TypeError):
        make_model("/nonexistent", unknown_setting=1)
