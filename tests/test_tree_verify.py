"""Tree verification (understudy.verify.tree) and decoding with dynamic draft trees
(DraftModelProposer.propose_tree), on tiny models:

c. greedy identity: tree speculative output == plain output, fp32 and bf16; the rounds are
   trees, and the draft's cache is rolled back after each;
d. sampling: the exact law of the first three tokens with tree drafting (chi-squared), and a
   wrong sibling rule (stats_helpers.wrong_sibling_rule) that the same test detects.

The tree itself and the target's tree pass (a, b, e): test_tree.py.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch
from scipy.stats import chisquare

from stats_helpers import wrong_sibling_rule
from test_exactness import P_THRESHOLD, WARPS, goodness_of_fit, random_prompts
from understudy import Engine, SamplingParams
from understudy.config import UnderstudyError
from understudy.verify.token_tree import TokenTree
from understudy.verify.tree import TreeVerdict, verify_tree_greedy, verify_tree_sampling

NON_DEFAULT_ROWS = "ignore:target passes hold"  # the exact=False warning of odd row budgets


def tree_engine(tiny_pair: tuple[str, str], **options: object) -> Engine:
    """The tiny pair with trees on, fp32, a 9-row budget (8 tree nodes)."""
    target, draft = tiny_pair
    return Engine.from_pretrained(
        target=target, draft=draft, dtype="float32", verify_rows=9, tree="on", **options
    )


# -- c. greedy identity -------------------------------------------------------------------------


@pytest.mark.filterwarnings(NON_DEFAULT_ROWS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows,branching,k", [(4, 2, 3), (9, 2, 4), (9, 3, 2), (17, 4, "auto")])
def test_greedy_tree_identity(tiny_pair, dtype, rows, branching, k):
    target, draft = tiny_pair
    spec = Engine.from_pretrained(
        target=target,
        draft=draft,
        dtype=dtype,
        num_speculative_tokens=k,
        verify_rows=rows,
        tree="on",
        tree_branching=branching,
    )
    assert spec.tree  # stats.exact is the row budget's alone: trees cost no exactness
    spec.costs = replace(spec.costs, draft_step=0.05)  # auto K: a cheap draft, deep trees
    plain = spec.with_method("none")
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    drafted = accepted = 0
    for prompt in random_prompts(5, seed=rows + branching):
        out = spec.generate(prompt, params)
        assert out.token_ids == plain.generate(prompt, params).token_ids
        drafted += out.stats.drafted
        accepted += out.stats.accepted
    assert drafted > 0 and accepted > 0


@pytest.mark.filterwarnings(NON_DEFAULT_ROWS)
def test_tree_rounds_are_trees(tiny_pair):
    """The proposer really branches, the budget holds, and the emitted tokens follow a path."""
    spec = tree_engine(tiny_pair, num_speculative_tokens=3, tree_branching=2)
    rounds = []
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    out = spec.stream([5, 6, 7, 8], params, on_round=rounds.append)
    tokens = [e.token_id for e in out]
    assert rounds and all(r.parents is not None for r in rounds if r.drafted)
    assert any(len(set(r.parents)) < len(r.parents) for r in rounds if r.drafted)  # branching
    assert all(len(r.drafted) <= 8 for r in rounds)
    emitted = tokens[1:]
    for r in rounds:
        tree = TokenTree.from_drafts(0, torch.tensor(r.drafted), torch.tensor(r.parents))
        assert all(d <= 3 for d in tree.depths.tolist())
        if r.path:
            assert tree.path(r.path[-1] + 1)[1:] == [i + 1 for i in r.path]
        kept = [r.drafted[i] for i in r.path or []]
        assert emitted[: len(kept) + 1] == [*kept, r.next_token][: len(emitted)]
        emitted = emitted[len(kept) + 1 :]


def test_tree_option_validation(tiny_pair):
    target, draft = tiny_pair
    with pytest.raises(UnderstudyError, match="tree must be"):
        Engine.from_pretrained(target=target, draft=draft, dtype="float32", tree="yes")
    with pytest.raises(UnderstudyError, match="tree_branching"):
        Engine.from_pretrained(target=target, draft=draft, dtype="float32", tree_branching=0)
    off = Engine.from_pretrained(target=target, draft=draft, dtype="float32")
    assert off.tree is False and off.exact  # default: chains, untouched
    auto = Engine.from_pretrained(target=target, draft=draft, dtype="float32", tree="auto")
    assert auto.tree and auto.tree_mode == "auto"  # tree_choice.py decides each round


def test_padded_trees_are_exact(tiny_pair):
    """Padded passes (bfloat16 here): tree="on" and tree="auto" draft trees, stay exact and
    give plain decoding's tokens."""
    target, draft = tiny_pair
    plain = Engine.from_pretrained(target=target, method="none", dtype="bfloat16")
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for mode in ("on", "auto"):
        spec = Engine.from_pretrained(target=target, draft=draft, dtype="bfloat16", tree=mode)
        assert spec.pad and spec.tree and spec.exact and spec.tree_mode == mode
        trees = 0
        for prompt in random_prompts(3, seed=7):
            rounds: list = []
            stream = spec.stream(prompt, params, on_round=rounds.append)
            for _ in stream:
                pass
            assert stream.output.token_ids == plain.generate(prompt, params).token_ids
            assert stream.output.stats.exact
            trees += sum(r.parents is not None for r in rounds)
        assert trees > 0, mode


@pytest.mark.filterwarnings(NON_DEFAULT_ROWS)
def test_draft_cache_is_rolled_back(tiny_pair):
    """After propose_tree the draft's cache again holds exactly the committed tokens."""
    spec = tree_engine(tiny_pair, num_speculative_tokens=4, tree_branching=3)
    proposer = spec.drafter
    tokens = [5, 6, 7, 8, 9]
    proposer.begin(tokens)
    proposal = proposer.propose_tree(tokens, 4, 8, SamplingParams(temperature=0.0), None)
    assert 1 <= proposal.size <= 8 and proposal.draft_probs is None
    assert proposer.runner.length == len(tokens) and proposer.fed == tokens
    parents = proposal.parents.tolist()
    assert all(-1 <= q < i for i, q in enumerate(parents))
    # the first-child path is the draft's own greedy chain
    proposer.begin(tokens)
    chain = proposer.propose(tokens, 4, SamplingParams(temperature=0.0), None).draft_ids
    depth = next((i for i, q in enumerate(parents) if q != i - 1), len(parents))
    assert proposal.draft_ids[:depth].tolist() == chain[:depth].tolist()


# -- d. sampling: the exact law -----------------------------------------------------------------


def test_sibling_rule_gives_p_exactly():
    """verify_tree_sampling on a fixed tree and fixed p: the law of (path, next token)."""
    # root -> children 1, 2 (tokens 0, 1); node 1 -> child 3 (token 2)
    tree = TokenTree(torch.tensor([9, 0, 1, 2]), torch.tensor([-1, 0, 0, 1]))
    p = torch.tensor(
        [
            [0.5, 0.3, 0.2, 0.0],  # at the root
            [0.1, 0.2, 0.3, 0.4],  # after token 0
            [0.25, 0.25, 0.25, 0.25],  # after token 1
            [0.7, 0.1, 0.1, 0.1],  # after 0, 2 (a leaf: bonus)
        ]
    )
    law = {(0, b): float(0.5 * p[1, b]) for b in range(4)}  # 0 kept: node 1's p next
    law |= {(1, b): float(0.3 * p[2, b]) for b in range(4)}  # 1 kept: a leaf, the bonus
    law[(2,)] = 0.2  # both children rejected: 2 from the residual, the walk ends
    gen = torch.Generator().manual_seed(0)
    counts = dict.fromkeys(law, 0)
    n = 20000
    for _ in range(n):
        v = verify_tree_sampling(tree, p, gen)
        emitted = [int(tree.tokens[i]) for i in v.path] + [v.next_token]
        counts[tuple(emitted[:2])] += 1
    keys = list(law)
    keys = [c for c in keys if law[c] > 0]
    assert sum(counts[c] for c in law if law[c] == 0) == 0
    expected = [law[c] * n for c in keys]
    expected = [e * n / sum(expected) for e in expected]  # float sums: exactly n
    pvalue = chisquare([counts[c] for c in keys], expected).pvalue
    assert pvalue > P_THRESHOLD, pvalue


def test_greedy_tree_verdicts():
    tree = TokenTree(torch.tensor([9, 0, 1, 2]), torch.tensor([-1, 0, 0, 1]))
    logits = torch.full((4, 5), -1.0)
    logits[0, 0] = logits[1, 2] = logits[3, 4] = 1.0
    assert verify_tree_greedy(tree, logits) == TreeVerdict([1, 3], 4, True)  # bonus at a leaf
    logits[1, 2], logits[1, 3] = -1.0, 1.0
    assert verify_tree_greedy(tree, logits) == TreeVerdict([1], 3, False)  # corrected
    logits[0, 0], logits[0, 1] = -1.0, 1.0
    logits[2, 4] = 1.0
    assert verify_tree_greedy(tree, logits) == TreeVerdict([2], 4, True)  # second sibling


@pytest.fixture(scope="module")
def tree_sampling_engine(tmp_path_factory):
    """A draft that disagrees often (noise 0.5): siblings past the first matter."""
    from conftest import make_tiny_pair

    target, draft = make_tiny_pair(
        tmp_path_factory.mktemp("tree_sampling"), seed=5, noise=0.5, tokenizer=False
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a non-default budget, when passes are padded
        return Engine.from_pretrained(
            target=target, draft=draft, dtype="float32", num_speculative_tokens=2,
            verify_rows=7, tree="on", tree_branching=2,
        )  # fmt: skip


@pytest.mark.parametrize("warp", ["top_k", "min_p"])
def test_tree_sampling_matches_target_law(tree_sampling_engine, warp):
    """N = 1500 samples of (x1, x2, x3); chi-squared goodness of fit, p > 0.001."""
    params = SamplingParams(ignore_eos=True, **WARPS[warp])
    pvalue = goodness_of_fit(tree_sampling_engine, [11, 42, 7], params, samples=1500)
    assert pvalue > P_THRESHOLD, f"{warp}: p = {pvalue:.2e}"


def test_wrong_sibling_rule_fails_the_same_test(tree_sampling_engine, monkeypatch):
    """Mutation: accept each sibling with its ORIGINAL p(x), never removing the rejected ones
    from p (so sibling j is taken with prob prod(1 - p(x_l)) * p(x_j) < p(x_j))."""
    import understudy.engine.verdict as verdict_module

    monkeypatch.setattr(verdict_module, "verify_tree_sampling", wrong_sibling_rule)
    params = SamplingParams(ignore_eos=True, **WARPS["top_k"])
    pvalue = goodness_of_fit(tree_sampling_engine, [11, 42, 7], params, samples=1500)
    assert pvalue < P_THRESHOLD, f"the wrong sibling rule was not detected (p = {pvalue:.3f})"
