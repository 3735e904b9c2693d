"""No kernel refusal reaches the user as a crash: a shape a kernel cannot take runs on the
exact portable path, the reason logged once (models/refusals.py); quantization="gguf"
refuses the model with that reason instead.

The case: a model whose heads are 8 wide, which span_attention (16 lanes) cannot take. It
used to fail every generate() with span_attention's "refused its arguments"."""

from __future__ import annotations

from dataclasses import replace

import pytest
from gguf import GGMLQuantizationType as T

from gguf_helpers import write_gguf_from_hf
from test_architectures import PROMPT, make_hf
from understudy import Engine, SamplingParams
from understudy.config import UnderstudyError
from understudy.kernels import fused_layer, qgemm, span_attention
from understudy.models.fused import layer_parts
from understudy.models.refusals import log_refusal

pytestmark = [
    pytest.mark.skipif(not qgemm.available(), reason="qgemm cannot be built here"),
    pytest.mark.skipif(not span_attention.available(), reason="span_attention is off or unbuilt"),
    pytest.mark.usefixtures("one_thread"),
]
NARROW = dict(num_attention_heads=8, num_key_value_heads=2,
              rope_parameters=dict(rope_type="default", rope_theta=10000.0))  # fmt: skip
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def narrow_gguf(tmp_path_factory) -> str:
    """A tiny Llama with 8-wide heads, in Q8_0 blocks."""
    hf = make_hf("llama3", **NARROW)
    assert hf.config.head_dim == 8
    path = tmp_path_factory.mktemp("narrow") / "narrow.gguf"
    return str(write_gguf_from_hf(hf, path, "llama", T.Q8_0))


def said(caplog: pytest.LogCaptureFixture, what: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if what in r.getMessage()]


def test_heads_span_attention_cannot_take_run_on_torch_saying_why_once(
    narrow_gguf: str, caplog: pytest.LogCaptureFixture
) -> None:
    log_refusal.cache_clear()  # said once a process: forget what earlier tests said
    options = dict(target=narrow_gguf, quantization="auto", max_context=256)
    with caplog.at_level("WARNING", logger="understudy.kernels"):
        plain = Engine.from_pretrained(method="none", **options)
        ngram = Engine.from_pretrained(method="ngram", num_speculative_tokens=4, **options)
    model = plain.target.model
    assert plain.target.from_blocks
    assert all(layer.attn.span_rows == 0 for layer in model.layers)  # kept off
    assert all(layer.fused is not None for layer in model.layers)  # the rest is fused
    lines = said(caplog, "span_attention")
    assert lines == ["span_attention: head size 8 is not a multiple of span_attention's 16 "
                     "lanes; that part runs on the exact portable path instead"], lines  # fmt: skip
    for prompt in (PROMPT, PROMPT[:5] * 3):
        out = ngram.generate(prompt, GREEDY)
        assert out.token_ids == plain.generate(prompt, GREEDY).token_ids
    assert out.stats.drafted > 0


def test_quantization_gguf_refuses_them_with_the_reason(narrow_gguf: str) -> None:
    with pytest.raises(UnderstudyError, match="head size 8 is not a multiple") as err:
        Engine.from_pretrained(target=narrow_gguf, method="none", quantization="gguf")
    assert "quantization='gguf' cannot be used" in str(err.value) and "\n" not in str(err.value)


def test_a_dense_float32_model_with_narrow_heads_generates(tmp_path) -> None:
    """The dense path (a Hugging Face folder, float32 on a CPU: rowgemm and span_attention
    turned on by the builder) keeps its attention on torch too."""
    hf = make_hf("llama3", **NARROW)
    hf.save_pretrained(tmp_path)
    options = dict(target=str(tmp_path), dtype="float32", max_context=256)
    plain = Engine.from_pretrained(method="none", **options)
    ngram = Engine.from_pretrained(method="ngram", num_speculative_tokens=4, **options)
    out = ngram.generate(PROMPT, GREEDY)
    assert out.token_ids == plain.generate(PROMPT, GREEDY).token_ids


def test_the_fused_layer_names_what_it_cannot_take(narrow_gguf: str) -> None:
    """An odd rotated width, an activation it lacks: one line each, and None where it can."""
    model = Engine.from_pretrained(target=narrow_gguf, method="none").target.model
    parts = layer_parts(model.layers[0])
    assert parts is not None
    shape, tensors = parts
    assert fused_layer.refusal(shape, tensors) is None
    odd = fused_layer.refusal(replace(shape, rotary_dim=7), tensors)
    assert odd is not None and "not 7 of 8" in odd
    relu = fused_layer.refusal(replace(shape, activation="relu"), tensors)
    assert relu is not None and "no relu activation" in relu
