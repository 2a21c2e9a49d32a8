"""The widths of the integers that carry a client's numbers on our wires (protos/: int32, uint32,
uint64), so that every transport refuses a number its wire cannot hold with INVALID_ARGUMENT / 400
naming the field, instead of failing later with a 500 from protobuf's encoder ("Value out of
range"). SamplingParams and FrontendCore check them for every transport; the HTTP request models
(services/frontend/http/models.py) state them in /openapi.json from these same constants."""
from __future__ import annotations

from services.core.errors import check

INT32_MIN, INT32_MAX = -2**31, 2**31 - 1
UINT32_MAX = 2**32 - 1
SEED_END = 2**63  # seeds are uint64 on the wire; SamplingParams takes [0, 2**63)


def check_int(field: str, value, low: int, high: int) -> None:
    """`value` is an int (not a bool) in [low, high], else InvalidArgument naming `field`."""
    check(isinstance(value, int) and not isinstance(value, bool) and low <= value <= high, field,
          f"must be an integer in [{low}, {high}], got {value!r}")
