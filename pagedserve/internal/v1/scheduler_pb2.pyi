from pagedserve.internal.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SubmitRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "priority", "continued_samples", "lora_name")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CONTINUED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    priority: int
    continued_samples: _containers.RepeatedCompositeFieldContainer[ContinuedSample]
    lora_name: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., continued_samples: _Optional[_Iterable[_Union[ContinuedSample, _Mapping]]] = ..., lora_name: _Optional[str] = ...) -> None: ...

class ContinuedSample(_message.Message):
    __slots__ = ("sample_index", "token_ids")
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    sample_index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, sample_index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SampleDelta(_message.Message):
    __slots__ = ("sample_index", "token_ids", "logprobs", "finish_reason", "stop_token_id", "pooled")
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    POOLED_FIELD_NUMBER: _ClassVar[int]
    sample_index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.Logprobs]
    finish_reason: str
    stop_token_id: int
    pooled: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, sample_index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.Logprobs, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., pooled: _Optional[_Iterable[float]] = ...) -> None: ...

class SubmitResponse(_message.Message):
    __slots__ = ("deltas", "seed", "num_prompt_tokens", "num_cached_tokens", "prompt_logprobs", "queue_time_s")
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TIME_S_FIELD_NUMBER: _ClassVar[int]
    deltas: _containers.RepeatedCompositeFieldContainer[SampleDelta]
    seed: int
    num_prompt_tokens: int
    num_cached_tokens: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.OptionalLogprobs]
    queue_time_s: float
    def __init__(self, deltas: _Optional[_Iterable[_Union[SampleDelta, _Mapping]]] = ..., seed: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.OptionalLogprobs, _Mapping]]] = ..., queue_time_s: _Optional[float] = ...) -> None: ...

class SubmitManyRequest(_message.Message):
    __slots__ = ("submit", "cancel", "stop_sample")
    SUBMIT_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    STOP_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    submit: SubmitRequest
    cancel: str
    stop_sample: StopSample
    def __init__(self, submit: _Optional[_Union[SubmitRequest, _Mapping]] = ..., cancel: _Optional[str] = ..., stop_sample: _Optional[_Union[StopSample, _Mapping]] = ...) -> None: ...

class StopSample(_message.Message):
    __slots__ = ("request_id", "sample_index")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    sample_index: int
    def __init__(self, request_id: _Optional[str] = ..., sample_index: _Optional[int] = ...) -> None: ...

class RequestNews(_message.Message):
    __slots__ = ("request_id", "response", "done", "error_code", "error_message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    response: SubmitResponse
    done: bool
    error_code: int
    error_message: str
    def __init__(self, request_id: _Optional[str] = ..., response: _Optional[_Union[SubmitResponse, _Mapping]] = ..., done: _Optional[bool] = ..., error_code: _Optional[int] = ..., error_message: _Optional[str] = ...) -> None: ...

class SubmitManyResponse(_message.Message):
    __slots__ = ("news",)
    NEWS_FIELD_NUMBER: _ClassVar[int]
    news: _containers.RepeatedCompositeFieldContainer[RequestNews]
    def __init__(self, news: _Optional[_Iterable[_Union[RequestNews, _Mapping]]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("worker_id", "address", "num_gpu_blocks", "num_free_gpu_blocks", "num_cpu_blocks", "num_free_cpu_blocks", "prefix_cache_queries", "prefix_cache_hits", "num_running", "num_waiting", "num_swapped", "num_steps", "step_time_s")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_GPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_GPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_CPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAPPED_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    num_gpu_blocks: int
    num_free_gpu_blocks: int
    num_cpu_blocks: int
    num_free_cpu_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_running: int
    num_waiting: int
    num_swapped: int
    num_steps: int
    step_time_s: float
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., num_gpu_blocks: _Optional[int] = ..., num_free_gpu_blocks: _Optional[int] = ..., num_cpu_blocks: _Optional[int] = ..., num_free_cpu_blocks: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_swapped: _Optional[int] = ..., num_steps: _Optional[int] = ..., step_time_s: _Optional[float] = ...) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("num_waiting", "num_running", "num_swapped", "num_preemptions", "workers", "max_model_len", "vocab_size", "model", "num_steps", "batch_invariant", "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos", "lora_names", "lora_num_running", "lora_num_waiting")
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAPPED_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    BATCH_INVARIANT_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS_FIELD_NUMBER: _ClassVar[int]
    LORA_NAMES_FIELD_NUMBER: _ClassVar[int]
    LORA_NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    LORA_NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    num_waiting: int
    num_running: int
    num_swapped: int
    num_preemptions: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStats]
    max_model_len: int
    vocab_size: int
    model: str
    num_steps: int
    batch_invariant: bool
    spec_decode_num_drafts: int
    spec_decode_num_draft_tokens: int
    spec_decode_num_accepted_tokens: int
    spec_decode_num_accepted_tokens_per_pos: _containers.RepeatedScalarFieldContainer[int]
    lora_names: _containers.RepeatedScalarFieldContainer[str]
    lora_num_running: _containers.RepeatedScalarFieldContainer[int]
    lora_num_waiting: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., num_swapped: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerStats, _Mapping]]] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., model: _Optional[str] = ..., num_steps: _Optional[int] = ..., batch_invariant: _Optional[bool] = ..., spec_decode_num_drafts: _Optional[int] = ..., spec_decode_num_draft_tokens: _Optional[int] = ..., spec_decode_num_accepted_tokens: _Optional[int] = ..., spec_decode_num_accepted_tokens_per_pos: _Optional[_Iterable[int]] = ..., lora_names: _Optional[_Iterable[str]] = ..., lora_num_running: _Optional[_Iterable[int]] = ..., lora_num_waiting: _Optional[_Iterable[int]] = ...) -> None: ...

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("worker_id", "address", "info")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    info: _common_pb2.WorkerInfo
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., info: _Optional[_Union[_common_pb2.WorkerInfo, _Mapping]] = ...) -> None: ...

class RegisterWorkerResponse(_message.Message):
    __slots__ = ("accepted", "reason", "heartbeat_interval_s")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    heartbeat_interval_s: float
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., heartbeat_interval_s: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...
