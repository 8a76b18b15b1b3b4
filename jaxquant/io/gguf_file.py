"""A bounded reader of GGUF files (llama.cpp's container): the header, the metadata
and the tensor table, checked before anything is allocated from them.

A GGUF file is untrusted input (docs/checkpoints.md, "Validation"). Every count and
length is bounded by the bytes left in the file before it is used: an array of n
elements needs at least n times its element's smallest encoding, a string of n bytes
needs n bytes. Every tensor's type must be a ggml type jaxquant knows, its dims
positive, its byte size (from the type's block size) inside the data section, its
offset a multiple of `general.alignment`, and no two tensors may overlap. Any
problem raises one `ValueError` naming the file and the field or tensor.

Layout (GGUF v2 / v3, little-endian): "GGUF", uint32 version, uint64 tensor count,
uint64 metadata count; each metadata entry a string key, a uint32 value type and
the value (strings: uint64 length + UTF-8 bytes; arrays: uint32 element type,
uint64 count, the elements); each tensor a string name, uint32 n_dims, n_dims
uint64 dims (innermost first), uint32 ggml type, uint64 offset into the data
section, which starts at the next multiple of the alignment after the table.
"""

from __future__ import annotations

import math
import os
import struct

import numpy as np

from jaxquant.io._common import CheckpointError

__all__ = ["GGUFReader", "GGUFTensor"]

MAGIC = b"GGUF"
VERSIONS = (2, 3)
#: metadata value type -> (struct format, size) for the fixed-size scalars.
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
            6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
          10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
#: The smallest encoding of one element of each type (a string: its 8-byte length).
_MIN_SIZE = {**{t: s for t, (_, s) in _SCALARS.items()}, _STRING: 8, _ARRAY: 12}
MAX_DIMS = 4
#: Nested arrays (an array of arrays) are allowed this deep; llama.cpp writes none.
MAX_NESTING = 2


class GGUFTensor:
    """One entry of the tensor table: name, shape (GGUF order: innermost first),
    ggml type number, and the byte range in the file."""

    __slots__ = ("name", "shape", "tensor_type", "type_name", "offset", "nbytes", "_reader")

    def __init__(self, reader, name, shape, tensor_type, type_name, offset, nbytes):
        self._reader = reader
        self.name, self.shape, self.tensor_type = name, shape, tensor_type
        self.type_name, self.offset, self.nbytes = type_name, offset, nbytes

    @property
    def data(self) -> np.ndarray:
        """The tensor's bytes, uint8 [nbytes] (a read-only view of the file)."""
        return self._reader.bytes_at(self.offset, self.nbytes)


class GGUFReader:
    """`GGUFReader(path, types)`: `fields` (metadata key -> Python value: int, float, bool,
    str, or a list / numpy array for arrays), `tensors` (a list of GGUFTensor in file
    order), `alignment`, `data_offset`. Raises ValueError naming the file for any
    malformed or out-of-bounds structure (the module docstring).

    types: the ggml types a tensor may have, name -> (number, elements per block, bytes
    per block) (`jaxquant.io.gguf.GGML_TYPES`)."""

    def __init__(self, path, types: dict):
        self.path = os.fspath(path)
        try:
            self._map = np.memmap(self.path, np.uint8, mode="r")
        except ValueError as e:  # numpy: "cannot mmap an empty file"
            raise CheckpointError(f"{self.path}: not a GGUF file ({e})") from None
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot read ({e.strerror or e})") from None
        self.size = int(self._map.size)
        self._pos = 0
        if self.size < 24 or bytes(self._map[:4]) != MAGIC:
            raise CheckpointError(f"{self.path}: not a GGUF file (no 'GGUF' magic and 24-byte "
                             f"header)")
        self._pos = 4
        version = self._scalar(4, "the version")
        if version not in VERSIONS:
            raise CheckpointError(f"{self.path}: GGUF version {version} is not supported (2 or 3)")
        n_tensors = self._count(self._scalar(10, "the tensor count"), 8 + 4 + 4 + 8,
                                "the tensor count")
        n_fields = self._count(self._scalar(10, "the metadata count"), 8 + 4 + 1,
                               "the metadata count")
        self.fields = {}
        for _ in range(n_fields):
            key = self._string("a metadata key")
            if key in self.fields:
                raise CheckpointError(f"{self.path}: metadata key {key!r} appears twice")
            self.fields[key] = self._value(self._scalar(4, f"{key}'s type"), key, 0)
        alignment = self.fields.get("general.alignment", 32)
        if (isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0
                or alignment & (alignment - 1)):
            raise CheckpointError(f"{self.path}: general.alignment={alignment!r} must be a positive "
                             f"power of two")
        self.alignment = alignment
        by_number = {num: (name, block, nbytes) for name, (num, block, nbytes) in
                     types.items()}
        table = []
        names = set()
        for _ in range(n_tensors):
            name = self._string("a tensor name")
            if name in names:
                raise CheckpointError(f"{self.path}: tensor {name!r} appears twice in the table")
            names.add(name)
            n_dims = self._scalar(4, f"tensor {name!r}'s n_dims")
            if not 1 <= n_dims <= MAX_DIMS:
                raise CheckpointError(f"{self.path}: tensor {name!r} has n_dims={n_dims}; expected "
                                 f"1..{MAX_DIMS}")
            dims = tuple(self._scalar(10, f"tensor {name!r}'s dims") for _ in range(n_dims))
            ttype = self._scalar(4, f"tensor {name!r}'s type")
            offset = self._scalar(10, f"tensor {name!r}'s offset")
            if ttype not in by_number:
                raise CheckpointError(f"{self.path}: tensor {name!r} has ggml type {ttype}, which "
                                 f"jaxquant does not know (known: {sorted(by_number)})")
            tname, block, block_bytes = by_number[ttype]
            if any(d <= 0 for d in dims) or dims[0] % block:
                raise CheckpointError(f"{self.path}: tensor {name!r} has dims {list(dims)}: each must "
                                 f"be positive and the first a multiple of {tname}'s "
                                 f"{block}-element block")
            elements = math.prod(dims)
            if elements > self.size * block:  # cheap bound before the exact one below
                raise CheckpointError(f"{self.path}: tensor {name!r} ({list(dims)}) is larger than "
                                 f"the file")
            table.append((name, dims, ttype, tname, offset,
                          elements // block * block_bytes))
        end = self._pos
        self.data_offset = -(-end // alignment) * alignment
        data_size = self.size - self.data_offset
        if data_size < 0:
            raise CheckpointError(f"{self.path}: the file ends inside the alignment padding before "
                             f"the tensor data")
        self.tensors = []
        for name, dims, ttype, tname, offset, nbytes in table:
            if offset % alignment:
                raise CheckpointError(f"{self.path}: tensor {name!r}'s offset {offset} is not a "
                                 f"multiple of the alignment {alignment}")
            if offset + nbytes > data_size:
                raise CheckpointError(f"{self.path}: tensor {name!r} ({tname} {list(dims)}, {nbytes} "
                                 f"bytes at data offset {offset}) runs past the end of the file "
                                 f"(data section of {data_size} bytes; truncated?)")
            self.tensors.append(GGUFTensor(self, name, np.array(dims, np.int64), ttype, tname,
                                           offset, nbytes))
        spans = sorted(self.tensors, key=lambda t: t.offset)
        for a, b in zip(spans, spans[1:]):
            if a.offset + a.nbytes > b.offset:
                raise CheckpointError(f"{self.path}: tensors {a.name!r} (bytes {a.offset}.."
                                 f"{a.offset + a.nbytes}) and {b.name!r} (from {b.offset}) "
                                 f"overlap")

    def bytes_at(self, offset: int, nbytes: int) -> np.ndarray:
        start = self.data_offset + offset
        return self._map[start:start + nbytes]

    # -- bounded primitive reads ------------------------------------------------------

    def _take(self, n: int, what: str) -> bytes:
        if n > self.size - self._pos:
            raise CheckpointError(f"{self.path}: {what} ({n} bytes at byte {self._pos}) runs past "
                             f"the end of the file ({self.size} bytes; truncated?)")
        b = bytes(self._map[self._pos:self._pos + n])
        self._pos += n
        return b

    def _scalar(self, vtype: int, what: str):
        fmt, size = _SCALARS[vtype]
        return struct.unpack(fmt, self._take(size, what))[0]

    def _count(self, n: int, min_size: int, what: str) -> int:
        """n items of at least min_size bytes each must fit in the bytes left."""
        if n * min_size > self.size - self._pos:
            raise CheckpointError(f"{self.path}: {what} {n} cannot fit in the {self.size - self._pos} "
                             f"bytes left in the file")
        return n

    def _string(self, what: str) -> str:
        n = self._scalar(10, f"{what}'s length")
        raw = self._take(self._count(n, 1, f"{what}'s length"), what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise CheckpointError(f"{self.path}: {what} at byte {self._pos - n} is not UTF-8") from None

    def _value(self, vtype: int, key: str, depth: int):
        if vtype in _SCALARS:
            v = self._scalar(vtype, f"metadata {key!r}")
            return bool(v) if vtype == 7 else v
        if vtype == _STRING:
            return self._string(f"metadata {key!r}")
        if vtype != _ARRAY:
            raise CheckpointError(f"{self.path}: metadata {key!r} has value type {vtype}, which GGUF "
                             f"does not define (0..12)")
        etype = self._scalar(4, f"metadata {key!r}'s element type")
        if etype not in _MIN_SIZE:
            raise CheckpointError(f"{self.path}: metadata {key!r} is an array of value type {etype}, "
                             f"which GGUF does not define (0..12)")
        n = self._count(self._scalar(10, f"metadata {key!r}'s count"), _MIN_SIZE[etype],
                        f"metadata {key!r}'s element count")
        if etype in _NUMPY:
            raw = self._take(n * _MIN_SIZE[etype], f"metadata {key!r}")
            out = np.frombuffer(raw, _NUMPY[etype])
            return out.astype(bool) if etype == 7 else out
        if etype == _ARRAY and depth + 1 >= MAX_NESTING:
            raise CheckpointError(f"{self.path}: metadata {key!r} nests arrays deeper than "
                             f"{MAX_NESTING}")
        return [self._value(etype, key, depth + 1) for _ in range(n)]
