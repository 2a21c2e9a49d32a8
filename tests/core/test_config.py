"""The config dataclasses: each setting's default and limits in one place, what LLM(...) takes."""
from __future__ import annotations

import dataclasses

import pytest

from services.core.config import CacheConfig, EngineArgs, SchedulerConfig, WorkerConfig
from services.core.errors import InvalidArgument
from services.core.kv_events import KVEventsConfig


def test_max_model_len_comes_from_the_model_capped_at_4096():
    assert SchedulerConfig().for_model(8192).max_model_len == 4096
    assert SchedulerConfig().for_model(2048).max_model_len == 2048
    assert SchedulerConfig(max_model_len=0).max_model_len is None  # the command line's "from the model"
    assert SchedulerConfig(max_model_len=512).for_model(8192).max_model_len == 512
    with pytest.raises(InvalidArgument) as err:
        SchedulerConfig(max_model_len=5000).for_model(4096)
    assert err.value.field == "max_model_len"


def test_chunked_prefill_off_needs_a_budget_of_a_whole_prompt():
    config = SchedulerConfig(enable_chunked_prefill=False, max_num_batched_tokens=1024)
    assert config.for_model(1024).max_model_len == 1024
    with pytest.raises(InvalidArgument) as err:
        config.for_model(2048)
    assert err.value.field == "max_num_batched_tokens"


def test_llm_keywords_reach_every_config_that_holds_them():
    args = EngineArgs.from_kwargs("m", block_size=32, max_num_seqs=8, dtype="float32", num_gpu_blocks=10)
    assert args.cache_config().block_size == args.scheduler_config(2048).block_size == 32
    assert args.scheduler_config(2048).max_num_seqs == 8 and args.worker_config().dtype == "float32"
    assert args.cache_config().num_gpu_blocks == 10 and args.worker_config().model == "m"
    # in one process the requests that bring no seed draw theirs from seed 0, so LLM() repeats itself;
    # the worker's torch seed is a setting of its own
    assert args.scheduler_config(2048).seed == 0 and args.worker_config().torch_seed == 0
    both = EngineArgs.from_kwargs("m", seed=5, torch_seed=6)
    assert (both.scheduler_config(2048).seed, both.worker_config().torch_seed) == (5, 6)
    assert not args.scheduler_config(2048).async_scheduling  # the in-process engine steps synchronously


# A valid value other than the default for each setting LLM(...) takes; bools and ints are derived
# (not the default, the default + 1), a setting of another kind must be named here.
NON_DEFAULT = {
    "dtype": "bfloat16", "device": "cpu", "kernel_backend": "torch", "quantization": "int8",
    "activation_quant": "none", "cpu_isa": "generic", "group_address": "10.0.0.1:29500",
    "model_cache_dir": "/srv/models", "kernel_cache_dir": "/srv/kernels", "tokenizer": "/srv/tokenizer", "tensor_parallel_size": 2, "pipeline_parallel_size": 2, "group_rank": 3,
    "block_size": 32, "num_gpu_blocks": 10, "kv_cache_memory_bytes": 1 << 20, "max_model_len": 1024,
    "preemption_mode": "swap", "scheduling_policy": "priority", "seed": 7,
    "speculative_config": {"method": "suffix", "num_speculative_tokens": 3},
    "kv_events_config": KVEventsConfig(enable_kv_cache_events=True, publisher="null"), "task": "embed",
    "lora_modules": "sql=/srv/loras/sql",
}


def non_default(field: dataclasses.Field):
    if field.name in NON_DEFAULT:
        return NON_DEFAULT[field.name]
    if field.type == "bool":
        return not field.default
    if field.type == "int":
        return field.default + 1
    raise AssertionError(f"{field.name} ({field.type}): add a valid non-default value to NON_DEFAULT")


def test_each_non_default_llm_setting_reaches_every_config_that_holds_it():
    """LLM(...)'s keywords are split over the worker's, the cache's and the scheduler's dataclasses
    (a name in several goes to each): a value lost or sent to the wrong one shows here."""
    classes = (WorkerConfig, CacheConfig, SchedulerConfig)
    given = {f.name: non_default(f) for cls in classes for f in dataclasses.fields(cls)
             if f.name not in ("model", "async_scheduling", "distributed_backend")}  # the first argument; refused
    # in process; one valid value (gloo) until nccl works
    assert all(given[f.name] != f.default for cls in classes for f in dataclasses.fields(cls) if f.name in given)
    args = EngineArgs.from_kwargs("m", **given)
    configs = {WorkerConfig: args.worker_config(), CacheConfig: args.cache_config(),
               SchedulerConfig: args.scheduler_config(4096)}
    arrived = {}
    for cls, config in configs.items():
        for f in dataclasses.fields(cls):
            if f.name in given:
                value = getattr(config, f.name)
                arrived[(cls.__name__, f.name)] = (value if f.name != "speculative_config"
                                                   else {"method": value.method,
                                                         "num_speculative_tokens": value.num_speculative_tokens})
    assert arrived == {(cls.__name__, f.name): given[f.name]
                       for cls in classes for f in dataclasses.fields(cls) if f.name in given}
    assert (args.worker_config().model, configs[SchedulerConfig].async_scheduling) == ("m", False)


@pytest.mark.parametrize("name", ["enforce_eager", "async_scheduling"])
def test_llm_refuses_what_it_cannot_do_naming_the_argument(name):
    with pytest.raises(InvalidArgument) as err:
        EngineArgs.from_kwargs("m", **{name: True})
    assert err.value.field == name


def test_nccl_is_refused_until_the_group_runs_on_it():
    with pytest.raises(InvalidArgument, match="nccl is not supported yet") as err:
        EngineArgs.from_kwargs("m", distributed_backend="nccl").worker_config()
    assert err.value.field == "distributed_backend"


def test_enforce_eager_says_why_it_is_gone():
    with pytest.raises(InvalidArgument, match="every step already runs eagerly"):
        EngineArgs.from_kwargs("m", enforce_eager=True)


@pytest.mark.parametrize("cls", [CacheConfig, SchedulerConfig, WorkerConfig, EngineArgs])
def test_configs_are_built_with_keywords_only(cls):
    with pytest.raises(TypeError):
        cls(16) if cls is not WorkerConfig else cls("m")


def test_the_step_contract_and_updates_are_built_with_keywords_only():
    from services.core.sampling_params import SamplingParams
    from services.core.sequence import SeqUpdate
    from services.core.step import NewSequence, StepDelta, WorkerInfo

    params = SamplingParams()
    with pytest.raises(TypeError):  # two lists of ints swapped by a reordered field would go unnoticed
        NewSequence(1, [5, 6], [], [0], 0, 2, params)
    with pytest.raises(TypeError):
        SeqUpdate("r", 0, [7])
    with pytest.raises(TypeError):
        StepDelta(1, [], [], [], [], [], [], True)
    with pytest.raises(TypeError):
        WorkerInfo("m", "float32", 16, 10, 0, 100, 256, (2,), "cpu", True)
    with pytest.raises(TypeError):
        SamplingParams(1, 0.5)
    new = NewSequence(seq_id=1, prompt_token_ids=[5, 6], output_token_ids=[], block_ids=[0], num_computed_tokens=0,
                      num_scheduled_tokens=2, params=params.with_seed(7))
    assert (new.prompt_token_ids, new.block_ids, new.params.seed) == ([5, 6], [0], 7)


def test_every_dataclass_of_more_than_three_fields_takes_keywords_only():
    """Checked on the sources (services/ and kernels/*.py), so a new one is caught too."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    positional = []
    for path in sorted([*root.joinpath("services").rglob("*.py"), *root.joinpath("kernels").glob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            decorators = [ast.unparse(d) for d in node.decorator_list if "dataclass" in ast.unparse(d)]
            num_fields = sum(isinstance(b, ast.AnnAssign) and "ClassVar" not in ast.unparse(b.annotation)
                             for b in node.body)
            name = (str(path.relative_to(root)), node.name)
            if decorators and num_fields > 3 and "kw_only=True" not in decorators[0]:
                positional.append(name)
    assert positional == []
