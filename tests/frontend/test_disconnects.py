"""A client that goes away hurts no one else: every request of the frontend shares one SubmitMany
call to the scheduler, so a disconnect (HTTP) or a cancel (gRPC) must end that request alone.
A real scheduler and worker (tiny random model) behind a real frontend, over real sockets."""
from __future__ import annotations

import asyncio
import http.client
import json
import random
import socket
import threading
import time

import grpc
import pytest

from pagedserve.v1 import generate_pb2_grpc
from pagedserve import build_request
from test_http_cluster import HttpCluster, serve

pytestmark = pytest.mark.slow
OTHERS = 8
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def served(tiny_llama):
    yield from serve(tiny_llama)


def body(prompt: list[int], stream: bool, max_tokens: int = MAX_TOKENS) -> bytes:
    return json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                       "stream": stream}).encode()


def prompt_of(i: int) -> list[int]:
    return [3 + (7 * i + j) % 500 for j in range(5 + i)]


def whole_text(port: int, prompt: list[int]) -> str:
    """A non-streamed completion's text (generous timeout: a loaded test machine is slow)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    connection.request("POST", "/v1/completions", body(prompt, False), {"content-type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200
    text = json.loads(response.read())["choices"][0]["text"]
    connection.close()
    return text


def streamed_text(port: int, prompt: list[int]) -> tuple[str, list[str]]:
    """The streamed completion's text and any error events (a failure mid-stream)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    connection.request("POST", "/v1/completions", body(prompt, True), {"content-type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200, response.read()
    text, errors = "", []
    for line in response:
        line = line.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            errors.append(chunk["error"]["message"])
        else:
            text += chunk["choices"][0]["text"]
    connection.close()
    return text, errors


def disconnect(port: int, prompt: list[int], after_first_chunk: bool) -> None:
    """Send a streamed request and close the socket, before or after the first chunk arrived."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    data = body(prompt, True, max_tokens=1000)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n%s" % (len(data), data))
    if after_first_chunk:
        received = b""
        while b"data: " not in received:
            received += sock.recv(65536)
    sock.close()


def wait_released(served: HttpCluster, prompt: list[int], timeout: float = 60) -> int:
    """Steps the scheduler ran from now until no request with this prompt runs any more."""
    async def watch() -> int:
        loop = served.cluster.scheduler.loop
        start, deadline = loop.num_steps, time.monotonic() + timeout
        while any(r.prompt_token_ids == prompt for r in loop.core.requests.values()):
            assert time.monotonic() < deadline, "the disconnected request still runs"
            await asyncio.sleep(0.001)
        return loop.num_steps - start
    return served.run(watch(), timeout=timeout + 10)


@pytest.mark.parametrize("after_first_chunk", [True, False], ids=["mid-stream", "before-first-chunk"])
def test_an_http_client_that_disconnects_fails_no_other_stream(served, after_first_chunk):
    port = served.frontend.http.port
    prompts = [prompt_of(i) for i in range(OTHERS)]
    want = [whole_text(port, p) for p in prompts]
    results: dict[int, tuple[str, list[str]]] = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, streamed_text(port, prompts[i])))
               for i in range(OTHERS)]
    for thread in threads:
        thread.start()
    served.run(served.cluster.wait_for(lambda s: s.num_running == OTHERS, timeout=60), timeout=90)
    leaving = prompt_of(OTHERS)
    disconnect(port, leaving, after_first_chunk)
    num_steps = wait_released(served, leaving)
    for thread in threads:
        thread.join(180)
    assert [results[i] for i in range(OTHERS)] == [(w, []) for w in want]
    assert num_steps <= 3  # its blocks were freed within a step or so of the disconnect noticed
    served.run(served.cluster.wait_idle(timeout=60), timeout=90)


@pytest.mark.parametrize("round_", range(2))
def test_random_grpc_cancels_end_only_the_cancelled_streams(served, round_):
    """200 streams started together; a random third is cancelled, half of those while the burst is
    still being submitted, the others after a few messages. The rest finish whole."""
    num, rng = 200, random.Random(5 + round_)
    cancel_after = {i: rng.choice([0, 0, 0, 1, 2, 3]) for i in rng.sample(range(num), num // 3)}
    outcomes: dict[int, object] = {}

    async def one(stub, i: int) -> None:
        call = stub.Generate(build_request(prompt_of(i % 40), max_tokens=24, temperature=0, ignore_eos=True))
        num_tokens, num_messages = 0, 0
        if cancel_after.get(i) == 0:  # before its first message
            asyncio.get_running_loop().call_later(rng.uniform(0, 0.004), call.cancel)
        try:
            async for response in call:
                num_messages += 1
                num_tokens += sum(len(s.token_ids) for s in response.samples)
                if cancel_after.get(i) == num_messages:
                    call.cancel()
            outcomes[i] = num_tokens
        except asyncio.CancelledError:
            outcomes[i] = grpc.StatusCode.CANCELLED
        except grpc.aio.AioRpcError as error:
            outcomes[i] = error.code()

    async def main() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{served.frontend.port}") as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            await asyncio.gather(*(one(stub, i) for i in range(num)))

    asyncio.run(asyncio.wait_for(main(), 300))
    wrong = {i: o for i, o in outcomes.items()
             if o != (grpc.StatusCode.CANCELLED if i in cancel_after else 24)}
    assert len(outcomes) == num and wrong == {}
    served.run(served.cluster.wait_idle(timeout=60), timeout=90)
