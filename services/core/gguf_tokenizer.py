"""A model's tokenizer built from a GGUF file's `tokenizer.ggml.*` metadata, with the tokenizers library.

Two vocabulary kinds, named by `tokenizer.ggml.model`:
- `gpt2`: byte-level BPE (tokens and merges as the file spells them). Its text is first cut by the
  regexes of the pre-tokenizer the file names in `tokenizer.ggml.pre` (llama.cpp's names; the regexes
  are those of each family's own tokenizer.json), then mapped to GPT-2's byte alphabet.
- `llama`: SentencePiece BPE (tokens with scores, byte fallback `<0xNN>`): the merges are the pairs of
  tokens that make a token, best score first; a word boundary is U+2581, prefixed to the text unless
  `tokenizer.ggml.add_space_prefix` says not.
- `bert`: WordPiece (BERT's), which llama.cpp's converter stores with a word's first piece prefixed by
  U+2581 and a continuation without its "##" (control tokens as they are): read back to WordPiece's
  spelling, lowercased and split as BERT's normalizer and pre-tokenizer do (`tokenizer.ggml.normalizer.*`,
  lowercase and accents stripped where the file says nothing, as llama.cpp), and "[CLS] A [SEP]" ("[CLS] A
  [SEP] B [SEP]" for a pair, B of token type 1) around an embedding's input, as llama.cpp adds them.
Tokens the file types CONTROL (and the UNKNOWN one) are special: matched whole, skipped when decoding;
USER_DEFINED ones are matched whole and kept. The transformers GGUF reader is never called: a test
compares the two.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from services.core.errors import InvalidArgument
from services.core.gguf_file import read_metadata

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # tokenizer.ggml.token_type

# The split regexes of each pre-tokenizer family (as its own tokenizer.json writes them).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")  # Qwen3.5: a letter's combining marks stay with it
# o200k (GPT-4o's tiktoken pattern; Phi-4-mini, gpt-oss, Llama 4): cased words with their contraction,
# numbers by three, "/" kept after punctuation
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# DeepSeek-V3/R1 (and Hunyuan's dense models): numbers by three, then runs of CJK and kana, then the rest
_DEEPSEEK3 = (r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
              r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
              r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# family -> (the regexes applied in turn, ignore_merges: a word that is a token is that token, as
# llama.cpp and Llama 3's own tokenizer.json do)
_FAMILIES = {
    "gpt2": ((_GPT2,), False),
    "digits-gpt2": ((r"\p{N}", _GPT2), False),  # every digit its own piece first
    "llama3": ((_LLAMA3,), True),
    "qwen2": ((_QWEN2,), False),
    "tekken": ((_TEKKEN,), False),
    "qwen35": ((_QWEN35,), False),
    "gpt4o": ((_GPT4O,), False),  # llama.cpp applies the merges to every word (no ignore_merges)
    "deepseek3": (_DEEPSEEK3, False),
}
# tokenizer.ggml.pre (llama.cpp's names) -> family
PRE_TOKENIZERS = {
    **dict.fromkeys(("default", "gpt-2", "phi-2", "mpt", "olmo", "jais", "roberta-bpe", "mellum", "gigachat",
                     "a.x-4.0", "exaone4", "trillion", "granite-docling"), "gpt2"),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
                    "digits-gpt2"),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "dbrx", "smaug-bpe",
                     "lfm2", "midm-2.0"), "llama3"),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez", "kormo", "f2llmv2", "grok-2"), "qwen2"),
    "qwen35": "qwen35",
    "tekken": "tekken",
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2", "kanana2", "talkie"), "gpt4o"),
    **dict.fromkeys(("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"), "deepseek3"),
}


@dataclass(frozen=True, kw_only=True)
class GgufTokenizer:
    """What the Tokenizer class takes from the file."""

    tokenizer: HFTokenizer
    bos_token: str | None
    eos_token: str | None
    add_bos: bool
    chat_template: str | None
    special_tokens: dict[str, str]  # tokenizer_config.json's names (sep_token, cls_token) -> the token


def load_gguf_tokenizer(path: str | Path) -> GgufTokenizer:
    meta = read_metadata(path)
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise InvalidArgument("tokenizer", f"{Path(path).name} carries no tokenizer.ggml.tokens; "
                                           "name a Hugging Face folder with --tokenizer")
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(meta, tokens, Path(path).name)
        add_bos_default = False
    elif kind == "llama":
        tokenizer = _sentencepiece_bpe(meta, tokens)
        add_bos_default = True  # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
    elif kind == "bert":
        tokens = [_wordpiece_spelling(t, kind_) for t, kind_ in zip(tokens, types)]
        cls, sep = (_token(meta, tokens, key) for key in (("cls_token_id", "bos_token_id"),
                                                           ("seperator_token_id", "eos_token_id")))
        tokenizer = _wordpiece(meta, tokens, cls, sep)
    else:
        raise InvalidArgument("tokenizer", f"{Path(path).name}: tokenizer.ggml.model {kind!r} is not served "
                                           "(served: gpt2, llama, bert); name a Hugging Face folder with --tokenizer")
    special = [AddedToken(t, special=True, normalized=False)
               for t, kind_ in zip(tokens, types) if kind_ in (CONTROL, UNKNOWN)]
    user = [AddedToken(t, special=False, normalized=False) for t, kind_ in zip(tokens, types) if kind_ == USER_DEFINED]
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(user)

    def token(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    bos = token("bos_token_id")
    if kind == "bert":  # its post-processor adds [CLS] and [SEP] to an embedding's input (encode_pooling)
        return GgufTokenizer(tokenizer=tokenizer, bos_token=None, eos_token=None, add_bos=False, chat_template=None,
                             special_tokens={"cls_token": cls, "sep_token": sep})
    return GgufTokenizer(tokenizer=tokenizer, bos_token=bos, eos_token=token("eos_token_id"),
                         add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)) and bos is not None,
                         chat_template=meta.get("tokenizer.chat_template"), special_tokens={})


def _byte_level_bpe(meta: dict, tokens: list[str], name: str) -> HFTokenizer:
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise InvalidArgument("tokenizer", f"{name}: pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not served "
                                           f"(served: {', '.join(sorted(PRE_TOKENIZERS))}); name a Hugging Face "
                                           "folder with --tokenizer")
    regexes, ignore_merges = _FAMILIES[PRE_TOKENIZERS[pre]]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or ()]
    vocab = {t: i for i, t in enumerate(tokens)}
    tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(meta: dict, tokens: list[str]) -> HFTokenizer:
    scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=_merges_by_score(tokens, scores, vocab),
                                       unk_token=tokens[unk] if unk is not None else None, fuse_unk=True,
                                       byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", split=False,
                                                       prepend_scheme="first" if prefix else "never")
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tokenizer


def _merges_by_score(tokens: list[str], scores: list[float], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """SentencePiece merges the pair whose joined piece scores best: every split of a token into two
    tokens is a merge, ranked by the token's score (ties: the lower token id first)."""
    ranked = []
    for index, piece in enumerate(tokens):
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[index], index, vocab[left], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _wordpiece_spelling(token: str, kind: int) -> str:
    """A `bert` file's token as WordPiece spells it (llama.cpp's converter: "\u2581word" for a word's first
    piece, "iece" for "##iece"; control tokens as they are)."""
    if kind in (CONTROL, UNKNOWN):
        return token
    return token[1:] if token.startswith("\u2581") else "##" + token


def _token(meta: dict, tokens: list[str], keys: tuple[str, ...]) -> str:
    """The token the first of `keys` (tokenizer.ggml.*) that the file holds names (llama.cpp's converter
    spells the separator's key "seperator_token_id")."""
    for key in keys:
        index = meta.get(f"tokenizer.ggml.{key}")
        if index is not None and 0 <= index < len(tokens):
            return tokens[index]
    raise InvalidArgument("tokenizer", f"a bert vocabulary needs tokenizer.ggml.{keys[0]}")


def _wordpiece(meta: dict, tokens: list[str], cls: str, sep: str) -> HFTokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    lowercase = bool(meta.get("tokenizer.ggml.normalizer.lowercase", True))
    tokenizer = HFTokenizer(models.WordPiece(vocab, unk_token=_token(meta, tokens, ("unknown_token_id",))))
    tokenizer.normalizer = normalizers.BertNormalizer(
        lowercase=lowercase, strip_accents=bool(meta.get("tokenizer.ggml.normalizer.strip_accents", lowercase)))
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])])
    return tokenizer
