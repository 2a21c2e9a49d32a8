"""Streaming one request to the frontend and timing each delta, over gRPC (pagedserve.client) or
the OpenAI HTTP API (/v1/completions with SSE; a minimal HTTP/1.1 client on asyncio streams,
since the venv has no httpx or aiohttp). Each `stream_*` returns the arrival time of every
delta that carried tokens and the number of output tokens.
"""
from __future__ import annotations

import asyncio
import json
import time

from workload import Request


def sampling(request: Request) -> dict:
    return {"max_tokens": request.output_len, "min_tokens": request.output_len, "ignore_eos": True,
            "temperature": 0.0}


class GrpcBackend:
    def __init__(self, address: str):
        from pagedserve import AsyncClient
        self.client = AsyncClient(address)

    async def stream(self, request: Request) -> tuple[list[float], int]:
        times, tokens = [], 0
        async for delta in self.client.generate(list(request.prompt_ids), **sampling(request)):
            if delta.token_ids:
                times.append(time.perf_counter())
                tokens += len(delta.token_ids)
        return times, tokens

    async def close(self) -> None:
        await self.client.close()


class HttpBackend:
    """POST /v1/completions with stream=true; tokens from the final usage chunk."""

    def __init__(self, address: str, model: str = ""):
        host, port = address.rsplit(":", 1)
        self.host, self.port, self.model = host, int(port), model

    async def stream(self, request: Request) -> tuple[list[float], int]:
        body = json.dumps({"model": self.model, "prompt": list(request.prompt_ids), "stream": True,
                           "stream_options": {"include_usage": True}, **sampling(request)}).encode()
        reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json"
                         f"\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
            await writer.drain()
            status, chunked = await _read_head(reader)
            if status != 200:
                raise RuntimeError(f"HTTP {status}: {(await reader.read(2000)).decode(errors='replace')}")
            return await _read_events(reader, chunked)
        finally:
            writer.close()

    async def close(self) -> None:
        pass


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, bool]:
    status = int((await reader.readline()).split()[1])
    chunked = False
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        chunked |= name.strip().lower() == "transfer-encoding" and "chunked" in value.lower()
    return status, chunked


async def _body_pieces(reader: asyncio.StreamReader, chunked: bool):
    while True:
        if not chunked:
            piece = await reader.read(65536)
            if not piece:
                return
            yield piece
            continue
        size = int((await reader.readline()).strip() or b"0", 16)
        if size == 0:
            return
        yield await reader.readexactly(size)
        await reader.readline()


async def _read_events(reader: asyncio.StreamReader, chunked: bool) -> tuple[list[float], int]:
    times, tokens, buffer = [], 0, b""
    async for piece in _body_pieces(reader, chunked):
        buffer += piece
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            data = event.decode().removeprefix("data:").strip()
            if not data or data == "[DONE]":
                continue
            message = json.loads(data)
            if message.get("usage"):
                tokens = message["usage"]["completion_tokens"]
            if any(c.get("text") for c in message.get("choices") or []):
                times.append(time.perf_counter())
    return times, tokens or len(times)
