"""method="auto": the choice of the part that serves a request (the target's head, the draft
model, plain decoding; policy/part_choice.py), greedy output equal to plain decoding's with
every part serving, the target's law under sampling with requests of every part
(chi-squared, p > 0.001) and a mutation that fails it, the head found or not, options."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eagle_helpers import SETTINGS, target_written_text, train_greedy_head
from test_exactness import P_THRESHOLD, WARPS, goodness_of_fit, random_prompts
from understudy import Engine, SamplingParams, UnderstudyError
from understudy.drafters.auto import AutoProposer
from understudy.drafters.base import Proposal
from understudy.drafters.draft_model import DraftModelProposer
from understudy.head.pipeline import train_head
from understudy.models.loader import load_model
from understudy.policy.part_choice import PartChoice

pytestmark = pytest.mark.usefixtures("one_thread")


# -- the choice --------------------------------------------------------------------------------


def test_each_part_is_tried_then_the_best_rate_wins():
    choice = PartChoice(("head", "model", "none"))
    rates = {"head": (96, 1.2), "model": (96, 1.6), "none": (96, 2.4)}  # tokens, seconds
    tried = []
    for _ in range(3 * PartChoice.MIN_TRIES):
        part = choice.choose()
        tried.append(part)
        choice.observe(part, *rates[part])
    assert sorted(set(tried)) == ["head", "model", "none"]
    assert tried == sorted(tried, key=["head", "model", "none"].index)  # in turn, head first
    assert choice.rate("head") == pytest.approx(80) and choice.rate("model") == pytest.approx(60)
    picks = [choice.choose() for _ in range(2 * PartChoice.PROBE_EVERY)]
    assert picks.count("head") == 2 * PartChoice.PROBE_EVERY - 2
    assert sorted(p for p in picks if p != "head") == ["model", "none"]  # probes, in turn


def test_plain_decoding_when_no_part_beats_it():
    choice = PartChoice(("model", "none"))
    for _ in range(2 * PartChoice.MIN_TRIES):
        part = choice.choose()
        choice.observe(part, 64, 2.0 if part == "model" else 1.6)  # 32 against 40 tokens/s
    picks = [choice.choose() for _ in range(PartChoice.PROBE_EVERY)]
    assert picks == ["none"] * (PartChoice.PROBE_EVERY - 1) + ["model"]


def test_recent_requests_weigh_more():
    """Rates decay: a part that was faster and has turned slower loses the lead."""
    choice = PartChoice(("head", "model"))
    for _ in range(3):
        choice.observe("head", 96, 1.0)
        choice.observe("model", 96, 1.5)
    assert max(choice.parts, key=choice.rate) == "head"
    for _ in range(20):
        choice.observe("head", 96, 2.0)  # the head's guesses stop being kept
    assert max(choice.parts, key=choice.rate) == "model"


# -- the engine --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tiny_pair, tmp_path_factory) -> tuple[str, str, Path]:
    target, draft = tiny_pair
    folder = tmp_path_factory.mktemp("auto") / "head"
    train_greedy_head(target, folder)
    return target, draft, folder


@pytest.mark.parametrize("k", [3, "auto"])
def test_greedy_identity_with_both_parts(trained, k):
    target, draft, folder = trained
    engine = Engine.from_pretrained(
        target=target, draft=draft, method="auto", head=str(folder), dtype="float32",
        num_speculative_tokens=k,
    )  # fmt: skip
    auto = engine.drafter
    assert isinstance(auto, AutoProposer) and auto.head is not None and auto.traits.wants_hidden
    assert engine.exact and not engine.tree
    plain = engine.with_method("none")
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for prompt in random_prompts(6, seed=12):
        assert engine.generate(prompt, params).token_ids == plain.generate(prompt, params).token_ids
    assert all(auto.requests[part] >= PartChoice.MIN_TRIES for part in ("head", "model", "none"))


def test_without_a_head_the_draft_model_alone(tiny_pair):
    """The tiny target is not the file the package's head was trained on, and no head was
    trained into the cache for it: auto runs the draft model alone, and reads no hidden
    states."""
    target, draft = tiny_pair
    engine = Engine.from_pretrained(target=target, draft=draft, method="auto", dtype="float32")
    assert engine.drafter.head is None and not engine.drafter.traits.wants_hidden
    assert not engine.runner.keep_hidden
    plain = engine.with_method("none")
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    for prompt in random_prompts(3, seed=4):
        assert engine.generate(prompt, params).token_ids == plain.generate(prompt, params).token_ids
    assert set(engine.drafter.requests) == {"model", "none"}
    assert engine.drafter.requests["model"] >= 1


def test_a_head_asked_for_is_used_or_refused(tiny_pair, tmp_path):
    target, draft = tiny_pair
    with pytest.raises(UnderstudyError, match="holds no trained head"):
        Engine.from_pretrained(
            target=target, draft=draft, method="auto", head=str(tmp_path), dtype="float32"
        )
    with pytest.raises(UnderstudyError, match="does not take option"):
        Engine.from_pretrained(target=target, draft=draft, method="auto", tree="on")


def test_batched_requests_are_their_solo_answers(trained):
    target, draft, folder = trained
    engine = Engine.from_pretrained(
        target=target, draft=draft, method="auto", head=str(folder), dtype="float32",
        max_num_seqs=3,
    )  # fmt: skip
    plain = Engine.from_pretrained(target=target, method="none", dtype="float32")
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(3, seed=21)
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == [plain.generate(p, params).token_ids for p in prompts]


# -- sampling ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sampling_auto(tmp_path_factory) -> Engine:
    """A head trained on the target's sampled text and a noisy draft model: each one's q
    overlaps p, yet differs often."""
    from conftest import make_tiny_pair

    target, draft = make_tiny_pair(
        tmp_path_factory.mktemp("auto_sampling"), seed=5, noise=0.5, tokenizer=False
    )
    folder = tmp_path_factory.mktemp("auto_sampling_head")
    sequences = target_written_text(target, 40, seed=1, temperature=1.0)
    train_head(load_model(target, "float32"), sequences, folder, "test", SETTINGS, False)
    return Engine.from_pretrained(
        target=target, draft=draft, method="auto", head=str(folder), dtype="float32",
        num_speculative_tokens=2,
    )  # fmt: skip


@pytest.mark.parametrize("warp", ["top_k", "min_p"])
def test_sampling_matches_target_law(sampling_auto, warp):
    """N = 1500 samples of (x1, x2, x3); chi-squared goodness of fit, p > 0.001; requests
    served by each part among them."""
    auto = sampling_auto.drafter
    before = dict(auto.requests)
    params = SamplingParams(ignore_eos=True, **WARPS[warp])
    pvalue = goodness_of_fit(sampling_auto, [11, 42, 7], params, samples=1500)
    assert pvalue > P_THRESHOLD, f"{warp}: p = {pvalue:.2e}"
    served = {part: auto.requests[part] - before[part] for part in auto.requests}
    assert all(n >= 1500 // (2 * PartChoice.PROBE_EVERY) for n in served.values()), served


def test_a_part_that_misstates_its_law_fails_the_same_test(sampling_auto, monkeypatch):
    """Mutation: the draft model's q handed to the verifier one token off (rolled along the
    vocabulary) while its guesses are drawn from the real q, every request served by it:
    the same test detects it. (q one-hot would not do: any fixed guess verified as certain
    keeps the law, which is why free drafts are exact.)"""
    real = DraftModelProposer.propose

    def misstated(self, tokens, k, params, generator):
        proposal = real(self, tokens, k, params, generator)
        assert proposal.draft_probs is not None  # sampled: the draft's q
        return Proposal(proposal.draft_ids, torch.roll(proposal.draft_probs, 1, dims=-1))

    monkeypatch.setattr(PartChoice, "choose", lambda self: "model")
    monkeypatch.setattr(DraftModelProposer, "propose", misstated)
    params = SamplingParams(ignore_eos=True, **WARPS["top_k"])
    pvalue = goodness_of_fit(sampling_auto, [11, 42, 7], params, samples=1500)
    assert pvalue < P_THRESHOLD, f"the misstated q was not detected (p = {pvalue:.3f})"
