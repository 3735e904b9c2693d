"""GGUF files of the fast path's architectures, as transformers reads them.

Per GGUF architecture, a tiny random model made with transformers' config class
(test_architectures.make_hf) is written as llama.cpp's converter writes it
(gguf_helpers.write_gguf_from_hf: float32 matrices, llama's q/k rows permuted, Gemma's norms
as 1 + w, Llama 3's rope scaling as the divisors rope_freqs), with the fields transformers'
GGUF reader maps and those llama.cpp adds that models/gguf_config.py reads. Loaded from the
file (dense, float32):

1. logits == the transformers model's forward (relative tolerance 1e-5);
2. greedy method="ngram" == plain decoding, bit for bit.

Llama also runs from its own Q8_0 blocks (quantization="gguf"): every dequantized weight is
the dense path's bitwise (the q/k rows un-permuted as transformers' reader does), and greedy
speculative output is plain decoding's. A GGUF of an architecture without a fast path is
refused in one line that says which form of the model to load instead.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from gguf import GGMLQuantizationType

from gguf_helpers import write_gguf_from_hf
from test_architectures import PROMPT, VOCAB, make_hf
from test_fallback import SMALL
from test_fallback import make_hf as make_other
from understudy import Engine, SamplingParams
from understudy.kernels import qgemm
from understudy.kernels.qgemm import QuantLinear
from understudy.models.convert import UnsupportedArchitecture
from understudy.models.loader import load_model
from understudy.models.runner import Runner

DEFAULT_ROPE = dict(rope_type="default", rope_theta=500000.0)
# GGUF architecture -> (test_architectures entry, overrides: what a GGUF file can carry)
CASES = {
    "llama": ("llama3", {}),  # its llama3 rope scaling as the file's rope_freqs
    "qwen3": ("qwen3", dict(head_dim=128)),  # the reader takes Qwen3's head_dim as 128
    "phi3": ("phi4-mini-partial", dict(rope_parameters=DEFAULT_ROPE)),
    "gemma2": (
        "gemma2",
        dict(query_pre_attn_scalar=256, attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    ),
    "gemma3": (  # six layers: Gemma 3's pattern, five sliding and one global
        "gemma3",
        dict(
            num_hidden_layers=6, layer_types=None, rope_parameters=None, query_pre_attn_scalar=256
        ),
    ),
}
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=list(CASES))
def written(request, tmp_path_factory) -> tuple[str, transformers.PreTrainedModel, Path]:
    arch = request.param
    name, overrides = CASES[arch]
    hf = make_hf(name, **overrides)
    path = write_gguf_from_hf(hf, tmp_path_factory.mktemp(arch) / f"{arch}.gguf", arch)
    return arch, hf, path


def test_logits_match_transformers(written):
    arch, hf, path = written
    loaded = load_model(str(path), dtype="float32", quantization="none")
    assert not loaded.from_blocks
    tokens = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(3))
    got = Runner(loaded.model, 64).extend(tokens)  # [40, V]
    with torch.no_grad():
        want = hf(tokens[None]).logits[0]  # [40, V]
    scale = float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale)


def test_greedy_speculative_equals_plain(written):
    _, _, path = written
    options = dict(target=str(path), dtype="float32", quantization="none", max_context=256)
    plain = Engine.from_pretrained(method="none", **options)
    ngram = Engine.from_pretrained(method="ngram", num_speculative_tokens=4, **options)
    for prompt in (PROMPT, PROMPT[:5] * 3):
        out = ngram.generate(prompt, GREEDY)
        assert out.token_ids == plain.generate(prompt, GREEDY).token_ids
        assert out.stats.exact
    assert out.stats.accepted > 0  # the repeating prompt's guesses were kept


@pytest.mark.skipif(not qgemm.available(), reason="qgemm cannot be built here")
def test_llama_from_its_blocks(tmp_path):
    hf = make_hf("llama3", tie_word_embeddings=False)
    path = write_gguf_from_hf(hf, tmp_path / "llama.gguf", "llama", GGMLQuantizationType.Q8_0)
    blocks = load_model(str(path), quantization="gguf")
    dense = load_model(str(path), dtype="float32", quantization="none")
    assert blocks.from_blocks and blocks.model.cfg == dense.model.cfg
    dense_params = dict(dense.model.named_parameters())
    checked = 0
    for name, module in blocks.model.named_modules():
        if isinstance(module, QuantLinear) and not name.endswith(".table"):
            assert torch.equal(module.weight, dense_params[f"{name}.weight"]), name
            checked += 1
    assert checked == 1 + 4 * blocks.model.cfg.num_layers
    options = dict(target=str(path), quantization="gguf", max_context=256)
    plain = Engine.from_pretrained(method="none", **options)
    ngram = Engine.from_pretrained(method="ngram", num_speculative_tokens=4, **options)
    prompt = PROMPT[:5] * 3
    out = ngram.generate(prompt, GREEDY)
    assert out.token_ids == plain.generate(prompt, GREEDY).token_ids and out.stats.accepted > 0


def test_a_gguf_without_a_fast_path_is_refused_in_one_line(tmp_path):
    hf = make_other("NemotronConfig", {**SMALL, "head_dim": 16})
    path = write_gguf_from_hf(hf, tmp_path / "nemotron.gguf", "nemotron")
    with pytest.raises(UnsupportedArchitecture, match="Hugging Face folder or id") as err:
        load_model(str(path), dtype="float32", quantization="none")
    assert "'nemotron' is not supported" in str(err.value) and "\n" not in str(err.value)
