"""The transformers fallback (models/hf_fallback.py): architectures the fast path lacks run on
transformers' own modelling code over a static cache, exact where the mechanism proves it.

Per family without a fast path (GPT-2, OLMo 2, and Starcoder2 with a sliding window of 8
positions, so the generated tokens run past it), a tiny random model made here with
transformers' own config class and saved to a temporary directory:

1. greedy: our plain decoding == transformers' greedy generate(), token for token (a
   difference allowed only where transformers' own top two logits nearly tie);
2. speculative: greedy method="draft" (a noisy copy as the draft, itself on the fallback),
   "ngram", "suffix" and "hybrid" == plain, bit for bit, and stats.exact says so; beneath
   it, a verification pass's logits are bitwise those of one-token passes (float32 with
   rowgemm's linears; and padded 16-row bfloat16 passes where the CPU multiplies bfloat16
   natively);
3. honesty: padded float32 passes on a CPU (no rowgemm) and a mixture of experts (OLMoE)
   run but report stats.exact = False with a warning;
4. refusals, one line each: a recurrent model (Mamba), token trees, hidden states (eagle),
   quantizing a fallback draft, batching a fallback draft.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from understudy import Engine, SamplingParams
from understudy.config import UnderstudyError
from understudy.kernels import rowgemm
from understudy.models.convert import UnsupportedArchitecture
from understudy.models.hf_fallback import FallbackLM
from understudy.models.loader import cpu_has_native_bf16
from understudy.models.row_attention import rows_apart_attention
from understudy.models.runner import Runner

VOCAB = 96
SMALL = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)  # fmt: skip
FAMILIES: dict[str, tuple[str, dict]] = {
    "gpt2": (
        "GPT2Config",
        dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256,
             bos_token_id=1, eos_token_id=2),
    ),
    "olmo2": ("Olmo2Config", SMALL),
    "starcoder2-window": ("Starcoder2Config", {**SMALL, "sliding_window": 8}),
}  # fmt: skip
MIXTURE = ("OlmoeConfig", {**SMALL, "num_experts": 4, "num_experts_per_tok": 2})
PROMPT = [5, 17, 33, 8, 61, 42, 9, 77, 12, 50, 3, 88]  # longer than the window
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_thread")


def make_hf(cls: str, kwargs: dict, seed: int = 0) -> transformers.PreTrainedModel:
    """A tiny random model whose next-token distribution is peaked and depends on the whole
    context (random init alone is near uniform and, with GPT-2's layer norms, ignores all but
    the last token): norms and biases moved, embeddings and every other matrix scaled up (a
    different context then changes the next greedy token about 60-95% of the time)."""
    config = getattr(transformers, cls)(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for key, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.2 * torch.randn_like(p))
            elif any(name in key for name in ("wte", "embed_tokens", "lm_head")):
                p.mul_(8.0)
            else:
                p.mul_(5.0)
    model.generation_config.eos_token_id = None
    return model


def noisy_copy(model: transformers.PreTrainedModel, seed: int) -> transformers.PreTrainedModel:
    copy = transformers.AutoModelForCausalLM.from_config(model.config).float().eval()
    copy.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in copy.parameters():
            p.add_(0.05 * p.std() * torch.randn(p.shape, generator=gen))
    return copy


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory) -> tuple[transformers.PreTrainedModel, Path, Path]:
    """(the transformers model, its directory, a noisy copy's directory)."""
    hf = make_hf(*FAMILIES[request.param])
    root = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(root / "target")
    noisy_copy(hf, seed=1).save_pretrained(root / "draft")
    return hf, root / "target", root / "draft"


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def test_greedy_matches_transformers_generate(family):
    hf, target, _ = family
    plain = Engine.from_pretrained(target=str(target), method="none", dtype="float32")
    assert isinstance(plain.target.model, FallbackLM)
    got = plain.generate(PROMPT, GREEDY).token_ids
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([PROMPT]), max_new_tokens=32, do_sample=False, min_new_tokens=32
        )
    want = out[0, len(PROMPT) :].tolist()
    i = first_difference(got, want)
    if i is not None:  # allowed only where transformers' own top two logits (nearly) tie
        with torch.no_grad():
            logits = hf(torch.tensor([PROMPT + want[:i]])).logits[0, -1]
        top = logits.topk(2).values
        gap, scale = float(top[0] - top[1]), float(logits.abs().max())
        assert gap < 1e-3 * scale, f"token {i}: {got[i]} vs {want[i]}, no tie (gap {gap:.2e})"


@pytest.mark.skipif(not rowgemm.available(), reason="needs the rowgemm kernel (a C compiler)")
def test_speculative_greedy_equals_plain(family, recwarn):
    """method="draft", "ngram", "suffix" and "hybrid" (K=4) give plain decoding's tokens bit
    for bit, and the engine claims it (stats.exact) without a warning: float32 on a CPU,
    every linear (GPT-2's Conv1D included) swapped for rowgemm's, unpadded passes."""
    _, target, draft = family
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
    assert isinstance(spec.drafter.draft_runner().model, FallbackLM)  # the draft too
    assert not spec.runner.pad and spec.target.model.outside == []  # every matrix swapped
    for prompt in (PROMPT, PROMPT[:5] * 3):  # the second repeats itself: n-grams match
        want = plain.generate(prompt, GREEDY).token_ids
        for engine in (spec, *others):
            out = engine.generate(prompt, GREEDY)
            assert out.token_ids == want, f"{engine.method} differs on {prompt}"
            assert out.stats.exact and out.stats.accepted > 0  # guesses were kept
    assert not [w for w in recwarn if "stats.exact" in str(w.message)]


@pytest.mark.skipif(not rowgemm.available(), reason="needs the rowgemm kernel (a C compiler)")
def test_a_pass_scores_each_row_as_plain_decoding_does(family):
    """What the token-level test rests on: 6 tokens scored in one verification pass get
    bitwise the logits they get scored one pass each. (Attending in one batched call instead
    of row_attention's row by row differs here by ~1e-6: this test catches it.)"""
    _, target, _ = family
    engine = Engine.from_pretrained(
        target=str(target), method="ngram", dtype="float32", num_speculative_tokens=5
    )
    assert_rows_score_as_alone(engine.runner)


def assert_rows_score_as_alone(runner: Runner) -> None:
    """6 tokens after a 40-token prefix, in one pass and in six: the same logits, bitwise."""
    ids = torch.randint(3, VOCAB, (46,), generator=torch.Generator().manual_seed(1))
    runner.prefill(ids[:40], span=64)
    together = runner.extend(ids[40:])  # [6, V]
    runner.truncate(40)
    alone = torch.cat([runner.extend(ids[i : i + 1]) for i in range(40, 46)])  # [6, V]
    assert torch.equal(together, alone)


@pytest.mark.skipif(not cpu_has_native_bf16(), reason="padded bfloat16 needs native bf16")
def test_padded_bfloat16_passes_are_exact(family, recwarn):
    """Where the CPU multiplies bfloat16 natively, the target's passes are padded to 16 rows
    (the hardware's budget): rows score as alone, and speculative output is plain's."""
    _, target, _ = family
    spec = Engine.from_pretrained(
        target=str(target), method="ngram", dtype="bfloat16", num_speculative_tokens=4
    )
    assert spec.runner.pad and spec.runner.rows == 16
    assert_rows_score_as_alone(spec.runner)
    plain = spec.with_method("none")
    out = spec.generate(PROMPT[:5] * 3, GREEDY)
    assert out.token_ids == plain.generate(PROMPT[:5] * 3, GREEDY).token_ids
    assert out.stats.exact and out.stats.accepted > 0
    assert not [w for w in recwarn if "stats.exact" in str(w.message)]


def test_padded_float32_passes_on_a_cpu_are_not_claimed_exact(family, monkeypatch):
    """Without rowgemm a float32 target's passes are padded, and torch's CPU matmuls can give
    a row other bits at another index of the pass: the engine says so and claims nothing."""
    _, target, _ = family
    monkeypatch.setenv("UNDERSTUDY_ROWGEMM", "0")
    with pytest.warns(UserWarning, match=r"padded float32 passes.*stats\.exact = False"):
        spec = Engine.from_pretrained(
            target=str(target), method="ngram", dtype="float32", num_speculative_tokens=4
        )
    assert spec.runner.pad and not spec.generate(PROMPT, GREEDY).stats.exact


@pytest.fixture(scope="module")
def mixture_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("olmoe") / "target"
    make_hf(*MIXTURE).save_pretrained(folder)
    return folder


def test_a_mixture_of_experts_runs_but_is_not_claimed_exact(mixture_dir):
    with pytest.warns(UserWarning, match=r"mixture of experts.*stats\.exact = False"):
        spec = Engine.from_pretrained(
            target=str(mixture_dir), method="ngram", dtype="float32", num_speculative_tokens=4
        )
    out = spec.generate(PROMPT[:5] * 3, GREEDY)
    assert len(out.token_ids) == 32 and not out.stats.exact
    plain = Engine.from_pretrained(target=str(mixture_dir), method="none", dtype="float32")
    assert plain.generate(PROMPT, GREEDY).stats.exact  # plain decoding is plain decoding


def test_a_recurrent_model_is_refused_in_one_line(tmp_path):
    config = transformers.MambaConfig(
        vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedArchitecture, match="recurrent state") as err:
        Engine.from_pretrained(target=str(tmp_path), method="none", dtype="float32")
    assert "\n" not in str(err.value)


def test_what_the_fallback_cannot_do_is_refused(family):
    _, target, draft = family
    with pytest.raises(UnderstudyError, match="scores chains only"):
        Engine.from_pretrained(
            target=str(target), draft=str(draft), method="draft", dtype="float32",
            num_speculative_tokens=4, tree="on",
        )  # fmt: skip
    with pytest.raises(UnderstudyError, match="hidden states"):
        Engine.from_pretrained(target=str(target), method="eagle", dtype="float32")
    with pytest.raises(UnderstudyError, match="transformers' own code"):
        Engine.from_pretrained(
            target=str(target), draft=str(draft), method="draft", dtype="float32",
            num_speculative_tokens=4, draft_quantization="int8",
        )  # fmt: skip


def test_a_row_attends_alone():
    """rows_apart_attention: a row's output is bitwise the same whichever rows share its pass
    (alone, or after three others), and it is SDPA's attention under the same mask (with a
    soft cap, transformers' eager arithmetic)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 4, 16, generator=gen)  # [B, H, R, D]
    k, v = torch.randn(2, 1, 2, 32, 16, generator=gen)  # [B, Hkv, L, D] each (GQA 2:1)
    positions = torch.arange(10, 14)  # the pass's rows sit at slots 10..13
    mask = (torch.arange(32)[None, :] <= positions[:, None])[None, None]  # [1, 1, R, L]
    module = torch.nn.Identity()
    together, _ = rows_apart_attention(module, q, k, v, mask, scaling=0.25)  # [B, R, H, D]
    alone, _ = rows_apart_attention(module, q[:, :, 3:], k, v, mask[:, :, 3:], scaling=0.25)
    assert torch.equal(together[:, 3], alone[:, 0])
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=0.25, enable_gqa=True
    ).transpose(1, 2)
    torch.testing.assert_close(together, want, rtol=1e-5, atol=1e-6)
    capped, _ = rows_apart_attention(module, q, k, v, mask, scaling=0.25, softcap=2.0)
    keys, values = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = torch.tanh(q @ keys.transpose(-1, -2) * 0.25 / 2.0) * 2.0  # Gemma 2's cap
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    torch.testing.assert_close(capped, (probs @ values).transpose(1, 2), rtol=1e-5, atol=1e-6)
