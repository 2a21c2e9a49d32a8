"""A real frontend on loopback in front of a fake Scheduler servicer, for the frontend's tests.

The fake implements SubmitMany / GetStats of the internal proto with a
deterministic rule: sample i's token at position p is prompt[(i + p) % len(prompt)] (an echo),
one token per step, finishing with "length" at max_tokens; with a `script` (token ids), every sample
emits those instead, one a step, and ends with "stop" after the last. It records what reached it:
submitted requests, aborts (request id, sample index) and cancelled requests (a cancel on the
SubmitMany call, or that call ending while they ran).
"""
from __future__ import annotations

import asyncio
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.internal.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.frontend.config import FrontendConfig
from services.frontend.server import FrontendServer

MODEL_ID = "test-model"
FAKE_SEED = 1234
MAX_MODEL_LEN = 128


def echo_token(prompt: list[int], sample_index: int, position: int) -> int:
    return prompt[(sample_index + position) % len(prompt)]


def fake_logprobs(token_id: int, k: int) -> common_pb2.Logprobs:
    return common_pb2.Logprobs(token_id=token_id, logprob=-0.5, rank=1,
                               top=[common_pb2.TokenLogprob(token_id=token_id + j, logprob=-0.5 - j) for j in range(k)])


class FakeScheduler(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, vocab_size: int, max_model_len: int = MAX_MODEL_LEN, step_s: float = 0.002):
        self.vocab_size, self.max_model_len, self.step_s = vocab_size, max_model_len, step_s
        self.num_workers = 1
        self.refuse: tuple[grpc.StatusCode, str] | None = None  # refuse every submitted request with this status
        self.refuse_next: list[tuple[grpc.StatusCode, str]] = []  # refuse the next submitted requests, one each
        self.submitted: list[scheduler_pb2.SubmitRequest] = []
        self.aborts: list[tuple[str, int]] = []
        self.cancelled: list[str] = []
        self.num_calls = 0  # SubmitMany calls the frontend opened
        self.drop_calls = False  # end every open SubmitMany call with drop_status at its next message
        self.drop_status = (grpc.StatusCode.UNAVAILABLE, "the scheduler is restarting")
        self.script: list[int] | None = None  # the exact tokens every sample emits (None: the echo)

    async def SubmitMany(self, request_iterator, context):
        self.num_calls += 1
        out: asyncio.Queue = asyncio.Queue()
        running: dict[str, asyncio.Task] = {}

        async def run(request) -> None:
            try:
                async for response in self._steps(request):
                    out.put_nowait(scheduler_pb2.RequestNews(request_id=request.request_id, response=response))
                out.put_nowait(scheduler_pb2.RequestNews(request_id=request.request_id, done=True))
            except asyncio.CancelledError:
                self.cancelled.append(request.request_id)
                raise
            finally:
                running.pop(request.request_id, None)

        async def read() -> None:
            async for message in request_iterator:
                if message.WhichOneof("kind") == "cancel":
                    if message.cancel in running:
                        running[message.cancel].cancel()
                    continue
                if message.WhichOneof("kind") == "stop_sample":
                    self.aborts.append((message.stop_sample.request_id, message.stop_sample.sample_index))
                    continue
                request = message.submit
                if self.refuse or self.refuse_next:
                    code, details = self.refuse or self.refuse_next.pop(0)
                    out.put_nowait(scheduler_pb2.RequestNews(request_id=request.request_id, done=True,
                                                             error_code=code.value[0], error_message=details))
                    continue
                self.submitted.append(request)
                running[request.request_id] = asyncio.ensure_future(run(request))

        reader = asyncio.ensure_future(read())
        try:
            while True:
                news = [await out.get()]
                while not out.empty():
                    news.append(out.get_nowait())
                if self.drop_calls:
                    self.drop_calls = False
                    await context.abort(*self.drop_status)
                yield scheduler_pb2.SubmitManyResponse(news=news)
        finally:
            reader.cancel()
            for task in list(running.values()):
                task.cancel()

    async def _steps(self, request):
        """One token a step per sample; a continuation's samples (only those) from their next position."""
        params, prompt, ended = request.params, list(request.prompt_token_ids), set()
        starts = {c.sample_index: len(c.token_ids) for c in request.continued_samples} or dict.fromkeys(range(params.n), 0)
        for step in range(params.max_tokens):
            deltas = [self._delta(request, i, start + step, ended) for i, start in starts.items()
                      if i not in ended and start + step < params.max_tokens]
            if not deltas:
                return
            response = scheduler_pb2.SubmitResponse(deltas=deltas, num_prompt_tokens=len(prompt),
                                                    seed=params.seed if params.HasField("seed") else FAKE_SEED)
            if step == 0 and not request.continued_samples and params.prompt_logprobs >= 0:
                response.prompt_logprobs.extend(
                    [common_pb2.OptionalLogprobs(has_value=False)] +
                    [common_pb2.OptionalLogprobs(has_value=True, value=fake_logprobs(t, params.prompt_logprobs))
                     for t in prompt[1:]])
            yield response
            await asyncio.sleep(self.step_s)

    def _delta(self, request, index: int, position: int, ended: set[int]) -> scheduler_pb2.SampleDelta:
        if (request.request_id, index) in self.aborts:
            ended.add(index)
            return scheduler_pb2.SampleDelta(sample_index=index, finish_reason="stop")
        if self.script is not None:
            token = self.script[position]
        else:
            token = echo_token(list(request.prompt_token_ids), index, position)
        delta = scheduler_pb2.SampleDelta(sample_index=index, token_ids=[token])
        if self.script is not None and position == len(self.script) - 1 < request.params.max_tokens - 1:
            delta.finish_reason = "stop"
            ended.add(index)
        if request.params.logprobs >= 0:
            delta.logprobs.append(fake_logprobs(token, request.params.logprobs))
        if position == request.params.max_tokens - 1:
            delta.finish_reason = "length"
        return delta

    async def GetStats(self, request, context):
        return scheduler_pb2.GetStatsResponse(
            workers=[scheduler_pb2.WorkerStats(worker_id=f"w{i}") for i in range(self.num_workers)],
            max_model_len=self.max_model_len if self.num_workers else 0,
            vocab_size=self.vocab_size if self.num_workers else 0, model="fake" if self.num_workers else "")


class Harness:
    """The fake scheduler (or several: the frontend's --scheduler-address list, `fakes`) and a
    FrontendServer on one event loop in a background thread."""

    def __init__(self, model_path, vocab_size: int, num_schedulers: int = 1, **config):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.fakes = [FakeScheduler(vocab_size) for _ in range(num_schedulers)]
        self.fake = self.fakes[0]
        self.run(self._start(model_path, config))

    async def _start(self, model_path, config) -> None:
        self.fake_servers, addresses = [], []
        for fake in self.fakes:
            server = grpc.aio.server()
            scheduler_pb2_grpc.add_SchedulerServicer_to_server(fake, server)
            addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
            await server.start()
            self.fake_servers.append(server)
        self.fake_server = self.fake_servers[0]
        self.scheduler_addresses = addresses
        self.frontend = FrontendServer(FrontendConfig(
            model=MODEL_ID, scheduler_address=",".join(addresses), host="127.0.0.1", grpc_port=0,
            health_poll_s=0.02, **config), model_path)
        await self.frontend.start()
        self.address = f"127.0.0.1:{self.frontend.port}"

    def run(self, coro, timeout: float = 10):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def health(self) -> int:
        with grpc.insecure_channel(self.address) as channel:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2).status

    def wait_for(self, condition, timeout: float = 3.0) -> bool:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def close(self) -> None:
        if not self.frontend.core.draining:
            self.run(self.frontend.drain())
        for server in self.fake_servers:
            self.run(server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
