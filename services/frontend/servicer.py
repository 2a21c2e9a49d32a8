"""The public gRPC API: convert, call FrontendCore, convert. Errors map to statuses in services.rpc_errors."""
from __future__ import annotations

from contextlib import aclosing

from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import generate_pb2_grpc
from services.frontend import convert
from services.frontend.core import FrontendCore
from services.rpc_errors import rpc_errors


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(self, core: FrontendCore):
        self.core = core

    @rpc_errors
    async def Generate(self, request: pb.GenerateRequest, context):
        async with aclosing(self.core.generate(convert.generate_request_from_pb(request))) as events:
            async for event in events:
                yield convert.event_to_pb(event)

    @rpc_errors
    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        self.core.check_model(request.model)
        prompt = convert.tokenize_prompt_from_pb(request)
        return pb.TokenizeResponse(token_ids=self.core.tokenize(prompt), text=self.core.render(prompt))

    @rpc_errors
    async def Detokenize(self, request: pb.DetokenizeRequest, context) -> pb.DetokenizeResponse:
        convert.reject_unknown_fields(request)
        self.core.check_model(request.model)
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        return pb.DetokenizeResponse(text=self.core.detokenize(list(request.token_ids), skip))

    @rpc_errors
    async def ListModels(self, request: pb.ListModelsRequest, context) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(models=[convert.model_card_to_pb(await self.core.model_card())])
