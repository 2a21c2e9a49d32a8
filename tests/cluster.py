"""A scheduler and workers as in-process grpc.aio servers on loopback ephemeral ports, for service tests."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc

from pagedserve.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.rpc import internal_codec
from services.core.config import CacheConfig, SchedulerConfig, WorkerConfig, split_settings
from services.core.sampling_params import SamplingParams
from services.core.step import Logprobs
from services.scheduler.config import SchedulerServiceConfig
from services.scheduler.server import SchedulerServer
from services.worker.config import WorkerServiceConfig
from services.worker.server import WorkerServer, start_worker
from tests.conftest import greedy, make_llm
from tests.waits import describe, is_idle

NUM_GPU_BLOCKS = 256


@dataclass
class Sample:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprobs] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class Generation:
    samples: dict[int, Sample] = field(default_factory=dict)
    prompt_logprobs: list[Logprobs | None] | None = None
    num_messages: int = 0

    def add(self, request_id: str, response: scheduler_pb2.SubmitResponse) -> None:
        """Fold one SubmitMany news' response into the samples."""
        self.num_messages += 1
        for update in internal_codec.updates_from_response(request_id, response):
            sample = self.samples.setdefault(update.sample_index, Sample())
            assert sample.finish_reason is None, f"{request_id}: tokens after the finish"
            sample.token_ids += update.token_ids
            sample.logprobs += update.logprobs or []
            sample.finish_reason = update.finish_reason
            if update.prompt_logprobs is not None:
                self.prompt_logprobs = update.prompt_logprobs


class Cluster:
    """A scheduler and `num_workers` workers in this process. `async with Cluster(...) as cluster:`
    starts them and stops them all on the way out, whatever happens inside (or in starting).
    worker_config: the workers' WorkerConfig settings beside model and dtype (e.g. enable_lora)."""

    def __init__(self, model, worker_config: dict | None = None, num_workers: int = 0, **scheduler_config):
        self.model = str(model)
        self.worker_config = worker_config or {}
        self.num_workers = num_workers
        service, scheduler = split_settings(scheduler_config, SchedulerServiceConfig, SchedulerConfig)
        self.scheduler = SchedulerServer(SchedulerServiceConfig(host="127.0.0.1", port=0, **service,
                                                                scheduler=SchedulerConfig(**scheduler)))
        self.workers: dict[str, WorkerServer] = {}
        self.channel = None
        self.stub = None

    async def __aenter__(self) -> Cluster:
        try:
            return await self.start()
        except BaseException:
            await self.close()
            raise

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def start(self, num_workers: int | None = None) -> Cluster:
        num_workers = self.num_workers if num_workers is None else num_workers
        port = await self.scheduler.start()
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)
        for i in range(num_workers):
            await self.add_worker(f"w{i}")
        await self.wait_for_workers(num_workers)
        return self

    async def add_worker(self, worker_id: str, scheduler_address: str | None = None) -> WorkerServer:
        address = scheduler_address or f"127.0.0.1:{self.scheduler.port}"
        server = await start_worker(WorkerConfig(model=self.model, dtype="float32", **self.worker_config),
                                    CacheConfig(block_size=16, num_gpu_blocks=NUM_GPU_BLOCKS),
                                    WorkerServiceConfig(scheduler_address=address, worker_id=worker_id,
                                                        host="127.0.0.1"))
        self.workers[worker_id] = server
        return server

    async def wait_for_workers(self, num: int, timeout: float = 10.0) -> scheduler_pb2.GetStatsResponse:
        return await self.wait_for(lambda s: len(s.workers) == num, timeout)

    async def wait_for(self, predicate, timeout: float = 10.0) -> scheduler_pb2.GetStatsResponse:
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            stats = await self.stats()
            if predicate(stats):
                return stats
            assert asyncio.get_running_loop().time() < deadline, f"timed out; last stats: {stats}"
            await asyncio.sleep(0.02)

    async def wait_idle(self, timeout: float = 5.0, num_workers: int | None = None) -> scheduler_pb2.GetStatsResponse:
        """tests/waits.py's wait_idle, awaited: the stats once nothing runs or waits and every block is free."""
        try:
            return await self.wait_for(lambda s: is_idle(s, num_workers), timeout)
        except AssertionError:
            raise AssertionError(f"not idle after {timeout:.0f}s: {describe(await self.stats())}") from None

    async def stats(self) -> scheduler_pb2.GetStatsResponse:
        return await self.stub.GetStats(scheduler_pb2.GetStatsRequest())

    def submit(self, request_id: str, prompt: list[int], params: SamplingParams) -> OneRequestCall:
        return OneRequestCall(self.stub, internal_codec.submit_to_proto(request_id, prompt, params))

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                       on_message=None) -> Generation:
        """Collect a whole stream; on_message(generation) runs after each message."""
        out = Generation()
        async for response in self.submit(request_id, prompt, params):
            out.add(request_id, response)
            if on_message is not None:
                await on_message(out)
        return out

    async def generate_killing(self, requests, after_messages: int,
                               victim: str = "w0") -> tuple[list[Generation], scheduler_pb2.GetStatsResponse]:
        """Generate every (request_id, prompt, params) at once, and stop worker `victim` abruptly (its
        in-flight calls cancelled) once a request has had `after_messages` messages. The generations,
        and the stats after them (the victim no longer registered)."""
        killed = asyncio.Event()

        async def kill_once(generation):
            if generation.num_messages == after_messages and not killed.is_set():
                killed.set()
                await self.workers.pop(victim).stop(None)

        got = await asyncio.gather(*(self.generate(request_id, prompt, params, on_message=kill_once)
                                     for request_id, prompt, params in requests))
        assert killed.is_set(), f"no request had {after_messages} messages: {victim} was not killed"
        stats = await self.stats()
        assert victim not in [w.worker_id for w in stats.workers]
        return got, stats

    async def check_idle_and_serving(self, prompt: list[int], num_workers: int | None = None) -> None:
        """After cancels or a crash: idle (every block free), and a new request is still served whole."""
        await self.wait_idle(num_workers=num_workers)
        follow_up = await self.generate("after", prompt, greedy(4))
        assert len(follow_up.samples[0].token_ids) == 4

    async def close(self) -> None:
        for server in self.workers.values():
            await server.stop(None)
        await self.scheduler.stop(None)
        if self.channel is not None:
            await self.channel.close()


class OneRequestCall:
    """One request on its own SubmitMany call, read like a server stream: `read()` gives each step's
    SubmitResponse, then grpc.aio.EOF; a refused or failed request raises AioRpcError with the status
    its RequestNews carried; `cancel()` ends the call, which aborts the request."""

    def __init__(self, stub: scheduler_pb2_grpc.SchedulerStub, request: scheduler_pb2.SubmitRequest):
        self.call = stub.SubmitMany()
        self.request = request
        self.pending: list[scheduler_pb2.RequestNews] = []
        self.sent = self.done = False

    async def read(self):
        if not self.sent:
            self.sent = True
            await self.call.write(scheduler_pb2.SubmitManyRequest(submit=self.request))
        while not self.done:
            if not self.pending:
                message = await self.call.read()
                if message is grpc.aio.EOF:
                    break
                self.pending = list(message.news)
                continue
            news = self.pending.pop(0)
            if news.error_code:
                self.done = True
                raise grpc.aio.AioRpcError(_STATUS_BY_VALUE[news.error_code], grpc.aio.Metadata(),
                                           grpc.aio.Metadata(), news.error_message)
            self.done = news.done
            if news.HasField("response"):
                return news.response
        await self.call.done_writing()
        return grpc.aio.EOF

    def cancel(self) -> None:
        self.call.cancel()

    async def __aiter__(self):
        try:
            while (response := await self.read()) is not grpc.aio.EOF:
                yield response
        finally:
            self.cancel()


_STATUS_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


# ---- the in-process reference the services must equal, bit for bit ----------------------------
VOCAB = 512  # the tiny model's


def mixed_params(i: int, max_tokens: int = 12) -> SamplingParams:
    """Greedy, seeded sampling with logprobs, n=2, prompt logprobs: one kind per i % 4."""
    return [greedy(max_tokens),
            SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i, max_tokens=max_tokens, logprobs=2),
            SamplingParams(n=2, temperature=1.0, top_k=50, seed=200 + i, max_tokens=max_tokens, logprobs=1),
            greedy(max_tokens, logprobs=0, prompt_logprobs=1)][i % 4]


def reference(model, prompts, params):
    """The in-process LLM's outputs, with the cluster's KV cache size."""
    llm = make_llm(model, dtype="float32", num_gpu_blocks=NUM_GPU_BLOCKS)
    return llm.generate(prompts, params, use_tqdm=False)


def assert_same(got: Generation, want, check_logprobs=True) -> None:
    """A cluster's generation equals the in-process RequestOutput: token ids, finish reasons and (exact) logprobs."""
    assert sorted(got.samples) == list(range(len(want.outputs)))
    for k, out in enumerate(want.outputs):
        assert got.samples[k].token_ids == out.token_ids, f"sample {k}"
        assert got.samples[k].finish_reason == out.finish_reason
        if check_logprobs and out.logprobs is not None:
            assert got.samples[k].logprobs == out.logprobs  # exact floats
    if check_logprobs:
        assert got.prompt_logprobs == want.prompt_logprobs


def run(coro):
    """Each test gets its own event loop (no pytest-asyncio here)."""
    return asyncio.run(asyncio.wait_for(coro, 60))
