"""Identical output by construction (issue: batch-invariant verification).

Two ways, both tested: in float32 on a CPU the target runs row-invariant kernels
(kernels/rowgemm.py; every output one FMA chain, each row its own attention call), so passes
are not padded at all; elsewhere (bfloat16, or UNDERSTUDY_ROWGEMM=0) every decode pass holds
exactly `verify_rows` rows. Either way a row's logits never depend on how many other rows
are real. These tests prove the consequences on tiny models:

1. invariance: a row scored alone equals the same row scored among others, bitwise;
2. identity: greedy speculative output == plain output, for K in 1..16, fp32 and bf16;
3. distribution: with sampling, the joint law of the first 3 generated tokens equals the
   target's exact law (chi-squared goodness of fit, p > 0.001), with temperature, top-k,
   top-p and min-p; and a subtly wrong verifier fails the same test (p < 0.001).
"""

from __future__ import annotations

import itertools
import warnings
from dataclasses import replace

import pytest
import torch
from scipy.stats import chisquare

from understudy import Engine, SamplingParams
from understudy.kernels import rowgemm
from understudy.kernels.rowgemm import RowInvariantLinear
from understudy.models.packed import PackedLinear, can_pack
from understudy.models.runner import Runner
from understudy.verify.sampling import warp_probs

P_THRESHOLD = 1e-3
needs_rowgemm = pytest.mark.skipif(not rowgemm.available(), reason="no C compiler here")


def random_prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 60, (n,), generator=g).tolist()
    return [torch.randint(1, 300, (m,), generator=g).tolist() for m in lengths]


@pytest.fixture
def padded_kernels(monkeypatch):
    """Engines built inside use padded passes with torch's kernels, not rowgemm."""
    monkeypatch.setenv("UNDERSTUDY_ROWGEMM", "0")


@needs_rowgemm
def test_row_invariant_kernels_are_the_float32_cpu_default(tiny_pair):
    """Unpadded passes: row j scored among 16 rows == scored alone == scored among j+1,
    bitwise, with no padding anywhere (kernels/rowgemm.py, per-row attention)."""
    target, _ = tiny_pair
    engine = Engine.from_pretrained(target=target, method="none", dtype=torch.float32)
    model = engine.target.model
    kinds = {type(m) for m in model.modules()}
    assert RowInvariantLinear in kinds and torch.nn.Linear not in kinds
    assert engine.pad is False and engine.exact
    runner = Runner(model, 256, rows=16, pad=False)
    prompt = torch.arange(3, 40)
    batch = torch.tensor([7, 99, 12, 5, 250, 31, 8, 64, 1, 2, 3, 4, 200, 150, 100, 50])
    runner.prefill(prompt)
    together = runner.extend(batch)  # [16, V], a 16-row pass
    for j in range(batch.shape[0]):
        runner.truncate(prompt.shape[0] + j)  # keep batch[:j], score batch[j] alone: 1 row
        alone = runner.extend(batch[j : j + 1])
        assert alone.shape[0] == 1 and torch.equal(alone[0], together[j]), f"row {j} differs"
        runner.truncate(prompt.shape[0])  # batch[: j + 1] in one pass of j + 1 rows
        assert torch.equal(runner.extend(batch[: j + 1])[j], together[j]), f"row {j} differs"


@pytest.mark.parametrize("packed", [False, True], ids=["torch-linear", "onednn-packed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_invariance(tiny_pair, dtype, packed, padded_kernels):
    """Padded passes: row j of a padded 17-row pass == the same token scored alone in a
    padded pass, with torch's linear (a 3-row budget keeps it) and with the prepacked oneDNN
    linears that a budget >= 4 gets on a CPU (models/packed.py)."""
    target, _ = tiny_pair
    if packed and not can_pack(torch.device("cpu"), dtype):
        pytest.skip(f"oneDNN cannot prepack {dtype} weights on this CPU (models/packed.py)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a 3-row budget is not the default here
        engine = Engine.from_pretrained(
            target=target, method="none", dtype=dtype, verify_rows=None if packed else 3
        )
    model = engine.target.model
    kinds = {type(m) for m in model.modules()}
    assert (PackedLinear in kinds) is packed and (torch.nn.Linear in kinds) is not packed
    runner = Runner(model, 256, rows=17)
    prompt = torch.arange(3, 40)
    batch = torch.tensor([7, 99, 12, 5, 250, 31, 8, 64, 1, 2, 3, 4, 200, 150, 100, 50])
    runner.prefill(prompt)
    together = runner.extend(batch)  # [16, V]
    for j in range(batch.shape[0]):
        runner.truncate(prompt.shape[0] + j)  # keep batch[:j], score batch[j] alone
        alone = runner.extend(batch[j : j + 1])[0]
        assert torch.equal(alone, together[j]), f"row {j} differs"


def test_unpadded_passes_are_not_invariant_in_general(tiny_pair, padded_kernels):
    """Why padding (or rowgemm) exists: with torch's kernels, shapes that vary with the number
    of real rows may change bits. (Recorded, not required.)"""
    target, _ = tiny_pair
    model = Engine.from_pretrained(target=target, method="none", dtype=torch.float32).target.model
    runner = Runner(model, 256, rows=None)
    runner.prefill(torch.arange(3, 40))
    together = runner.extend(torch.arange(100, 116))
    runner.truncate(37)
    alone = runner.extend(torch.tensor([100]))
    assert alone.shape == together[:1].shape  # compared for the record in the README


@pytest.mark.parametrize(
    "dtype, rowgemm",
    [
        pytest.param("float32", True, marks=needs_rowgemm),
        ("float32", False),
        ("bfloat16", False),
    ],
    ids=["float32-rowgemm", "float32-padded", "bfloat16-padded"],
)
def test_greedy_identity_k_1_to_16(tiny_pair, dtype, rowgemm, monkeypatch):
    target, draft = tiny_pair
    monkeypatch.setenv("UNDERSTUDY_ROWGEMM", "1" if rowgemm else "0")
    spec = Engine.from_pretrained(
        target=target, draft=draft, num_speculative_tokens=16, dtype=dtype, verify_rows=17
    )
    assert spec.pad is not rowgemm
    plain = spec.with_method("none")
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(12, seed=7)
    expected = [plain.generate(p, params).token_ids for p in prompts]
    for k in range(1, 17):
        spec.k = k
        for prompt, want in zip(prompts[k % 4 :: 4], expected[k % 4 :: 4], strict=True):
            out = spec.generate(prompt, params)
            assert out.token_ids == want, f"K={k} differs from plain decoding"


def test_greedy_identity_default_configuration(tiny_pair):
    """The hardware's default row budget and automatic K, against default method='none'."""
    target, draft = tiny_pair
    spec = Engine.from_pretrained(target=target, draft=draft, dtype="float32")
    plain = Engine.from_pretrained(target=target, method="none", dtype="float32")
    assert spec.exact and plain.exact and spec.runner.rows == plain.runner.rows
    spec.costs = replace(
        spec.costs, draft_step=0.05
    )  # as for a cheap draft: auto K then drafts up to rows - 1 tokens
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    drafted = 0
    for prompt in random_prompts(10, seed=3):
        out = spec.generate(prompt, params)
        assert out.token_ids == plain.generate(prompt, params).token_ids
        drafted += out.stats.drafted
    assert drafted > 0


def test_non_default_row_budget_is_flagged(tiny_pair, padded_kernels):
    target, draft = tiny_pair
    with pytest.warns(UserWarning, match="exact"):
        engine = Engine.from_pretrained(
            target=target, draft=draft, dtype="float32", num_speculative_tokens=12
        )
    out = engine.generate([1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0))
    assert out.stats.exact is False


@needs_rowgemm
def test_any_k_is_exact_with_row_invariant_kernels(tiny_pair):
    """No row budget to respect: K = 40 (41-row passes) is exact, and identical to plain."""
    target, draft = tiny_pair
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "not exact" warning
        spec = Engine.from_pretrained(
            target=target, draft=draft, dtype="float32", num_speculative_tokens=40
        )
    plain = Engine.from_pretrained(target=target, method="none", dtype="float32")
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    for prompt in random_prompts(4, seed=11):
        out = spec.generate(prompt, params)
        assert out.stats.exact and out.token_ids == plain.generate(prompt, params).token_ids


# -- sampling: the joint law of the first three tokens ----------------------------------------


def exact_joint(engine: Engine, prompt: list[int], params: SamplingParams, depth: int = 3) -> dict:
    """P(x1..x_depth) under the target's warped distribution, by enumeration."""
    runner = Runner(engine.target.model, 64)
    law: dict[tuple[int, ...], float] = {}

    def expand(prefix: tuple[int, ...], mass: float) -> None:
        if len(prefix) == depth:
            law[prefix] = mass
            return
        logits = runner.prefill(torch.tensor(prompt + list(prefix)))
        probs = warp_probs(logits[None], params)[0]
        for token in probs.nonzero().flatten().tolist():
            expand((*prefix, token), mass * float(probs[token]))

    expand((), 1.0)
    return law


def goodness_of_fit(
    engine: Engine, prompt: list[int], params: SamplingParams, samples: int
) -> float:
    law = exact_joint(engine, prompt, params)
    counts = dict.fromkeys(law, 0)
    for seed in range(samples):
        run = SamplingParams(**{**params.__dict__, "seed": seed, "max_tokens": 3})
        key = tuple(engine.generate(prompt, run).token_ids)
        if key not in counts:
            return 0.0  # a sequence the target can never produce
        counts[key] += 1
    cells = sorted(law, key=law.get, reverse=True)
    observed, expected, tail_o, tail_e = [], [], 0, 0.0
    for cell in cells:  # pool cells with expected count < 5 into one
        e = law[cell] * samples
        if e >= 5:
            observed.append(counts[cell])
            expected.append(e)
        else:
            tail_o += counts[cell]
            tail_e += e
    if tail_e > 0:
        observed.append(tail_o)
        expected.append(tail_e)
    scale = sum(observed) / sum(expected)
    return float(chisquare(observed, [e * scale for e in expected]).pvalue)


@pytest.fixture(scope="module")
def sampling_engine(tmp_path_factory):
    """A draft that disagrees often (noise 0.5), so rejections and residuals matter."""
    from conftest import make_tiny_pair

    target, draft = make_tiny_pair(
        tmp_path_factory.mktemp("sampling"), seed=5, noise=0.5, tokenizer=False
    )
    return Engine.from_pretrained(
        target=target, draft=draft, dtype="float32", num_speculative_tokens=2
    )


WARPS = {
    "top_k": dict(temperature=1.0, top_k=3),
    "top_p": dict(temperature=0.9, top_k=5, top_p=0.8),
    "min_p": dict(temperature=1.3, top_k=4, min_p=0.2),
}


@pytest.mark.parametrize("warp", list(WARPS))
def test_speculative_sampling_matches_target_law(sampling_engine, warp):
    """N = 1500 samples of (x1, x2, x3); chi-squared goodness of fit, p > 0.001."""
    params = SamplingParams(ignore_eos=True, **WARPS[warp])
    pvalue = goodness_of_fit(sampling_engine, [11, 42, 7], params, samples=1500)
    assert pvalue > P_THRESHOLD, f"{warp}: p = {pvalue:.2e}"


def test_wrong_verifier_fails_the_same_test(sampling_engine, monkeypatch):
    """Mutation check: resampling from p instead of the residual max(0, p - q) is detected."""
    import understudy.engine.verdict as verdict_module
    from stats_helpers import resample_from_p_verify

    monkeypatch.setattr(verdict_module, "verify_sampling", resample_from_p_verify)
    params = SamplingParams(ignore_eos=True, **WARPS["top_k"])
    pvalue = goodness_of_fit(sampling_engine, [11, 42, 7], params, samples=1500)
    assert pvalue < P_THRESHOLD, f"the wrong verifier was not detected (p = {pvalue:.3f})"


def test_exact_joint_is_a_distribution(sampling_engine):
    law = exact_joint(sampling_engine, [11, 42, 7], SamplingParams(temperature=1.0, top_k=3))
    assert len(law) == 27 and abs(sum(law.values()) - 1.0) < 1e-5
    assert all(len(k) == 3 for k in itertools.islice(law, 5))
