"""The model's tokenizer (tokenizer.json, or a GGUF file's) and chat template, without transformers or torch."""
from __future__ import annotations

import datetime
import json
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders

from services.core.errors import InvalidArgument
from services.core.gguf_file import is_gguf_file


MAX_REQUEST_TEMPLATES = 8
RESERVED_TEMPLATE_NAMES = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)


class Tokenizer:
    """`source`: a Hugging Face folder (tokenizer.json, tokenizer_config.json) or a GGUF file
    (tokenizer.ggml.* and tokenizer.chat_template, services/core/gguf_tokenizer.py)."""

    def __init__(self, source: str | Path):
        source = Path(source)
        if is_gguf_file(source):
            from services.core.gguf_tokenizer import load_gguf_tokenizer

            loaded = load_gguf_tokenizer(source)
            self._tok = loaded.tokenizer
            self.bos_token, self.eos_token = loaded.bos_token, loaded.eos_token
            self.add_bos = loaded.add_bos
            self._config = dict(loaded.special_tokens)
            template = loaded.chat_template
        else:
            self._tok, config = _from_folder(source)
            self._config = config
            self.bos_token = _token_text(config.get("bos_token"))
            self.eos_token = _token_text(config.get("eos_token"))
            self.add_bos = bool(config.get("add_bos_token", False)) and self.bos_token is not None
            template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self._env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)  # client text is never
        self._env.globals["raise_exception"] = _raise                                   # evaluated
        self._env.globals["strftime_now"] = _strftime_now  # gpt-oss's template dates its system message
        self._compiled: dict[str, jinja2.Template] = {}  # the templates requests gave, most recent last
        self.set_template(template or "")
        self.vocab_size = self._tok.get_vocab_size()
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        pieces = self._tok.get_vocab(with_added_tokens=True)
        # No token stands for more characters than its piece has (a byte-level piece has one
        # character per byte): a text longer than max_model_len * this cannot fit, untokenized.
        self.max_token_chars = max(map(len, pieces), default=1)
        self._byte_level = isinstance(self._tok.decoder, decoders.ByteLevel)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos:
            bos = self._tok.token_to_id(self.bos_token)
            if not ids or ids[0] != bos:
                ids = [bos] + ids
        return ids

    def encode_pooling(self, text: str, pair: str | None = None) -> list[int]:
        """What an embedding or cross-encoder model reads: the tokenizer's own special tokens around the
        text, or the text pair (tokenizer.json's post-processor, as sentence-transformers adds them)."""
        return self._tok.encode(text, pair, add_special_tokens=True).ids

    def token_id(self, piece: str) -> int | None:
        """The id of a vocabulary piece as it is spelled there (None: no such piece)."""
        return self._tok.token_to_id(piece)

    def special_token_id(self, name: str) -> int | None:
        """tokenizer_config.json's special token `name` (e.g. sep_token) as an id; None: it names none."""
        token = _token_text(self._config.get(name))
        return self._tok.token_to_id(token) if token else None

    def to_json(self) -> str:
        """The tokenizer.json text (the grammar compiler builds its own view of the vocabulary)."""
        return self._tok.to_str()

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes. A token can end inside a multi-byte character, where `decode`
        gives U+FFFD instead; these bytes, joined over a sequence, are the text's UTF-8."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level and all(c in _UNICODE_TO_BYTE for c in piece):
            return bytes(_UNICODE_TO_BYTE[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # SentencePiece byte fallback
            return bytes([int(piece[3:5], 16)])
        if not self._byte_level and piece.startswith("\u2581"):  # SentencePiece's word boundary
            return piece.replace("\u2581", " ").encode()
        return self.decode([token_id], skip_special_tokens=False).encode()

    def set_template(self, source: str) -> None:
        """Replace the model's chat template (--chat-template); "" leaves none."""
        self._template = self._env.from_string(source) if source else None
        self.template_source = source  # what the template uses (e.g. `tools`) decides what it gets

    def compile_template(self, source: str) -> jinja2.Template:
        """A request's own chat template, compiled (the last few are kept). Raises InvalidArgument."""
        template = self._compiled.pop(source, None)
        if template is None:
            try:
                template = self._env.from_string(source)
            except jinja2.exceptions.TemplateError as exc:
                raise InvalidArgument("chat_template", f"is not a valid Jinja template: {exc}") from None
        self._compiled[source] = template
        while len(self._compiled) > MAX_REQUEST_TEMPLATES:
            self._compiled.pop(next(iter(self._compiled)))
        return template

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, template_kwargs: dict | None = None,
                            template: str | None = None) -> str:
        """`template_kwargs`: more variables for the template (e.g. enable_thinking); `template`: a
        template's source to use instead of the model's."""
        compiled = self.compile_template(template) if template else self._template
        if compiled is None:
            raise InvalidArgument("messages", "this model has no chat template (give one: --chat-template, or a "
                                              "request's chat_template)")
        reserved = sorted(set(template_kwargs or ()) & RESERVED_TEMPLATE_NAMES)
        if reserved:
            raise InvalidArgument(f"chat_template_kwargs.{reserved[0]}", "is set by the server, not by kwargs")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                    or not isinstance(message.get("content"), str):
                raise InvalidArgument(f"messages[{i}]", "needs a string role and a string content")
        try:
            extra = {"tools": tools} if tools else {}  # templates test `tools is defined`
            return compiled.render(**(template_kwargs or {}), messages=messages,
                                   add_generation_prompt=add_generation_prompt, **extra,
                                   bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except jinja2.exceptions.TemplateError as exc:
            raise InvalidArgument("messages", f"chat template refused the messages: {exc}") from exc


def _from_folder(folder: Path) -> tuple[HFTokenizer, dict]:
    if not (folder / "tokenizer.json").is_file():
        raise InvalidArgument("model", f"no tokenizer.json in {folder}")
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    template_path = folder / "chat_template.jinja"  # gpt-oss's folders, transformers 5's save_pretrained: the
    if template_path.is_file():                      # template in its own file, taking precedence as in transformers
        config["chat_template"] = template_path.read_text(encoding="utf-8")
    return HFTokenizer.from_file(str(folder / "tokenizer.json")), config


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable bytes stand for themselves, the
    others (controls, space, ...) for the code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


_UNICODE_TO_BYTE = _byte_level_alphabet()


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value
