"""Drafts without a model: token ids that may come next, read off text already seen. Pure Python.

A drafter only guesses; the worker's verify pass keeps a drafted token only where it equals the
token the sampler draws there (services/core/spec_decode.py), so a bad guess costs compute, never
a different output.

- `NgramDrafter` (vLLM's "ngram", prompt lookup decoding): the longest suffix of the context, of
  prompt_lookup_max down to prompt_lookup_min tokens, that occurred before; the tokens that
  followed its latest earlier occurrence.
- `SuffixDrafter` (Arctic's suffix decoding): a trie of every substring of up to `max_depth`
  tokens of the context, with counts; the longest suffix of the context found in it, then the
  most frequent continuation, token by token. A `GlobalSuffixTree`, shared by the requests of one
  scheduler, holds the outputs of finished requests, bounded in tokens (oldest out first).

Both are fed incrementally (`extend`): each new token costs O(max n) or O(depth), not a scan of
the context.
"""
from __future__ import annotations

from collections import deque


class NgramDrafter:
    """One sequence's n-gram index: each n-gram (n in [min_n, max_n]) -> where its latest
    occurrence that has a next token ends."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._next: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token after it

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            # the n-grams ending at the current last token now have a next token: `token`
            end = len(self.tokens)
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._next[tuple(self.tokens[end - n:end])] = end
            self.tokens.append(token)

    def propose(self, k: int) -> list[int]:
        tokens = self.tokens
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            start = self._next.get(tuple(tokens[len(tokens) - n:]))
            if start is not None:
                return tokens[start:start + k]
        return []


class _Node:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.count = 0


class SuffixTrie:
    """Every substring of up to `max_depth` tokens of the text fed to it, with how often it occurs.
    Fed token by token: the nodes of the suffixes ending at the last token are kept (`_active`)."""

    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self.root = _Node()
        self._active: list[_Node] = []  # nodes of the suffixes of lengths 1..max_depth-1 ending last

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            grown = []
            for node in [self.root] + self._active:
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = _Node()
                child.count += 1
                grown.append(child)
            self._active = grown[:self.max_depth - 1]

    def remove(self, tokens: list[int]) -> None:
        """Take back the counts one `extend(tokens)` from an empty context added."""
        for start in range(len(tokens)):
            node = self.root
            for token in tokens[start:start + self.max_depth]:
                child = node.children[token]
                child.count -= 1
                if child.count == 0:
                    del node.children[token]
                    break
                node = child
        self._active = []

    def match(self, context: list[int], max_len: int) -> tuple[int, _Node | None]:
        """The longest suffix of `context` (at most max_len tokens) that is in the trie and has a
        continuation: (its length, its node)."""
        for length in range(min(max_len, len(context)), 0, -1):
            node = self.root
            for token in context[len(context) - length:]:
                node = node.children.get(token)
                if node is None:
                    break
            if node is not None and node.children:
                return length, node
        return 0, None

    def match_last(self, max_len: int) -> tuple[int, _Node | None]:
        """`match` for the text fed to this trie itself, from the nodes `extend` keeps: O(max_len), no walk
        from the root per length (0.5 ms a step at depth 24 on a loaded host, against 20 us)."""
        for length in range(min(max_len, len(self._active)), 0, -1):
            node = self._active[length - 1]  # the suffix of `length` tokens ending at the last one
            if node.children:
                return length, node
        return 0, None

    @staticmethod
    def follow(node: _Node, k: int, min_count: int) -> list[int]:
        """Up to k tokens from `node`, the most frequent child each time (ties: the first seen)."""
        draft = []
        while len(draft) < k and node.children:
            token, child = max(node.children.items(), key=lambda item: item[1].count)
            if child.count < min_count:
                break
            draft.append(token)
            node = child
        return draft


class GlobalSuffixTree:
    """Outputs of finished requests, bounded: past `max_tokens` tokens the oldest output leaves."""

    def __init__(self, max_depth: int, max_tokens: int):
        self.trie = SuffixTrie(max_depth)
        self.max_tokens = max_tokens
        self._outputs: deque[list[int]] = deque()
        self.num_tokens = 0

    def add(self, output: list[int]) -> None:
        if not output or len(output) > self.max_tokens:
            return
        self.trie._active = []  # each output is its own text: no substring spans two
        self.trie.extend(output)
        self._outputs.append(list(output))
        self.num_tokens += len(output)
        while self.num_tokens > self.max_tokens:
            old = self._outputs.popleft()
            self.trie.remove(old)
            self.num_tokens -= len(old)


class SuffixDrafter:
    """One sequence's suffix trie over its prompt and output, and the scheduler's global tree."""

    def __init__(self, max_depth: int, min_count: int, global_tree: GlobalSuffixTree | None):
        self.trie = SuffixTrie(max_depth)
        self.min_count = min_count
        self.global_tree = global_tree
        self.tokens: list[int] = []

    def extend(self, tokens: list[int]) -> None:
        self.trie.extend(tokens)
        self.tokens += tokens

    def propose(self, k: int) -> list[int]:
        max_len = max(self.trie.max_depth - k, 1)  # room below the match for the draft
        length, node = self.trie.match_last(max_len)
        if self.global_tree is not None:
            global_length, global_node = self.global_tree.trie.match(self.tokens, max_len)
            if global_length > length:
                node = global_node
        return SuffixTrie.follow(node, k, self.min_count) if node is not None else []
