"""Token trees (understudy.verify.token_tree), tree passes (Runner.tree_pass / keep_path), tree verification
(verify_tree.py) and dynamic draft trees (DraftModelProposer.propose_tree), on tiny models:

a. the layout of a small tree, by hand;
b. bitwise: a node scored in a tree pass vs its path scored as a chain (same rows);
c. greedy identity: tree speculative output == plain output, fp32 and bf16;
d. sampling: the exact law of the first three tokens with tree drafting (chi-squared), and a
   wrong sibling rule that the same test detects;
e. KV compaction: after keep_path the cache holds the path as a chain would have written it.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch
from scipy.stats import chisquare

from test_exactness import P_THRESHOLD, WARPS, goodness_of_fit, needs_rowgemm, random_prompts
from understudy import Engine, SamplingParams
from understudy.config import UnderstudyError
from understudy.models.runner import Runner
from understudy.verify.token_tree import TokenTree
from understudy.verify.tree import TreeVerdict, verify_tree_greedy, verify_tree_sampling

NON_DEFAULT_ROWS = "ignore:target passes hold"  # the exact=False warning of odd row budgets

# root 5; depth 1: 7, 99, 12; depth 2: 250, 31 (under 7), 8 (under 99), 3 (under 12); ...
TOKENS = [5, 7, 99, 12, 250, 31, 8, 64, 1, 2, 3, 4, 200]
PARENTS = [-1, 0, 0, 0, 1, 1, 2, 4, 4, 7, 3, 10, 6]


# -- a. layout ---------------------------------------------------------------------------------


def test_tree_layout_by_hand():
    #        0(5)
    #      /      \
    #    1(7)     2(9)
    #    /  \       \
    #  3(4) 4(6)    5(8)
    tree = TokenTree(torch.tensor([5, 7, 9, 4, 6, 8]), torch.tensor([-1, 0, 0, 1, 1, 2]))
    assert tree.depths.tolist() == [0, 1, 1, 2, 2, 2]
    assert tree.depth == 2 and tree.size == 6
    assert tree.children() == [[1, 2], [3, 4], [5], [], [], []]
    assert tree.path(4) == [0, 1, 4] and tree.path(0) == [0] and tree.path(5) == [0, 2, 5]
    want = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0],
            [1, 1, 0, 1, 0, 0],
            [1, 1, 0, 0, 1, 0],
            [1, 0, 1, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(tree.ancestor_mask(), want)
    assert tree.positions(10).tolist() == [10, 11, 11, 12, 12, 12]
    offsets = tree.slot_offsets()
    assert offsets.tolist() == [0, 1, 2, 3, 4, 5]
    assert torch.equal(tree.region_mask(offsets), want)
    # a Proposal's view: drafts 7, 9, 4, 6, 8 with parents -1, -1, 0, 0, 1
    same = TokenTree.from_drafts(5, torch.tensor([7, 9, 4, 6, 8]), torch.tensor([-1, -1, 0, 0, 1]))
    assert torch.equal(same.parents, tree.parents) and torch.equal(same.tokens, tree.tokens)
    chain = TokenTree.chain(5, [7, 9, 4])
    assert chain.parents.tolist() == [-1, 0, 1, 2] and chain.depths.tolist() == [0, 1, 2, 3]
    assert torch.equal(chain.ancestor_mask(), torch.ones(4, 4, dtype=torch.bool).tril())


def test_tree_rejects_bad_shapes():
    with pytest.raises(AssertionError):
        TokenTree(torch.tensor([1, 2, 3]), torch.tensor([-1, 2, 0]))  # parent after child
    with pytest.raises(AssertionError):
        TokenTree(torch.tensor([1, 2, 2]), torch.tensor([-1, 0, 0]))  # equal siblings
    with pytest.raises(AssertionError):
        TokenTree(torch.tensor([1, 2]), torch.tensor([0, 0]))  # no root


def test_runner_tree_pass_mask_positions_slots(tiny_pair, monkeypatch):
    """The exact tensors a padded target tree pass hands to the model."""
    target, _ = tiny_pair
    model = Engine.from_pretrained(target=target, method="none", dtype="float32").target.model
    runner = Runner(model, 64, rows=8)
    runner.prefill(torch.arange(3, 13), span=20)  # 10 prompt tokens: the root is at slot 10
    tree = TokenTree(torch.tensor([5, 7, 9, 4, 6, 8]), torch.tensor([-1, 0, 0, 1, 1, 2]))
    seen = {}

    def spy(tokens, positions, slots, mask, logit_rows=None, key_slots=None, split=None):
        seen.update(tokens=tokens, positions=positions, slots=slots, mask=mask, split=split)
        return torch.zeros(tokens.shape[0], model.cfg.vocab_size)

    monkeypatch.setattr(model, "forward", spy)
    offsets = tree.slot_offsets()
    runner.tree_pass(tree.tokens, tree.depths, offsets, tree.region_mask(offsets))
    assert seen["tokens"].tolist() == [5, 7, 9, 4, 6, 8, 0, 0]  # 2 filler rows
    assert seen["positions"].tolist() == [10, 11, 11, 12, 12, 12, 16, 17]
    assert seen["slots"].tolist() == [10, 11, 12, 13, 14, 15, 16, 17]
    mask = seen["mask"]
    assert mask.shape == (8, runner.window)  # the request's fixed key window
    assert mask[:, :10].all()
    assert torch.equal(mask[:6, 10:16], tree.ancestor_mask())
    assert not mask[:6, 16:].any()
    assert mask[6, 16] and mask[7, 17] and mask[6:, 10:16].sum() == 0 and mask[6:].sum() == 22
    assert runner.length == 10  # a tree pass leaves the length alone
    # the split the model attends through: near the start, no head part; each node's tail
    # is the prefix then its own path root..node, in chain order
    split = seen["split"]
    window = runner.window
    assert split.window == window and split.tail == 8 + 16
    assert torch.isinf(split.bias[0, :, 0, :window]).all()
    tails = split.tail_slots.view(8, split.tail)
    paths = [[10], [10, 11], [10, 12], [10, 11, 13], [10, 11, 14], [10, 12, 15]]
    for i, path in enumerate(paths):
        sees = split.bias[0, i, 0, window:] == 0
        assert tails[i][sees].tolist() == [*range(10), *path], i


@needs_rowgemm
def test_unpadded_tree_pass_gathers_each_path_in_chain_order(tiny_pair, monkeypatch):
    """With row-invariant kernels: no filler rows, and node i attends to the prefix then its
    own path root..node at key positions base..base+depth, exactly where a chain has them."""
    target, _ = tiny_pair
    model = Engine.from_pretrained(target=target, method="none", dtype="float32").target.model
    runner = Runner(model, 64, rows=8, pad=False)
    runner.prefill(torch.arange(3, 13), span=20)
    tree = TokenTree(torch.tensor([5, 7, 9, 4, 6, 8]), torch.tensor([-1, 0, 0, 1, 1, 2]))
    seen = {}

    def spy(tokens, positions, slots, mask, logit_rows=None, key_slots=None, split=None):
        assert split is None  # row-invariant kernels gather whole windows instead
        seen.update(tokens=tokens, positions=positions, slots=slots, mask=mask, keys=key_slots)
        return torch.zeros(tokens.shape[0], model.cfg.vocab_size)

    monkeypatch.setattr(model, "forward", spy)
    offsets = tree.slot_offsets()
    runner.tree_pass(tree.tokens, tree.depths, offsets, tree.region_mask(offsets))
    assert seen["tokens"].tolist() == [5, 7, 9, 4, 6, 8]
    assert seen["positions"].tolist() == [10, 11, 11, 12, 12, 12]
    assert seen["slots"].tolist() == [10, 11, 12, 13, 14, 15]
    keys, mask = seen["keys"], seen["mask"]
    assert keys.shape == mask.shape == (6, runner.window)
    assert (keys[:, :10] == torch.arange(10)).all()
    paths = [[10], [10, 11], [10, 12], [10, 11, 13], [10, 11, 14], [10, 12, 15]]
    for i, path in enumerate(paths):
        assert keys[i, 10 : 10 + len(path)].tolist() == path
        assert mask[i].tolist() == [j < 10 + len(path) for j in range(runner.window)]


# -- b. bitwise: tree pass vs chain pass --------------------------------------------------------


def prefilled_tree(tiny_pair: tuple[str, str], dtype: torch.dtype):
    """The tiny target with a 17-row runner after a 37-token prompt, and the test tree:
    (model, runner, tree, base = the prompt length, the tree's slot offsets)."""
    target, _ = tiny_pair
    model = Engine.from_pretrained(target=target, method="none", dtype=dtype).target.model
    runner = Runner(model, 256, rows=17)
    tree = TokenTree(torch.tensor(TOKENS), torch.tensor(PARENTS))
    runner.prefill(torch.arange(3, 40), span=100)
    return model, runner, tree, runner.length, tree.slot_offsets()


@needs_rowgemm
def test_tree_node_logits_vs_chain_row_invariant(tiny_pair):
    """Row-invariant kernels (float32 CPU default): EVERY node of an unpadded tree pass is
    bitwise its path scored by plain decoding, one token per pass."""
    model, _, tree, base, offsets = prefilled_tree(tiny_pair, torch.float32)
    runner = Runner(model, 256, rows=17, pad=False)
    runner.prefill(torch.arange(3, 40), span=100)
    in_tree = runner.tree_pass(tree.tokens, tree.depths, offsets, tree.region_mask(offsets))
    for i in range(tree.size):
        runner.truncate(base)
        for token in tree.tokens[tree.path(i)]:
            one_by_one = runner.extend(token[None])[0]
        assert torch.equal(in_tree[i], one_by_one), f"node {i} differs"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_node_logits_vs_chain(tiny_pair, dtype, monkeypatch):
    """Padded passes: EVERY node scored in a 17-row tree pass is bitwise its path scored as
    a (17-row) chain pass, the nodes off the first-child path too (split_attention gathers
    each node's path in chain order)."""
    monkeypatch.setenv("UNDERSTUDY_ROWGEMM", "0")
    model, runner, tree, base, offsets = prefilled_tree(tiny_pair, dtype)
    in_tree = runner.tree_pass(tree.tokens, tree.depths, offsets, tree.region_mask(offsets))
    assert any(tree.path(i) != list(range(len(tree.path(i)))) for i in range(tree.size))
    for i in range(tree.size):
        path = tree.path(i)
        runner.truncate(base)
        chain = runner.extend(tree.tokens[path])[-1]
        assert torch.equal(in_tree[i], chain), f"node {i} (path {path}) differs"


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


def wrong_sibling_rule(tree, target_probs, generator):
    """The mutation below (not lossless): p is never renormalised over the rest."""
    from understudy.verify.sampling import sample

    children, node, path = tree.children(), 0, []
    while True:
        p = target_probs[node]
        for c in children[node]:
            if float(torch.rand((), generator=generator)) < float(p[tree.tokens[c]]):  # WRONG
                node = c
                path.append(c)
                break
        else:
            residual = p.clone()
            residual[tree.tokens[children[node]]] = 0.0
            if residual.sum() <= 0:
                residual = p
            token = int(sample((residual / residual.sum())[None], generator))
            return TreeVerdict(path, token, not children[node])


def test_wrong_sibling_rule_fails_the_same_test(tree_sampling_engine, monkeypatch):
    """Mutation: accept each sibling with its ORIGINAL p(x), never removing the rejected ones
    from p (so sibling j is taken with prob prod(1 - p(x_l)) * p(x_j) < p(x_j))."""
    import understudy.engine.engine as engine_module

    monkeypatch.setattr(engine_module, "verify_tree_sampling", wrong_sibling_rule)
    params = SamplingParams(ignore_eos=True, **WARPS["top_k"])
    pvalue = goodness_of_fit(tree_sampling_engine, [11, 42, 7], params, samples=1500)
    assert pvalue < P_THRESHOLD, f"the wrong sibling rule was not detected (p = {pvalue:.3f})"


# -- e. KV compaction ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keep_path_compacts_like_a_chain(tiny_pair, dtype):
    """After a tree pass and keep_path(path), slots base..base+m-1 hold bitwise the KV that
    the tree pass wrote for the path's nodes, and that a chain pass of the path writes
    (path 0 -> 3 -> 10 -> 11: not contiguous, so the copy really moves slots)."""
    model, runner, tree, base, offsets = prefilled_tree(tiny_pair, dtype)
    runner.tree_pass(tree.tokens, tree.depths, offsets, tree.region_mask(offsets))
    path = tree.path(11)
    assert path == [0, 3, 10, 11]
    slots = base + torch.tensor(path)
    from_tree = [
        (k[:, slots].clone(), v[:, slots].clone())
        for k, v in zip(model.k_cache, model.v_cache, strict=True)
    ]
    prefix = [
        (k[:, :base].clone(), v[:, :base].clone())
        for k, v in zip(model.k_cache, model.v_cache, strict=True)
    ]
    runner.keep_path(offsets[path])
    assert runner.length == base + 4
    kept = [
        (k[:, base : base + 4].clone(), v[:, base : base + 4].clone())
        for k, v in zip(model.k_cache, model.v_cache, strict=True)
    ]
    for (kt, vt), (kk, vk), (kp, vp), k, v in zip(
        from_tree, kept, prefix, model.k_cache, model.v_cache, strict=True
    ):
        assert torch.equal(kt, kk) and torch.equal(vt, vk)  # an exact copy
        assert torch.equal(k[:, :base], kp) and torch.equal(v[:, :base], vp)  # prefix untouched
    runner.truncate(base)
    runner.extend(tree.tokens[path])  # the chain writes slots base..base+3
    for (kk, vk), k, v in zip(kept, model.k_cache, model.v_cache, strict=True):
        assert torch.equal(kk, k[:, base : base + 4]), "keys differ from the chain's"
        assert torch.equal(vk, v[:, base : base + 4]), "values differ from the chain's"


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
