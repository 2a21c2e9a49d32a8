"""A client to run on another host (tests/netns.py): streams requests at once through a frontend.

    python tests/e2e/stream_client.py ADDRESS JOB_JSON

JOB_JSON: {"requests": [{"prompt": ..., <AsyncClient.generate keyword arguments>}, ...],
"started_after": N}. Prints JSON lines: {"started": TOTAL} once, when N tokens have arrived over all
streams (the test acts mid-stream on it), then {"results": [{"token_ids": [...], "finish_reason": ...,
"error": null or "CODE: details"}, ...]} in request order.
"""
from __future__ import annotations

import asyncio
import json
import sys

from pagedserve import AsyncClient


async def main(address: str, job: dict) -> list[dict]:
    client = AsyncClient(address)
    total, started_after, announced = 0, job.get("started_after", 1), False

    async def one(request: dict) -> dict:
        nonlocal total, announced
        request = dict(request)
        prompt = request.pop("prompt")
        ids, reason = [], None
        try:
            async for delta in client.generate(prompt, **request):
                ids += delta.token_ids
                reason = delta.finish_reason or reason
                total += len(delta.token_ids)
                if total >= started_after and not announced:
                    announced = True
                    print(json.dumps({"started": total}), flush=True)
        except Exception as error:  # noqa: BLE001 - every failure is reported to the test, none hidden
            return {"token_ids": ids, "finish_reason": reason, "error": f"{type(error).__name__}: {error}"}
        return {"token_ids": ids, "finish_reason": reason, "error": None}

    try:
        return await asyncio.gather(*(one(r) for r in job["requests"]))
    finally:
        await client.close()


if __name__ == "__main__":
    results = asyncio.run(main(sys.argv[1], json.loads(sys.argv[2])))
    print(json.dumps({"results": results}), flush=True)
