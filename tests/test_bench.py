"""`understudy bench` on tiny models, and the shipped prompt sets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from understudy.bench.against_llama_cpp import against_llama_cpp, against_markdown, interleaved_tg
from understudy.bench.engines import parse_methods
from understudy.bench.prompts import SHIPPED_SETS, load_prompt_file, load_prompts
from understudy.bench.summary import implied_alpha
from understudy.cli.bench import INTERRUPTED_EXIT_CODE, bench
from understudy.config import UnderstudyError
from understudy.drafters import DRAFTERS
from understudy.engine.draft_setup import DEFAULT_CPU_DRAFT_QUANTIZATION
from understudy.policy.theory import expected_tokens_per_round

TWO_PROMPTS = [
    {"id": "c1", "category": "completion", "prompt": "def add(a, b):"},
    {
        "id": "e1",
        "category": "editing",
        "messages": [
            {"role": "user", "content": "Rename x to i:\nfor x in range(10):\n    print(x)"}
        ],
    },
]


def app() -> typer.Typer:
    a = typer.Typer()
    a.command()(bench)
    return a


@pytest.fixture
def prompt_file(tmp_path: Path) -> Path:
    path = tmp_path / "two.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in TWO_PROMPTS))
    return path


def invoke(tiny_pair, prompt_file: Path, out: Path, *extra: str):
    target, draft = tiny_pair
    args = [
        "--prompts", str(prompt_file), "--target", target, "--draft", draft,
        "--dtype", "float32", "--max-tokens", "8", "--max-context", "256",
        "--out", str(out), "--no-progress", *extra,
    ]  # fmt: skip
    return CliRunner().invoke(app(), args)


def tiny_head(target: str, folder: Path) -> Path:
    """A barely trained method=eagle head for the tiny target (enough to run, not to guess)."""
    import torch

    from understudy.head.pipeline import HeadSettings, train_head
    from understudy.head.train import TrainConfig
    from understudy.models.loader import load_model

    sequences = torch.randint(1, 300, (4, 16), generator=torch.Generator().manual_seed(0))
    settings = HeadSettings(32, 64, TrainConfig(epochs=1, batch=2, warmup=1))
    train_head(load_model(target, "float32"), sequences.tolist(), folder, "t", settings, False)
    return folder


def test_bench_tiny_end_to_end(tiny_pair, prompt_file, tmp_path):
    out = tmp_path / "results"
    head = tiny_head(tiny_pair[0], tmp_path / "head")
    # every registered method (eagle with its head), and one with a fixed K
    methods = [m if m != "eagle" else f"eagle:head={head}" for m in DRAFTERS] + ["draft:k=2"]
    result = invoke(tiny_pair, prompt_file, out, "--methods", ",".join(methods), "--compare", "hf")
    assert result.exit_code == 0, result.output
    res = json.loads((out / "results.json").read_text())
    labels = ["none", *methods, "hf-plain", "hf-assisted", "hf-lookup"]
    assert res["schema"] == "understudy-bench/1"
    assert res["labels"] == labels
    assert res["categories"] == ["completion", "editing"]
    assert res["complete"] and not res["interrupted"]
    assert len(res["runs"]) == res["planned_runs"] == 2 * len(labels)
    assert res["command"].startswith("understudy bench --prompts")
    for run in res["runs"]:
        assert run["identical"] is True, (run["label"], run["prompt_id"])  # greedy: lossless
        assert 1 <= len(run["token_ids"]) <= 8
    for label in labels:
        for cat in ("completion", "editing", "all"):
            s = res["summary"][label][cat]
            assert s["all_identical"] is True
            assert s["speedup"]["median"] > 0 and s["tokens_per_s"]["median"] > 0
    assert res["summary"]["none"]["all"]["speedup"]["median"] == pytest.approx(1.0)
    fixed = res["summary"]["draft:k=2"]["all"]
    assert fixed["drafted"] > 0 and 0 <= fixed["acceptance_rate"] <= 1
    assert fixed["tokens_per_pass"] > 1.0
    assert 1 <= len(fixed["per_position_acceptance"]) <= 2
    assert fixed["c"] > 0 and fixed["alpha_implied"] is not None
    assert res["engines"]["draft:k=2"]["k"] == 2
    assert res["engines"]["draft"]["draft_quantization"] == DEFAULT_CPU_DRAFT_QUANTIZATION
    for name in ("speedup.png", "acceptance_per_position.png", "theory.png"):
        assert (out / name).stat().st_size > 1000
    assert res["plots"] == ["speedup.png", "acceptance_per_position.png", "theory.png"]
    assert "| completion | draft:k=2 |" in (out / "results.md").read_text()
    assert "draft:k=2" in result.output  # the rich table


def test_bench_ctrl_c_keeps_results_and_resumes(tiny_pair, prompt_file, tmp_path, monkeypatch):
    from understudy.bench.run import Bench

    original, calls = Bench._one, []

    def flaky(self, label, p, ids, params):
        calls.append(label)
        if len(calls) == 6:  # the warm-up takes 2 calls, then 3 runs complete
            raise KeyboardInterrupt
        return original(self, label, p, ids, params)

    monkeypatch.setattr(Bench, "_one", flaky)
    out = tmp_path / "results"
    result = invoke(tiny_pair, prompt_file, out, "--methods", "none,draft:k=2")
    assert result.exit_code == INTERRUPTED_EXIT_CODE, result.output
    res = json.loads((out / "results.json").read_text())
    assert res["interrupted"] and not res["complete"]
    assert len(res["runs"]) == 3 and res["planned_runs"] == 4
    assert (out / "speedup.png").exists()

    monkeypatch.setattr(Bench, "_one", original)
    result = invoke(tiny_pair, prompt_file, out, "--methods", "none,draft:k=2", "--resume")
    assert result.exit_code == 0, result.output
    res = json.loads((out / "results.json").read_text())
    assert res["complete"] and res["resumed_runs"] == 2  # c1 finished; e1 is run again
    assert sorted((r["prompt_id"], r["label"]) for r in res["runs"]) == [
        ("c1", "draft:k=2"), ("c1", "none"), ("e1", "draft:k=2"), ("e1", "none"),
    ]  # fmt: skip


def test_bench_bad_input_is_one_line(tiny_pair, prompt_file, tmp_path):
    result = invoke(tiny_pair, prompt_file, tmp_path, "--methods", "none,telepathy")
    assert result.exit_code == 2
    assert "unknown method 'telepathy'" in result.output
    result = invoke(tiny_pair, prompt_file, tmp_path, "--methods", "none", "--compare", "vllm")
    assert result.exit_code == 2
    assert "--compare takes hf, llama.cpp or a comma list" in result.output


def test_bench_one_peer_only(tiny_pair, prompt_file, tmp_path):
    out = tmp_path / "one-peer"
    result = invoke(tiny_pair, prompt_file, out, "--methods", "none", "--compare", "hf-lookup")
    assert result.exit_code == 0, result.output
    res = json.loads((out / "results.json").read_text())
    assert sorted({r["label"] for r in res["runs"]}) == ["hf-lookup", "none"]


def test_serving_mode_drives_real_servers(tiny_pair, prompt_file, tmp_path):
    """`--concurrency`: a real server per method, the same requests at each level, every
    greedy answer identical to the first method's at one client; table, JSON and plot."""
    out = tmp_path / "serving"
    result = invoke(tiny_pair, prompt_file, out, "--concurrency", "1,3", "--requests", "3")
    assert result.exit_code == 0, result.output
    res = json.loads((out / "serving.json").read_text())
    levels = [(lv["method"], lv["concurrency"]) for lv in res["levels"]]
    assert levels == [("none", 1), ("none", 3), ("draft", 1), ("draft", 3)]
    for level in res["levels"]:
        assert level["requests"] == 3 and level["tokens"] == 3 * 8  # EOS ignored
        assert level["identical"] is True
        assert 0 < level["ttft_p50_s"] <= level["latency_p50_s"] <= level["latency_p95_s"]
    assert res["servers"]["draft"]["max_num_seqs"] == 3
    assert (out / "throughput.png").stat().st_size > 0 and "| none | 3 |" in (
        out / "serving.md"
    ).read_text()


def test_serving_mode_refuses_what_it_cannot_do(tiny_pair, prompt_file, tmp_path):
    for extra, message in (
        (("--concurrency", "1,x"), "--concurrency takes integers"),
        (("--concurrency", "0"), "integers >= 1"),
        (("--concurrency", "2", "--methods", "none,telepathy"), "got 'telepathy'"),
        (("--concurrency", "2", "--compare", "hf"), "does not take --compare"),
        (("--requests", "4",), "--requests belongs to serving mode"),
    ):  # fmt: skip
        result = invoke(tiny_pair, prompt_file, tmp_path, *extra)
        assert result.exit_code == 2 and message in result.output, (extra, result.output)


@pytest.mark.parametrize("name", SHIPPED_SETS)
def test_shipped_prompt_sets(name):
    prompts = load_prompt_file(name)
    assert len(prompts) >= 20
    assert all(p.category == name for p in prompts)
    assert len({p.id for p in prompts}) == len(prompts)
    if name == "completion":
        assert all(isinstance(p.prompt, str) for p in prompts)
    else:  # chat-format tasks
        assert all(p.is_chat and p.prompt[-1]["role"] == "user" for p in prompts)
    if name in ("editing", "summarize"):  # the task's material is inside the prompt
        assert all(len(p.prompt[-1]["content"]) > 200 for p in prompts)


def test_default_subset_and_unique_ids():
    everything = load_prompts()
    assert len({p.id for p in everything}) == len(everything)
    subset = load_prompts(per_category=3)
    assert [p.category for p in subset] == [c for c in SHIPPED_SETS for _ in range(3)]


def test_prompt_file_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "category": "x", "prompt": "hi"}\n{"id": "a", "category": "x"}\n')
    with pytest.raises(UnderstudyError, match="bad.jsonl:2: give exactly one of"):
        load_prompt_file(bad)
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"id": "a", "category": "x", "prompt": "hi"}\n' * 2)
    with pytest.raises(UnderstudyError, match="appears twice"):
        load_prompts([str(dup)])
    with pytest.raises(UnderstudyError, match="not found"):
        load_prompt_file(tmp_path / "missing.jsonl")


def test_parse_methods():
    specs = parse_methods("draft:k=2,draft,none", "auto")
    assert [s.label for s in specs] == ["none", "draft:k=2", "draft"]
    assert [s.k for s in specs] == [0, 2, "auto"]
    assert parse_methods("draft", 3)[0].label == "none"  # the baseline is always run
    with pytest.raises(UnderstudyError, match="listed twice"):
        parse_methods("draft,draft", "auto")
    with pytest.raises(UnderstudyError, match="key=value"):
        parse_methods("draft:fast", "auto")


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.8, 0.97])
def test_implied_alpha_inverts_eq1(alpha):
    assert implied_alpha(expected_tokens_per_round(alpha, 4), 4) == pytest.approx(alpha, abs=1e-6)


def _decode_summary(rates: dict[str, float]) -> dict:
    return {label: {"all": {"decode_tokens_per_s": {"median": v}}} for label, v in rates.items()}


def test_against_llama_cpp_takes_its_fastest_plain_and_best():
    """llama.cpp's plain decoding is the faster of llama-completion and the interleaved
    llama-bench tg mean; its best the faster of that and its speculative example."""
    tg = interleaved_tg([{"tokens_per_s": v} for v in (18.0, 20.0, 22.0)])
    assert tg == {"mean": 20.0, "sd": 2.0, "n": 3}
    summary = _decode_summary(
        {"none": 22.0, "draft": 31.0, "llama.cpp-plain": 16.0, "llama.cpp-draft": 12.0}
    )
    fig = against_llama_cpp(summary, ["none", "draft"], "llama.cpp-plain", ["llama.cpp-draft"], tg)
    assert fig["llama_plain"] == {"source": "llama-bench tg", "decode_tokens_per_s": 20.0}
    assert fig["llama_best"]["source"] == "llama-bench tg"
    assert fig["ours"]["none"]["over_llama_plain"] == pytest.approx(1.1)
    assert fig["ours"]["draft"]["over_llama_best"] == pytest.approx(1.55)
    md = against_markdown(fig, tg)
    assert "| draft | 31.00 | 1.55× | 1.55× |" in md and "20.00 ± 2.00 tok/s over 3" in md

    # a speculative example faster than both plain measures is the best; without the
    # llama-bench samples, llama-completion is the plain reference
    summary = _decode_summary({"draft": 30.0, "llama.cpp-plain": 15.0, "llama.cpp-draft": 24.0})
    fig = against_llama_cpp(summary, ["draft"], "llama.cpp-plain", ["llama.cpp-draft"], None)
    assert fig["llama_plain"]["source"] == "llama.cpp-plain"
    assert fig["llama_best"] == {"source": "llama.cpp-draft", "decode_tokens_per_s": 24.0}
    assert fig["ours"]["draft"]["over_llama_plain"] == pytest.approx(2.0)
    assert fig["ours"]["draft"]["over_llama_best"] == pytest.approx(1.25)
    assert against_llama_cpp(_decode_summary({"draft": 30.0}), ["draft"], None, [], None) is None
