"""The GGUF container, read without the `gguf` library's reader: its header (fields and tensor
infos) parsed from a memory map in one pass, each tensor's bytes read when asked for.

The library's reader builds a numpy array for every string of the vocabulary: for a 150,000
token vocabulary about 8 s and 500 MB at its peak, twice over when the weights and the
tokenizer each open the file. Here the header costs a fraction of a second and the strings
themselves, and a tensor's bytes are read into memory of their own, so that loading holds
at most one tensor's bytes beyond what the model keeps (no file mapping left resident).
The layout is llama.cpp's (ggml/docs/gguf.md): magic "GGUF", version 2 or 3, the counts, the
key-value fields, the tensor infos, then the data at the alignment.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

# GGUFValueType -> (struct format, numpy dtype) of the scalar types
SCALARS = {
    GGUFValueType.UINT8: ("<B", np.uint8),
    GGUFValueType.INT8: ("<b", np.int8),
    GGUFValueType.UINT16: ("<H", np.uint16),
    GGUFValueType.INT16: ("<h", np.int16),
    GGUFValueType.UINT32: ("<I", np.uint32),
    GGUFValueType.INT32: ("<i", np.int32),
    GGUFValueType.FLOAT32: ("<f", np.float32),
    GGUFValueType.BOOL: ("<?", np.bool_),
    GGUFValueType.UINT64: ("<Q", np.uint64),
    GGUFValueType.INT64: ("<q", np.int64),
    GGUFValueType.FLOAT64: ("<d", np.float64),
}
DEFAULT_ALIGNMENT = 32


class GGUFFormatError(ValueError):
    """Bytes that are not a GGUF file, with where they stop being one."""


@dataclass(frozen=True)
class Tensor:
    """One tensor's info: its name, its shape in GGUF's order (the fastest dimension first:
    [inputs, outputs] for a matrix), its type, and where its bytes are."""

    path: Path
    name: str
    shape: tuple[int, ...]
    tensor_type: GGMLQuantizationType
    offset: int  # in the file
    nbytes: int

    @property
    def rows(self) -> int:
        """Every dimension but the first: a matrix's outputs."""
        return int(np.prod(self.shape[1:], dtype=np.int64))

    @property
    def data(self) -> np.ndarray:
        """The bytes [rows, bytes per row], read now."""
        return self.read(0, self.rows)

    def read(self, start: int, stop: int) -> np.ndarray:
        """Rows start..stop - 1's bytes [stop - start, bytes per row], read now."""
        stop = min(stop, self.rows)
        row = self.nbytes // self.rows
        count = (stop - start) * row
        raw = np.fromfile(self.path, np.uint8, count, offset=self.offset + start * row)
        if raw.size != count:
            raise GGUFFormatError(f"tensor {self.name} runs past the end of the file")
        return raw.reshape(stop - start, row)


@dataclass(frozen=True)
class GGUFFile:
    fields: dict[str, Any]
    tensors: list[Tensor]


def read_gguf(path: str | Path) -> GGUFFile:
    """The header of the file at `path`; GGUFFormatError (or OSError) where it is not one."""
    path = Path(path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
        try:
            return _Parser(view, path).file()
        except (struct.error, IndexError, ValueError, UnicodeDecodeError) as e:
            raise GGUFFormatError(f"not a GGUF file: {e}") from e


class _Parser:
    def __init__(self, view: mmap.mmap, path: Path):
        self.view, self.at, self.path = view, 0, path

    def unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.view, self.at)[0]
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        size = self.unpack("<Q")
        if self.at + size > len(self.view):
            raise GGUFFormatError(f"a string of {size} bytes at {self.at} past the end")
        text = self.view[self.at : self.at + size].decode("utf-8")
        self.at += size
        return text

    def value(self, kind: int) -> Any:
        kind = GGUFValueType(kind)
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind == GGUFValueType.ARRAY:
            item, count = GGUFValueType(self.unpack("<I")), self.unpack("<Q")
            if item in SCALARS:  # numbers: one read
                dtype = np.dtype(SCALARS[item][1])
                values = np.frombuffer(self.view, dtype, count, self.at).tolist()
                self.at += dtype.itemsize * count
                return values
            return [self.value(item) for _ in range(count)]
        return self.unpack(SCALARS[kind][0])

    def file(self) -> GGUFFile:
        if self.view[:4] != b"GGUF":
            raise GGUFFormatError("no GGUF magic")
        self.at = 4
        version = self.unpack("<I")
        if version not in (2, 3):
            raise GGUFFormatError(f"GGUF version {version} (2 and 3 are read)")
        n_tensors, n_fields = self.unpack("<Q"), self.unpack("<Q")
        fields = {}
        for _ in range(n_fields):
            key = self.string()
            fields[key] = self.value(self.unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self.string()
            dims = tuple(self.unpack("<Q") for _ in range(self.unpack("<I")))
            kind = self.unpack("<I")
            if kind not in GGMLQuantizationType._value2member_map_:
                raise GGUFFormatError(f"tensor {name} has type {kind}, which GGUF does not know")
            infos.append((name, dims, GGMLQuantizationType(kind), self.unpack("<Q")))
        align = int(fields.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-self.at // align) * align
        return GGUFFile(fields, [self.tensor(start, *info) for info in infos])

    def tensor(
        self, start: int, name: str, dims: tuple[int, ...], kind: GGMLQuantizationType, at: int
    ) -> Tensor:
        block, size = GGML_QUANT_SIZES[kind]
        if not dims or dims[0] % block:
            raise GGUFFormatError(f"tensor {name}: shape {dims} is not whole blocks of {kind.name}")
        nbytes = int(np.prod(dims, dtype=np.int64)) // block * size
        return Tensor(self.path, name, dims, kind, start + at, nbytes)
