"""Random-weight encoders (BERT) for tests and benchmarks, written by services/tools/make_model.py.

    bert             transformers' BertModel with sentence-transformers' layout beside it
                     (modules.json, 1_Pooling mean pooling, Normalize): an embedding model as BGE/E5 ship
    bert_classifier  BertForSequenceClassification with one label: a cross-encoder as bge-reranker ships
    bert_wordpiece   `bert` with BERT's own kind of vocabulary (WordPiece, lowercased): the kind llama.cpp's
                     converter writes into a GGUF file and llama.cpp tokenizes (tests/gguf_files.py,
                     bench/embed.py's llama.cpp peer)

The config.json is transformers' BertConfig's, the tensor names and shapes those of the model it
makes (on the meta device). The tokenizer of `bert` and `bert_classifier` is make_tokenizer's, with a
post-processor that adds <|im_start|> as [CLS] and <|im_end|> as [SEP] around a text or a pair (the
pair's second text of token type 1), as BERT's does; `bert_wordpiece`'s is built here from the same
corpus (`wordpiece_vocab`: [PAD] [CLS] [SEP] [UNK] [MASK], then the corpus's most frequent characters,
each also as a ##continuation, then its most frequent words, then [unusedN] to the size).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from services.tools.make_tokenizer import BOS_ID, EOS_ID, IM_END, IM_START
from services.tools.random_weights import NORM_NOISE, QK_GAIN, ParamSpec

ENCODERS = {"bert": "BertModel", "bert_classifier": "BertForSequenceClassification", "bert_wordpiece": "BertModel"}
WORDPIECE_SPECIALS = ("[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]")  # ids 0..4
BIAS_STD = 0.02
MAX_POSITIONS = 512


def encoder_config(arch: str, s: dict) -> dict:
    import transformers

    config = transformers.BertConfig(
        hidden_size=s["hidden_size"], intermediate_size=s["intermediate_size"], num_hidden_layers=s["num_layers"],
        num_attention_heads=s["num_heads"], vocab_size=s["vocab_size"],
        max_position_embeddings=min(MAX_POSITIONS, s["max_position_embeddings"]), type_vocab_size=2,
        layer_norm_eps=1e-12, pad_token_id=0 if arch == "bert_wordpiece" else EOS_ID, num_labels=1).to_dict()
    for key in ("transformers_version", "_name_or_path", "output_attentions", "output_hidden_states", "return_dict"):
        config.pop(key, None)
    if ENCODERS[arch] == "BertModel":
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
    """The tokenizer's post-processor and special tokens as BERT's (`bert_wordpiece`: BERT's kind of
    tokenizer), and for an embedding model the sentence-transformers layout (mean pooling, normalised)."""
    if arch == "bert_wordpiece":
        _write_wordpiece_files(out)
    else:
        _add_bert_specials(out)
    if ENCODERS[arch] != "BertModel":
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


def _add_bert_specials(out: Path) -> None:
    """make_tokenizer's tokenizer with <|im_start|> as [CLS] and <|im_end|> as [SEP]."""
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


def wordpiece_vocab(vocab_size: int) -> list[str]:
    """A WordPiece vocabulary of exactly `vocab_size` pieces from make_tokenizer's corpus, lowercased and
    split as BERT's normalizer and pre-tokenizer do (deterministic: counts, ties by the piece's text)."""
    from collections import Counter

    from tokenizers import normalizers, pre_tokenizers

    from services.tools.make_tokenizer import CORPUS_PATH

    normalizer, splitter = normalizers.BertNormalizer(lowercase=True), pre_tokenizers.BertPreTokenizer()
    words = Counter(word for line in CORPUS_PATH.read_text(encoding="utf-8").splitlines()
                    for word, _ in splitter.pre_tokenize_str(normalizer.normalize_str(line)))
    chars = Counter()
    for word, count in words.items():
        for char in word:
            chars[char] += count
    room = vocab_size - len(WORDPIECE_SPECIALS)
    top_chars = [c for c, _ in sorted(chars.items(), key=lambda kv: (-kv[1], kv[0]))][:room // 4]
    pieces = [*WORDPIECE_SPECIALS, *top_chars, *("##" + c for c in top_chars)]
    known = set(pieces)
    for word, _ in sorted(words.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(pieces) == vocab_size:
            break
        if len(word) > 1 and word not in known and all(c in known for c in word):
            pieces.append(word)
            known.add(word)
    pieces += [f"[unused{i}]" for i in range(vocab_size - len(pieces))]
    return pieces


def _write_wordpiece_files(out: Path) -> None:
    """tokenizer.json (BERT's normalizer, pre-tokenizer, WordPiece, [CLS] A [SEP] B [SEP]) and the config
    naming its special tokens, over make_tokenizer's files."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    config = json.loads((out / "config.json").read_text())
    pieces = wordpiece_vocab(config["vocab_size"])
    vocab = {piece: i for i, piece in enumerate(pieces)}
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.add_special_tokens(list(WORDPIECE_SPECIALS))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    tokenizer.save(str(out / "tokenizer.json"))
    special = {"cls_token": "[CLS]", "sep_token": "[SEP]", "unk_token": "[UNK]", "pad_token": "[PAD]",
               "mask_token": "[MASK]"}
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", **special, "do_lower_case": True,
        "clean_up_tokenization_spaces": False, "model_max_length": config["max_position_embeddings"],
        "model_input_names": ["input_ids", "token_type_ids", "attention_mask"]}, indent=2) + "\n", encoding="utf-8")
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n", encoding="utf-8")
