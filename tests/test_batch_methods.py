"""Every method batches: draft (chains and trees), ngram, suffix, hybrid and eagle (chains
and trees) run on several seats, and every answer is its solo answer, greedy and seeded
sampling alike; greedy answers are plain decoding's. One engine loop serves them all
(engine/scheduler.py, engine/round.py): solo is a batch of one.

Solo means the same engine serving the request alone: its costs, measured at build, steer
every plan, and a plan decides how a seeded answer's random draws fall (never its law). What
learns across requests is held still: the suffix cache is off, hybrid's c is fixed, and
tree="auto" (which learns which shape pays) is compared with trees fixed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle_helpers import train_greedy_head
from understudy import Engine, SamplingParams

PROMPTS = [
    "def add(a, b):",
    "class Stack:\n    def push(self, x):\n",
    "x = 1\ny = 2\n" * 6,
    [5, 17, 99, 3],
    "for i in range(10):\n",
    "hello hello hello hello",
]


def params_each() -> list[SamplingParams]:
    """Greedy and seeded sampled requests of different lengths."""
    return [
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.9, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=28, temperature=0.0),
        SamplingParams(max_tokens=20, temperature=1.0, top_k=20, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=26, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=22, temperature=0.7, top_p=0.9, seed=11, ignore_eos=True),
    ]


@pytest.fixture(scope="module")
def head(tiny_pair, tmp_path_factory) -> Path:
    target, _ = tiny_pair
    folder = tmp_path_factory.mktemp("batch_eagle") / "head"
    train_greedy_head(target, folder)
    return folder


METHODS = {
    "draft-tree": ("draft", {"tree": "on", "tree_branching": 2}),
    "ngram": ("ngram", {}),
    "suffix": ("suffix", {"suffix_decoding_max_cached_requests": 0}),
    # c fixed: left to itself hybrid's c follows the rounds' wall times, and its choice of
    # drafts (so a seeded answer's bits, never its law) with them
    "hybrid": ("hybrid", {"suffix_decoding_max_cached_requests": 0, "hybrid_cost_ratio": 0.3}),
    "eagle-chain": ("eagle", {"tree": "off"}),
    "eagle-tree": ("eagle", {"tree": "on"}),
    "eagle-auto": ("eagle", {}),  # its default: trees where they pay
}


def build(tiny_pair, head: Path, name: str, seats: int, k: int | str = 3) -> Engine:
    target, draft = tiny_pair
    method, options = METHODS[name]
    extra = {"draft": str(head)} if method == "eagle" else {"draft": draft}
    return Engine.from_pretrained(
        target, method=method, num_speculative_tokens=k, dtype="float32", max_num_seqs=seats,
        max_context=512, **extra, **options,
    )  # fmt: skip


@pytest.mark.parametrize("name", sorted(set(METHODS) - {"eagle-auto"}))
def test_every_method_batches_each_answer_its_solo_answer(tiny_pair, head, name):
    """Six requests (three greedy, three seeded sampled) on four seats, joining as others
    leave, against each alone on the same engine (the same measured costs: two engines'
    timings differ, and with them plans, so seeded answers too)."""
    batched = build(tiny_pair, head, name, seats=4)
    assert len(batched.scheduler.seats) == 4
    params = params_each()
    solo = [batched.generate(p, q) for p, q in zip(PROMPTS, params, strict=True)]
    together = batched.generate(PROMPTS, params)
    assert [o.token_ids for o in together] == [o.token_ids for o in solo]
    assert sum(o.stats.drafted for o in together) > 0, "the batch did speculate"
    if METHODS[name][1].get("tree") == "on":
        assert batched.tree
    plain = batched.with_method("none")
    for prompt, q, out in zip(PROMPTS, params, together, strict=True):
        if q.greedy:
            assert out.token_ids == plain.generate(prompt, q).token_ids
    assert not batched.scheduler.busy and len(batched.scheduler.free) == 4


def test_rounds_of_a_batched_tree_engine_are_trees(tiny_pair, head):
    """tree="on" stays trees in a batch (it used to become chains): each round reported to
    on_round for a greedy sequence of the batch has parents (the head's rounds: free ones,
    drafters/free_first.py, are chains, so they are off here)."""
    target, draft = tiny_pair
    engine = Engine.from_pretrained(
        target, method="eagle", num_speculative_tokens=3, dtype="float32", max_num_seqs=3,
        max_context=512, draft=str(head), tree="on", free_drafts="off",
    )  # fmt: skip
    rounds = []
    scheduler = engine.scheduler
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    sequences = [
        scheduler.submit(engine.encode(p), params, on_round=rounds.append) for p in PROMPTS[:3]
    ]
    scheduler.run_until_done()
    assert all(s.output is not None for s in sequences)
    drafted = [r for r in rounds if r.drafted]
    assert drafted and all(r.parents is not None for r in drafted)
    assert scheduler.rows_last_pass >= 1


def test_automatic_k_batches_hybrid_and_eagle(tiny_pair, head):
    """Under automatic K the batch plan caps greedy chains, and counts a tree's nodes as
    rows it cannot cap; greedy output stays plain's."""
    for name in ("hybrid", "eagle-chain", "eagle-auto"):
        engine = build(tiny_pair, head, name, seats=3, k="auto")
        plain = engine.with_method("none")
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        together = engine.generate(PROMPTS[:5], params)
        for prompt, out in zip(PROMPTS[:5], together, strict=True):
            assert out.token_ids == plain.generate(prompt, params).token_ids
