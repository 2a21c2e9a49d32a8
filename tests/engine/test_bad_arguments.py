"""Bad engine arguments and sampling parameters raise an error that names the field."""
from __future__ import annotations

import json

import pytest

from services.core.config import CacheConfig, EngineArgs, SchedulerConfig
from services.core.errors import InvalidArgument
from services.core.sampling_params import SamplingParams
from tests.conftest import greedy, make_llm


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(temperature=-0.1), "temperature"),
    (dict(n=0), "n"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(logprobs=21), "logprobs"),
    (dict(seed=-1), "seed"),
    (dict(stop=[""]), "stop"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(InvalidArgument) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field and field in str(err.value)


@pytest.mark.parametrize("build, field", [
    (lambda: CacheConfig(block_size=12), "block_size"),
    (lambda: SchedulerConfig(preemption_mode="drop"), "preemption_mode"),
    (lambda: SchedulerConfig(scheduling_policy="random"), "scheduling_policy"),
    (lambda: SchedulerConfig(max_num_seqs=0), "max_num_seqs"),
    (lambda: EngineArgs.from_kwargs("m", blocksize=16), "blocksize"),
])
def test_bad_engine_arguments_name_the_field(build, field):
    with pytest.raises(InvalidArgument) as err:
        build()
    assert err.value.field == field


def test_llm_refuses_bad_block_size_and_long_prompt(tiny_llama):
    with pytest.raises(InvalidArgument, match="block_size"):
        make_llm(tiny_llama, block_size=64)
    llm = make_llm(tiny_llama, max_model_len=64)
    with pytest.raises(InvalidArgument) as err:
        llm.generate([[5] * 64], SamplingParams(max_tokens=4), use_tqdm=False)
    assert err.value.field == "prompt"
    assert llm.generate([[5] * 10], SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids


def test_unknown_architecture_names_model_type(tiny_llama, tmp_path):
    import shutil

    folder = tmp_path / "weird"
    shutil.copytree(tiny_llama, folder)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "gpt_neox"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidArgument) as err:
        make_llm(folder)
    assert err.value.field == "model_type" and "gpt_neox" in str(err.value)
    assert all(served in str(err.value) for served in ("llama", "qwen3", "gemma3_text"))  # what is served


def test_max_model_len_above_the_model_is_refused(tiny_llama):
    with pytest.raises(InvalidArgument) as err:
        make_llm(tiny_llama, max_model_len=10**6)
    assert err.value.field == "max_model_len"


def test_a_request_larger_than_the_kv_cache_is_refused_not_left_waiting(tiny_llama):
    """4 blocks of 16 hold 64 tokens: a longer prompt (or prompt + max_tokens) can never run."""
    import threading

    llm = make_llm(tiny_llama, num_gpu_blocks=4)
    result = {}

    def attempt(prompt, max_tokens):
        try:
            llm.generate([prompt], SamplingParams(max_tokens=max_tokens), use_tqdm=False)
        except InvalidArgument as err:
            result["field"] = err.field

    for prompt, max_tokens, field in (([5] * 80, 4, "prompt"), ([5] * 40, 60, "max_tokens")):
        result.clear()
        worker = threading.Thread(target=attempt, args=(prompt, max_tokens), daemon=True)
        worker.start()
        worker.join(timeout=20)
        assert not worker.is_alive(), "generate hung on a request that can never fit"
        assert result.get("field") == field
    assert llm.generate([[5] * 40], SamplingParams(max_tokens=20), use_tqdm=False)[0].outputs[0].token_ids


def test_token_ids_outside_the_vocabulary_and_a_bad_priority_name_the_field(tiny_llama):
    llm = make_llm(tiny_llama)
    vocab = llm.tokenizer.vocab_size
    for prompt, params, field in (([5, vocab], SamplingParams(max_tokens=2), "prompt_token_ids"),
                                  ([5, -1], SamplingParams(max_tokens=2), "prompt_token_ids"),
                                  ([5, 6], SamplingParams(max_tokens=2, logit_bias={vocab: 1.0}), "logit_bias")):
        with pytest.raises(InvalidArgument) as err:
            llm.generate([prompt], params, use_tqdm=False)
        assert err.value.field == field
    for priority in ([2 ** 31], ["high"], [0, 1]):  # outside int32, not an int, not one per prompt
        with pytest.raises(InvalidArgument) as err:
            llm.generate([[5, 6]], greedy(2), use_tqdm=False, priority=priority)
        assert err.value.field == "priority"
    assert llm.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False, priority=[-4])[0].outputs[0].token_ids


@pytest.mark.parametrize("block_id", [-1, 64])
def test_a_worker_refuses_block_ids_outside_its_cache(model_dir, block_id):
    """The compiled CPU kernels write and read the cache through these ids without bounds
    checks: a bad id from a scheduler must be an error naming the field, not a stray write."""
    from services.core.step import CachedSequence, NewSequence, StepDelta

    llm = make_llm(model_dir("llama", "tiny"), num_gpu_blocks=64)
    worker = next(iter(llm.engine.workers.values()))
    new = NewSequence(seq_id=1, prompt_token_ids=[5, 6, 7], output_token_ids=[], block_ids=[block_id],
                      num_computed_tokens=0, num_scheduled_tokens=3, params=greedy(4).with_seed(0))
    with pytest.raises(InvalidArgument, match="block_ids"):
        worker.step(StepDelta(step_id=1, new_seqs=[new]))
    new.block_ids = [0]
    assert worker.step(StepDelta(step_id=2, new_seqs=[new])).outputs, "the worker still serves"
    grown = CachedSequence(seq_id=1, new_token_ids=[9], new_block_ids=[block_id], num_computed_tokens=3,
                           num_scheduled_tokens=1)
    with pytest.raises(InvalidArgument, match="block_ids"):
        worker.step(StepDelta(step_id=3, cached_seqs=[grown]))
