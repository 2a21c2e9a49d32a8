"""Tokenizer folders of reasoning models for the frontend's tests: the tiny test tokenizer with the
markers Qwen3 and DeepSeek-R1 add as tokens of their own, and their real chat templates
(tests/frontend/templates, copied from the models' tokenizer_config.json and gpt-oss's
chat_template.jinja)."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer

from services.tools.make_tokenizer import tokenizer_json

TEMPLATES = Path(__file__).with_name("templates")
MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<｜User｜>", "<｜Assistant｜>",
           "<｜end▁of▁sentence｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁outputs▁end｜>"]
VOCAB_SIZE = 512


def reasoning_model(folder: Path, template: str) -> Path:
    """A tokenizer folder with `template` (a file name under templates/) as its chat template."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer.from_str(tokenizer_json(VOCAB_SIZE))
    tokenizer.add_tokens([AddedToken(m, special=False, normalized=False) for m in MARKERS])
    (folder / "tokenizer.json").write_text(tokenizer.to_str(), encoding="utf-8")
    config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": False,
              "chat_template": (TEMPLATES / template).read_text(encoding="utf-8")}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
    return folder


HARMONY_TOKENS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"]
def harmony_model(folder: Path) -> Path:
    """A tokenizer folder with gpt-oss's harmony tokens (special ones, as gpt-oss has them) and its chat
    template."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer.from_str(tokenizer_json(VOCAB_SIZE))
    tokenizer.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in HARMONY_TOKENS])
    (folder / "tokenizer.json").write_text(tokenizer.to_str(), encoding="utf-8")
    config = {"bos_token": "<|start|>", "eos_token": "<|return|>", "add_bos_token": False,
              "chat_template": (TEMPLATES / "gpt_oss.jinja").read_text(encoding="utf-8")}
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder
