"""Logits processors (understudy.constraints), unit level: each against a hand-computed
table, and all of them together against the property speculation relies on: row i of a
multi-row call equals what one-row plain decoding computes after committing drafted[:i],
bit for bit, and a call leaves the committed state as it was."""

from __future__ import annotations

import math

import pytest
import torch

from understudy.config import SamplingParams, StructuredSpec, UnderstudyError
from understudy.constraints import Composite, build_processor
from understudy.constraints.bias import LogitBias
from understudy.constraints.grammar import GrammarProcessor
from understudy.constraints.min_tokens import MinTokens
from understudy.constraints.penalties import Penalties

INF = math.inf
EOS = 0


@pytest.fixture(scope="module")
def tokenizer(tiny_pair):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_pair[0])


def started(proc, prompt, generated=()):
    proc.begin(list(prompt))
    proc.commit([*prompt, *generated])
    return proc


def test_penalties_match_a_hand_computed_table():
    """prompt [1], generated [2, 2, 3]; presence 0.5, frequency 0.25, repetition 2."""
    logits = torch.tensor([[2.0, -1.0, 4.0, -2.0, 1.0, 0.0]] * 3)
    proc = started(Penalties(6, 0.5, 0.25, 2.0), [1], [2, 2, 3])
    out = proc.process(logits, [4, 4])
    want = torch.tensor(
        [
            [2.0, -2.0, 1.0, -4.75, 1.0, 0.0],  # 1: prompt only, so repetition only
            [2.0, -2.0, 1.0, -4.75, -0.25, 0.0],  # 4 drafted once: 1/2 - 0.25 - 0.5
            [2.0, -2.0, 1.0, -4.75, -0.5, 0.0],  # twice: 1/2 - 0.5 - 0.5
        ]
    )
    assert torch.equal(out, want)
    assert torch.equal(proc.process(logits[:1], []), want[:1])  # drafts were tentative
    assert torch.equal(logits[0], torch.tensor([2.0, -1.0, 4.0, -2.0, 1.0, 0.0]))  # untouched


def test_presence_and_frequency_count_only_generated_tokens():
    logits = torch.zeros(1, 4)
    proc = started(Penalties(4, 1.0, 1.0, 1.0), [3, 3, 3], [1])
    assert proc.process(logits, []).tolist() == [[0.0, -2.0, 0.0, 0.0]]


def test_logit_bias_adds_and_refuses_ids_outside_the_vocabulary():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    out = LogitBias({0: 100.0, 2: -100.0}, 3).process(logits, [])
    assert out.tolist() == [[101.0, 2.0, -97.0]]
    with pytest.raises(UnderstudyError, match="logit_bias.*outside the vocabulary"):
        LogitBias({3: 1.0}, 3)


def test_min_tokens_masks_stop_tokens_until_enough_are_generated():
    proc = started(MinTokens(3, (0, 5), 8), [7, 7], [1])  # one generated: two more blocked
    out = proc.process(torch.zeros(4, 8), [2, 3, 4])
    blocked = ~torch.isfinite(out)
    assert blocked[:2, [0, 5]].all() and not blocked[2:].any() and blocked.sum() == 4
    proc.commit([7, 7, 1, 2, 3])
    assert torch.isfinite(proc.process(torch.zeros(1, 8), [])).all()


def test_build_processor_is_none_when_nothing_is_asked():
    assert build_processor(SamplingParams(), None, 320, (EOS,)) is None
    assert build_processor(SamplingParams(min_tokens=2, ignore_eos=True), None, 320, (0,)) is None
    both = build_processor(SamplingParams(logit_bias={1: 1.0}, min_tokens=1), None, 320, (0,))
    assert isinstance(both, Composite) and len(both.parts) == 2


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("presence_penalty", 2.5, "presence_penalty must be a number in"),
        ("frequency_penalty", float("nan"), "frequency_penalty must be"),
        ("repetition_penalty", 0.0, "repetition_penalty must be a number in"),
        ("repetition_penalty", 1e-300, "repetition_penalty must be a number in"),
        ("logit_bias", {1: 101.0}, "logit_bias values must be in"),
        ("logit_bias", {-1: 1.0}, "logit_bias keys must be token ids"),
        ("min_tokens", 200, "min_tokens must be an integer in 0..max_tokens"),
        ("stop_token_ids", [-3], "stop_token_ids must be token ids"),
        ("logprobs", 21, "logprobs must be an integer in 0..20"),
    ],
)
def test_sampling_params_refuse_out_of_range_values(field, value, message):
    with pytest.raises(UnderstudyError, match=message):
        SamplingParams(**{field: value})


def test_structured_spec_takes_exactly_one_language():
    with pytest.raises(UnderstudyError, match="exactly one of"):
        StructuredSpec(regex="a", grammar='root ::= "a"')
    with pytest.raises(UnderstudyError, match="ignore_eos"):
        SamplingParams(structured=StructuredSpec(json_object=True), ignore_eos=True)


SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}},
    "required": ["a"],
    "additionalProperties": False,
}


def allowed(row: torch.Tensor) -> set[int]:
    return set(torch.isfinite(row).nonzero().flatten().tolist())


def test_grammar_masks_follow_commits_and_end_with_eos(tokenizer):
    spec = StructuredSpec(json_schema=SCHEMA)
    proc = GrammarProcessor.build(spec, tokenizer, 320, (EOS,))
    text_ids = tokenizer('{"a": 12}')["input_ids"]
    proc.begin([5, 6])
    first = proc.process(torch.zeros(1, 320), [])[0]
    assert {tokenizer.decode([t]) for t in allowed(first)} == {"{"}
    tokens = [5, 6]
    for token in text_ids:
        row = proc.process(torch.zeros(1, 320), [])[0]
        assert token in allowed(row) and EOS not in allowed(row)
        tokens.append(token)
        proc.commit(tokens)
    assert allowed(proc.process(torch.zeros(1, 320), [])[0]) == {EOS}


def test_grammar_rows_along_a_draft_then_rollback(tokenizer):
    """Row i is the mask after drafted[:i]; a refused draft gets -inf at its own row; the
    matcher is back where it was afterwards."""
    proc = GrammarProcessor.build(StructuredSpec(json_schema=SCHEMA), tokenizer, 320, (EOS,))
    proc.begin([5])
    good = tokenizer('{"a')["input_ids"]
    bad = tokenizer("x")["input_ids"][0]
    drafted = [*good, bad, good[0]]
    out = proc.process(torch.zeros(len(drafted) + 1, 320), drafted)
    for i, token in enumerate(good):
        assert token in allowed(out[i])
    assert bad not in allowed(out[len(good)])
    assert torch.equal(out[len(good) + 1 :], torch.zeros(2, 320))  # unreachable: left alone
    again = proc.process(torch.zeros(1, 320), [])
    assert allowed(again[0]) == allowed(out[0])  # rolled back to the committed state


def test_grammar_wins_when_min_tokens_leaves_it_nothing(tokenizer):
    spec = StructuredSpec(choice=("ab",))
    proc = build_processor(SamplingParams(structured=spec, min_tokens=50), tokenizer, 320, (EOS,))
    ids = tokenizer("ab")["input_ids"]
    started(proc, [5], ids)
    row = proc.process(torch.randn(1, 320), [])[0]
    assert allowed(row) == {EOS} and row[EOS] == 0.0


def test_constraints_that_leave_no_token_are_errors_not_nan(tokenizer):
    """min_tokens with every token a stop token, and a grammar whose every next token is a
    stop token, would leave a row of -inf only (NaN probabilities): each is refused."""
    every = SamplingParams(min_tokens=2, stop_token_ids=list(range(1, 320)))
    with pytest.raises(UnderstudyError, match="^min_tokens .*every token"):
        build_processor(every, tokenizer, 320, (EOS,))
    assert build_processor(every, tokenizer, 321, (EOS,)) is not None  # one token is left
    cut = SamplingParams(structured=StructuredSpec(choice=("ab",)), stop_token_ids=[*range(1, 320)])
    proc = build_processor(cut, tokenizer, 320, (EOS,))
    proc.begin([5])
    with pytest.raises(UnderstudyError, match="^structured output: .*allows no token"):
        proc.process(torch.zeros(1, 320), [])


@pytest.mark.parametrize(
    "spec",
    [
        StructuredSpec(json_schema={"type": "nope"}),
        StructuredSpec(regex="(unclosed"),
        StructuredSpec(grammar="root ::= "),
    ],
    ids=["json_schema", "regex", "grammar"],
)
def test_a_grammar_that_does_not_compile_is_a_clear_error(tokenizer, spec):
    with pytest.raises(UnderstudyError, match="does not compile"):
        GrammarProcessor.build(spec, tokenizer, 320, (EOS,))


def everything(tokenizer) -> SamplingParams:
    return SamplingParams(
        presence_penalty=0.4,
        frequency_penalty=0.3,
        repetition_penalty=1.3,
        logit_bias={7: 3.0, 9: -2.0},
        min_tokens=5,
        stop_token_ids=[1],
        structured=StructuredSpec(regex="[a-z ]{0,40}"),
    )


def test_every_row_equals_one_row_plain_decoding(tokenizer):
    """The property that makes speculation lossless under processors (base.py): for random
    logits and a draft the grammar accepts, batched row i == a fresh one-row computation
    after committing drafted[:i], bitwise; and a repeated call gives the same rows."""
    params = everything(tokenizer)
    prompt = tokenizer("the quick")["input_ids"]
    generated = tokenizer(" brown")["input_ids"]
    drafted = tokenizer(" fox jumps")["input_ids"]
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(drafted) + 1, 320, generator=g) * 5  # [R, V]
    proc = build_processor(params, tokenizer, 320, (EOS,))
    started(proc, prompt, generated)
    batched = proc.process(logits, drafted)
    assert torch.equal(proc.process(logits, drafted), batched)
    for i in range(len(drafted) + 1):
        fresh = build_processor(params, tokenizer, 320, (EOS,))
        started(fresh, prompt, [*generated, *drafted[:i]])
        assert torch.equal(fresh.process(logits[i : i + 1], [])[0], batched[i]), f"row {i}"
    blocked = 5 - len(generated)  # min_tokens=5: stop ids 0 and 1 impossible until then
    assert blocked > 0 and not torch.isfinite(batched[:blocked, :2]).any()
    assert torch.isfinite(batched[blocked:, :2]).all()  # then the regex may end anywhere
