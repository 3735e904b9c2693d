"""Bring your own model: every architecture of the fast path against transformers itself.

Per architecture, a tiny random model made here with transformers' own config class (2
layers, hidden 64, float32; sliding windows of 8 positions, so 40 generated tokens run far
past them):

1. logits: our Transformer's logits for a 48-token sequence == transformers' forward
   (relative tolerance 1e-4);
2. greedy: our plain decoding == transformers' greedy generate(), token for token; a
   difference is allowed only where transformers' own top two logits are a near-tie;
3. speculative: greedy method="draft" (a noisy copy as draft), "ngram", "suffix" and
   "hybrid" == plain, bit for bit, with row-invariant kernels and with padded passes
   (split attention);
4. refusals: recurrent and unknown architectures are refused with a one-line reason;
5. context: "dynamic" and "longrope" ropes end the engine's context where transformers
   switches their frequencies (models/rope.py), exact up to there.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import transformers

from understudy import Engine, SamplingParams
from understudy.config import UnderstudyError
from understudy.models.convert import UnsupportedArchitecture, config_from_hf, convert_state_dict
from understudy.models.loaded import build_model
from understudy.models.rope import RopeScaling, rope_frequencies
from understudy.models.runner import Runner

VOCAB = 96
WINDOW = 8
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
ARCHITECTURES: dict[str, tuple[str, dict]] = {
    "llama3": (
        "LlamaConfig",
        dict(
            tie_word_embeddings=True,
            rope_parameters=dict(
                rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                high_freq_factor=4.0, original_max_position_embeddings=16,
            ),
        ),
    ),
    "llama-yarn": (
        "LlamaConfig",
        dict(rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                  original_max_position_embeddings=64)),
    ),
    "llama-linear": (
        "LlamaConfig", dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0))
    ),
    "llama-dynamic": (
        "LlamaConfig",
        dict(rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0)),
    ),
    "mistral-window": ("MistralConfig", dict(sliding_window=WINDOW)),
    "qwen3": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=True)),
    "gemma2": (
        "Gemma2Config",
        dict(head_dim=24, sliding_window=WINDOW, query_pre_attn_scalar=20,
             attn_logit_softcapping=2.0, final_logit_softcapping=8.0),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=12,
             layer_types=["sliding_attention", "full_attention"],
             rope_parameters={
                 "sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                 "full_attention": dict(rope_type="linear", rope_theta=1000000.0, factor=8.0),
             }),
    ),
    "phi3-longrope": (
        "Phi3Config",
        dict(
            max_position_embeddings=1024, original_max_position_embeddings=256,
            sliding_window=WINDOW,
            rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                                 short_factor=[1.0 + i / 16 for i in range(8)],
                                 long_factor=[4.0] * 8, partial_rotary_factor=1.0),
        ),
    ),
    "phi4-mini-partial": (
        "Phi3Config",
        dict(tie_word_embeddings=True,
             rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                  partial_rotary_factor=0.75)),
    ),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen3-moe": (
        "Qwen3MoeConfig",
        dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
             norm_topk_prob=True, head_dim=16, mlp_only_layers=[1]),
    ),
}  # fmt: skip
SLIDING = ("mistral-window", "gemma2", "gemma3", "phi3-longrope")
MIXTURES = ("mixtral", "qwen3-moe")
ROPE_ONLY = ("llama-yarn", "llama-linear", "llama-dynamic")


pytestmark = pytest.mark.usefixtures("one_thread")


def make_hf(name: str, seed: int = 0, **overrides: object) -> transformers.PreTrainedModel:
    """A tiny random model of `name` (`overrides`: config fields set apart from its entry),
    with weights spread enough that the next-token distribution is peaked and varies with
    the input (random init alone is near uniform)."""
    cls, extra = ARCHITECTURES[name]
    config = getattr(transformers, cls)(**{**BASE, **extra, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for key, p in model.named_parameters():
            if p.ndim == 1:  # norms: away from their neutral value, so each one matters
                p.add_(0.2 * torch.randn_like(p))
            elif "embed_tokens" in key or "lm_head" in key:
                p.mul_(8.0)
            elif "gate.weight" in key:  # routers: decisive, so no expert choice is a near-tie
                p.mul_(10.0)
            elif "q_proj" in key or "k_proj" in key or "qkv_proj" in key:
                p.mul_(3.0)  # sharper attention: the scale and the soft cap matter
    model.generation_config.eos_token_id = None
    return model


def noisy_copy(model: transformers.PreTrainedModel, noise: float, seed: int):
    copy = transformers.AutoModelForCausalLM.from_config(model.config).float().eval()
    copy.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in copy.parameters():
            p.add_(noise * p.std() * torch.randn(p.shape, generator=gen))
    return copy


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def arch(request, tmp_path_factory) -> tuple[str, transformers.PreTrainedModel, Path, Path]:
    """(name, the transformers model, its directory, a noisy copy's directory)."""
    name = request.param
    hf = make_hf(name)
    root = tmp_path_factory.mktemp(name)
    hf.save_pretrained(root / "target")
    noisy_copy(hf, 0.05, seed=1).save_pretrained(root / "draft")
    return name, hf, root / "target", root / "draft"


def ours(hf: transformers.PreTrainedModel):
    sd = hf.state_dict()
    cfg = config_from_hf(hf.config, sd)
    return build_model(cfg, convert_state_dict(sd, cfg), torch.device("cpu"))


PROMPT = [5, 17, 33, 8, 61, 42, 9, 77, 12, 50, 3, 88]  # longer than the window


def test_logits_match_transformers(arch):
    name, hf, _, _ = arch
    tokens = torch.randint(3, VOCAB, (48,), generator=torch.Generator().manual_seed(3))
    runner = Runner(ours(hf), 128)
    got = runner.extend(tokens)  # [48, V]
    with torch.no_grad():
        want = hf(tokens[None]).logits[0].float()  # [48, V]
    scale = float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * scale)


GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def test_greedy_matches_transformers_generate(arch):
    """Plain decoding (one row a pass over the static cache) == transformers' greedy
    generate() (its own dynamic cache): 40 tokens past a prompt longer than the window."""
    _, hf, target, _ = arch
    plain = Engine.from_pretrained(target=str(target), method="none", dtype="float32")
    got = plain.generate(PROMPT, GREEDY).token_ids
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([PROMPT]), max_new_tokens=40, do_sample=False, min_new_tokens=40
        )
    want = out[0, len(PROMPT) :].tolist()
    i = first_difference(got, want)
    if i is not None:  # allowed only where transformers' own top two logits (nearly) tie
        with torch.no_grad():
            logits = hf(torch.tensor([PROMPT + want[:i]])).logits[0, -1]
        top = logits.topk(2).values
        gap, scale = float(top[0] - top[1]), float(logits.abs().max())
        assert gap < 1e-3 * scale, f"token {i}: {got[i]} vs {want[i]}, no tie (gap {gap:.2e})"


@pytest.mark.parametrize("padded", [False, True], ids=["row-invariant", "padded"])
def test_speculative_greedy_equals_plain(arch, padded, monkeypatch):
    """method="draft" (noisy copy, K=4), "ngram", "suffix" and "hybrid" give plain decoding's
    tokens bit for bit; padded: every pass holds a fixed number of rows and attends through
    split_attention (windowed for sliding layers)."""
    name, _, target, draft = arch
    if name in ROPE_ONLY:
        pytest.skip("a rope variant: its frequencies change nothing a pass does (llama3 runs)")
    if padded and name not in (*SLIDING, *MIXTURES):
        pytest.skip("padded passes: the sliding-window and mixture models cover them")
    if padded:
        monkeypatch.setenv("UNDERSTUDY_ROWGEMM", "0")
    spec = Engine.from_pretrained(
        target=str(target), draft=str(draft), method="draft", dtype="float32",
        num_speculative_tokens=4,
    )  # fmt: skip
    others = [
        Engine.from_pretrained(
            target=str(target), draft=str(draft) if method == "hybrid" else None, method=method,
            dtype="float32", num_speculative_tokens=4,
        )
        for method in ("ngram", "suffix", "hybrid")
    ]  # fmt: skip
    plain = spec.with_method("none")
    assert all(engine.runner.pad is padded for engine in (spec, *others))
    for prompt in (PROMPT, PROMPT[:5] * 3):  # the second repeats itself: n-grams match
        want = plain.generate(prompt, GREEDY).token_ids
        for engine in (spec, *others):
            out = engine.generate(prompt, GREEDY)
            assert out.token_ids == want, f"{engine.method} differs on {prompt}"
            assert out.stats.exact and out.stats.accepted > 0  # guesses were kept


# -- rope frequencies: transformers' own functions ---------------------------------------------


@pytest.mark.parametrize("name", ["llama3", "llama-yarn", "llama-linear", "phi3-longrope"])
def test_rope_frequencies_are_transformers(name):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cls, extra = ARCHITECTURES[name]
    config = getattr(transformers, cls)(**{**BASE, **extra})
    kind = config.rope_parameters["rope_type"]
    want, want_factor = ROPE_INIT_FUNCTIONS[kind](config, torch.device("cpu"))
    sd = {"lm_head.weight": torch.zeros(1)}
    cfg = config_from_hf(config, sd)
    assert isinstance(cfg.rope_scaling, RopeScaling) and cfg.rope_scaling.kind == kind
    got, factor = rope_frequencies(cfg.rope_theta, cfg.head_dim, cfg.rope_scaling, 1024)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert factor == pytest.approx(want_factor, rel=1e-12)


def test_context_dependent_ropes_record_their_exact_context():
    """dynamic / longrope are transformers' own only below the length where transformers
    switches frequencies; the model says up to where."""
    for name, limit in (("llama-dynamic", 256), ("phi3-longrope", 256), ("llama3", None)):
        assert ours(make_hf(name)).exact_context == limit, name


@pytest.mark.parametrize("name", ["llama-dynamic", "phi3-longrope"])
def test_the_context_ends_where_the_rope_switches(name, tmp_path):
    """The engine's context is lowered to the switch length L = 256 (models/rope.py), with a
    warning naming it. Up to L our logits are transformers' forward over all L tokens; over
    a longer sequence transformers changes the frequencies of every position. Greedy
    speculative decoding equals plain decoding up to the end of that context, and a longer
    prompt is refused naming L."""
    limit = 256
    hf = make_hf(name)
    tokens = torch.randint(3, VOCAB, (2 * limit,), generator=torch.Generator().manual_seed(3))
    got = Runner(ours(hf), 2 * limit).extend(tokens)[:limit]  # [L, V]
    with torch.no_grad():
        within = hf(tokens[None, :limit]).logits[0]  # [L, V]
        past = hf(tokens[None]).logits[0, :limit]  # [L, V]: a pass past the switch
    tolerance = 1e-4 * float(within.abs().max())
    torch.testing.assert_close(got, within, rtol=1e-4, atol=tolerance)
    assert float((got - past).abs().max()) > 10 * tolerance

    hf.save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match=f"max_context lowered from 4096 to {limit} tokens"):
        spec = Engine.from_pretrained(
            target=str(tmp_path), method="ngram", dtype="float32", num_speculative_tokens=4
        )
    plain = spec.with_method("none")
    assert spec.max_context == plain.max_context == limit
    prompt = (PROMPT[:5] * 40)[:200]  # repeats itself: n-grams match
    to_the_end = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
    want = plain.generate(prompt, to_the_end).token_ids
    assert len(want) == limit - len(prompt)
    out = spec.generate(prompt, to_the_end)
    assert out.token_ids == want and out.stats.accepted > 0
    with pytest.raises(UnderstudyError, match=f"the context holds {limit}"):
        spec.generate([5] * limit, GREEDY)


def test_a_context_within_the_switch_is_kept(tmp_path):
    """max_context at or under the switch length, or a rope without one: no change."""
    for name, context in (("llama-dynamic", 200), ("llama3", 4096)):
        make_hf(name).save_pretrained(tmp_path / name)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            engine = Engine.from_pretrained(
                target=str(tmp_path / name), method="none", dtype="float32", max_context=context
            )
        assert engine.max_context == context, name


# -- refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cls", "kwargs", "reason"),
    [
        ("MambaConfig", {}, "recurrent state"),
        ("Qwen3NextConfig", {}, "rolled back"),
        ("GPT2Config", {}, "not supported"),
        ("LlamaConfig", dict(mlp_bias=True), "biases"),
        ("LlamaConfig", dict(hidden_act="relu"), "activation 'relu'"),
        ("Gemma3TextConfig", dict(use_bidirectional_attention=True), "bidirectional"),
    ],
)
def test_what_stays_out_is_refused_with_a_reason(cls, kwargs, reason):
    config = getattr(transformers, cls)(**kwargs)
    with pytest.raises(UnsupportedArchitecture, match=reason) as err:
        config_from_hf(config, {"lm_head.weight": torch.zeros(1)})
    assert "\n" not in str(err.value)


def test_unknown_rope_scaling_is_refused():
    config = transformers.LlamaConfig(
        **{**BASE, "rope_parameters": dict(rope_type="proportional", rope_theta=1e4)}
    )
    with pytest.raises(UnsupportedArchitecture, match="proportional"):
        config_from_hf(config, {})
