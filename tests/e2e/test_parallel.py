"""Tensor and pipeline parallel worker groups give the tokens and logprobs of one process, bit for bit.

Each layout is a real group: LLM(...) is rank 0 and starts the other ranks as processes, which meet
over torch.distributed (gloo) on loopback. One batch exercises what the promise covers: greedy and
seeded rows side by side, logprobs, a shared prefix (prefix-cache hits), prompts longer than the
step's token budget (chunked prefill) and a KV cache too small for everyone (preemption).
"""
from __future__ import annotations

import pytest

from services.core.errors import InvalidArgument
from services.core.sampling_params import SamplingParams
from tests.conftest import make_llm
from tests.e2e.parallel_batch import ENGINE, MODEL, batch_params, batch_prompts, bits

pytestmark = pytest.mark.slow


def _params() -> list[SamplingParams]:
    return batch_params(max_tokens=12)


def _prompts() -> list[list[int]]:
    return batch_prompts(max_len=70, seed=3, shared_prefix=20)


def _run(folder, **layout) -> tuple[list, dict]:
    with make_llm(folder, **ENGINE, **layout) as llm:
        outputs = llm.generate(_prompts(), _params(), use_tqdm=False)
        stats = llm.scheduler.stats()
    return bits(outputs), stats


@pytest.fixture(scope="module")
def folder(model_dir):
    return model_dir(**MODEL)


@pytest.fixture(scope="module")
def single(folder):
    return _run(folder)


def test_the_batch_preempts_chunks_and_hits_the_prefix_cache(single):
    outputs, stats = single
    assert stats.num_preemptions > 0
    assert sum(w.prefix_cache_hits for w in stats.workers) > 0
    assert all(len(tokens) == 12 for tokens, _, _ in outputs)


@pytest.mark.parametrize("tp, pp", [(2, 1), (4, 1), (1, 2), (2, 2), (2, 4)], ids=lambda v: str(v))
def test_layouts_give_the_bits_of_one_process(folder, single, tp, pp):
    """PP stages run micro-batches (as many as stages). Each of 2 and 4 ranks per layer group and per
    stage alone, crossed square (2 x 2) and crossed unequal (TP 2 x PP 4: a rank's stage and its place in
    the stage's group are not interchangeable there). TP 4 x PP 2 (8 processes, 11 s on 2 cores) adds no
    case: a stage's group of 4 is TP 4's group, and (2, 4) crosses unequal sizes; TP 4 x PP 4 neither."""
    outputs, _ = _run(folder, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    assert outputs == single[0]


def test_a_sequence_gives_the_same_bits_in_any_micro_batch(folder, single):
    """Eight micro-batches a step (up to one per sequence): the batch's prefill chunks and decodes land in
    micro-batches of their own or side by side, and every sequence keeps the bits of one process. Each
    stage's timers (what bench/parallel.py reads) count its compute within its pipelined passes."""
    with make_llm(folder, **ENGINE, pipeline_parallel_size=2, pipeline_micro_batches=8) as llm:
        outputs = llm.generate(_prompts(), _params(), use_tqdm=False)
        timers = next(iter(llm.engine.workers.values())).group_timers()
    assert bits(outputs) == single[0]
    assert len(timers) == 2 and all(0 < t["busy_seconds"] <= t["forward_seconds"] for t in timers)


@pytest.mark.parametrize("activation_quant", ["none", "int8"])
def test_quantized_weights_give_the_same_bits_at_tp_2(folder, activation_quant):
    """int8: o_proj and down_proj are quantized per K group, so each rank quantizes what it holds; with
    int8 activations each group folds its own chain."""
    want, _ = _run(folder, quantization="int8", activation_quant=activation_quant)
    got, _ = _run(folder, quantization="int8", activation_quant=activation_quant, tensor_parallel_size=2)
    assert got == want


def test_a_layout_the_model_cannot_take_is_refused_naming_the_constraint(folder, capfd):
    """Before any rank is spawned: a refused layout used to start every rank, each failing with a traceback."""
    with pytest.raises(InvalidArgument, match="tensor_parallel_size.*3 must divide the model's 4 row-parallel"):
        make_llm(folder, tensor_parallel_size=3)
    with pytest.raises(InvalidArgument, match="pipeline_parallel_size.*8 stages for 4 layers"):
        make_llm(folder, pipeline_parallel_size=8)
    assert "pagedserve-rank" not in capfd.readouterr().err


@pytest.mark.parametrize("activation_quant", ["none", "int8"])
def test_the_default_model_at_tp_3_and_pp_2_gives_the_bits_of_one_process(activation_quant):
    """SmolLM2-135M (9 heads, 3 KV heads, 30 layers, its GGUF's blocks): 3 reduction groups, so TP 3. PP 2
    with int8 activations is not run: a stage quantizes the activations of its own layers as one process
    does (it hands the next stage the hidden states, not quantized ones); what int8 changes, the per-group
    chains, is TP's."""
    from services.tools.default_model import ensure_default_model

    model = ensure_default_model()
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = [SamplingParams(temperature=0, max_tokens=6, logprobs=1),
              SamplingParams(temperature=0.8, seed=3, max_tokens=6, logprobs=1)]
    runs = []
    layouts = [{}, {"tensor_parallel_size": 3}] + ([{"pipeline_parallel_size": 2}] if activation_quant == "none" else [])
    for layout in layouts:
        with make_llm(model, kv_cache_memory_bytes=32 << 20, activation_quant=activation_quant, **layout) as llm:
            runs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs)
                         for o in llm.generate(prompts, params, use_tqdm=False)])
    assert all(run == runs[0] for run in runs[1:]) and len(runs) == len(layouts)
