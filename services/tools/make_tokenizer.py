"""A small byte-level BPE tokenizer with ChatML special tokens, trained offline.

Trained with the `tokenizers` library on `tokenizer_corpus.txt` (English prose, code,
numbers, accented Latin, Chinese and other scripts, emoji). Byte-level BPE has all
256 bytes in its alphabet, so any UTF-8 text encodes and decodes back exactly.

When the requested vocabulary is larger than the corpus supports (the corpus alone
gives about 4,100 tokens), deterministic filler words (random lowercase strings from
a fixed `random.Random(0)`) are added to the training text until the size is reached.

Training is deterministic: word counts do not depend on thread order, and ties
between equally frequent pairs are broken by token id; the same bytes came out under
1, 2 and 8 rayon threads and different Python hash seeds (checked when this was
written; tests/tools/test_make_model.py checks file hashes across two builds).
"""
from __future__ import annotations

import functools
import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS_PATH = Path(__file__).with_name("tokenizer_corpus.txt")
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]  # ids 0, 1, 2
BOS_ID, EOS_ID, ENDOFTEXT_ID = 1, 2, 0
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS) + 1

# ChatML, as in SmolLM2 but without a default system prompt.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@functools.lru_cache(maxsize=8)
def tokenizer_json(vocab_size: int) -> str:
    """The serialized tokenizer with exactly `vocab_size` tokens (trained once per size)."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be at least {MIN_VOCAB_SIZE}, got {vocab_size}")
    lines = CORPUS_PATH.read_text(encoding="utf-8").splitlines(keepends=True)
    tokenizer = _train(lines, vocab_size)
    if tokenizer.get_vocab_size() < vocab_size:
        missing = vocab_size - tokenizer.get_vocab_size()
        tokenizer = _train(lines + _filler_words(missing), vocab_size)
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer reached {tokenizer.get_vocab_size()} tokens, wanted {vocab_size}")
    return tokenizer.to_str(pretty=True)


def _train(lines: list[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(lines, trainer)
    return tokenizer


def _filler_words(count: int) -> list[str]:
    # every distinct word yields at least one merge (the word itself)
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    return [" " + "".join(rng.choices(letters, k=rng.randint(5, 9))) for _ in range(count)]


def write_tokenizer_files(out_dir: Path, vocab_size: int, max_length: int) -> None:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json."""
    (out_dir / "tokenizer.json").write_text(tokenizer_json(vocab_size), encoding="utf-8")
    special = {"bos_token": IM_START, "eos_token": IM_END, "pad_token": IM_END, "unk_token": ENDOFTEXT}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "additional_special_tokens": [IM_START, IM_END],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(out_dir / "tokenizer_config.json", config)
    _write_json(out_dir / "special_tokens_map.json", {**special, "additional_special_tokens": [IM_START, IM_END]})


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
