"""Train an EagleHead on cached target features (head/features.py): distillation.

For pair t (g_t, token t+1) the head predicts f^_{t+1} (g_t: f_t, or with feature layers the
fused outputs the shards keep as "kept", models/eagle_head.py). Two losses, both against the
target's own outputs, never against the corpus text:
  - classification: cross-entropy between the target's next-token distribution,
    softmax(lm(f_{t+1})), and the head's, softmax(lm(f^_{t+1})), both over the draft
    vocabulary (lm = the target's LM rows);
  - regression: smooth-L1 between f^_{t+1} and f_{t+1}, in units of the features' std.
Drafting feeds the head its own predictions, so training unrolls `unroll` steps (EAGLE-3's
training-time test): step s feeds the predictions of step s-1 as the features, and every
step is scored against the real features and distributions. Each step attends as drafting
does (EagleHead.sequence): to the real pairs before its chain and to its own chain, never
to the other positions' predicted pairs, a view drafting never gives it.

Two options for a head trained on little text (it overfits: one trained on 262k stdlib tokens
agreed with the target on ~0.75 of training positions and 0.50 held out):
  - `feature_noise`: uniform noise on the real input features (EAGLE's augmentation), so the
    head learns to read features that are not exactly the ones it saw; the targets stay clean;
  - `precision`: the matmuls run under bfloat16 autocast where the hardware multiplies bf16
    natively (1.65 s vs 3.0-3.3 s a step on a 2-core AVX512-BF16 CPU), so an hour buys more epochs.
    Held-out agreement (`evaluate`) is always measured in float32.

The metric that matters is `agree@s`: how often the head's argmax at step s equals the
target's argmax (the acceptance rate of greedy drafting at depth s, on held-out sequences).

Checkpoints (`checkpoint.pt`: head, optimizer, step, config) are written every
`checkpoint_every` steps and at the end of every epoch; `train` resumes from one if present.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from understudy.config import UnderstudyError
from understudy.head.shards import Rows
from understudy.models.eagle_head import EagleHead
from understudy.models.loader import cpu_has_native_bf16

CHECKPOINT = "checkpoint.pt"
PRECISIONS = ("auto", "float32", "bfloat16")


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = 6
    batch: int = 2  # sequences per step
    lr: float = 6e-4
    warmup: int = 50  # steps
    unroll: int = 2
    reg_weight: float = 1.0
    weight_decay: float = 0.0
    seed: int = 0
    checkpoint_every: int = 100
    # half-width of the uniform noise added to the real input features, in units of the
    # features' std (0 = off); the first unrolled step reads them, later steps read the
    # head's own predictions, which carry their own error. Off by default: 0.2 did not curb
    # overfitting (docs/eagle.md)
    feature_noise: float = 0.0
    precision: str = "auto"  # "auto" = bfloat16 where the hardware multiplies it natively

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise UnderstudyError(
                f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}"
            )
        if not self.feature_noise >= 0:
            raise UnderstudyError(f"feature_noise must be >= 0, got {self.feature_noise}")


def training_autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast for the training step when `precision` asks for it (or "auto" and the
    device multiplies bf16 natively); a no-op context otherwise."""
    if precision == "auto":
        native = cpu_has_native_bf16() if device.type == "cpu" else torch.cuda.is_bf16_supported()
        precision = "bfloat16" if native else "float32"
    if precision == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def choose_vocab(
    argmax: torch.Tensor, tokens: torch.Tensor, vocab_size: int, size: int
) -> torch.Tensor:
    """The `size` token ids the target predicts most often (ties: most frequent in the text),
    sorted ascending. argmax, tokens: any shape, int."""
    counts = torch.bincount(argmax.flatten().long(), minlength=vocab_size).double()
    counts += 1e-3 * torch.bincount(tokens.flatten().long(), minlength=vocab_size).double()
    return torch.topk(counts, min(size, vocab_size)).indices.sort().values


def _lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, total - cfg.warmup)
    return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def unrolled_losses(
    head: EagleHead,
    tokens: torch.Tensor,  # [B, T] int64
    features: torch.Tensor,  # [B, T, hidden] float32
    target_argmax: torch.Tensor,  # [B, T] int64 (target vocabulary ids)
    unroll: int,
    feature_scale: float,
    reg_weight: float,
    feature_noise: float = 0.0,
    kept: torch.Tensor | None = None,  # [B, T, F] float32: the feature layers' outputs
) -> tuple[torch.Tensor, list[float]]:
    """Total loss over `unroll` steps and the argmax agreement at each step. The head reads
    `kept` where it has feature layers, else the final features. `feature_noise` (see
    TrainConfig) perturbs the real input features only, never the targets."""
    # target at step s for input pair t: f_{t+s}, distribution of token t+s+1
    assert (kept is None) == (not head.cfg.feature_layers), "the head reads kept features"
    real_inputs = features if kept is None else kept
    inputs = head.input_features(real_inputs[:, :-1])  # [B, T-1, H] g_t
    if feature_noise > 0:
        noise = torch.rand_like(inputs).sub_(0.5).mul_(2 * feature_noise * feature_scale)
        inputs = inputs + noise  # [B, T-1, H]
    total = features.new_zeros(())
    agree = []
    vocab_index = torch.full((head.cfg.target_vocab_size,), -1, dtype=torch.long)
    vocab_index[head.vocab.cpu()] = torch.arange(head.vocab.shape[0])
    with torch.no_grad():  # the target's distributions of tokens 2..T, shared by all steps
        target_probs = torch.softmax(head.draft_logits(features[:, 1:]), dim=-1)  # [B, T-1, N]
    earlier = None  # the keys/values of the steps so far (EagleHead.sequence)
    for s in range(1, unroll + 1):
        t = features.shape[1] - s  # pairs with a target at this step
        if t <= 0:
            break
        predicted, earlier = head.sequence(tokens[:, s : s + t], inputs[:, :t], earlier)
        real = features[:, s : s + t]  # [B, t, H]
        logp = torch.log_softmax(head.draft_logits(predicted), dim=-1)  # [B, t, N]
        cls = -(target_probs[:, s - 1 : s - 1 + t] * logp).sum(-1).mean()
        reg = F.smooth_l1_loss(predicted / feature_scale, real / feature_scale)
        total = total + cls + reg_weight * reg
        want = vocab_index[target_argmax[:, s : s + t]]  # [B, t], -1 = outside the vocab
        agree.append(float((logp.argmax(-1) == want).float().mean()))
        inputs = predicted  # the next step sees the head's own predictions
    return total / unroll, agree


def batch_losses(
    head: EagleHead,
    data: Mapping[str, Rows],
    rows: torch.Tensor | slice,
    cfg: TrainConfig,
    feature_scale: float,
    feature_noise: float = 0.0,
) -> tuple[torch.Tensor, list[float]]:
    """`unrolled_losses` over the sequences `rows` of `data` (shards' tensors, any dtype; the
    feature layers' outputs read where the data holds them)."""
    kept = data.get("kept")
    return unrolled_losses(
        head,
        data["tokens"][rows].long(),
        data["features"][rows].float(),
        data["argmax"][rows].long(),
        cfg.unroll,
        feature_scale,
        cfg.reg_weight,
        feature_noise,
        None if kept is None else kept[rows].float(),
    )


@torch.no_grad()
def evaluate(
    head: EagleHead, data: Mapping[str, Rows], cfg: TrainConfig, feature_scale: float
) -> list[float]:
    """Mean argmax agreement per unrolled step on `data` (held-out sequences)."""
    sums: list[float] = []
    n = data["tokens"].shape[0]
    for i in range(n):
        _, agree = batch_losses(head, data, slice(i, i + 1), cfg, feature_scale)
        sums = [a + b for a, b in zip(sums, agree, strict=True)] if sums else agree
    return [s / max(1, n) for s in sums]


@dataclass
class Progress:
    """How far training has come: optimizer steps, held-out agreement per epoch, seconds."""

    step: int = 0
    history: list[dict[str, object]] = field(default_factory=list)
    seconds: float = 0.0


def resume(
    head: EagleHead,
    optimizer: torch.optim.Optimizer,
    cfg: TrainConfig,
    path: Path,
    run: dict[str, object] | None = None,
) -> Progress:
    """The progress of the checkpoint at `path` (head and optimizer restored) where it was
    written under the same config and for the same `run` (what else makes a run itself: its
    text's size and the head it started from, so that a run over more text, or from
    another head, starts afresh rather than continue a finished one); a fresh start
    otherwise."""
    if not path.exists():
        return Progress()
    saved = torch.load(path, weights_only=False)
    if saved["config"] != asdict(cfg) or saved.get("run", {}) != (run or {}):
        return Progress()
    head.load_state_dict(saved["head"])
    optimizer.load_state_dict(saved["optimizer"])
    return Progress(saved["step"], saved["history"], saved["seconds"])


def save_checkpoint(
    head: EagleHead,
    optimizer: torch.optim.Optimizer,
    cfg: TrainConfig,
    done: Progress,
    path: Path,
    run: dict[str, object] | None = None,
) -> None:
    """Write the checkpoint whole or not at all (a temporary file, renamed)."""
    state = {
        "head": head.state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": done.step,
        "history": done.history,
        "seconds": done.seconds,
        "config": asdict(cfg),
        "run": run or {},
    }
    torch.save(state, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").rename(path)


def optimizer_step(
    head: EagleHead,
    optimizer: torch.optim.Optimizer,
    batch: dict[str, torch.Tensor],  # the rows of train_data this step trains on (and "kept")
    cfg: TrainConfig,
    feature_scale: float,
) -> tuple[float, list[float]]:
    """One optimizer step on `batch`: its loss and per-step agreement."""
    params = [p for p in head.parameters() if p.requires_grad]
    with training_autocast(cfg.precision, head.fc.weight.device):
        loss, agree = batch_losses(head, batch, slice(None), cfg, feature_scale, cfg.feature_noise)
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    return loss.item(), agree


def train(
    head: EagleHead,
    train_data: Mapping[str, Rows],
    val_data: Mapping[str, Rows],
    cfg: TrainConfig,
    folder: Path,
    progress: bool = True,
    start: str = "fresh",
) -> dict[str, object]:
    """Train `head` in place; returns the facts worth keeping (config, losses, agreement).
    Resumes from the folder's checkpoint, written every cfg.checkpoint_every steps, where it
    is of this run: the same config, as many training sequences, the same `start` (the
    --init head's folder, or "fresh")."""
    torch.manual_seed(cfg.seed)
    folder.mkdir(parents=True, exist_ok=True)
    n = train_data["tokens"].shape[0]
    steps_per_epoch = max(1, n // cfg.batch)
    total_steps = steps_per_epoch * cfg.epochs
    feature_scale = float(train_data["features"][: min(n, 8)].float().std())
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    checkpoint = folder / CHECKPOINT
    run: dict[str, object] = {"sequences": n, "start": start}
    done = resume(head, optimizer, cfg, checkpoint, run)
    history = done.history
    head.train()
    bar = tqdm(
        total=total_steps, initial=done.step, unit="step", desc="train head", disable=not progress
    )
    while done.step < total_steps:
        epoch, offset = divmod(done.step, steps_per_epoch)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed + epoch))
        rows = order[offset * cfg.batch : (offset + 1) * cfg.batch]
        batch = {
            key: train_data[key][rows]
            for key in ("tokens", "features", "argmax", "kept")
            if key in train_data
        }
        t0 = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(done.step, total_steps, cfg)
        loss, agree = optimizer_step(head, optimizer, batch, cfg, feature_scale)
        done.seconds += time.perf_counter() - t0
        done.step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", agree1=f"{agree[0]:.2f}")
        end_of_epoch = done.step % steps_per_epoch == 0
        if end_of_epoch:
            head.eval()
            val = evaluate(head, val_data, cfg, feature_scale)
            head.train()
            history.append(
                {"epoch": done.step // steps_per_epoch, "step": done.step, "val_agree": val}
            )
            bar.write(f"epoch {done.step // steps_per_epoch}: held-out agreement per step {val}")
        if end_of_epoch or done.step % cfg.checkpoint_every == 0:
            save_checkpoint(head, optimizer, cfg, done, checkpoint, run)
    bar.close()
    head.eval()
    spent = done.seconds
    return {
        "train": asdict(cfg),
        "train_sequences": n,
        "train_tokens": n * train_data["tokens"].shape[1],
        "train_seconds": round(spent, 1),
        "feature_scale": feature_scale,
        "history": history,
        "val_agree": history[-1]["val_agree"]
        if history
        else evaluate(head, val_data, cfg, feature_scale),
    }
