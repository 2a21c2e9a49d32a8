"""How a pipelined step cuts its batch into micro-batches (services/worker/pipeline.py split)."""
from __future__ import annotations

import pytest

from services.worker.pipeline import split


def test_micro_batches_are_whole_sequences_of_about_equal_tokens():
    # 16 decodes (one token each): 4 micro-batches of 4 sequences
    assert split(list(range(17)), 4) == [(0, 4), (4, 8), (8, 12), (12, 16)]
    # a 40-token prefill chunk then 8 decodes, in 2: the chunk alone, the decodes together
    assert split([0, 40] + [40 + i for i in range(1, 9)], 2) == [(0, 1), (1, 9)]


@pytest.mark.parametrize("parts", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("starts", [[0, 1], [0, 5, 6, 7], [0, 1, 2, 50], [0, 30, 31, 32, 33, 80, 81]])
def test_every_sequence_is_in_exactly_one_micro_batch_in_order(starts, parts):
    ranges = split(starts, parts)
    assert ranges[0][0] == 0 and ranges[-1][1] == len(starts) - 1
    assert all(a < b for a, b in ranges) and all(r[1] == n[0] for r, n in zip(ranges, ranges[1:]))
    assert len(ranges) == min(parts, len(starts) - 1)
