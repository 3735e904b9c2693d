"""Weight-only int8 / int4 draft quantization (models/quant.py).

1. a quantized Linear is close to the fp32 Linear it replaces, and exactly the matmul of its
   own dequantized weight (kernel and layout are right);
2. layers the kernel cannot take stay unquantized; everything else (lm_head too) is swapped;
3. the packed weights round-trip through the on-disk cache;
4. lossless: greedy speculative output with a quantized draft == plain output, and sampled
   output has the target's law (first 3 tokens, chi-squared contingency vs method="none").
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency
from torch import nn

from understudy import Engine, SamplingParams, UnderstudyError
from understudy.models.loader import load_model
from understudy.models.quant import (
    Int4Linear,
    Int8Linear,
    dequantize_int4,
    load_or_quantize,
    parse_scheme,
    quantize_int4,
    quantize_model,
)

P_THRESHOLD = 1e-3


pytestmark = pytest.mark.usefixtures("one_thread")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def random_linear(k: int, n: int, bias: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    linear = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        linear.weight.normal_(0, 0.02)
        if bias:
            linear.bias.normal_(0, 0.02)
    return linear.requires_grad_(False)


@pytest.mark.parametrize("scheme, bound", [("int8", 0.02), ("int4-g32", 0.12), ("int4", 0.15)])
@pytest.mark.parametrize("bias", [False, True])
def test_quantized_linear_close_to_fp32(scheme, bound, bias):
    linear = random_linear(256, 384, bias)
    spec = parse_scheme(scheme)
    quant = (
        Int8Linear.from_linear(linear)
        if spec.bits == 8
        else Int4Linear.from_linear(linear, spec.group_size)
    )
    x = torch.randn(2, 3, 256)  # leading dims are kept
    with torch.inference_mode():
        y, ref = quant(x), linear(x)
    assert y.shape == ref.shape == (2, 3, 384) and y.dtype == torch.float32
    assert rel_err(y, ref) < bound, rel_err(y, ref)
    # ... and it is the matmul of its own dequantized weight (bf16 activations: ~0.5%)
    if spec.bits == 8:
        w = quant.dequantized()
    else:
        w = dequantize_int4(*quantize_int4(linear.weight, spec.group_size))
    exact = x @ w.T + (linear.bias if bias else 0)
    assert rel_err(y, exact) < 1e-2, rel_err(y, exact)


def test_int4_smaller_groups_are_more_accurate():
    w = random_linear(512, 64, False).weight
    errors = [rel_err(dequantize_int4(*quantize_int4(w, g)), w) for g in (32, 64, 128, 256)]
    assert errors == sorted(errors) and errors[0] < 0.1


def test_int8_round_trip_error_is_small():
    w = random_linear(128, 32, False).weight
    q = Int8Linear.from_linear(random_linear(128, 32, False))
    assert q.qweight.dtype == torch.int8 and q.scales.dtype == torch.bfloat16
    assert rel_err(q.dequantized(), w) < 0.01


def test_unknown_scheme_is_refused():
    with pytest.raises(UnderstudyError, match="unknown quantization scheme"):
        parse_scheme("int3")


@pytest.fixture()
def tiny_draft(tiny_pair):
    """A fresh float32 tiny draft model (hidden 64, intermediate 128, vocab 320)."""
    target, draft = tiny_pair
    return Engine.from_pretrained(
        target=target,
        draft=draft,
        dtype="float32",
        num_speculative_tokens=2,
        draft_quantization=None,
    )


def test_everything_fitting_is_swapped_lm_head_included(tiny_draft):
    model = tiny_draft.drafter.runner.model
    quantize_model(model, "int8")
    info = model.quantization
    assert isinstance(model.lm_head, Int8Linear)
    assert not info.skipped and len(info.quantized) == 4 * model.cfg.num_layers + 1
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert info.bytes_after < info.bytes_before / 3


def test_layers_that_do_not_fit_the_group_stay_unquantized(tiny_draft):
    """Group size 128: only w_down (in_features 128) fits; the rest have in_features 64."""
    model = tiny_draft.drafter.runner.model
    quantize_model(model, "int4")
    info = model.quantization
    assert info.quantized == [f"layers.{i}.mlp.w_down" for i in range(model.cfg.num_layers)]
    assert "lm_head" in info.skipped and isinstance(model.lm_head, nn.Linear)
    assert isinstance(model.layers[0].mlp.w_down, Int4Linear)


def draft_logits(engine: Engine, prompt: list[int]) -> torch.Tensor:
    runner = engine.drafter.runner
    return runner.prefill(torch.tensor(prompt))


@pytest.mark.parametrize("scheme", ["int8", "int4-g32"])
def test_cache_round_trip(tiny_pair, tmp_path, scheme):
    target, draft = tiny_pair
    first = Engine.from_pretrained(
        target=target,
        draft=draft,
        dtype="float32",
        num_speculative_tokens=2,
        draft_quantization=None,
    )
    load_or_quantize(first.drafter.runner.model, tmp_path, scheme)
    assert first.drafter.runner.model.quantization.from_cache is False
    assert len(list(tmp_path.glob("quant-*.safetensors"))) == 1
    second = Engine.from_pretrained(
        target=target,
        draft=draft,
        dtype="float32",
        num_speculative_tokens=2,
        draft_quantization=None,
    )
    load_or_quantize(second.drafter.runner.model, tmp_path, scheme)
    info = second.drafter.runner.model.quantization
    assert info.from_cache is True and not info.skipped
    prompt = [5, 17, 99, 3, 250]
    assert torch.equal(draft_logits(first, prompt), draft_logits(second, prompt))


def test_stale_cache_is_replaced(tiny_pair, tmp_path):
    target, draft = tiny_pair
    engine = Engine.from_pretrained(
        target=target,
        draft=draft,
        dtype="float32",
        num_speculative_tokens=2,
        draft_quantization=None,
    )
    load_or_quantize(engine.drafter.runner.model, tmp_path, "int8")
    (cached,) = tmp_path.glob("quant-*.safetensors")
    cached.write_bytes(b"not a safetensors file")
    fresh = Engine.from_pretrained(
        target=target,
        draft=draft,
        dtype="float32",
        num_speculative_tokens=2,
        draft_quantization=None,
    )
    load_or_quantize(fresh.drafter.runner.model, tmp_path, "int8")
    assert fresh.drafter.runner.model.quantization.from_cache is False
    assert isinstance(fresh.drafter.runner.model.lm_head, Int8Linear)
    again = Engine.from_pretrained(
        target=target,
        draft=draft,
        dtype="float32",
        num_speculative_tokens=2,
        draft_quantization=None,
    ).drafter.runner.model
    load_or_quantize(again, tmp_path, "int8")  # the rewritten file is good again
    assert again.quantization.from_cache is True


def test_default_cache_dir_is_keyed_by_the_weights(tiny_pair, tmp_path, monkeypatch):
    monkeypatch.setenv("UNDERSTUDY_CACHE", str(tmp_path))
    target, draft = tiny_pair
    for spec, expect_cached in ((draft, False), (draft, True), (target, False)):
        model = load_model(spec, dtype="float32").model  # a draft is loaded this way
        load_or_quantize(model, None, "int8")
        assert model.quantization.from_cache is expect_cached
    assert len(list((tmp_path / "quantized").iterdir())) == 2  # one per distinct model


def test_quantizing_twice(tiny_draft, tmp_path):
    """A second quantization is refused (error compounds); load_or_quantize with the scheme the
    model already has is a no-op and writes no file of its own."""
    model = tiny_draft.drafter.runner.model
    quantize_model(model, "int8")
    with pytest.raises(UnderstudyError, match="already quantized"):
        quantize_model(model, "int4-g32")
    assert load_or_quantize(model, tmp_path, "int8") is model
    assert not list(tmp_path.iterdir())
    with pytest.raises(UnderstudyError, match="already quantized"):
        load_or_quantize(model, tmp_path, "int4-g32")


def test_from_pretrained_quantizes_the_draft(tiny_pair, tmp_path, monkeypatch):
    """The factory's path: draft_quantization="auto" quantizes the draft on a CPU (the target
    never), caching the packing; None keeps it dense."""
    from understudy.engine.draft_setup import DEFAULT_CPU_DRAFT_QUANTIZATION

    monkeypatch.setenv("UNDERSTUDY_CACHE", str(tmp_path))
    target, draft = tiny_pair
    engine = Engine.from_pretrained(target=target, draft=draft, dtype="float32")
    model = engine.drafter.runner.model
    assert model.quantization.scheme == parse_scheme(DEFAULT_CPU_DRAFT_QUANTIZATION).name
    assert not any(isinstance(m, (Int8Linear, Int4Linear)) for m in engine.target.model.modules())
    again = Engine.from_pretrained(target=target, draft=draft, dtype="float32")
    assert again.drafter.runner.model.quantization.from_cache is True
    dense = Engine.from_pretrained(
        target=target, draft=draft, dtype="float32", draft_quantization=None
    )
    assert not hasattr(dense.drafter.runner.model, "quantization")


def test_int8_needs_in_features_multiple_of_32():
    """The bf16 int8 kernel returns garbage for in_features % 16 != 0: such layers stay."""
    model = nn.Sequential(random_linear(72, 64, False), random_linear(64, 64, True))
    quantize_model(model, "int8")
    assert model.quantization.skipped == ["0"] and model.quantization.quantized == ["1"]
    assert isinstance(model[0], nn.Linear) and isinstance(model[1], Int8Linear)


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 40, (n,), generator=g).tolist()
    return [torch.randint(1, 300, (m,), generator=g).tolist() for m in lengths]


@pytest.fixture(scope="module")
def plain(tiny_pair):
    return Engine.from_pretrained(target=tiny_pair[0], method="none", dtype="float32")


@pytest.mark.parametrize("scheme", ["int8", "int4-g32", "int4"])
@pytest.mark.parametrize("k", [1, 2])
def test_greedy_with_quantized_draft_equals_plain(tiny_pair, plain, scheme, k):
    target, draft = tiny_pair
    engine = Engine.from_pretrained(
        target=target,
        draft=draft,
        dtype="float32",
        num_speculative_tokens=k,
        draft_quantization=None,
    )
    quantize_model(engine.drafter.runner.model, scheme)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    drafted = accepted = 0
    for prompt in prompts(6, seed=k):
        a = engine.generate(prompt, params)
        assert a.token_ids == plain.generate(prompt, params).token_ids
        drafted += a.stats.drafted
        accepted += a.stats.accepted
    assert 0 < accepted < drafted, "both the accept and the reject paths should run"


SAMPLING = SamplingParams(temperature=1.0, top_k=3, ignore_eos=True)
PROMPT = [11, 42, 7]


def first_tokens(engine: Engine, n: int, seed0: int) -> list[tuple[int, ...]]:
    out = []
    for seed in range(seed0, seed0 + n):
        run = SamplingParams(**{**SAMPLING.__dict__, "seed": seed, "max_tokens": 3})
        out.append(tuple(engine.generate(PROMPT, run).token_ids))
    return out


def homogeneity_pvalue(a: list[tuple[int, ...]], b: list[tuple[int, ...]]) -> float:
    """Chi-squared test that two samples of sequences come from one law (contingency table;
    sequences seen fewer than 10 times in all are pooled so expected counts stay >= 5)."""
    cells = sorted(set(a) | set(b))
    table = np.array([[s.count(c) for c in cells] for s in (a, b)], dtype=np.float64)
    small = table.sum(0) < 10
    if small.any():
        table = np.concatenate([table[:, ~small], table[:, small].sum(1, keepdims=True)], axis=1)
    assert table.shape[1] >= 5, "the test needs several outcomes to have power"
    return float(chi2_contingency(table).pvalue)


@pytest.fixture(scope="module")
def plain_samples(plain):
    return first_tokens(plain, 1200, seed0=10_000)  # independent of the engines' seeds


@pytest.fixture(scope="module")
def int4_engine(tiny_pair):
    target, draft = tiny_pair
    engine = Engine.from_pretrained(
        target=target,
        draft=draft,
        dtype="float32",
        num_speculative_tokens=2,
        draft_quantization=None,
    )
    quantize_model(engine.drafter.runner.model, "int4-g32")
    return engine


def test_sampling_with_quantized_draft_has_target_law(int4_engine, plain_samples):
    """Joint law of the first 3 tokens (K = 2, top-k 3): quantized-draft engine vs plain
    decoding, 1200 samples each, chi-squared test of homogeneity, p > 0.001."""
    pvalue = homogeneity_pvalue(first_tokens(int4_engine, 1200, seed0=0), plain_samples)
    assert pvalue > P_THRESHOLD, f"p = {pvalue:.2e}"
    assert int4_engine.generate(PROMPT, SamplingParams(max_tokens=20, seed=1)).stats.drafted > 0


def test_wrong_verifier_fails_the_same_test(int4_engine, plain_samples, monkeypatch):
    """Mutation check (the test has power): resampling from p instead of the residual."""
    import understudy.engine.verdict as verdict_module
    from stats_helpers import resample_from_p_verify

    monkeypatch.setattr(verdict_module, "verify_sampling", resample_from_p_verify)
    pvalue = homogeneity_pvalue(first_tokens(int4_engine, 1200, seed0=0), plain_samples)
    assert pvalue < P_THRESHOLD, f"the wrong verifier was not detected (p = {pvalue:.3f})"
