"""The public gRPC API: convert, call FrontendCore, convert back (services.frontend.public_codec).
Errors map to statuses in services.rpc.status."""
from __future__ import annotations

import asyncio
from contextlib import aclosing

from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import generate_pb2_grpc
from services.core.errors import InvalidArgument, check
from services.frontend import pooling, public_codec
from services.frontend.batch import run_batch
from services.frontend.core import FrontendCore
from services.frontend.types import GenerateRequest, Prompt
from services.rpc.status import rpc_errors

LARGE_MESSAGE_BYTES = 64 * 1024


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(self, core: FrontendCore):
        self.core = core

    @rpc_errors
    async def Generate(self, request: pb.GenerateRequest, context):
        generate_request = await _off_loop_if_large(public_codec.generate_request_from_pb, request)
        split = await reasoning_split(self.core, generate_request)
        async with aclosing(self.core.generate(generate_request)) as events:
            async for event in events:
                yield public_codec.event_to_pb(event, split)

    @rpc_errors
    async def GenerateBatch(self, request_iterator, context):
        splits: dict[str, public_codec.ReasoningSplit | None] = {}  # by request id, while the request runs
        async with aclosing(run_batch(self.core, _requests(self.core, request_iterator, splits))) as batches:
            async for items in batches:
                yield public_codec.batch_to_pb(items, splits)

    @rpc_errors
    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        self.core.check_model(request.model)
        prompt = await _off_loop_if_large(public_codec.tokenize_prompt_from_pb, request)
        return pb.TokenizeResponse(token_ids=await self.core.tokenize(prompt), text=self.core.render(prompt))

    @rpc_errors
    async def Detokenize(self, request: pb.DetokenizeRequest, context) -> pb.DetokenizeResponse:
        public_codec.reject_unknown_fields(request)
        self.core.check_model(request.model)
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        return pb.DetokenizeResponse(text=await self.core.detokenize(list(request.token_ids), skip))

    @rpc_errors
    async def Embed(self, request: pb.EmbedRequest, context) -> pb.EmbedResponse:
        public_codec.reject_unknown_fields(request)
        self.core.check_pooling_model(request.model)
        inputs = [item.text if item.WhichOneof("input") == "text" else list(item.token_ids.ids)
                  for item in request.inputs]
        dimensions = request.dimensions if request.HasField("dimensions") else None
        pooled = await pooling.embed(self.core, inputs, dimensions, field="inputs")
        return pb.EmbedResponse(embeddings=[pb.Embedding(values=p.data, num_prompt_tokens=p.num_prompt_tokens)
                                            for p in pooled])

    @rpc_errors
    async def Score(self, request: pb.ScoreRequest, context) -> pb.ScoreResponse:
        public_codec.reject_unknown_fields(request)
        self.core.check_pooling_model(request.model)
        check(len(request.query) > 0, "query", "must not be empty")
        documents = list(request.documents)
        instruction = request.instruction if request.HasField("instruction") else None
        pooled = await pooling.score(self.core, [request.query] * len(documents), documents, instruction)
        return pb.ScoreResponse(scores=[p.data[0] for p in pooled],
                                num_prompt_tokens=sum(p.num_prompt_tokens for p in pooled))

    @rpc_errors
    async def ListModels(self, request: pb.ListModelsRequest, context) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(models=[public_codec.model_card_to_pb(await self.core.model_card())])


async def _off_loop_if_large(convert_from_pb, request):
    """Convert (and check) a request; a large one on a thread, so the event loop stays free."""
    if request.ByteSize() <= LARGE_MESSAGE_BYTES:
        return convert_from_pb(request)
    return await asyncio.to_thread(convert_from_pb, request)


async def reasoning_split(core: FrontendCore, request: GenerateRequest) -> public_codec.ReasoningSplit | None:
    """The reader of the thinking apart from the answer, for a chat prompt under a reasoning parser
    (the prompt is tokenized here, as the core would, to read where it ends); None otherwise."""
    if request.prompt.messages is None or core.reasoning_parser is None:
        return None
    request.prompt = Prompt(token_ids=await core.tokenize(request.prompt))
    thinking = core.thinking(request.prompt.token_ids)
    return None if thinking is None else public_codec.ReasoningSplit(thinking)


async def _requests(core: FrontendCore, request_iterator, splits: dict):
    """The call's requests as (request_id, GenerateRequest), each one's reasoning reader put in
    `splits` (the first request of an id keeps its own: a repeated id is refused by the batch);
    one with a bad field brings its error instead."""
    async for request in request_iterator:
        try:
            generate_request = await _off_loop_if_large(public_codec.generate_request_from_pb, request)
        except InvalidArgument as error:
            yield request.request_id, error
            continue
        try:
            split = await reasoning_split(core, generate_request)
        except Exception as error:  # noqa: BLE001 - this request's error (its prompt did not render), not the call's
            yield request.request_id, error
            continue
        splits.setdefault(request.request_id, split)
        yield request.request_id, generate_request
