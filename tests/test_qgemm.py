"""kernels/qgemm.c: products against gguf's reference dequantizers, and row invariance.

Weights are random valid blocks (random bytes, finite float16 scales written where each
format keeps them). References are float64 matmuls with gguf's own dequantized weights.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize

from understudy.kernels import qgemm
from understudy.kernels.build import compile_shared

pytestmark = pytest.mark.skipif(not qgemm.available(), reason="qgemm cannot be built here")

T = GGMLQuantizationType
SCALE_OFFSETS = {T.Q4_K: (0, 2), T.Q6_K: (208,), T.Q8_0: (0,), T.Q5_0: (0,), T.Q4_0: (0,)}


def random_blocks(kind: GGMLQuantizationType, rows: int, cols: int, seed: int) -> qgemm.GGUFTensor:
    """[rows, cols] of random blocks of `kind`: random quant bytes, finite f16 scales."""
    block, size = GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for offset in SCALE_OFFSETS[kind]:
        scales = (rng.standard_normal((rows, cols // block)) * 0.01).astype(np.float16)
        data[:, :, offset : offset + 2] = scales.view(np.uint8).reshape(rows, cols // block, 2)
    return qgemm.GGUFTensor(kind, data.reshape(rows, -1), rows, cols)


def quantized_activations(x: np.ndarray, block: int) -> np.ndarray:
    """What qgemm.c multiplies with: each row's blocks as int8 times their float scale."""
    xb = x.astype(np.float32).reshape(x.shape[0], -1, block)
    amax = np.abs(xb).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.clip(np.rint(xb * inv), -127, 127)
    return (q * (amax / np.float32(127))).reshape(x.shape).astype(np.float64)


CASES = [(T.Q4_K, 256), (T.Q6_K, 256), (T.Q8_0, 32), (T.Q5_0, 32), (T.Q4_0, 32)]


@pytest.mark.parametrize(("kind", "block"), CASES, ids=[c[0].name for c in CASES])
def test_product_matches_reference(kind: GGMLQuantizationType, block: int) -> None:
    """Against W (gguf's dequantizer) in float64: with the activations as the kernel
    quantizes them, within float32 rounding (1e-5 of the sum of |terms|); with the raw
    activations, within the activation rounding's bound (half a step a value:
    sum |w| * scale / 2)."""
    cols, rows, m = 3 * block * (2 if block == 32 else 1), 40, 5
    weight = random_blocks(kind, rows, cols, seed=1)
    w = dequantize(weight.data, kind).astype(np.float64)  # [rows, cols]
    x = np.random.default_rng(2).standard_normal((m, cols)).astype(np.float32)
    bias = torch.randn(rows)
    y = qgemm.QuantLinear([weight], bias)(torch.from_numpy(x)).double().numpy()  # [m, rows]
    xq = quantized_activations(x, block)
    exact = xq @ w.T + bias.double().numpy()
    scale = np.abs(xq) @ np.abs(w).T + 1e-30
    assert np.all(np.abs(y - exact) <= 1e-5 * scale), np.abs(y - exact).max()
    steps = np.abs(x).reshape(m, -1, block).max(-1) / 127  # [m, blocks]
    bound = (np.repeat(steps, block, axis=1) / 2) @ np.abs(w).T
    assert np.all(np.abs(y - (x.astype(np.float64) @ w.T + bias.double().numpy())) <= bound)
    # the kernel really uses the weights: another block's bytes change the result
    other = random_blocks(kind, rows, cols, seed=3)
    assert not torch.equal(
        qgemm.QuantLinear([other], bias)(torch.from_numpy(x)), torch.from_numpy(y).float()
    )


@pytest.mark.parametrize(("kind", "block"), CASES, ids=[c[0].name for c in CASES])
def test_the_largest_quants_against_full_scale_activations_stay_exact(
    kind: GGMLQuantizationType, block: int
) -> None:
    """Every quant at its extreme (Q4_K 15, Q6_K 63, Q5_0 31, Q4_0 15, Q8_0 -128) against activations
    of +-127 everywhere: the most any partial integer sum holds (the AVX2 path sums up to 16
    products in int16 before widening). An overflow or a saturation would be far off the
    float64 product."""
    cols, rows = 2 * 256, 16
    weight = random_blocks(kind, rows, cols, seed=6)
    blocks = weight.data.reshape(rows, cols // block, -1)
    blocks[:, :, 2 if kind in (T.Q8_0, T.Q4_0) else 4 if kind == T.Q5_0 else 0 :] = (
        0x80 if kind == T.Q8_0 else 0xFF
    )
    if kind == T.Q4_K:
        blocks[:, :, 4:16] = 0xFF  # sub-block scales and mins 63: the largest products
    for offset in SCALE_OFFSETS[kind]:
        blocks[:, :, offset : offset + 2] = np.array([0.01], dtype=np.float16).view(np.uint8)
    w = dequantize(weight.data, kind).astype(np.float64)  # [rows, cols]
    x = np.ones((2, cols), dtype=np.float32)
    x[1] = -1.0
    y = qgemm.QuantLinear([weight], None)(torch.from_numpy(x)).double().numpy()  # [2, rows]
    exact = x.astype(np.float64) @ w.T
    assert np.all(np.abs(y - exact) <= 1e-5 * (np.abs(x) @ np.abs(w).T)), np.abs(y - exact).max()


@pytest.mark.parametrize(("kind", "block"), CASES, ids=[c[0].name for c in CASES])
def test_weight_rows_are_the_reference_dequantization(
    kind: GGMLQuantizationType, block: int
) -> None:
    weight = random_blocks(kind, 24, 2 * 256, seed=4)
    linear = qgemm.QuantLinear([weight], None)
    index = torch.tensor([5, 0, 23, 5])
    expected = torch.from_numpy(dequantize(weight.data[index.numpy()], kind))
    assert torch.equal(linear.weight_rows(index), expected)


def test_rows_are_bitwise_independent_of_call_size_and_threads() -> None:
    """Every row of a call of 1..40 rows equals that row computed alone, bitwise, with 1 and
    2 threads; parts of all five kernel types and one dequantized (F32) part."""
    cols = 512
    parts = [random_blocks(k, 24 + 8 * i, cols, seed=10 + i) for i, (k, _) in enumerate(CASES)]
    f32 = np.random.default_rng(9).standard_normal((16, cols)).astype(np.float32)
    parts.append(qgemm.GGUFTensor(T.F32, f32, 16, cols))
    out = sum(p.rows for p in parts)
    linear = qgemm.QuantLinear(parts, torch.randn(out))
    x = torch.randn(40, cols) * torch.logspace(-3, 2, 40)[:, None]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([linear(x[i : i + 1]) for i in range(40)])  # [40, out]
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            for m in (1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 17, 25, 31, 32, 33, 40):
                assert torch.equal(linear(x[:m]), alone[:m]), (n_threads, m)
            assert torch.equal(linear(x.flip(0)), alone.flip(0)), n_threads
    finally:
        torch.set_num_threads(threads)


PORTABLE_BUILDS = {
    "scalar": ("-O2", "-march=x86-64", "-fopenmp", "-ffp-contract=off"),
    "avx2": ("-O3", "-march=haswell", "-fopenmp", "-ffp-contract=off"),
}
# row counts that reach every path of the vector kernels: one group of rows sharing each
# decoded block (1-8 rows: accumulators in registers, or in L1 from 5 rows), groups side by
# side (9-32: AVX-512 splits them into 2-4 groups of 4-8, AVX2 into groups of 8), and a
# second tile of rows (33-40)
ROW_COUNTS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 16, 17, 25, 31, 32, 33, 40)


def every_row_count(lib: ctypes.CDLL, kind: GGMLQuantizationType, block: int) -> list[torch.Tensor]:
    """`lib`'s products (it packs the weights itself: a build's panel layout is its own) for
    calls of each of ROW_COUNTS rows: 3 blocks a row (an odd count of 32-value blocks), 40
    columns in 3 panels, the last one partial, and a bias; rows of magnitudes 1e-2 .. 10."""
    cols = 3 * 256 + (block if block == 32 else 0)
    weight = random_blocks(kind, 40, cols, seed=20)
    linear = qgemm.QuantLinear([weight], torch.linspace(-1.0, 1.0, 40), lib=lib)
    rows = torch.randn(40, cols, generator=torch.Generator().manual_seed(21))
    xs = rows * torch.logspace(-2, 1, 40)[:, None]
    return [linear(xs[:m]) for m in ROW_COUNTS]


@pytest.mark.parametrize("build", sorted(PORTABLE_BUILDS))
def test_every_instruction_set_gives_the_same_bits(build: str) -> None:
    """The portable C path and the AVX2 path compute the same integers and float steps as
    the path this CPU runs (AVX-512 where it has it): same bits, for every kernel type and
    every way a call's rows are grouped (ROW_COUNTS)."""
    other = qgemm.load(PORTABLE_BUILDS[build])
    native = qgemm.load()
    assert native is not None
    if other is None or other.understudy_qgemm_simd() == native.understudy_qgemm_simd():
        pytest.skip(f"no {build} build here, or it is what this CPU runs already")
    for kind, block in CASES:
        theirs, ours = every_row_count(other, kind, block), every_row_count(native, kind, block)
        for m, a, b in zip(ROW_COUNTS, theirs, ours, strict=True):
            assert torch.equal(a, b), (kind.name, m)


# Float steps of the AVX-512 Q4_K block in another order (qgemm_avx512.h's text: each
# mutation names the lines it replaces): what the comparison above must catch
FLOAT_ORDER_MUTATIONS = {
    "mins term before the block's sum": (
        "        f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(s, d), f[r]);\n"
        "        f[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(jsum), _mm512_mul_ps(s, dmin), f[r]);\n",
        "        f[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(jsum), _mm512_mul_ps(s, dmin), f[r]);\n"
        "        f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(s, d), f[r]);\n",
    ),
    "mins term rounded before it is taken off": (
        "        f[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(jsum), _mm512_mul_ps(s, dmin), f[r]);\n",
        "        f[r] = _mm512_sub_ps(f[r], _mm512_mul_ps(_mm512_cvtepi32_ps(jsum),\n"
        "                                                 _mm512_mul_ps(s, dmin)));\n",
    ),
}


@pytest.mark.parametrize("mutation", sorted(FLOAT_ORDER_MUTATIONS))
def test_a_different_float_order_fails_the_comparison(mutation: str, tmp_path: Path) -> None:
    """The comparison across instruction sets has the power to see the order of the float
    steps: an AVX-512 build whose Q4_K blocks take theirs in another order (the same
    integers, the same operations) gives other bits than the portable build, which the
    unchanged build matches (test_every_instruction_set_gives_the_same_bits)."""
    native, scalar = qgemm.load(), qgemm.load(PORTABLE_BUILDS["scalar"])
    if native is None or native.understudy_qgemm_simd() != 2 or scalar is None:
        pytest.skip("no AVX-512 build or no portable build here")
    for source in [qgemm.SOURCE, *qgemm.SOURCE.parent.glob("*.h")]:  # what it may include
        (tmp_path / source.name).write_text(source.read_text())
    header = tmp_path / "qgemm_avx512.h"
    before, after = FLOAT_ORDER_MUTATIONS[mutation]
    assert header.read_text().count(before) == 1, "the mutation's lines are not in the kernel"
    header.write_text(header.read_text().replace(before, after))
    built = compile_shared(tmp_path / "qgemm.c", tmp_path / "build")
    mutant = None if built is None else qgemm.bind(built)
    assert mutant is not None, "the mutated kernel did not build"
    theirs = every_row_count(scalar, T.Q4_K, 256)
    mutated = every_row_count(mutant, T.Q4_K, 256)
    assert not any(torch.equal(a, b) for a, b in zip(theirs, mutated, strict=True))


def test_refuses_shapes_it_cannot_take() -> None:
    weight = random_blocks(T.Q4_K, 8, 256, seed=5)
    bad = qgemm.GGUFTensor(
        T.Q4_K, np.ascontiguousarray(weight.data[:, :100]), 8, 256
    )  # rows cut short
    with pytest.raises(AssertionError, match="refused"):
        qgemm.QuantLinear([bad], None)(torch.randn(1, 256))


@pytest.mark.parametrize("build", sorted(PORTABLE_BUILDS))
def test_every_instruction_set_quantizes_edge_rows_alike(build: str) -> None:
    """The activation quantizer's corners give the same bits on every path: an all-zero row,
    exact .5 ties, a subnormal block maximum (its 127 / max overflows), values near the float
    limit, and a row with an infinity (NaN out, alike)."""
    other = qgemm.load(PORTABLE_BUILDS[build])
    native = qgemm.load()
    assert native is not None
    if other is None or other.understudy_qgemm_simd() == native.understudy_qgemm_simd():
        pytest.skip(f"no {build} build here, or it is what this CPU runs already")
    cols = 512
    rows = np.zeros((6, cols), dtype=np.float32)
    rows[1, 0], rows[1, 1:40] = 127, np.arange(39) + 0.5
    rows[2, ::7] = 1e-40
    rows[3, 0::2], rows[3, 1::2] = 3e38, -3e38
    rows[4] = np.random.default_rng(0).standard_normal(cols) * 1e-38
    rows[5] = np.random.default_rng(1).standard_normal(cols)
    rows[5, 5] = np.inf
    x = torch.from_numpy(rows)
    for kind, _ in CASES:
        weight = random_blocks(kind, 16, cols, seed=30)
        vector = qgemm.QuantLinear([weight], None)(x)
        theirs = qgemm.QuantLinear([weight], None, lib=other)(x)
        torch.testing.assert_close(theirs, vector, rtol=0, atol=0, equal_nan=True)


def test_a_packed_memory_map_stays_readable_after_its_pages_are_released(tmp_path) -> None:
    """After packing, a memory-mapped tensor's pages are dropped (madvise) but its bytes stay
    readable: weight_rows still dequantizes the file's rows, and the product equals that of
    the same blocks held in the process's own memory."""
    weight = random_blocks(T.Q4_K, 48, 4096, seed=40)
    path = tmp_path / "blocks.bin"
    weight.data.tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r", shape=weight.data.shape)
    from_file = qgemm.QuantLinear([qgemm.GGUFTensor(T.Q4_K, mapped, 48, 4096)], None)
    in_memory = qgemm.QuantLinear([weight], None)
    x = torch.randn(3, 4096)
    assert torch.equal(from_file(x), in_memory(x))
    index = torch.tensor([47, 0, 13])
    expected = torch.from_numpy(dequantize(weight.data[index.numpy()], T.Q4_K))
    assert torch.equal(from_file.weight_rows(index), expected)


def test_panels_pad_a_partial_last_panel_without_writing_past_it() -> None:
    """Out features that do not fill the last 16-column panel: the columns past the tensor
    are never written (a sentinel beside them survives) and the ones inside are right."""
    weight = random_blocks(T.Q8_0, 21, 64, seed=41)
    linear = qgemm.QuantLinear([weight, random_blocks(T.Q5_0, 5, 64, seed=42)], None)
    x = torch.randn(2, 64)
    y = linear(x)
    alone = qgemm.QuantLinear([weight], None)(x)
    assert torch.equal(y[:, :21], alone)


def parts_call(
    lib, linears: list[qgemm.QuantLinear], firsts: list[int], x, ldy: int, threads: int = 0
):
    """understudy_qgemm_parts over each linear's one part, into y [M, ldy] filled with a
    sentinel: (return code, y)."""
    n = len(linears)
    calls = [linear.kernel_calls[0] for linear in linears]  # (kind, packed, bias, at, rows)
    y = torch.full((x.shape[0], ldy), 7.5)
    code = lib.understudy_qgemm_parts(
        n, (ctypes.c_int * n)(*[c[0] for c in calls]), (ctypes.c_void_p * n)(*[c[1] for c in calls]),
        (ctypes.c_void_p * n)(*[c[2] or None for c in calls]), (ctypes.c_long * n)(*firsts),
        (ctypes.c_long * n)(*[c[4] for c in calls]), x.data_ptr(), y.data_ptr(), ldy, x.shape[0],
        x.shape[1], threads or torch.get_num_threads(),
    )  # fmt: skip
    return code, y


def test_parts_in_one_call_have_the_bits_of_each_part_alone() -> None:
    """One call over parts of all four types (one quantization per block size, the panels of
    all parts shared over the threads): each part's columns are bitwise those of a call of
    its own, with its bias, for 1..11 rows on 1 and 2 threads; columns between and after
    the parts are never written."""
    lib = qgemm.load()
    shapes = [(T.Q4_K, 21), (T.Q8_0, 5), (T.Q6_K, 200), (T.Q5_0, 17)]
    linears = [
        qgemm.QuantLinear([random_blocks(kind, rows, 512, seed=60 + i)], torch.randn(rows))
        for i, (kind, rows) in enumerate(shapes)
    ]
    firsts, at = [], 0
    for _, rows in shapes:
        firsts.append(at)
        at += rows + 3  # a gap of 3 columns after each part
    x = torch.randn(11, 512) * torch.logspace(-2, 1, 11)[:, None]
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            for m in (1, 3, 4, 5, 8, 11):
                code, y = parts_call(lib, linears, firsts, x[:m], at)
                assert code == 0
                written = torch.zeros(at, dtype=torch.bool)
                for linear, first, (kind, rows) in zip(linears, firsts, shapes, strict=True):
                    alone = linear(x[:m])
                    assert torch.equal(y[:, first : first + rows], alone), (kind.name, m)
                    written[first : first + rows] = True
                assert (y[:, ~written] == 7.5).all(), m
    finally:
        torch.set_num_threads(threads)
    too_many = [linears[0]] * 5
    assert parts_call(lib, too_many, [0] * 5, x[:1], at)[0] == -1
    assert parts_call(lib, linears[:1], [at - 10], x[:1], at)[0] == -1  # past ldy


TEAM_OF_ONE = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from test_qgemm import T, parts_call, qgemm, random_blocks
lib = qgemm.load()
linears = [qgemm.QuantLinear([random_blocks(T.Q4_K, 100, 512, seed=70)], None),
           qgemm.QuantLinear([random_blocks(T.Q6_K, 60, 512, seed=71)], None)]
x = torch.randn(3, 512)
code, y = parts_call(lib, linears, [0, 100], x, 160, threads=2)
assert code == 0, code
alone = torch.cat([linear(x) for linear in linears], dim=1)
print("same" if torch.equal(y, alone) else "differs")
"""


def test_panels_of_a_thread_that_never_started_are_taken_by_the_others() -> None:
    """A one-tile call gives each of its `threads` a run of panels and lets a thread done
    with its own take the rest of the others'. With OpenMP limited to one thread, a call
    asking for two gets a team of one: that thread must take both runs, every column."""
    env = dict(os.environ, OMP_THREAD_LIMIT="1")
    here = str(Path(__file__).parent)
    done = subprocess.run(
        [sys.executable, "-c", TEAM_OF_ONE, here], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "same", done.stdout


@pytest.mark.parametrize("kind", [T.Q5_0, T.Q8_0], ids=["Q5_0", "Q8_0"])
def test_requantized_q4_0_is_gguf_reference_quantizer_bitwise(kind: GGMLQuantizationType) -> None:
    """understudy_requant_q4_0 (draft_quantization="q4_0") gives bitwise the blocks gguf's
    reference quantizer makes of the values gguf dequantizes: scales of every magnitude
    (float16 subnormals among them), all-zero blocks, ties of largest magnitude."""
    from gguf import quantize

    from understudy.models.requantize import requantized

    weight = random_blocks(kind, 48, 512, seed=30)
    blocks = weight.data.reshape(48, 16, -1)
    rng = np.random.default_rng(31)
    scales = (rng.standard_normal((48, 16)) * np.logspace(-7, 1, 16)).astype(np.float16)
    blocks[:, :, 0:2] = scales.view(np.uint8).reshape(48, 16, 2)
    blocks[0, :, 2:] = 0 if kind == T.Q8_0 else blocks[0, :, 2:]  # all-zero Q8_0 blocks
    blocks[1, :, 0:2] = 0  # d = 0: every value zero
    expected = quantize(dequantize(weight.data, kind).reshape(48, 512), T.Q4_0)
    lib = qgemm.load()
    got = np.empty_like(expected)
    data = weight.data
    code = lib.understudy_requant_q4_0(
        int(kind), data.ctypes.data, data.shape[1], 512, 48, got.ctypes.data, 2
    )
    assert code == 0 and np.array_equal(got, expected)
    if kind == T.Q5_0:  # the type draft_quantization="q4_0" requantizes
        part = requantized(weight, lib)
        assert part.kind == T.Q4_0 and np.array_equal(part.data, expected)
    assert requantized(weight, lib).kind == (T.Q4_0 if kind == T.Q5_0 else kind)
