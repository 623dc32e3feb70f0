"""A validating GGUF reader: model files come from strangers, so nothing in the
header is trusted until it has been checked against the file itself.

Layout (all little-endian): magic "GGUF", version u32 (2 or 3), tensor count u64,
metadata count u64; then `key: string, type: u32, value` entries; then tensor infos
`name: string, n_dims: u32, dims: u64[n_dims] (fastest-varying first), type: u32,
offset: u64`; then, at the next multiple of `general.alignment` (default 32), the
data section, with each tensor at `offset` from its start.

Every check failure raises EdgeError("<file>: <what is wrong>"). Tensor data is
memory-mapped, never read into memory here.
"""
from __future__ import annotations

import mmap
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import EdgeError
from .formats import block_shape, type_name

MAGIC = b"GGUF"
MAX_DIMS = 4
DEFAULT_ALIGNMENT = 32

# Metadata value types: id -> (struct format, size). 8 = string, 9 = array.
_SCALARS = {
    0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
    6: ("<f", 4), 7: ("<B", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8),
}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4",
          7: "<u1", 10: "<u8", 11: "<i8", 12: "<f8"}
TYPE_NAMES = {0: "u8", 1: "i8", 2: "u16", 3: "i16", 4: "u32", 5: "i32", 6: "f32", 7: "bool",
              8: "string", 9: "array", 10: "u64", 11: "i64", 12: "f64"}
STRING, ARRAY, BOOL = 8, 9, 7
_U64 = struct.Struct("<Q")


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "a special file"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type_id: int
    shape: tuple[int, ...]   # NumPy order: slowest-varying first, e.g. (out, in)
    offset: int              # absolute offset in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return type_name(self.type_id)


class _Cursor:
    """Reads from a bytes-like buffer with a bounds check on every read."""

    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path = buf, 0, path
        self.size = len(buf)

    def fail(self, msg: str):
        raise EdgeError(f"{self.path}: {msg}")

    def need(self, n: int, what: str):
        if n < 0 or self.pos + n > self.size:
            self.fail(f"{what} at byte {self.pos} runs past the end of the file "
                      f"({self.size} bytes): the file is truncated or corrupt")

    def unpack(self, fmt: str, size: int, what: str):
        self.need(size, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return v

    def u32(self, what: str) -> int:
        return self.unpack("<I", 4, what)

    def u64(self, what: str) -> int:
        return self.unpack("<Q", 8, what)

    def string(self, what: str) -> str:
        n = self.u64(f"length of {what}")
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            self.fail(f"{what} is not valid UTF-8")

    def _strings(self, count: int, key: str) -> list[str]:
        """`count` strings: self.string in a tight loop (vocabularies hold 10^5 of them)."""
        buf, pos, size, length = self.buf, self.pos, self.size, _U64.unpack_from
        out, i = [], 0
        try:
            for i in range(count):
                if pos + 8 > size:
                    break
                (n,) = length(buf, pos)
                if n > size - pos - 8:
                    break
                out.append(buf[pos + 8:pos + 8 + n].decode("utf-8"))
                pos += 8 + n
        except UnicodeDecodeError:
            self.pos = pos + 8
            self.fail(f"{key}[{i}] is not valid UTF-8")
        if len(out) < count:   # ran out of file: the checks of self.string say where
            self.pos = pos
            self.string(f"{key}[{len(out)}]")
        self.pos = pos
        return out

    def value(self, vtype: int, key: str) -> Any:
        if vtype in _SCALARS:
            fmt, size = _SCALARS[vtype]
            v = self.unpack(fmt, size, f"value of {key}")
            if vtype == BOOL:
                if v > 1:
                    self.fail(f"metadata {key}: bool value {v} is not 0 or 1")
                return bool(v)
            return v
        if vtype == STRING:
            return self.string(f"value of {key}")
        self.fail(f"metadata {key}: unknown value type {vtype}")

    def array(self, etype: int, key: str) -> Any:
        count = self.u64(f"array length of {key}")
        if etype == STRING:
            # Each string needs at least its 8-byte length: bound the count before looping.
            self.need(count * 8, f"array {key} ({count} strings)")
            return self._strings(count, key)
        if etype in _SCALARS:
            size = _SCALARS[etype][1]
            self.need(count * size, f"array {key} ({count} × {TYPE_NAMES[etype]})")
            arr = np.frombuffer(self.buf, dtype=_NUMPY[etype], count=count, offset=self.pos).copy()
            self.pos += count * size
            if etype == BOOL and count and arr.max() > 1:
                self.fail(f"metadata {key}: bool array holds a value other than 0 or 1")
            return arr.astype(bool) if etype == BOOL else arr
        if etype == ARRAY:
            self.fail(f"metadata {key}: nested arrays are not supported")
        self.fail(f"metadata {key}: unknown array element type {etype}")


class GGUFFile:
    """Header of a GGUF file, validated, plus memory-mapped access to tensor data."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            # O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused below)
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
            try:
                st = os.fstat(fd)
                if stat.S_ISDIR(st.st_mode):
                    raise IsADirectoryError
                if not stat.S_ISREG(st.st_mode):
                    raise EdgeError(f"{self.path}: is {_file_kind(st.st_mode)}, not a regular file; "
                                    "expected a .gguf file")
                size = st.st_size
                if size < 24:
                    raise EdgeError(f"{self.path}: file is too small to be GGUF ({size} bytes)")
                self._mmap = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            finally:
                os.close(fd)
        except IsADirectoryError:
            raise EdgeError(f"{self.path}: is a directory; expected a .gguf file") from None
        except FileNotFoundError:
            raise EdgeError(f"{self.path}: no such file") from None
        except PermissionError:
            raise EdgeError(f"{self.path}: permission denied") from None
        except OSError as e:   # not a directory, name too long, I/O error, unmappable...
            raise EdgeError(f"{self.path}: cannot read: {e.strerror or e}") from None
        self.file_size = size
        self.metadata: dict[str, Any] = {}
        self.metadata_types: dict[str, tuple[int, ...]] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self._parse()

    # -- parsing -------------------------------------------------------------
    def _parse(self):
        c = _Cursor(self._mmap, self.path)
        c.need(4, "magic")
        if self._mmap[:4] != MAGIC:
            c.fail(f"not a GGUF file (magic {bytes(self._mmap[:4])!r}, expected b'GGUF')")
        c.pos = 4
        self.version = c.u32("version")
        if self.version not in (2, 3):
            c.fail(f"GGUF version {self.version} is not supported (supported: 2, 3)")
        n_tensors = c.u64("tensor count")
        n_kv = c.u64("metadata count")
        # Smallest possible entries: key len 8 + type 4 + 1-byte value; tensor info
        # name len 8 + n_dims 4 + type 4 + offset 8.
        if n_kv * 13 > c.size - c.pos or n_tensors * 24 > c.size - c.pos:
            c.fail(f"header claims {n_kv} metadata entries and {n_tensors} tensors, "
                   f"more than a {c.size}-byte file can hold")

        for _ in range(n_kv):
            key = c.string("metadata key")
            vtype = c.u32(f"value type of {key}")
            if key in self.metadata:
                c.fail(f"duplicate metadata key {key!r}")
            if vtype == ARRAY:
                etype = c.u32(f"array type of {key}")
                self.metadata[key] = c.array(etype, key)
                self.metadata_types[key] = (ARRAY, etype)
            else:
                self.metadata[key] = c.value(vtype, key)
                self.metadata_types[key] = (vtype,)

        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if (self.metadata_types.get("general.alignment", (4,)) != (4,) or alignment <= 0
                or alignment & (alignment - 1)):
            c.fail(f"general.alignment must be a u32 power of two, got {alignment!r}")

        infos = []
        for _ in range(n_tensors):
            name = c.string("tensor name")
            n_dims = c.u32(f"n_dims of {name}")
            if not 1 <= n_dims <= MAX_DIMS:
                c.fail(f"tensor {name}: {n_dims} dimensions (must be 1..{MAX_DIMS})")
            dims = [c.u64(f"dims of {name}") for _ in range(n_dims)]
            tid = c.u32(f"type of {name}")
            offset = c.u64(f"offset of {name}")
            if name in self.tensors or any(i[0] == name for i in infos):
                c.fail(f"duplicate tensor name {name!r}")
            infos.append((name, dims, tid, offset))

        data_start = -(-c.pos // alignment) * alignment
        self.data_offset = data_start
        end_prev = 0
        for name, dims, tid, offset in infos:
            shape = block_shape(tid)
            if shape is None:
                c.fail(f"tensor {name}: unknown tensor type id {tid}")
            bs, ts = shape
            if any(d <= 0 for d in dims):
                c.fail(f"tensor {name}: dimension of size 0 in {dims}")
            n = 1
            for d in dims:
                n *= d
                if n >= 1 << 62:
                    c.fail(f"tensor {name}: element count of {dims} overflows")
            if dims[0] % bs:
                c.fail(f"tensor {name}: row length {dims[0]} is not a multiple of the "
                       f"{type_name(tid)} block size {bs}")
            nbytes = n // bs * ts
            if offset % alignment:
                c.fail(f"tensor {name}: offset {offset} is not a multiple of the alignment {alignment}")
            if offset < end_prev:
                c.fail(f"tensor {name}: offset {offset} overlaps the previous tensor "
                       f"(tensor data must be in order)")
            if data_start + offset + nbytes > self.file_size:
                c.fail(f"tensor {name}: data ({nbytes} bytes at {data_start + offset}) runs past "
                       f"the end of the file ({self.file_size} bytes): truncated download?")
            end_prev = offset + nbytes
            self.tensors[name] = TensorInfo(name, tid, tuple(reversed(dims)),
                                            data_start + offset, nbytes)

    # -- access --------------------------------------------------------------
    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str, types: tuple[int, ...] = ()) -> Any:
        """A metadata value that must exist, optionally of one of the given scalar types."""
        if key not in self.metadata:
            raise EdgeError(f"{self.path}: metadata key {key!r} is missing")
        t = self.metadata_types[key][0]
        if types and t not in types:
            want = "/".join(TYPE_NAMES[x] for x in types)
            raise EdgeError(f"{self.path}: metadata {key} has type {TYPE_NAMES[t]}, expected {want}")
        return self.metadata[key]

    def tensor_bytes(self, name: str) -> np.ndarray:
        """The tensor's raw bytes as a read-only uint8 view into the map: (rows, row_bytes)."""
        t = self.tensors[name]
        flat = np.frombuffer(self._mmap, dtype=np.uint8, count=t.nbytes, offset=t.offset)
        rows = int(np.prod(t.shape[:-1])) if len(t.shape) > 1 else 1
        return flat.reshape(rows, t.nbytes // rows)

    def read_bytes(self, offset: int, n: int) -> bytes:
        """Up to n bytes of the file from offset (fewer at its end)."""
        return self._mmap[offset:offset + n]

    def close(self):
        self._mmap.close()
