"""Counter-based random numbers for sampling (docs/ARCHITECTURE.md rule 4).

A draw is a pure function of (request seed, sample index, position): nothing is
consumed from a shared generator, so a request's stream cannot depend on which other
requests share its batch, on preemption, or on the worker that runs it.
"""
from __future__ import annotations

import secrets

_MASK = 2**64 - 1
_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment (2**64 / golden ratio)


def _splitmix64(state: int) -> int:
    """One splitmix64 output for `state`: a bijective, well-mixed 64-bit hash."""
    z = (state + _GAMMA) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def derive_seed(seed: int, *keys: int) -> int:
    """A 64-bit value that is a pure function of (seed, *keys), keys in order."""
    state = _splitmix64(seed & _MASK)
    for key in keys:
        state = _splitmix64(state ^ _splitmix64(key & _MASK))
    return state


def uniform(seed: int, sample_index: int, position: int) -> float:
    """The uniform draw in [0, 1) for the token at `position` of sample `sample_index`."""
    return (derive_seed(seed, sample_index, position) >> 11) * 2.0**-53  # top 53 bits


def new_request_seed() -> int:
    """A fresh seed in [0, 2**63) for a request that brought none."""
    return secrets.randbits(63)
