"""The GPU check can only run on a CUDA machine; here, make sure it is ready to."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load_kernel_bench():
    spec = importlib.util.spec_from_file_location("kernel_bench", BENCH / "kernel_bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernel_bench"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_gpu_check_script_parses():
    assert subprocess.run(["bash", "-n", str(BENCH / "gpu_check.sh")]).returncode == 0


def test_kernel_bench_sizes_and_report_without_a_gpu():
    bench = load_kernel_bench()
    cases = dict(bench.attention_cases(smoke=False))
    assert len(cases["decode b=256 ctx=4096"]) == 256 and cases["prefill 1x2048"] == [(2048, 2048)]
    # decode, one token at 4096 context in bf16: K and V of 8 heads x 64 dims dominate
    assert bench.attention_bytes([(4096, 1)], 2) == 2 * 32 * 64 * 2 + 4096 * 8 * 64 * 2 * 2 + 256 * 4
    result = bench.Result("paged_attention", "decode b=1 ctx=128", 10**6, 20.0, 100.0, 5.0, 1e-3)
    report = bench.render_markdown([result], {"device": "test"}, 1e12, "cmd", "3 passed")
    assert "| paged_attention | decode b=1 ctx=128 | 1.00 | 20.0 | 100.0 | 5.0 | 5.0 | 4.0 | 1.00e-03 |" in report
    assert "3 passed" in report and '"x_floor": 4.0' in report


def load_bench(name: str):
    sys.path[:0] = [str(BENCH)]
    try:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        del sys.path[0]


def test_linear_bound_times_the_weights_the_engine_multiplies(model_dir):
    import torch

    from kernels.linear import plain_linear
    from kernels.ops import TORCH_OPS
    from services.worker.loader import load_model

    folder = model_dir("qwen2", "tiny")
    model = load_model(folder, torch.float32, torch.device("cpu"), TORCH_OPS, plain_linear)
    # The row-parallel weights (o_proj, down_proj) are multiplied in K groups (kernels/row_parallel.py):
    # the same weight bytes, so the bound times them whole.
    names = lambda m: (*getattr(m, "linear_weights", ()), *getattr(m, "row_parallel_weights", ()))  # noqa: E731
    engine = [tuple(getattr(m, name).shape) for m in model.modules() for name in names(m)]
    assert sorted(load_bench("linear_bound").step_shapes(folder)) == sorted(engine)


def test_roofline_pairs_each_round_with_its_own_bandwidth_probe(model_dir):
    """The host's bandwidth drifts within minutes: a round's decode steps are compared with the
    probe taken just before them, and the median over rounds is reported."""
    roofline = load_bench("roofline")
    costs = roofline.model_costs(model_dir("llama", "tiny"))
    step_bytes = roofline.decode_bytes(costs, 1, 128, 2)
    paired = [{"bandwidth_bytes_per_s": step_bytes / 0.005, "decode_step_s": 0.010},  # 50%
              {"bandwidth_bytes_per_s": step_bytes / 0.008, "decode_step_s": 0.010},  # 80%
              {"bandwidth_bytes_per_s": step_bytes / 0.007, "decode_step_s": 0.010}]  # 70%
    limits = {"bandwidth_bytes_per_s": step_bytes / 0.004, "matmul_flops_bfloat16": 1e12}
    timing = {"prefill_s": 1.0, "decode_step_s": 0.010, "paired": paired}
    row = roofline.analyse(costs, limits, "bfloat16", 1, 128, timing)
    assert abs(row["decode_bandwidth_frac"] - 0.7) < 1e-9
    assert [round(f, 9) for f in row["decode_bandwidth_frac_range"]] == [0.5, 0.8]
    assert abs(row["decode_bandwidth_frac_best_bw"] - 0.4) < 1e-9


def test_contention_policies_and_ratios():
    bench = load_bench("contention")
    assert bench.policy_env("default") == {} and bench.policy_env("passive") == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert bench.policy_env("spin:1000") == {"GOMP_SPINCOUNT": "1000"}
    with pytest.raises(SystemExit, match="spin:N"):
        bench.policy_env("lazy")
    points = [{"load": load, "batch": 1, "tokens_per_s": speed} for load, speed in ((0, 90.0), (2, 6.0), (0, 94.0))]
    passive = [{"load": 0, "batch": 1, "tokens_per_s": 45.0}, {"load": 2, "batch": 1, "tokens_per_s": 30.0}]
    rows = bench.summarize({"default": {"threads": 2, "points": points}, "passive": {"threads": 2, "points": passive}})
    by = {(r["policy"], r["load"]): r for r in rows}
    assert by["default", 0]["tokens_per_s"] == 92.0 and by["default", 0]["range"] == (90.0, 94.0)
    assert by["default", 2]["vs_own_quiet"] == 6.0 / 92.0
    assert by["passive", 2]["vs_own_quiet"] == 30.0 / 45.0 and by["passive", 2]["vs_first_policy_quiet"] == 30.0 / 92.0


def test_linear_bound_quantizes_each_format_it_names():
    """--quantizations times each weight in the named format, as the loader would hold it."""
    import torch

    bench = load_bench("linear_bound")
    weight = torch.randn(96, 64)
    for fmt, step in (("int8", 1 / 127), ("q8_0", 1 / 127), ("q4_1", 1 / 15), ("q4_0", 1 / 7)):
        quantized = bench.quantized(weight, fmt, torch.bfloat16)
        assert quantized.format == fmt and quantized.shape == weight.shape and quantized.dtype == torch.bfloat16
        assert (quantized.dequantize() - weight).abs().max() <= weight.abs().max() * step


def test_quant_reports_the_int8_divergence_with_its_top2_gap():
    """bench/quant.py compares int8 weights with fp32 ones: a divergence says our top-2 gap there."""
    bench = load_bench("quant")
    diverged = {"equal": False, "first_divergence": 17, "compared": 32, "our_top2_logprob_gap": 0.444}
    assert bench._compare_text(diverged) == "first differs at token 17 of 32 (our top-2 logprob gap there: 0.444)"
    assert bench._compare_text({"equal": True, "compared": 8}) == "token-equal (8 tokens)"


def test_llama_cpp_parity_counts_a_near_tie_only_when_both_sides_are_near_one(monkeypatch):
    """bench/activation_quality.py's parity with llama-server: a first divergence is a near-tie only
    when our top-2 gap AND llama.cpp's are under --near-tie, so one confident side makes it one to explain."""
    import types
    from services.core.step import Logprobs

    bench = load_bench("activation_quality")
    monkeypatch.setattr(bench, "full_logits", lambda model, ids: None)  # no model loaded: margins empty
    ours = [types.SimpleNamespace(token_ids=[5, 6, 7], logprobs=[None, None, Logprobs(token_id=7, logprob=-0.1, rank=1, top=((7, -0.1), (9, -0.15)))]),
            types.SimpleNamespace(token_ids=[5, 6, 7], logprobs=[None, None, Logprobs(token_id=7, logprob=-0.1, rank=1, top=((7, -0.1), (9, -0.15)))]),
            types.SimpleNamespace(token_ids=[5, 6], logprobs=[None, None])]
    theirs = [[5, 6, 9], [5, 6, 9], [5, 6]]
    tops = [[None, None, [(9, -0.1), (7, -0.12)]], [None, None, [(9, -0.1), (7, -2.0)]], [None, None]]
    result = bench.parity("gguf-int8", ours, theirs, tops, [[1], [1], [1]], {}, types.SimpleNamespace(near_tie=0.1))
    near = [(r["equal"], r["near_tie"]) for r in result["per_prompt"]]
    assert near == [(False, True), (False, False), (True, True)] and result["equal"] == 1
    assert result["per_prompt"][1]["their_margin"] == -0.1 - (-2.0)


def test_quant_serve_reports_the_fp32_ceiling_of_its_workload(tmp_path, monkeypatch):
    """The serve section says how many tok/s fp32 arithmetic allows on its workload here: the
    linear layers' FLOPs (the lm_head once per prompt, then at every decode step) at the
    machine's fp32 matmul rate, and what 10x the baseline would need."""
    bench = load_bench("quant")
    roofline = load_bench("roofline")
    monkeypatch.setitem(sys.modules, "roofline", roofline)  # what fp32_ceiling imports
    monkeypatch.setattr(roofline, "matmul_flops", lambda dtype: 1e9)  # 1 GFLOP/s
    (tmp_path / "config.json").write_text(
        '{"model_type": "llama", "hidden_size": 4, "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,'
        ' "num_key_value_heads": 1, "vocab_size": 10}')
    # per layer: q, o 4x4 each; k, v 4x2 each; gate, up, down 4x8 each: 32 + 16 + 96 = 144; lm_head 40
    workload = {"num_requests": 2, "prompt_tokens": 10, "output_tokens": 6}
    ceiling = bench.fp32_ceiling(tmp_path, workload, threads=1)
    flops = 2 * (10 * 144 + 2 * 40 + 4 * 184)
    assert ceiling["workload_flops"] == flops
    assert ceiling["max_output_tok_per_s"] == pytest.approx(6 * 1e9 / flops)
    serve = {"fp32_ceiling": ceiling, "values": {"base": [1e6]}, "baseline": "base", "workload": workload}
    text = bench._ceiling_text(serve)
    assert f"no fp32 kernel can pass {6e9 / flops:.0f} output tok/s" in text
    assert f"10x the baseline would need {10 * 1e6 * flops / 6 / 1e9:.0f} GFLOP/s" in text


def test_spec_verify_cost_runs_the_model_runner_as_the_worker_does(model_dir):
    """bench/spec.py's cost section builds the worker's own SeqState and batch: a field it no longer
    has (the seed moved into the sampling params) broke it without a test."""
    from tests.conftest import make_llm

    spec = load_bench("spec")
    with make_llm(model_dir("llama", "tiny"), num_gpu_blocks=64) as llm:
        cost = spec.verify_cost(llm, context=20, batches=(1, 2), rows=(1, 4), repeats=1)
    assert sorted(cost) == [1, 2] and all(sorted(cost[b]) == [1, 4] for b in cost)
    assert all(seconds > 0 for per_rows in cost.values() for seconds in per_rows.values())


def test_llama_server_top_k_bans_a_token_that_ends_inside_a_character_and_keeps_its_logprob():
    """llama-server omits completion_probabilities when the sampled token ends mid-UTF-8; the probabilities
    come from the raw logits, so banning the token (logit_bias) gives the same top-k, the banned one in it."""
    llamacpp = load_bench("llamacpp")
    top = [{"id": 7, "logprob": -0.1}, {"id": 9, "logprob": -2.5}, {"id": 3, "logprob": -4.0}]
    partial = {7, 9}  # tokens whose text ends inside a character
    calls = []

    def completion(prompt_ids, max_tokens, ignore_eos, **extra):
        calls.append(extra.get("logit_bias", []))
        banned = {t for t, allowed in extra.get("logit_bias", []) if allowed is False}
        sampled = next((t["id"] for t in top if t["id"] not in banned), None)
        if sampled is None:  # nothing left to sample: no token, no probabilities
            return {"tokens": [], "completion_probabilities": []}
        return {"tokens": [sampled], "completion_probabilities": [] if sampled in partial else
                [{"id": sampled, "top_logprobs": top}]}

    server = llamacpp.Server.__new__(llamacpp.Server)
    server._completion = completion
    assert server.next_token_top([1, 2], 3) == [(7, -0.1), (9, -2.5), (3, -4.0)]
    assert calls == [[], [[7, False]], [[7, False], [9, False]]]
    partial.add(3)
    with pytest.raises(RuntimeError, match=r"tokens \[7, 9, 3\] banned"):
        server.next_token_top([1, 2], 3)


def test_gguf_benches_name_a_bare_files_type_and_count_its_linear_weights(model_dir, tmp_path):
    """bench/gguf_speed.py and bench/gguf_quality.py label each file by its type, and quant.py's fp32
    ceiling counts a bare GGUF file's linear weights as roofline counts its folder's."""
    from tests.gguf_files import write_gguf

    from services.worker.model_config import ModelArchConfig

    folder = model_dir("llama", "tiny")
    path = write_gguf(folder, tmp_path / "tiny.gguf", tensor_type="q8_0",
                      types={"model.embed_tokens.weight": "f16"})
    files, quant = load_bench("gguf_files"), load_bench("quant")
    assert files.type_label(path) == "Q8_0"  # no general.file_type here: the most common block type
    mix, cfg = files.tensor_mix(path), ModelArchConfig.from_folder(folder)
    assert not cfg.tie_word_embeddings  # the output layer is a Q8_0 tensor of its own
    assert mix == {"F16": 1, "Q8_0": 7 * cfg.num_layers + 1}  # the norms' F32 left out
    assert quant.linear_params(ModelArchConfig.from_model(path)) == \
        load_bench("roofline").model_costs(folder)["linear_params"]


def test_gguf_speed_holds_each_phase_to_its_own_target():
    """A serve-only run is held to the 3x of 16 concurrent requests, not to decode's 1.5x."""
    speed = load_bench("gguf_speed")
    args = type(sys)("args")
    args.prefill_len, args.num_requests = 512, 16
    serve = {"values": {"(e) engine, GGUF Q6_K, all at once": [200.0], "(s) llama-server, 16 slots": [100.0]}}
    [row] = speed.summary_rows({"file": "x.gguf", "type": "Q6_K", "serve": serve}, args)
    assert row[2:] == ["16 concurrent", "(e) engine, GGUF Q6_K, all at once",
                       "**2.00x** (200.0 vs 100.0 tok/s; >= 3x: **missed**)"]


def test_gguf_quality_states_each_agreement_with_its_count_and_interval():
    """A results row says how many positions an agreement is over and how far it may be off: 8 of 10 is
    not 80% to the tenth of a percent (the Wilson 95% interval of 8/10 is 49.0-94.3%)."""
    quality = load_bench("gguf_quality")
    low, high = quality.wilson(8, 10)
    assert (round(low, 3), round(high, 3)) == (0.49, 0.943)
    assert quality.wilson(0, 0) == (0.0, 1.0)
    row = {"agreement": 989 / 1024, "agreeing": 989, "positions": 1024}
    assert quality.share_text(row) == "96.58% (1024 positions; 95% CI 95.3-97.5%)"


def test_machine_limits_bounds_from_a_files_tensors():
    limits = load_bench("machine_limits")
    meta = {"general.architecture": "llama", "llama.attention.head_count": 4, "llama.embedding_length": 64,
            "llama.block_count": 2}
    # (name, ggml shape [n_in, n_out(, experts)], elements, bytes as stored)
    embd, out = ("token_embd.weight", [64, 100], 6400, 6800), ("output.weight", [64, 100], 6400, 6800)
    layer = [("blk.0.attn_q.weight", [64, 64], 4096, 2304), ("blk.0.attn_norm.weight", [64], 64, 256)]
    costs = limits.tensor_costs([embd, out, *layer], meta)
    # a decode token reads one embedding row, the output layer and every other tensor once
    assert costs["decode_bytes"] == 68 + 6800 + 2304 + 256
    assert (costs["linear_macs"], costs["output_macs"], costs["attention"]) == (4096, 6400, (2, 4, 32))
    # pp8: linear layers, the output once per prompt, QK^T and PV at the causal mean context 4.5
    assert limits.prefill_macs_per_token(costs, 8) == 4096 + 6400 / 8 + 2 * 4 * 32 * 4.5
    assert limits.bounds(costs, read_bytes_per_s=9428 * 10, int8_macs_per_s=6048 * 5, prompt=8) == {
        "decode": 10.0, "prefill": 5.0}
    tied = limits.tensor_costs([embd, *layer], meta)  # the output layer is the embedding: read whole
    assert (tied["decode_bytes"], tied["output_macs"]) == (6800 + 2304 + 256, 6400)
    moe_meta = {**{k.replace("llama.", "qwen3moe."): v for k, v in meta.items()}, "general.architecture": "qwen3moe",
                "qwen3moe.expert_count": 8, "qwen3moe.expert_used_count": 2, "qwen3moe.attention.key_length": 8}
    experts = ("blk.0.ffn_up_exps.weight", [64, 32, 8], 16384, 17408)
    moe = limits.tensor_costs([embd, out, *layer, experts], moe_meta)  # batch 1 reads its 2 of 8 experts
    assert moe["decode_bytes"] == 9428 + 17408 / 4 and moe["linear_macs"] == 4096 + 16384 / 4
    assert moe["attention"] == (2, 4, 16)


def test_machine_limits_places_each_target_against_the_bound():
    limits = load_bench("machine_limits")
    decode = limits.against_bound(bound=100.0, peer=44.0, ours=43.0, target=1.5)
    assert (decode["target_tok_s"], decode["target_fraction"], decode["peer_fraction"]) == (66.0, 0.66, 0.44)
    assert limits.verdict(decode, 1.5) == "reachable in principle: 1.5x llama.cpp is 66% of the bound (llama.cpp at 44%)"
    prefill = limits.against_bound(bound=300.0, peer=132.0, ours=153.0, target=3.0)
    assert limits.verdict(prefill, 3.0) == "above the limit: 3x llama.cpp is 1.32x the bound"
    probe = {"vnni512": 2e11, "int8avx2": 9e10, "fma512": 4e10, "fma256": 4e10, "read": 4e10,
             "cpu:vnni512": 4.6e11, "cpu:int8avx2": 2.3e11, "cpu:clock": 7.2e9}
    assert limits.int8_peak(probe) == 2e11 and limits.int8_peak({**probe, "vnni512": None}) == 9e10
    assert limits.int8_peak(probe, "cpu:") == 4.6e11
    # multiply-adds per cycle per core: the CPU-time rate over the clock probe's cycles (two cores, 3.6 GHz)
    rounds = [{**probe, "cpu:clock": 4.6e11 / per} for per in (70, 64, 60)]
    assert limits.per_cycle(rounds, "vnni512") == pytest.approx(64.0)
    assert limits.summarize([probe, {**probe, "read": 2e10}, {**probe, "read": 3e10}])["read"] == {
        "median": 3e10, "best": 4e10}
