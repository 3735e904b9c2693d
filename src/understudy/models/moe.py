"""Feed-forward blocks: the gated MLP, and a sparse mixture of such MLPs (Mixtral, Qwen3-MoE).

MLP: down(act(gate(x)) * up(x)), gate and up fused into one matmul (`w_gate_up`, gate rows
first: the layout of Phi-3's `gate_up_proj`, and of transformers' fused expert weights).

SparseMoE (Shazeer et al. 2017; Jiang et al. 2024, Mixtral): a router scores the experts,
each row keeps its top-k, and the row's output is the weighted sum of those experts' MLPs.
Routing is transformers' own: softmax over all experts in float32, top-k, then (when the
model asks) renormalised over the k kept. Invariant: a row's output depends on that row
alone. The router is a row-wise linear, and each row's experts run on that row by itself
(a 1-row call per expert, in increasing expert order, summed from zero as transformers
sums its experts), so no matmul ever sees how many rows a pass holds or which experts the
other rows chose. Grouping the rows of an expert into one call would be faster but would
make a row's result depend on the others (a matmul's result depends on its row count).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

Expert = Callable[[torch.Tensor], torch.Tensor]  # [1, hidden] -> [1, hidden]
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
}


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, activation: str) -> None:
        super().__init__()
        self.inter = intermediate
        self.act = ACTIVATIONS[activation]
        self.w_gate_up = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.w_down = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [R, hidden] -> [R, hidden]
        gate, up = self.w_gate_up(x).split(self.inter, dim=-1)
        return self.w_down(self.act(gate) * up)


class SparseMoE(nn.Module):
    def __init__(
        self,
        hidden: int,
        intermediate: int,
        activation: str,
        experts: int,
        top_k: int,
        normalize: bool,
        weights_in_float32: bool,
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.normalize = normalize  # renormalise the kept k weights to sum to one
        # Mixtral scales each expert's output by its float32 weight; Qwen3-MoE first casts
        # the weights to the model's dtype (the same in float32, not in bfloat16)
        self.weights_in_float32 = weights_in_float32
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(MLP(hidden, intermediate, activation) for _ in range(experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [R, k], expert ids [R, k]) of each row, as transformers routes."""
        logits = self.router(x)  # [R, E]
        probs = torch.softmax(logits.float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # [R, k]
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.weights_in_float32:
            weights = weights.to(logits.dtype)
        return weights, chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [R, hidden] -> [R, hidden]
        return self.mix(x, list(self.experts))

    def mix(self, x: torch.Tensor, experts: Sequence[Expert]) -> torch.Tensor:
        """The routed sum of `experts` (this mixture's MLPs, or kernels computing them:
        models/fused.py) over rows x [R, hidden] -> [R, hidden], one 1-row call each."""
        weights, chosen = self.route(x)
        order = chosen.argsort(dim=-1)  # each row's experts in increasing id
        chosen = chosen.gather(1, order).tolist()
        weights = weights.gather(1, order)
        rows = []
        for r in range(x.shape[0]):
            row = x[r : r + 1]  # [1, hidden]
            out = torch.zeros_like(row)
            for j, e in enumerate(chosen[r]):
                y = experts[e](row) * weights[r, j]
                out = out + y.to(out.dtype)
            rows.append(out)
        return torch.cat(rows)
