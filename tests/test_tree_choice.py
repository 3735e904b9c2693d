"""tree="auto": each round a tree or a chain, whichever has yielded more per modelled cost.

Unit: the chooser tries both shapes, then keeps the one with the higher tokens-per-cost rate
and retries the other every PROBE_EVERY rounds, less often when it is far behind (a chooser
that kept the lower rate fails `test_tries_both_then_keeps_the_better_shape`). End to end on the tiny pair: both shapes occur, greedy output
is plain decoding's, and the sampled joint law of three tokens is the target's (chi-squared,
p > 0.001, the harness of test_exactness.py).
"""

from __future__ import annotations

from test_exactness import P_THRESHOLD, WARPS, goodness_of_fit, random_prompts
from understudy import Engine, SamplingParams
from understudy.policy.costs import Costs
from understudy.policy.tree_choice import TreeOrChain


def run_rounds(chooser: TreeOrChain, emitted: dict[bool, int], rounds: int) -> list[bool]:
    """Play `rounds` rounds of 8 rows and 4 draft passes; each shape emits a fixed count."""
    shapes = []
    for _ in range(rounds):
        tree = chooser.choose()
        shapes.append(tree)
        chooser.observe(tree, emitted[tree], rows=8, draft_passes=4)
    return shapes


def test_tries_both_then_keeps_the_better_shape():
    """A far better shape (5 tokens a round against 2): the loser is retried only every
    FAR_FACTOR x PROBE_EVERY rounds."""
    rarely = TreeOrChain.FAR_FACTOR * TreeOrChain.PROBE_EVERY
    for better in (True, False):
        chooser = TreeOrChain(Costs(draft_step=0.1, row=0.02, tree_node=0.03))
        emitted = {better: 5, not better: 2}
        shapes = run_rounds(chooser, emitted, 160)
        tries = 2 * TreeOrChain.MIN_TRIES
        assert shapes[:tries] == [False, True] * TreeOrChain.MIN_TRIES  # alternating first
        later = shapes[tries:]
        assert later.count(not better) <= len(later) // rarely + 1
        assert later.count(not better) >= 3  # the loser is still retried now and then


def test_a_close_loser_is_retried_more_often():
    """Shapes within FAR of each other (10 tokens a round against 9, equal costs): the loser
    is retried every PROBE_EVERY rounds."""
    for better in (True, False):
        chooser = TreeOrChain(Costs(draft_step=0.1, row=0.02, tree_node=0.02))
        shapes = run_rounds(chooser, {better: 10, not better: 9}, 86)
        later = shapes[2 * TreeOrChain.MIN_TRIES :]
        assert later.count(better) >= len(later) - len(later) // TreeOrChain.PROBE_EVERY - 1
        assert later.count(not better) >= len(later) // TreeOrChain.PROBE_EVERY - 1


def test_cost_decides_when_tokens_tie():
    """Equal tokens per round: the shape whose rows cost less wins (v_tree > v here)."""
    chooser = TreeOrChain(Costs(draft_step=0.1, row=0.02, tree_node=0.06))
    shapes = run_rounds(chooser, {True: 4, False: 4}, 30)
    later = shapes[2 * TreeOrChain.MIN_TRIES :]
    assert later.count(False) > later.count(True)
    assert chooser.round_cost(True, 8, 4) > chooser.round_cost(False, 8, 4)
    assert chooser.round_cost(False, 0, 0) == 1.0  # nothing drafted: a plain pass


def test_auto_trees_greedy_identity_and_both_shapes(tiny_pair):
    target, draft = tiny_pair
    engine = Engine.from_pretrained(target=target, draft=draft, dtype="float32", tree="auto")
    assert engine.tree_mode == "auto" and engine.exact
    assert engine.costs.tree_node >= 0.0  # measured at build
    plain = engine.with_method("none")
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    shapes = set()
    for prompt in random_prompts(3, seed=21):  # the engine's chooser learns across them
        rounds = []
        stream = engine.stream(prompt, params, on_round=rounds.append)
        for _ in stream:
            pass
        assert stream.output.token_ids == plain.generate(prompt, params).token_ids
        shapes |= {r.parents is not None for r in rounds if r.drafted}
    assert shapes == {True, False}


def test_auto_trees_sampling_law(tmp_path_factory):
    """Round 1 a chain of one guess, round 2 a tree: the law of three tokens is the target's."""
    from conftest import make_tiny_pair

    target, draft = make_tiny_pair(
        tmp_path_factory.mktemp("tree_auto"), seed=9, noise=0.5, tokenizer=False
    )
    engine = Engine.from_pretrained(
        target=target, draft=draft, dtype="float32", num_speculative_tokens=1, tree="auto"
    )
    params = SamplingParams(ignore_eos=True, **WARPS["top_k"])
    pvalue = goodness_of_fit(engine, [11, 42, 7], params, samples=1500)
    assert pvalue > P_THRESHOLD, f"p = {pvalue:.2e}"
