from pagedserve.internal.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NewSequence(_message.Message):
    __slots__ = ("seq_id", "prompt_token_ids", "output_token_ids", "block_ids", "num_computed_tokens", "num_scheduled_tokens", "params", "sample_index", "num_samples", "lora_name", "lora_path")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    params: _common_pb2.SamplingParams
    sample_index: int
    num_samples: int
    lora_name: str
    lora_path: str
    def __init__(self, seq_id: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., num_scheduled_tokens: _Optional[int] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., sample_index: _Optional[int] = ..., num_samples: _Optional[int] = ..., lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ...) -> None: ...

class CachedSequence(_message.Message):
    __slots__ = ("seq_id", "new_token_ids", "new_block_ids", "num_computed_tokens", "num_scheduled_tokens", "draft_token_ids", "num_kept_blocks")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_KEPT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_kept_blocks: int
    def __init__(self, seq_id: _Optional[int] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., num_scheduled_tokens: _Optional[int] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., num_kept_blocks: _Optional[int] = ...) -> None: ...

class BlockPair(_message.Message):
    __slots__ = ("src", "dst")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    src: int
    dst: int
    def __init__(self, src: _Optional[int] = ..., dst: _Optional[int] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("step_id", "new_seqs", "cached_seqs", "finished_seq_ids", "blocks_to_swap_out", "blocks_to_swap_in", "blocks_to_copy", "async_next_step")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_SEQS_FIELD_NUMBER: _ClassVar[int]
    CACHED_SEQS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TO_SWAP_OUT_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TO_SWAP_IN_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TO_COPY_FIELD_NUMBER: _ClassVar[int]
    ASYNC_NEXT_STEP_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    new_seqs: _containers.RepeatedCompositeFieldContainer[NewSequence]
    cached_seqs: _containers.RepeatedCompositeFieldContainer[CachedSequence]
    finished_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    blocks_to_swap_out: _containers.RepeatedCompositeFieldContainer[BlockPair]
    blocks_to_swap_in: _containers.RepeatedCompositeFieldContainer[BlockPair]
    blocks_to_copy: _containers.RepeatedCompositeFieldContainer[BlockPair]
    async_next_step: bool
    def __init__(self, step_id: _Optional[int] = ..., new_seqs: _Optional[_Iterable[_Union[NewSequence, _Mapping]]] = ..., cached_seqs: _Optional[_Iterable[_Union[CachedSequence, _Mapping]]] = ..., finished_seq_ids: _Optional[_Iterable[int]] = ..., blocks_to_swap_out: _Optional[_Iterable[_Union[BlockPair, _Mapping]]] = ..., blocks_to_swap_in: _Optional[_Iterable[_Union[BlockPair, _Mapping]]] = ..., blocks_to_copy: _Optional[_Iterable[_Union[BlockPair, _Mapping]]] = ..., async_next_step: _Optional[bool] = ...) -> None: ...

class SeqOutput(_message.Message):
    __slots__ = ("seq_id", "token_ids", "logprobs", "pooled")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    POOLED_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.Logprobs]
    pooled: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, seq_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.Logprobs, _Mapping]]] = ..., pooled: _Optional[_Iterable[float]] = ...) -> None: ...

class PromptLogprobsChunk(_message.Message):
    __slots__ = ("seq_id", "entries")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    entries: _containers.RepeatedCompositeFieldContainer[_common_pb2.OptionalLogprobs]
    def __init__(self, seq_id: _Optional[int] = ..., entries: _Optional[_Iterable[_Union[_common_pb2.OptionalLogprobs, _Mapping]]] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("step_id", "outputs", "prompt_logprobs")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    outputs: _containers.RepeatedCompositeFieldContainer[SeqOutput]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprobsChunk]
    def __init__(self, step_id: _Optional[int] = ..., outputs: _Optional[_Iterable[_Union[SeqOutput, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprobsChunk, _Mapping]]] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
