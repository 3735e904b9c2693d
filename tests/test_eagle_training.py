"""Training method="eagle"'s head (head/): the target writes its training text, its features
are extracted and cached, the head is trained in either precision, saved and resumed, and
training's unrolled steps attend as drafting does; `understudy train-head` from the command
line. What the engine does with a trained head: test_eagle.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from eagle_helpers import SETTINGS, target_written_text, train_greedy_head
from test_cli import cli
from test_exactness import random_prompts
from understudy import Engine, SamplingParams, UnderstudyError
from understudy.head.features import sequence_data
from understudy.head.lockstep import prepare_target
from understudy.head.pipeline import HeadSettings, train_head
from understudy.head.train import TrainConfig, evaluate, training_autocast, unrolled_losses
from understudy.models.eagle_head import EagleHead, load_head
from understudy.models.loader import load_model


@pytest.fixture(scope="module")
def trained(tiny_pair, tmp_path_factory) -> tuple[str, Path, dict]:
    target, _ = tiny_pair
    folder = tmp_path_factory.mktemp("eagle") / "head"
    return target, folder, train_greedy_head(target, folder)


def test_training_learns_the_targets_next_tokens(trained):
    """Held-out argmax agreement of the trained head is far above an untrained one's."""
    target, folder, meta = trained
    model = load_model(target, "float32").model
    trained_head = load_head(folder, model)
    model.feature_layers = trained_head.cfg.feature_layers
    data = sequence_data(model, target_written_text(target, 4, seed=99, temperature=0.0))
    untrained = EagleHead(trained_head.cfg, model.embed)
    untrained.vocab.copy_(trained_head.vocab)
    untrained.lm.weight.data = trained_head.lm.weight.data.clone()
    scale = float(meta["feature_scale"])
    good = evaluate(trained_head, data, SETTINGS.train, scale)
    bad = evaluate(untrained.eval(), data, SETTINGS.train, scale)
    assert good[0] > 0.3 and good[0] > bad[0] + 0.25, (good, bad)  # measured: 0.44 vs 0.004
    assert len(meta["val_agree"]) == SETTINGS.train.unroll


def one_sequence_data(target: str, layers: tuple[int, ...]) -> dict[str, torch.Tensor]:
    model = load_model(target, "float32").model
    model.feature_layers = layers
    return sequence_data(model, target_written_text(target, 1, seed=7, temperature=0.0))


def test_feature_noise_is_random_seeded_and_off_at_zero(trained):
    """feature_noise perturbs the head's inputs (the loss moves), reproducibly under a seed,
    and not at all at 0 (the value `evaluate` uses)."""
    target, folder, meta = trained
    head = load_head(folder, load_model(target, "float32").model)
    data = one_sequence_data(target, head.cfg.feature_layers)
    scale = float(meta["feature_scale"])

    def loss(noise: float, seed: int) -> float:
        torch.manual_seed(seed)
        with torch.no_grad():
            total, _ = unrolled_losses(
                head, data["tokens"], data["features"], data["argmax"], 2, scale, 1.0, noise,
                data["kept"],
            )  # fmt: skip
        return float(total)

    assert loss(0.0, 1) == loss(0.0, 2)
    assert loss(0.3, 1) == loss(0.3, 1)
    assert loss(0.3, 1) != loss(0.3, 2) and loss(0.3, 1) != loss(0.0, 1)
    with pytest.raises(UnderstudyError, match="feature_noise"):
        TrainConfig(feature_noise=-0.1)
    with pytest.raises(UnderstudyError, match="precision"):
        TrainConfig(precision="float8")


def test_training_precisions(tiny_pair, tmp_path):
    """bfloat16 autocast runs the step's matmuls in bf16; both precisions train a head that
    agrees with the target held out, one reading the final hidden state alone, the other
    the outputs of both layers (the tiny target's default feature layers)."""
    with training_autocast("bfloat16", torch.device("cpu")):
        assert torch.is_autocast_enabled("cpu")
        assert (
            torch.nn.functional.linear(torch.ones(2, 4), torch.ones(3, 4)).dtype == torch.bfloat16
        )
    with training_autocast("float32", torch.device("cpu")):
        assert not torch.is_autocast_enabled("cpu")
    target, _ = tiny_pair
    sequences = target_written_text(target, 40, seed=0, temperature=0.0)
    for precision, layers in (("float32", ()), ("bfloat16", None)):
        settings = HeadSettings(
            intermediate_size=96,
            draft_vocab_size=256,
            train=TrainConfig(
                epochs=8, batch=4, lr=3e-3, warmup=5, checkpoint_every=1000, precision=precision
            ),
            feature_layers=layers,
        )
        folder = tmp_path / precision
        meta = train_head(load_model(target, "float32"), sequences, folder, "t", settings, False)
        assert meta["val_agree"][0] > 0.15, (precision, meta["val_agree"])  # untrained: ~0.004
        assert meta["feature_layers"] == ([] if layers == () else [0, 1])


def test_saved_files_and_resume(trained, tiny_pair):
    """A second run reuses the cached features and the finished checkpoint: no new work."""
    target, folder, meta = trained
    shards = sorted((folder / "features-test-64-layers-0-1").glob("features-*.safetensors"))
    assert shards and (folder / "head.safetensors").exists() and (folder / "checkpoint.pt").exists()
    stamps = [p.stat().st_mtime_ns for p in shards]
    sequences = target_written_text(target, 40, seed=0, temperature=0.0)
    again = train_head(load_model(target, "float32"), sequences, folder, "test", SETTINGS, False)
    assert [p.stat().st_mtime_ns for p in shards] == stamps
    assert again["train_seconds"] == meta["train_seconds"]  # resumed at the last step
    assert again["val_agree"] == meta["val_agree"]


def test_a_run_from_another_head_starts_afresh(trained, tmp_path):
    """The finished checkpoint is of a run from scratch: the same settings from --init (a
    trained head) train anew instead of resuming it, on the cached features."""
    target, folder, meta = trained
    copy = tmp_path / "again"
    shutil.copytree(folder, copy)
    sequences = target_written_text(target, 40, seed=0, temperature=0.0)
    again = train_head(
        load_model(target, "float32"), sequences, copy, "test", SETTINGS, False, init=folder
    )
    # a resumed finished run writes no checkpoint: this one is the new run's, to its end
    saved = torch.load(copy / "checkpoint.pt", weights_only=False)
    assert saved["run"]["start"] == str(folder.resolve())
    assert saved["step"] == again["history"][-1]["step"] and len(again["history"]) == len(
        meta["history"]
    )


def test_inference_sees_what_training_saw(trained):
    """Each chain round's s-th guess, for s = 1..3 while the guesses before it were kept, is
    the training path's argmax of step s at the same position: the features reach the head
    at the right positions through the engine's rounds, and training's unrolled steps attend
    as drafting does (EagleHead.sequence). Mutation: with steps s > 1 attending to their
    own step's pairs (an earlier training scheme), the deeper guesses differ."""
    target, folder, _ = trained
    engine = Engine.from_pretrained(
        target=target, method="eagle", draft=str(folder), dtype="float32",
        num_speculative_tokens=3, tree="off", draft_quantization=None,
        free_drafts="off",  # every round the head's own
    )  # fmt: skip
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    model = load_model(target, "float32").model
    head = load_head(folder, model)
    prepare_target(model)
    model.feature_layers = head.cfg.feature_layers
    checked = [0, 0, 0]  # guesses compared at depths 1, 2, 3
    for prompt in random_prompts(3, seed=5):
        rounds = []
        out = engine.stream(prompt, params, on_round=rounds.append)
        sequence = prompt + [event.token_id for event in out]
        kept = sequence_data(model, [sequence])["kept"]  # [1, T, F]
        guesses = []  # guesses[s - 1][i]: step s's guess of token i + s + 1
        sequence = torch.tensor(sequence)
        with torch.no_grad():
            inputs, earlier = head.input_features(kept[:, :-1]), None
            for s in (1, 2, 3):
                t = sequence.shape[0] - s
                predicted, earlier = head.sequence(sequence[None, s:], inputs[:, :t], earlier)
                guesses.append(head.vocab[head.draft_logits(predicted[0]).argmax(-1)])
                inputs = predicted
        length = len(prompt) + 1
        for r in rounds:
            for depth in range(min(len(r.drafted), r.accepted + 1, 3)):
                assert r.drafted[depth] == int(guesses[depth][length - 2]), (r, depth)
                checked[depth] += 1
            length += r.accepted + 1
    assert checked[0] >= 10 and checked[1] >= 3 and checked[2] >= 1, checked


def test_train_head_and_generate_from_the_command_line(tiny_pair, tmp_path):
    target, _ = tiny_pair
    corpus = tmp_path / "corpus.py"
    corpus.write_text("def add(a, b):\n    return a + b\n\n" * 40)
    out = tmp_path / "head"
    common = ["--target", target, "--out", str(out), "--no-progress"]
    small = ["--tokens", "256", "--seq-len", "32", "--epochs", "1", "--intermediate-size", "32"]
    trained = cli("train-head", *common, "--data", str(corpus), *small, "--draft-vocab", "64")
    assert trained.returncode == 0, trained.stderr
    said = " ".join(trained.stderr.split())  # rich wraps long lines
    assert "--method eagle" in said and (out / "head.safetensors").exists()
    prompt = ["def add(a, b):", "--target", target, "--dtype", "float32", "--json"]
    fast = cli("generate", *prompt, "--method", "eagle", "--draft", str(out), "--max-tokens", "12")
    slow = cli("generate", *prompt, "--method", "none", "--max-tokens", "12")
    assert fast.returncode == 0, fast.stderr
    assert json.loads(fast.stdout)["token_ids"] == json.loads(slow.stdout)["token_ids"]
    bad = cli("train-head", *common, "--data", str(tmp_path / "missing"))
    assert bad.returncode == 2 and "no such file" in " ".join(bad.stderr.split())
    for option, value in (("--precision", "float8"), ("--feature-noise", "-1")):
        bad = cli("train-head", *common, option, value)
        assert bad.returncode == 2 and option in " ".join(bad.stderr.split()), bad.stderr
