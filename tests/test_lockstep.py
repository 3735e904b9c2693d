"""head/lockstep.py: the target reads and writes training text in lockstep batches, and the
features it keeps are the very bits the engine's runner hands method="eagle" at decode time
(Runner.last_hidden): for a GGUF target on its own blocks (fused layers, one C call for the
whole stack, split at the feature layers) and for a float32 one (row-invariant kernels), for
the final hidden states and for the feature layers' outputs, whatever the batch holds."""

from __future__ import annotations

import pytest
import torch

from gguf_helpers import KERNEL_LAYER_TYPES, write_tiny_qwen2_gguf
from understudy.engine.builder import EngineSpec, target_runner
from understudy.head.lockstep import decode_in_lockstep, prepare_target
from understudy.kernels import fused_layer, qgemm, span_attention
from understudy.models.loader import load_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def gguf_target(tmp_path_factory: pytest.TempPathFactory) -> str:
    if not (qgemm.available() and fused_layer.load() is not None and span_attention.available()):
        pytest.skip("the GGUF kernels cannot be built here")
    path = tmp_path_factory.mktemp("lockstep") / "t.gguf"
    return str(write_tiny_qwen2_gguf(path, seed=3, layer_types=KERNEL_LAYER_TYPES, layers=4))


def runner_rows(spec: str, dtype: str, layers: tuple[int, ...], tokens: list[int], prompt: int):
    """What the engine's runner keeps for `tokens`: the prompt prefilled, then decode passes
    of 1, 3, 1, 5, ... rows (plain decoding's and verification's shapes) -> [T, F]."""
    loaded = load_model(spec, dtype)
    runner, exact = target_runner(loaded, EngineSpec(method="none", max_context=256))
    assert exact and not runner.pad
    loaded.model.feature_layers = layers
    runner.keep_hidden = True
    runner.prefill(torch.tensor(tokens[:prompt]), len(tokens))
    kept = [runner.last_hidden]
    at, sizes = prompt, [1, 3, 1, 5, 2, 7]
    while at < len(tokens):
        n = min(sizes[len(kept) % len(sizes)], len(tokens) - at)
        runner.extend(torch.tensor(tokens[at : at + n]))
        kept.append(runner.last_hidden)
        at += n
    return loaded.model, torch.cat(kept)


@pytest.mark.parametrize("layers", [(), (0, 2)])
@pytest.mark.parametrize("kind", ["gguf", "float32"])
def test_lockstep_features_are_the_runners_bits(kind, layers, gguf_target, tiny_pair):
    """A sequence continued in a lockstep batch of three, and the same tokens through the
    engine's runner (prompt of 6 tokens, then passes of 1-7 rows): bitwise the same features
    at every position, and the lockstep text is the runner's greedy text."""
    spec, dtype = (gguf_target, "auto") if kind == "gguf" else (tiny_pair[0], "float32")
    if kind == "float32" and layers:
        layers = (0, 1)  # the tiny float32 target has 2 layers
    loaded = load_model(spec, dtype)
    model = loaded.model
    prepare_target(model)
    model.feature_layers = layers
    if kind == "gguf":
        assert model.fused_stack is not None and all(layer.fused for layer in model.layers)
    prompts = [[5, 17, 9, 33, 2, 40], [7, 8], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69]]
    decoded = decode_in_lockstep(model, prompts, 30)
    tokens = decoded.tokens[0].tolist()
    ran_model, kept = runner_rows(spec, dtype, layers, tokens, len(prompts[0]))
    assert ran_model.feature_layers == layers
    mine = decoded.features[0] if not layers else decoded.kept[0]
    assert mine.shape == (30, model.cfg.hidden_size * max(1, len(layers)))
    assert torch.equal(kept, mine)
    assert torch.equal(decoded.argmax[0, 5:-1], decoded.tokens[0, 6:])  # greedy past the prompt


def test_feature_layers_leave_the_pass_alone(gguf_target):
    """Taking the feature layers' outputs (the stack split in three calls) changes no bit of
    the final hidden states; they are the residual stream after those layers, in order."""
    model = load_model(gguf_target).model
    prepare_target(model)
    prompts = [[3, 4, 5, 6], [9, 10]]
    plain = decode_in_lockstep(model, prompts, 12)
    model.feature_layers = (1, 3)
    tapped = decode_in_lockstep(model, prompts, 12)
    assert torch.equal(plain.features, tapped.features) and plain.kept is None
    hidden = model.cfg.hidden_size
    last = tapped.kept[..., hidden:]  # the residual stream after the last layer
    assert torch.equal(model.norm(last), tapped.features)
    assert not torch.equal(tapped.kept[..., :hidden], last)
