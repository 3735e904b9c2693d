"""`understudy inspect`: what it says of a model is what loading and building an engine does.

Each verdict is checked against the real thing on tiny models made here: the path and dtype
against load_model, the pass shape, the KV bytes (engine/seats.kv_bytes over the runner's
own cache) and stats.exact against a built engine, the tensor counts and bytes against
gguf's own reader, the weights' bytes against the loaded model's tensors, the draft's
verdict against draft_setup.check_compatible on the loaded pair, eagle's head against
find_head. The command runs as a subprocess once, and bad input exits non-zero in one line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader

from gguf_helpers import MIXED_LAYER_TYPES, write_gguf_from_hf, write_tiny_qwen2_gguf
from test_fallback import SMALL
from test_fallback import make_hf as make_other
from understudy import Engine, SamplingParams
from understudy.config import UnderstudyError
from understudy.drafters.eagle import default_head_dir
from understudy.engine.draft_setup import check_compatible
from understudy.engine.inspect import InspectReport, inspect_model
from understudy.engine.pass_shape import default_verify_rows
from understudy.engine.seats import kv_bytes
from understudy.kernels import qgemm
from understudy.kernels.qgemm import QuantLinear
from understudy.models.gguf_weights import ARCHITECTURES
from understudy.models.hf_fallback import FallbackLM
from understudy.models.loader import load_model

pytestmark = pytest.mark.usefixtures("one_thread")
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
SRC = str(Path(__file__).resolve().parents[1] / "src")
needs_qgemm = pytest.mark.skipif(not qgemm.available(), reason="qgemm cannot be built here")


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> str:
    """Blocks of five kernel types and one float32 matrix, which rowgemm runs as it is."""
    path = tmp_path_factory.mktemp("inspect") / "tiny.gguf"
    return str(write_tiny_qwen2_gguf(path, layer_types=MIXED_LAYER_TYPES))


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory) -> str:
    """A model our Transformer refuses: it runs on transformers' own code."""
    folder = tmp_path_factory.mktemp("inspect") / "gpt2"
    make_other("GPT2Config", dict(SMALL)).save_pretrained(folder)
    return str(folder)


def engine_agrees(
    report: InspectReport, spec: str, max_context: int = 64, **options: object
) -> None:
    """An engine built as inspect assumes has the report's path, dtype, passes, context,
    KV cache and stats.exact."""
    engine = Engine.from_pretrained(
        target=spec, method="ngram", num_speculative_tokens=2, max_context=max_context, **options
    )
    model, runner = engine.runner.model, engine.runner
    assert report.path == (
        "blocks" if engine.target.from_blocks
        else "transformers" if isinstance(model, FallbackLM) else "dense"
    )  # fmt: skip
    assert report.dtype == str(model.dtype).removeprefix("torch.")
    assert (report.pass_rows, report.padded) == (runner.rows, runner.pad)
    assert report.context == engine.max_context
    assert report.kv_bytes_per_token == kv_bytes(model, 1)
    assert report.kv_bytes == kv_bytes(model, runner.slots)
    assert report.exact == engine.generate([5, 6, 7, 5, 6], GREEDY).stats.exact


@needs_qgemm
def test_gguf_from_its_blocks(gguf_file):
    report = inspect_model(gguf_file, max_context=64)
    assert report.path == "blocks" and report.blocks_refused is None and report.exact
    assert (report.family, report.layers, report.vocab_size) == ("qwen2", 2, 320)
    engine_agrees(report, gguf_file)


def test_tensor_groups_against_ggufs_reader(gguf_file):
    report = inspect_model(gguf_file, max_context=64)
    reader = GGUFReader(gguf_file)
    count, size = Counter(), Counter()
    for t in reader.tensors:
        count[t.tensor_type.name] += 1
        size[t.tensor_type.name] += int(t.n_bytes)
    got_count, got_size = Counter(), Counter()
    for group in report.tensors:
        got_count[group.type] += group.count
        got_size[group.type] += group.file_bytes
        kernel = GGMLQuantizationType[group.type] in qgemm.KERNEL_TYPES
        assert (group.runs == "blocks") == (kernel and group.runs != "vector"), group
    assert (got_count, got_size) == (count, size)
    assert {g.type for g in report.tensors if g.runs == "float32"} == {"F32"}


@needs_qgemm
def test_weights_bytes_are_what_the_blocks_path_holds(gguf_file):
    """The file's tensors as build_from_gguf holds them: kernel panels, float32 parts, and the
    norms and biases (the tiny file's head is its own tensor, not the embedding's)."""
    model = load_model(gguf_file).model
    held = sum(p.nbytes for p in model.parameters())  # the norms
    for module in model.modules():
        if isinstance(module, QuantLinear):
            held += sum(panel.nbytes for panel in module.packed)
            held += sum(part.packed.nbytes for part in module.dense.values())
            held += 0 if module.bias is None else module.bias.nbytes
    assert inspect_model(gguf_file).weights_bytes == held


def test_hugging_face_folder_dense(tiny_pair):
    target = tiny_pair[0]
    for dtype in ("float32", "bfloat16"):  # row-invariant passes, padded passes
        report = inspect_model(target, dtype=dtype, max_context=64)
        assert report.path == "dense" and report.tensors == [] and report.blocks_refused is None
        engine_agrees(report, target, dtype=dtype)
    model = load_model(target, dtype="float32").model
    unique = {p.data_ptr(): p.nbytes for p in model.parameters()}
    assert inspect_model(target, dtype="float32").weights_bytes == sum(unique.values())


def test_context_lowered_where_the_rope_changes_with_length(tmp_path):
    from test_architectures import make_hf

    folder = tmp_path / "llama-dynamic"
    make_hf("llama-dynamic").save_pretrained(folder)
    report = inspect_model(str(folder), dtype="float32", max_context=1024)
    assert report.rope_scaling["kind"] == "dynamic"
    assert report.context == report.context_length < report.max_context == 1024
    engine_agrees(report, str(folder), max_context=1024, dtype="float32")


def test_fallback_and_its_exactness(gpt2_dir, monkeypatch):
    report = inspect_model(gpt2_dir, dtype="float32", max_context=64)
    assert report.path == "transformers" and "'gpt2'" in report.why_path
    engine_agrees(report, gpt2_dir, dtype="float32")
    eagle = next(m for m in report.methods if m.method == "eagle")
    assert not eagle.runs and "hidden states" in eagle.why
    # without rowgemm, float32 passes are padded torch matmuls: the engine says inexact
    monkeypatch.setenv("UNDERSTUDY_ROWGEMM", "0")
    report = inspect_model(gpt2_dir, dtype="float32", max_context=64)
    assert not report.exact and "rowgemm" in report.why_inexact
    engine_agrees(report, gpt2_dir, dtype="float32")


def test_why_a_gguf_runs_dense(gguf_file, tmp_path, monkeypatch):
    report = inspect_model(gguf_file, dtype="bfloat16")
    assert report.path == "dense" and "float32, not bfloat16" in report.blocks_refused
    assert report.why_path.endswith(report.blocks_refused)
    monkeypatch.setenv("UNDERSTUDY_QGEMM", "0")  # what a machine without a C compiler sees
    report = inspect_model(gguf_file, max_context=64)
    assert report.path == "dense" and "cannot be built" in report.blocks_refused
    assert not load_model(gguf_file, dtype="float32").from_blocks


def test_on_cuda_a_gguf_runs_dense(gguf_file):
    """Nothing is placed on the device, so this needs no GPU: the rules read its type."""
    cuda = torch.device("cuda")
    report = inspect_model(gguf_file, dtype="float32", device="cuda", max_context=64)
    assert report.path == "dense" and "not cuda" in report.blocks_refused
    assert (report.pass_rows, report.padded) == (default_verify_rows(torch.float32, cuda), True)


def test_an_architecture_without_a_blocks_path(tmp_path):
    from test_architectures import make_hf
    from test_gguf_architectures import CASES

    arch = next((a for a in CASES if a not in ARCHITECTURES), None)
    if arch is None:
        pytest.skip("every GGUF architecture written here runs from its blocks")
    name, overrides = CASES[arch]
    path = str(write_gguf_from_hf(make_hf(name, **overrides), tmp_path / f"{arch}.gguf", arch))
    report = inspect_model(path, max_context=64)
    assert report.path == "dense" and report.family == arch
    assert f"{arch!r} cannot run from its blocks" in report.blocks_refused
    engine_agrees(report, path)


def test_draft_verdicts_follow_check_compatible(tiny_pair, tmp_path):
    target, draft = tiny_pair
    report = inspect_model(target, draft=draft, dtype="float32")
    assert report.draft.compatible and report.draft.path == "dense"
    assert all(m.runs for m in report.methods if m.method in ("draft", "hybrid"))
    other = str(write_tiny_qwen2_gguf(tmp_path / "eos5.gguf", eos=5))  # another end of text
    report = inspect_model(target, draft=other, dtype="float32")
    with pytest.raises(UnderstudyError) as refusal:
        check_compatible(load_model(target, "float32"), load_model(other, "float32"))
    assert report.draft.compatible is False and report.draft.why == str(refusal.value)
    draft_method = next(m for m in report.methods if m.method == "draft")
    assert not draft_method.runs and str(refusal.value) in draft_method.why
    assert inspect_model(target).draft.model is None  # no default draft for this target


def test_eagle_runs_where_a_head_is_found(tiny_pair):
    from test_bench import tiny_head

    target = tiny_pair[0]
    assert inspect_model(target).eagle_head is None
    folder = default_head_dir(target)
    try:
        tiny_head(target, folder)
        report = inspect_model(target, dtype="float32")
        eagle = next(m for m in report.methods if m.method == "eagle")
        assert eagle.runs and report.eagle_head == str(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def run_cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PYTHONPATH": SRC, "COLUMNS": "400", **env}
    command = [sys.executable, "-m", "understudy.cli", "inspect", *args]
    return subprocess.run(command, capture_output=True, text=True, env=environ, timeout=300)


def test_cli_json(gguf_file):
    done = run_cli(gguf_file, "--json", "--max-context", "64")
    assert done.returncode == 0, done.stderr
    payload = json.loads(done.stdout)
    assert set(payload) == {f.name for f in fields(InspectReport)}
    assert payload == json.loads(json.dumps(inspect_model(gguf_file, max_context=64).to_dict()))
    summary = run_cli(gguf_file)
    assert summary.returncode == 0 and "exact" in summary.stdout and "Q6_K" in summary.stdout


@pytest.mark.parametrize(
    "spec, env, reason",
    [
        ("missing/model.gguf", {}, "GGUF file not found: missing/model.gguf"),
        ("no-such-model", {}, "unknown model 'no-such-model'"),
        ("someone/no-such-model", {"HF_HUB_OFFLINE": "1"}, "could not load model"),
    ],
)
def test_bad_input_fails_in_one_line(spec, env, reason):
    done = run_cli(spec, **env)
    assert done.returncode == 2 and done.stdout == ""
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: ") and reason in lines[-1], done.stderr
    assert "Traceback" not in done.stderr


def test_a_packaged_model_not_fetched_is_refused_unless_asked(tmp_path, monkeypatch):
    monkeypatch.setenv("UNDERSTUDY_CACHE", str(tmp_path))
    with pytest.raises(UnderstudyError, match="--fetch"):
        inspect_model("gemma3-270m")


def test_importable_without_the_server_extras():
    blocked = "fastapi uvicorn xgrammar prometheus_client ray matplotlib".split()
    code = f"import sys; sys.modules.update(dict.fromkeys({blocked!r})); "
    code += "import understudy.engine.inspect, understudy.cli.inspect"
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": SRC})
    assert done.returncode == 0


@pytest.mark.e2e
def test_packaged_target():
    from understudy.models.fetch import gguf_path
    from understudy.models.registry import DEFAULT_TARGET, PACKAGED_MODELS

    path = gguf_path(PACKAGED_MODELS[DEFAULT_TARGET])
    if not path.exists():
        pytest.skip("the packaged target is not in the cache")
    report = inspect_model(DEFAULT_TARGET)
    assert (report.family, report.layers, report.heads, report.kv_heads) == ("qwen2", 28, 12, 2)
    assert report.path == ("blocks" if qgemm.available() else "dense")
    kinds = Counter(t.tensor_type.name for t in GGUFReader(str(path)).tensors)
    counted = Counter()
    for group in report.tensors:
        counted[group.type] += group.count
    assert counted == kinds
    assert report.draft.compatible and report.draft.model == "qwen2.5-coder-0.5b"
    assert report.methods[0].why.startswith("the default: method eagle")  # the head it ships
    element = torch.float32.itemsize if report.path == "blocks" else 2
    assert report.kv_bytes_per_token == 2 * 28 * 2 * 128 * element  # K and V, layers, kv heads
