"""xgrammar vs llguidance, measured on the default model's tokenizer (vocab 49,152).

Three measures, each contender in turn inside one run (the host is shared):
- compile time of a nested JSON schema (no cache: a fresh compiler each repeat);
- time per token to fill the next-token bitmask while walking a valid document token by token;
- coverage of JSON-schema features: each feature's schema is compiled, then a valid and an
  invalid document are walked; a feature is covered when the valid one is accepted to the end
  and the invalid one is rejected at some token.

    .venv/bin/python bench/grammar_choice.py --out bench/results/grammar_choice.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from transformers import PreTrainedTokenizerFast

DEFAULT_TOKENIZER = Path.home() / ".cache/pagedserve/SmolLM2-135M-Instruct"

NESTED = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "address": {"type": "object", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"},
            "geo": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                    "required": ["lat", "lon"]}},
            "required": ["street", "city", "geo"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "orders": {"type": "array", "items": {"type": "object", "properties": {
            "id": {"type": "integer"}, "status": {"enum": ["open", "shipped", "closed"]},
            "lines": {"type": "array", "items": {"type": "object", "properties": {
                "sku": {"type": "string"}, "qty": {"type": "integer"}}, "required": ["sku", "qty"]}}},
            "required": ["id", "status", "lines"]}},
    },
    "required": ["name", "age", "address", "tags", "orders"],
}
NESTED_DOC = {"name": "Ada Lovelace", "age": 36, "address": {"street": "12 St James's Square", "city": "London",
              "geo": {"lat": 51.507, "lon": -0.135}}, "tags": ["math", "engines"],
              "orders": [{"id": 1, "status": "shipped", "lines": [{"sku": "AE-1", "qty": 2}, {"sku": "N-7", "qty": 1}]},
                         {"id": 2, "status": "open", "lines": []}]}

# feature -> (schema, valid document, invalid document)
FEATURES = {
    "enum": ({"enum": ["red", "green"]}, "red", "blue"),
    "minimum/maximum": ({"type": "integer", "minimum": 3, "maximum": 7}, 5, 9),
    "minItems/maxItems": ({"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3},
                          [1, 2], [1, 2, 3, 4]),
    "pattern": ({"type": "string", "pattern": "^[a-z]{3}-[0-9]{2}$"}, "abc-12", "ab-123"),
    "$ref": ({"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
                               "additionalProperties": False}},
              "type": "array", "items": {"$ref": "#/$defs/pt"}}, [{"x": 1}], [{"y": 1}]),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, True, "no"),
    "recursive $ref": ({"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "required": ["v", "kids"], "additionalProperties": False}}, "$ref": "#/$defs/node"},
        {"v": 1, "kids": [{"v": 2, "kids": []}]}, {"v": 1, "kids": [{"w": 2}]}),
}


class XGrammar:
    name = "xgrammar 0.2.8"

    def __init__(self, hf, vocab_size, eos):
        import xgrammar as xgr
        self.xgr, self.vocab_size = xgr, vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=eos)

    def compile(self, schema: dict):
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))

    def walk(self, compiled, tokens: list[int]) -> tuple[bool, list[float]]:
        matcher = self.xgr.GrammarMatcher(compiled)
        bitmask = self.xgr.allocate_token_bitmask(1, self.vocab_size)
        times = []
        for token in tokens:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            times.append(time.perf_counter() - t0)
            if not matcher.accept_token(token):
                return False, times
        return matcher.is_terminated() or matcher.accept_token(self.info.stop_token_ids[0]), times


class LLGuidance:
    name = "llguidance 1.9.1"

    def __init__(self, hf, vocab_size, eos):
        import llguidance
        import llguidance.hf
        import llguidance.torch
        self.ll, self.vocab_size = llguidance, vocab_size
        self.tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size)

    def compile(self, schema: dict):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                             defaults={"whitespace_flexible": False})
        matcher = self.ll.LLMatcher(self.tok, grammar)  # compiles the lexer; masks are computed lazily
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return grammar

    def walk(self, grammar, tokens: list[int]) -> tuple[bool, list[float]]:
        matcher = self.ll.LLMatcher(self.tok, grammar)
        if matcher.is_error():
            return False, []
        bitmask = self.ll.torch.allocate_token_bitmask(1, self.vocab_size)
        times = []
        for token in tokens:
            t0 = time.perf_counter()
            self.ll.torch.fill_next_token_bitmask(matcher, bitmask, 0)
            times.append(time.perf_counter() - t0)
            if not matcher.consume_token(token):
                return False, times
        return matcher.is_accepting(), times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", default=str(DEFAULT_TOKENIZER))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    hf = PreTrainedTokenizerFast(tokenizer_file=str(Path(args.tokenizer) / "tokenizer.json"))
    vocab_size = json.loads((Path(args.tokenizer) / "config.json").read_text())["vocab_size"]
    eos = json.loads((Path(args.tokenizer) / "config.json").read_text())["eos_token_id"]
    eos = [eos] if isinstance(eos, int) else eos
    contenders = [XGrammar(hf, vocab_size, eos), LLGuidance(hf, vocab_size, eos)]
    encode = lambda doc: hf.encode(json.dumps(doc, separators=(",", ":")), add_special_tokens=False)  # noqa: E731
    results = {"vocab_size": vocab_size, "contenders": {}}
    compile_s = {c.name: [] for c in contenders}
    mask_s = {c.name: [] for c in contenders}
    for _ in range(args.repeats):  # interleaved: one repeat of each in turn
        for c in contenders:
            t0 = time.perf_counter()
            compiled = c.compile(NESTED)
            compile_s[c.name].append(time.perf_counter() - t0)
            ok, times = c.walk(compiled, encode(NESTED_DOC))
            assert ok, f"{c.name} rejected the nested document"
            mask_s[c.name] += times
    for c in contenders:
        coverage = {}
        for feature, (schema, good, bad) in FEATURES.items():
            try:
                compiled = c.compile(schema)
                accepts = c.walk(compiled, encode(good))[0]
                rejects = not c.walk(compiled, encode(bad))[0]
                coverage[feature] = "yes" if accepts and rejects else f"accepts valid={accepts}, rejects invalid={rejects}"
            except Exception as e:  # noqa: BLE001 - a refusal is a finding here
                coverage[feature] = f"error: {str(e)[:120]}"
        masks = sorted(mask_s[c.name])
        results["contenders"][c.name] = {
            "compile_nested_ms_median": 1e3 * statistics.median(compile_s[c.name]),
            "compile_nested_ms_all": [round(1e3 * s, 2) for s in compile_s[c.name]],
            "mask_us_per_token_median": 1e6 * statistics.median(masks),
            "mask_us_per_token_p99": 1e6 * masks[int(0.99 * (len(masks) - 1))],
            "mask_tokens_timed": len(masks),
            "coverage": coverage,
        }
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
