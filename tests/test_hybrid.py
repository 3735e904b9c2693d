"""method="hybrid": the plan (free / model / mixed / none), the q of a mixed proposal, greedy
identity with every plan in play, the target's distribution under sampling with mixed
proposals (and a mutation check), options."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from understudy import Engine, SamplingParams, UnderstudyError
from understudy.drafters import hybrid as hybrid_module
from understudy.drafters.base import Drafter, Proposal
from understudy.drafters.hybrid import HybridProposer, bucket, mixed_q
from understudy.measure.live import LiveCostRatio
from understudy.policy.adaptive_k import AdaptiveK
from understudy.policy.costs import Costs, PassCurve
from understudy.verify.sampling import warp_probs

ALPHA = 1e-3


pytestmark = pytest.mark.usefixtures("one_thread")


# -- the plan ----------------------------------------------------------------------------------


def test_buckets():
    assert [bucket(m) for m in (0, 1, 2, 3, 4, 7, 8, 15, 16, 100)] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]


def test_plan_from_priors():
    # a long match (prior 0.75 per guess) at c = 0.3: free beats the model, 2.31 vs 1.37
    assert HybridProposer(None, None, 0.3).choose_mix(2, 2, 8) == (2, 0)
    # nothing free: the model if it pays (c = 0.3), else a plain pass (c = 2)
    assert HybridProposer(None, None, 0.3).choose_mix(2, 0, 0) == (0, 2)
    assert HybridProposer(None, None, 2.0).choose_mix(2, 0, 0) == (0, 0)
    # a short, confident free run extended by a cheap model: mixed
    assert HybridProposer(None, None, 0.1).choose_mix(4, 1, 16) == (1, 3)
    # a weak one-token match and a cheap model: the model alone
    assert HybridProposer(None, None, 0.1).choose_mix(4, 4, 1) == (0, 4)


def test_plan_prices_the_draft_catching_up():
    """Tokens the draft model has not seen (a long prompt on its first use, or the text of
    free rounds) cost it catch_up_ratio passes each, shared among CATCH_UP_ROUNDS rounds."""
    proposer = HybridProposer(None, None, 0.1, catch_up_ratio=0.03)
    assert proposer.choose_mix(4, 4, 4) == (0, 4)  # a 4-token match (prior 0.6) loses to the model
    # 400 unseen tokens = 12 passes, 1.5 per round: the free guesses alone, at no draft cost
    assert proposer.choose_mix(4, 4, 4, unseen=400) == (4, 0)
    # nothing free: the model, caught up, still beats a plain pass
    assert proposer.choose_mix(4, 0, 0, unseen=400) == (0, 4)
    # the catch-up is shared: 12 passes charged to one round would lose to a plain pass
    hybrid_module.CATCH_UP_ROUNDS, saved = 1, hybrid_module.CATCH_UP_ROUNDS
    try:
        assert proposer.choose_mix(4, 0, 0, unseen=400) == (0, 0)
    finally:
        hybrid_module.CATCH_UP_ROUNDS = saved


def test_plan_prices_rows():
    """With unpadded passes each extra row costs v of a pass: long plans must earn it."""
    free_rows = HybridProposer(None, None, 0.01).choose_mix(15, 15, 1)
    dear_rows = HybridProposer(None, None, 0.01)
    dear_rows.costs = Costs(row=0.1)
    j, n_model = dear_rows.choose_mix(15, 15, 1)
    # a 1-token match (prior 0.2) loses to the model; its prior is AdaptiveK's, a per guess
    a = AdaptiveK.PRIOR_ACCEPT

    def best_k(c: float, v: float) -> int:
        rates = [sum(a**i for i in range(k + 1)) / (1 + k * (c + v)) for k in range(16)]
        return max(range(16), key=rates.__getitem__)

    assert free_rows == (0, best_k(0.01, 0.0))
    assert (j, n_model) == (0, best_k(0.01, 0.1))
    assert 0 < n_model < free_rows[1]


def test_plan_prices_rows_by_the_measured_pass_curve():
    """Where the pass curve was measured, a plan checking n guesses costs T(n) = curve[n],
    not 1 + n v: rows cheap within a kernel's row group and dear beyond it (one slope v,
    the curve's at the whole budget, prices the first rows as dearly as the last)."""
    a = AdaptiveK.PRIOR_ACCEPT
    curve = tuple(1.0 + 0.04 * n for n in range(8)) + tuple(2.0 + 0.3 * n for n in range(8))
    proposer = HybridProposer(None, None, 0.05)
    slope = (curve[-1] - 1.0) / 15  # the one slope, as costs.row has it
    proposer.costs = Costs(row=slope)
    linear = proposer.choose_mix(15, 0, 0)
    proposer.costs = Costs(row=slope, pass_curve=PassCurve(tuple(range(1, 17)), curve))
    assert proposer.pass_cost(3) == curve[3] and proposer.pass_cost(20) == 1.0 + 20 * slope
    rates = [sum(a**i for i in range(k + 1)) / (k * 0.05 + curve[k]) for k in range(16)]
    assert proposer.choose_mix(15, 0, 0) == (0, max(range(16), key=rates.__getitem__))
    assert proposer.choose_mix(15, 0, 0)[1] > linear[1]


def test_plan_learns_from_verdicts():
    proposer = HybridProposer(None, None, 0.3)
    assert proposer.choose_mix(2, 2, 8) == (2, 0)
    for _ in range(20):  # free guesses from long matches keep being rejected at once
        proposer._observe([0, 5], 1, [6, 7], 2, 0, bucket(8))
    assert proposer.choose_mix(2, 2, 8) == (0, 2)
    for _ in range(40):  # and now the model's guesses too
        proposer._observe([0, 5], 1, [6, 7], 0, 2, bucket(8))
    assert proposer.choose_mix(2, 0, 0) == (0, 0)


# -- the q of a mixed proposal -----------------------------------------------------------------


class StubFree:
    def __init__(self, guesses: list[int], match: int) -> None:
        self.guesses, self.match = guesses, match

    def begin(self, prompt_ids):
        pass

    def draft(self, tokens, k):
        return self.guesses[:k], self.match

    def commit(self, tokens):
        pass


class StubModel(Drafter):
    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.seen: list[list[int]] = []
        self.fed: list[int] = []  # tokens it has computed KV for, as DraftModelProposer's

    def begin(self, prompt_ids):
        pass

    def catch_up(self, tokens):
        self.fed = list(tokens[:-1])

    def propose(self, tokens, k, params, generator):
        self.seen.append(list(tokens))
        q = torch.softmax(torch.arange(k * self.vocab, dtype=torch.float32).view(k, -1), -1)
        ids = torch.arange(k, dtype=torch.long)
        return Proposal(ids, None if params.greedy else q)

    def commit(self, tokens):
        pass


def test_mixed_proposal_q():
    model = StubModel(vocab=6)
    proposer = HybridProposer(StubFree([4, 5], 16), model, 0.1)
    proposer.choose_mix = lambda k, free_len, match_len, unseen=0: (2, 2)
    sampled = proposer.propose([9, 9], 4, SamplingParams(temperature=1.0), torch.Generator())
    assert model.seen[-1] == [9, 9, 4, 5]  # the model continues after the free guesses
    assert sampled.draft_ids.tolist() == [4, 5, 0, 1]
    q = sampled.draft_probs
    assert q.shape == (4, 6)
    assert torch.equal(q[:2], torch.nn.functional.one_hot(torch.tensor([4, 5]), 6).float())
    stub_q = torch.softmax(torch.arange(12, dtype=torch.float32).view(2, -1), -1)
    assert torch.equal(q[2:], stub_q)
    assert torch.equal(mixed_q(torch.tensor([4, 5]), stub_q), q)
    greedy = proposer.propose([9, 9], 4, SamplingParams(temperature=0.0), torch.Generator())
    assert greedy.draft_probs is None and greedy.draft_ids.tolist() == [4, 5, 0, 1]
    proposer.choose_mix = lambda k, free_len, match_len, unseen=0: (2, 0)
    free_only = proposer.propose([9, 9], 4, SamplingParams(temperature=1.0), torch.Generator())
    assert free_only.draft_probs is None and free_only.draft_ids.tolist() == [4, 5]
    assert proposer.plans == {"free": 1, "model": 0, "mixed": 2, "none": 0}


class DoubtingStubModel(StubModel):
    """A draft model whose rounds stop on its own doubt (draft_path_confidence on)."""

    stops_by_confidence = True

    def propose(self, tokens, k, params, generator):
        self.asked = k
        return super().propose(tokens, min(k, 3), params, generator)  # it doubts after 3


def test_a_doubting_model_drafts_the_rest_of_the_budget():
    """The plan says whether the model drafts; a model that stops on its own doubt then gets
    the rest of the round's budget (as under method="draft"), not the plan's K."""
    model = DoubtingStubModel(vocab=6)
    proposer = HybridProposer(StubFree([4, 5], 16), model, 0.1)
    proposer.choose_mix = lambda k, free_len, match_len, unseen=0: (1, 2)
    proposal = proposer.propose([9, 9], 10, SamplingParams(temperature=0.0), torch.Generator())
    assert model.asked == 9 and model.seen[-1] == [9, 9, 4]
    assert proposal.draft_ids.tolist() == [4, 0, 1, 2]
    assert proposer._last[3] == 3  # learnt with the length it really drafted
    plain_model = StubModel(vocab=6)
    capped = HybridProposer(StubFree([4, 5], 16), plain_model, 0.1)
    capped.choose_mix = lambda k, free_len, match_len, unseen=0: (1, 2)
    assert capped.propose([9, 9], 10, SamplingParams(), torch.Generator()).size == 3


def test_live_cost_ratio_follows_the_rounds_times():
    """c starts at the build-time measurement and moves to draft-seconds-per-guess over
    target-seconds-per-pass as rounds are seen; the prior counts as PRIOR_ROUNDS rounds."""
    live = LiveCostRatio(0.1)
    assert live.value == 0.1
    live.observe_draft(0.6, 3)  # 0.2 s per guess, no pass seen yet: still the prior
    assert live.value == 0.1
    live.observe_pass(0.5)  # observed c = 0.2 / 0.5 = 0.4, weight 1 against the prior's 2
    assert live.value == pytest.approx((2 * 0.1 + 1 * 0.4) / 3)
    for _ in range(60):
        live.observe_draft(0.2, 1)
        live.observe_pass(0.5)
    assert live.value == pytest.approx((2 * 0.1 + 10 * 0.4) / 12, rel=1e-3)  # weight -> 10
    live.observe_draft(1.0, 0)  # a round the model drafted nothing in: ignored
    assert live.value == pytest.approx((2 * 0.1 + 10 * 0.4) / 12, rel=1e-3)


def test_hybrid_learns_c_only_when_it_measured_it():
    fixed = HybridProposer(StubFree([4, 5], 16), StubModel(6), 0.1)
    assert fixed.live_cost is None
    learning = HybridProposer(StubFree([4, 5], 16), StubModel(6), 0.1, learn_cost=True)
    learning.choose_mix = lambda k, free_len, match_len, unseen=0: (0, 2)
    learning.propose([9, 9], 4, SamplingParams(), torch.Generator())
    learning.commit([9, 9, 0, 7])
    live = learning.live_cost
    assert live.seconds_per_guess is not None and live.seconds_per_pass is not None
    assert live.weight == 1.0


def test_c_is_followed_only_where_the_pass_curve_was_not_measured():
    """On padded passes the build's one-step timing underrates c, and the rounds' wall times
    correct it; where the pass curve was measured (unpadded passes, timed in sweeps) c stays
    the build's, so a slow round on a busy machine cannot turn the plans from the model for
    the rest of a request."""
    padded = HybridProposer(StubFree([4, 5], 16), StubModel(6), 0.0, learn_cost=True)
    padded.settle(Costs(draft_step=0.2, row=0.0), True)
    assert padded.live_cost is not None and padded.live_cost.value == 0.2
    measured = HybridProposer(StubFree([4, 5], 16), StubModel(6), 0.0, learn_cost=True)
    measured.settle(
        Costs(draft_step=0.3, row=0.1, pass_curve=PassCurve((1, 2, 3), (1.0, 1.1, 1.3))), True
    )
    assert measured.live_cost is None and measured.cost_ratio == 0.3
    measured.choose_mix = lambda k, free_len, match_len, unseen=0: (0, 1)
    measured.propose([9, 9], 2, SamplingParams(), torch.Generator())
    measured.commit([9, 9, 0, 7])
    assert measured.cost_ratio == 0.3


class FakeClock:
    """time.perf_counter for hybrid's live cost: advanced by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class SlowStubModel(StubModel):
    """A catch-up of 5 s per unseen token and 0.1 s a guess, on the fake clock."""

    def __init__(self, vocab: int, clock: FakeClock) -> None:
        super().__init__(vocab)
        self.clock = clock

    def catch_up(self, tokens):
        self.clock.now += 5.0 * max(len(tokens) - 1 - len(self.fed), 0)
        super().catch_up(tokens)

    def propose(self, tokens, k, params, generator):
        self.clock.now += 0.1 * k
        return super().propose(tokens, k, params, generator)


def test_live_cost_times_guesses_apart_from_the_catch_up_and_per_one_row_pass(monkeypatch):
    """c is seconds per guess over seconds per ONE-ROW target pass. The draft's catch-up on
    tokens it has not seen is priced apart (catch_up_ratio) and not timed as guessing, and a
    verification pass of n guesses counts as the passes it costs (pass_cost).
    Mutations: timing the catch-up with the guesses (a 20-token prompt's catch-up made the
    first round's c ~30 times the measured one) or a whole pass as one row fail here."""
    clock = FakeClock()
    monkeypatch.setattr(hybrid_module.time, "perf_counter", clock)
    model = SlowStubModel(6, clock)
    proposer = HybridProposer(StubFree([4, 5], 16), model, 0.3, learn_cost=True)
    proposer.costs = Costs(row=0.5)  # a pass checking n guesses: 1 + 0.5 n one-row passes
    proposer.choose_mix = lambda k, free_len, match_len, unseen=0: (0, 3)
    prompt = list(range(1, 21))
    proposal = proposer.propose(prompt, 3, SamplingParams(temperature=0.0), torch.Generator())
    assert proposal.size == 3 and clock.now == pytest.approx(5.0 * 19 + 0.3)
    clock.now += 2.5 * 0.4  # the pass checking 3 guesses: 2.5 one-row passes of 0.4 s
    proposer.commit([*prompt, 0, 1, 9])
    live = proposer.live_cost
    assert live.seconds_per_guess == pytest.approx(0.1)
    assert live.seconds_per_pass == pytest.approx(0.4)
    assert live.value == pytest.approx((2 * 0.3 + 1 * 0.25) / 3)


def test_the_plans_do_not_price_the_prompts_catch_up():
    """The model's first round reads the prompt whatever the plans, so they price only the
    generated tokens the draft has not seen: one at the first round, not the prompt's 40."""
    model = StubModel(6)
    proposer = HybridProposer(StubFree([4, 5], 16), model, 0.1)
    unseen_seen = []

    def plan(k, free_len, match_len, unseen=0):
        unseen_seen.append(unseen)
        return (0, 0)

    proposer.choose_mix = plan
    prompt = list(range(1, 41))
    proposer.begin(prompt)
    assert model.fed == []  # the prompt is read in the first model round, not at begin
    proposer.propose([*prompt, 7], 4, SamplingParams(), torch.Generator())
    proposer.commit([*prompt, 7, 8])
    proposer.propose([*prompt, 7, 8], 4, SamplingParams(), torch.Generator())
    assert unseen_seen == [1, 2]


def test_commit_learns_the_verdict():
    proposer = HybridProposer(StubFree([4, 5], 16), StubModel(6), 0.1)
    proposer.choose_mix = lambda k, free_len, match_len, unseen=0: (2, 0)
    before = proposer.free_estimate.alpha(16)
    proposer.propose([9, 9], 2, SamplingParams(), torch.Generator())
    proposer.commit([9, 9, 4, 7])  # first guess kept, second rejected
    after = proposer.free_estimate.alpha(16)
    assert after != before
    tries = proposer.free_estimate.tries[bucket(16)]
    assert tries == pytest.approx(2.0 * 0.98 + 2)  # prior (decayed) + two guesses reached


# -- through the engine ------------------------------------------------------------------------


def repetitive_prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(3, 20, (1,), generator=g))
        out.append(torch.randint(1, 300, (length,), generator=g).tolist() * 2)
    return out


def force_mixing(k: int, free_len: int, match_len: int, unseen: int = 0) -> tuple[int, int]:
    """A plan that mixes whenever it can: one free guess, then the draft model."""
    return min(1, free_len), k - min(1, free_len)


@pytest.mark.filterwarnings("ignore:target passes hold")
@pytest.mark.parametrize(
    "free, k, forced", [("suffix", "auto", False), ("ngram", "auto", False), ("suffix", 4, True)]
)
def test_greedy_identity(tiny_pair, free, k, forced):
    target, draft = tiny_pair
    plain = Engine.from_pretrained(target=target, method="none", dtype="float32")
    engine = Engine.from_pretrained(
        target=target,
        draft=draft,
        method="hybrid",
        num_speculative_tokens=k,
        dtype="float32",
        hybrid_free=free,
        hybrid_cost_ratio=0.25,
    )
    if forced:
        engine.drafter.choose_mix = force_mixing
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    accepted = 0
    for prompt in repetitive_prompts(8, seed=5):
        out = engine.generate(prompt, params)
        assert out.token_ids == plain.generate(prompt, params).token_ids
        accepted += out.stats.accepted
    plans = engine.drafter.plans
    assert accepted > 0 and plans["model"] > 0, plans
    assert plans["mixed" if forced else "free"] > 0, plans


def test_options(tiny_pair):
    target, draft = tiny_pair
    engine = Engine.from_pretrained(
        target=target,
        draft=draft,
        method="hybrid",
        dtype="float32",
        hybrid_free="ngram",
        prompt_lookup_max=3,
    )
    assert engine.drafter.free.index.max_n == 3
    assert 0 < engine.drafter.cost_ratio < 100  # measured: the tiny pair costs about the same
    assert not hasattr(engine.drafter, "runner")  # so the engine's K is the full row budget
    with pytest.raises(UnderstudyError, match="hybrid_free"):
        Engine.from_pretrained(target=target, draft=draft, method="hybrid", hybrid_free="x")
    with pytest.raises(UnderstudyError, match="hybrid_cost"):
        Engine.from_pretrained(target=target, draft=draft, method="hybrid", hybrid_cost_ratio=-1.0)
    with pytest.raises(UnderstudyError, match="prompt_lookup_max"):
        Engine.from_pretrained(target=target, draft=draft, method="hybrid", prompt_lookup_max=3)
    with pytest.raises(UnderstudyError, match="needs a draft model"):
        Engine.from_pretrained(target=target, method="hybrid")


# -- sampling: mixed proposals keep the target's distribution ---------------------------------

# 4 tokens, so the first round may draft K = 2 (the row budget); the test looks at 3
SAMPLING = SamplingParams(max_tokens=4, temperature=1.0, top_k=3, ignore_eos=True)
SAMPLES = 1000


def exact_law(engine: Engine, prompt: list[int]) -> dict[tuple[int, ...], float]:
    """P(x1, x2, x3) under the target's warped distribution, by enumeration."""
    law: dict[tuple[int, ...], float] = {}

    def expand(prefix: tuple[int, ...], mass: float) -> None:
        if len(prefix) == 3:
            law[prefix] = mass
            return
        logits = engine.runner.prefill(torch.tensor(prompt + list(prefix)))
        probs = warp_probs(logits[None], SAMPLING)[0]
        for token in probs.nonzero().flatten().tolist():
            expand((*prefix, token), mass * float(probs[token]))

    expand((), 1.0)
    return law


def goodness_of_fit(engine: Engine, prompt: list[int], seeds: range) -> float:
    law = exact_law(engine, prompt)
    counts = dict.fromkeys(law, 0)
    for seed in seeds:
        out = engine.generate(prompt, SamplingParams(**{**SAMPLING.__dict__, "seed": seed}))
        key = tuple(out.token_ids[:3])
        if key not in counts:
            return 0.0  # a sequence the target never produces
        counts[key] += 1
    observed, expected, tail_o, tail_e = [], [], 0, 0.0
    for cell in sorted(law, key=law.get, reverse=True):  # pool cells expecting < 5
        e = law[cell] * len(seeds)
        if e >= 5:
            observed.append(counts[cell])
            expected.append(e)
        else:
            tail_o, tail_e = tail_o + counts[cell], tail_e + e
    if tail_e > 0:
        observed.append(tail_o)
        expected.append(tail_e)
    scale = sum(observed) / sum(expected)
    return float(chisquare(observed, [e * scale for e in expected]).pvalue)


@pytest.fixture(scope="module")
def mixed_engine(tiny_pair):
    """Hybrid forced to mix whenever it can, and a prompt where the first round usually has
    a free guess (right about half the time) for the model to extend."""
    from test_ngram import informative_prompt

    target, draft = tiny_pair
    engine = Engine.from_pretrained(
        target=target,
        draft=draft,
        method="hybrid",
        dtype="float32",
        hybrid_free="ngram",
        hybrid_cost_ratio=0.1,
    )
    engine.drafter.choose_mix = force_mixing
    return engine, informative_prompt(engine)


def test_sampling_with_mixed_proposals_matches_target(mixed_engine):
    engine, prompt = mixed_engine
    pvalue = goodness_of_fit(engine, prompt, range(SAMPLES))
    plans = engine.drafter.plans
    assert plans["mixed"] > SAMPLES / 2, plans  # the first round mixed in most runs
    assert pvalue > ALPHA, f"p = {pvalue:.2e}"


def test_misaligned_q_fails_the_same_test(mixed_engine, monkeypatch):
    """Mutation check: the model's q rows put at the free guesses' positions is detected."""

    def misaligned(free, model_q):
        full = mixed_q(free, model_q)
        return torch.cat([full[free.shape[0] :], full[: free.shape[0]]])  # WRONG: rows rotated

    engine, prompt = mixed_engine
    monkeypatch.setattr(hybrid_module, "mixed_q", misaligned)
    pvalue = goodness_of_fit(engine, prompt, range(SAMPLES, 2 * SAMPLES))
    assert pvalue < ALPHA, f"the misaligned q was not detected (p = {pvalue:.3f})"
