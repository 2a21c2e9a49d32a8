"""GGUF files for tests, written with the `gguf` package from a make_model folder the way llama.cpp's
convert_hf_to_gguf.py lays them out: its metadata keys, its tensor names, q/k rows permuted for
llama only, the tokenizer as tokenizer.ggml.* (byte-level BPE: tokens, merges, token types, the
pre-tokenizer's name) and the chat template. No test needs llama.cpp."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

CONTROL, NORMAL = 3, 1
LLAMA_CPP_PERMUTES = ("llama",)  # convert_hf_to_gguf.py's LlamaModel.undo_permute; Qwen2Model/Qwen3Model do not
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# config.json's model_type -> general.architecture where they differ
GGUF_ARCH = {"gemma3_text": "gemma3", "qwen3_moe": "qwen3moe", "mixtral": "llama", "gpt_oss": "gpt-oss"}
NORM_SHIFT = ("gemma3",)  # Gemma3Model.norm_shift: llama.cpp's converter stores each norm weight as 1 + w
# o200k as Phi-4-mini's and gpt-oss's tokenizer.json write it (llama.cpp names it gpt-4o)
GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
               r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
               r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# DeepSeek-V3's three splits in turn (its tokenizer.json's Sequence)
DEEPSEEK3_SPLITS = (r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
                    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the split regex (or regexes, applied in turn) of that family's tokenizer.json
STYLES = {"gpt-2": None, "qwen2": QWEN2_SPLIT, "llama-bpe": LLAMA3_SPLIT, "gpt-4o": GPT4O_SPLIT,
          "qwen35": QWEN35_SPLIT, "deepseek-v3": DEEPSEEK3_SPLITS}


def restyle_tokenizer(folder: Path, pre: str) -> None:
    """Give the folder's byte-level tokenizer.json the pre-tokenizer of a qwen2, llama-3, ... tokenizer
    (its split regexes, then the byte mapping), as those models' own tokenizer.json files have it."""
    splits = STYLES[pre]
    if splits is None:
        return
    data = json.loads((folder / "tokenizer.json").read_text())
    data["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        *({"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated", "invert": False}
          for split in ((splits,) if isinstance(splits, str) else splits)),
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}
    if pre == "llama-bpe":
        data["model"]["ignore_merges"] = True
    (folder / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))


def write_gguf(folder: Path, out: Path, tensor_type: str = "f32", pre: str = "gpt-2", arch: str | None = None,
               with_tensors: bool = True, types: dict[str, str] | None = None) -> Path:
    """The folder as one GGUF file. tensor_type: the 2-D weights' type (f32, f16, bf16, q8_0, mixed: q8_0 for
    the linear layers and f16 for the embedding); norms and biases stay f32; `types`: HF name -> type (a
    mixture's stacked experts: model.layers.L.mlp.experts.down_proj.weight; a K-quant as random blocks)."""
    from gguf import GGUFWriter

    config = json.loads((folder / "config.json").read_text())
    arch = arch or GGUF_ARCH.get(config["model_type"], config["model_type"])
    writer = GGUFWriter(str(out), arch)
    _hyperparameters(writer, arch, config)
    _tokenizer(writer, folder, pre)
    if with_tensors:
        _tensors(writer, folder, arch, config, tensor_type, types or {})
    return _finish(writer, out)


def _hyperparameters(writer, arch: str, config: dict) -> None:
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    for key, value in {"context_length": config["max_position_embeddings"], "embedding_length": config["hidden_size"],
                       "feed_forward_length": config["intermediate_size"], "block_count": config["num_hidden_layers"],
                       "attention.head_count": config["num_attention_heads"],
                       "attention.head_count_kv": config["num_key_value_heads"],
                       "attention.key_length": head_dim, "attention.value_length": head_dim,
                       "rope.dimension_count": head_dim, "vocab_size": config["vocab_size"]}.items():
        writer.add_uint32(f"{arch}.{key}", value)
    params = config.get("rope_parameters") or {}
    theta = config.get("rope_theta") or params.get("full_attention", params).get("rope_theta", 10000.0)
    writer.add_float32(f"{arch}.rope.freq_base", theta)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", config["rms_norm_eps"])
    experts = config.get("num_experts") or config.get("num_local_experts")
    if experts:  # TextModel's keys; Qwen2MoeModel's expert width
        writer.add_uint32(f"{arch}.expert_count", experts)
        writer.add_uint32(f"{arch}.expert_used_count", config["num_experts_per_tok"])
        if config.get("moe_intermediate_size"):
            writer.add_uint32(f"{arch}.expert_feed_forward_length", config["moe_intermediate_size"])
    if arch == "gpt-oss":  # GptOssModel's keys (the window, the experts' width); the layer kinds and the
        # SwiGLU constants are not written (llama.cpp's loader assumes gpt-oss's)
        writer.add_uint32(f"{arch}.attention.sliding_window", config["sliding_window"])
        writer.add_uint32(f"{arch}.expert_feed_forward_length", config["intermediate_size"])
    if params.get("rope_type") == "yarn":  # TextModel.set_gguf_parameters (no truncate key)
        writer.add_string(f"{arch}.rope.scaling.type", "yarn")
        writer.add_float32(f"{arch}.rope.scaling.factor", params["factor"])
        writer.add_uint32(f"{arch}.rope.scaling.original_context_length", params["original_max_position_embeddings"])
        writer.add_float32(f"{arch}.rope.scaling.yarn_beta_fast", params["beta_fast"])
        writer.add_float32(f"{arch}.rope.scaling.yarn_beta_slow", params["beta_slow"])
    if arch == "phi3":  # Phi3MiniModel's keys: the rotary dims, the pre-training context, the window
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        writer.add_uint32(f"{arch}.rope.dimension_count",
                          int(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
                              * config["hidden_size"]) // config["num_attention_heads"])
        writer.add_uint32(f"{arch}.rope.scaling.original_context_length", rope["original_max_position_embeddings"])
        writer.add_uint32(f"{arch}.attention.sliding_window", config.get("sliding_window") or 0)
        import math

        scale = config["max_position_embeddings"] / rope["original_max_position_embeddings"]
        writer.add_float32(f"{arch}.rope.scaling.attn_factor", math.sqrt(
            1 + math.log(scale) / math.log(rope["original_max_position_embeddings"])) if scale > 1 else 1.0)
    if arch == "gemma3":  # Gemma3Model and TextModel's keys; the layer kinds as a flag per layer, which
        # llama.cpp reads (its converter leaves the pattern to the loader's default, every 6th layer global)
        writer.add_uint32(f"{arch}.attention.sliding_window", config["sliding_window"])
        writer.add_array(f"{arch}.attention.sliding_window_pattern",
                         [kind == "sliding_attention" for kind in config["layer_types"]])
        writer.add_float32(f"{arch}.rope.freq_base_swa", params["sliding_attention"]["rope_theta"])
        if config.get("final_logit_softcapping"):
            writer.add_float32(f"{arch}.final_logit_softcapping", config["final_logit_softcapping"])


def _tokenizer(writer, folder: Path, pre: str) -> None:
    data = json.loads((folder / "tokenizer.json").read_text())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    vocab = data["model"]["vocab"]
    tokens = [None] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    special = {t["content"] for t in data["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_string("tokenizer.ggml.pre", pre)
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.token_type", [CONTROL if t in special else NORMAL for t in tokens])
    writer.add_array("tokenizer.ggml.merges", merges)
    writer.add_uint32("tokenizer.ggml.bos_token_id", vocab[config["bos_token"]])
    writer.add_uint32("tokenizer.ggml.eos_token_id", vocab[config["eos_token"]])
    writer.add_bool("tokenizer.ggml.add_bos_token", False)
    writer.add_string("tokenizer.chat_template", config["chat_template"])


def _tensors(writer, folder: Path, arch: str, config: dict, tensor_type: str, types: dict[str, str]) -> None:
    from safetensors.torch import load_file  # (numpy has no bfloat16: a bfloat16 folder's values as float32)

    from services.worker.gguf_arch import ARCHITECTURES, GLOBAL_NAMES, LAYER_NAMES

    to_gguf = {hf: name for name, hf in {**GLOBAL_NAMES, **LAYER_NAMES, **ARCHITECTURES[arch].layer_names}.items()}
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update({name: t.float().numpy() for name, t in load_file(str(file)).items()})
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if scaling.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_rope_factors(config, scaling))
    if scaling.get("rope_type") == "longrope":  # Phi3MiniModel.generate_extra_tensors
        writer.add_tensor("rope_factors_long.weight", np.array(scaling["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(scaling["short_factor"], dtype=np.float32))
    if arch == "gpt-oss":
        _gpt_oss_names(tensors)
    for hf in [name for name in tensors if name.endswith(".mlp.experts.gate_up_proj")]:  # [E, 2I, H]
        gate, up = np.split(tensors.pop(hf), 2, axis=1)  # stacked per layer as llama.cpp stores experts
        tensors[hf.replace("gate_up_proj", "gate_proj.weight")], tensors[hf.replace("gate_up_proj", "up_proj.weight")] \
            = gate, up
    for hf in [name for name in tensors if name.endswith(".mlp.experts.down_proj")]:  # [E, H, I]
        tensors[hf + ".weight"] = tensors.pop(hf)
    for hf, array in sorted(tensors.items()):
        array = array.astype(np.float32)
        if hf.startswith("model.layers."):
            _, _, layer, rest = hf.split(".", 3)
            name = f"blk.{layer}.{to_gguf[rest]}"
        else:
            name = to_gguf[hf]
        if arch in LLAMA_CPP_PERMUTES and ("q_proj" in hf or "k_proj" in hf):
            n = heads if "q_proj" in hf else kv_heads  # llama.cpp's permute: interleaved rotary pairs
            array = array.reshape(n, 2, array.shape[0] // n // 2, *array.shape[1:]).swapaxes(1, 2).reshape(array.shape)
        if arch in NORM_SHIFT and hf.endswith("norm.weight"):
            array = array + np.float32(1.0)
        kind = "f32" if array.ndim == 1 or hf.endswith(("mlp.gate.weight", "mlp.router.weight", ".bias")) \
            else tensor_type  # the router and the biases (gpt-oss's experts' [E, out]): F32
        if kind == "mixed":
            kind = "f16" if hf == "model.embed_tokens.weight" else "q8_0"
        kind = types.get(hf, kind)
        _add_tensor(writer, name, array, kind)


def _finish(writer, out: Path) -> Path:
    """The file written: header, metadata, tensors."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _add_tensor(writer, name: str, array: np.ndarray, kind: str) -> None:
    """One float32 tensor written as `kind` (f32, f16, bf16, what gguf.quants writes, or a K-quant)."""
    from gguf import GGMLQuantizationType, quants

    if kind == "f32":
        writer.add_tensor(name, array)
    elif kind == "f16":
        writer.add_tensor(name, array.astype(np.float16))
    elif kind == "bf16":  # the top 16 bits of each float32 (exact for a bfloat16 folder's values)
        halves = (array.view(np.uint32) >> 16).astype(np.uint16)
        writer.add_tensor(name, halves.view(np.uint8).reshape(*array.shape[:-1], -1),
                          raw_dtype=GGMLQuantizationType.BF16)
    elif kind in ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "mxfp4"):  # what gguf.quants writes
        qtype = GGMLQuantizationType[kind.upper()]
        writer.add_tensor(name, quants.quantize(array, qtype), raw_dtype=qtype)
    else:  # a K-quant: valid random blocks of the tensor's spread (not its values), rows as they are
        from tests.kernels.quant_helpers import random_blocks

        rows = random_blocks(kind, int(np.prod(array.shape[:-1])), array.shape[-1], np.random.default_rng(0),
                             scale=float(array.std()))
        writer.add_tensor(name, rows.reshape(*array.shape[:-1], -1), raw_dtype=GGMLQuantizationType[kind.upper()])


def _gpt_oss_names(tensors: dict) -> None:
    """gpt-oss's tensors as GptOssModel.modify_tensors names them: its stacked input-major experts ([E, H, 2I]
    gate and up interleaved by column, [E, I, H] down) as [E, out, in] gate, up and down, their biases
    [E, 2I] de-interleaved the same way; the sinks and the router's weight and bias kept."""
    for hf in [name for name in tensors if ".mlp.experts." in name]:
        array, base = tensors.pop(hf), hf.rsplit(".", 1)[0] + "."
        if hf.endswith("gate_up_proj_bias"):
            tensors[base + "gate_proj.bias"], tensors[base + "up_proj.bias"] = array[:, ::2], array[:, 1::2]
        elif hf.endswith("down_proj_bias"):
            tensors[base + "down_proj.bias"] = array
        elif hf.endswith("gate_up_proj"):
            tensors[base + "gate_proj.weight"] = np.ascontiguousarray(array[:, :, ::2].transpose(0, 2, 1))
            tensors[base + "up_proj.weight"] = np.ascontiguousarray(array[:, :, 1::2].transpose(0, 2, 1))
        else:
            tensors[base + "down_proj.weight"] = np.ascontiguousarray(array.transpose(0, 2, 1))


def mxfp4_values(array: np.ndarray) -> np.ndarray:
    """The values MXFP4 holds for `array` (rows of blocks of 32 along the last axis): gguf.quants' round trip."""
    from gguf import GGMLQuantizationType, quants

    return quants.dequantize(quants.quantize(array.astype(np.float32), GGMLQuantizationType.MXFP4),
                             GGMLQuantizationType.MXFP4)


def _llama3_rope_factors(config: dict, scaling: dict) -> np.ndarray:
    """What llama.cpp's converter stores for Llama 3's rope scaling: per frequency, the divisor of the
    inverse frequency (1 for short wavelengths, `factor` for long ones, blended between)."""
    import math

    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    theta = config.get("rope_theta") or scaling.get("rope_theta", 10000.0)
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old_len / high:
            factors.append(1.0)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def write_sentencepiece_gguf(out: Path, vocab_size: int = 2000) -> Path:
    """A GGUF carrying only a SentencePiece-BPE tokenizer (tokenizer.ggml.model "llama", as Llama 2 and
    Mistral files have): trained here on make_tokenizer's corpus with byte fallback; scores -id (the
    merge order, as SentencePiece's BPE scores are), <unk> UNKNOWN, <s> </s> CONTROL, <0xNN> BYTE."""
    from gguf import GGUFWriter
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from services.tools.make_tokenizer import CORPUS_PATH

    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False)
    tokenizer.train_from_iterator(CORPUS_PATH.read_text(encoding="utf-8").splitlines(), trainer)
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    types = [2 if t == "<unk>" else 3 if t in ("<s>", "</s>") else 6 if t.startswith("<0x") else NORMAL
             for t in tokens]
    writer = GGUFWriter(str(out), "llama")
    writer.add_string("tokenizer.ggml.model", "llama")
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.scores", [0.0 if kind != NORMAL else -float(i) for i, kind in enumerate(types)])
    writer.add_array("tokenizer.ggml.token_type", types)
    writer.add_uint32("tokenizer.ggml.unknown_token_id", 0)
    writer.add_uint32("tokenizer.ggml.bos_token_id", 1)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    return _finish(writer, out)


# llama.cpp's names for a BERT file's tensors (gguf-py's constants: MODEL_ARCH.BERT), spelled out here
# rather than taken from services/worker/gguf_arch.py, so the test checks that map
BERT_TOP = {"embeddings.word_embeddings.weight": "token_embd.weight",
            "embeddings.position_embeddings.weight": "position_embd.weight",
            "embeddings.token_type_embeddings.weight": "token_types.weight",
            "embeddings.LayerNorm.weight": "token_embd_norm.weight", "embeddings.LayerNorm.bias": "token_embd_norm.bias"}
BERT_LAYER = {"attention.self.query": "attn_q", "attention.self.key": "attn_k", "attention.self.value": "attn_v",
              "attention.output.dense": "attn_output", "attention.output.LayerNorm": "attn_output_norm",
              "intermediate.dense": "ffn_up", "output.dense": "ffn_down", "output.LayerNorm": "layer_output_norm"}
BERT_POOLING = {"mean": 1, "cls": 2}  # bert.pooling_type


def write_bert_gguf(folder: Path, out: Path, tensor_type: str = "f32", pooling: str | None = "mean") -> Path:
    """A make_model `bert_wordpiece` folder as convert_hf_to_gguf.py's BertModel writes it: its keys
    (bert.*, the pooling type, the token types' count), the WordPiece vocabulary in its phantom-space
    spelling ("\u2581" before a word's first piece, "##" dropped, control tokens as they are), the special
    tokens' ids, and the tensors under llama.cpp's names: the 2-D weights in `tensor_type` (f32, f16, q8_0;
    the position and token-type embeddings stay f32, as the converter keeps them), norms and biases f32."""
    from gguf import GGUFWriter
    from safetensors.numpy import load_file

    config = json.loads((folder / "config.json").read_text())
    writer = GGUFWriter(str(out), "bert")
    for key, value in {"block_count": config["num_hidden_layers"], "context_length": config["max_position_embeddings"],
                       "embedding_length": config["hidden_size"], "feed_forward_length": config["intermediate_size"],
                       "attention.head_count": config["num_attention_heads"]}.items():
        writer.add_uint32(f"bert.{key}", value)
    writer.add_float32("bert.attention.layer_norm_epsilon", config["layer_norm_eps"])
    writer.add_bool("bert.attention.causal", False)
    if pooling is not None:
        writer.add_uint32("bert.pooling_type", BERT_POOLING[pooling])
    _wordpiece_vocab(writer, folder, config["type_vocab_size"])
    for hf, array in sorted(load_file(str(folder / "model.safetensors")).items()):
        if hf.startswith("pooler."):
            continue  # the converter drops the pooler of an embedding model
        if hf.startswith("encoder.layer."):
            _, _, layer, rest = hf.split(".", 3)
            module, param = rest.rsplit(".", 1)
            name = f"blk.{layer}.{BERT_LAYER[module]}.{param}"
        else:
            name = BERT_TOP[hf]
        kind = "f32" if array.ndim == 1 or name in ("position_embd.weight", "token_types.weight") else tensor_type
        _add_tensor(writer, name, array.astype(np.float32), kind)
    return _finish(writer, out)


def _wordpiece_vocab(writer, folder: Path, type_vocab_size: int) -> None:
    data = json.loads((folder / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in data["added_tokens"] if t["special"]}
    types = [CONTROL if t in special else NORMAL for t in tokens]
    writer.add_uint32("tokenizer.ggml.token_type_count", type_vocab_size)
    writer.add_string("tokenizer.ggml.model", "bert")
    writer.add_string("tokenizer.ggml.pre", "gpt-2")  # what the converter names a vocabulary it does not know
    writer.add_array("tokenizer.ggml.tokens", [t if kind == CONTROL else t[2:] if t.startswith("##") else "\u2581" + t
                                               for t, kind in zip(tokens, types)])
    writer.add_array("tokenizer.ggml.token_type", types)
    for key, token in (("bos", "[CLS]"), ("eos", "[SEP]"), ("unknown", "[UNK]"), ("seperator", "[SEP]"),
                       ("padding", "[PAD]"), ("mask", "[MASK]")):
        writer.add_uint32(f"tokenizer.ggml.{key}_token_id", vocab[token])
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_bool("tokenizer.ggml.add_eos_token", True)
    writer.add_bool("tokenizer.ggml.normalizer.lowercase", True)
