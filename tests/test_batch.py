"""Batched decoding (engine/scheduler.py, engine/round.py): every answer equals its solo answer, whatever shares
its passes; sampled answers keep the target's law; seats come and go between rounds.

Solo means the same engine serving that one request alone (`engine.generate(prompt)`), and
for greedy requests that is also plain decoding's output (tests/test_exactness.py), so a
batched greedy answer is bitwise plain decoding's.
"""

from __future__ import annotations

import pytest
import torch

from stats_helpers import ALPHA, chisquare_pvalue, resample_from_p_verify
from test_exactness import exact_joint
from understudy import Engine, SamplingParams
from understudy.config import UnderstudyError
from understudy.engine.outputs import GenerationOutput
from understudy.engine.seats import kv_bytes_per_seat, make_seats
from understudy.models.runner import Runner
from understudy.models.shared_pass import TreeRows, score_together
from understudy.policy.batch_plan import BatchCosts, Wish, choose_cap
from understudy.policy.costs import PassCurve as Curve
from understudy.verify.token_tree import TokenTree

PROMPTS = [
    "def add(a, b):",
    "class Stack:\n    def push(self, x):\n",
    "x = 1\ny = 2\n" * 12,  # a long prompt
    "import os\n",
    "hello",
    "def f(x):\n    return x *",
    [5, 17, 99, 3],  # token ids
    "for i in range(10):\n",
]


def mixed_params() -> list[SamplingParams]:
    """Greedy and seeded sampled requests, different budgets, a stop string, EOS on."""
    return [
        SamplingParams(max_tokens=40, temperature=0.0),
        SamplingParams(max_tokens=12, temperature=0.0),
        SamplingParams(max_tokens=30, temperature=0.8, seed=3),
        SamplingParams(max_tokens=36, temperature=0.0, stop=["\n\n", "):"]),
        SamplingParams(max_tokens=40, temperature=1.0, top_k=20, seed=7),
        SamplingParams(max_tokens=1, temperature=0.0),  # no round at all
        SamplingParams(max_tokens=25, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=33, temperature=0.7, top_p=0.9, seed=11),
    ]


@pytest.fixture(
    scope="module",
    params=[
        ("draft", 3),
        ("draft", "auto"),
        ("ngram", "auto"),
        ("suffix", "auto"),
        ("none", "auto"),
    ],
)
def batched(request, tiny_pair) -> Engine:
    """Four seats for eight prompts: sequences join as others leave, at different rounds.
    (With K "auto" the batch plan chooses lengths; the tiny draft costs what its target
    does, so it may choose plain rounds: the fixed K=3 engine always drafts.)"""
    target, draft = tiny_pair
    method, k = request.param
    # suffix's cross-request cache makes a seeded answer depend on what was served before
    # (alone or not): off here, so solo and batched runs start from the same state
    options = {"suffix_decoding_max_cached_requests": 0} if method == "suffix" else {}
    return Engine.from_pretrained(
        target, draft, method=method, num_speculative_tokens=k, dtype="float32",
        max_num_seqs=4, max_context=512, **options,
    )  # fmt: skip


def test_every_answer_is_its_solo_answer(batched):
    params = mixed_params()
    solo = [batched.generate(p, q) for p, q in zip(PROMPTS, params, strict=True)]
    together = batched.generate(PROMPTS, params)
    assert [o.token_ids for o in together] == [o.token_ids for o in solo]
    assert [o.text for o in together] == [o.text for o in solo]
    assert [o.stats.finish_reason for o in together] == [o.stats.finish_reason for o in solo]
    assert {o.stats.finish_reason for o in together} >= {"length"}
    assert len(batched.scheduler.free) == 4 and not batched.scheduler.busy  # every seat back


def test_greedy_batch_equals_plain_decoding(batched, tiny_pair):
    target, _ = tiny_pair
    plain = Engine.from_pretrained(target, method="none", dtype="float32", max_context=512)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    together = batched.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, together, strict=True):
        assert out.token_ids == plain.generate(prompt, params).token_ids
    if batched.method in ("ngram", "suffix") or batched.k == 3:
        assert sum(o.stats.drafted for o in together) > 0  # the batch did speculate


def test_a_sequence_at_the_end_of_its_context(batched):
    """A prompt that leaves 6 tokens of context: its budget ends it, the others go on."""
    long_prompt = [3 + i % 200 for i in range(506)]
    params = [SamplingParams(max_tokens=50, temperature=0.0)] * 3
    prompts = [long_prompt, "def add(a, b):", "import os\n"]
    solo = [batched.generate(p, q) for p, q in zip(prompts, params, strict=True)]
    together = batched.generate(prompts, params)
    assert len(together[0].token_ids) <= 6
    assert [o.token_ids for o in together] == [o.token_ids for o in solo]


def test_a_cancelled_sequence_frees_its_seat_and_the_rest_are_unchanged(tiny_pair):
    target, draft = tiny_pair
    engine = Engine.from_pretrained(target, draft, dtype="float32", max_num_seqs=2)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    solo = [engine.generate(p, params).token_ids for p in PROMPTS[:3]]
    loop = engine.scheduler
    seen: list[int] = []
    first = loop.submit(engine.encode(PROMPTS[0]), params, on_token=lambda e: seen.append(1))
    second = loop.submit(engine.encode(PROMPTS[1]), params)
    third = loop.submit(engine.encode(PROMPTS[2]), params)  # waits for a seat
    while len(seen) < 5:
        loop.step()
    assert len(loop.running) == 2 and len(loop.waiting) == 1
    first.cancel()
    loop.step()  # the cancelled one leaves, the waiting one takes its seat
    assert first.finished.is_set() and first.output is not None
    assert first.output.stats.finish_reason == "cancelled"
    assert third in [r.sequence for r in loop.running]
    loop.run_until_done()
    assert first.output.token_ids == solo[0][: len(first.output.token_ids)]
    assert second.output.token_ids == solo[1] and third.output.token_ids == solo[2]
    assert len(loop.free) == 2


def test_shared_pass_rows_equal_solo_rows(tiny_pair):
    """The mechanism: rows of three sequences in one pass, bitwise their solo passes."""
    target, _ = tiny_pair
    engine = Engine.from_pretrained(target, method="none", dtype="float32", max_context=256)
    solo_runner = engine.runner
    model = solo_runner.model
    seats = [
        Runner(model, 256, solo_runner.rows, False, (i + 1) * solo_runner.slots) for i in range(3)
    ]
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 200, (n,), generator=generator) for n in (5, 40, 13)]
    fed = [torch.tensor([3, 4, 5]), torch.tensor([7]), torch.tensor([8, 9])]
    expected = []
    for prompt, rows in zip(prompts, fed, strict=True):
        solo_runner.prefill(prompt, len(prompt) + 50)
        expected.append(solo_runner.extend(rows))
    for runner, prompt in zip(seats, prompts, strict=True):
        runner.prefill(prompt, len(prompt) + 50)
    got = score_together(seats, fed)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)


def test_a_tree_shares_a_pass_bitwise(tiny_pair):
    """A token tree's nodes beside another sequence's chain in one pass: every node's logits
    are bitwise its tree pass alone, and the kept path's KV is the same afterwards."""
    target, _ = tiny_pair
    engine = Engine.from_pretrained(target, method="none", dtype="float32", max_context=256)
    solo = engine.runner
    seats = [Runner(solo.model, 256, solo.rows, False, (i + 1) * solo.slots) for i in range(2)]
    tree = TokenTree.from_drafts(9, torch.tensor([4, 5, 6, 7, 8]), torch.tensor([-1, 0, 0, 1, -1]))
    offsets = tree.slot_offsets()
    rows = TreeRows(tree.tokens, tree.depths, offsets, tree.region_mask(offsets))
    prompts = [torch.tensor([3, 1, 4, 1, 5, 9, 2, 6]), torch.tensor([2, 7, 1, 8])]
    solo.prefill(prompts[0], 60)
    expected_tree = solo.tree_pass(rows.tokens, rows.depths, rows.offsets, rows.visible)
    solo.keep_path(offsets[[0, 1, 2, 4]])
    expected_next = solo.extend(torch.tensor([11]))
    solo.prefill(prompts[1], 60)
    expected_chain = solo.extend(torch.tensor([3, 3]))
    for runner, prompt in zip(seats, prompts, strict=True):
        runner.prefill(prompt, 60)
    got_tree, got_chain = score_together(seats, [rows, torch.tensor([3, 3])])
    assert torch.equal(got_tree, expected_tree) and torch.equal(got_chain, expected_chain)
    assert seats[0].length == len(prompts[0]) and seats[1].length == len(prompts[1]) + 2
    seats[0].keep_path(offsets[[0, 1, 2, 4]])
    assert torch.equal(score_together(seats[:1], [torch.tensor([11])])[0], expected_next)


# -- the sampled law at batch > 1 ---------------------------------------------------------------


@pytest.fixture(scope="module")
def sampling_batch(tmp_path_factory) -> Engine:
    """A draft that disagrees often (noise 0.5), so rejections and residuals matter."""
    from conftest import make_tiny_pair

    target, draft = make_tiny_pair(
        tmp_path_factory.mktemp("batch_law"), seed=5, noise=0.5, tokenizer=False
    )
    return Engine.from_pretrained(
        target, draft, dtype="float32", num_speculative_tokens=2, max_num_seqs=4
    )


def batched_goodness_of_fit(engine: Engine, samples: int) -> float:
    """`samples` draws of (x1, x2, x3) after one prompt, eight requests per batch (four
    seats: they join mid-batch), beside a greedy neighbour; chi-squared p-value against the
    target's exact joint law."""
    prompt = [11, 42, 7]
    params = SamplingParams(temperature=1.0, top_k=3, ignore_eos=True, max_tokens=3)
    law = exact_joint(engine, prompt, params)
    cells = sorted(law)
    counts = dict.fromkeys(cells, 0)
    neighbour = SamplingParams(temperature=0.0, max_tokens=6)
    for start in range(0, samples, 7):
        seeds = range(start, min(start + 7, samples))
        batch = [SamplingParams(**{**params.__dict__, "seed": s}) for s in seeds]
        outs = engine.generate([prompt] * len(batch) + [[5, 6]], [*batch, neighbour])
        for out in outs[:-1]:
            key = tuple(out.token_ids)
            if key not in counts:
                return 0.0  # a sequence the target can never produce
            counts[key] += 1
    return chisquare_pvalue([counts[c] for c in cells], [law[c] for c in cells])


def test_batched_sampling_has_the_target_law(sampling_batch):
    """N = 1500, Pearson chi-squared over the 27 joint outcomes, p > ALPHA = 0.001."""
    pvalue = batched_goodness_of_fit(sampling_batch, 1500)
    assert pvalue > ALPHA, f"p = {pvalue:.2e}"


def test_a_wrong_verifier_fails_the_batched_law_test(sampling_batch, monkeypatch):
    """Mutation: resampling from p instead of the residual is detected at the same N."""
    import understudy.engine.verdict as verdict_module

    monkeypatch.setattr(verdict_module, "verify_sampling", resample_from_p_verify)
    pvalue = batched_goodness_of_fit(sampling_batch, 1500)
    assert pvalue < ALPHA, f"the wrong verifier was not detected (p = {pvalue:.3f})"


# -- the plan, the seats, bad input --------------------------------------------------------------


def flat(k: int) -> float:
    return 1.0 + 0.9 * k  # a draft that is nearly always right


def test_the_cap_drafts_while_rows_are_cheap_and_stops_when_they_are_not():
    cheap = BatchCosts(Curve((1, 64), (0.10, 0.11)), Curve((1, 8), (0.01, 0.011)))
    dear = BatchCosts(Curve((1, 2, 64), (0.10, 0.2, 6.4)), Curve((1, 8), (0.01, 0.011)))
    wishes = [Wish(8, True, flat) for _ in range(8)]
    assert choose_cap(wishes, cheap) == 8
    assert choose_cap(wishes, dear) == 0  # plain batched decoding is faster
    # a sampled sequence keeps its own length: it is not capped, and still costs its rows
    mixed = [*wishes[:7], Wish(3, False, flat)]
    assert choose_cap(mixed, dear) == 0


def test_a_greedy_tree_is_kept_whole_where_it_pays_and_capped_where_rows_are_dear():
    """A tree of 15 nodes, depth 4: kept whole (None) where its rows are cheap and its rounds
    have yielded more than a chain's; a chain of its depth where they yielded no more (the
    same tokens for fewer rows); plain rounds (0) where rows are dear. A sampled tree is
    never capped, and its nodes count."""
    cheap = BatchCosts(Curve((1, 256), (0.10, 0.11)), Curve((1, 8), (0.01, 0.011)))
    dear = BatchCosts(Curve((1, 2, 128), (0.10, 0.2, 12.8)), Curve((1, 8), (0.01, 0.011)))
    trees = [Wish(4, True, flat, tree_rows=15, tree_tokens=flat(4) + 1.5) for _ in range(4)]
    assert choose_cap(trees, cheap) is None
    no_gain = [Wish(4, True, flat, tree_rows=15, tree_tokens=flat(4)) for _ in range(4)]
    assert choose_cap(no_gain, cheap) == 4
    assert choose_cap(trees, dear) == 0
    sampled = Wish(4, False, flat, tree_rows=15, tree_tokens=flat(4))
    assert sampled.rows(0, whole=True) == 15 and sampled.tokens(0, whole=True) == flat(4)


def test_the_drafts_lag_is_a_cost_of_drafting():
    """A draft model that must first be fed what it has not seen (a sequence that just
    joined: its whole prompt) makes the same round's drafting dearer, here too dear."""
    costs = BatchCosts(Curve((1, 8, 64), (0.10, 0.12, 0.5)), Curve((1, 8, 64), (0.03, 0.04, 0.3)))
    caught_up = [Wish(4, True, flat, lag=2) for _ in range(4)]
    assert choose_cap(caught_up, costs) == 4
    joined = [*caught_up[:3], Wish(4, True, flat, lag=600)]
    assert choose_cap(joined, costs) == 0
    # paid once, the lag serves the rest of a long answer: a round is charged its share
    long_answer = [*caught_up[:3], Wish(4, True, flat, lag=600, remaining=4000)]
    assert choose_cap(long_answer, costs) == 4
    assert long_answer[3].first_rows(4) == pytest.approx(1 + 599 * flat(4) / 4000)
    assert costs.draft_seconds([2, 1, 0], [3.0, 5.0, 900.0]) == pytest.approx(
        costs.draft.seconds_at(8)
        + costs.draft.seconds_at(1)  # the first pass: 3 + 5 rows; then one
    )


def test_the_curve_interpolates_and_extrapolates():
    curve = Curve((1, 4, 8), (1.0, 1.3, 2.1))
    assert curve.seconds_at(1) == 1.0 and curve.seconds_at(8) == pytest.approx(2.1)
    assert curve.seconds_at(6) == pytest.approx(1.7) and curve.seconds_at(16) == pytest.approx(3.7)
    assert curve.ratios == pytest.approx((1.0, 1.1, 1.2, 1.3, 1.5, 1.7, 1.9, 2.1))


def test_seats_and_their_memory(tiny_pair):
    target, draft = tiny_pair
    engine = Engine.from_pretrained(target, draft, dtype="float32", max_num_seqs=3)
    cfg = engine.target.model.cfg
    per_slot = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4  # float32 k and v
    expected = per_slot * engine.runner.slots * 2  # target and its same-shaped draft
    assert kv_bytes_per_seat(engine.scheduler.seats) == expected
    assert engine.target.model.cache_slots == 3 * engine.runner.slots
    with pytest.raises(UnderstudyError, match="max_num_seqs"):
        make_seats(engine.runner, None, 0)


def test_padded_targets_refuse_seats(tiny_pair):
    target, _ = tiny_pair
    engine = Engine.from_pretrained(target, method="none", dtype="float32")
    padded = Runner(engine.target.model, 64, rows=8, pad=True)
    with pytest.raises(UnderstudyError, match="row-invariant"):
        make_seats(padded, None, 2)


def test_bad_batches_are_refused_before_anything_runs(tiny_pair):
    target, draft = tiny_pair
    engine = Engine.from_pretrained(target, method="ngram", dtype="float32", max_num_seqs=2)
    with pytest.raises(UnderstudyError, match="2 prompts but 3"):
        engine.generate(["a", "b"], [SamplingParams()] * 3)
    with pytest.raises(UnderstudyError, match="on_token"):
        engine.generate(["a", "b"], on_token=print)
    with pytest.raises(UnderstudyError, match="list of prompts"):
        engine.generate("a", [SamplingParams()])
    assert not engine.scheduler.busy


def test_streaming_per_sequence_gives_each_its_own_tokens(tiny_pair):
    target, draft = tiny_pair
    engine = Engine.from_pretrained(target, draft, dtype="float32", max_num_seqs=2)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    prompts = PROMPTS[:3]
    streamed: dict[int, list[int]] = {i: [] for i in range(3)}
    outputs = {}
    for i, event in engine.stream_batch(prompts, params):
        if isinstance(event, GenerationOutput):
            outputs[i] = event
        else:
            streamed[i].append(event.token_id)
    solo = [engine.generate(p, params).token_ids for p in prompts]
    assert [streamed[i] for i in range(3)] == solo
    assert [outputs[i].token_ids for i in range(3)] == solo
    # a consumer that stops early cancels the rest and frees every seat
    stream = engine.stream_batch(prompts, params)
    next(stream)
    stream.close()
    assert not engine.scheduler.busy and len(engine.scheduler.free) == 2
