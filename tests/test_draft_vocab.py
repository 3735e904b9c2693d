"""draft_vocab: the draft guesses from the first N token ids only (drafters/draft_vocab.py).

A tiny random Qwen2 target from GGUF blocks (vocabulary 320); the draft is the same network
with its head's scales 10x (the target's ranking, confident guesses), limited to ids below
160. Greedy output must be plain decoding's; sampled output must have the target's law, by
the chi-squared test of test_exactness.py (N = 1500 samples of (x1, x2, x3), p > 0.001),
which a verifier that resamples a rejected guess from p instead of the residual fails at the
same N (p ~ 1e-57 here). Where the target's likely tokens lie past 160 the draft's q is 0
on them, so the residual carries much of the law.
"""

from __future__ import annotations

import pytest
import torch

from gguf_helpers import TINY, write_tiny_qwen2_gguf
from test_exactness import P_THRESHOLD, WARPS, goodness_of_fit
from understudy import Engine, SamplingParams
from understudy.config import UnderstudyError
from understudy.drafters.draft_vocab import DraftVocabHead
from understudy.kernels import qgemm
from understudy.models.loader import load_model

pytestmark = [
    pytest.mark.skipif(not qgemm.available(), reason="qgemm cannot be built here"),
    pytest.mark.usefixtures("one_thread"),
]

LIMIT = TINY["vocab"] // 2
SHARPEN = 10.0  # the draft: the target itself with logits 10x sharper, then limited


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("draft-vocab")
    target = write_tiny_qwen2_gguf(root / "target.gguf", seed=0)
    draft = write_tiny_qwen2_gguf(root / "draft.gguf", seed=0, head_scale=SHARPEN)
    return str(target), str(draft)


def engine(tiny_gguf: tuple[str, str], **options: object) -> Engine:
    target, draft = tiny_gguf
    return Engine.from_pretrained(
        target=target, draft=draft, quantization="gguf", max_context=256, **options
    )


@pytest.fixture(scope="module")
def limited(tiny_gguf: tuple[str, str]) -> Engine:
    return engine(tiny_gguf, num_speculative_tokens=2, draft_vocab=LIMIT)


def test_the_draft_scores_only_its_ids(tiny_gguf: tuple[str, str], limited: Engine) -> None:
    """The draft's logits are -inf past the limit and, below it, bitwise the full head's
    first LIMIT outputs (the same blocks; each column is computed on its own)."""
    runner = limited.drafter.draft_runner()
    head = runner.model.lm_head
    assert isinstance(head, DraftVocabHead) and head.rows == LIMIT
    hidden = torch.randn(3, runner.model.cfg.hidden_size)
    logits = head(hidden)  # [3, vocab]
    assert logits.shape == (3, TINY["vocab"])
    assert torch.isinf(logits[:, LIMIT:]).all() and torch.isfinite(logits[:, :LIMIT]).all()
    full = load_model(tiny_gguf[1], quantization="gguf").model.lm_head
    assert torch.equal(logits[:, :LIMIT], full(hidden)[:, :LIMIT])


def test_a_greedy_guess_reads_only_the_drafts_ids(limited: Engine, monkeypatch) -> None:
    """Greedy, the chain takes its guess and the guess's probability from the first LIMIT
    logits only (the rest are -inf): the same guess and probability as from all of them."""
    from understudy.drafters.draft_model import DraftChain

    drafter = limited.drafter
    assert drafter.vocab_rows == LIMIT
    monkeypatch.setattr(drafter, "path_confidence", 0.01)  # the chain computes its probability
    logits = torch.full((1, TINY["vocab"]), float("-inf"))
    logits[0, :LIMIT] = torch.randn(LIMIT, generator=torch.Generator().manual_seed(3))
    logits[0, LIMIT - 1] = logits.max() + 1.0  # the guess: the last id the draft scores
    guesses = []
    for rows in (LIMIT, None):
        monkeypatch.setattr(drafter, "vocab_rows", rows)
        chain = DraftChain(drafter, [1, 2], 3, SamplingParams(temperature=0.0), torch.Generator())
        guesses.append((int(chain.take(logits)), chain.own[0]))
    assert guesses[0][0] == guesses[1][0] == LIMIT - 1
    assert guesses[0][1] == pytest.approx(guesses[1][1], rel=1e-6)


def test_greedy_output_is_plain_decoding(tiny_gguf: tuple[str, str], limited: Engine) -> None:
    target, _ = tiny_gguf
    plain = Engine.from_pretrained(target=target, method="none", quantization="gguf")
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    for prompt in ([5, 6, 7, 8, 5, 6, 7, 8], [200, 201, 250, 300, 310, 5]):
        out = limited.generate(prompt, params)
        assert out.token_ids == plain.generate(prompt, params).token_ids
        assert out.stats.exact and out.stats.drafted > 0


@pytest.mark.parametrize("warp", ["top_k", "min_p"])
def test_sampled_output_has_the_target_law(limited: Engine, warp: str) -> None:
    params = SamplingParams(ignore_eos=True, **WARPS[warp])
    pvalue = goodness_of_fit(limited, [11, 42, 7], params, samples=1500)
    assert pvalue > P_THRESHOLD, f"{warp}: p = {pvalue:.2e}"


def test_a_wrong_verifier_fails_the_same_test(limited: Engine, monkeypatch) -> None:
    """Mutation check: resampling a rejected guess from p, not the residual, is caught."""
    import understudy.engine.verdict as verdict_module
    from stats_helpers import resample_from_p_verify

    monkeypatch.setattr(verdict_module, "verify_sampling", resample_from_p_verify)
    params = SamplingParams(ignore_eos=True, **WARPS["top_k"])
    pvalue = goodness_of_fit(limited, [11, 42, 7], params, samples=1500)
    assert pvalue < P_THRESHOLD, f"the wrong verifier was not detected (p = {pvalue:.3f})"


def test_auto_keeps_a_small_vocabulary_whole(tiny_gguf: tuple[str, str]) -> None:
    """auto limits only a vocabulary over twice AUTO_VOCAB; 320 ids stay whole."""
    spec = engine(tiny_gguf, num_speculative_tokens=2)
    assert not isinstance(spec.drafter.draft_runner().model.lm_head, DraftVocabHead)


def test_bad_values_are_refused(tiny_gguf: tuple[str, str], tiny_pair: tuple[str, str]) -> None:
    for bad in (0, -3, 1.5, "half", True):
        with pytest.raises(UnderstudyError, match="draft_vocab must be auto, all or an integer"):
            engine(tiny_gguf, num_speculative_tokens=2, draft_vocab=bad)
    with pytest.raises(UnderstudyError, match="needs a draft whose LM head runs from GGUF"):
        Engine.from_pretrained(
            target=tiny_pair[0], draft=tiny_pair[1], dtype="float32", draft_vocab=100,
            num_speculative_tokens=2,
        )  # fmt: skip
