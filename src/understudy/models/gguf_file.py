"""What a GGUF file holds, as the blocks path reads it: its tensor table, its scalar metadata,
and each tensor's data mapped (never copied) from the file.

gguf's reader parses every metadata value one by one in Python (a 151,936-token vocabulary
and its merges: ~20 s a file on a 2-core CPU, which a load paid twice), so the table and the
scalars are read once per file and kept as JSON beside the cached config (`read_layout`).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

LAYOUT_FILE = "layout.json"
# the element types GGUF stores as plain arrays (every other type: rows of block bytes)
PLAIN_TYPES = {
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}
Scalar = int | float | bool | str


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a GGUF file: where its data lies and how to read it."""

    name: str
    tensor_type: int  # ggml's type id
    shape: tuple[int, ...]  # GGUF's order, innermost dimension first
    offset: int  # of its data, in bytes from the file's start
    n_bytes: int


@dataclass(frozen=True)
class GGUFLayout:
    """A GGUF file's architecture, tensor table and scalar metadata (the tokenizer's and
    every array left out: the blocks path reads hyperparameters, not vocabularies)."""

    architecture: str | None
    tensors: tuple[TensorEntry, ...]
    metadata: dict[str, Scalar] = field(default_factory=dict)

    @classmethod
    def of(cls, reader: GGUFReader) -> GGUFLayout:
        field_ = reader.fields.get("general.architecture")
        entries = tuple(
            TensorEntry(
                t.name, int(t.tensor_type), tuple(int(d) for d in t.shape), int(t.data_offset),
                int(t.n_bytes),
            )
            for t in reader.tensors
        )  # fmt: skip
        metadata = {
            key: value.contents()
            for key, value in reader.fields.items()
            if not key.startswith(("tokenizer.", "GGUF."))
            and len(value.types) == 1
            and value.types[0] != GGUFValueType.ARRAY
        }
        return cls(None if field_ is None else str(field_.contents()), entries, metadata)

    def names(self) -> set[str]:
        return {t.name for t in self.tensors}

    def entry(self, name: str) -> TensorEntry:
        return next(t for t in self.tensors if t.name == name)


def read_layout(path: Path, cache: Path | None = None) -> GGUFLayout:
    """`path`'s layout, from `cache`/LAYOUT_FILE when there, else parsed (and kept there)."""
    kept = None if cache is None else cache / LAYOUT_FILE
    if kept is not None and kept.exists():
        raw = json.loads(kept.read_text())
        if "metadata" in raw:  # else kept by an older version: parse again
            entries = tuple(
                TensorEntry(**{**e, "shape": tuple(e["shape"])}) for e in raw["tensors"]
            )
            return GGUFLayout(raw["architecture"], entries, raw["metadata"])
    layout = GGUFLayout.of(GGUFReader(str(path)))
    if kept is not None:
        kept.parent.mkdir(parents=True, exist_ok=True)
        partial = kept.with_suffix(f".{os.getpid()}.partial")
        raw = {
            "architecture": layout.architecture,
            "tensors": [asdict(e) for e in layout.tensors],
            "metadata": layout.metadata,
        }
        partial.write_text(json.dumps(raw))
        partial.replace(kept)  # whole or absent: a reader never sees half a file
    return layout


@dataclass(frozen=True)
class MappedTensor:
    """A tensor's data mapped from the file, shaped as gguf's reader shapes it: rows of
    block bytes for block types, an array of its elements for the plain ones."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


def mapped_tensors(path: Path, layout: GGUFLayout) -> dict[str, MappedTensor]:
    """Every tensor of `path` by name, each a view of one read-only map of the file."""
    file = np.memmap(path, mode="r")
    out = {}
    for e in layout.tensors:
        kind = GGMLQuantizationType(e.tensor_type)
        dims = tuple(reversed(e.shape))
        raw = file[e.offset : e.offset + e.n_bytes]
        if kind in PLAIN_TYPES:
            data = raw.view(PLAIN_TYPES[kind]).reshape(dims)
        else:
            assert kind in GGML_QUANT_SIZES, kind
            data = raw.reshape(quant_shape_to_byte_shape(dims, kind))
        out[e.name] = MappedTensor(e.name, kind, e.shape, data)
    return out
