"""method="suffix": the suffix trie (counts, cursors, removal), its memory bounds, speculation
(most frequent continuation, length growing with the match), the cross-request cache, and
greedy identity through the engine."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from understudy import Engine, SamplingParams, UnderstudyError
from understudy.drafters.suffix import SuffixCache, SuffixProposer, SuffixTrie

pytestmark = pytest.mark.usefixtures("one_thread")


def substring_counts(seqs: list[list[int]], depth: int) -> Counter:
    counts: Counter = Counter()
    for seq in seqs:
        for start in range(len(seq)):
            for end in range(start + 1, min(start + depth, len(seq)) + 1):
                counts[tuple(seq[start:end])] += 1
    return counts


def node_strings(trie: SuffixTrie) -> dict[int, tuple[int, ...]]:
    parent = {child: key >> 32 for key, child in trie.child.items()}

    def string(node: int) -> tuple[int, ...]:
        out = []
        while node:
            out.append(trie.token[node])
            node = parent[node]
        return tuple(reversed(out))

    return {node: string(node) for node in parent}


def check_trie(trie: SuffixTrie, seqs: list[list[int]], exact_best: bool = True) -> None:
    """Every substring of length <= depth is a node whose count is its number of occurrences;
    no other nodes; `best` is a most frequent child."""
    expected = substring_counts(seqs, trie.max_depth)
    strings = node_strings(trie)
    assert sorted(strings.values()) == sorted(expected)
    assert trie.nodes == len(strings) + 1
    assert trie.count[0] == sum(len(s) for s in seqs)
    for node, string in strings.items():
        assert trie.count[node] == expected[string], string
    children: dict[int, list[int]] = {}
    for key, child in trie.child.items():
        children.setdefault(key >> 32, []).append(child)
    for node, kids in children.items():
        best = trie.best[node]
        if exact_best:
            assert best in kids and trie.count[best] == max(trie.count[c] for c in kids)
        else:
            assert best == -1 or best in kids


# -- the trie ----------------------------------------------------------------------------------


def test_trie_counts_match_brute_force():
    rng = random.Random(0)
    for depth in (2, 3, 6):
        seqs = [[rng.randrange(3) for _ in range(rng.randrange(0, 30))] for _ in range(3)]
        trie = SuffixTrie(depth)
        for seq in seqs:
            trie.insert(seq)
        check_trie(trie, seqs)


def test_cursors_are_the_suffixes_found():
    rng = random.Random(1)
    trie = SuffixTrie(5)
    seq = [rng.randrange(4) for _ in range(60)]
    cursor = trie.insert(seq)
    strings = node_strings(trie)
    assert [strings[n] for n in cursor] == [tuple(seq[-i:]) for i in range(1, 6)]
    text = [rng.randrange(5) for _ in range(40)]  # 4 is never in the trie
    follow: list[int] = []
    for i, token in enumerate(text):
        follow = trie.follow_step(follow, token)
        seen = text[: i + 1]
        want = []
        for m in range(1, min(5, len(seen)) + 1):
            if tuple(seen[-m:]) not in strings.values():
                break
            want.append(tuple(seen[-m:]))
        assert [strings[n] for n in follow] == want
        assert trie.cursor_for(seen) == follow


def test_memory_bound_and_repetitive_text():
    rng = random.Random(2)
    depth = 8
    novel = [rng.randrange(10**6) for _ in range(500)]
    trie = SuffixTrie(depth)
    trie.insert(novel)
    assert trie.nodes <= 1 + len(novel) * depth
    periodic = SuffixTrie(depth)
    periodic.insert([1, 2, 3] * 300)
    assert periodic.nodes == 1 + 3 * depth  # the distinct substrings only


def test_remove_undoes_insert_and_reuses_nodes():
    rng = random.Random(3)
    trie = SuffixTrie(4)
    a = [rng.randrange(3) for _ in range(40)]
    b = [rng.randrange(3) for _ in range(40)]
    trie.insert(a)
    trie.insert(b)
    capacity = len(trie.count)
    trie.remove(a)
    check_trie(trie, [b], exact_best=False)
    trie.remove(b)
    assert trie.nodes == 1 and not trie.child and trie.count[0] == 0
    trie.insert(a)
    check_trie(trie, [a])
    assert len(trie.count) == capacity  # freed ids were reused


def test_cross_request_cache_is_bounded_and_exact():
    rng = random.Random(4)
    cache = SuffixCache(max_depth=6, max_requests=4, max_tokens=200)
    kept: list[list[int]] = []
    for _ in range(40):
        output = [rng.randrange(5) for _ in range(rng.randrange(1, 90))]
        cache.add(output)
        kept.append(output)
        while sum(map(len, kept)) > 200 or len(kept) > 4:
            kept.pop(0)
        assert list(cache.outputs) == kept and cache.tokens == sum(map(len, kept))
        assert cache.trie.nodes <= 1 + 200 * 6
        check_trie(cache.trie, kept, exact_best=False)
    assert len(cache.trie.count) <= 1 + 200 * 6  # never more ids than the bound


def test_cache_off_and_oversized_output():
    off = SuffixCache(max_depth=4, max_requests=0, max_tokens=100)
    off.add([1, 2, 3])
    assert off.tokens == 0 and off.trie.nodes == 1
    small = SuffixCache(max_depth=4, max_requests=-1, max_tokens=10)
    small.add(list(range(25)))
    assert small.tokens == 10 and list(small.outputs) == [list(range(15, 25))]


# -- speculation -------------------------------------------------------------------------------


def fresh(prompt: list[int], **options) -> SuffixProposer:
    proposer = SuffixProposer(**options)
    proposer.begin(prompt)
    return proposer


def test_speculation_length_grows_with_match_length():
    text = list(range(100, 140))  # 40 distinct tokens
    for m in (1, 3, 5, 8):
        proposer = fresh(text + text[:m], max_tree_depth=24, max_spec_factor=1.0)
        guesses, match = proposer.draft(text + text[:m], 30)
        assert match == m
        assert guesses == text[m : 2 * m]  # m * max_spec_factor (1.0) tokens
        if m <= 3:  # the default factor, 4.0 (within the trie's depth of 24)
            assert fresh(text + text[:m]).draft(text + text[:m], 30)[0] == text[m : 5 * m]
    proposer = fresh(text + text[:4], max_spec_factor=2.5)
    assert proposer.draft(text + text[:4], 30)[0] == text[4:14]
    assert fresh(text + text[:8]).draft(text + text[:8], 3)[0] == text[8:11]  # k caps


def test_most_frequent_continuation_wins():
    # (1, 2) is followed by 7 twice, by 9 once (most recently)
    text = [1, 2, 7, 0, 1, 2, 7, 0, 1, 2, 9, 0, 1, 2]
    guesses, match = fresh(text).draft(text, 1)
    assert guesses == [7] and match == 2
    # ties go to the most recent
    text = [1, 2, 7, 0, 1, 2, 9, 0, 1, 2]
    assert fresh(text).draft(text, 1)[0] == [9]


def test_min_token_prob_stops_guessing():
    text = [5, 1, 5, 2, 5, 3, 5, 4, 5]  # after 5: 1, 2, 3 or 4, a quarter each
    assert fresh(text).draft(text, 1)[0] == [4]  # 0.25 >= 0.1
    assert fresh(text, min_token_prob=0.3).draft(text, 1)[0] == []


def test_incremental_and_fresh_agree():
    rng = random.Random(5)
    text = [rng.randrange(6) for _ in range(200)]
    grown = fresh(text[:20], max_tree_depth=6)
    at = 20
    while at < len(text):
        at += rng.randrange(1, 4)
        grown.commit(text[:at])
        rebuilt = fresh(text[:at], max_tree_depth=6)
        assert grown.draft(text[:at], 5) == rebuilt.draft(text[:at], 5)
        assert grown.local.count == rebuilt.local.count


def test_cross_request_guesses():
    first_output = list(range(200, 230))
    proposer = SuffixProposer()
    proposer.begin([1, 2, 3])
    proposer.commit([1, 2, 3, *first_output])
    proposer.begin([4, 5, 6])  # the first output joins the global cache now
    assert list(proposer.cache.outputs) == [first_output]
    context = [4, 5, 6, *first_output[:6]]
    guesses, match = proposer.draft(context, 4)
    assert guesses == first_output[6:10] and match == 6
    off = SuffixProposer(max_cached_requests=0)
    off.begin([1, 2, 3])
    off.commit([1, 2, 3, *first_output])
    off.begin([4, 5, 6])
    assert off.draft(context, 4) == ([], 0)


def test_proposal_is_one_hot():
    proposer = fresh([1, 2, 3, 1, 2])
    proposal = proposer.propose([1, 2, 3, 1, 2], 4, SamplingParams(), torch.Generator())
    # match "1 2" (m = 2): up to 4 * m guesses, k = 4, as far as the text goes
    assert proposal.draft_ids.tolist() == [3, 1, 2] and proposal.draft_probs is None


def test_options():
    with pytest.raises(UnderstudyError, match="suffix_decoding_max_tree_depth"):
        SuffixProposer(max_tree_depth=1)
    with pytest.raises(UnderstudyError, match="suffix_decoding_min_token_prob"):
        SuffixProposer(min_token_prob=2.0)
    with pytest.raises(UnderstudyError, match="suffix_decoding_max_cached_requests"):
        SuffixProposer(max_cached_requests=-5)
    with pytest.raises(UnderstudyError, match="takes"):
        SuffixProposer.from_models(None, None, 64, prompt_lookup_max=3)
    made = SuffixProposer.from_models(
        None, None, 64, suffix_decoding_max_tree_depth=8, suffix_decoding_max_cached_tokens=99
    )
    assert made.depth == 8 and made.cache.max_tokens == 99


# -- through the engine ------------------------------------------------------------------------


def test_greedy_identity_and_cross_request_speedup(tiny_pair):
    target, _ = tiny_pair
    plain = Engine.from_pretrained(target=target, method="none", dtype="float32")
    engine = Engine.from_pretrained(target=target, method="suffix", dtype="float32")
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(11)
    accepted = 0
    for _ in range(8):
        segment = torch.randint(
            1, 300, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g
        )
        prompt = segment.tolist() * 2
        first = engine.generate(prompt, params)
        assert first.token_ids == plain.generate(prompt, params).token_ids
        again = engine.generate(prompt, params)  # the first output is in the global cache now
        assert again.token_ids == first.token_ids
        assert again.stats.accepted >= first.stats.accepted
        accepted += first.stats.accepted
    assert accepted > 0
    assert again.stats.tokens_per_pass > 2.0  # K = 2 (the CPU row budget): at most 3
