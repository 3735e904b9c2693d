"""The vLLM peer of the serving benchmark (bench/vllm_peer.py): its labels, the command line
it builds, its environment, the error when vLLM is not installed, and its rows in the report.
The last test runs real vLLM on the tiny pair; it is skipped unless $UNDERSTUDY_VLLM_PYTHON
names a python with vLLM."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from understudy.bench import serving_report, vllm_peer
from understudy.bench.vllm_peer import VllmSetup
from understudy.cli.bench import bench
from understudy.config import UnderstudyError

SETUP = VllmSetup("/envs/vllm/bin/python", "0.0.0", "/cache/target-bf16", "/cache/draft-bf16",
                  "target.gguf dequantized to bfloat16", "draft.gguf dequantized to bfloat16")  # fmt: skip


def app() -> typer.Typer:
    a = typer.Typer()
    a.command()(bench)
    return a


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_labels():
    assert vllm_peer.vllm_labels(["vllm"]) == ["vllm-plain", "vllm-draft"]
    assert vllm_peer.vllm_labels(["vllm-ngram:k=3", "vllm", "vllm-plain"]) == [
        "vllm-ngram:k=3", "vllm-plain", "vllm-draft"
    ]  # fmt: skip
    for bad, message in (("vllm-beam", "unknown vLLM peer"), ("vllm-draft:k=0", "k must be"),
                         ("vllm-plain:k=2", "takes no k")):  # fmt: skip
        with pytest.raises(UnderstudyError, match=message):
            vllm_peer.vllm_labels([bad])
    assert vllm_peer.is_vllm("vllm") and vllm_peer.is_vllm("vllm-draft:k=2")
    assert not vllm_peer.is_vllm("hf") and not vllm_peer.is_vllm("llama.cpp")


def test_command_plain_and_draft():
    plain = vllm_peer.command(SETUP, "vllm-plain", 8123, max_num_seqs=8, max_context=4096, seed=0)
    assert plain[:3] == [SETUP.python, "-m", "vllm.entrypoints.openai.api_server"]
    assert flag(plain, "--model") == SETUP.target and flag(plain, "--host") == "127.0.0.1"
    assert flag(plain, "--port") == "8123" and flag(plain, "--max-num-seqs") == "8"
    assert flag(plain, "--max-model-len") == "4096" and flag(plain, "--dtype") == "bfloat16"
    assert flag(plain, "--generation-config") == "vllm"  # the request's defaults, not the model's
    assert flag(plain, "--served-model-name") == vllm_peer.SERVED_NAME
    assert "--speculative-config" not in plain
    draft = vllm_peer.command(SETUP, "vllm-draft:k=3", 8123, 8, 4096, 0)
    spec = json.loads(flag(draft, "--speculative-config"))
    assert spec == {"method": "draft_model", "num_speculative_tokens": 3, "model": SETUP.draft}
    ngram = json.loads(flag(vllm_peer.command(SETUP, "vllm-ngram", 1, 1, 64, 0), "--speculative-config"))  # fmt: skip
    assert ngram["method"] == "ngram" and ngram["num_speculative_tokens"] == vllm_peer.DRAFT_K


def test_environment_binds_every_core_and_yields_to_the_callers(tmp_path, monkeypatch):
    for name in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU", "LD_PRELOAD",
                 "VLLM_CPU_KVCACHE_SPACE"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "bin").mkdir()
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    env = vllm_peer.environment(str(tmp_path / "bin" / "python"), cores=2)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert env["LD_PRELOAD"] == str(tmp_path / "lib" / "libiomp5.so")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    assert "VLLM_CPU_OMP_THREADS_BIND" not in vllm_peer.environment(str(tmp_path / "x"), cores=2)
    record = vllm_peer.describe(SETUP, "vllm-draft", env)
    assert str(tmp_path) not in json.dumps(record) and "/cache/" not in json.dumps(record)
    assert record["speculative_config"]["model"] == "draft.gguf dequantized to bfloat16"


def test_not_installed_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.delenv(vllm_peer.PYTHON_ENV, raising=False)
    with pytest.raises(UnderstudyError, match=f"not installed: .*{vllm_peer.PYTHON_ENV}="):
        vllm_peer.prepare(["vllm-plain"], None, None)
    monkeypatch.setenv(vllm_peer.PYTHON_ENV, str(tmp_path / "missing" / "python"))
    with pytest.raises(UnderstudyError, match="is not a file"):
        vllm_peer.find_python()


def test_python_without_vllm_is_a_clear_error():
    try:
        import vllm  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("vLLM is importable here")
    with pytest.raises(UnderstudyError, match="vLLM does not import under .*No module named"):
        vllm_peer.vllm_version(sys.executable)


def test_cli_serving_compare(tiny_pair, tmp_path, monkeypatch):
    """--compare vllm without vLLM: one line, status 2, before any server starts; --compare
    with another peer is refused in serving mode."""
    monkeypatch.delenv(vllm_peer.PYTHON_ENV, raising=False)
    target, draft = tiny_pair
    base = ["--target", target, "--draft", draft, "--concurrency", "1", "--out", str(tmp_path)]
    result = CliRunner().invoke(app(), [*base, "--compare", "vllm"])
    assert result.exit_code == 2 and "not installed" in result.output, result.output
    assert not list(tmp_path.glob("server-*.log"))
    result = CliRunner().invoke(app(), [*base, "--compare", "vllm,hf"])
    assert result.exit_code == 2 and "does not take --compare vllm,hf" in result.output
    result = CliRunner().invoke(app(), [*base, "--compare", "vllm-beam"])
    assert result.exit_code == 2 and "unknown vLLM peer" in result.output


def test_report_rows_of_a_peer(tmp_path):
    level = {"concurrency": 1, "tok_s": 10.0, "latency_p50_s": 1.0, "latency_p95_s": 1.0,
             "ttft_p50_s": 0.1, "ttft_p95_s": 0.1}  # fmt: skip
    results = {
        "date": "2026-01-01 00:00",
        "config": {"requests": 2, "max_tokens": 8, "temperature": 0.0},
        "levels": [
            {**level, "method": "none", "identical": True, "identical_same_engine": True},
            {**level, "method": "vllm-plain", "tok_s": 5.0, "identical": False,
             "identical_same_engine": True},
        ],  # fmt: skip
        "servers": {"none": {"model": "m"}, "vllm-plain": vllm_peer.describe(SETUP, "vllm-plain", {})},
    }  # fmt: skip
    rows = serving_report.rows(results)
    assert rows[1][0] == "vllm-plain" and rows[1][4] == "0.50x"
    assert rows[1][-1] == "NO (own engine: yes)" and rows[0][-1] == "yes"
    text = serving_report.markdown(results)
    assert "- vllm-plain: vLLM 0.0.0, target.gguf dequantized to bfloat16, plain decoding" in text
    assert serving_report.plot(results, tmp_path).stat().st_size > 0


def tiny_target(folder: Path) -> str:
    """A tiny Qwen2 whose heads are 64 wide: vLLM's CPU attention refuses conftest's 16
    ("Unsupported CPU attention configuration: head_dim=16")."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from conftest import TINY_VOCAB, make_tiny_tokenizer

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=TINY_VOCAB, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=512, eos_token_id=0)  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(folder)
    make_tiny_tokenizer(folder)
    return str(folder)


@pytest.mark.skipif(not os.environ.get(vllm_peer.PYTHON_ENV), reason="vLLM is not installed")
def test_real_vllm_beside_ours(tmp_path):
    """Ours and vLLM's server on a tiny target, the same completion requests."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "c1", "category": "completion", "prompt": "def f(x):"}))
    target = tiny_target(tmp_path / "target")
    out = tmp_path / "out"
    args = ["--prompts", str(prompts), "--target", target, "--dtype", "float32",
            "--max-tokens", "8", "--max-context", "256", "--methods", "none",
            "--concurrency", "1,2", "--requests", "2", "--compare", "vllm-plain", "--out", str(out)]  # fmt: skip
    result = CliRunner().invoke(app(), args)
    assert result.exit_code == 0, result.output
    res = json.loads(Path(out / "serving.json").read_text())
    assert [lv["method"] for lv in res["levels"]] == ["none", "none", "vllm-plain", "vllm-plain"]
    assert all(lv["tokens"] == 2 * 8 for lv in res["levels"])  # EOS ignored by both
    assert res["servers"]["vllm-plain"]["engine"] == "vllm"
