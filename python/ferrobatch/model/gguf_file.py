"""A fast, read-only GGUF (v2/v3, little-endian) parser: metadata dict + memory-mapped tensors.

``gguf.GGUFReader`` builds a numpy view per array element (seconds for a 49k-token vocabulary);
this reads the same header with ``struct`` in tens of milliseconds. Tensor bytes stay memory-mapped.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_NUMPY_TYPES = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
                6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor: ``shape`` in numpy order (rows first), raw bytes as ``uint8 [rows, bytes_per_row]``."""

    name: str
    type_id: int
    type_name: str
    shape: tuple[int, ...]
    data: np.ndarray


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("<Q")
        value = bytes(self.buf[self.pos:self.pos + length]).decode("utf-8", errors="replace")
        self.pos += length
        return value

    def value(self, type_id: int) -> Any:
        if type_id in _SCALARS:
            return self.scalar(_SCALARS[type_id])
        if type_id == _STRING:
            return self.string()
        if type_id == _ARRAY:
            item_type, count = self.scalar("<I"), self.scalar("<Q")
            if item_type in _NUMPY_TYPES:  # numeric arrays in one read
                dtype = np.dtype(_NUMPY_TYPES[item_type])
                values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
                self.pos += dtype.itemsize * count
                return values.tolist()
            return [self.value(item_type) for _ in range(count)]
        raise ValueError(f"corrupt GGUF metadata: unknown value type {type_id}")


class GGUFFile:
    """Parsed GGUF header: ``metadata`` (key -> Python value) and ``tensors`` (name -> info)."""

    def __init__(self, path: str | os.PathLike) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = os.fspath(path)
        with open(self.path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                raise ValueError(f"{self.path} is empty, not a GGUF file")
            self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        cur = _Cursor(memoryview(self._mmap))
        if len(self._mmap) < 24 or bytes(cur.buf[:4]) != _MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file (bad magic)")
        cur.pos = 4
        version = cur.scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {version} in {self.path}")
        num_tensors, num_kv = cur.scalar("<Q"), cur.scalar("<Q")
        if max(num_tensors, num_kv) > len(self._mmap):      # each entry takes bytes
            raise ValueError(f"corrupt GGUF header in {self.path}: {num_tensors} tensors and "
                             f"{num_kv} metadata entries claimed in {len(self._mmap)} bytes")
        try:
            self.metadata: dict[str, Any] = {}
            for _ in range(num_kv):
                key = cur.string()
                self.metadata[key] = cur.value(cur.scalar("<I"))
            infos = []
            for _ in range(num_tensors):
                name = cur.string()
                dims = [cur.scalar("<Q") for _ in range(cur.scalar("<I"))]
                infos.append((name, dims, cur.scalar("<I"), cur.scalar("<Q")))
        except (struct.error, OverflowError, MemoryError) as exc:
            raise ValueError(f"truncated or corrupt GGUF header in {self.path}") from exc
        alignment = int(self.metadata.get("general.alignment", 32))
        data_start = -(-cur.pos // alignment) * alignment
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for name, dims, type_id, offset in infos:
            try:
                qtype = GGMLQuantizationType(type_id)
            except ValueError as exc:
                raise ValueError(f"tensor {name}: unknown GGML type id {type_id}") from exc
            block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
            shape = tuple(reversed(dims)) or (1,)
            rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
            row_bytes = shape[-1] // block_elems * block_bytes
            start = data_start + offset
            if start + rows * row_bytes > len(self._mmap):
                raise ValueError(f"tensor {name} extends past the end of {self.path}")
            raw = np.frombuffer(self._mmap, dtype=np.uint8, count=rows * row_bytes, offset=start)
            data = raw.reshape(shape[:-1] + (row_bytes,)) if len(shape) > 1 else raw
            self.tensors[name] = GGUFTensorInfo(name, type_id, qtype.name, shape, data)
