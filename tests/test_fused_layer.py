"""kernels/fused_layer: a layer's work around its attention in two C calls, for models on
GGUF blocks. It is taken where every linear of a layer runs in qgemm; it computes what the
modules compute (within float rounding); and output stays exact on it: greedy speculative
equals plain decoding bit for bit, batched answers equal their solo answers, and a seeded
sampled answer is the same batched and alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gguf_helpers import KERNEL_LAYER_TYPES, MIXED_LAYER_TYPES, write_tiny_qwen2_gguf
from understudy import Engine, SamplingParams
from understudy.kernels import fused_layer, qgemm, span_attention
from understudy.models.key_groups import KeyGroup
from understudy.models.refusals import log_refusal
from understudy.models.runner import Runner
from understudy.models.transformer import FusedStackHook, Transformer

pytestmark = [
    pytest.mark.skipif(not qgemm.available(), reason="qgemm cannot be built here"),
    pytest.mark.skipif(fused_layer.load() is None, reason="fused_layer cannot be built here"),
    pytest.mark.usefixtures("one_thread"),
]
OPTIONS = dict(quantization="gguf", max_context=256)


@pytest.fixture(scope="module")
def kernel_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """(target, draft) whose layers are all of kernel types."""
    root = tmp_path_factory.mktemp("fused")
    target = write_tiny_qwen2_gguf(root / "t.gguf", seed=3, layer_types=KERNEL_LAYER_TYPES)
    draft = write_tiny_qwen2_gguf(
        root / "d.gguf", seed=4, tied=True, layer_types=KERNEL_LAYER_TYPES
    )
    return str(target), str(draft)


def test_taken_where_every_linear_is_of_a_kernel_type(
    kernel_pair: tuple[str, str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every layer fused where all its parts have kernels; a float32 part keeps its layers
    on the module path (quantization="auto"), which says why once."""
    engine = Engine.from_pretrained(method="draft", target=kernel_pair[0], draft=kernel_pair[1],
                                    **OPTIONS)  # fmt: skip
    for model in (engine.target.model, engine.seat.drafter.draft_runner().model):
        assert all(layer.fused is not None for layer in model.layers)
        assert (model.fused_stack is not None) == span_attention.available()
    mixed = write_tiny_qwen2_gguf(tmp_path / "mixed.gguf", seed=5, layer_types=MIXED_LAYER_TYPES)
    log_refusal.cache_clear()  # said once a process: forget what earlier tests said
    with caplog.at_level("WARNING", logger="understudy.kernels"):
        plain = Engine.from_pretrained(
            method="none", target=str(mixed), quantization="auto", max_context=256
        )
    assert all(layer.fused is None for layer in plain.target.model.layers)
    assert plain.target.model.fused_stack is None
    said = [r.getMessage() for r in caplog.records if "fused layer" in r.getMessage()]
    assert len(said) == 1 and "F32 part" in said[0], said  # once, for both layers


def recording_stack(
    target: str, monkeypatch: pytest.MonkeyPatch
) -> tuple[Transformer, FusedStackHook, list[bool]]:
    """The target's model, its fused stack, and the list each stack call appends its answer
    to (True: the stack took the pass)."""
    model = Engine.from_pretrained(method="none", target=target, **OPTIONS).target.model
    stack = model.fused_stack
    assert stack is not None and model.layers[0].attn.span_rows >= 6
    taken: list[bool] = []
    run = stack.run
    monkeypatch.setattr(stack, "run", lambda *args: taken.append(run(*args)) or taken[-1])
    return model, stack, taken


@pytest.mark.skipif(not span_attention.available(), reason="span_attention is off or unbuilt")
def test_all_layers_in_one_call_give_the_per_layer_bits(
    kernel_pair: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Passes through FusedStack (every layer in one C call) and through the per-layer calls:
    bitwise the same hidden states and caches, for a prompt of 6 rows and decode passes of 1,
    2 and 5 rows; a pass whose rows' keys are not one run (a tree's: row 1 skips its sibling)
    is declined by the stack and computed by the per-layer path, alike."""
    model, stack, taken = recording_stack(kernel_pair[0], monkeypatch)
    tokens = torch.tensor([3, 17, 42, 7, 99, 250, 1, 64, 128, 5, 77, 31, 8, 2, 90])
    passes = [(0, 6), (6, 7), (7, 9), (9, 14)]  # [start, end) of tokens
    tree = torch.zeros(2, 16, dtype=torch.bool)  # two siblings at slots 14 and 15
    tree[:, :14], tree[0, 14], tree[1, 15] = True, True, True
    results = []
    for use in (True, False):
        model.fused_stack = stack if use else None
        model.k_cache, model.v_cache = [], []
        model.allocate_cache(16)
        hidden = []
        for start, end in passes:
            positions = torch.arange(start, end)
            mask = torch.arange(end)[None] <= positions[:, None]  # [R, end] causal
            hidden.append(model.hidden_states(tokens[start:end], positions, positions, mask))
        at = torch.tensor([14, 14])
        hidden.append(model.hidden_states(tokens[13:15], at, torch.tensor([14, 15]), tree))
        results.append(hidden + [c.clone() for c in model.k_cache + model.v_cache])
    model.fused_stack = stack
    assert taken == [True] * len(passes) + [False]
    for a, b in zip(results[0], results[1], strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(not span_attention.available(), reason="span_attention is off or unbuilt")
def test_a_pass_of_several_sequences_takes_the_stack_with_the_same_bits(
    kernel_pair: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batched pass (KeyGroups: each sequence over its own region of the cache) runs all
    its layers in one call, one mask over the cache's slots, and gives the per-layer path's
    bits: two sequences in regions at slots 0 and 16, prompts of 5 and 6 rows, then passes
    of 1 + 3 and 2 + 1 rows; a pass where one sequence is a tree (gathered keys) is declined
    by the stack and computed by the per-layer path, alike."""
    model, stack, taken = recording_stack(kernel_pair[0], monkeypatch)
    seqs = [
        torch.tensor([3, 17, 42, 7, 99, 250, 1, 64, 128]),
        torch.tensor([5, 77, 31, 8, 2, 90, 11, 6, 200]),
    ]
    bases = [0, 16]
    passes = [[(0, 5), (0, 6)], [(5, 6), (6, 9)], [(6, 8), (9, 9)]]  # per sequence [start, end)
    results = []
    for use in (True, False):
        model.fused_stack = stack if use else None
        model.k_cache, model.v_cache = [], []
        model.allocate_cache(32)
        hidden = []
        for spans in passes:
            tokens, positions, slots, groups, start = [], [], [], [], 0
            for seq, base, (a, b) in zip(seqs, bases, spans, strict=True):
                if a == b:
                    continue
                where = torch.arange(a, b)
                tokens.append(seq[a:b])
                positions.append(where)
                slots.append(base + where)
                mask = torch.arange(b)[None] <= where[:, None]  # [n, b] causal
                groups.append(KeyGroup(slice(start, start + b - a), base, mask))
                start += b - a
            empty = torch.ones(start, 0, dtype=torch.bool)
            hidden.append(model.hidden_states(torch.cat(tokens), torch.cat(positions),
                                              torch.cat(slots), empty, groups=groups))  # fmt: skip
        # sequence 0 a chain row at position 8; sequence 1 two sibling nodes at position 9
        tree = torch.zeros(2, 10, dtype=torch.bool)
        tree[:, :9], tree[0, 9], tree[1, 9] = True, True, True
        key_slots = torch.arange(10).repeat(2, 1) + 16
        key_slots[1, 9] = 26  # the second sibling's own slot
        groups = [KeyGroup(slice(0, 1), 0, torch.ones(1, 9, dtype=torch.bool)),
                  KeyGroup(slice(1, 3), 16, tree, key_slots)]  # fmt: skip
        hidden.append(model.hidden_states(
            torch.tensor([128, 200, 45]), torch.tensor([8, 9, 9]), torch.tensor([8, 25, 26]),
            torch.ones(3, 0, dtype=torch.bool), groups=groups,
        ))  # fmt: skip
        results.append(hidden + [c.clone() for c in model.k_cache + model.v_cache])
    model.fused_stack = stack
    assert taken == [True] * len(passes), taken  # the tree's pass never reached the stack
    for a, b in zip(results[0], results[1], strict=True):
        assert torch.equal(a, b)


def test_a_pass_of_any_row_count_gives_each_row_its_one_row_logits(
    kernel_pair: tuple[str, str],
) -> None:
    """A pass of n = 1 .. 16 rows (a verification of n - 1 guesses; the kernels group its
    rows in every way they can) gives each row, bitwise, the logits that one-row passes, as
    plain decoding makes them, give at its position."""
    model = Engine.from_pretrained(method="none", target=kernel_pair[0], **OPTIONS).target.model
    runner = Runner(model, 64, rows=16, pad=False)
    tokens = torch.tensor([3, 17, 42, 7, 99, 250, 1, 64, 128, 5, 77, 31, 8, 2, 90, 11, 6, 200,
                           45, 13, 160, 9])  # fmt: skip
    runner.prefill(tokens[:6])
    one_row = torch.cat([runner.extend(tokens[i : i + 1]) for i in range(6, 22)])  # [16, V]
    for n in range(1, 17):
        runner.truncate(6)
        assert torch.equal(runner.extend(tokens[6 : 6 + n]), one_row[:n]), n


def test_computes_what_the_modules_compute(kernel_pair: tuple[str, str]) -> None:
    """Logits of a prompt and 4 decode rows through the fused layers and through the
    modules: the same up to float rounding (relative RMS 1e-4; the int8 rounding of
    activations can move a value by one step where rounding differs)."""
    engine = Engine.from_pretrained(method="none", target=kernel_pair[0], **OPTIONS)
    model = engine.target.model
    tokens = torch.tensor([3, 17, 42, 7, 99, 250, 1, 64, 128, 5])
    fused = [layer.fused for layer in model.layers]
    logits = []
    for use in (True, False):
        for layer, f in zip(model.layers, fused, strict=True):
            layer.fused = f if use else None
        runner = Runner(model, 64, rows=16, pad=False)
        first = runner.prefill(tokens[:6])
        logits.append(torch.cat([first[None], runner.extend(tokens[6:])]))
    for layer, f in zip(model.layers, fused, strict=True):
        layer.fused = f
    error = (logits[0] - logits[1]).norm() / logits[1].norm()
    assert error < 1e-3, error
    assert torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_greedy_speculative_and_batched_equal_plain(
    kernel_pair: tuple[str, str], method: str
) -> None:
    target, draft = kernel_pair
    plain = Engine.from_pretrained(method="none", target=target, **OPTIONS)
    spec = Engine.from_pretrained(
        method=method, target=target, draft=draft if method == "draft" else None,
        num_speculative_tokens=3, max_num_seqs=3, **OPTIONS,
    )  # fmt: skip
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11], [40, 41, 40, 41, 40, 41, 40]]
    alone = [plain.generate(p, params).token_ids for p in prompts]
    outs = spec.generate(prompts, params)
    assert [o.token_ids for o in outs] == alone
    assert sum(o.stats.drafted for o in outs) > 0


def test_seeded_sampling_is_the_same_batched_and_alone(kernel_pair: tuple[str, str]) -> None:
    target, draft = kernel_pair
    spec = Engine.from_pretrained(method="draft", target=target, draft=draft,
                                  num_speculative_tokens=3, max_num_seqs=2, **OPTIONS)  # fmt: skip
    params = SamplingParams(max_tokens=20, temperature=0.9, seed=11, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [30, 31, 32, 33, 34]]
    alone = [spec.generate(p, params).token_ids for p in prompts]
    together = spec.generate(prompts, params)
    assert [o.token_ids for o in together] == alone
    assert sum(o.stats.drafted for o in together) > 0
