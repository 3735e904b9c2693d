"""Engine tests on tiny random models: greedy speculative == plain, rollback, stats, API."""

from __future__ import annotations

import pytest
import torch

from understudy import Engine, SamplingParams, UnderstudyError
from understudy.models.runner import Runner


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(1, 300, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


@pytest.fixture(scope="module")
def engines(tiny_pair):
    target, draft = tiny_pair
    spec = Engine.from_pretrained(
        target=target, draft=draft, method="draft", num_speculative_tokens=8, dtype="float32"
    )
    plain = Engine.from_pretrained(target=target, method="none", dtype="float32")
    return spec, plain


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
def test_greedy_speculative_equals_plain(engines, k):
    spec, plain = engines
    spec.k = k
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    rejected_somewhere = False
    for prompt in prompts(6, seed=k):
        a = spec.generate(prompt, params)
        b = plain.generate(prompt, params)
        assert a.token_ids == b.token_ids
        assert len(a.token_ids) == 40
        rejected_somewhere |= a.stats.accepted < a.stats.drafted
        assert a.stats.tokens_per_pass > 1.0
    assert rejected_somewhere, "the draft should disagree sometimes, so rollback is exercised"


def test_plain_stats_exact(engines):
    _, plain = engines
    out = plain.generate([5, 6, 7], SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True))
    s = out.stats
    assert s.tokens == 17 == len(out.token_ids)
    assert s.target_passes == 17
    assert s.tokens_per_pass == 1.0
    assert s.mean_accepted_length == 1.0


def test_stats_consistent(engines):
    spec, _ = engines
    spec.k = 4
    out = spec.generate(
        [9, 8, 7, 6], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    )
    s = out.stats
    assert s.tokens == 50
    assert s.target_passes == s.rounds + 1
    # every round emits accepted + 1 tokens (the last may be cut by max_tokens)
    assert s.tokens <= 1 + s.accepted + s.rounds
    assert s.tokens >= 1 + s.accepted + s.rounds - 4
    assert s.acceptance_rate == pytest.approx(s.accepted / s.drafted)
    assert s.mean_accepted_length == pytest.approx((s.accepted + s.rounds) / s.rounds)
    assert len(s.per_position_acceptance) == 4
    pairs = zip(s.per_position_acceptance, s.per_position_acceptance[1:], strict=False)
    assert all(a >= b for a, b in pairs)


def test_max_tokens_never_exceeded(engines):
    spec, _ = engines
    spec.k = 8
    for n in (1, 2, 3, 9, 10):
        out = spec.generate(
            [1, 2, 3], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        )
        assert len(out.token_ids) == n


def test_eos_inside_accepted_draft_stops_like_plain(engines):
    spec, plain = engines
    spec.k = 8
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    base = plain.generate([3, 1, 4, 1, 5], params).token_ids
    eos = base[20]  # pretend the 21st generated token is an end-of-text token
    for engine in (spec, plain):
        engine.target.eos_token_ids = (eos,)
    try:
        params = SamplingParams(max_tokens=60, temperature=0.0)
        a = spec.generate([3, 1, 4, 1, 5], params)
        b = plain.generate([3, 1, 4, 1, 5], params)
    finally:
        for engine in (spec, plain):
            engine.target.eos_token_ids = (0,)
    assert a.token_ids == b.token_ids == base[: base.index(eos) + 1]
    assert a.stats.finish_reason == "stop"


def test_seeded_sampling_is_reproducible(engines):
    spec, _ = engines
    params = SamplingParams(max_tokens=30, temperature=0.8, top_k=50, seed=0, ignore_eos=True)
    a = spec.generate([4, 4, 4], params).token_ids
    b = spec.generate([4, 4, 4], params).token_ids
    assert a == b


def test_runner_truncate_rolls_back(tiny_pair):
    """Scoring tokens, rolling back, and scoring others gives the logits of a fresh run."""
    target, _ = tiny_pair
    engine = Engine.from_pretrained(target=target, method="none", dtype="float32")
    runner = Runner(engine.target.model, 256, rows=16)
    prompt = torch.tensor([5, 9, 13, 17])
    runner.prefill(prompt)
    runner.extend(torch.tensor([100, 101, 102]))
    runner.truncate(5)  # keep token 100 only
    after = runner.extend(torch.tensor([7, 8]))
    fresh = Runner(engine.target.model, 256, rows=16)
    fresh.prefill(prompt)
    fresh.extend(torch.tensor([100]))
    expected = fresh.extend(torch.tensor([7, 8]))
    assert torch.equal(after, expected)


def test_text_prompt_stream_and_stop(tiny_pair):
    target, draft = tiny_pair
    engine = Engine.from_pretrained(
        target=target, draft=draft, num_speculative_tokens=3, dtype="float32"
    )
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    events = list(stream := engine.stream("def add(a, b):", params))
    out = stream.output
    assert out is not None and [e.token_id for e in events] == out.token_ids
    assert "".join(e.text for e in events) == out.text
    assert {e.origin for e in events} <= {"accepted", "corrected", "bonus", "target"}
    assert events[0].origin == "target"
    if len(out.text) > 6:
        stop = out.text[3:6]
        cut = engine.generate(
            "def add(a, b):",
            SamplingParams(max_tokens=30, temperature=0.0, stop=[stop], ignore_eos=True),
        )
        assert cut.text == out.text[: out.text.index(stop)]
        assert cut.stats.finish_reason == "stop"


def test_chat_prompt(tiny_pair):
    target, draft = tiny_pair
    engine = Engine.from_pretrained(target=target, draft=draft, dtype="float32")
    out = engine.generate(
        [{"role": "user", "content": "hi"}], SamplingParams(max_tokens=5, temperature=0.0)
    )
    assert 1 <= len(out.token_ids) <= 5


def test_token_id_model_without_tokenizer(tiny_pair_no_tokenizer):
    target, draft = tiny_pair_no_tokenizer
    engine = Engine.from_pretrained(target=target, draft=draft, dtype="float32")
    out = engine.generate([1, 2, 3], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert out.text == "" and len(out.token_ids) == 8
    with pytest.raises(UnderstudyError, match="no tokenizer"):
        engine.generate("hello", SamplingParams(max_tokens=4))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 65}, "num_speculative_tokens"),
        ({"method": "telepathy"}, "unknown method"),
        ({"target": "no-such-model"}, "no-such-model"),
    ],
)
def test_bad_engine_arguments(tiny_pair, kwargs, message):
    target, draft = tiny_pair
    args = {"target": target, "draft": draft, "dtype": "float32", **kwargs}
    with pytest.raises(UnderstudyError, match=message):
        Engine.from_pretrained(**args)


def test_bad_prompts(engines):
    spec, _ = engines
    with pytest.raises(UnderstudyError, match="empty"):
        spec.generate("", SamplingParams(max_tokens=4))
    with pytest.raises(UnderstudyError, match="empty"):
        spec.generate([], SamplingParams(max_tokens=4))
    with pytest.raises(UnderstudyError, match="context"):
        spec.generate([1] * 5000, SamplingParams(max_tokens=4))


@pytest.mark.parametrize(
    "kwargs",
    [{"temperature": -1}, {"top_p": 0.0}, {"top_p": 1.5}, {"max_tokens": 0}, {"top_k": -2}],
)
def test_bad_sampling_params(kwargs):
    with pytest.raises(UnderstudyError):
        SamplingParams(**kwargs)


def test_incompatible_draft_is_refused(tmp_path, tiny_pair):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    target, _ = tiny_pair
    other = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=400,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    )
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(UnderstudyError, match="vocabulary"):
        Engine.from_pretrained(target=target, draft=str(tmp_path / "other"), dtype="float32")
