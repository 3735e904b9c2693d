"""The sampling law on a mixture-of-experts model (Mixtral) and a sliding-window model (Gemma 3
text), with a wrong verifier that the same test must catch at the same sample size.

Speculative sampling (method="draft", K = 2, temperature 1, top-k 3) must emit tokens
distributed as the target's own (Leviathan et al. 2023, Alg. 1). The test: N = 400 seeded
generations after a 12-token prompt (longer than Gemma 3's 8-position window, so every token
is scored past it); Pearson chi-squared of the 27 outcomes (x1, x2, x3) against the target's
exact joint law p(x1) p(x2 | x1) p(x3 | x1, x2), enumerated from its logits; pass iff
p-value > ALPHA = 0.001 (stats_helpers.py).

Why a wrong verifier cannot look right here. Tiny random models have nearly uniform next-token
laws; then p and q nearly agree, and every verifier emits nearly p. So the pair is built to
disagree: top-k 3 leaves the target three tokens at each step (its top token ~0.4-0.5), and
the draft is the same network with its LM head multiplied by SHARPEN = 10: the same ranking,
so the same three tokens, but confident guesses (its top token ~0.8). The mutation
(stats_helpers.resample_from_p_verify) resamples a rejected guess from p instead of
norm(max(0, p - q)), so a drafted position emits m = min(p, q) + (1 - sum min(p, q)) p.
Four tokens are generated and x2 and x3 are both drafted positions: after x1 (the prefill
pass's) a round drafts min(K, remaining - 1) = 2 guesses, and after a rejection at x2 the
next round drafts one. So the mutant's law of (x1, x2, x3) is p(x1) m(x2 | x1) m(x3 | x1, x2),
enumerated beside the target's, and the design is checked before any sampling: a total
variation distance from the target's law >= MIN_TV = 0.2 (0.24 Mixtral, 0.27 Gemma 3) and a
chi-squared noncentrality N * sum (m - p)^2 / p >= 100 (134 and 138), where the 0.001
critical value at 26 degrees of freedom is 54. The mutant's samples are then checked against
its own enumerated law too, so the distance stated is the one the test faced.
"""

from __future__ import annotations

import pytest
import torch

from stats_helpers import ALPHA, chisquare_pvalue, resample_from_p_verify
from test_architectures import make_hf
from understudy import Engine, SamplingParams
from understudy.models.runner import Runner
from understudy.verify.sampling import warp_probs

PROMPT = [5, 17, 33, 8, 61, 42, 9, 77, 12, 50, 3, 88]  # 12 tokens: past the 8-slot window
SHARPEN = 10.0
K = 2
N = 400
DEPTH = 3  # tokens counted per sample; a fourth is generated so both x2 and x3 are drafted
PARAMS = SamplingParams(temperature=1.0, top_k=3, ignore_eos=True, max_tokens=DEPTH + 1)
MIN_TV = 0.2
MIN_NONCENTRALITY = 100.0

Law = dict[tuple[int, ...], float]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["mixtral", "gemma3"])
def pair(request, tmp_path_factory) -> tuple[str, Engine, Law, Law]:
    """(name, the speculative engine, the target's exact joint law, the mutant's)."""
    name = request.param
    root = tmp_path_factory.mktemp(f"law-{name}")
    hf = make_hf(name, tie_word_embeddings=False)  # untied: the head changes alone
    hf.save_pretrained(root / "target")
    with torch.no_grad():
        hf.lm_head.weight.mul_(SHARPEN)
    hf.save_pretrained(root / "draft")
    engine = Engine.from_pretrained(
        target=str(root / "target"), draft=str(root / "draft"), method="draft",
        num_speculative_tokens=K, dtype="float32", draft_quantization=None, max_context=64,
    )  # fmt: skip
    target, mutant = joint_laws(engine)
    return name, engine, target, mutant


def joint_laws(engine: Engine) -> tuple[Law, Law]:
    """The target's law of (x1..x_DEPTH) after PROMPT, and the mutant's, by enumeration over
    the top-3 supports: p from the target's logits, q from the draft's (the same warping)."""
    target = Runner(engine.target.model, 64)
    draft = Runner(engine.drafter.draft_runner().model, 64)
    law: Law = {}
    mutant: Law = {}

    def next_law(runner: Runner, prefix: tuple[int, ...]) -> torch.Tensor:
        logits = runner.prefill(torch.tensor(PROMPT + list(prefix)))
        return warp_probs(logits[None], PARAMS)[0].double()  # [V]

    def expand(prefix: tuple[int, ...], mass: float, mutant_mass: float) -> None:
        if len(prefix) == DEPTH:
            law[prefix], mutant[prefix] = mass, mutant_mass
            return
        p = next_law(target, prefix)
        m = p  # x1 comes from the prefill pass: no guess to judge
        if prefix:  # a drafted position: accepted with min(p, q), else resampled from p
            overlap = torch.minimum(p, next_law(draft, prefix))
            m = overlap + (1 - overlap.sum()) * p
        for token in p.nonzero().flatten().tolist():
            expand((*prefix, token), mass * float(p[token]), mutant_mass * float(m[token]))

    expand((), 1.0, 1.0)
    return law, mutant


def sampled_counts(engine: Engine) -> dict[tuple[int, ...], int]:
    counts: dict[tuple[int, ...], int] = {}
    for seed in range(N):
        run = SamplingParams(**{**PARAMS.__dict__, "seed": seed})
        key = tuple(engine.generate(PROMPT, run).token_ids[:DEPTH])
        counts[key] = counts.get(key, 0) + 1
    return counts


def pvalue(counts: dict[tuple[int, ...], int], law: Law) -> float:
    if set(counts) - set(law):
        return 0.0  # a sequence the law can never produce
    cells = sorted(law)
    return chisquare_pvalue([counts.get(c, 0) for c in cells], [law[c] for c in cells])


def test_the_pair_separates_the_mutant_from_the_target(pair):
    """The design, before any sampling: the mutant's law is far from the target's."""
    name, _, target, mutant = pair
    tv = 0.5 * sum(abs(target[c] - mutant[c]) for c in target)
    noncentrality = N * sum((mutant[c] - target[c]) ** 2 / target[c] for c in target)
    assert tv >= MIN_TV, f"{name}: TV {tv:.3f}"
    assert noncentrality >= MIN_NONCENTRALITY, f"{name}: noncentrality {noncentrality:.0f}"


def test_speculative_sampling_has_the_target_law(pair):
    name, engine, target, _ = pair
    counts = sampled_counts(engine)
    p = pvalue(counts, target)
    assert p > ALPHA, f"{name}: emitted tokens are not the target's law (p = {p:.2e})"


def test_a_wrong_verifier_fails_the_law_test(pair, monkeypatch):
    """Resampling from p instead of the residual fails at the same N; its samples fit the
    mutant's enumerated law (module docstring)."""
    import understudy.engine.verdict as verdict_module

    name, engine, target, mutant = pair
    monkeypatch.setattr(verdict_module, "verify_sampling", resample_from_p_verify)
    counts = sampled_counts(engine)
    p = pvalue(counts, target)
    assert p < ALPHA, f"{name}: the wrong verifier was not detected (p = {p:.3f})"
    fit = pvalue(counts, mutant)
    assert fit > ALPHA, f"{name}: the mutant's samples do not fit its law (p = {fit:.2e})"
