"""The frontend process: the gRPC Generation servicer and (with http_port) the OpenAI HTTP API
over one FrontendCore in one event loop; health; draining both on SIGTERM."""
from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import grpc
import structlog

from pagedserve.v1 import generate_pb2, generate_pb2_grpc
from services.core.errors import Unavailable
from services.core.lora import parse_lora_modules
from services.core.pooling import PoolingModel
from services.core.tokenizer import Tokenizer
from services.frontend import reasoning
from services.frontend.config import FrontendConfig
from services.frontend.core import FrontendCore
from services.frontend.http.app import build_app
from services.frontend.http.server import HttpServer
from services.frontend.response_store import ResponseStore
from services.frontend.scheduler_client import SchedulerClient
from services.frontend.servicer import GenerationServicer
from services.rpc.grpc_server import GrpcServer

log = structlog.get_logger("frontend")
SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


class FrontendServer:
    """Health is SERVING while the scheduler reports a registered worker, until `drain`."""

    def __init__(self, config: FrontendConfig, tokenizer_path: Path, model_path: Path | None = None):
        """model_path: the workers' model folder (its pooling layout); the tokenizer's folder by default."""
        self.config = config
        self.scheduler = SchedulerClient(config.scheduler_address, config.scheduler_failover_timeout_s)
        tokenizer = Tokenizer(tokenizer_path)
        if config.chat_template:
            tokenizer.set_template(config.template_source())
        self.core = FrontendCore(tokenizer, self.scheduler, config.model_id, config.max_pending, config.grammar,
                                 reasoning.choose(config.reasoning_parser, tokenizer.template_source),
                                 config.template_kwargs())
        self.core.trust_request_chat_template = config.trust_request_chat_template
        self.core.pooling_model = PoolingModel.of(model_path or tokenizer_path)
        self.core.loras = parse_lora_modules(config.lora_modules)
        self.core.lora_dir, self.core.allow_any_lora_path = config.lora_dir, config.allow_any_lora_path
        servicer = GenerationServicer(self.core)
        self.grpc = GrpcServer(lambda server: generate_pb2_grpc.add_GenerationServicer_to_server(servicer, server),
                               SERVICE_NAME, config.reflection, config.max_message_bytes)
        self.http = HttpServer(build_app(self.core, lambda: self.serving, config.api_key, config.max_body_bytes,
                                         ResponseStore(config.responses)),
                               config.host, config.http_port) if config.http_port else None
        self.serving = False  # the scheduler has a ready worker (and we are not draining)
        self._watcher: asyncio.Task | None = None

    @property
    def port(self) -> int:
        return self.grpc.port

    async def start(self) -> None:
        await self.grpc.set_serving(False)
        await self.grpc.start(self.config.host, self.config.grpc_port)
        if self.http is not None:
            await self.http.start()
        self._watcher = asyncio.create_task(self._watch_scheduler())
        log.info("serving", port=self.port, http_port=self.http and self.http.port,
                 scheduler=self.config.scheduler_address, model=self.config.model)

    async def drain(self) -> None:
        """Graceful stop: NOT_SERVING, new requests UNAVAILABLE, running ones finish (up to the timeout)."""
        self.core.draining = True
        self._watcher.cancel()
        self.serving = False
        await self.grpc.set_serving(False)
        log.info("draining", num_pending=self.core.num_pending)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.drain_timeout_s
        while self.core.num_pending and loop.time() < deadline:
            await asyncio.sleep(0.05)
        await self.grpc.stop(grace=1.0)
        if self.http is not None:
            await self.http.stop()
        await self.scheduler.close()
        log.info("stopped")

    async def _watch_scheduler(self) -> None:
        ready = None
        while True:
            try:
                now_ready = await self.core.refresh()
            except (Unavailable, grpc.aio.AioRpcError) as error:
                now_ready = False
                if ready is not False:
                    log.warning("scheduler unreachable", details=str(error))
            if now_ready != ready:
                self.serving = now_ready
                await self.grpc.set_serving(now_ready)
                card = self.core.card
                log.info("health", serving=now_ready, max_model_len=card and card.max_model_len,
                         vocab_size=card and card.vocab_size)
                ready = now_ready
            lost = self.scheduler.pool.lost_event
            with contextlib.suppress(asyncio.TimeoutError):  # a lost scheduler turns health NOT_SERVING at once
                await asyncio.wait_for(lost.wait(), self.config.health_poll_s)
            lost.clear()
