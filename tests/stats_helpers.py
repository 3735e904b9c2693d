"""Shared helpers for the statistical tests: one goodness-of-fit test, used the same way everywhere.

The threshold is ALPHA = 0.001: a correct sampler must give p-value > ALPHA, and every
deliberately wrong sampler in the suite must give p-value < ALPHA at the same sample size.
All tests seed their generators, so a given run is deterministic (never flaky); ALPHA only
says how unlucky a seed would have to be for a correct sampler to fail.
"""

from __future__ import annotations

import numpy as np
from scipy.stats import chisquare

ALPHA = 1e-3
MIN_EXPECTED = 5.0  # the usual validity rule for Pearson's chi-squared test


def chisquare_pvalue(observed, probs, min_expected: float = MIN_EXPECTED) -> float:
    """Pearson chi-squared goodness of fit of `observed` counts to the exact `probs`.

    Both are array-likes of the same shape (flattened here). Cells with probability 0 must
    be empty: a single observation there is impossible under `probs`, so the p-value is 0.
    Cells whose expected count is below `min_expected` are pooled into one cell; if the pool
    is still too small it is merged into the smallest remaining cell.
    """
    observed = np.asarray(observed, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    assert observed.shape == probs.shape, (observed.shape, probs.shape)
    assert (probs >= 0).all() and probs.sum() > 0
    impossible = probs == 0
    if observed[impossible].any():
        return 0.0
    n = observed.sum()
    expected = probs / probs.sum() * n
    small = (expected < min_expected) & ~impossible
    keep = ~small & ~impossible
    obs_cells = list(observed[keep])
    exp_cells = list(expected[keep])
    if small.any():
        pooled_obs, pooled_exp = observed[small].sum(), expected[small].sum()
        if pooled_exp >= min_expected or not exp_cells:
            obs_cells.append(pooled_obs)
            exp_cells.append(pooled_exp)
        else:
            i = int(np.argmin(exp_cells))
            obs_cells[i] += pooled_obs
            exp_cells[i] += pooled_exp
    if len(obs_cells) < 2:  # one cell holds all the mass: nothing to test beyond support
        return 1.0
    return float(chisquare(obs_cells, exp_cells).pvalue)


def resample_from_p_verify(draft_ids, draft_probs, target_probs, generator):
    """A subtly WRONG `verify_sampling` for mutation checks: after rejecting a guess it
    resamples from the target's p instead of the residual max(0, p - q). Same signature and
    return type as understudy.verify.verify_sampling."""
    import torch

    from understudy.verify.chain import Verdict
    from understudy.verify.sampling import sample

    k = draft_ids.shape[0]
    for i in range(k):
        p, q = target_probs[i, draft_ids[i]], draft_probs[i, draft_ids[i]]
        if float(torch.rand(1, generator=generator)) * float(q) >= float(p):
            return Verdict(i, int(sample(target_probs[i : i + 1], generator)))  # WRONG
    return Verdict(k, int(sample(target_probs[k : k + 1], generator)))


def wrong_sibling_rule(tree, target_probs, generator):
    """A WRONG `verify_tree_sampling` for mutation checks (not lossless): each sibling is
    accepted with its ORIGINAL p(x), and p is never renormalised over the siblings left, so
    sibling j is taken with probability prod(1 - p(x_l)) * p(x_j) < p(x_j). Same signature
    and return type as understudy.verify.tree.verify_tree_sampling."""
    import torch

    from understudy.verify.sampling import sample
    from understudy.verify.tree import TreeVerdict

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
