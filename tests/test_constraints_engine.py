"""Processors and stop tokens through the engine, on the tiny models (tests/conftest.py)."""

from __future__ import annotations

import json

import pytest
import torch

from understudy import Engine, SamplingParams
from understudy.config import StructuredSpec
from understudy.constraints import LogitsProcessor, build_processor

PROMPT = "def add(a, b):"
SCHEMA = {
    "type": "object",
    "properties": {"name": {"enum": ["add", "push"]}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
    "additionalProperties": False,
}


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


def test_min_tokens_holds_off_stop_strings_too(plain):
    """As vLLM: no stop string is looked for before min_tokens tokens (counting the one just
    emitted), so one that completes earlier does not end the text."""
    base = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    free = plain.generate(PROMPT, base)
    pieces = [plain.tokenizer.decode([t]) for t in free.token_ids]
    k, stop = next(
        (i, p) for i, p in enumerate(pieces)
        if i >= 2 and p.strip().isascii() and p.strip() and free.text.count(p) == 1
    )  # fmt: skip
    stopped = plain.generate(PROMPT, SamplingParams(**{**vars(base), "stop": [stop]}))
    assert stopped.text == free.text[: free.text.index(stop)]
    at_k = SamplingParams(**{**vars(base), "stop": [stop], "min_tokens": k + 1})
    assert plain.generate(PROMPT, at_k).text == stopped.text  # token k is the (k + 1)-th
    # once the text has run a stop string's length past it, it is out of the window searched
    end = free.text.index(stop) + 2 * len(stop)
    m = next(j for j in range(k + 2, 24) if len(plain.tokenizer.decode(free.token_ids[:j])) > end)
    held = plain.generate(PROMPT, SamplingParams(**{**vars(base), "stop": [stop], "min_tokens": m}))
    assert held.text == free.text and held.stats.finish_reason == "length"


# -- lossless under processors ----------------------------------------------------------------

PROCESSED = {
    "penalties": dict(frequency_penalty=0.3, repetition_penalty=1.1),  # n-gram still drafts
    "bias+min_tokens": dict(logit_bias={0: 8.0, 17: 5.0, 40: -100.0}, min_tokens=6),
    "regex": dict(structured=StructuredSpec(regex="[a-z ]{4,30}\\(")),
    "json": dict(structured=StructuredSpec(json_schema=SCHEMA)),
    "all": dict(
        frequency_penalty=0.5,
        presence_penalty=0.3,
        repetition_penalty=1.2,
        logit_bias={17: 3.0},
        min_tokens=3,
        structured=StructuredSpec(regex="[a-z ]{0,30}"),
    ),
}
PROMPTS = [  # the last two repeat themselves, so n-gram lookup finds drafts
    "def add(a, b):",
    "The quick brown",
    "for i in range(10):\n    print(i)\nfor i in range(10):\n    print(i)\nfor i in",
    "def push(self, x):\n        self.items.append(x)\n    def push(self, x):\n",
]


class DraftRowsRaw(LogitsProcessor):
    """A WRONG wiring for mutation checks: the processor is applied to the last row of each
    verify pass only, so drafted tokens are checked against the raw target."""

    def __init__(self, inner: LogitsProcessor) -> None:
        self.inner = inner

    def begin(self, prompt_ids: list[int]) -> None:
        self.inner.begin(prompt_ids)

    def commit(self, tokens: list[int]) -> None:
        self.inner.commit(tokens)

    def process(self, logits: torch.Tensor, drafted: list[int]) -> torch.Tensor:
        out = logits.clone()
        out[-1:] = self.inner.process(logits, drafted)[-1:]
        return out


def mutate(monkeypatch) -> None:
    import understudy.engine.start as start_module

    def wrong(*args, **kwargs):
        inner = build_processor(*args, **kwargs)
        return None if inner is None else DraftRowsRaw(inner)

    monkeypatch.setattr(start_module, "build_processor", wrong)


@pytest.fixture(scope="module")
def speculative(tiny_pair):
    target, draft = tiny_pair
    return {
        "draft": Engine.from_pretrained(
            target=target, draft=draft, dtype="float32", num_speculative_tokens=4
        ),
        "ngram": Engine.from_pretrained(
            target=target, method="ngram", dtype="float32", num_speculative_tokens=4
        ),
        "suffix": Engine.from_pretrained(
            target=target, method="suffix", dtype="float32", num_speculative_tokens=4
        ),
        "hybrid": Engine.from_pretrained(
            target=target,
            draft=draft,
            method="hybrid",
            dtype="float32",
            num_speculative_tokens=4,
            hybrid_cost_ratio=0.25,
        ),
    }


def greedy_outputs(engine, case: str) -> list[list[int]]:
    params = SamplingParams(max_tokens=32, temperature=0.0, **PROCESSED[case])
    return [engine.generate(p, params).token_ids for p in PROMPTS]


@pytest.mark.parametrize("method", ["draft", "ngram", "suffix", "hybrid"])
@pytest.mark.parametrize("case", list(PROCESSED))
def test_greedy_speculative_equals_plain_under_processors(speculative, plain, method, case):
    engine = speculative[method]
    drafted = 0
    want = greedy_outputs(plain, case)
    params = SamplingParams(max_tokens=32, temperature=0.0, **PROCESSED[case])
    for prompt, expected in zip(PROMPTS, want, strict=True):
        out = engine.generate(prompt, params)
        assert out.token_ids == expected, f"{method}/{case} differs on {prompt!r}"
        drafted += out.stats.drafted
    assert drafted > 0  # speculation ran


def test_processors_change_the_output(plain):
    free = greedy_outputs(plain, "penalties")
    params = SamplingParams(max_tokens=32, temperature=0.0)
    assert free != [plain.generate(p, params).token_ids for p in PROMPTS]
    for out in greedy_outputs(plain, "json"):
        text = plain.tokenizer.decode(out[:-1])
        assert out[-1] == 0 and isinstance(json.loads(text), dict), text


def test_wrong_wiring_fails_greedy_identity(speculative, plain, monkeypatch):
    """Mutation check: checking drafts against the raw target breaks the identity."""
    want = {case: greedy_outputs(plain, case) for case in ("penalties", "bias+min_tokens")}
    mutate(monkeypatch)
    got = {case: greedy_outputs(speculative["draft"], case) for case in want}
    assert got != want


# -- the sampled law under processors (batched) -------------------------------------------------

LAW = dict(  # a grammar's mask, a bias, every penalty, top-k: all at once
    temperature=1.0, top_k=4, max_tokens=3, frequency_penalty=0.7,
    presence_penalty=0.4, repetition_penalty=1.3, logit_bias={17: 2.0},
    structured=StructuredSpec(regex="[a-z ]{1,40}"),
)  # fmt: skip


@pytest.fixture(scope="module")
def disagreeing(tmp_path_factory) -> Engine:
    """A draft that disagrees often (noise 0.5), on four seats: rejections, residuals and
    sequences joining mid-batch all matter."""
    from conftest import make_tiny_pair

    target, draft = make_tiny_pair(tmp_path_factory.mktemp("law"), seed=5, noise=0.5)
    return Engine.from_pretrained(
        target, draft, dtype="float32", num_speculative_tokens=2, max_num_seqs=4
    )


def processed_joint(engine: Engine, prompt: list[int], params: SamplingParams) -> dict:
    """P(x1, x2, x3) under the processed, warped target law, by enumeration: at each prefix
    a fresh processor that has seen prompt + prefix changes the target's logits. EOS (which
    the grammar allows once it is complete) ends a sequence early."""
    from understudy.models.runner import Runner
    from understudy.verify.sampling import warp_probs

    runner = Runner(engine.target.model, 64)
    vocab, eos = runner.vocab_size, engine.target.eos_token_ids
    law: dict[tuple[int, ...], float] = {}

    def expand(prefix: tuple[int, ...], mass: float) -> None:
        if len(prefix) == 3:
            law[prefix] = mass
            return
        processor = build_processor(params, engine.tokenizer, vocab, eos)
        processor.begin(prompt)
        processor.commit(prompt + list(prefix))
        logits = runner.prefill(torch.tensor(prompt + list(prefix)))[None]
        probs = warp_probs(processor.process(logits, []), params)[0]
        for token in probs.nonzero().flatten().tolist():
            if token in eos:
                law[(*prefix, token)] = mass * float(probs[token])
            else:
                expand((*prefix, token), mass * float(probs[token]))

    expand((), 1.0)
    return law


def processed_goodness_of_fit(engine: Engine, samples: int) -> float:
    from stats_helpers import chisquare_pvalue

    prompt = engine.tokenizer.encode("def add(a, b):")
    params = SamplingParams(**LAW)
    law = processed_joint(engine, prompt, params)
    counts = dict.fromkeys(law, 0)
    for start in range(0, samples, 7):  # seven sampled requests a batch, on four seats
        batch = [
            SamplingParams(**{**LAW, "seed": s}) for s in range(start, min(start + 7, samples))
        ]
        for out in engine.generate([prompt] * len(batch), batch):
            key = tuple(out.token_ids)
            if key not in counts:
                return 0.0  # a sequence the processed target can never produce
            counts[key] += 1
    cells = sorted(law)
    return chisquare_pvalue([counts[c] for c in cells], [law[c] for c in cells])


def test_sampling_under_processors_has_the_processed_law(disagreeing):
    """N = 3000 batched draws, Pearson chi-squared over the joint outcomes of three tokens,
    p > ALPHA = 0.001 (stats_helpers.py), with the drafts rejected often enough to matter."""
    from stats_helpers import ALPHA

    pvalue = processed_goodness_of_fit(disagreeing, 3000)
    assert pvalue > ALPHA, f"p = {pvalue:.2e}"


def test_a_wrong_verifier_fails_the_processed_law_test(disagreeing, monkeypatch):
    """Mutation: resampling a rejected position from p' instead of the residual is detected
    at the same N. (The other wrong wiring, drafts checked against the raw target, is caught
    sooner: the grammar's matcher refuses the first forbidden token it is asked to commit.)"""
    import understudy.engine.verdict as verdict_module
    from stats_helpers import ALPHA, resample_from_p_verify

    monkeypatch.setattr(verdict_module, "verify_sampling", resample_from_p_verify)
    pvalue = processed_goodness_of_fit(disagreeing, 3000)
    assert pvalue < ALPHA, f"the wrong wiring was not detected (p = {pvalue:.3f})"
