"""A small streaming GGUF v3 writer: header first, then tensor data one piece at a time.

Every metadata value is written with the type given by the caller (llama.cpp checks
them strictly: u32 not i32, f32 not f64). Tensor sizes come from the format registry, so the
header can be written before any tensor is converted; `tensor_data` checks that the
bytes written for each tensor match the size announced in the header.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, BinaryIO

from gguf.constants import GGUF_MAGIC, GGUFValueType

from .formats import block_shape, row_bytes

ALIGNMENT = 32

_SCALAR = {GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
           GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
           GGUFValueType.FLOAT32: "<f", GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q",
           GGUFValueType.FLOAT64: "<d", GGUFValueType.BOOL: "<?"}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]      # NumPy order (outermost first); GGUF stores it reversed
    type_id: int
    offset: int                 # relative to the start of the data section

    @property
    def nbytes(self) -> int:
        rows = 1
        for d in self.shape[:-1]:
            rows *= d
        return rows * row_bytes(self.type_id, self.shape[-1])


def _pad(n: int) -> int:
    return (ALIGNMENT - n % ALIGNMENT) % ALIGNMENT


def _string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _value(vtype: GGUFValueType, value: Any, item_type: GGUFValueType | None = None) -> bytes:
    if vtype == GGUFValueType.STRING:
        return _string(value)
    if vtype == GGUFValueType.ARRAY:
        head = struct.pack("<IQ", item_type, len(value))
        if item_type == GGUFValueType.STRING:
            return head + b"".join(_string(s) for s in value)
        fmt = _SCALAR[item_type]
        return head + struct.pack(f"<{len(value)}{fmt[1]}", *value)
    return struct.pack(_SCALAR[vtype], value)


class GGUFStreamWriter:
    """kv(...) and tensor(...) to declare, write_header(), then tensor_data(...) per tensor in order."""

    def __init__(self, f: BinaryIO):
        self.f = f
        self.kvs: list[bytes] = []
        self.keys: set[str] = set()
        self.tensors: list[TensorInfo] = []
        self._size = 0
        self._next = 0          # index of the next tensor whose data is expected

    def kv(self, key: str, vtype: GGUFValueType, value: Any,
           item_type: GGUFValueType | None = None) -> None:
        assert key not in self.keys, key
        self.keys.add(key)
        self.kvs.append(_string(key) + struct.pack("<I", vtype) + _value(vtype, value, item_type))

    def tensor(self, name: str, shape: tuple[int, ...], type_id: int) -> TensorInfo:
        assert block_shape(type_id) is not None and all(d > 0 for d in shape), (name, shape, type_id)
        info = TensorInfo(name, tuple(shape), type_id, self._size)
        self._size += info.nbytes + _pad(info.nbytes)
        self.tensors.append(info)
        return info

    def write_header(self) -> None:
        out = [struct.pack("<IIQQ", GGUF_MAGIC, 3, len(self.tensors), len(self.kvs)), *self.kvs]
        for t in self.tensors:
            dims = tuple(reversed(t.shape))
            out.append(_string(t.name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims,
                                                     t.type_id, t.offset))
        head = b"".join(out)
        self.f.write(head + b"\0" * _pad(len(head)))

    def tensor_data(self, name: str, chunks) -> None:
        """Write the next tensor's bytes from an iterable of bytes-like chunks."""
        info = self.tensors[self._next]
        assert info.name == name, (info.name, name)
        n = 0
        for c in chunks:
            self.f.write(c)
            n += memoryview(c).nbytes
        assert n == info.nbytes, (name, n, info.nbytes)
        self.f.write(b"\0" * _pad(n))
        self._next += 1

    @property
    def data_size(self) -> int:
        return self._size
