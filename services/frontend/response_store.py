"""The Responses API's stored responses: in memory only, bounded in entries and bytes, each kept
for a time to live. Never written to disk; a restart (or another frontend replica) forgets them.

An entry is a response body (what GET /v1/responses/{id} returns) and the conversation it ends
(the chat messages, the model's output included), which a request naming it as
`previous_response_id` continues. When a new entry would pass a bound, the oldest entries go
first; an entry larger than the byte bound alone is not kept.
"""
from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass

from services.core.config import setting
from services.core.errors import check


@dataclass(frozen=True, kw_only=True)
class ResponseStoreLimits:
    max_entries: int = setting(1024, "Responses API: stored responses kept in memory (oldest go first)",
                               flag="--responses-store-entries")
    max_bytes: int = setting(64 << 20, "Responses API: total bytes of the stored responses",
                             flag="--responses-store-bytes")
    ttl_s: float = setting(3600.0, "Responses API: seconds a stored response is kept",
                           flag="--responses-store-ttl-s")

    def __post_init__(self) -> None:
        for name in ("max_entries", "max_bytes", "ttl_s"):
            check(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}")


@dataclass(kw_only=True)
class StoredResponse:
    body: dict  # the response object
    messages: list[dict]  # the conversation, ending with the response's output
    num_bytes: int
    expires: float


class ResponseStore:
    def __init__(self, limits: ResponseStoreLimits = ResponseStoreLimits(), clock=time.monotonic):
        self.limits, self.clock = limits, clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, body: dict, messages: list[dict]) -> bool:
        """Keep the response; False when it alone is over the byte bound (then it is not kept)."""
        num_bytes = len(json.dumps(body, ensure_ascii=False)) + len(json.dumps(messages, ensure_ascii=False))
        self.delete(response_id)
        if num_bytes > self.limits.max_bytes:
            return False
        self._expire()
        while self._entries and (len(self._entries) >= self.limits.max_entries
                                 or self.num_bytes + num_bytes > self.limits.max_bytes):
            self.delete(next(iter(self._entries)))
        self._entries[response_id] = StoredResponse(body=body, messages=messages, num_bytes=num_bytes,
                                                     expires=self.clock() + self.limits.ttl_s)
        self.num_bytes += num_bytes
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.num_bytes -= entry.num_bytes
        return entry is not None

    def _expire(self) -> None:
        """Entries are in the order they were stored, so the expired ones are first."""
        now = self.clock()
        while self._entries and next(iter(self._entries.values())).expires <= now:
            self.delete(next(iter(self._entries)))
