"""Every family of the fast path from a GGUF file's own blocks (quantization="gguf").

Per family, a tiny random transformers model (test_architectures.make_hf) is written as
llama.cpp's converter writes it (gguf_helpers.write_gguf_from_hf) in block types gguf's
own quantizer makes (Q8_0, with Q4_0 and Q5_0 parts where a family's real files have
them), and loaded with quantization="gguf", which refuses any part the kernels cannot take:

1. every linear runs from its blocks (a mixture's router is float32 in the file, as
   llama.cpp keeps it, and runs as it is), and every layer through the fused layer;
2. logits == transformers' forward of the same model with the file's weights (each matrix
   quantized and dequantized by gguf), within the activation quantization's error;
3. the fused layer computes what the modules compute (within float rounding);
4. a pass of several rows gives each row the bits of one-row passes, and greedy
   speculation (n-gram, and a noisy copy as the draft) is plain decoding's, bit for bit.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from gguf_helpers import write_gguf_from_hf
from test_architectures import PROMPT, VOCAB, make_hf
from understudy import Engine, SamplingParams
from understudy.kernels import qgemm
from understudy.kernels.qgemm import QuantLinear
from understudy.models.convert import UnsupportedArchitecture, config_from_hf
from understudy.models.loader import load_model
from understudy.models.rope import Rotary
from understudy.models.runner import Runner

pytestmark = [
    pytest.mark.skipif(not qgemm.available(), reason="qgemm cannot be built here"),
    pytest.mark.usefixtures("one_thread"),
]
GEMMA3_ROPE = {
    "sliding_attention": dict(rope_type="default", rope_theta=10000.0),
    "full_attention": dict(rope_type="linear", rope_theta=1000000.0, factor=8.0),
}
# family -> (GGUF architecture, make_hf entry, config overrides, block types by GGUF name,
# general.name). Overrides: what the file carries (Gemma's score scale is transformers'
# default, 256); soft caps, Qwen3's head size, Gemma 3's rope scaling, Phi-4-mini's rotated
# share and Phi-3's LongRoPE and window are read from the file itself (models/gguf_config.py).
FAMILIES = {
    "qwen3": ("qwen3", "qwen3", dict(head_dim=32), dict(ffn_gate=T.Q4_0, ffn_up=T.Q4_0), None),
    "gemma2": (
        "gemma2", "gemma2",
        dict(head_dim=16, query_pre_attn_scalar=256, attn_logit_softcapping=2.0,
             final_logit_softcapping=8.0),
        {}, None,
    ),
    "gemma3": (  # six layers: five sliding, one global; Q5_0 where the real 270M has it
        "gemma3", "gemma3",
        dict(num_hidden_layers=6, layer_types=None, rope_parameters=GEMMA3_ROPE,
             query_pre_attn_scalar=256),
        dict(attn_q=T.Q5_0, attn_k=T.Q5_0, ffn_gate=T.Q5_0, ffn_up=T.Q5_0), None,
    ),
    "phi4-mini": ("phi3", "phi4-mini-partial", {}, {}, None),
    "phi3-longrope": ("phi3", "phi3-longrope", {}, {}, None),  # and a sliding window
    # a "llama" file named mistral: read as Mistral without a window (llama.cpp has none)
    "mistral": ("llama", "mistral-window", dict(sliding_window=None), {}, "mistral-tiny"),
    "mixtral": ("llama", "mixtral", {}, dict(ffn_down_exps=T.Q5_0), "mixtral-tiny"),
    "qwen3-moe": ("qwen3moe", "qwen3-moe", dict(mlp_only_layers=[]), {}, None),
}  # fmt: skip
# q and k weights scaled up, so that attention scores reach the soft cap (at Gemma's score
# scale of 1/16 a tiny model's scores stay near 0.2, where the cap changes nothing)
SHARPER_SCORES = {"gemma2": 5.0, "gemma3": 5.0, "phi3-longrope": 5.0}
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
OPTIONS = dict(quantization="gguf", max_context=256)


@dataclass
class Family:
    name: str
    hf: transformers.PreTrainedModel
    types: dict[str, T]
    target: str
    draft: str  # the same model, its weights nudged: agrees often, not always


def noisy(model: transformers.PreTrainedModel, scale: float = 0.02) -> transformers.PreTrainedModel:
    out = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(scale * p.std() * torch.randn(p.shape, generator=gen))
    return out


def sharpen(model: transformers.PreTrainedModel, factor: float) -> None:
    """Scale the q and k projections (Phi-3's fused q/k/v rows too) by `factor`, in place."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    qk_rows = (config.num_attention_heads + config.num_key_value_heads) * head_dim
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "q_proj" in key or "k_proj" in key:
                p.mul_(factor)
            elif "qkv_proj" in key:
                p[:qk_rows].mul_(factor)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory) -> Family:
    arch, entry, overrides, types, name = FAMILIES[request.param]
    hf = make_hf(entry, **overrides)
    sharpen(hf, SHARPER_SCORES.get(request.param, 1.0))
    root = tmp_path_factory.mktemp(request.param)
    target = write_gguf_from_hf(hf, root / "target.gguf", arch, T.Q8_0, types, name)
    draft = write_gguf_from_hf(noisy(hf), root / "draft.gguf", arch, T.Q8_0, types, name)
    return Family(request.param, hf, types, str(target), str(draft))


GGUF_PART = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}  # fmt: skip


def roundtrip(w: np.ndarray, kind: T) -> torch.Tensor:
    return torch.from_numpy(dequantize(quantize(np.ascontiguousarray(w), kind), kind))


def with_file_weights(fam: Family) -> transformers.PreTrainedModel:
    """The transformers model with the weights the file holds: each matrix through gguf's
    quantizer and dequantizer in its block type (rows are independent, so llama's row
    permutation and the split of fused expert tensors do not change what a row holds)."""
    ref = copy.deepcopy(fam.hf)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.ndim < 2 or name.endswith("mlp.gate.weight"):  # norms; routers stay F32
                continue
            w = p.detach().numpy()
            if name.endswith("experts.gate_up_proj"):  # [E, 2I, H]: gate, then up
                half = w.shape[1] // 2
                kinds = [fam.types.get(n, T.Q8_0) for n in ("ffn_gate_exps", "ffn_up_exps")]
                p.copy_(torch.cat([roundtrip(w[:, :half], kinds[0]),
                                   roundtrip(w[:, half:], kinds[1])], dim=1))  # fmt: skip
                continue
            if name.endswith("experts.down_proj"):
                p.copy_(roundtrip(w, fam.types.get("ffn_down_exps", T.Q8_0)))
                continue
            part = next((v for k, v in GGUF_PART.items() if k in name), None)
            p.copy_(roundtrip(w, fam.types.get(part, T.Q8_0)).reshape(w.shape))
    return ref


def test_the_file_describes_the_model_it_was_written_from(family: Family) -> None:
    """The config the blocks path reads from the file (transformers' GGUF reader, then
    models/gguf_config.py) is the one the dense path derives from the transformers model
    itself: every field (eps as float32 stores it), and the ropes' frequencies and cos/sin
    factors (LongRoPE's factors, Gemma 3's scaled global rope)."""
    got = load_model(family.target, quantization="gguf").model
    want = config_from_hf(family.hf.config, family.hf.state_dict())
    apart = dict(rope_scaling=None, rms_norm_eps=0.0, moe_layers=())
    assert replace(got.cfg, **apart) == replace(want, **apart)
    assert got.cfg.rms_norm_eps == pytest.approx(want.rms_norm_eps, rel=1e-6)
    layers = range(want.num_layers)
    assert [got.cfg.sparse(i) for i in layers] == [want.sparse(i) for i in layers]
    dim, positions = want.rotary_dim or want.head_dim, want.max_position_embeddings
    ropes = [Rotary(want.rope_theta, dim, want.rope_scaling, positions)]
    if want.local_rope_theta is not None:
        ropes.append(Rotary(want.local_rope_theta, dim, None, positions))
    assert len(got.rotaries) == len(ropes)
    for ours, theirs in zip(got.rotaries, ropes, strict=True):
        torch.testing.assert_close(ours.inv_freq, theirs.inv_freq)
        assert ours.attention_factor == pytest.approx(theirs.attention_factor, rel=1e-6)


# families whose tiny files transformers' GGUF reader cannot load dense: it takes Qwen3's head
# size as 128 and Qwen3-MoE's expert width as 768 (its defaults), whatever the file says
NOT_DENSE = ("qwen3", "qwen3-moe")


def test_the_dense_path_reads_the_same_config(family: Family) -> None:
    """quantization="none" (transformers reads and dequantizes the file) derives the config
    the blocks path does; a Mixtral file, which transformers reads as a dense Llama (random
    MLPs), is refused in one line."""
    if family.name in NOT_DENSE:
        pytest.skip("transformers' GGUF reader cannot load this tiny file")
    if family.name == "mixtral":
        with pytest.raises(UnsupportedArchitecture, match="stored as 'llama'") as err:
            load_model(family.target, dtype="float32", quantization="none")
        assert "\n" not in str(err.value)
        return
    dense = load_model(family.target, dtype="float32", quantization="none").model.cfg
    assert dense == load_model(family.target, quantization="gguf").model.cfg


def test_every_linear_runs_from_its_blocks(family: Family) -> None:
    engine = Engine.from_pretrained(target=family.target, method="none", **OPTIONS)
    model = engine.target.model
    assert engine.target.from_blocks
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, QuantLinear)]
    assert len(linears) > 4 * model.cfg.num_layers
    for name, linear in linears:
        dense = [linear.parts[int(i)].kind for i in linear.dense]
        if name.endswith("mlp.router"):  # the file's own float32, run as it is
            assert dense == [T.F32], name
        else:
            assert not dense and {p.kind for p in linear.parts} <= qgemm.KERNEL_TYPES, name
    assert all(layer.fused is not None for layer in model.layers)


def logits_of(model, tokens: torch.Tensor) -> torch.Tensor:
    """Logits [7, vocab] at positions 5..11: a pass of the first 6 tokens, then one by one."""
    runner = Runner(model, 64, rows=16, pad=False)
    first = runner.prefill(tokens[:6])
    return torch.cat([first[None]] + [runner.extend(tokens[i : i + 1]) for i in range(6, 12)])


def test_logits_match_transformers_on_the_file_weights(family: Family) -> None:
    """Activations are rounded to int8 per block (a step of max|x| / 127): logits agree
    with transformers' within 3% RMS of their own RMS, and on the argmax where
    transformers' top two are apart."""
    model = Engine.from_pretrained(target=family.target, method="none", **OPTIONS).target.model
    tokens = torch.randint(3, VOCAB, (12,), generator=torch.Generator().manual_seed(3))
    got = logits_of(model, tokens)
    with torch.no_grad():
        want = with_file_weights(family)(tokens[None]).logits[0, 5:]  # [7, V]
    error = (got - want).norm() / want.norm()
    assert error <= 0.03, error
    top2 = want.topk(2).values
    clear = top2[:, 0] - top2[:, 1] > 0.1 * want.std()
    assert clear.any() and torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


def test_fused_layers_compute_what_the_modules_compute(family: Family) -> None:
    """The same passes through the fused layers and through the modules (QuantLinears,
    torch norms, attention and activations): the same logits up to float rounding."""
    model = Engine.from_pretrained(target=family.target, method="none", **OPTIONS).target.model
    tokens = torch.randint(3, VOCAB, (12,), generator=torch.Generator().manual_seed(4))
    fused = [layer.fused for layer in model.layers]
    stack = model.fused_stack
    got = logits_of(model, tokens)
    for layer in model.layers:
        layer.fused = None
    model.fused_stack = None
    try:
        want = logits_of(model, tokens)
    finally:
        for layer, f in zip(model.layers, fused, strict=True):
            layer.fused = f
        model.fused_stack = stack
    error = (got - want).norm() / want.norm()
    assert error < 1e-3, error


def test_a_row_has_the_bits_of_one_row_passes(family: Family) -> None:
    """The invariant speculation rests on: 5 rows scored in one pass (a verification) are
    bitwise the rows scored one at a time (plain decoding)."""
    model = Engine.from_pretrained(target=family.target, method="ngram", **OPTIONS).target.model
    tokens = torch.tensor(PROMPT[:11])
    together = Runner(model, 64, rows=16, pad=False)
    together.prefill(tokens[:6])
    rows = together.extend(tokens[6:])  # [5, V]
    alone = Runner(model, 64, rows=16, pad=False)
    alone.prefill(tokens[:6])
    singles = torch.cat([alone.extend(tokens[i : i + 1]) for i in range(6, 11)])
    assert torch.equal(rows, singles)


def test_greedy_speculation_equals_plain(family: Family) -> None:
    plain = Engine.from_pretrained(target=family.target, method="none", **OPTIONS)
    ngram = Engine.from_pretrained(target=family.target, method="ngram",
                                   num_speculative_tokens=4, **OPTIONS)  # fmt: skip
    draft = Engine.from_pretrained(target=family.target, draft=family.draft, method="draft",
                                   num_speculative_tokens=3, **OPTIONS)  # fmt: skip
    drafted = 0
    for prompt in (PROMPT, PROMPT[:5] * 3):
        expected = plain.generate(prompt, GREEDY).token_ids
        for engine in (ngram, draft):
            out = engine.generate(prompt, GREEDY)
            assert out.token_ids == expected, engine.method
            drafted += out.stats.drafted
    assert drafted > 0
    draft_model = draft.seat.drafter.draft_runner().model
    assert all(layer.fused is not None for layer in draft_model.layers)


def test_the_helper_writes_each_family_as_llama_cpp_does(family: Family) -> None:
    """The file holds the architecture's own tensor names and the block types asked for."""
    from gguf import GGUFReader

    tensors = {t.name: t.tensor_type for t in GGUFReader(family.target).tensors}
    arch = FAMILIES[family.name][0]
    assert "blk.0.attn_norm.weight" in tensors and "output_norm.weight" in tensors
    if arch in ("qwen3moe",) or family.name == "mixtral":
        assert tensors["blk.0.ffn_gate_inp.weight"] == T.F32
        assert tensors["blk.0.ffn_down_exps.weight"] == family.types.get("ffn_down_exps", T.Q8_0)
    if arch == "phi3":
        assert "blk.0.attn_qkv.weight" in tensors and "blk.0.ffn_gate.weight" not in tensors
    if family.name == "phi3-longrope":
        assert tensors["rope_factors_short.weight"] == T.F32
    for part, kind in family.types.items():
        assert tensors[f"blk.0.{part}.weight"] == kind, part
