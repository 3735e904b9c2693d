"""Token trees (understudy.verify.token_tree) and the target's tree pass (Runner.tree_pass /
keep_path), on tiny models:

a. the layout of a small tree, by hand, and the tensors a tree pass hands the model;
b. bitwise: a node scored in a tree pass vs its path scored as a chain (same rows);
e. KV compaction: after keep_path the cache holds the path as a chain would have written it.

Verifying trees and decoding with them (c, d): test_tree_verify.py.
"""

from __future__ import annotations

import pytest
import torch

from test_exactness import needs_rowgemm
from understudy import Engine
from understudy.models.runner import Runner
from understudy.verify.token_tree import TokenTree

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
