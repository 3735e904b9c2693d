"""Models run from a GGUF file's own blocks (quantization="auto" on a CPU, and "gguf",
models/gguf_weights.py).

Tiny random Qwen2 GGUFs are written in the test with gguf's GGUFWriter (blocks of every
kernel type; one float32 part, which "auto" runs dequantized and "gguf" refuses). The dense
path (transformers' GGUF loader, dequantized) is the reference: the same weights bitwise,
logits within the activation quantization's error.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T

from gguf_helpers import MIXED_LAYER_TYPES, MORE_LAYER_TYPES, write_tiny_qwen2_gguf
from understudy.config import UnderstudyError
from understudy.kernels import qgemm
from understudy.kernels.qgemm import QuantLinear
from understudy.models.loader import LoadedModel, load_model
from understudy.models.runner import Runner

pytestmark = pytest.mark.skipif(not qgemm.available(), reason="qgemm cannot be built here")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """(target, draft): the draft another seed, with its head tied to its embedding."""
    root = tmp_path_factory.mktemp("gguf")
    target = write_tiny_qwen2_gguf(root / "target.gguf", seed=0, layer_types=MIXED_LAYER_TYPES)
    draft = write_tiny_qwen2_gguf(
        root / "draft.gguf", seed=1, tied=True, layer_types=MIXED_LAYER_TYPES
    )
    return str(target), str(draft)


@pytest.fixture(scope="module")
def pair(tiny_gguf: tuple[str, str]) -> tuple[LoadedModel, LoadedModel]:
    """The tiny target from its blocks, and dense (float32, via transformers)."""
    return (
        load_model(tiny_gguf[0], quantization="auto"),
        load_model(tiny_gguf[0], dtype="float32", quantization="none"),
    )


def test_weights_are_the_dense_conversion_bitwise(pair: tuple[LoadedModel, LoadedModel]) -> None:
    """Every parameter of the block model, dequantized, is the dense path's bitwise: names,
    fusing and row order map as transformers' GGUF loader maps them."""
    assert_dense_conversion_bitwise(*pair)


def test_every_kernel_type_runs_from_its_blocks(tmp_path: Path) -> None:
    """A file of the other kernel types (Q5_K, Q3_K, Q2_K, IQ4_XS, IQ4_NL, Q4_1, Q5_1, F16,
    BF16): every linear runs from the file's blocks (no part dequantized at load), its
    weights are the dense conversion's bitwise, and greedy speculative output is plain
    decoding's."""
    from understudy import Engine, SamplingParams

    path = str(write_tiny_qwen2_gguf(tmp_path / "more.gguf", seed=2, layer_types=MORE_LAYER_TYPES))
    blocks = load_model(path, quantization="gguf")
    assert_dense_conversion_bitwise(blocks, load_model(path, dtype="float32", quantization="none"))
    linears = [m for m in blocks.model.modules() if isinstance(m, QuantLinear)]
    kinds = {p.kind for m in linears for p in m.parts}
    assert kinds >= {k for pair in MORE_LAYER_TYPES.values() for k in pair}
    assert all(len(m.dense) == 0 for m in linears)
    options = dict(target=path, quantization="gguf", max_context=256)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    expected = Engine.from_pretrained(method="none", **options).generate(prompt, params)
    spec = Engine.from_pretrained(method="ngram", num_speculative_tokens=4, **options)
    out = spec.generate(prompt, params)
    assert out.token_ids == expected.token_ids and out.stats.drafted > 0


def assert_dense_conversion_bitwise(blocks: LoadedModel, dense: LoadedModel) -> None:
    assert blocks.from_blocks and not dense.from_blocks
    assert isinstance(blocks.model.lm_head, QuantLinear)
    dense_params = dict(dense.model.named_parameters())
    checked = 0
    for name, module in blocks.model.named_modules():
        if isinstance(module, QuantLinear) and not name.endswith(".table"):
            assert torch.equal(module.weight, dense_params[f"{name}.weight"]), name
            if module.bias is not None:
                assert torch.equal(module.bias, dense_params[f"{name}.bias"]), name
            checked += 1
    assert checked == 1 + 4 * blocks.model.cfg.num_layers
    assert torch.equal(blocks.model.embed.weight, dense.model.embed.weight)
    for name, param in blocks.model.named_parameters():  # the norms
        assert torch.equal(param, dense_params[name]), name
    assert blocks.model.cfg == dense.model.cfg
    assert blocks.eos_token_ids == dense.eos_token_ids == (0,)


def test_logits_close_to_dense(pair: tuple[LoadedModel, LoadedModel]) -> None:
    """Activations are rounded to int8 per block (a step of max|x| / 127, ~0.7% RMS error
    a matmul, compounding over the layers): logits agree with the dense path's within 5%
    RMS of their own RMS, and on the argmax where the dense margin is clear."""
    tokens = torch.tensor([3, 17, 42, 7, 99, 250, 1, 64, 128, 5])
    logits = []
    for loaded in pair:
        runner = Runner(loaded.model, 64)
        first = runner.prefill(tokens[:6])  # [vocab]
        rest = runner.extend(tokens[6:])  # [4, vocab]
        logits.append(torch.cat([first[None], rest]))
    blocks, dense = logits  # [5, vocab] each
    error = (blocks - dense).norm() / dense.norm()
    print(f"relative RMS error {error:.4f}")
    assert error <= 0.05, error
    top2 = dense.topk(2).values
    clear = top2[:, 0] - top2[:, 1] > 0.1 * dense.std()
    assert clear.any()
    assert torch.equal(blocks.argmax(-1)[clear], dense.argmax(-1)[clear])


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_greedy_speculative_equals_plain(tiny_gguf: tuple[str, str], method: str) -> None:
    """From GGUF blocks the target's passes are unpadded (row-invariant kernels), and greedy
    speculative output is plain decoding's, bit for bit."""
    from understudy import Engine, SamplingParams

    target, draft = tiny_gguf
    options = dict(target=target, quantization="auto", max_context=256)
    plain = Engine.from_pretrained(method="none", **options)
    spec = Engine.from_pretrained(
        method=method, draft=draft if method == "draft" else None, num_speculative_tokens=4,
        **options,
    )  # fmt: skip
    assert not spec.runner.pad and spec.target.from_blocks
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    expected = plain.generate(prompt, params).token_ids
    out = spec.generate(prompt, params)
    assert out.token_ids == expected
    assert out.stats.target_passes < len(expected) or out.stats.acceptance_rate == 0.0
    assert out.stats.drafted > 0


def test_a_type_without_a_kernel_runs_dequantized_or_is_refused(tmp_path: Path) -> None:
    """A matrix of a type qgemm lacks (TQ1_0) runs dequantized under "auto", which says so
    once, and "gguf" refuses the file naming the tensor and its type."""
    from gguf_helpers import KERNEL_LAYER_TYPES

    path = write_tiny_qwen2_gguf(
        tmp_path / "tq.gguf", layer_types={**KERNEL_LAYER_TYPES, "attn_k": T.TQ1_0}
    )
    with pytest.raises(UnderstudyError, match=r"blk\.0\.attn_k\.weight: TQ1_0"):
        load_model(str(path), quantization="gguf")
    from understudy import Engine, SamplingParams

    assert load_model(str(path)).from_blocks
    plain = Engine.from_pretrained(method="none", target=str(path), max_context=256)
    spec = Engine.from_pretrained(
        method="ngram", target=str(path), max_context=256, num_speculative_tokens=3
    )
    assert all(layer.fused is None for layer in plain.target.model.layers)
    prompt = [3, 5, 7, 3, 5, 7, 3, 5]
    expected = plain.generate(prompt, SamplingParams(max_tokens=24, temperature=0)).token_ids
    got = spec.generate(prompt, SamplingParams(max_tokens=24, temperature=0)).token_ids
    assert got == expected


def test_quantization_is_chosen_and_refused_by_name(
    tiny_gguf: tuple[str, str], tiny_pair: tuple[str, str]
) -> None:
    from understudy import Engine

    target, draft = tiny_gguf
    assert load_model(target).from_blocks  # auto: a GGUF on a CPU
    assert not load_model(tiny_pair[0]).from_blocks  # auto: a Hugging Face directory
    with pytest.raises(UnderstudyError, match="not a GGUF"):
        load_model(tiny_pair[0], quantization="gguf")
    with pytest.raises(UnderstudyError, match="float32, not bfloat16"):
        load_model(target, dtype="bfloat16", quantization="gguf")
    with pytest.raises(
        UnderstudyError, match="projection has a F32 part, which qgemm has no kernel for"
    ) as err:
        load_model(target, quantization="gguf")  # a float32 part: no kernel, dequantized
    assert "cannot be used" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(UnderstudyError, match="unknown quantization 'q3'"):
        load_model(target, quantization="q3")
    with pytest.raises(UnderstudyError, match="draft runs from its GGUF blocks"):
        Engine.from_pretrained(
            target=target, draft=draft, quantization="auto", draft_quantization="int4",
            num_speculative_tokens=2,
        )  # fmt: skip
    with pytest.raises(UnderstudyError, match="q4_0' requantizes a draft model's GGUF blocks"):
        Engine.from_pretrained(
            target=tiny_pair[0], draft=tiny_pair[1], dtype="float32", draft_quantization="q4_0",
            num_speculative_tokens=2,
        )  # fmt: skip


def test_a_draft_requantized_to_q4_0_keeps_plain_decodings_output(
    tiny_gguf: tuple[str, str],
) -> None:
    """draft_quantization="q4_0" turns the draft's Q5_0 tensors into Q4_0 blocks (and
    nothing else); only its guesses change: greedy output is plain decoding's, bit for bit."""
    from gguf import GGMLQuantizationType as T

    from understudy import Engine, SamplingParams

    target, draft = tiny_gguf
    options = dict(target=target, draft=draft, quantization="auto", max_context=256)
    kept = Engine.from_pretrained(method="draft", draft_quantization="none", **options)
    requantized = Engine.from_pretrained(method="draft", draft_quantization="q4_0", **options)

    def kinds(engine: Engine) -> set[T]:
        model = engine.drafter.draft_runner().model
        return {p.kind for m in model.modules() if isinstance(m, QuantLinear) for p in m.parts}

    assert T.Q5_0 in kinds(kept) and T.Q4_0 not in kinds(kept)
    assert kinds(requantized) == (kinds(kept) - {T.Q5_0}) | {T.Q4_0}
    plain = Engine.from_pretrained(method="none", target=target, quantization="auto")
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    out = requantized.generate(prompt, params)
    assert out.token_ids == plain.generate(prompt, params).token_ids and out.stats.drafted > 0


REAL_DRAFT = "qwen2.5-coder-0.5b"


@pytest.mark.e2e
def test_real_draft_from_blocks() -> None:
    """The real 0.5B from its Q5_0/Q8_0/Q6_K/Q4_K blocks: logits close to the dense float32
    path's, and greedy self-speculation (n-gram guesses) equals plain decoding for 32 tokens."""
    from understudy import Engine, SamplingParams

    blocks = load_model(REAL_DRAFT, quantization="gguf")
    dense = load_model(REAL_DRAFT, dtype="float32", quantization="none")
    tokens = torch.tensor(blocks.tokenizer.encode("def fibonacci(n):\n    if n < 2:"))
    got, want = (Runner(m.model, 128).prefill(tokens) for m in (blocks, dense))  # [vocab]
    # int8 activations (as llama.cpp multiplies): seen 4% centred RMS error, TV 0.019
    assert (got - want).norm() <= 0.08 * (want - want.mean()).norm()
    assert got.topk(5).indices.tolist() == want.topk(5).indices.tolist()
    assert 0.5 * (got.softmax(-1) - want.softmax(-1)).abs().sum() <= 0.05
    del dense
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    prompt = "def fibonacci(n):"
    options = dict(target=REAL_DRAFT, quantization="gguf", max_context=512)
    expected = Engine.from_pretrained(method="none", **options).generate(prompt, params)
    spec = Engine.from_pretrained(method="ngram", num_speculative_tokens=4, **options)
    assert spec.generate(prompt, params).token_ids == expected.token_ids


def test_helpers_write_what_they_say(tmp_path: Path) -> None:
    """The tiny files hold the block types the tests rely on."""
    from gguf import GGUFReader

    def kinds(path: Path) -> set[str]:
        return {t.tensor_type.name for t in GGUFReader(path).tensors}

    mixed = write_tiny_qwen2_gguf(tmp_path / "t", layer_types=MIXED_LAYER_TYPES)
    assert {"Q4_K", "Q6_K", "Q8_0", "Q5_0", "F32"} <= kinds(mixed)
    more = write_tiny_qwen2_gguf(tmp_path / "m", layer_types=MORE_LAYER_TYPES)
    assert {k.name for kinds in MORE_LAYER_TYPES.values() for k in kinds} <= kinds(more)


def test_the_kept_layout_maps_the_tensors_gguf_reads(tmp_path: Path) -> None:
    """read_layout parses a file once and keeps its architecture and tensor table; from the
    kept table, mapped_tensors gives every tensor's data as gguf's reader does (same type,
    shape, dtype and bytes), without parsing the file again (a kept table naming another
    architecture is what a second read returns)."""
    import json

    import numpy as np
    from gguf import GGUFReader

    from understudy.models.gguf_file import LAYOUT_FILE, mapped_tensors, read_layout

    path = write_tiny_qwen2_gguf(tmp_path / "t.gguf")
    cache = tmp_path / "meta"
    layout = read_layout(path, cache)
    assert layout.architecture == "qwen2" and read_layout(path, cache) == layout
    mapped = mapped_tensors(path, layout)
    reader = GGUFReader(str(path))
    assert set(mapped) == {t.name for t in reader.tensors}
    for t in reader.tensors:
        m = mapped[t.name]
        assert m.tensor_type == t.tensor_type and m.shape == tuple(int(d) for d in t.shape)
        assert m.data.dtype == t.data.dtype and m.data.shape == t.data.shape, t.name
        assert np.array_equal(m.data.view(np.uint8), t.data.view(np.uint8)), t.name
    kept = json.loads((cache / LAYOUT_FILE).read_text())
    (cache / LAYOUT_FILE).write_text(json.dumps({**kept, "architecture": "elsewhere"}))
    assert read_layout(path, cache).architecture == "elsewhere"
