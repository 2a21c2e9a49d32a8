"""Constrained sampling in the worker: one matcher per sequence, a token mask per step.

A sequence's matcher state is a function of its output tokens only. Before each sample the
matcher is brought to the mirror's tokens: it consumes the tokens it has not seen, and rolls back
the ones the mirror no longer has (a token of an early step under async scheduling that a delta
then confirmed or not, see services/worker/async_scheduling.py). A sequence that is recomputed, swapped back in or moved to another
worker arrives as a NewSequence and gets a fresh matcher that replays its output tokens, so the
mask, and with it the sample (a pure function of seed, position, logits and mask), is the one an
undisturbed run would have used.

The mask is applied to the logits before the sampler sees them; logits never leave the worker.
Compiled grammars live in this process's `GrammarCache` (bounded, in memory). A constraint that
fails to compile here, or takes longer than the limit, was already refused by the frontend under
the same limits; should it happen anyway, the sequence is ended (only end-of-sequence allowed)
and the failure logged, so nothing a client sends can stop the step loop.
"""
from __future__ import annotations

import concurrent.futures
from pathlib import Path

import numpy as np
import structlog
import torch

from services.core.errors import InvalidArgument
from services.core.structured import Constraint, GrammarCache, GrammarLimits, make_tokenizer

log = structlog.get_logger("worker.grammar")


class SequenceGrammar:
    """One sequence's matcher and the output tokens it has consumed."""

    def __init__(self, future: concurrent.futures.Future, timeout_s: float, seq_id: int):
        self._future, self._timeout_s, self.seq_id = future, timeout_s, seq_id
        self._pristine = None  # a copy of the compiled matcher, to rebuild from
        self.matcher = None
        self.consumed: list[int] = []
        self.failed = False  # compile failed or the tokens left the grammar: only EOS from here

    def sync(self, tokens: list[int]) -> None:
        """Bring the matcher to `tokens` (the sequence's output so far)."""
        if self.failed or not self._ready():
            return
        num = len(self.consumed)
        if num > len(tokens) or (num and self.consumed[num - 1] != tokens[num - 1]):
            self._rewind(tokens)
        new = tokens[len(self.consumed):]
        if new:
            if not self.matcher.consume_tokens(new):
                self._fail("tokens outside the grammar", self.matcher.get_error())
                return
            self.consumed += new

    def num_valid(self, tokens: list[int], drafts: list[int]) -> int:
        """How many of `drafts`, after the output `tokens`, the grammar allows in a row (speculative
        decoding: the rest cannot be accepted). The matcher is left at `tokens`; the masks of the
        verify rows move it along the drafts, and the next step's sync rolls it back."""
        self.sync(tokens)
        if self.failed or self.matcher is None:
            return 0
        return self.matcher.validate_tokens(drafts)

    def fill(self, bitmask: torch.Tensor, row: int, eos_token_ids: tuple[int, ...]) -> None:
        """Write the allowed next tokens into bitmask[row] (int32 words, bit t % 32 of word t // 32)."""
        if not self.failed:
            self.matcher.unsafe_compute_mask_ptr(bitmask[row].data_ptr(), bitmask.shape[1] * 4)
            if not self.matcher.is_error():
                return
            self._fail("mask", self.matcher.get_error())
        bitmask[row] = 0
        for token in eos_token_ids:
            bitmask[row, token // 32] |= _bit(token % 32)

    def _ready(self) -> bool:
        if self.matcher is not None:
            return True
        try:
            self._pristine = self._future.result(timeout=self._timeout_s)
        except concurrent.futures.TimeoutError:
            self._fail("compile", f"took longer than {self._timeout_s} s")
            return False
        except InvalidArgument as error:
            self._fail("compile", str(error))
            return False
        self.matcher = self._pristine.deep_copy()
        return True

    def _rewind(self, tokens: list[int]) -> None:
        """Undo consumed tokens down to the common prefix with `tokens`; replay from scratch if needed."""
        keep = 0
        for a, b in zip(self.consumed, tokens):
            if a != b:
                break
            keep += 1
        if not self.matcher.rollback(len(self.consumed) - keep):
            self.matcher, keep = self._pristine.deep_copy(), 0
        del self.consumed[keep:]

    def _fail(self, what: str, detail: str) -> None:
        self.failed = True
        log.error("grammar_failed", seq_id=self.seq_id, stage=what, detail=detail[:300])


def _bit(index: int) -> int:
    """Bit `index` of an int32 word, as the signed value torch stores."""
    return -(1 << 31) if index == 31 else 1 << index


class Grammars:
    """A worker's compiler (its tokenizer, built on first use) and the masks of a step."""

    def __init__(self, tokenizer_path: Path, vocab_size: int, eos_token_ids: tuple[int, ...],
                 limits: GrammarLimits = GrammarLimits()):
        """tokenizer_path: a folder with a tokenizer.json, or a GGUF file (services/core/tokenizer.py)."""
        self.tokenizer_path, self.vocab_size, self.eos_token_ids = Path(tokenizer_path), vocab_size, eos_token_ids
        self.limits = limits
        self._cache: GrammarCache | None = None
        # compiles run here, beside the forward pass (llguidance drops the GIL while it builds)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._mask_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")

    def start(self, constraint: Constraint, seq_id: int) -> SequenceGrammar:
        """A new sequence's grammar; compiling starts now and is awaited at its first sample."""
        future = self._pool.submit(lambda: self.cache.matcher(constraint))
        return SequenceGrammar(future, 2 * self.limits.compile_timeout_s, seq_id)

    @property
    def cache(self) -> GrammarCache:
        if self._cache is None:
            from services.core.tokenizer import Tokenizer

            text = Tokenizer(self.tokenizer_path).to_json()
            self._cache = GrammarCache(make_tokenizer(text, self.vocab_size, self.eos_token_ids), self.limits)
        return self._cache

    def start_masks(self, rows: list[tuple[int, SequenceGrammar, list[int]]]) -> concurrent.futures.Future | None:
        """Build the masks of a step's constrained rows (logits row, its grammar, the sequence's output
        tokens) on a side thread, beside the forward pass; `apply` waits for them."""
        if not rows:
            return None
        return self._mask_pool.submit(self._allowed, [(row, grammar, list(tokens)) for row, grammar, tokens in rows])

    def apply(self, logits: torch.Tensor, masks: concurrent.futures.Future | None) -> None:
        """Set to -inf, in place, the logits [R, V] their grammar does not allow."""
        if masks is None:
            return
        index, allowed = masks.result()
        if logits.device.type == "cpu" and logits.is_contiguous():  # numpy, in place: one thread, no pool wake-up
            values = logits.numpy()
            for i, row in enumerate(index):
                np.putmask(values[row], allowed[i] == 0, -np.inf)
            return
        blocked = torch.from_numpy(allowed).to(logits.device) == 0  # [r, V]
        rows = torch.tensor(index, device=logits.device)
        with torch.inference_mode():  # the logits are an inference tensor
            logits[rows] = logits[rows].masked_fill_(blocked, float("-inf"))

    def mask(self, logits: torch.Tensor, rows: list[tuple[int, SequenceGrammar, list[int]]]) -> None:
        """start_masks then apply, for callers with the logits already at hand."""
        self.apply(logits, self.start_masks(rows))

    def _allowed(self, rows) -> tuple[list[int], np.ndarray]:
        """The rows' logits indices and their allowed tokens, uint8 [r, V]."""
        bitmask = torch.empty(len(rows), -(-self.vocab_size // 32), dtype=torch.int32)
        for i, (_, grammar, tokens) in enumerate(rows):
            grammar.sync(tokens)
            grammar.fill(bitmask, i, self.eos_token_ids)
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, count=self.vocab_size, bitorder="little")
        return [row for row, _, _ in rows], bits
