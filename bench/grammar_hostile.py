"""Hostile constraints: compile time (or refusal) of each case, one process per (library, case).

    for c in regex_nested_quant regex_alt_star schema_depth_200 schema_enum_20k schema_str_len_1e6; do
      for w in x l; do echo "$w $c $(timeout 30 .venv/bin/python bench/grammar_hostile.py $w $c)"; done; done
"""
import json, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).parent))
from grammar_choice import XGrammar, LLGuidance, DEFAULT_TOKENIZER
from transformers import PreTrainedTokenizerFast
hf = PreTrainedTokenizerFast(tokenizer_file=str(DEFAULT_TOKENIZER / "tokenizer.json"))
which, case = sys.argv[1], sys.argv[2]
def deep(n):
    s = {"type": "integer"}
    for _ in range(n): s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
    return s
cases = {
 "regex_nested_quant": ("regex", "((a{1,100}){1,100}){1,100}"),
 "regex_alt_star": ("regex", "(a|aa|aaa)*(b|bb)*" * 20),
 "schema_depth_200": ("json", deep(200)),
 "schema_enum_20k": ("json", {"enum": [f"v{i}" for i in range(20000)]}),
 "schema_str_len_1e6": ("json", {"type": "string", "minLength": 1000000}),
}
kind, spec = cases[case]
c = (XGrammar(hf, 49152, [2]) if which == "x" else LLGuidance(hf, 49152, [2]))
t0 = time.perf_counter()
try:
    if which == "x":
        import xgrammar as xgr
        comp = xgr.GrammarCompiler(c.info, max_threads=1, cache_enabled=False)
        g = comp.compile_regex(spec) if kind == "regex" else comp.compile_json_schema(json.dumps(spec))
        m = xgr.GrammarMatcher(g); bm = xgr.allocate_token_bitmask(1, 49152); m.fill_next_token_bitmask(bm)
    else:
        import llguidance as ll, llguidance.torch
        g = ll.LLMatcher.grammar_from_regex(spec) if kind == "regex" else ll.LLMatcher.grammar_from_json_schema(json.dumps(spec))
        m = ll.LLMatcher(c.tok, g)
        if m.is_error(): raise ValueError(m.get_error())
        bm = ll.torch.allocate_token_bitmask(1, 49152); ll.torch.fill_next_token_bitmask(m, bm, 0)
        if m.is_error(): raise ValueError(m.get_error())
    print(json.dumps({"result": "compiled", "s": round(time.perf_counter() - t0, 3)}))
except Exception as e:
    print(json.dumps({"result": "refused: " + str(e)[:150], "s": round(time.perf_counter() - t0, 3)}))
