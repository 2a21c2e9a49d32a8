"""The tokenizer built from a GGUF file's metadata (services/core/gguf_tokenizer.py) gives the ids of
transformers' own GGUF tokenizer and of the model's tokenizer.json, on code, numbers, CJK, emoji and
special tokens; the chat template and BOS/EOS come from the file."""
from __future__ import annotations

import itertools
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
    "HelloWorld's camelCase JSONParser a/b//c\n e\u0301\u0301 ひらがなカタカナ漢字 x12345y",
]

ENGLISH = "The quick brown fox jumps over the lazy dog; the river rose above its banks."


def transformers_ids(folder, name: str, texts: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(folder), gguf_file=name)
    return [reference(text, add_special_tokens=False)["input_ids"] for text in texts]


def ours(path, texts: list[str]) -> list[list[int]]:
    tokenizer = Tokenizer(path)
    return [tokenizer.encode(text, add_special_tokens=False) for text in texts]


@pytest.fixture(scope="module")
def unsplit(tmp_path_factory, model_dir):
    """The tiny model's folder with a byte-level BPE learned without any split on make_model's corpus and
    TEXTS: its merges cross the words, digits, scripts and marks that the families' regexes cut apart, so
    a wrong regex shows in the ids (make_model's 512-token vocabulary has too few merges for that). Its
    pre-tokenizer GPT-2's; restyle_tokenizer gives the others."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from services.tools.make_tokenizer import CORPUS_PATH, SPECIAL_TOKENS

    folder = tmp_path_factory.mktemp("unsplit") / "hf"
    shutil.copytree(model_dir("llama", "tiny"), folder)
    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = CORPUS_PATH.read_text().splitlines() + TEXTS * 20  # merges across the texts' cuts
    tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=1500, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def restyled(tmp_path, folder, pre: str):
    """The folder with the tokenizer.json of the `pre` family, and its GGUF file."""
    folder = shutil.copytree(folder, tmp_path / "hf")
    restyle_tokenizer(folder, pre)
    return folder, write_gguf(folder, tmp_path / "model.gguf", pre=pre, with_tensors=False)


@pytest.mark.parametrize("pre", ["gpt-2", "qwen2", "llama-bpe", "gpt-4o", "qwen35"])
def test_byte_level_styles_match_transformers_and_tokenizer_json(tmp_path, unsplit, pre):
    """A gpt2 (make_model's), qwen2, llama-3, GPT-4o (o200k: Phi-4-mini, gpt-oss) and Qwen3.5-style
    tokenizer: the file's ids are transformers' GGUF tokenizer's and the original tokenizer.json's."""
    folder, path = restyled(tmp_path, unsplit, pre)
    got = ours(path, TEXTS)
    assert got == ours(folder, TEXTS)
    assert got == transformers_ids(tmp_path, path.name, TEXTS)
    tokenizer = Tokenizer(path)
    assert [tokenizer.decode(ids, skip_special_tokens=False) for ids in got] == TEXTS
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.add_bos) == ("<|im_start|>", "<|im_end|>", False)
    messages = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(messages) == Tokenizer(folder).apply_chat_template(messages)


def test_deepseek_v3_style_matches_tokenizer_json(tmp_path, unsplit):
    """DeepSeek-V3's three splits in turn (numbers by three, CJK and kana runs, the rest), which
    transformers' GGUF reader does not know: the file's ids are the original tokenizer.json's."""
    folder, path = restyled(tmp_path, unsplit, "deepseek-v3")
    got = ours(path, TEXTS)
    assert got == ours(folder, TEXTS)
    assert [Tokenizer(path).decode(ids, skip_special_tokens=False) for ids in got] == TEXTS


def test_the_split_regexes_matter(tmp_path, unsplit):
    """The same vocabulary read under each family's name gives other ids (a test of the pre table and of
    the vocabulary above: fails if the file's tokenizer.ggml.pre were ignored or two families cut alike)."""
    ids = {}
    for pre in ("gpt-2", "smollm", "llama-bpe", "qwen2", "qwen35", "tekken", "gpt-4o", "deepseek-v3"):
        path = write_gguf(unsplit, tmp_path / f"{pre}.gguf", pre=pre, with_tensors=False)
        ids[pre] = ours(path, TEXTS)
    for a, b in itertools.combinations(ids, 2):
        assert ids[a] != ids[b], (a, b)


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
