"""kernels/rowgemm: correct, and row-invariant by construction (a row's bits never depend on
how many rows share the call or what they hold), where torch's own CPU matmul is not."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from understudy.kernels import rowgemm
from understudy.kernels.build import compile_shared
from understudy.kernels.rowgemm import FLAGS, SOURCE, RowInvariantLinear

pytestmark = pytest.mark.skipif(not rowgemm.available(), reason="no C compiler here")

SHAPES = [(37, 100), (48, 64), (300, 1536), (2050, 257)]  # [out, in]; out not a multiple of 16


@pytest.mark.parametrize("out_features, in_features", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_matches_torch_linear(out_features, in_features, bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    fast = RowInvariantLinear(linear)
    x = torch.randn(21, in_features)
    torch.testing.assert_close(fast(x), F.linear(x, linear.weight, linear.bias))
    assert torch.equal(fast.weight, linear.weight.detach())
    index = torch.tensor([0, out_features // 2, out_features - 1])
    assert torch.equal(fast.weight_rows(index), linear.weight.detach()[index])


@pytest.mark.parametrize("out_features, in_features", SHAPES)
def test_a_row_is_bitwise_the_same_in_any_call(out_features, in_features):
    """Row r scored in calls of 1..40 rows (past the 16-row register group), among random
    companions, always gives the same bits as row r scored alone."""
    torch.manual_seed(1)
    linear = torch.nn.Linear(in_features, out_features)
    fast = RowInvariantLinear(linear)
    rows = torch.randn(40, in_features)
    alone = torch.stack([fast(rows[r : r + 1])[0] for r in range(40)])  # [40, out]
    for m in range(1, 41):
        assert torch.equal(fast(rows[:m]), alone[:m]), f"a call of {m} rows differs"
        shuffled = torch.cat([torch.randn(3, in_features), rows[m - 1 : m]])
        assert torch.equal(fast(shuffled)[3], alone[m - 1])


def test_torch_linear_is_not_row_invariant():
    """The mutation the kernel exists for: torch's own CPU matmul changes a row's bits with
    the number of rows in the call, so the test above would fail on F.linear."""
    torch.manual_seed(1)
    weight = torch.randn(2048, 1536) / 40
    rows = torch.randn(16, 1536)
    alone = F.linear(rows[:1], weight)[0]
    assert any(not torch.equal(F.linear(rows[:m], weight)[0], alone) for m in range(2, 17))


def test_a_broken_compiler_means_no_kernel(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "/bin/false")
    assert compile_shared(SOURCE, tmp_path, FLAGS) is None
    assert list(tmp_path.glob("*.so")) == []
