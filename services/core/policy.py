"""Scheduling policies as orderings, and the waiting queue kept in that order."""
from __future__ import annotations

import bisect

from services.core.sequence import Sequence


def policy_key(policy: str, seq: Sequence) -> tuple:
    """Smaller runs first. Admission order breaks ties under every policy."""
    request = seq.request
    if policy == "priority":
        return (request.priority, request.arrival, seq.sample_index)
    if policy == "sjf":  # the work left: prompt still to compute plus tokens still to generate
        remaining = seq.num_tokens - seq.num_computed_tokens + request.params.max_tokens - len(seq.output_token_ids)
        return (remaining, request.arrival, seq.sample_index)
    return (request.arrival, seq.sample_index)


class WaitingQueue:
    """Sequence ids in policy order; a preempted sequence keeps its place by its key."""

    def __init__(self, policy: str):
        self.policy = policy
        self._entries: list[tuple[tuple, int]] = []  # sorted (key, seq_id)

    def __len__(self) -> int:
        return len(self._entries)

    def push(self, seq: Sequence) -> None:
        bisect.insort(self._entries, (policy_key(self.policy, seq), seq.seq_id))

    def __iter__(self):
        """Sequence ids in policy order (a copy: the queue may change while they are read)."""
        return iter([seq_id for _, seq_id in self._entries])

    def peek(self) -> int:
        return self._entries[0][1]

    def pop(self) -> int:
        return self._entries.pop(0)[1]

    def remove(self, seq_id: int) -> None:
        for i, (_, queued) in enumerate(self._entries):
            if queued == seq_id:
                del self._entries[i]
                return
