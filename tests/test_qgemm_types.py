"""kernels/qgemm.c's block types beyond test_qgemm's five (Q5_K, Q3_K, IQ4_XS, Q2_K, IQ4_NL,
Q4_1, Q5_1) and its 2-byte float types (F16, BF16): products against gguf's own dequantizer
on blocks of every scale magnitude, row invariance, and the same bits on every instruction
set.

Blocks: random quant bytes; float16 scales from subnormal to ~100 of either sign; all-zero
blocks; and the bytes that pack the integer sub-block scales (and mins) set, block by
block, to one bit each (so every bit of every packed field is seen alone) or all ones.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize
from torch import nn

from test_qgemm import PORTABLE_BUILDS, quantized_activations
from understudy.kernels import qgemm, rowgemm

pytestmark = pytest.mark.skipif(not qgemm.available(), reason="qgemm cannot be built here")

T = GGMLQuantizationType
# where each format keeps its float16 scales: d, then dmin (Q4_1, Q5_1: m) where it has one
HALVES = {
    T.Q5_K: (0, 2),
    T.Q3_K: (108,),
    T.IQ4_XS: (0,),
    T.Q2_K: (80, 82),
    T.IQ4_NL: (0,),
    T.Q4_1: (0, 2),
    T.Q5_1: (0, 2),
}
# the bytes that pack the integer sub-block scales and mins
SCALE_BYTES = {T.Q5_K: (4, 16), T.Q3_K: (96, 108), T.IQ4_XS: (2, 8), T.Q2_K: (0, 16)}
# the bytes of the quants
QUANT_BYTES = {
    T.Q5_K: (16, 176),
    T.Q3_K: (0, 96),
    T.IQ4_XS: (8, 136),
    T.Q2_K: (16, 80),
    T.IQ4_NL: (2, 18),
    T.Q4_1: (4, 20),
    T.Q5_1: (4, 24),
}
BLOCK_TYPES = list(HALVES)
FLOAT_TYPES = [T.F16, T.BF16]


def varied_blocks(kind: GGMLQuantizationType, rows: int, cols: int, seed: int) -> qgemm.GGUFTensor:
    """[rows, cols] of blocks of `kind` as the module docstring says: row r % 4 == 1 has its
    packed scale bytes at one bit (bit b % 8 in block b), r % 4 == 2 at all ones, and block 0
    of each row r % 4 == 3 is all zero."""
    block, size = GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed)
    nb = cols // block
    data = rng.integers(0, 256, size=(rows, nb, size), dtype=np.uint8)
    for offset in HALVES[kind]:
        magnitude = 10.0 ** rng.uniform(-7.5, 2, (rows, nb))  # float16's subnormals to 100
        halves = (magnitude * rng.choice([-1.0, 1.0], (rows, nb))).astype(np.float16)
        data[:, :, offset : offset + 2] = halves.view(np.uint8).reshape(rows, nb, 2)
    if kind in SCALE_BYTES:
        lo, hi = SCALE_BYTES[kind]
        one_bit = (1 << (np.arange(nb) % 8)).astype(np.uint8)  # [nb]
        data[1::4, :, lo:hi] = one_bit[None, :, None]
        data[2::4, :, lo:hi] = 0xFF
    data[3::4, 0, :] = 0
    return qgemm.GGUFTensor(kind, data.reshape(rows, -1), rows, cols)


def float_weights(kind: GGMLQuantizationType, rows: int, cols: int, seed: int) -> qgemm.GGUFTensor:
    """[rows, cols] 2-byte floats of magnitudes 1e-6..1e2 (float16's subnormals among them),
    as gguf's reader holds them (F16: float16 [rows, cols]; BF16: its bytes)."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((rows, cols)) * 10.0 ** rng.uniform(-6, 2, (rows, cols))
    if kind == T.F16:
        return qgemm.GGUFTensor(kind, values.astype(np.float16), rows, cols)
    top = (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return qgemm.GGUFTensor(kind, top.view(np.uint8).reshape(rows, 2 * cols), rows, cols)


def term_magnitudes(weight: qgemm.GGUFTensor) -> np.ndarray:
    """|d sc v| + |dmin mn| of every weight [rows, cols] (float64), each term from gguf's
    dequantizer with the other scale zeroed: the size of what the kernel's float steps
    round (a value can be small where its two terms are large)."""
    kind = weight.kind
    offsets = HALVES[kind]
    blocks = weight.data.reshape(weight.rows, -1, GGML_QUANT_SIZES[kind][1])
    total = np.zeros((weight.rows, weight.cols))
    for keep in offsets:
        part = blocks.copy()
        for offset in offsets:
            if offset != keep:
                part[:, :, offset : offset + 2] = 0
        total += np.abs(dequantize(part.reshape(weight.rows, -1), kind).astype(np.float64))
    return total


ROWS_X = np.random.default_rng(2).standard_normal((5, 768)) * np.logspace(-3, 3, 5)[:, None]


@pytest.mark.parametrize("kind", BLOCK_TYPES, ids=[k.name for k in BLOCK_TYPES])
def test_product_matches_gguf_dequantizer(kind: GGMLQuantizationType) -> None:
    """y = x W^T + bias against W from gguf's dequantizer and x as the kernel quantizes it,
    in float64: within 1e-5 of the size of the terms the float steps round (the integers
    are exact; a block's float step rounds three times, the accumulator once a block)."""
    cols, rows = 768, 40
    block = GGML_QUANT_SIZES[kind][0]
    weight = varied_blocks(kind, rows, cols, seed=1)
    w = dequantize(weight.data, kind).astype(np.float64)  # [rows, cols]
    assert np.isfinite(w).all() and (w[3::4, :block] == 0).all()
    x = ROWS_X.astype(np.float32)
    bias = torch.randn(rows)
    y = qgemm.QuantLinear([weight], bias)(torch.from_numpy(x)).double().numpy()  # [5, rows]
    xq = quantized_activations(x, 256 if block == 256 else 32)
    exact = xq @ w.T + bias.double().numpy()
    size = np.abs(xq) @ term_magnitudes(weight).T + np.abs(bias.double().numpy()) + 1e-30
    error = np.abs(y - exact) / size
    assert error.max() <= 1e-5, error.max()
    # the weights matter: other blocks give other products
    other = varied_blocks(kind, rows, cols, seed=3)
    assert not torch.equal(
        qgemm.QuantLinear([other], bias)(torch.from_numpy(x)), torch.from_numpy(y).float()
    )


@pytest.mark.parametrize("kind", BLOCK_TYPES, ids=[k.name for k in BLOCK_TYPES])
@pytest.mark.parametrize("fill", [0x00, 0xFF])
def test_extreme_quants_against_full_scale_activations_stay_exact(
    kind: GGMLQuantizationType, fill: int
) -> None:
    """Every quant and packed scale byte at 0 or at all ones (the largest codes, IQ4's -127
    and 113, Q3_K's scale -32 and value -4) against activations of +-127 everywhere: the
    most any partial integer sum holds (the AVX2 path adds products in int16 while they
    fit). An overflow or a saturation would be far off the float64 product."""
    cols, rows = 512, 16
    weight = varied_blocks(kind, rows, cols, seed=6)
    blocks = weight.data.reshape(rows, cols // GGML_QUANT_SIZES[kind][0], -1)
    lo, hi = QUANT_BYTES[kind]
    blocks[:, :, lo:hi] = fill
    if kind in SCALE_BYTES:
        lo, hi = SCALE_BYTES[kind]
        blocks[:, :, lo:hi] = fill
    for offset in HALVES[kind]:
        blocks[:, :, offset : offset + 2] = np.array([0.01], dtype=np.float16).view(np.uint8)
    w = dequantize(weight.data, kind).astype(np.float64)  # [rows, cols]
    x = np.ones((2, cols), dtype=np.float32)
    x[1] = -1.0
    y = qgemm.QuantLinear([weight], None)(torch.from_numpy(x)).double().numpy()  # [2, rows]
    exact = x.astype(np.float64) @ w.T
    size = np.abs(x) @ term_magnitudes(weight).T
    assert np.all(np.abs(y - exact) <= 1e-5 * size), np.abs(y - exact).max()


@pytest.mark.parametrize("kind", FLOAT_TYPES, ids=[k.name for k in FLOAT_TYPES])
def test_float_weights_give_rowgemms_bits(kind: GGMLQuantizationType) -> None:
    """F16 and BF16 run as one fused multiply-add chain per output over the inputs in order:
    bitwise rowgemm's product on the weights converted to float32 (the same chain), for
    1..11 rows; the conversion is gguf's, and the chain is within its rounding of float64."""
    cols, rows = 200, 37  # no block size: any K, a partial last panel
    weight = float_weights(kind, rows, cols, seed=7)
    w = dequantize(weight.data, kind).astype(np.float32).reshape(rows, cols)
    bias = torch.randn(rows)
    dense = nn.Linear(cols, rows)
    dense.weight.data, dense.bias.data = torch.from_numpy(w.copy()), bias.clone()
    reference = rowgemm.RowInvariantLinear(dense)
    linear = qgemm.QuantLinear([weight], bias)
    x = torch.from_numpy(ROWS_X[:, :cols].astype(np.float32)).repeat(3, 1)[:11]
    for m in (1, 2, 6, 7, 11):
        assert torch.equal(linear(x[:m]), reference(x[:m])), m
    x64, w64, b64 = x.double().numpy(), w.astype(np.float64), bias.double().numpy()
    size = np.abs(x64) @ np.abs(w64.T) + np.abs(b64)
    assert np.all(
        np.abs(linear(x).double().numpy() - (x64 @ w64.T + b64)) <= cols * 2.0**-23 * size
    )
    index = torch.tensor([36, 0, 5])
    assert torch.equal(linear.weight_rows(index), torch.from_numpy(w[index.numpy()]))


@pytest.mark.parametrize("kind", BLOCK_TYPES, ids=[k.name for k in BLOCK_TYPES])
def test_weight_rows_are_gguf_dequantization_bitwise(kind: GGMLQuantizationType) -> None:
    weight = varied_blocks(kind, 24, 512, seed=4)
    index = torch.tensor([5, 0, 23, 5, 2, 3])
    expected = torch.from_numpy(dequantize(weight.data[index.numpy()], kind))
    assert torch.equal(qgemm.QuantLinear([weight], None).weight_rows(index), expected)


def all_types(cols: int, seed: int) -> list[qgemm.GGUFTensor]:
    parts = [varied_blocks(k, 16 + 8 * i, cols, seed + i) for i, k in enumerate(BLOCK_TYPES)]
    return parts + [float_weights(k, 21, cols, seed + 20 + i) for i, k in enumerate(FLOAT_TYPES)]


def test_rows_are_bitwise_independent_of_call_size_and_threads() -> None:
    """Every row of a call of 1..40 rows equals that row computed alone, bitwise, with 1 and
    2 threads, for every type here (parts of one QuantLinear) and in one kernel call of
    four parts (understudy_qgemm_parts, as the fused layers call it)."""
    cols = 512
    parts = all_types(cols, seed=10)
    out = sum(p.rows for p in parts)
    linear = qgemm.QuantLinear(parts, torch.randn(out))
    x = torch.randn(40, cols) * torch.logspace(-3, 2, 40)[:, None]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([linear(x[i : i + 1]) for i in range(40)])  # [40, out]
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            for m in (1, 2, 3, 5, 7, 8, 9, 16, 31, 32, 33, 40):
                assert torch.equal(linear(x[:m]), alone[:m]), (n_threads, m)
            assert torch.equal(linear(x.flip(0)), alone.flip(0)), n_threads
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("build", sorted(PORTABLE_BUILDS))
def test_every_instruction_set_gives_the_same_bits(build: str) -> None:
    """The portable C path and the AVX2 path give the bits of the path this CPU runs, for
    every type here, 1..11 rows, an odd count of 32-value blocks; each build packs for
    itself."""
    other = qgemm.load(PORTABLE_BUILDS[build])
    native = qgemm.load()
    assert native is not None
    if other is None or other.understudy_qgemm_simd() == native.understudy_qgemm_simd():
        pytest.skip(f"no {build} build here, or it is what this CPU runs already")
    for cols in (512, 544):
        for weight in all_types(cols, seed=20):
            if cols % GGML_QUANT_SIZES[weight.kind][0]:
                continue
            linear = qgemm.QuantLinear([weight], torch.randn(weight.rows))
            theirs = qgemm.QuantLinear([weight], linear.bias, lib=other)
            xs = torch.randn(11, cols) * torch.logspace(-2, 1, 11)[:, None]
            for m in (1, 3, 8, 11):
                assert torch.equal(theirs(xs[:m]), linear(xs[:m])), (weight.kind.name, cols, m)


@pytest.mark.parametrize(
    "kind", sorted(qgemm.KERNEL_TYPES - set(FLOAT_TYPES), key=int), ids=lambda k: k.name
)
def test_panels_hold_the_files_bytes(kind: GGMLQuantizationType) -> None:
    """A one-row pass streams the panels, so repacking adds no byte: 16 columns' panel-block
    is 16 of the file's blocks (6-bit scales stay 6 bits), on every instruction set's
    build."""
    block, size = GGML_QUANT_SIZES[kind]
    for build in sorted(PORTABLE_BUILDS) + ["native"]:
        lib = qgemm.load() if build == "native" else qgemm.load(PORTABLE_BUILDS[build])
        assert lib is not None
        assert lib.understudy_qpack_bytes(int(kind), 4 * block, 32) == 32 * 4 * size, build
