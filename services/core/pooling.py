"""Pooling models: what a worker serves (its task) and how it pools, read from the model folder.

A worker serves its model to `generate` tokens, to `embed` (one vector per input) or to `score`
(a cross-encoder's or a yes/no decoder reranker's relevance). A pooling request
(SamplingParams.pooling) is prefill only: the scheduler runs its prompt (chunked and batched with
the others where the model allows, services/core/worker_scheduler.py), the worker pools the last
layer's hidden states into one output (services/worker/pooler.py), and the request ends; its blocks
go back (a decoder's full blocks stay in the prefix cache).

How an embedding is pooled follows sentence-transformers' layout where the folder has it
(`modules.json`, `1_Pooling/config.json`, a `Normalize` module): CLS, mean or last token, and
whether the vector is L2-normalised. Without it: last token and normalised for a decoder (as
Qwen3-Embedding and E5-Mistral are), CLS and normalised for an encoder. A GGUF file says its pooling in
`{arch}.pooling_type` (llama.cpp's converter writes it from the same sentence-transformers layout) and is
normalised, as llama-server's embeddings are. Pure Python.
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from services.core.errors import InvalidArgument, check
from services.core.gguf_file import is_gguf_file, read_metadata

TASKS = ("auto", "generate", "embed", "score")
POOLING_MODES = ("cls", "mean", "last")
_ST_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
             "pooling_mode_lasttoken": "last"}
_ENCODER_BASES = ("BertModel", "XLMRobertaModel", "RobertaModel")
GGUF_ENCODERS = ("bert",)  # general.architecture of an encoder's GGUF file (services/worker/gguf_arch.py)
GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}  # llama.cpp's pooling_type (0 none and 4 rank: not an embedding)


@dataclass(frozen=True, kw_only=True)
class PoolingSpec:
    """How a worker pools an embedding."""

    mode: str = "last"  # cls, mean or last
    normalize: bool = True  # L2-normalised
    matryoshka: bool = False  # a shorter vector may be asked (`dimensions`): the first d, normalised again
    matryoshka_dimensions: tuple[int, ...] = ()  # the lengths it may be asked for (config.json's); (): any

    @property
    def whole(self) -> bool:
        """Every position's hidden state is needed in one step (CLS of an encoder, a mean)."""
        return self.mode != "last"


@dataclass(frozen=True, kw_only=True)
class PoolingModel:
    """What a frontend reads from the model folder: how a pair is scored (a cross-encoder's text pair,
    or a decoder reranker's prompt), and whether `dimensions` may shorten an embedding."""

    encoder: bool = False
    spec: PoolingSpec = PoolingSpec()

    @classmethod
    def of(cls, folder: Path | None) -> PoolingModel:
        """The model folder's, or its GGUF file's."""
        if folder is None or not (Path(folder).is_dir() or is_gguf_file(folder)):
            return cls()
        encoder = is_encoder_folder(folder)
        try:
            return cls(encoder=encoder, spec=pooling_spec(folder, encoder))
        except InvalidArgument:  # a layout the workers refuse: they say why when they load it
            return cls(encoder=encoder)


def resolve_task(task: str, folder: Path, architectures: tuple[str, ...]) -> str:
    """auto: score for a *ForSequenceClassification model, embed for a bare encoder or a
    sentence-transformers folder, generate otherwise (a Qwen3-Reranker is a causal LM: --task score)."""
    check(task in TASKS, "task", f"must be one of {', '.join(TASKS)}, got {task!r}")
    if task != "auto":
        return task
    if any(a.endswith("ForSequenceClassification") for a in architectures):
        return "score"
    if any(a in _ENCODER_BASES for a in architectures) or (Path(folder) / "modules.json").is_file():
        return "embed"
    return "generate"


def pooling_spec(folder: Path, is_encoder: bool) -> PoolingSpec:
    """The folder's sentence-transformers pooling (modules.json, its Pooling and Normalize modules), or
    a GGUF file's pooling_type, else the family's default."""
    folder = Path(folder)
    if is_gguf_file(folder):
        return _gguf_pooling(folder, is_encoder)
    config = (_json(folder / "config.json") if folder.is_dir() else None) or {}  # a tokenizer-only folder has none
    dims = config.get("matryoshka_dimensions") or ()
    matryoshka = dict(matryoshka=bool(config.get("is_matryoshka") or dims),
                      matryoshka_dimensions=tuple(sorted(int(d) for d in dims)))
    modules = _json(folder / "modules.json") if folder.is_dir() else None
    if not modules:
        return PoolingSpec(mode="cls" if is_encoder else "last", normalize=True, **matryoshka)
    mode, normalize = None, False
    for module in modules:
        kind = module.get("type", "")
        if kind.endswith("Pooling"):
            mode = _pooling_mode(_json(folder / module.get("path", "") / "config.json") or {})
        elif kind.endswith("Normalize"):
            normalize = True
        elif not kind.endswith("Transformer"):
            raise InvalidArgument("model", f"sentence-transformers module {kind!r} is not served (Transformer, "
                                           f"Pooling and Normalize are)")
    return PoolingSpec(mode=mode or ("cls" if is_encoder else "last"), normalize=normalize, **matryoshka)


def _gguf_pooling(path: Path, is_encoder: bool) -> PoolingSpec:
    meta = read_metadata(path)
    key = f"{meta.get('general.architecture')}.pooling_type"
    kind = meta.get(key)
    if kind is not None and kind not in GGUF_POOLING:
        served = ", ".join(f"{code} ({mode})" for code, mode in GGUF_POOLING.items())
        raise InvalidArgument("model", f"{path.name}: {key} {kind} is not served for embeddings (served: {served})")
    mode = GGUF_POOLING[kind] if kind is not None else "cls" if is_encoder else "last"
    return PoolingSpec(mode=mode, normalize=True)


def _pooling_mode(config: dict) -> str:
    modes = [mode for key, mode in _ST_MODES.items() if config.get(key)]
    others = [key for key, value in config.items() if key.startswith("pooling_mode") and value and key not in _ST_MODES]
    if len(modes) != 1 or others:
        raise InvalidArgument("model", f"1_Pooling: one of {', '.join(_ST_MODES)} is served, got "
                                       f"{modes + others}")
    return modes[0]


def _json(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def shorten(vector: list[float], dimensions: int | None, spec: PoolingSpec) -> list[float]:
    """A Matryoshka model's first `dimensions` values, L2-normalised again (None: the whole vector): the
    norm summed exactly (fsum) and each value divided by it in double, then rounded to float32 as the
    whole vector's values are, so the base64 and float encodings carry the same bits."""
    if dimensions is None or dimensions == len(vector):
        return vector
    check(spec.matryoshka, "dimensions", "this model does not support shortened embeddings (no is_matryoshka "
                                         "or matryoshka_dimensions in its config.json)")
    check(1 <= dimensions <= len(vector), "dimensions", f"must be in [1, {len(vector)}], got {dimensions}")
    allowed = spec.matryoshka_dimensions
    check(not allowed or dimensions in allowed, "dimensions",
          f"this model's matryoshka_dimensions are {', '.join(map(str, allowed))}, got {dimensions}")
    head = vector[:dimensions]
    norm = math.sqrt(math.fsum(x * x for x in head))
    return [_f32(x / norm) for x in head] if norm > 0 else head


def _f32(value: float) -> float:
    """The float32 nearest `value` (round to nearest even), as a Python float."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


# ---- scoring inputs --------------------------------------------------------------
# Qwen3-Reranker's prompt (its model card): the model answers "yes" or "no"; the score is P(yes).
RERANKER_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
_RERANKER_PREFIX = ('<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and '
                    'the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
                    '<|im_start|>user\n')
_RERANKER_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def is_encoder_folder(folder: Path) -> bool:
    """The model (a folder, or a GGUF file) is an encoder (BERT family): it scores a (query, document) pair
    as one text pair."""
    if is_gguf_file(folder):
        return read_metadata(folder).get("general.architecture") in GGUF_ENCODERS
    config = _json(Path(folder) / "config.json") if Path(folder).is_dir() else None
    return bool(config) and config.get("model_type") in ("bert", "xlm-roberta")


def score_input(tokenizer, encoder: bool, query: str, document: str, instruction: str | None = None) -> list[int]:
    """The token ids a scoring model reads for (query, document): a cross-encoder's text pair with
    its tokenizer's special tokens, or a decoder reranker's yes/no prompt."""
    if encoder:
        return tokenizer.encode_pooling(query, document)
    body = f"<Instruct>: {instruction or RERANKER_INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"
    return tokenizer.encode(_RERANKER_PREFIX + body + _RERANKER_SUFFIX, add_special_tokens=False)
