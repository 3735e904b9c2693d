"""method="eagle": a head trained on the target's own hidden states drafts; the target decides.

A tiny head trained in the test (eagle_helpers.py), loaded by the engine from disk. Then the
same proofs as every method: greedy output equals plain decoding (chains, trees, int4 and
dense heads, rounds cut short by doubt), and the sampled joint law of the first 3 tokens is
the target's (chi-squared, p > 0.001), with a mutation that fails it. Training the head:
test_eagle_training.py.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from eagle_helpers import SETTINGS, target_written_text, train_greedy_head
from test_exactness import P_THRESHOLD, WARPS, goodness_of_fit, random_prompts
from understudy import Engine, SamplingParams, UnderstudyError
from understudy.head.features import sequence_data
from understudy.head.lockstep import prepare_target
from understudy.head.pipeline import train_head
from understudy.kernels import qgemm
from understudy.models.loader import load_model
from understudy.models.quant import Int4Linear
from understudy.policy.costs import Costs


def accepted_in_greedy_identity(engine: Engine, prompts: list[list[int]], tokens: int) -> int:
    """Assert that `engine`'s greedy output equals plain decoding's on every prompt; return
    how many guesses it kept in all (so a caller can check that it drafted at all)."""
    plain = engine.with_method("none")
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    accepted = 0
    for prompt in prompts:
        out = engine.generate(prompt, params)
        assert out.token_ids == plain.generate(prompt, params).token_ids
        accepted += out.stats.accepted
    return accepted


@pytest.fixture(scope="module")
def trained(tiny_pair, tmp_path_factory) -> tuple[str, Path, dict]:
    target, _ = tiny_pair
    folder = tmp_path_factory.mktemp("eagle") / "head"
    return target, folder, train_greedy_head(target, folder)


@pytest.mark.parametrize("k", [1, 3, 5, "auto"])
def test_greedy_identity(trained, k):
    target, folder, _ = trained
    engine = Engine.from_pretrained(
        target=target, method="eagle", draft=str(folder), dtype="float32",
        num_speculative_tokens=k, tree="off",
    )  # fmt: skip
    assert engine.exact and not engine.tree
    assert accepted_in_greedy_identity(engine, random_prompts(4, seed=11), 40) > 0


@pytest.mark.parametrize("k,branching", [(3, 2), (4, 3), ("auto", 2)])
def test_greedy_tree_identity(trained, k, branching):
    """tree="on": the head's trees (EAGLE-2) give plain decoding's tokens, and they branch."""
    target, folder, _ = trained
    engine = Engine.from_pretrained(
        target=target,
        method="eagle",
        draft=str(folder),
        dtype="float32",
        num_speculative_tokens=k,
        tree="on",
        tree_branching=branching,
        free_drafts="off",  # the head's own rounds: free ones are chains (test_free_first.py)
    )
    assert engine.tree and engine.exact
    plain = engine.with_method("none")
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    accepted = branched = 0
    for prompt in random_prompts(4, seed=13):
        rounds = []
        out = engine.stream(prompt, params, on_round=rounds.append)
        assert [event.token_id for event in out] == plain.generate(prompt, params).token_ids
        accepted += out.output.stats.accepted
        for r in (r for r in rounds if r.drafted):  # the last rounds may have no room
            assert r.parents is not None and len(r.drafted) <= engine.runner.rows - 1
            branched += len(set(r.parents)) < len(r.parents)  # some node has two children
    assert accepted > 0 and branched > 0


def test_default_drafts_trees_where_they_pay_and_keeps_identity(trained):
    """method="eagle" as a user builds it: tree="auto" with 4 children a node (tree_choice.py
    picks the shape each round); greedy output is still plain decoding's."""
    target, folder, _ = trained
    engine = Engine.from_pretrained(
        target=target, method="eagle", draft=str(folder), dtype="float32"
    )
    assert engine.tree_mode == "auto" and engine.tree and engine.drafter.branching == 4
    assert engine.exact
    # on a CPU the head drafts in int4 (draft_quantization="auto"), its LM rows included
    info = engine.drafter.head.quantization
    assert info.scheme == "int4-g32" and "lm" in info.quantized and "fc" in info.quantized
    assert isinstance(engine.drafter.head.fc, Int4Linear)
    plain = engine.with_method("none")
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    for prompt in random_prompts(3, seed=17):
        assert engine.generate(prompt, params).token_ids == plain.generate(prompt, params).token_ids


def test_head_quantization_is_chosen_and_checked(trained):
    """draft_quantization applies to the head: None keeps it dense, a scheme is used as
    given (and still keeps greedy identity), an unknown one is refused by name."""
    target, folder, _ = trained

    def build(quantization: str | None) -> Engine:
        return Engine.from_pretrained(
            target=target, method="eagle", draft=str(folder), dtype="float32",
            draft_quantization=quantization,
        )  # fmt: skip

    dense = build(None).drafter.head
    assert not hasattr(dense, "quantization") and type(dense.fc) is torch.nn.Linear
    engine = build("int8")
    assert engine.drafter.head.quantization.scheme == "int8"
    assert accepted_in_greedy_identity(engine, random_prompts(3, seed=23), 32) > 0
    blocks = build("q8_0")
    assert isinstance(blocks.drafter.head.fc, qgemm.QuantLinear)
    assert accepted_in_greedy_identity(blocks, random_prompts(3, seed=23), 32) > 0
    with pytest.raises(UnderstudyError, match="draft_quantization must be"):
        build("int3")


def test_tree_rounds_hand_the_head_the_kept_path(trained):
    """After tree rounds the head holds the target's features of exactly the kept tokens:
    those of one prefill of the whole output (the kept path's hidden states, in order)."""
    target, folder, _ = trained
    # the head as trained (draft_quantization=None): torch's int4 linears compute in bf16 and
    # round differently for different row counts, which is not what this checks (which
    # tokens' features the head holds); a misplaced row differs by far more
    engine = Engine.from_pretrained(
        target=target, method="eagle", draft=str(folder), dtype="float32",
        num_speculative_tokens=3, tree="on", draft_quantization=None,
    )  # fmt: skip
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    prompt = random_prompts(1, seed=21)[0]
    out = engine.generate(prompt, params)
    assert out.stats.accepted > 0
    sequence = prompt + out.token_ids
    model = load_model(target, "float32").model
    prepare_target(model)
    head = engine.drafter.head
    model.feature_layers = head.cfg.feature_layers
    with torch.inference_mode():
        features = head.input_features(sequence_data(model, [sequence])["kept"][0])  # [T, H]
    known = engine.drafter.known
    assert known >= len(sequence) - 2
    torch.testing.assert_close(engine.drafter.real_features(), features[:known])


def test_doubt_ends_rounds_and_keeps_identity(trained):
    """draft_path_confidence: at 1.0 every round stops after its first guess (a product of
    probabilities below 1); at a low bar under automatic K, rounds run past the length
    automatic K alone allows. Greedy output stays plain decoding's, and the calibration has
    seen exactly the guesses the target judged.

    The row budget and the costs automatic K reads are fixed here, so the test means the same
    on every machine (measured costs differ: on a CPU where automatic K alone already drafts
    to the row budget, no bar could run past it). At c = 0.3 automatic K alone stopped these
    rounds at 7 guesses, the bar at 1e-4 at 15 (the tiny head's calibrated chances are low:
    a bar of 0.01 stops them at 6)."""
    target, folder, _ = trained
    plain = Engine.from_pretrained(target=target, method="none", dtype="float32")
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    lengths = {}
    for name, options in (
        ("sure", {"num_speculative_tokens": 5, "draft_path_confidence": 1.0}),
        ("bold", {"draft_path_confidence": 1e-4}),
        ("k", {"draft_path_confidence": 0.0}),
    ):
        engine = Engine.from_pretrained(
            target=target,
            method="eagle",
            draft=str(folder),
            dtype="float32",
            verify_rows=16,
            tree="off",
            free_drafts="off",  # the head's own rounds alone
            **options,
        )
        engine.costs = Costs(draft_step=0.3, row=0.0)
        lengths[name] = []
        for prompt in random_prompts(3, seed=17):
            rounds = []
            stream = engine.stream(prompt, params, on_round=rounds.append)
            assert [e.token_id for e in stream] == plain.generate(prompt, params).token_ids
            lengths[name] += [len(r.drafted) for r in rounds if r.drafted]
            if name == "bold":
                # every round but the last (the request ends with it: no later round could
                # use what it would teach) counts its guesses up to the first rejected one
                judged = sum(min(len(r.drafted), r.accepted + 1) for r in rounds[:-1])
                assert sum(engine.drafter.calibration.seen) == judged
    assert lengths["sure"] and set(lengths["sure"]) == {1}
    assert max(lengths["bold"]) > max(lengths["k"]), lengths


def test_doubt_options_settle_and_refuse_bad_values(trained):
    from understudy.drafters.eagle import AUTO_PATH_CONFIDENCE

    target, folder, _ = trained

    def build(**options: object) -> Engine:
        return Engine.from_pretrained(
            target=target, method="eagle", draft=str(folder), dtype="float32", **options
        )

    automatic = build()  # "auto": the tuned floor, or what a guess costs where that is more
    guess = automatic.costs.draft_step + automatic.costs.row
    assert automatic.drafter.path_confidence == min(max(AUTO_PATH_CONFIDENCE, guess), 1.0)
    assert automatic.drafter.path_confidence >= AUTO_PATH_CONFIDENCE > 0
    fixed = build(num_speculative_tokens=3).drafter
    assert fixed.path_confidence == 0.0 and not fixed.stops_by_confidence
    assert build(draft_confidence=0.3).drafter.confidence == 0.3
    for name in ("draft_confidence", "draft_path_confidence"):
        with pytest.raises(UnderstudyError, match=name):
            build(**{name: 1.5})


def test_missing_head_says_how_to_train_one(tiny_pair, tmp_path, monkeypatch):
    monkeypatch.setenv("UNDERSTUDY_CACHE", str(tmp_path))
    target, _ = tiny_pair
    with pytest.raises(UnderstudyError, match="understudy train-head --target"):
        Engine.from_pretrained(target=target, method="eagle", dtype="float32")
    with pytest.raises(UnderstudyError, match="holds no trained head"):
        Engine.from_pretrained(target=target, method="eagle", draft=str(tmp_path), dtype="float32")


def test_a_head_option_that_names_no_folder_is_refused(tiny_pair):
    target, _ = tiny_pair
    for head in (5, True, ["a"]):  # e.g. --option head=5 parses to an int
        with pytest.raises(UnderstudyError, match="head must be a folder"):
            Engine.from_pretrained(target=target, method="eagle", dtype="float32", head=head)


def test_head_of_another_target_is_refused(trained, tmp_path):
    target, folder, _ = trained
    other = tmp_path / "other"
    shutil.copytree(folder, other, ignore=shutil.ignore_patterns("features-*", "*.pt"))
    config = json.loads((other / "config.json").read_text())
    config["head"]["target_vocab_size"] += 1
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnderstudyError, match="another target"):
        Engine.from_pretrained(target=target, method="eagle", draft=str(other), dtype="float32")


# -- sampling: the joint law of the first three tokens ----------------------------------------


@pytest.fixture(scope="module")
def sampling_head(tmp_path_factory) -> tuple[str, Path]:
    """A head trained on the target's sampled text: its q overlaps p, yet differs often."""
    from conftest import make_tiny_pair

    target, _ = make_tiny_pair(
        tmp_path_factory.mktemp("eagle_sampling"), seed=5, noise=0.5, tokenizer=False
    )
    folder = tmp_path_factory.mktemp("eagle_sampling_head")
    sequences = target_written_text(target, 40, seed=1, temperature=1.0)
    train_head(load_model(target, "float32"), sequences, folder, "test", SETTINGS, False)
    return target, folder


@pytest.fixture(scope="module")
def sampling_eagle(sampling_head):
    target, folder = sampling_head
    return Engine.from_pretrained(
        target=target, method="eagle", draft=str(folder), dtype="float32",
        num_speculative_tokens=2, tree="off",
    )  # fmt: skip


@pytest.fixture(scope="module")
def sampling_eagle_tree(sampling_head):
    target, folder = sampling_head
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a non-default budget, when passes are padded
        return Engine.from_pretrained(
            target=target, method="eagle", draft=str(folder), dtype="float32",
            num_speculative_tokens=2, verify_rows=7, tree="on", tree_branching=3,
        )  # fmt: skip


@pytest.mark.parametrize("warp", list(WARPS))
def test_sampling_matches_target_law(sampling_eagle, warp):
    """N = 1500 samples of (x1, x2, x3); chi-squared goodness of fit, p > 0.001."""
    params = SamplingParams(ignore_eos=True, **WARPS[warp])
    pvalue = goodness_of_fit(sampling_eagle, [11, 42, 7], params, samples=1500)
    assert pvalue > P_THRESHOLD, f"{warp}: p = {pvalue:.2e}"


def test_sampling_law_with_doubt(sampling_head):
    """Rounds cut short by the head's own doubt keep the target's law (p > 0.001)."""
    target, folder = sampling_head
    engine = Engine.from_pretrained(
        target=target, method="eagle", draft=str(folder), dtype="float32",
        num_speculative_tokens=3, draft_path_confidence=0.3, tree="off",
    )  # fmt: skip
    params = SamplingParams(ignore_eos=True, **WARPS["top_k"])
    pvalue = goodness_of_fit(engine, [11, 42, 7], params, samples=1500)
    assert pvalue > P_THRESHOLD, f"p = {pvalue:.2e}"


@pytest.fixture(scope="module")
def sampling_eagle_blocks(sampling_head):
    """The sampling head with its linears in Q4_0 blocks on qgemm (models/block_linears.py)."""
    target, folder = sampling_head
    return Engine.from_pretrained(
        target=target, method="eagle", draft=str(folder), dtype="float32",
        num_speculative_tokens=2, tree="off", draft_quantization="q4_0",
    )  # fmt: skip


@pytest.mark.skipif(not qgemm.available(), reason="qgemm cannot be built here")
def test_block_head_sampling_matches_target_law(sampling_eagle_blocks):
    """A head drafting on the block kernels keeps the target's law: N = 1500 samples of
    (x1, x2, x3), chi-squared, p > 0.001."""
    assert isinstance(sampling_eagle_blocks.drafter.head.lm, qgemm.QuantLinear)
    params = SamplingParams(ignore_eos=True, **WARPS["min_p"])
    pvalue = goodness_of_fit(sampling_eagle_blocks, [11, 42, 7], params, samples=1500)
    assert pvalue > P_THRESHOLD, f"p = {pvalue:.2e}"


@pytest.mark.skipif(not qgemm.available(), reason="qgemm cannot be built here")
def test_a_head_that_misstates_its_law_fails_the_same_test(sampling_eagle_blocks, monkeypatch):
    """Mutation: a head that samples its guess at the request's warp but hands the verifier
    q unwarped (its plain softmax) is detected by the same test."""
    from understudy.drafters import eagle as eagle_module

    real_guess = eagle_module.EagleProposer._guess

    def misstated(self, predicted, params, generator):
        token, q, own = real_guess(self, predicted, params, generator)
        logits = self.head.draft_logits(predicted[None]).float().cpu()[0]  # [N]
        q = torch.zeros(self.head.cfg.target_vocab_size)
        q[self.vocab] = torch.softmax(logits, -1)
        return token, q, own

    monkeypatch.setattr(eagle_module.EagleProposer, "_guess", misstated)
    params = SamplingParams(ignore_eos=True, **WARPS["min_p"])
    pvalue = goodness_of_fit(sampling_eagle_blocks, [11, 42, 7], params, samples=1500)
    assert pvalue < P_THRESHOLD, f"the misstated q was not detected (p = {pvalue:.3f})"


def test_wrong_verifier_fails_the_same_test(sampling_eagle, monkeypatch):
    """Mutation check: resampling from p instead of the residual max(0, p - q) after a
    rejected guess of the head is detected by the same test."""
    import understudy.engine.verdict as verdict_module
    from stats_helpers import resample_from_p_verify

    monkeypatch.setattr(verdict_module, "verify_sampling", resample_from_p_verify)
    params = SamplingParams(ignore_eos=True, **WARPS["top_k"])
    pvalue = goodness_of_fit(sampling_eagle, [11, 42, 7], params, samples=1500)
    assert pvalue < P_THRESHOLD, f"the wrong verifier was not detected (p = {pvalue:.3f})"


@pytest.mark.parametrize("warp", ["top_k", "min_p"])
def test_tree_sampling_matches_target_law(sampling_eagle_tree, warp):
    """The head's trees, sampled: N = 1500 samples of (x1, x2, x3), chi-squared, p > 0.001."""
    params = SamplingParams(ignore_eos=True, **WARPS[warp])
    pvalue = goodness_of_fit(sampling_eagle_tree, [11, 42, 7], params, samples=1500)
    assert pvalue > P_THRESHOLD, f"{warp}: p = {pvalue:.2e}"


def test_wrong_tree_rule_fails_the_same_test(sampling_eagle_tree, monkeypatch):
    """Mutation: the sibling rule that never takes rejected siblings out of p is detected."""
    import understudy.engine.verdict as verdict_module
    from stats_helpers import wrong_sibling_rule

    monkeypatch.setattr(verdict_module, "verify_tree_sampling", wrong_sibling_rule)
    params = SamplingParams(ignore_eos=True, **WARPS["top_k"])
    pvalue = goodness_of_fit(sampling_eagle_tree, [11, 42, 7], params, samples=1500)
    assert pvalue < P_THRESHOLD, f"the wrong sibling rule was not detected (p = {pvalue:.3f})"
