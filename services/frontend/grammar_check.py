"""The frontend's check of a structured-outputs constraint, before anything reaches the scheduler.

The constraint is compiled here with the same compiler and limits the worker uses (the frontend
owns the tokenizer), off the event loop and under a wall-clock limit, so an invalid, too large or
too slow constraint is a 400 / INVALID_ARGUMENT naming the field and never reaches a worker.
Compiled grammars are kept in a bounded in-memory cache (GrammarCache), never on disk.
"""
from __future__ import annotations

import asyncio

from services.core.errors import InvalidArgument
from services.core.structured import Constraint, GrammarCache, GrammarLimits, make_tokenizer
from services.core.tokenizer import Tokenizer


class GrammarCheck:
    def __init__(self, tokenizer: Tokenizer, limits: GrammarLimits = GrammarLimits()):
        self.tokenizer, self.limits = tokenizer, limits
        self._cache: GrammarCache | None = None
        self._building: asyncio.Future | None = None

    async def check(self, constraint: Constraint, vocab_size: int) -> None:
        """Raises InvalidArgument naming constraint.field when it cannot be compiled in time."""
        cache = await self._get_cache(vocab_size)
        compiling = asyncio.ensure_future(asyncio.to_thread(cache.matcher, constraint))
        try:  # shield: on timeout the thread finishes (llguidance's fuel bounds it) and is dropped
            await asyncio.wait_for(asyncio.shield(compiling), self.limits.compile_timeout_s)
        except TimeoutError:
            raise InvalidArgument(constraint.field, f"the {constraint.kind} did not compile within "
                                                    f"{self.limits.compile_timeout_s} s; simplify it") from None

    async def _get_cache(self, vocab_size: int) -> GrammarCache:
        if self._cache is None:  # about 1 s once: llguidance indexes the vocabulary
            if self._building is None:
                eos = (self.tokenizer.eos_token_id,) if self.tokenizer.eos_token_id is not None else ()
                self._building = asyncio.ensure_future(asyncio.to_thread(
                    make_tokenizer, self.tokenizer.to_json(), vocab_size, eos))
            self._cache = GrammarCache(await self._building, self.limits)
        return self._cache
