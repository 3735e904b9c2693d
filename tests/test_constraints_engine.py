"""Processors and stop tokens through the engine, on the tiny models (tests/conftest.py)."""

from __future__ import annotations

import pytest

from understudy import Engine, SamplingParams

PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def plain(tiny_pair):
    return Engine.from_pretrained(target=tiny_pair[0], method="none", dtype="float32")


def test_stop_token_ids_end_generation_like_eos(plain):
    free = plain.generate(PROMPT, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    ids = free.token_ids
    at = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])  # its first occurrence
    params = SamplingParams(
        max_tokens=24, temperature=0.0, ignore_eos=True, stop_token_ids=[ids[at]]
    )
    out = plain.generate(PROMPT, params)
    assert out.token_ids == ids[: at + 1]  # kept in token_ids
    assert out.text == plain.tokenizer.decode(ids[:at])  # not in the text
    assert out.stats.finish_reason == "stop"


def test_include_stop_str_in_output_keeps_the_stop_string(plain):
    base = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    text = plain.generate(PROMPT, base).text
    stop = text[5:8]
    assert stop and stop not in text[:7]
    cut = plain.generate(PROMPT, SamplingParams(**{**vars(base), "stop": [stop]}))
    kept = plain.generate(
        PROMPT, SamplingParams(**{**vars(base), "stop": [stop], "include_stop_str_in_output": True})
    )
    start = text.index(stop)
    assert cut.text == text[:start]
    assert kept.text == text[: start + len(stop)]
    assert kept.stats.finish_reason == cut.stats.finish_reason == "stop"
