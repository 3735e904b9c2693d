"""The head that ships with the package (models/head_file.py): packed in Q4_0 blocks,
bound by sha256 to the target file it was trained on, found by method="eagle" with no
draft= given, refused for any other file, and outranked by a head the user trained into
the cache. A tiny GGUF target on its own blocks stands in for the packaged one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file

from eagle_helpers import SETTINGS
from gguf_helpers import KERNEL_LAYER_TYPES, write_tiny_qwen2_gguf
from test_cli import cli
from understudy import Engine, SamplingParams, UnderstudyError
from understudy.drafters import eagle
from understudy.drafters.eagle import default_head_dir
from understudy.head.lockstep import decode_in_lockstep, prepare_target
from understudy.head.pipeline import HeadSettings, train_head
from understudy.head.train import TrainConfig
from understudy.kernels import qgemm
from understudy.models import head_file
from understudy.models.head_file import file_sha256, load_packed_head, pack_head, read_packed
from understudy.models.loader import load_model

Q4_0 = GGMLQuantizationType.Q4_0

pytestmark = [
    pytest.mark.skipif(not qgemm.available(), reason="qgemm cannot be built here"),
    pytest.mark.usefixtures("one_thread"),
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Path]:
    """(target .gguf, a head trained for it, that head packed)."""
    root = tmp_path_factory.mktemp("shipped")
    target = str(write_tiny_qwen2_gguf(root / "t.gguf", seed=3, layer_types=KERNEL_LAYER_TYPES,
                                       layers=3, head_scale=30.0))  # fmt: skip
    model = load_model(target).model
    prepare_target(model)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 300, (6,), generator=gen).tolist() for _ in range(32)]
    sequences = decode_in_lockstep(model, prompts, 48).tokens.tolist()
    settings = HeadSettings(96, 256, SETTINGS.train)
    meta = train_head(load_model(target), sequences, root / "head", "t", settings, False)
    assert meta["target_sha256"] == file_sha256(target) and meta["feature_layers"] == [0, 1, 2]
    packed = root / "packed.safetensors"
    pack_head(root / "head", packed, str(meta["target_sha256"]))
    return target, root / "head", packed


def test_packed_weights_are_the_q4_0_blocks(trained):
    """Every linear comes back as exactly its Q4_0 blocks' values (gguf's own quantizer and
    dequantizer); norms, biases and the vocabulary as trained; the config and the target's
    digest ride along; the LM rows are not in the file."""
    target, folder, packed = trained
    cfg, sha256, meta = read_packed(packed)
    assert sha256 == file_sha256(target) and cfg.feature_layers == (0, 1, 2)
    assert meta["feature_layers"] == [0, 1, 2]
    assert not any(name.startswith("lm.") for name in load_file(str(packed)))
    state = load_file(str(folder / "head.safetensors"))
    head = load_packed_head(packed, load_model(target).model)
    loaded = head.state_dict()
    for name, value in state.items():
        if value.ndim == 2 and name != "vocab":
            w = value.float().numpy()
            want = torch.from_numpy(dequantize(quantize(w, Q4_0), Q4_0)).reshape(w.shape)
            assert torch.equal(loaded[name], want), name
        else:
            assert torch.equal(loaded[name], value), name


def test_method_eagle_finds_the_shipped_head_for_its_file(trained, monkeypatch, tmp_path):
    """No draft= and no head in the cache: the packed head of the target's own file drafts,
    and greedy output is plain decoding's."""
    target, _, packed = trained
    monkeypatch.setattr(eagle, "shipped_head", lambda: packed)
    monkeypatch.setenv("UNDERSTUDY_CACHE", str(tmp_path))
    engine = Engine.from_pretrained(target=target, method="eagle", max_context=256)
    assert engine.target.model.feature_layers == (0, 1, 2)
    plain = engine.with_method("none")
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    accepted = 0
    for prompt in ([5, 6, 7, 8], [100, 3, 250]):
        out = engine.generate(prompt, params)
        assert out.token_ids == plain.generate(prompt, params).token_ids
        accepted += out.stats.accepted
    assert accepted > 0


def test_a_packed_head_drafts_with_the_blocks_of_the_head_it_was_packed_from(trained):
    """Beside a GGUF target the drafter puts the head in Q4_0 blocks: from the packed file
    they are bitwise the trained folder's, so the shipped head drafts as the trained one."""
    target, folder, packed = trained
    heads = [
        Engine.from_pretrained(target=target, method="eagle", draft=str(source),
                               max_context=256).drafter.head
        for source in (folder, packed)
    ]  # fmt: skip
    blocks = dict(heads[1].named_modules())
    compared = 0
    for name, a in heads[0].named_modules():
        if isinstance(a, qgemm.QuantLinear):
            b = blocks[name]
            assert isinstance(b, qgemm.QuantLinear), name
            x = torch.randn(3, a.in_features, generator=torch.Generator().manual_seed(compared))
            assert torch.equal(a(x), b(x)), name
            compared += 1
    assert compared >= 5  # fuse, fc, the block's attention and MLP, the LM rows


@pytest.mark.parametrize("scheme,kind", [("auto", "Q4_0"), ("q8_0", "Q8_0")])
def test_the_head_drafts_on_the_targets_block_kernels(trained, scheme, kind):
    """Beside a target that runs from its GGUF blocks, draft_quantization="auto" puts the
    head's linears, its LM rows included, in Q4_0 blocks on qgemm (q8_0: Q8_0, as asked);
    greedy output is plain decoding's, and the head's guesses are kept."""
    target, folder, _ = trained
    engine = Engine.from_pretrained(
        target=target, method="eagle", draft=str(folder), draft_quantization=scheme,
        num_speculative_tokens=3, max_context=256,
    )  # fmt: skip
    head = engine.drafter.head
    for linear in (head.fc, head.lm, head.block.mlp.w_down):
        assert isinstance(linear, qgemm.QuantLinear) and linear.parts[0].kind.name == kind
    plain = engine.with_method("none")
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    accepted = 0
    for prompt in ([5, 6, 7, 8], [100, 3, 250], [42, 17]):
        out = engine.generate(prompt, params)
        assert out.token_ids == plain.generate(prompt, params).token_ids
        accepted += out.stats.accepted
    assert accepted > 0


def test_a_shipped_head_of_another_file_is_refused(trained, monkeypatch, tmp_path):
    """The packed head of one file, asked for by another (the same network written again:
    another file), is refused with a line that says whose it is and how to train one."""
    target, _, packed = trained
    other = write_tiny_qwen2_gguf(tmp_path / "other.gguf", seed=4, layer_types=KERNEL_LAYER_TYPES,
                                  layers=3)  # fmt: skip
    monkeypatch.setattr(eagle, "shipped_head", lambda: packed)
    monkeypatch.setenv("UNDERSTUDY_CACHE", str(tmp_path))
    with pytest.raises(UnderstudyError, match="belongs to another target file.*train-head"):
        Engine.from_pretrained(target=str(other), method="eagle", max_context=256)
    with pytest.raises(UnderstudyError, match="belongs to another target file"):
        Engine.from_pretrained(target=str(other), method="eagle", draft=str(packed))
    monkeypatch.setattr(eagle, "shipped_head", lambda: tmp_path / "absent.safetensors")
    with pytest.raises(UnderstudyError, match="no trained head for target"):
        Engine.from_pretrained(target=str(other), method="eagle", max_context=256)


def test_a_head_trained_into_the_cache_outranks_the_shipped_one(trained, monkeypatch, tmp_path):
    target, folder, packed = trained
    monkeypatch.setattr(eagle, "shipped_head", lambda: packed)
    monkeypatch.setenv("UNDERSTUDY_CACHE", str(tmp_path))
    loaded = load_model(target)
    assert eagle.find_head(loaded, None) == packed
    mine = default_head_dir(loaded.name)
    mine.mkdir(parents=True)
    for name in ("head.safetensors", "config.json"):
        (mine / name).write_bytes((folder / name).read_bytes())
    assert eagle.find_head(loaded, None) == mine
    assert eagle.find_head(loaded, str(packed)) == packed  # draft= names it


def test_packing_refuses_what_the_package_cannot_carry(trained, monkeypatch, tmp_path):
    target, folder, _ = trained
    monkeypatch.setattr(head_file, "MAX_BYTES", 1000)
    out = tmp_path / "big.safetensors"
    with pytest.raises(UnderstudyError, match="over 0 MB"):
        pack_head(folder, out, "0" * 64)
    assert not out.exists() and not out.with_suffix(".tmp").exists()


def test_pack_head_from_the_command_line(trained, tmp_path):
    target, folder, _ = trained
    out = tmp_path / "cli.safetensors"
    made = cli("pack-head", str(folder), "--out", str(out))
    assert made.returncode == 0, made.stderr
    assert read_packed(out)[1] == file_sha256(target)
    unbound = tmp_path / "unbound"
    unbound.mkdir()
    config = json.loads((folder / "config.json").read_text())
    config["meta"].pop("target_sha256")
    (unbound / "config.json").write_text(json.dumps(config))
    (unbound / "head.safetensors").write_bytes((folder / "head.safetensors").read_bytes())
    bad = cli("pack-head", str(unbound), "--out", str(tmp_path / "x.safetensors"))
    assert bad.returncode == 2 and "sha256" in " ".join(bad.stderr.split())


def test_training_goes_on_from_a_packed_head(trained, tmp_path):
    """`init` a packed head's file: training starts from its dequantized Q4_0 weights and
    keeps its vocabulary (at a learning rate of ~0 it ends where it started); a packed head
    of another target file is refused by name."""
    target, _, packed = trained
    model = load_model(target).model
    prepare_target(model)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 300, (6,), generator=gen).tolist() for _ in range(8)]
    sequences = decode_in_lockstep(model, prompts, 48).tokens.tolist()
    still = HeadSettings(96, 256, TrainConfig(epochs=1, batch=4, lr=1e-12, warmup=1))
    meta = train_head(load_model(target), sequences, tmp_path / "more", "t", still, False,
                      init=packed)  # fmt: skip
    assert meta["init"] == str(packed) and meta["feature_layers"] == [0, 1, 2]
    start = load_packed_head(packed, load_model(target).model).state_dict()
    after = load_file(str(tmp_path / "more" / "head.safetensors"))
    assert torch.equal(after["vocab"], start["vocab"])
    for name, weight in after.items():
        if name != "vocab":
            torch.testing.assert_close(weight, start[name].float(), atol=1e-6, rtol=0)
    other = write_tiny_qwen2_gguf(tmp_path / "other.gguf", seed=4, layer_types=KERNEL_LAYER_TYPES,
                                  layers=3)  # fmt: skip
    with pytest.raises(UnderstudyError, match="packed for another target file"):
        train_head(load_model(str(other)), sequences, tmp_path / "x", "t", still, False,
                   init=packed)  # fmt: skip
