"""kernels/span_attention.c: decode rows' attention against a float64 reference (with Gemma
2's soft cap too), row invariance (a row's bits alone and among others, on 1 and 2 threads),
the portable and AVX2 builds' bits against this CPU's path, its refusal of rows that do not
see one run of keys, and of heads whose size is not a multiple of its lanes."""

from __future__ import annotations

import pytest
import torch

from understudy.kernels import span_attention as kernel

pytestmark = pytest.mark.skipif(not kernel.available(), reason="span_attention cannot be built")

OTHER_BUILDS = {
    "portable": ("-O3", "-march=x86-64", "-fopenmp", "-ffp-contract=off"),  # no AVX at all
    "avx2": ("-O3", "-march=haswell", "-fopenmp", "-ffp-contract=off"),
}


def case(rows: int, heads: int, kv_heads: int, dim: int, length: int, per_row: bool, seed: int):
    """q [H, R, D] (a transposed view, as the model hands it), keys/values [B, Hkv, L, D] and
    a mask [R, L] giving row r the run of keys lo_r..hi_r-1 (a chain's, a window's)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, heads, dim, generator=gen).transpose(0, 1)
    batch = rows if per_row else 1
    keys = torch.randn(batch, kv_heads, length, dim, generator=gen) * 2
    values = torch.randn(batch, kv_heads, length, dim, generator=gen)
    mask = torch.zeros(rows, length, dtype=torch.bool)
    for r in range(rows):
        hi = length - rows + r + 1
        lo = max(0, hi - 7) if r % 3 == 2 else 0  # some rows see a window
        mask[r, lo:hi] = True
    return q, keys, values, mask


def reference(q, keys, values, mask, scale: float, softcap: float | None = None) -> torch.Tensor:
    """float64 softmax attention of each row over the keys it sees -> [R, H, D], each
    scaled score capped to softcap * tanh(s / softcap) when given."""
    heads, rows, _ = q.shape
    group = heads // keys.shape[1]
    out = torch.empty(rows, heads, q.shape[-1], dtype=torch.float64)
    for r in range(rows):
        b = r if keys.shape[0] > 1 else 0
        seen = mask[r]
        for h in range(heads):
            k = keys[b, h // group][seen].double()
            v = values[b, h // group][seen].double()
            s = k @ q[h, r].double() * scale
            w = torch.softmax(s if softcap is None else torch.tanh(s / softcap) * softcap, dim=0)
            out[r, h] = w @ v
    return out


@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(12, 2, 128), (14, 2, 64), (4, 4, 80)])
def test_matches_a_float64_reference(heads: int, kv_heads: int, dim: int, per_row: bool) -> None:
    q, keys, values, mask = case(9, heads, kv_heads, dim, 37, per_row, seed=heads + dim)
    got = kernel.span_attention(q, keys, values, mask, dim**-0.5)
    assert got is not None
    want = reference(q, keys, values, mask, dim**-0.5)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5), (
        (got.double() - want).abs().max()
    )


@pytest.mark.parametrize("threads", [1, 2, 8])
def test_a_row_has_the_same_bits_alone_and_among_others(threads: int) -> None:
    """The invariant the engine's exactness rests on: a row's output does not depend on the
    other rows of the call, their number, or the thread split (with 8 threads a row alone
    splits each kv head's 6 query heads over several threads; 16 rows keep them together)."""
    q, keys, values, mask = case(16, 12, 2, 128, 300, per_row=False, seed=3)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = kernel.span_attention(q, keys, values, mask, 0.088)
        assert together is not None
        for r in range(16):
            alone = kernel.span_attention(q[:, r : r + 1], keys, values, mask[r : r + 1], 0.088)
            assert alone is not None and torch.equal(alone[0], together[r]), r
        for first, last in ((0, 5), (5, 16)):  # other companions, other splits
            part = kernel.span_attention(q[:, first:last], keys, values, mask[first:last], 0.088)
            assert part is not None and torch.equal(part, together[first:last])
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("build", sorted(OTHER_BUILDS))
def test_every_instruction_set_gives_the_same_bits(build: str) -> None:
    """The AVX-512 and AVX2 paths compute the portable C path's sums in its order: same bits,
    for rows with fewer than 4 keys left over and feature sizes that are not a multiple of 64."""
    library = kernel.load(OTHER_BUILDS[build])
    if library is None or kernel.load() is None:
        pytest.skip(f"no {build} build here")
    for heads, kv_heads, dim, length in ((12, 2, 128, 301), (14, 2, 64, 30), (4, 4, 80, 19)):
        q, keys, values, mask = case(6, heads, kv_heads, dim, length, per_row=False, seed=dim)
        native = kernel.span_attention(q, keys, values, mask, dim**-0.5)
        other = kernel.span_attention(q, keys, values, mask, dim**-0.5, lib=library)
        assert native is not None and other is not None
        assert torch.equal(native, other), (heads, dim, (native - other).abs().max())


def test_refuses_rows_that_do_not_see_one_run() -> None:
    q, keys, values, mask = case(3, 4, 2, 64, 12, per_row=False, seed=1)
    mask[1, 2] = False  # a hole: a tree node's ancestors, not gathered
    assert kernel.span_attention(q, keys, values, mask, 0.125) is None
    mask[1] = False  # nothing visible at all
    assert kernel.span_attention(q, keys, values, mask, 0.125) is None


@pytest.mark.parametrize("per_row", [False, True])
def test_soft_capped_scores_match_a_float64_reference(per_row: bool) -> None:
    """Scores up to ~+-6 against a cap of 2 (most saturate, some in tanh's small-argument
    series): the kernel is the capped reference's within float rounding, and far from the
    uncapped one (the test would catch a cap not applied)."""
    q, keys, values, mask = case(9, 8, 2, 64, 40, per_row, seed=5)
    got = kernel.span_attention(q, keys, values, mask, 0.125, softcap=2.0)
    assert got is not None
    want = reference(q, keys, values, mask, 0.125, softcap=2.0)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5), (
        (got.double() - want).abs().max()
    )
    uncapped = reference(q, keys, values, mask, 0.125)
    assert (uncapped - want).abs().max() > 1e-2
    assert torch.equal(
        kernel.span_attention(q[:, 3:4], keys[3:4] if per_row else keys, values[3:4] if per_row
                              else values, mask[3:4], 0.125, softcap=2.0)[0],
        got[3],
    )  # fmt: skip


def test_names_the_heads_it_cannot_take() -> None:
    assert kernel.refusal(14, 2, 64) is None
    assert "head size 8" in kernel.refusal(4, 2, 8)
    assert "do not split" in kernel.refusal(6, 4, 64)
