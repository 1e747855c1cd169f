"""Parsing a GGUF file: header, metadata key/values, tensor infos, and the mapped data section.

The layout (llama.cpp's docs/gguf.md, ggml/include/gguf.h), all little-endian:

    magic "GGUF" | version u32 (2 or 3) | tensor_count u64 | kv_count u64
    kv_count x  (key: string, value_type u32, value)
    tensor_count x  (name: string, n_dims u32, ne u64[n_dims], ggml_type u32, offset u64)
    padding to `general.alignment` (default 32)
    data section: each tensor at data_start + offset, offsets aligned, tensors padded

A string is a u64 byte length and UTF-8 bytes; an array is an element type u32, a count u64 and
the elements. `ne` lists dimensions innermost (contiguous) first: ne[0] is the row length.

Only the standard library is used here (struct over an mmap), so the metadata can be read where
numpy is not wanted; the file is mapped once and tensors are views of that mapping.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncengine.gguf.errors import GGUFError
from asyncengine.gguf.ggml_types import (
    BLOCK_LAYOUT,
    GGMLType,
    supported_names,
    tensor_nbytes,
    type_name,
)

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)  # v1 counted in 32 bits; llama.cpp no longer reads it either
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
_HEADER = struct.Struct("<4sIQQ")

# Metadata value types (enum gguf_type): scalar struct formats.
_STRING, _ARRAY = 8, 9
_SCALAR_FORMATS = {
    0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d",
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class RawTensorInfo:
    """One entry of the tensor table as the file states it, not yet checked."""

    name: str
    dims: tuple[int, ...]  # as stored: innermost first
    ggml_type: int
    offset: int  # relative to the data section


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """A checked tensor: a served type, a shape, and bytes that lie inside the file.

    `shape` is outermost first (numpy / torch order, the reverse of GGUF's `ne`): a weight
    matrix is `(out_features, in_features)`, as in a Hugging Face checkpoint, and its last
    dimension is the contiguous row that quantized blocks tile.
    """

    name: str
    ggml_type: GGMLType
    shape: tuple[int, ...]
    offset: int  # absolute, from the start of the file
    nbytes: int


class _Cursor:
    """Reads values off the mapping at a moving position; running off the end is truncation."""

    def __init__(self, path: Path, buf: mmap.mmap) -> None:
        self.path, self.buf, self.pos, self.size = path, buf, 0, len(buf)

    def _need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise GGUFError(
                self.path,
                f"the file is truncated: it ends at byte {self.size} while reading {what} "
                f"(at byte {self.pos})",
            )

    def unpack(self, fmt: str, what: str) -> tuple[Any, ...]:
        n = struct.calcsize("<" + fmt)
        self._need(n, what)
        values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += n
        return values

    def scalar(self, fmt: str, what: str) -> Any:
        return self.unpack(fmt, what)[0]

    def string(self, what: str) -> str:
        length: int = self.scalar("Q", what)
        self._need(length, what)
        raw = self.buf[self.pos : self.pos + length]
        self.pos += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise GGUFError(self.path, f"{what} is not valid UTF-8 ({exc})") from None

    def value(self, value_type: int, what: str) -> Any:
        if value_type in _SCALAR_FORMATS:
            return self.scalar(_SCALAR_FORMATS[value_type], what)
        if value_type == _STRING:
            return self.string(what)
        if value_type == _ARRAY:
            element_type, count = self.unpack("IQ", what)
            if element_type in _SCALAR_FORMATS:
                fmt = _SCALAR_FORMATS[element_type]
                self._need(count * struct.calcsize(fmt), what)
                return list(self.unpack(f"{count}{fmt}", what))
            self._need(count * 8, what)  # every string or array element takes 8 bytes or more
            return [self.value(element_type, what) for _ in range(count)]
        raise GGUFError(self.path, f"{what} has an unknown value type {value_type}")


@dataclass(slots=True)
class GGUFFile:
    """A parsed GGUF file: its metadata and tensor table, and the read-only mapping of it."""

    path: Path
    version: int
    metadata: dict[str, Any]
    raw_tensors: list[RawTensorInfo]
    alignment: int
    data_start: int
    buffer: mmap.mmap

    @property
    def file_size(self) -> int:
        return len(self.buffer)

    def check_tensors(self) -> dict[str, TensorInfo]:
        """The tensor table, checked: each type served, each row whole blocks, each tensor's
        bytes aligned, inside the file, and overlapping no other's. Raises `GGUFError`."""
        infos: dict[str, TensorInfo] = {}
        for raw in self.raw_tensors:
            if raw.name in infos:
                raise GGUFError(self.path, f"tensor {raw.name!r} appears twice")
            infos[raw.name] = self._check_one(raw)
        self._check_no_overlap(list(infos.values()))
        return infos

    def _check_one(self, raw: RawTensorInfo) -> TensorInfo:
        if raw.ggml_type not in BLOCK_LAYOUT:
            raise GGUFError(
                self.path,
                f"tensor {raw.name!r} has type {type_name(raw.ggml_type)}, which asyncengine "
                f"does not run; it runs {supported_names()}",
            )
        ggml_type = GGMLType(raw.ggml_type)
        block_size = BLOCK_LAYOUT[ggml_type][0]
        if raw.dims[0] % block_size:
            raise GGUFError(
                self.path,
                f"tensor {raw.name!r} ({ggml_type.name}) has rows of {raw.dims[0]} values, "
                f"not a multiple of its block size {block_size}",
            )
        shape = tuple(reversed(raw.dims))
        nbytes = tensor_nbytes(ggml_type, shape)
        if raw.offset % self.alignment:
            raise GGUFError(
                self.path,
                f"tensor {raw.name!r} has offset {raw.offset}, not a multiple of the "
                f"alignment {self.alignment}: the tensor table is corrupt",
            )
        start = self.data_start + raw.offset
        if start + nbytes > self.file_size:
            raise GGUFError(
                self.path,
                f"tensor {raw.name!r} (bytes {start}..{start + nbytes}) runs past the end of "
                f"the file ({self.file_size} bytes): the file is truncated or its tensor "
                "offsets are corrupt",
            )
        return TensorInfo(raw.name, ggml_type, shape, start, nbytes)

    def _check_no_overlap(self, infos: list[TensorInfo]) -> None:
        ordered = sorted(infos, key=lambda t: t.offset)
        for before, after in itertools.pairwise(ordered):
            if before.offset + before.nbytes > after.offset:
                raise GGUFError(
                    self.path,
                    f"tensors {before.name!r} and {after.name!r} overlap (bytes "
                    f"{before.offset}..{before.offset + before.nbytes} and "
                    f"{after.offset}..): the tensor offsets are corrupt",
                )

    def close(self) -> None:
        """Unmap the file; views of it that are still alive keep it mapped instead."""
        # A tensor view still using the mapping keeps it; it goes with the last view.
        with contextlib.suppress(BufferError):
            self.buffer.close()


def parse_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Map `path` and parse its header, metadata and tensor table (not yet checked; see
    `GGUFFile.check_tensors`). Raises `GGUFError` for a file that is not GGUF, is of an
    unsupported version, or is truncated; `OSError` where it cannot be opened."""
    path = Path(path)
    with path.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < _HEADER.size:
            raise GGUFError(
                path,
                f"the file is truncated or not GGUF: {size} bytes, shorter than a GGUF header",
            )
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return _parse(path, buf)
    except BaseException:
        buf.close()
        raise


def _parse(path: Path, buf: mmap.mmap) -> GGUFFile:
    cursor = _Cursor(path, buf)
    magic, version, tensor_count, kv_count = cursor.unpack("4sIQQ", "the header")
    if magic != GGUF_MAGIC:
        raise GGUFError(path, f"not a GGUF file: it starts with {magic!r}, not {GGUF_MAGIC!r}")
    if version not in SUPPORTED_VERSIONS:
        if version & 0xFFFF == 0 and version >> 16:
            problem = "a big-endian GGUF file; only little-endian files are read"
        else:
            problem = f"GGUF version {version}; supported versions: 2, 3"
        raise GGUFError(path, problem)

    metadata: dict[str, Any] = {}
    for index in range(kv_count):
        key = cursor.string(f"the key of metadata entry {index}")
        value_type = cursor.scalar("I", f"the type of metadata {key!r}")
        metadata[key] = cursor.value(value_type, f"metadata {key!r}")

    raw_tensors = [_read_tensor_info(cursor, index) for index in range(tensor_count)]

    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFError(path, f"general.alignment is {alignment!r}, not a power of two")
    data_start = -(-cursor.pos // alignment) * alignment
    if raw_tensors and data_start > cursor.size:
        raise GGUFError(
            path, f"the file is truncated: it ends at byte {cursor.size}, before its data section"
        )
    return GGUFFile(path, version, metadata, raw_tensors, alignment, data_start, buf)


def _read_tensor_info(cursor: _Cursor, index: int) -> RawTensorInfo:
    name = cursor.string(f"the name of tensor {index}")
    n_dims: int = cursor.scalar("I", f"tensor {name!r}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise GGUFError(cursor.path, f"tensor {name!r} has {n_dims} dimensions (1 to 4 allowed)")
    dims: tuple[int, ...] = cursor.unpack(f"{n_dims}Q", f"tensor {name!r}")
    ggml_type, offset = cursor.unpack("IQ", f"tensor {name!r}")
    if any(d <= 0 or d >= 1 << 40 for d in dims):
        raise GGUFError(cursor.path, f"tensor {name!r} has dimensions {list(dims)}")
    return RawTensorInfo(name, dims, ggml_type, offset)
