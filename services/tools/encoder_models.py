"""Random-weight encoders (BERT) for tests and benchmarks, written by services/tools/make_model.py.

    bert             transformers' BertModel with sentence-transformers' layout beside it
                     (modules.json, 1_Pooling mean pooling, Normalize): an embedding model as BGE/E5 ship
    bert_classifier  BertForSequenceClassification with one label: a cross-encoder as bge-reranker ships

The config.json is transformers' BertConfig's, the tensor names and shapes those of the model it
makes (on the meta device). The tokenizer is make_tokenizer's, with a post-processor that adds
<|im_start|> as [CLS] and <|im_end|> as [SEP] around a text or a pair (the pair's second text of
token type 1), as BERT's does.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from services.tools.make_tokenizer import BOS_ID, EOS_ID, IM_END, IM_START
from services.tools.random_weights import NORM_NOISE, QK_GAIN, ParamSpec

ENCODERS = {"bert": "BertModel", "bert_classifier": "BertForSequenceClassification"}
BIAS_STD = 0.02
MAX_POSITIONS = 512


def encoder_config(arch: str, s: dict) -> dict:
    import transformers

    config = transformers.BertConfig(
        hidden_size=s["hidden_size"], intermediate_size=s["intermediate_size"], num_hidden_layers=s["num_layers"],
        num_attention_heads=s["num_heads"], vocab_size=s["vocab_size"],
        max_position_embeddings=min(MAX_POSITIONS, s["max_position_embeddings"]), type_vocab_size=2,
        layer_norm_eps=1e-12, pad_token_id=EOS_ID, num_labels=1).to_dict()
    for key in ("transformers_version", "_name_or_path", "output_attentions", "output_hidden_states", "return_dict"):
        config.pop(key, None)
    if arch == "bert":
        config.pop("id2label", None)
        config.pop("label2id", None)
    config.update(architectures=[ENCODERS[arch]], torch_dtype=s["dtype"], dtype=s["dtype"])
    return config


def encoder_param_specs(config: dict) -> list[ParamSpec]:
    import torch
    import transformers

    cfg = transformers.BertConfig(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    cls = getattr(transformers, config["architectures"][0])
    with torch.device("meta"):
        model = cls(cfg)
    return [_spec(name, tuple(p.shape)) for name, p in model.named_parameters()]


def _spec(name: str, shape: tuple[int, ...]) -> ParamSpec:
    if "LayerNorm" in name:
        return ParamSpec(name=name, shape=shape, mean=1.0 if name.endswith("weight") else 0.0, std=NORM_NOISE)
    if len(shape) == 1:
        return ParamSpec(name=name, shape=shape, mean=0.0, std=BIAS_STD)
    if "embeddings" in name:  # a LayerNorm follows: unit scale
        return ParamSpec(name=name, shape=shape, mean=0.0, std=1.0)
    gain = QK_GAIN if name.endswith(("query.weight", "key.weight")) else 1.0
    return ParamSpec(name=name, shape=shape, mean=0.0, std=gain / math.sqrt(shape[-1]))


def write_encoder_files(out: Path, arch: str) -> None:
    """The tokenizer's post-processor and special tokens as BERT's, and for `bert` the
    sentence-transformers layout (mean pooling, normalised)."""
    path = out / "tokenizer.json"
    tokenizer = json.loads(path.read_text(encoding="utf-8"))
    cls, sep = [IM_START, BOS_ID], [IM_END, EOS_ID]
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": IM_START, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                   {"SpecialToken": {"id": IM_END, "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": IM_START, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"SpecialToken": {"id": IM_END, "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}},
                 {"SpecialToken": {"id": IM_END, "type_id": 1}}],
        "special_tokens": {tok: {"id": tok, "ids": [i], "tokens": [tok]} for tok, i in (cls, sep)},
    }
    path.write_text(json.dumps(tokenizer, ensure_ascii=False), encoding="utf-8")
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config.update(cls_token=IM_START, sep_token=IM_END, model_input_names=["input_ids", "token_type_ids", "attention_mask"])
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    if arch != "bert":
        return
    hidden = json.loads((out / "config.json").read_text())["hidden_size"]
    (out / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}], indent=2))
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": hidden, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
        "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": False, "include_prompt": True}, indent=2))
    (out / "2_Normalize").mkdir(exist_ok=True)
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": MAX_POSITIONS,
                                                               "do_lower_case": False}))
    (out / "config_sentence_transformers.json").write_text(json.dumps({"similarity_fn_name": "cosine"}))
