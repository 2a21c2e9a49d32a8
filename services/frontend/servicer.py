"""The public gRPC API: convert, call FrontendCore, convert back (services.frontend.public_codec).
Errors map to statuses in services.rpc.status."""
from __future__ import annotations

import asyncio
import collections
from contextlib import aclosing

from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import generate_pb2_grpc
from services.core.errors import InvalidArgument
from services.frontend import public_codec
from services.frontend.batch import run_batch
from services.frontend.core import FrontendCore
from services.frontend.tool_stream import ToolCallStream
from services.frontend.types import GenerateRequest, Prompt
from services.rpc.status import rpc_errors

LARGE_MESSAGE_BYTES = 64 * 1024


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(self, core: FrontendCore):
        self.core = core

    @rpc_errors
    async def Generate(self, request: pb.GenerateRequest, context):
        generate_request = await _off_loop_if_large(public_codec.generate_request_from_pb, request)
        readers = await self._reasoning_readers(generate_request)
        async with aclosing(self.core.generate(generate_request)) as events:
            async for event in events:
                response = public_codec.event_to_pb(event)
                if readers is not None:
                    public_codec.split_reasoning(response, event, readers)
                yield response

    async def _reasoning_readers(self, request: GenerateRequest):
        """Per sample, a reader of the thinking apart from the answer: for a chat prompt under a
        reasoning parser (the prompt is tokenized here, as the core would, to read where it ends)."""
        if request.prompt.messages is None or self.core.reasoning_parser is None:
            return None
        request.prompt = Prompt(token_ids=await self.core.tokenize(request.prompt))
        thinking = self.core.thinking(request.prompt.token_ids)
        if thinking is None:
            return None
        return collections.defaultdict(lambda: thinking.reader(ToolCallStream("none", set())))

    @rpc_errors
    async def GenerateBatch(self, request_iterator, context):
        async with aclosing(run_batch(self.core, _requests(request_iterator))) as batches:
            async for items in batches:
                yield public_codec.batch_to_pb(items)

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
    async def ListModels(self, request: pb.ListModelsRequest, context) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(models=[public_codec.model_card_to_pb(await self.core.model_card())])


async def _off_loop_if_large(convert_from_pb, request):
    """Convert (and check) a request; a large one on a thread, so the event loop stays free."""
    if request.ByteSize() <= LARGE_MESSAGE_BYTES:
        return convert_from_pb(request)
    return await asyncio.to_thread(convert_from_pb, request)


async def _requests(request_iterator):
    """The call's requests as (request_id, GenerateRequest); one with a bad field brings its error instead."""
    async for request in request_iterator:
        try:
            yield request.request_id, await _off_loop_if_large(public_codec.generate_request_from_pb, request)
        except InvalidArgument as error:
            yield request.request_id, error
