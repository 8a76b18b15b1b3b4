"""safetensors files: `load_safetensors` / `save_safetensors` (numpy dicts), and
`SafetensorsFile`, a bounded reader of one file's header and tensors.

A .safetensors file is untrusted input (docs/checkpoints.md, "Validation"), so it is
read here rather than through the ``safetensors`` package: the 8-byte header length
must fit in the file (and be at most MAX_HEADER bytes), the header must be a JSON
object of name -> {"dtype", "shape", "data_offsets"} (plus an optional
"__metadata__" of strings), each dtype one this reader knows, each shape a list of
non-negative ints, each [start, end) inside the data section with end - start equal
to the dtype's size times the shape's product, and no two tensors' bytes may
overlap. Any problem raises one ValueError naming the file and the tensor or field.
Tensors are read from a memory map of the file, one at a time (or a slice of one).

Writing goes through the optional ``safetensors`` package (``pip install
safetensors``, or ``jaxquant[safetensors]``).
"""

from __future__ import annotations

import json
import math
import os

import ml_dtypes
import numpy as np

from jaxquant.io._common import CheckpointError, host_array

__all__ = ["DTYPES", "MAX_HEADER", "SafetensorsFile", "load_safetensors", "save_safetensors"]

#: The safetensors dtype names this reader maps onto numpy.
DTYPES = {"F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
          "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
          "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype("<i8"),
          "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
          "U64": np.dtype("<u8"), "U32": np.dtype("<u4"), "U16": np.dtype("<u2"),
          "U8": np.dtype("u1"), "BOOL": np.dtype("?")}
#: The largest header read (the safetensors package's own limit is 100 MB).
MAX_HEADER = 100_000_000


class SafetensorsFile:
    """One .safetensors file's header, checked (the module docstring); tensors read by
    name from a memory map: `names()`, `shape(name)`, `dtype(name)`, `get(name)`
    (a copy), `part(name, index)` (a copy of tensor[index], reading only those bytes)."""

    def __init__(self, path):
        self.path = os.fspath(path)
        try:
            size = os.path.getsize(self.path)
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise CheckpointError(f"{self.path}: not a safetensors file ({size} bytes; the "
                                     f"8-byte header length is missing)")
                n = int.from_bytes(head, "little")
                if n > size - 8 or n > MAX_HEADER:
                    raise CheckpointError(f"{self.path}: header length {n} does not fit in the file "
                                     f"({size} bytes; at most {MAX_HEADER}): truncated or not a "
                                     f"safetensors file")
                raw = f.read(n)
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot read ({e.strerror or e})") from None
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{self.path}: the header is not JSON ({e})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: the header must be a JSON object; got "
                             f"{type(header).__name__}")
        self.metadata = header.pop("__metadata__", None)
        if self.metadata is not None and (not isinstance(self.metadata, dict) or not all(
                isinstance(v, str) for v in self.metadata.values())):
            raise CheckpointError(f"{self.path}: __metadata__ must be an object of strings")
        self.data_offset = 8 + n
        data_size = size - self.data_offset
        self._entries = {}
        for name, e in header.items():
            self._entries[name] = self._entry(name, e, data_size)
        spans = sorted((s, t, name) for name, (_, _, s, t) in self._entries.items() if t > s)
        for (s0, t0, a), (s1, _, b) in zip(spans, spans[1:]):
            if t0 > s1:
                raise CheckpointError(f"{self.path}: tensors {a!r} (bytes {s0}..{t0}) and {b!r} "
                                      f"(from {s1}) overlap")
        covered = sum(t - s for s, t, _ in spans)
        if covered != data_size:  # the format has no holes and nothing after the last tensor
            raise CheckpointError(f"{self.path}: the tensors cover {covered} of the data "
                                  f"section's {data_size} bytes (a hole, or bytes after the "
                                  f"last tensor: truncated or appended to?)")

    def _entry(self, name, e, data_size):
        where = f"{self.path}: tensor {name!r}"
        if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
            raise CheckpointError(f"{where}: its header entry must be an object with exactly "
                             f"'dtype', 'shape' and 'data_offsets'; got {e!r:.200}")
        dtype, shape, offsets = e["dtype"], e["shape"], e["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise CheckpointError(f"{where}: dtype {dtype!r:.40} is not one of {sorted(DTYPES)}")
        if not isinstance(shape, list) or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise CheckpointError(f"{where}: shape {shape!r:.200} must be a list of non-negative ints")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(
                isinstance(o, int) and not isinstance(o, bool) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= data_size):
            raise CheckpointError(f"{where}: data_offsets {offsets!r:.200} must be [start, end] with "
                             f"0 <= start <= end <= {data_size} (the data section's size)")
        start, end = offsets
        want = math.prod(shape) * DTYPES[dtype].itemsize
        if end - start != want:
            raise CheckpointError(f"{where}: data_offsets span {end - start} bytes; {dtype} "
                             f"{shape} needs {want}")
        return DTYPES[dtype], tuple(shape), start, end

    def names(self):
        return self._entries.keys()

    def __contains__(self, name):
        return name in self._entries

    def dtype(self, name) -> np.dtype:
        return self._entries[name][0]

    def shape(self, name) -> tuple:
        return self._entries[name][1]

    def _view(self, name) -> np.ndarray:
        dtype, shape, start, end = self._entries[name]
        if end == start:
            return np.zeros(shape, dtype)
        raw = np.memmap(self.path, np.uint8, mode="r", offset=self.data_offset + start,
                        shape=(end - start,))
        return raw.view(dtype).reshape(shape)

    def get(self, name) -> np.ndarray:
        return np.array(self._view(name))

    def part(self, name, index) -> np.ndarray:
        """tensor[index] (index: a tuple of slices), reading only those bytes."""
        return np.array(self._view(name)[index])


def load_safetensors(path) -> dict[str, np.ndarray]:
    """All tensors of a .safetensors file as numpy arrays (bfloat16 and float8 via
    ml_dtypes), read through SafetensorsFile (every problem a ValueError naming the
    file)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike; got {type(path).__name__}")
    f = SafetensorsFile(path)
    return {name: f.get(name) for name in f.names()}


def _safetensors_numpy():
    try:
        import safetensors.numpy as stn
    except ImportError as e:
        raise ImportError(
            "writing .safetensors files needs the optional 'safetensors' package: pip install "
            "safetensors (or pip install 'jaxquant[safetensors]')") from e
    return stn


def save_safetensors(path, tensors: dict, metadata: dict | None = None) -> None:
    """Write a dict of arrays (numpy or jax) to a .safetensors file."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike; got {type(path).__name__}")
    if not isinstance(tensors, dict):
        raise TypeError(f"tensors must be a dict of name -> array; got {type(tensors).__name__}")
    stn = _safetensors_numpy()
    arrays = {str(k): np.ascontiguousarray(host_array(v, f"tensors[{k!r}]"))
              for k, v in tensors.items()}
    stn.save_file(arrays, os.fspath(path), metadata=metadata)
