"""The soak's requests: what each asks (Spec), how it is sent (Shot), and one client per transport.

A Shot goes over gRPC (Generate, streamed; or GenerateBatch of one, read whole) or HTTP
(/v1/completions, SSE or one JSON body), and has a fate: "normal", "disconnect" (the client
goes away after `cut` deltas, 0: before the first) or "deadline" (`deadline_s` on the call; over
HTTP the client gives up then). Its Outcome says what the client saw.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from dataclasses import dataclass, field

from stream_clients import _body_pieces, _read_head

TRANSPORTS = ("grpc-stream", "grpc-batch", "http-stream", "http-json")
DEADLINE_AS_INTERNAL = "Internal error from Core"


@dataclass(frozen=True)
class Spec:
    """A request: its prompt and sampling. The same spec gives the same tokens every time."""

    prompt: tuple[int, ...]
    params: dict = field(hash=False)


@dataclass(frozen=True)
class Shot:
    spec_index: int
    transport: str
    fate: str = "normal"  # normal, disconnect, deadline
    cut: int = 0  # disconnect: after this many deltas
    deadline_s: float = 0.0


@dataclass
class Outcome:
    kind: str  # completed, cancelled, timed_out (or timed_out_as_internal: see GrpcShots), error
    text: str = ""
    token_ids: list[int] | None = None  # gRPC only; HTTP gives the count
    num_tokens: int = 0
    error: str = ""


def make_specs(num: int, vocab_size: int, seed: int) -> list[Spec]:
    """Half greedy, half seeded sampling; prompts of 4..60 ids, 8..48 new tokens each."""
    rng = random.Random(seed)
    specs = []
    for i in range(num):
        prompt = tuple(rng.randrange(3, vocab_size) for _ in range(rng.randint(4, 60)))
        params = dict(max_tokens=rng.randint(8, 48), ignore_eos=True)
        params.update(temperature=0.0) if i % 2 == 0 else params.update(temperature=0.9, top_p=0.95, seed=7000 + i)
        specs.append(Spec(prompt, params))
    return specs


def draw_shot(rng: random.Random, num_specs: int, disconnect: float, deadline: float) -> Shot:
    roll, index, transport = rng.random(), rng.randrange(num_specs), rng.choice(TRANSPORTS)
    if roll < disconnect:
        return Shot(index, transport, "disconnect", cut=rng.randint(0, 6))
    if roll < disconnect + deadline:
        return Shot(index, transport, "deadline", deadline_s=rng.uniform(0.05, 1.5))
    return Shot(index, transport)


class GrpcShots:
    def __init__(self, address: str):
        from pagedserve import AsyncClient
        self.client = AsyncClient(address)

    async def send(self, spec: Spec, shot: Shot) -> Outcome:
        import grpc

        from pagedserve import AsyncBatchStream, AsyncStream, GenerationError, build_request
        timeout = shot.deadline_s if shot.fate == "deadline" else None
        request_id = uuid.uuid4().hex
        request = build_request(list(spec.prompt), request_id=request_id, **spec.params)
        if shot.transport == "grpc-batch":
            stream = AsyncBatchStream(self.client.stub.GenerateBatch(iter([request]), timeout=timeout),
                                      {request_id: 0})
        else:
            stream = AsyncStream(self.client.stub.Generate(request, timeout=timeout))
        text, ids, seen, started = "", [], 0, time.monotonic()
        try:
            if shot.fate == "disconnect" and shot.cut == 0:
                stream.cancel()
                return Outcome("cancelled")
            async for item in stream:
                delta = item[1] if shot.transport == "grpc-batch" else item
                text, ids, seen = text + delta.text, ids + delta.token_ids, seen + 1
                if shot.fate == "disconnect" and seen >= shot.cut:
                    stream.cancel()
                    return Outcome("cancelled", text, ids, len(ids))
        except GenerationError as error:
            if error.code == grpc.StatusCode.DEADLINE_EXCEEDED and shot.fate == "deadline":
                return Outcome("timed_out", text, ids, len(ids))
            if shot.fate == "deadline" and time.monotonic() - started >= shot.deadline_s and \
                    (error.code, error.details) == (grpc.StatusCode.INTERNAL, DEADLINE_AS_INTERNAL):
                # gRPC's deadline status is best effort: when the server's copy of the deadline fires
                # first, its RST_STREAM can reach the client as INTERNAL (grpc/grpc#2685)
                return Outcome("timed_out_as_internal", text, ids, len(ids), error=str(error))
            return Outcome("error", text, ids, len(ids), error=str(error))
        if shot.transport == "grpc-batch" and isinstance(stream.results[0], GenerationError):
            return Outcome("error", text, ids, len(ids), error=str(stream.results[0]))
        return Outcome("completed", text, ids, len(ids))

    async def close(self) -> None:
        await self.client.close()


class HttpShots:
    """POST /v1/completions on a fresh connection each (a disconnect is closing it)."""

    def __init__(self, address: str):
        host, port = address.rsplit(":", 1)
        self.host, self.port = host, int(port)

    async def send(self, spec: Spec, shot: Shot) -> Outcome:
        outcome = Outcome("cancelled")
        try:
            work = self._send(spec, shot, outcome)
            if shot.fate == "deadline":
                return await asyncio.wait_for(work, shot.deadline_s)
            return await work
        except asyncio.TimeoutError:
            outcome.kind = "timed_out"
            return outcome
        except (OSError, ValueError, KeyError, asyncio.IncompleteReadError) as error:
            outcome.kind, outcome.error = "error", f"{type(error).__name__}: {error}"
            return outcome

    async def _send(self, spec: Spec, shot: Shot, outcome: Outcome) -> Outcome:
        streaming = shot.transport == "http-stream"
        body = json.dumps({"prompt": list(spec.prompt), "stream": streaming, **spec.params,
                           **({"stream_options": {"include_usage": True}} if streaming else {})}).encode()
        reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json"
                         f"\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
            await writer.drain()
            if shot.fate == "disconnect" and shot.cut == 0:
                return outcome  # gone before the first byte of the answer
            status, chunked = await _read_head(reader)
            if status != 200:
                outcome.kind = "error"
                outcome.error = f"HTTP {status}: {(await reader.read(2000)).decode(errors='replace')}"
                return outcome
            if streaming:
                return await self._read_stream(reader, chunked, shot, outcome)
            reply = json.loads(b"".join([piece async for piece in _body_pieces(reader, chunked)]))
            outcome.text, outcome.num_tokens = reply["choices"][0]["text"], reply["usage"]["completion_tokens"]
            outcome.kind = "completed"
            return outcome
        finally:
            writer.close()

    async def _read_stream(self, reader, chunked: bool, shot: Shot, outcome: Outcome) -> Outcome:
        buffer, seen = b"", 0
        async for piece in _body_pieces(reader, chunked):
            buffer += piece
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                data = event.decode().removeprefix("data:").strip()
                if data == "[DONE]":
                    outcome.kind = "completed"
                    return outcome
                if not data:
                    continue
                message = json.loads(data)
                if "error" in message:
                    outcome.kind, outcome.error = "error", json.dumps(message["error"])
                    return outcome
                if message.get("usage"):
                    outcome.num_tokens = message["usage"]["completion_tokens"]
                outcome.text += "".join(c.get("text", "") for c in message.get("choices") or [])
                seen += 1
                if shot.fate == "disconnect" and seen >= shot.cut:
                    return outcome  # cancelled: the connection closes in _send
        outcome.kind, outcome.error = "error", "the stream ended without [DONE]"
        return outcome

    async def close(self) -> None:
        pass
