"""method="auto", the default (engine/method_choice.py): the target's own head where one is
found for it, else the draft model; a named draft model wins; `inspect` says which."""

from __future__ import annotations

import pytest

from understudy import Engine
from understudy.engine.inspect import inspect_model
from understudy.engine.method_choice import head_for, resolve_method
from understudy.models.head_file import file_sha256, read_packed, shipped_head
from understudy.models.registry import DEFAULT_TARGET

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_method_asked_for_is_kept():
    for method in ("none", "draft", "ngram", "suffix", "hybrid", "eagle"):
        assert resolve_method(method, None, None) == (method, "asked for")


def test_the_packaged_target_gets_the_head_the_package_ships(tmp_path, monkeypatch):
    """By the packaged model's registered sha256, which is the one the shipped head records:
    no model is loaded, no file hashed."""
    monkeypatch.setenv("UNDERSTUDY_CACHE", str(tmp_path))  # no head trained into the cache
    _, sha256, _ = read_packed(shipped_head())
    assert file_sha256(DEFAULT_TARGET) == sha256
    assert head_for(DEFAULT_TARGET) == "the package"
    assert resolve_method("auto", None, None) == (
        "eagle",
        "the target's own head, from the package",
    )
    # a draft model named: the user chose it
    assert resolve_method("auto", None, "qwen2.5-coder-0.5b")[0] == "draft"
    # another packaged model: the head was not trained on it
    assert resolve_method("auto", "gemma3-270m", None) == (
        "draft",
        "no trained head for this target",
    )


def test_a_head_trained_into_the_cache_is_found(tiny_pair, tmp_path, monkeypatch):
    from understudy.drafters.eagle import default_head_dir
    from understudy.models.eagle_head import CONFIG_FILE

    monkeypatch.setenv("UNDERSTUDY_CACHE", str(tmp_path))
    target, _ = tiny_pair
    assert resolve_method("auto", target, None)[0] == "draft"
    folder = default_head_dir(target)
    folder.mkdir(parents=True)
    (folder / CONFIG_FILE).write_text("{}")  # where `understudy train-head` writes its head
    assert resolve_method("auto", target, None) == (
        "eagle",
        "the target's own head, from the cache",
    )


def test_the_default_engine_of_a_target_with_no_head_drafts_with_its_model(
    tiny_pair, tmp_path, monkeypatch
):
    monkeypatch.setenv("UNDERSTUDY_CACHE", str(tmp_path))
    target, draft = tiny_pair
    engine = Engine.from_pretrained(target=target, draft=draft, dtype="float32")
    assert engine.method == "draft"
    assert Engine.from_pretrained(target=target, method="ngram", dtype="float32").method == "ngram"


def test_inspect_says_what_the_default_builds(tiny_pair, tmp_path, monkeypatch):
    monkeypatch.setenv("UNDERSTUDY_CACHE", str(tmp_path))
    target, draft = tiny_pair
    report = inspect_model(target, draft=draft, dtype="float32")
    auto = report.methods[0]
    assert auto.method == "auto" and auto.runs
    assert auto.why == "the default: method draft (a draft model was named)"
    report = inspect_model(target, dtype="float32")
    assert report.methods[0].why == "the default: method draft (no trained head for this target)"
