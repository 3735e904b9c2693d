"""method="suffix": SuffixDecoding (Oliaro et al. 2024; Arctic Inference, vLLM's "suffix").

Two suffix tries with occurrence counts, both bounded to depth `suffix_decoding_max_tree_depth`:
- the local trie, over this request's prompt and the text generated so far (one per request);
- the global trie, over the outputs of earlier requests of the same engine (FIFO-evicted to
  at most `suffix_decoding_max_cached_requests` outputs and `suffix_decoding_max_cached_tokens`
  tokens; 0 requests turns it off). An output joins it when the next request begins.

Each round, every suffix of the text that occurs in a trie (match length m) is a candidate:
from its node, follow the most frequent child (ties: the most recent) while the estimated
probability of the whole path, the product of count(child) / count(node), stays at least
`suffix_decoding_min_token_prob`, for at most min(k, m * `suffix_decoding_max_spec_factor`)
tokens: the longer the match, the further we guess. The candidate with the highest score
(sum of path probabilities: the expected number of accepted tokens) wins.

Cost: appending a token moves D = max_tree_depth cursors one step each (D dict operations per
trie), so a round costs O(D * new tokens + D * k), independent of the length of the text.
Memory: a trie over n tokens has at most n * D + 1 nodes of ~140 bytes (flat lists and one
dict), far fewer on repetitive text: the local trie at most max_context * D (13 MB for 4096
tokens at D = 24), dropped when the next request begins; the global one at most
`suffix_decoding_max_cached_tokens` * D (the default 16384 tokens: 55 MB at worst).

Guesses are deterministic given the text (and the cache), so q = one-hot: lossless.
Note: with the global cache on, which guesses a request gets depends on earlier requests, so a
*seeded* sampled output may differ between runs of the same request (it is still distributed
exactly as the target's); greedy output never changes. Set the cache off
(suffix_decoding_max_cached_requests=0) where seeded runs must repeat bit for bit.
"""

from __future__ import annotations

import copy
from collections import deque

import torch

from understudy.config import SamplingParams, UnderstudyError
from understudy.drafters.base import Drafter, Proposal, positive_int, register, take_options
from understudy.models.loader import LoadedModel

_SHIFT = 32  # edge key = node << 32 | token (token ids are < 2**32)
_MASK = (1 << _SHIFT) - 1

DEFAULTS: dict[str, object] = {
    "suffix_decoding_max_tree_depth": 24,  # vLLM's defaults, except the token budget (ours)
    "suffix_decoding_max_cached_requests": 10000,
    "suffix_decoding_max_cached_tokens": 1 << 14,
    "suffix_decoding_max_spec_factor": 4.0,  # vLLM: 1.0 (see SuffixProposer)
    "suffix_decoding_min_token_prob": 0.1,
}


class SuffixTrie:
    """All substrings of length <= max_depth of some token sequences, with occurrence counts.

    Node 0 is the root. count[v] = number of occurrences of v's string; best[v] = the child
    with the highest count (the most recently incremented among equals), -1 for none.
    Insertion keeps `best` exact at O(1) per increment; removal may leave it stale (see
    `remove`).
    A *cursor* for a text is the list of nodes of its suffixes: cursor[i] is the node of the
    last i + 1 tokens; it stops at the first suffix that is not in the trie.
    """

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.child: dict[int, int] = {}  # node << 32 | token -> child node
        self.count: list[int] = [0]
        self.best: list[int] = [-1]
        self.token: list[int] = [-1]  # the token on the edge into each node
        self.free: list[int] = []  # ids of removed nodes, for reuse

    @property
    def nodes(self) -> int:
        """Live nodes, the root included."""
        return len(self.count) - len(self.free)

    def _bump(self, node: int, token: int) -> int:
        """Count one more occurrence of node's string followed by `token`; return that child."""
        key = node << _SHIFT | token
        child = self.child.get(key)
        count = self.count
        if child is None:
            if self.free:
                child = self.free.pop()
                count[child], self.best[child], self.token[child] = 1, -1, token
            else:
                child = len(count)
                count.append(1)
                self.best.append(-1)
                self.token.append(token)
            self.child[key] = child
        else:
            count[child] += 1
        best = self.best[node]
        if best < 0 or count[child] >= count[best]:
            self.best[node] = child
        return child

    def insert_step(self, cursor: list[int], token: int) -> list[int]:
        """Append `token` to the text whose cursor is given (its suffixes are all in the trie,
        down to depth max_depth): count every new suffix, return the new cursor."""
        assert 0 <= token <= _MASK
        self.count[0] += 1
        bump = self._bump
        new = [bump(0, token)]
        for i in range(min(len(cursor), self.max_depth - 1)):
            new.append(bump(cursor[i], token))
        return new

    def insert(self, tokens: list[int]) -> list[int]:
        cursor: list[int] = []
        for token in tokens:
            cursor = self.insert_step(cursor, token)
        return cursor

    def remove(self, tokens: list[int]) -> None:
        """Undo `insert(tokens)`: subtract every suffix, free the nodes no longer used. A parent
        whose best child is freed forgets it (the next increment of a child sets it again); a
        best child that merely lost count stays best (guesses may be a little worse; they are
        verified anyway)."""
        count, best, child = self.count, self.best, self.child
        for start in range(len(tokens)):
            count[0] -= 1
            node = 0
            for token in tokens[start : start + self.max_depth]:
                key = node << _SHIFT | token
                nxt = child[key]
                count[nxt] -= 1
                if count[nxt] == 0:
                    del child[key]
                    self.free.append(nxt)
                    if best[node] == nxt:
                        best[node] = -1
                node = nxt

    def follow_step(self, cursor: list[int], token: int) -> list[int]:
        """The cursor after appending `token` to a text that is not inserted (lookups only).
        A suffix missing from the trie means every longer one is missing too."""
        child = self.child
        new: list[int] = []
        node = child.get(token)  # from the root (node 0)
        if node is None:
            return new
        new.append(node)
        for i in range(min(len(cursor), self.max_depth - 1)):
            node = child.get(cursor[i] << _SHIFT | token)
            if node is None:
                break
            new.append(node)
        return new

    def cursor_for(self, tokens: list[int]) -> list[int]:
        cursor: list[int] = []
        for token in tokens[-self.max_depth :]:
            cursor = self.follow_step(cursor, token)
        return cursor

    def expand(
        self, node: int, depth: int, limit: int, min_prob: float, live: list[int] | None
    ) -> tuple[list[int], float]:
        """Follow the most frequent children of `node` (at `depth`) for at most `limit` tokens
        while the path's probability stays >= min_prob. `live`: the cursor of the text when
        the trie contains that text itself; its nodes count the occurrence at the very end,
        which has no continuation yet, so it is left out of their denominators.
        Returns (tokens, score = sum of the path probabilities of the guesses)."""
        count, best, token = self.count, self.best, self.token
        guesses: list[int] = []
        prob, score = 1.0, 0.0
        while len(guesses) < limit:
            child = best[node]
            if child < 0:
                break
            total = count[node]
            if live is not None and depth <= len(live) and live[depth - 1] == node:
                total -= 1
            if total <= 0:
                break
            prob *= count[child] / total
            if prob < min_prob:
                break
            guesses.append(token[child])
            score += prob
            node, depth = child, depth + 1
        return guesses, score

    def speculate(
        self, cursor: list[int], k: int, factor: float, min_prob: float, live: bool
    ) -> tuple[list[int], float, int]:
        """The best guesses over every match length m (the cursor's suffixes): at most
        min(k, m * factor) tokens from the match of length m. Returns (guesses, score, m)."""
        best: tuple[list[int], float, int] = ([], 0.0, 0)
        for m in range(min(len(cursor), self.max_depth - 1), 0, -1):
            limit = min(k, int(m * factor + 1e-6))
            if limit <= best[1]:  # a score never exceeds its number of guesses
                break
            guesses, score = self.expand(
                cursor[m - 1], m, limit, min_prob, cursor if live else None
            )
            if score > best[1]:
                best = (guesses, score, m)
        return best


class SuffixCache:
    """Earlier requests' outputs in one global trie, evicted first in, first out so that it
    holds at most `max_requests` outputs and `max_tokens` tokens (so at most
    max_tokens * max_depth + 1 nodes). Eviction subtracts the output's suffixes, O(max_depth)
    per evicted token, and frees the nodes whose count falls to 0."""

    def __init__(self, max_depth: int, max_requests: int, max_tokens: int) -> None:
        self.max_depth = max_depth
        self.max_requests = max_requests  # 0: off; -1: no limit on the number
        self.max_tokens = max_tokens
        self.outputs: deque[list[int]] = deque()
        self.tokens = 0
        self.trie = SuffixTrie(max_depth)
        self.version = 0  # changes with the trie: cursors into it from before are stale

    @property
    def enabled(self) -> bool:
        return self.max_requests != 0

    def add(self, output: list[int]) -> None:
        if not self.enabled or not output:
            return
        output = output[-self.max_tokens :]
        while self.outputs and (
            self.tokens + len(output) > self.max_tokens
            or 0 < self.max_requests <= len(self.outputs)
        ):
            oldest = self.outputs.popleft()
            self.tokens -= len(oldest)
            self.trie.remove(oldest)
        self.outputs.append(output)
        self.tokens += len(output)
        self.trie.insert(output)
        self.version += 1


@register("suffix")
class SuffixProposer(Drafter):
    """Suffix-trie drafting. Options (vLLM's names): suffix_decoding_max_tree_depth (24),
    suffix_decoding_max_cached_requests (10000; 0 = no cross-request cache, -1 = no limit),
    suffix_decoding_max_spec_factor (4.0; vLLM's default is 1.0), suffix_decoding_min_token_prob
    (0.1); ours: suffix_decoding_max_cached_tokens (16384), the memory bound of the
    cross-request cache.

    Why 4.0: vLLM's 1.0 suits batched GPU serving, where every guessed row costs compute others
    could use. Here an extra row costs ~3.5% of a pass (unpadded row-invariant passes), so
    guessing further along a confident match pays. Replaying the greedy outputs of the shipped
    prompts through the drafter (exact accepted lengths, cost 1 + 0.04 per guess): factor 4.0
    raised tokens per pass on 5 editing prompts (full answers) from 2.19 to 2.63 and on 5
    summarize prompts (64 tokens) from 3.37 to 4.51, and changed completion and chat by under
    0.03; 8.0 gained little more and guessed more rows."""

    @classmethod
    def from_models(
        cls, target: LoadedModel, draft: LoadedModel | None, max_context: int, **options: object
    ) -> SuffixProposer:
        opts = take_options("suffix", options, DEFAULTS)
        return cls(**{name.removeprefix("suffix_decoding_"): v for name, v in opts.items()})

    def __init__(
        self,
        max_tree_depth: int = 24,
        max_cached_requests: int = 10000,
        max_cached_tokens: int = 1 << 14,
        max_spec_factor: float = 4.0,
        min_token_prob: float = 0.1,
    ) -> None:
        self.depth = positive_int("suffix", "suffix_decoding_max_tree_depth", max_tree_depth, 2)
        requests = max_cached_requests
        if isinstance(requests, bool) or not isinstance(requests, int) or requests < -1:
            raise UnderstudyError(
                "suffix_decoding_max_cached_requests must be an integer >= -1 "
                "(0 = no cross-request cache, -1 = no limit)"
            )
        tokens = positive_int("suffix", "suffix_decoding_max_cached_tokens", max_cached_tokens)
        if not isinstance(max_spec_factor, int | float) or max_spec_factor <= 0:
            raise UnderstudyError("suffix_decoding_max_spec_factor must be a number > 0")
        if not isinstance(min_token_prob, int | float) or not 0 <= min_token_prob <= 1:
            raise UnderstudyError("suffix_decoding_min_token_prob must be in [0, 1]")
        self.factor = float(max_spec_factor)
        self.min_prob = float(min_token_prob)
        self.cache = SuffixCache(self.depth, requests, tokens)
        self.local = SuffixTrie(self.depth)
        self.local_cursor: list[int] = []
        self.global_cursor: list[int] = []
        self.seq: list[int] = []  # this request's text so far (our own copy)
        self.prompt_len = 0
        self.cursor_version = 0

    def begin(self, prompt_ids: list[int]) -> None:
        self.cache.add(self.seq[self.prompt_len :])  # the previous request's output
        self.seq = list(prompt_ids)
        self.prompt_len = len(prompt_ids)
        self.local = SuffixTrie(self.depth)
        self.local_cursor = self.local.insert(self.seq)
        self.global_cursor = self.cache.trie.cursor_for(self.seq)
        self.cursor_version = self.cache.version

    def for_seat(self, index: int) -> SuffixProposer:
        """A seat of its own with the same options, sharing the cross-request cache (another
        seat's request may change it mid-request: `_sync` then finds its cursor again)."""
        seat = copy.copy(self)
        seat.local = SuffixTrie(self.depth)
        seat.local_cursor, seat.global_cursor, seat.seq, seat.prompt_len = [], [], [], 0
        return seat

    def _sync(self, tokens: list[int]) -> None:
        n = len(self.seq)
        if len(tokens) < n or (n and tokens[n - 1] != self.seq[n - 1]):
            self.begin(tokens)  # not a continuation of what we saw: start over
            return
        local, cache = self.local, self.cache.trie
        if self.cursor_version != self.cache.version:  # the shared cache changed under us
            self.global_cursor = cache.cursor_for(self.seq)
            self.cursor_version = self.cache.version
        for token in tokens[n:]:
            self.seq.append(token)
            self.local_cursor = local.insert_step(self.local_cursor, token)
            self.global_cursor = cache.follow_step(self.global_cursor, token)

    def draft(self, tokens: list[int], k: int) -> tuple[list[int], int]:
        """Free guesses (no tensors): (up to k token ids, match length). Used by hybrid."""
        self._sync(tokens)
        guesses, score, m = self.local.speculate(
            self.local_cursor, k, self.factor, self.min_prob, live=True
        )
        if self.global_cursor:
            g_guesses, g_score, g_m = self.cache.trie.speculate(
                self.global_cursor, k, self.factor, self.min_prob, live=False
            )
            if g_score > score:
                guesses, m = g_guesses, g_m
        return guesses, m

    def propose(
        self, tokens: list[int], k: int, params: SamplingParams, generator: torch.Generator
    ) -> Proposal:
        guesses, _ = self.draft(tokens, k)
        return Proposal(torch.tensor(guesses, dtype=torch.long), None)  # q = one-hot

    def commit(self, tokens: list[int]) -> None:
        self._sync(tokens)
