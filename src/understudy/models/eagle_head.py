"""A small network on the target's own hidden states that guesses the target's next tokens
(EAGLE, Li et al. 2024): the drafter of method="eagle".

Vocabulary: f_t is the target's final hidden state at position t (after its last norm, the
input of its LM head), so lm_head(f_t) are the target's logits for token t+1. The head maps
the pair (g_t, token t+1) to a prediction of f_{t+1}, whose logits guess token t+2:

    g_t = f_t, or with feature layers (EAGLE-3, Li et al. 2025) the target's residual stream
          after a low, a middle and a high layer, each normed, side by side, through `fuse`:
          fuse([tap_norm_i(h_t^(l_i))])                             [R, hidden]
    x   = fc([emb_norm(embed(token_{t+1})), feat_norm(g_t)])       [R, hidden]
    x   = one decoder block (causal attention over earlier pairs)   [R, hidden]
    f^  = norm(x)                                                   [R, hidden]
    q   = lm(f^)   over a reduced draft vocabulary of N token ids   [R, N]

`lm` holds rows of the target's own LM head (frozen, not saved: rebuilt from the target at
load) for the N token ids the target predicts most often (`vocab`), which cuts the head's
largest cost. To draft several tokens the head feeds its own f^ back as the next g (EAGLE-3's
training-time test teaches it to read both kinds). `input_features` makes g from what the
target's runner keeps (models/runner.py `last_hidden`: f, or the feature layers' outputs).

The block is models/transformer.py's Block (the same attention and MLP code as the target),
with its own slot-indexed KV cache of pairs: pair p (feature of position p, token p + 1)
sits at slot p and rotary position p. Invariant: the cache holds valid pairs for positions
0..length-1; `truncate` rolls back by position arithmetic, like Runner.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from understudy.models.transformer import Block, RMSNorm, Transformer, TransformerConfig

WEIGHTS_FILE = "head.safetensors"
CONFIG_FILE = "config.json"
KeysValues = tuple[torch.Tensor, torch.Tensor]  # one step's keys, values [kv_heads, n, head_dim]


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    draft_vocab_size: int  # N: rows of the target's LM head the head scores
    target_vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    attention_bias: bool = True
    # the target layers whose outputs are the head's features, ascending (() = the target's
    # final hidden state); see default_feature_layers
    feature_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        layers = tuple(int(i) for i in self.feature_layers)  # a JSON list comes back as list
        object.__setattr__(self, "feature_layers", layers)
        if list(layers) != sorted(set(layers)) or any(i < 0 for i in layers):
            raise ValueError(f"feature_layers must be ascending layer indices, got {layers}")

    @property
    def feature_size(self) -> int:
        """Width of what the head reads from the target a position (Runner.last_hidden)."""
        return self.hidden_size * max(1, len(self.feature_layers))

    @classmethod
    def for_target(
        cls,
        target: TransformerConfig,
        intermediate: int,
        draft_vocab: int,
        feature_layers: tuple[int, ...] = (),
    ) -> HeadConfig:
        if feature_layers and feature_layers[-1] >= target.num_layers:
            raise ValueError(
                f"feature layer {feature_layers[-1]} past the target's {target.num_layers}"
            )
        return cls(
            hidden_size=target.hidden_size,
            intermediate_size=intermediate,
            num_heads=target.num_heads,
            num_kv_heads=target.num_kv_heads,
            head_dim=target.head_dim,
            draft_vocab_size=min(draft_vocab, target.vocab_size),
            target_vocab_size=target.vocab_size,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
            attention_bias=target.attention_bias,
            feature_layers=feature_layers,
        )

    def block_config(self) -> TransformerConfig:
        return TransformerConfig(
            vocab_size=self.target_vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=1,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            attention_bias=self.attention_bias,
        )


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low, middle and high layers of a target of `num_layers`: the second, the one
    before the middle, and the last (whose output, normed, is f itself: `fuse` starts as
    that alone, so training starts from the final-feature head and adds the others)."""
    return tuple(sorted({min(1, num_layers - 1), max(0, num_layers // 2 - 1), num_layers - 1}))


class EagleHead(nn.Module):
    """See the module docstring. `embed` is the target's token embedding (shared, frozen)."""

    vocab: torch.Tensor  # a buffer, registered in __init__

    def __init__(self, cfg: HeadConfig, embed: nn.Embedding) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.embed = [embed]  # a list: the target's module, not a submodule of the head
        taps = len(cfg.feature_layers)
        if taps:  # EAGLE-3 features: each layer's output normed, then fused
            self.tap_norms = nn.ModuleList(RMSNorm(h, cfg.rms_norm_eps) for _ in range(taps))
            self.fuse = nn.Linear(taps * h, h, bias=False)
            with torch.no_grad():  # start as the last tap alone (default_feature_layers)
                self.fuse.weight.zero_()
                self.fuse.weight[:, (taps - 1) * h :].copy_(torch.eye(h))
        self.emb_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.feat_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.block = Block(cfg.block_config())
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.lm.weight.requires_grad_(False)
        self.register_buffer("vocab", torch.arange(cfg.draft_vocab_size))  # [N] target ids
        exponents = torch.arange(0, cfg.head_dim, 2, dtype=torch.float32)
        self.inv_freq = 1.0 / (cfg.rope_theta ** (exponents / cfg.head_dim))  # [D/2]
        self.k_cache: torch.Tensor | None = None  # [kv_heads, S, head_dim]
        self.v_cache: torch.Tensor | None = None
        self.length = 0

    # -- the network -----------------------------------------------------------------------

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None]  # [R, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [R, D]
        dtype = self.norm.weight.dtype
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def input_features(self, kept: torch.Tensor) -> torch.Tensor:
        """What the target's runner kept [..., feature_size] -> the head's g [..., hidden]."""
        if not self.cfg.feature_layers:
            return kept
        h = self.cfg.hidden_size
        parts = [norm(kept[..., i * h : (i + 1) * h]) for i, norm in enumerate(self.tap_norms)]
        return self.fuse(torch.cat(parts, dim=-1))

    def step(
        self,
        tokens: torch.Tensor,  # [R] token t+1 of each pair
        features: torch.Tensor,  # [R, hidden] g_t of each pair
        positions: torch.Tensor,  # [R]
        slots: torch.Tensor,  # [R]
        mask: torch.Tensor,  # [R, L]
        k_cache: torch.Tensor,  # [kv_heads, S, head_dim]
        v_cache: torch.Tensor,  # [kv_heads, S, head_dim]
    ) -> torch.Tensor:
        """Predicted next features f^ [R, hidden]; writes the pairs' keys/values to `slots`."""
        with torch.no_grad():  # the target's embedding is frozen
            emb = self.embed[0](tokens).to(features.dtype)  # [R, hidden]
        x = self.fc(torch.cat([self.emb_norm(emb), self.feat_norm(features)], dim=-1))
        cos, sin = self.rotary(positions)
        block = self.block
        x = x + block.attn(block.attn_norm(x), cos, sin, slots, mask, k_cache, v_cache)
        x = x + block.mlp(block.mlp_norm(x))
        return self.norm(x)

    def draft_logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """[R, hidden] predicted features -> [R, N] float32 logits over the draft vocabulary."""
        return self.lm(predicted).float()

    def sequence(
        self,
        tokens: torch.Tensor,  # [B, t]
        features: torch.Tensor,  # [B, t, hidden]
        earlier: list[list[KeysValues]] | None = None,
    ) -> tuple[torch.Tensor, list[list[KeysValues]]]:
        """Training: drafting step s over whole sequences, as drafting sees it (EAGLE-3's
        training-time test). `earlier[b]`: the keys/values of steps 1..s-1 of sequence b
        (None: this is step 1). Returns the predicted features [B, t, hidden] and `earlier`
        with this step's keys/values appended.

        Pair i of step 1 is (f_i, token i+1) at position i; pair i of step s > 1 is (step
        s-1's prediction at pair i, token i+s) at position i+s-1. Like a drafting round
        after the real pairs 0..i, it attends to step 1's pairs 0..i (real features) and to
        pair i of each step 2..s (its own chain), nothing else."""
        b, t = tokens.shape
        cfg = self.cfg
        earlier = earlier if earlier is not None else [[] for _ in range(b)]
        steps = len(earlier[0]) + 1
        i = torch.arange(t, device=tokens.device)  # [t]
        sizes = [k.shape[1] for k, _ in earlier[0]] + [t]  # pairs of each step so far
        blocks = [
            (j[None] <= i[:, None]) if step == 0 else (j[None] == i[:, None])  # [t, size]
            for step, j in enumerate(torch.arange(n, device=tokens.device) for n in sizes)
        ]
        mask = torch.cat(blocks, dim=1)  # [t, L]
        slots = sum(sizes[:-1]) + i  # [t] this step's slots, after the earlier steps'
        out = []
        for row in range(b):
            dtype = earlier[row][0][0].dtype if earlier[row] else features.dtype
            fresh = features.new_zeros((cfg.num_kv_heads, t, cfg.head_dim), dtype=dtype)
            k_cache = torch.cat([*(k for k, _ in earlier[row]), fresh], dim=1)  # [Hkv, L, D]
            v_cache = torch.cat([*(v for _, v in earlier[row]), fresh], dim=1)  # [Hkv, L, D]
            out.append(
                self.step(tokens[row], features[row], i + steps - 1, slots, mask, k_cache, v_cache)
            )
            earlier[row] = [*earlier[row], (k_cache[:, -t:], v_cache[:, -t:])]
        return torch.stack(out), earlier

    # -- inference: a KV cache of pairs ------------------------------------------------------

    def allocate_cache(self, slots: int) -> None:
        cfg, weight = self.cfg, self.norm.weight
        if self.k_cache is None or self.k_cache.shape[1] != slots:
            shape = (cfg.num_kv_heads, slots, cfg.head_dim)
            self.k_cache = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
            self.v_cache = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
        self.length = 0

    def truncate(self, length: int) -> None:
        assert 0 <= length <= self.length, (length, self.length)
        self.length = length

    @torch.inference_mode()
    def extend(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """Feed pairs (features [n, hidden], tokens [n]) at positions length..length+n-1;
        return the predicted next features [n, hidden]."""
        assert self.k_cache is not None and self.v_cache is not None, "allocate_cache first"
        n, start = tokens.shape[0], self.length
        assert start + n <= self.k_cache.shape[1], "the head's cache is full"
        device = self.norm.weight.device
        positions = torch.arange(start, start + n, device=device)
        mask = torch.arange(start + n, device=device)[None, :] <= positions[:, None]  # [n, L]
        out = self.step(
            tokens.to(device),
            features.to(device, self.norm.weight.dtype),
            positions,
            positions,
            mask,
            self.k_cache,
            self.v_cache,
        )
        self.length = start + n
        return out

    @torch.inference_mode()
    def tree_step(
        self,
        tokens: torch.Tensor,  # [e] tree nodes
        features: torch.Tensor,  # [e, hidden] each node's parent's predicted feature
        base: int,
        depths: torch.Tensor,  # [e] their depths (the root, tokens[-1], is depth 0)
        offsets: torch.Tensor,  # [e] their slots relative to base
        visible: torch.Tensor,  # [e, span] bool: which slots base + j each node sees
    ) -> torch.Tensor:
        """Feed tree nodes as pairs (their parent's feature, their token) in one step; return
        their predicted next features [e, hidden]. The root's pair sits at slot and position
        `base` (the newest real pair); a node of depth d is written to slot base + offset at
        position base + d and attends to the real pairs before base and to the slots it sees
        (its ancestors and itself). `length` is unchanged: the nodes sit past it."""
        assert self.k_cache is not None and self.v_cache is not None, "allocate_cache first"
        e, span = visible.shape
        assert base + span <= self.k_cache.shape[1], "the head's cache is full"
        device = self.norm.weight.device
        mask = torch.zeros(e, base + span, dtype=torch.bool, device=device)  # [e, L]
        mask[:, :base] = True
        mask[:, base:] = visible.to(device)
        return self.step(
            tokens.to(device),
            features.to(device, self.norm.weight.dtype),
            base + depths.to(device),
            base + offsets.to(device),
            mask,
            self.k_cache,
            self.v_cache,
        )


# -- files ---------------------------------------------------------------------------------


def lm_rows(target: Transformer, vocab: torch.Tensor) -> torch.Tensor:
    """The target LM head's rows for token ids `vocab` [N] -> [N, hidden] (a copy)."""
    rows_of = getattr(target.lm_head, "weight_rows", None)  # row-invariant: no full copy
    if rows_of is not None:
        return rows_of(vocab)
    weight = target.lm_head.weight  # a dense copy when the target's linears are packed
    return weight.detach()[vocab.to(weight.device)].clone()


def save_head(head: EagleHead, folder: Path, meta: dict[str, object]) -> None:
    """Write head.safetensors (the trained weights and the vocabulary; not the LM rows, which
    are the target's) and config.json (the HeadConfig and `meta`: training facts)."""
    folder.mkdir(parents=True, exist_ok=True)
    state = {
        k: v.detach().contiguous().cpu() for k, v in head.state_dict().items() if k != "lm.weight"
    }
    save_file(state, str(folder / WEIGHTS_FILE))
    payload = {"head": asdict(head.cfg), "meta": meta}
    (folder / CONFIG_FILE).write_text(json.dumps(payload, indent=2) + "\n")


def read_head_config(folder: Path) -> tuple[HeadConfig, dict[str, object]]:
    payload = json.loads((folder / CONFIG_FILE).read_text())
    return HeadConfig(**payload["head"]), dict(payload.get("meta", {}))


def load_head(folder: Path, target: Transformer) -> EagleHead:
    """Load a trained head for `target` (its embedding and LM rows are taken from it)."""
    cfg, _ = read_head_config(folder)
    head = EagleHead(cfg, target.embed)
    state = load_file(str(folder / WEIGHTS_FILE))
    missing, unexpected = head.load_state_dict(state, strict=False)
    assert set(missing) == {"lm.weight"} and not unexpected, (missing, unexpected)
    head.lm.weight.data = lm_rows(target, head.vocab)
    return head.to(device=target.device, dtype=target.dtype).eval()
