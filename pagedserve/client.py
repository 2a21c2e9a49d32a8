"""A Python client for the public gRPC API (protos/pagedserve/v1/generate.proto), sync and asyncio.

    client = Client("127.0.0.1:50051")
    result = client.generate("What is the capital of France?", max_tokens=32, temperature=0)
    print(result.text, result.seed, result.num_completion_tokens)
    for delta in client.stream([{"role": "user", "content": "Hi"}], max_tokens=16):
        print(delta.text, end="", flush=True)

    async with AsyncClient("127.0.0.1:50051") as client:
        async for delta in client.generate([1, 2, 3], n=2, seed=7):
            print(delta.index, delta.text)

    results = await client.complete_batch([{"prompt": p, "max_tokens": 64} for p in prompts])  # one call

A prompt is text, a list of token ids, or a list of chat messages ({"role", "content"});
keyword arguments are the sampling parameters of the proto (max_tokens, temperature, stop,
n, logprobs, seed, logit_bias={id: bias}, ...). Errors raise GenerationError.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import uuid

import grpc

from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import generate_pb2_grpc
from pagedserve.status import code_of, split_details  # the readers services/rpc/status.py shares, no server module

_FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}


class GenerationError(Exception):
    """The server refused or failed a call: `code` is the grpc.StatusCode, `details` its message."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details

    @property
    def field(self) -> str | None:
        """The parameter at fault, for INVALID_ARGUMENT ("top_p: must be in (0, 1]" -> "top_p")."""
        return split_details(self.details)[0] if self.code == grpc.StatusCode.INVALID_ARGUMENT else None

    @classmethod
    def wrap(cls, error: grpc.RpcError) -> GenerationError:
        return cls(error.code(), error.details() or "")


@dataclass(kw_only=True)
class Logprob:
    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]  # (token id, logprob), best first


@dataclass(kw_only=True)
class Delta:
    """What one sample gained in one stream message."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[Logprob] | None = None
    finish_reason: str | None = None  # stop, length or abort once the sample ended
    stop_reason: str | int | None = None  # the stop string or stop token id


@dataclass(kw_only=True)
class Sample:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass(kw_only=True)
class Result:
    request_id: str = ""
    samples: list[Sample] = field(default_factory=list)
    prompt_logprobs: list[Logprob | None] | None = None
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    num_cached_tokens: int = 0
    seed: int = 0

    @property
    def text(self) -> str:
        return self.samples[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.samples[0].token_ids


@dataclass
class ModelInfo:
    id: str
    max_model_len: int
    vocab_size: int


def build_request(prompt: str | list[int] | list[dict], *, request_id: str = "", model: str = "",
                  priority: int = 0, add_special_tokens: bool | None = None,
                  add_generation_prompt: bool | None = None, **sampling) -> pb.GenerateRequest:
    request = pb.GenerateRequest(request_id=request_id, model=model, priority=priority)
    if isinstance(prompt, str):
        request.text = prompt
    elif prompt and all(isinstance(m, dict) for m in prompt):
        request.chat.CopyFrom(_chat(prompt, add_generation_prompt))
    else:
        request.token_ids.ids.extend(prompt)
    if add_special_tokens is not None:
        request.add_special_tokens = add_special_tokens
    for name, value in sampling.items():
        if name not in pb.SamplingParams.DESCRIPTOR.fields_by_name:
            raise TypeError(f"unknown sampling parameter {name!r}")
        if name == "logit_bias":
            request.params.logit_bias.update({int(t): float(b) for t, b in value.items()})
        elif name == "choice":  # structured outputs: the allowed strings
            request.params.choice.choices.extend(value)
        elif name in ("stop", "stop_token_ids"):
            getattr(request.params, name).extend([value] if isinstance(value, str) else value)
        elif value is not None:
            setattr(request.params, name, value)
    return request


class _Folder:
    """Folds stream messages into deltas and the final Result (`done` once the summary came)."""

    def __init__(self):
        self.result = Result()
        self.done = False

    def fold(self, response: pb.GenerateResponse) -> list[Delta]:
        result = self.result
        result.request_id = response.request_id
        if response.prompt_logprobs:
            result.prompt_logprobs = [_logprob(p.value) if p.has_value else None for p in response.prompt_logprobs]
        deltas = [_delta(s) for s in response.samples]
        for delta in deltas:
            while len(result.samples) <= delta.index:
                result.samples.append(Sample(index=len(result.samples)))
            _extend(result.samples[delta.index], delta)
        if response.HasField("summary"):
            self.done = True
            summary = response.summary
            result.num_prompt_tokens, result.num_completion_tokens = summary.num_prompt_tokens, \
                summary.num_completion_tokens
            result.num_cached_tokens, result.seed = summary.num_cached_tokens, summary.seed
        return deltas


class _CallStream:
    """A streaming call, each message folded (`folder.fold`) into the items it yields, with
    `for` on a blocking call or `async for` on an asyncio one. `cancel()` aborts the call."""

    def __init__(self, call, folder):
        self._call, self._folder = call, folder

    def __iter__(self):
        try:
            for response in self._call:
                yield from self._folder.fold(response)
        except grpc.RpcError as error:
            raise GenerationError.wrap(error) from None

    async def __aiter__(self):
        try:
            async for response in self._call:
                for item in self._folder.fold(response):
                    yield item
        except grpc.RpcError as error:  # grpc.aio.AioRpcError is one
            raise GenerationError.wrap(error) from None

    def cancel(self) -> None:
        self._call.cancel()


class Stream(_CallStream):
    """Deltas of one Generate call; `result` is complete once the iteration ends."""

    def __init__(self, call):
        super().__init__(call, _Folder())

    @property
    def result(self) -> Result:
        return self._folder.result


class AsyncStream(Stream):
    """`async for delta in stream`; `result` is complete once the iteration ends."""


def _batch_requests(requests: list[dict]) -> tuple[list[pb.GenerateRequest], dict[str, int]]:
    """Each dict: "prompt" plus build_request's keywords; ids are assigned where missing."""
    prefix = uuid.uuid4().hex[:12]
    built = [build_request(**{"request_id": f"{prefix}-{i}", **r}) for i, r in enumerate(requests)]
    ids = {request.request_id: i for i, request in enumerate(built)}
    if len(ids) != len(built):
        raise ValueError("request_id: each request of a batch needs its own (responses are matched by it)")
    return built, ids


class _BatchFolder:
    """Folds GenerateBatch messages into (index, delta) pairs and one Result or error per request."""

    def __init__(self, ids: dict[str, int]):
        self.ids, self.folders = ids, [_Folder() for _ in ids]
        self.errors: dict[int, GenerationError] = {}

    def fold(self, response: pb.GenerateBatchResponse) -> list[tuple[int, Delta]]:
        for error in response.errors:
            self.errors[error.index] = GenerationError(code_of(error.code), error.message)
        return [(self.ids[r.request_id], delta) for r in response.responses
                for delta in self.folders[self.ids[r.request_id]].fold(r)]

    @property
    def results(self) -> list[Result | GenerationError]:
        """Once the call has ended: a request with neither a summary nor an error never finished."""
        return [self.errors.get(i) or (folder.result if folder.done else
                                       GenerationError(grpc.StatusCode.UNKNOWN, "the call ended before this request"))
                for i, folder in enumerate(self.folders)]


class BatchStream(_CallStream):
    """(request index, delta) pairs of one GenerateBatch call; `results` is complete once the
    iteration ends: a Result per request, or the GenerationError it ended with."""

    def __init__(self, call, ids: dict[str, int]):
        super().__init__(call, _BatchFolder(ids))

    @property
    def results(self) -> list[Result | GenerationError]:
        return self._folder.results


class AsyncBatchStream(BatchStream):
    """`async for index, delta in stream`."""


class Client:
    """Blocking client; one channel, safe to share between threads."""

    def __init__(self, address: str = "127.0.0.1:50051"):
        self.channel = grpc.insecure_channel(address)
        self.stub = generate_pb2_grpc.GenerationStub(self.channel)

    def stream(self, prompt: str | list[int] | list[dict], **kwargs) -> Stream:
        return Stream(self.stub.Generate(build_request(prompt, **kwargs)))

    def generate(self, prompt: str | list[int] | list[dict], **kwargs) -> Result:
        stream = self.stream(prompt, **kwargs)
        for _ in stream:
            pass
        return stream.result

    def generate_batch(self, requests: list[dict]) -> BatchStream:
        """Many requests over one call (GenerateBatch); each dict is "prompt" plus the keywords of
        `generate`. Iterate for (index, delta) pairs."""
        built, ids = _batch_requests(requests)
        return BatchStream(self.stub.GenerateBatch(iter(built)), ids)

    def complete_batch(self, requests: list[dict]) -> list[Result | GenerationError]:
        stream = self.generate_batch(requests)
        for _ in stream:
            pass
        return stream.results

    def tokenize(self, prompt: str | list[dict], add_special_tokens: bool | None = None) -> list[int]:
        return list(self._call(self.stub.Tokenize, _tokenize_request(prompt, add_special_tokens)).token_ids)

    def detokenize(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        request = pb.DetokenizeRequest(token_ids=token_ids, skip_special_tokens=skip_special_tokens)
        return self._call(self.stub.Detokenize, request).text

    def list_models(self) -> list[ModelInfo]:
        return [_model(m) for m in self._call(self.stub.ListModels, pb.ListModelsRequest()).models]

    def embed(self, inputs: str | list[int] | list, dimensions: int | None = None) -> list[list[float]]:
        """One fp32 vector per input (a text or token ids; a list of them), from a model served to embed."""
        return [list(e.values) for e in self._call(self.stub.Embed, _embed_request(inputs, dimensions)).embeddings]

    def score(self, query: str, documents: list[str], instruction: str | None = None) -> list[float]:
        """Each document's relevance to the query, from a model served to score."""
        return list(self._call(self.stub.Score, _score_request(query, documents, instruction)).scores)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @staticmethod
    def _call(method, request):
        try:
            return method(request)
        except grpc.RpcError as error:
            raise GenerationError.wrap(error) from None


class AsyncClient:
    """asyncio client: `async for delta in client.generate(...)`, or `await client.complete(...)`."""

    def __init__(self, address: str = "127.0.0.1:50051"):
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = generate_pb2_grpc.GenerationStub(self.channel)

    def generate(self, prompt: str | list[int] | list[dict], **kwargs) -> AsyncStream:
        return AsyncStream(self.stub.Generate(build_request(prompt, **kwargs)))

    async def complete(self, prompt: str | list[int] | list[dict], **kwargs) -> Result:
        stream = self.generate(prompt, **kwargs)
        async for _ in stream:
            pass
        return stream.result

    def generate_batch(self, requests: list[dict]) -> AsyncBatchStream:
        """Many requests over one call (GenerateBatch); each dict is "prompt" plus the keywords of
        `generate`. `async for index, delta in ...`."""
        built, ids = _batch_requests(requests)
        return AsyncBatchStream(self.stub.GenerateBatch(iter(built)), ids)

    async def complete_batch(self, requests: list[dict]) -> list[Result | GenerationError]:
        stream = self.generate_batch(requests)
        async for _ in stream:
            pass
        return stream.results

    async def tokenize(self, prompt: str | list[dict], add_special_tokens: bool | None = None) -> list[int]:
        return list((await self._call(self.stub.Tokenize, _tokenize_request(prompt, add_special_tokens))).token_ids)

    async def detokenize(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        request = pb.DetokenizeRequest(token_ids=token_ids, skip_special_tokens=skip_special_tokens)
        return (await self._call(self.stub.Detokenize, request)).text

    async def list_models(self) -> list[ModelInfo]:
        return [_model(m) for m in (await self._call(self.stub.ListModels, pb.ListModelsRequest())).models]

    async def embed(self, inputs: str | list[int] | list, dimensions: int | None = None) -> list[list[float]]:
        reply = await self._call(self.stub.Embed, _embed_request(inputs, dimensions))
        return [list(e.values) for e in reply.embeddings]

    async def score(self, query: str, documents: list[str], instruction: str | None = None) -> list[float]:
        return list((await self._call(self.stub.Score, _score_request(query, documents, instruction))).scores)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    @staticmethod
    async def _call(method, request):
        try:
            return await method(request)
        except grpc.aio.AioRpcError as error:
            raise GenerationError.wrap(error) from None


def _embed_request(inputs: str | list[int] | list, dimensions: int | None) -> pb.EmbedRequest:
    """A text, token ids, or a list of texts and token-id lists."""
    single = isinstance(inputs, str) or (isinstance(inputs, list) and inputs and isinstance(inputs[0], int))
    items = [inputs] if single else list(inputs)
    request = pb.EmbedRequest(inputs=[pb.EmbedInput(text=i) if isinstance(i, str) else
                                      pb.EmbedInput(token_ids=pb.TokenIds(ids=i)) for i in items])
    if dimensions is not None:
        request.dimensions = dimensions
    return request


def _score_request(query: str, documents: list[str], instruction: str | None) -> pb.ScoreRequest:
    request = pb.ScoreRequest(query=query, documents=documents)
    if instruction is not None:
        request.instruction = instruction
    return request


def _chat(messages: list[dict], add_generation_prompt: bool | None) -> pb.ChatMessages:
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages])
    if add_generation_prompt is not None:
        chat.add_generation_prompt = add_generation_prompt
    return chat


def _tokenize_request(prompt: str | list[dict], add_special_tokens: bool | None) -> pb.TokenizeRequest:
    request = pb.TokenizeRequest(text=prompt) if isinstance(prompt, str) else \
        pb.TokenizeRequest(chat=_chat(prompt, None))
    if add_special_tokens is not None:
        request.add_special_tokens = add_special_tokens
    return request


def _logprob(lp: pb.Logprob) -> Logprob:
    return Logprob(
        token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank, top=[(t.token_id, t.logprob) for t in lp.top])


def _delta(sample: pb.SampleDelta) -> Delta:
    stop = sample.WhichOneof("stop_reason")
    return Delta(index=sample.index, text=sample.text, token_ids=list(sample.token_ids),
                 logprobs=[_logprob(lp) for lp in sample.logprobs] or None,
                 finish_reason=_FINISH.get(sample.finish_reason), stop_reason=getattr(sample, stop) if stop else None)


def _extend(sample: Sample, delta: Delta) -> None:
    sample.text += delta.text
    sample.token_ids += delta.token_ids
    if delta.logprobs:
        sample.logprobs = (sample.logprobs or []) + delta.logprobs
    if delta.finish_reason:
        sample.finish_reason, sample.stop_reason = delta.finish_reason, delta.stop_reason


def _model(model: pb.ModelInfo) -> ModelInfo:
    return ModelInfo(model.id, model.max_model_len, model.vocab_size)
