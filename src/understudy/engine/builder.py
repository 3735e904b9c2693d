"""Build an Engine from user-facing names: resolve models, check compatibility, pick drafter.

Everything slow (fetching, converting, packing) happens here, never in the first generate().
"""

from __future__ import annotations

import time
import warnings

import torch

from understudy.config import UnderstudyError
from understudy.drafters import DRAFTERS
from understudy.engine.engine import Engine
from understudy.kernels import rowgemm
from understudy.models.loader import LoadedModel, cpu_has_native_bf16, load_model
from understudy.models.packed import PACK_FROM_ROWS, can_pack, pack_linears
from understudy.models.quant import SCHEMES, load_or_quantize
from understudy.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET
from understudy.models.runner import Runner
from understudy.models.transformer import Transformer
from understudy.verify.token_tree import TokenTree

METHODS = ("none", *DRAFTERS)


ROW_INVARIANT_ROWS = 16  # most rows of an unpadded pass (K <= 15) unless told otherwise


def row_invariant_kernels(model: Transformer) -> bool:
    """Whether the target runs row-invariant kernels (kernels/rowgemm.py): float32 on a CPU
    where the kernel could be built. Then passes are not padded at all: plain decoding scores
    one row, verification K+1, and a row's logits are bitwise the same either way."""
    return model.device.type == "cpu" and model.dtype == torch.float32 and rowgemm.available()


def target_pass_shape(model: Transformer) -> tuple[int, bool]:
    """(rows, pad) of the target's passes by default: (16, False) with row-invariant kernels,
    else (the hardware's padded budget, True)."""
    if row_invariant_kernels(model):
        return ROW_INVARIANT_ROWS, False
    return default_verify_rows(model.dtype, model.device), True


def install_row_invariant_kernels(model: Transformer, rows: int) -> None:
    """Swap the target's linears for rowgemm and score each row of a pass of up to `rows`
    rows in its own attention call (models/transformer.py), so no op of a decode pass
    depends on how many rows it holds. Idempotent."""
    rowgemm.use_row_invariant_linears(model)
    for layer in model.layers:
        layer.attn.rows_apart_upto = max(layer.attn.rows_apart_upto, rows)


def default_verify_rows(dtype: torch.dtype, device: torch.device) -> int:
    """Rows per padded target pass (every decode pass, plain included, has exactly this
    many) where row-invariant kernels are not available (CUDA, bfloat16, no C compiler).

    Chosen by measurement (README, "Identical output by construction";
    scripts/row_budget.py): where matmuls are flat in rows (CUDA, CPUs with native bf16) a
    wide budget is nearly free. On a CPU without native bf16 (fp32, linears prepacked for
    oneDNN from 4 rows on) a 1.5B pass costs ~270 ms at 3 rows and ~320 ms at 6, and 6 rows
    gave the fastest draft and n-gram decoding (8 rows: no faster).
    """
    if device.type == "cuda" or (dtype == torch.bfloat16 and cpu_has_native_bf16()):
        return 16
    return 6


def prepare_target_kernels(model: Transformer, rows: int) -> None:
    """Pack the target's linears for oneDNN when its passes hold >= 4 rows on a CPU (from 4
    rows on, F.linear repacks every weight on every call; models/packed.py)."""
    if rows >= PACK_FROM_ROWS and can_pack(model.device, model.dtype):
        pack_linears(model, rows)


DEFAULT_CPU_DRAFT_QUANTIZATION = "int4-g32"  # measured fastest on this CPU: docs/quantized-draft.md


def resolve_draft_quantization(value: str | None, draft: LoadedModel) -> str | None:
    """ "auto" -> int4 (group 32) on a CPU, none on CUDA (torch's packed kernels are CPU ones).
    `draft`: the model whose device decides (the draft, or the target it shares one with)."""
    if value in (None, "none"):
        return None
    if value == "auto":
        return DEFAULT_CPU_DRAFT_QUANTIZATION if draft.model.device.type == "cpu" else None
    if value not in SCHEMES:
        raise UnderstudyError(
            f"draft_quantization must be auto, none or one of {', '.join(SCHEMES)}; got {value!r}"
        )
    return value


def quantize_own_drafter(proposer: object, value: str | None, target: LoadedModel) -> None:
    """`draft_quantization` for a drafter that holds its own network (method="eagle": the
    head), on the target's device: "auto" is int4 (group 32) on a CPU, as for a draft model."""
    quantize = getattr(proposer, "quantize", None)
    scheme = resolve_draft_quantization(value, target)
    if quantize is not None and scheme is not None:
        quantize(scheme)


# Timings use a typical request's key window (prompt + budget ~ 500 slots), not the engine's
# whole max_context: attention over thousands of empty slots would inflate the target's pass.
MEASURE_SPAN = 480


def best_extend_seconds(
    runner: Runner, context: torch.Tensor, tokens: torch.Tensor, repeats: int
) -> float:
    """Best of `repeats` timings of one pass scoring `tokens` after `context` (already
    prefilled), after a warm-up pass; the cache is rolled back to `context` after each."""
    runner.truncate(context.shape[0])
    runner.extend(tokens)  # warm-up
    runner.truncate(context.shape[0])
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        runner.extend(tokens)
        times.append(time.perf_counter() - t0)
        runner.truncate(context.shape[0])
    return min(times)


def measure_cost_ratio(engine: Engine, repeats: int = 5) -> float:
    """c = one draft step / one target pass, timed on a short dummy context (best of
    `repeats`, after a warm-up pass, so a busy machine disturbs it less), clamped to [0.01, 1]."""
    proposer = engine.proposer
    step_seconds = getattr(proposer, "step_seconds", None)  # drafters without a Runner
    if proposer is None or not (hasattr(proposer, "runner") or step_seconds):
        return 0.0
    context = torch.arange(1, 33, device=engine.target.model.device)

    def best_of(runner: Runner) -> float:
        runner.prefill(context, span=MEASURE_SPAN)
        return best_extend_seconds(runner, context, context[:1], repeats)

    if step_seconds is not None:
        draft_step = step_seconds(repeats)
    else:
        draft_step = best_of(proposer.runner)
        proposer.runner.truncate(0)
    target_pass = best_of(engine.runner)
    engine.runner.truncate(0)
    return min(max(draft_step / target_pass, 0.01), 1.0)


def measure_row_cost(engine: Engine, repeats: int = 3) -> float:
    """v = the extra cost of one more row in an unpadded target pass, as a fraction of a
    1-row pass: (t(rows) / t(1) - 1) / (rows - 1), best of `repeats` each, clamped to [0, 1].
    (On the 1.5B target on a 2-core CPU: 1 row ~241 ms, 16 rows ~352 ms, v ~0.03.)"""
    runner = engine.runner
    context = torch.arange(1, 33, device=runner.model.device)
    rows = runner.rows
    if rows is None or rows < 2:
        return 0.0
    guesses = torch.arange(40, 40 + rows, device=runner.model.device)
    runner.prefill(context, span=MEASURE_SPAN)
    one = best_extend_seconds(runner, context, guesses[:1], repeats)
    full = best_extend_seconds(runner, context, guesses, repeats)
    runner.truncate(0)
    return min(max((full / one - 1.0) / (rows - 1), 0.0), 1.0)


def measure_tree_node_cost(engine: Engine, repeats: int = 3) -> float:
    """v_tree = the extra cost of one more node in a target tree pass (the pass a tree round
    verifies with: on unpadded passes each node gathers its path's keys), as a fraction of a
    1-row pass: (t(tree of `rows` nodes) / t(1 row) - 1) / (rows - 1), best of `repeats`,
    clamped to [0, 1]. The tree is a chain, which gathers as much as any tree of its size."""
    runner = engine.runner
    rows = runner.rows
    if rows is None or rows < 2:
        return 0.0
    device = runner.model.device
    context = torch.arange(1, 33, device=device)
    tree = TokenTree.chain(40, list(range(41, 40 + rows)))
    offsets = tree.slot_offsets()  # [rows]
    visible = tree.region_mask(offsets)

    def tree_pass() -> None:
        runner.tree_pass(tree.tokens.to(device), tree.depths, offsets, visible)

    runner.prefill(context, span=MEASURE_SPAN)
    one = best_extend_seconds(runner, context, context[:1], repeats)
    tree_pass()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        tree_pass()
        times.append(time.perf_counter() - t0)
    runner.truncate(0)
    return min(max((min(times) / one - 1.0) / (rows - 1), 0.0), 1.0)


def check_compatible(target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse a draft whose tokens do not mean the target's tokens (cf. llama.cpp's
    are_compatible). With tokenizers: same vocabulary and special ids; without: same vocab
    size and EOS ids."""
    t_cfg, d_cfg = target.model.cfg, draft.model.cfg
    if t_cfg.vocab_size != d_cfg.vocab_size:
        raise UnderstudyError(
            f"draft {draft.name!r} has a vocabulary of {d_cfg.vocab_size} tokens, the target "
            f"{target.name!r} {t_cfg.vocab_size}: they cannot share token ids"
        )
    if set(draft.eos_token_ids) - set(target.eos_token_ids) and target.eos_token_ids:
        raise UnderstudyError(
            f"draft {draft.name!r} and target {target.name!r} disagree on end-of-text ids "
            f"({sorted(draft.eos_token_ids)} vs {sorted(target.eos_token_ids)})"
        )
    t_tok, d_tok = target.tokenizer, draft.tokenizer
    if t_tok is not None and d_tok is not None:
        if t_tok.get_vocab() != d_tok.get_vocab():
            raise UnderstudyError(
                f"draft {draft.name!r} and target {target.name!r} have different tokenizers"
            )


def build_engine(
    target: str | None,
    draft: str | None,
    method: str,
    num_speculative_tokens: int | str,
    dtype: str | torch.dtype,
    max_context: int,
    verify_rows: int | None,
    device: str | None,
    draft_quantization: str | None = "auto",
    drafter_options: dict[str, object] | None = None,
) -> Engine:
    if method not in METHODS:
        raise UnderstudyError(f"unknown method {method!r}: choose one of {', '.join(METHODS)}")
    if not isinstance(max_context, int) or max_context < 8:
        raise UnderstudyError(f"max_context must be an integer >= 8, got {max_context!r}")
    target_model = load_model(target or DEFAULT_TARGET, dtype, device)
    model = target_model.model
    default_rows, pad = target_pass_shape(model)
    k = num_speculative_tokens
    rows = verify_rows or (default_rows if k == "auto" else max(default_rows, k + 1))
    if k != "auto" and rows < k + 1:
        raise UnderstudyError(f"verify_rows={rows} cannot hold K+1={k + 1} tokens")
    if pad:
        exact = rows == default_rows
        prepare_target_kernels(model, rows)
    else:  # row-invariant kernels: exact whatever the number of rows
        exact = True
        install_row_invariant_kernels(model, rows)
    if not exact:
        warnings.warn(
            f"target passes hold {rows} rows, not this hardware's default {default_rows}: "
            "greedy output may differ from method='none' on near-ties (stats.exact = False)",
            stacklevel=3,
        )
    proposer = None
    options = drafter_options or {}
    if method != "none":
        drafter = DRAFTERS[method]
        if drafter.needs_draft_model:
            draft_spec = draft or (DEFAULT_DRAFT if target in (None, DEFAULT_TARGET) else None)
            if draft_spec is None:
                raise UnderstudyError(f"method {method!r} needs a draft model: pass draft=...")
            draft_model = load_model(draft_spec, dtype, device)
            check_compatible(target_model, draft_model)
            scheme = resolve_draft_quantization(draft_quantization, draft_model)
            if scheme is not None:
                load_or_quantize(draft_model.model, None, scheme)
            proposer = drafter.from_models(target_model, draft_model, max_context, **options)
        elif getattr(drafter, "takes_draft_path", False):  # e.g. eagle: draft = the head's folder
            proposer = drafter.from_models(target_model, None, max_context, head=draft, **options)
        else:
            proposer = drafter.from_models(target_model, None, max_context, **options)
        quantize_own_drafter(proposer, draft_quantization, target_model)
    engine = Engine(target_model, proposer, method, k, max_context, rows, exact, pad=pad)
    measure_engine_costs(engine)
    return engine


def measure_engine_costs(engine: Engine) -> None:
    """Time what automatic K and tree="auto" weigh, once per engine: c, and on unpadded
    passes v (and v_tree under tree="auto"); nothing for an engine that chooses nothing."""
    if engine.proposer is None or (engine.k != "auto" and engine.tree_mode != "auto"):
        return
    engine.cost_ratio = measure_cost_ratio(engine)
    if engine.pad:
        return
    engine.row_cost = measure_row_cost(engine)
    if hasattr(engine.proposer, "row_cost"):  # proposers that plan their own rounds (hybrid)
        engine.proposer.row_cost = engine.row_cost
    if engine.tree_mode == "auto":
        engine.tree_node_cost = measure_tree_node_cost(engine)
