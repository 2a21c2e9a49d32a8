"""The tokenizer built from a GGUF file's metadata (services/core/gguf_tokenizer.py) gives the ids of
transformers' own GGUF tokenizer and of the model's tokenizer.json, on code, numbers, CJK, emoji and
special tokens; the chat template and BOS/EOS come from the file."""
from __future__ import annotations

import shutil

import pytest

from services.core.errors import InvalidArgument
from services.core.tokenizer import Tokenizer
from tests.gguf_files import restyle_tokenizer, write_gguf

TEXTS = [
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # 42\n",
    "Numbers: 1234567, 3.14159, 2024-12-03,    42 and 1,000,000.",
    "日本語のテキスト、中文的句子。한국어 문장.",
    "emoji 🎉👍🏽 and 👨‍👩‍👧 family ✓",
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
    "I'm sure you'll see they've DON'T we'd\r\n\r\n\ttabs   and  spaces   ",
    "Ünïcödé façade naïve — “quotes” … ½",
]

ENGLISH = "The quick brown fox jumps over the lazy dog; the river rose above its banks."


def transformers_ids(folder, name: str, texts: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(folder), gguf_file=name)
    return [reference(text, add_special_tokens=False)["input_ids"] for text in texts]


def ours(path, texts: list[str]) -> list[list[int]]:
    tokenizer = Tokenizer(path)
    return [tokenizer.encode(text, add_special_tokens=False) for text in texts]


@pytest.mark.parametrize("pre", ["gpt-2", "qwen2", "llama-bpe"])
def test_byte_level_styles_match_transformers_and_tokenizer_json(tmp_path, model_dir, pre):
    """A gpt2 (make_model's), qwen2-style and llama-3-style tokenizer: the file's ids are transformers'
    GGUF tokenizer's and the original tokenizer.json's."""
    folder = tmp_path / "hf"
    shutil.copytree(model_dir("llama", "tiny"), folder)
    restyle_tokenizer(folder, pre)
    path = write_gguf(folder, tmp_path / "model.gguf", pre=pre, with_tensors=False)
    got = ours(path, TEXTS)
    assert got == ours(folder, TEXTS)
    assert got == transformers_ids(tmp_path, path.name, TEXTS)
    tokenizer = Tokenizer(path)
    assert [tokenizer.decode(ids, skip_special_tokens=False) for ids in got] == TEXTS
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.add_bos) == ("<|im_start|>", "<|im_end|>", False)
    messages = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(messages) == Tokenizer(folder).apply_chat_template(messages)


def test_the_split_regexes_matter(tmp_path, model_dir):
    """The same vocabulary read as gpt-2 and as llama-bpe cuts a number differently (a test of the pre
    table: fails if the file's tokenizer.ggml.pre were ignored)."""
    folder = model_dir("llama", "tiny")
    gpt2 = write_gguf(folder, tmp_path / "gpt2.gguf", pre="gpt-2", with_tensors=False)
    llama3 = write_gguf(folder, tmp_path / "llama3.gguf", pre="llama-bpe", with_tensors=False)
    assert ours(gpt2, ["x 1234567"]) != ours(llama3, ["x 1234567"])


def test_unknown_pre_tokenizer_is_refused(tmp_path, model_dir):
    path = write_gguf(model_dir("llama", "tiny"), tmp_path / "m.gguf", pre="no-such-pre", with_tensors=False)
    with pytest.raises(InvalidArgument, match="no-such-pre.*served: .*llama-bpe.*--tokenizer"):
        Tokenizer(path)


@pytest.mark.slow
def test_default_model_file_matches_transformers():
    """SmolLM2's own GGUF (49k tokens, pre "smollm": digits split first): transformers' GGUF tokenizer with
    the digit split it drops restored (default_model._split_digits), and the converted folder's."""
    from transformers import AutoTokenizer

    from services.tools.default_model import _split_digits, default_model_path, find_gguf

    path = find_gguf()
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    _split_digits(reference)
    got = ours(path, TEXTS)
    assert got == [reference(text, add_special_tokens=False)["input_ids"] for text in TEXTS]
    assert got == ours(default_model_path(), TEXTS)
    tokenizer = Tokenizer(path)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.template_source == reference.chat_template


@pytest.mark.slow
def test_sentencepiece_vocabulary_matches_transformers(tmp_path):
    """tokenizer.ggml.model "llama": merges from the scores, byte fallback for what the vocabulary lacks
    (CJK, emoji), a word-boundary prefix, BOS added (llama.cpp's default for this kind)."""
    from tests.gguf_files import write_sentencepiece_gguf

    path = write_sentencepiece_gguf(tmp_path / "spm.gguf")
    texts = [t.replace("<|im_start|>", "<s>").replace("<|im_end|>", "</s>") for t in TEXTS] + [ENGLISH]
    got = ours(path, texts)
    assert got == transformers_ids(tmp_path, path.name, texts)
    tokenizer = Tokenizer(path)
    assert tokenizer.add_bos and tokenizer.encode("hi")[0] == 1
    assert [tokenizer.decode(ids, skip_special_tokens=False) for ids in got] == texts
