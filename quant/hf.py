"""Reading Hugging Face checkpoint directories: config.json and safetensors shards.

Safetensors headers are validated here before anything is mapped (length, JSON, dtype,
shape against byte count, offsets inside the file and not overlapping), so a corrupt or
truncated file is a one-line EdgeError, never a crash or garbage weights. Tensors are
read through one read-only memory map per shard; `rows()` hands out float32 copies of
row ranges and `release()` drops the mapped pages again so resident memory stays
bounded by the chunk size, not the checkpoint size. bf16 has no NumPy dtype: it is
read as raw uint16 bits and widened exactly. Pickle checkpoints are refused, never
opened.
"""
from __future__ import annotations

import json
import math
import mmap
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgellama.errors import EdgeError

from edgellama.formats.floats import dequantize_bf16

_DTYPES = {"BF16": (np.uint16, 2), "F16": (np.float16, 2), "F32": (np.float32, 4)}
_PICKLE = ("*.bin", "*.pth", "*.pt", "*.ckpt", "*.pkl")
_MAX_HEADER = 100 << 20


_MAX_JSON = 256 << 20          # a 128k-token tokenizer.json is ~9 MB
U32_MAX, I32_MAX = (1 << 32) - 1, (1 << 31) - 1
F32_MAX = float(np.finfo(np.float32).max)


def load_json(path: Path, what: str) -> dict:
    """A JSON object from `path`, or one EdgeError naming the file. Refuses non-regular
    files (a FIFO would block), files over 256 MB, numbers Python cannot parse (NaN,
    Infinity, 5000-digit integers) and nesting deep enough to exhaust the stack."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with open(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise EdgeError(f"{path}: not a regular file ({what})")
            if st.st_size > _MAX_JSON:
                raise EdgeError(f"{path}: {st.st_size} bytes is too large for a {what} "
                                f"(limit {_MAX_JSON >> 20} MB)")
            raw = f.read(_MAX_JSON + 1)
    except FileNotFoundError:
        raise EdgeError(f"{path}: missing ({what})") from None
    except IsADirectoryError:
        raise EdgeError(f"{path}: is a directory, expected a JSON file ({what})") from None
    except OSError as e:
        raise EdgeError(f"{path}: cannot read ({what}): {e.strerror or e}") from None
    try:
        data = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError) as e:    # JSONDecodeError, too many digits
        raise EdgeError(f"{path}: not valid JSON ({e})") from None
    except RecursionError:
        raise EdgeError(f"{path}: not valid JSON (nested too deeply)") from None
    if not isinstance(data, dict):
        raise EdgeError(f"{path}: expected a JSON object, got {_kind(data)}")
    return data


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _kind(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int):
        return "an integer"
    if isinstance(v, float):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "a list"
    return "an object"


def _show(v) -> str:
    s = repr(v)
    return s if len(s) <= 60 else f"{_kind(v)} ({s[:40]}...)"


def want_int(path: Path, key: str, v, lo: int = 1, hi: int = U32_MAX, what: str = "") -> int:
    """v as an integer in [lo, hi] (an integral float such as 4096.0 counts), else an
    EdgeError naming file and key, what the value must be and what it is."""
    if isinstance(v, float) and not isinstance(v, bool) and math.isfinite(v) and v == int(v):
        v = int(v)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise EdgeError(f"{path}: '{key}' must be an integer from {lo} to {hi}{what}, got {_show(v)}; "
                        f"fix the value in {path.name}")
    return v


def want_float(path: Path, key: str, v, lo: float, hi: float = F32_MAX, lo_open: bool = True,
               hi_open: bool = False, what: str = "") -> float:
    """v as a finite number in the range (lo_open: lo excluded), that stays in range
    once rounded to float32 (the GGUF field type), else an EdgeError naming file and key."""
    ok = isinstance(v, (int, float)) and not isinstance(v, bool)
    if ok:
        f32 = float(np.float32(v)) if abs(v) <= F32_MAX else math.inf   # nan stays nan
        ok = (math.isfinite(f32) and (f32 > lo if lo_open else f32 >= lo)
              and (f32 < hi if hi_open else f32 <= hi))
    if not ok:
        rng = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
        raise EdgeError(f"{path}: '{key}' must be a number in {rng}{what}, got {_show(v)}; "
                        f"fix the value in {path.name}")
    return float(v)


@dataclass
class TensorRef:
    """One tensor inside a safetensors shard: where it is and what it holds."""
    name: str
    shard: "SafetensorsFile"
    dtype: str
    shape: tuple[int, ...]
    start: int      # absolute byte offset in the file
    nbytes: int

    def rows(self, r0: int, r1: int, index: np.ndarray | None = None) -> np.ndarray:
        """Rows r0:r1 (or rows index[r0:r1]) as a (k, cols) float32 array (a fresh copy)."""
        src = self.shard.view(self)
        src = src.reshape(src.shape[0], -1) if src.ndim > 1 else src.reshape(1, -1)
        part = src[index[r0:r1]] if index is not None else src[r0:r1]
        if self.dtype == "BF16":
            out = np.empty(part.shape, np.float32)
            dequantize_bf16(np.ascontiguousarray(part).reshape(-1).view(np.uint8), out.reshape(-1))
            return out
        return part.astype(np.float32)

    def release(self) -> None:
        self.shard.release(self.start, self.nbytes)


class SafetensorsFile:
    """A validated safetensors file, mapped read-only on first use."""

    def __init__(self, path: Path):
        self.path = path
        self.tensors: dict[str, TensorRef] = {}
        self._mm: mmap.mmap | None = None
        self._fd: int | None = None
        try:        # without waiting on a FIFO, which open() would do for its writer
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except OSError as e:
            raise EdgeError(f"{path}: cannot read: {e.strerror or e}") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise EdgeError(f"{path}: not a regular file (safetensors shard)")
        size = st.st_size
        with open(fd, "rb") as f:
            try:
                raw = f.read(8)
                if len(raw) < 8:
                    raise EdgeError(f"{path}: truncated safetensors file ({size} bytes, no header)")
                (n,) = struct.unpack("<Q", raw)
                if n < 2 or n > _MAX_HEADER or 8 + n > size:
                    raise EdgeError(f"{path}: invalid safetensors header length {n} "
                                    f"(file is {size} bytes)")
                header = json.loads(f.read(n).decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise EdgeError(f"{path}: invalid safetensors header ({e})") from None
            except OSError as e:         # /proc/self/mem, a failing disk
                raise EdgeError(f"{path}: cannot read: {e.strerror or e}") from None
        if not isinstance(header, dict):
            raise EdgeError(f"{path}: invalid safetensors header (not a JSON object)")
        data_start = 8 + n
        spans = []
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            if not isinstance(meta, dict) or set(meta) - {"dtype", "shape", "data_offsets"}:
                raise EdgeError(f"{path}: invalid safetensors header entry for {name!r}")
            dtype, shape, offs = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
            if not isinstance(dtype, str) or dtype not in _DTYPES:
                raise EdgeError(f"{path}: tensor {name!r} has dtype {_show(dtype)} "
                                f"(supported: {', '.join(_DTYPES)})")
            if (not isinstance(shape, list) or len(shape) > 4
                    or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
                raise EdgeError(f"{path}: tensor {name!r} has an invalid shape {_show(shape)}")
            if (not isinstance(offs, list) or len(offs) != 2
                    or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
                    or not 0 <= offs[0] <= offs[1]):
                raise EdgeError(f"{path}: tensor {name!r} has invalid data_offsets {_show(offs)}")
            count = 1
            for d in shape:
                count *= d
            nbytes = count * _DTYPES[dtype][1]
            if offs[1] - offs[0] != nbytes:
                raise EdgeError(f"{path}: tensor {name!r} shape {shape} {dtype} needs {nbytes} bytes "
                                f"but data_offsets span {offs[1] - offs[0]}")
            if data_start + offs[1] > size:
                raise EdgeError(f"{path}: truncated: tensor {name!r} ends at byte "
                                f"{data_start + offs[1]} but the file has {size}")
            spans.append((offs[0], offs[1], name))
            self.tensors[name] = TensorRef(name, self, dtype, tuple(shape), data_start + offs[0], nbytes)
        spans.sort()
        for (_, e0, a), (s1, _, b) in zip(spans, spans[1:]):
            if s1 < e0:
                raise EdgeError(f"{path}: invalid safetensors header: tensors {a!r} and {b!r} overlap")

    def view(self, t: TensorRef) -> np.ndarray:
        if self._mm is None:
            self._fd = os.open(self.path, os.O_RDONLY)
            self._mm = mmap.mmap(self._fd, 0, access=mmap.ACCESS_READ)
        dt = _DTYPES[t.dtype][0]
        count = t.nbytes // _DTYPES[t.dtype][1]
        return np.frombuffer(self._mm, dtype=dt, count=count, offset=t.start).reshape(t.shape or (1,))

    def release(self, start: int, nbytes: int) -> None:
        """Drop the mapped pages of [start, start+nbytes) from this process (they stay in
        the page cache); keeps peak RSS at one chunk rather than the whole shard."""
        if self._mm is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        lo = start - start % mmap.PAGESIZE
        hi = min(start + nbytes, len(self._mm))
        if hi > lo:
            self._mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def close(self) -> None:
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:      # a caller still holds a view; the GC unmaps later
                pass
            os.close(self._fd)
            self._mm = self._fd = None


def refuse_pickle(hf_dir: Path) -> None:
    found = sorted(p.name for pat in _PICKLE for p in hf_dir.glob(pat))
    if found:
        raise EdgeError(
            f"{hf_dir / found[0]}: pickle checkpoints are not read: unpickling runs arbitrary code "
            f"from the file. Use the model's .safetensors files (most Hub repos have them), or "
            f"convert with a trusted tool in a sandbox first")


def open_checkpoint(hf_dir: Path) -> tuple[dict[str, TensorRef], list[SafetensorsFile]]:
    """All tensors of a checkpoint dir: model.safetensors or the shards listed in
    model.safetensors.index.json. Returns (name -> TensorRef, open shards)."""
    index_path = hf_dir / "model.safetensors.index.json"
    single = hf_dir / "model.safetensors"
    if index_path.is_file():
        index = load_json(index_path, "shard index")
        wmap = index.get("weight_map")
        if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
            raise EdgeError(f"{index_path}: missing or malformed 'weight_map'")
        names = sorted(set(wmap.values()))
    elif single.is_file():
        wmap, names = None, ["model.safetensors"]
    else:
        shards = sorted(p.name for p in hf_dir.glob("*.safetensors"))
        if not shards:
            refuse_pickle(hf_dir)
            raise EdgeError(f"{hf_dir}: no model.safetensors or model.safetensors.index.json")
        wmap, names = None, shards
    shards, tensors = [], {}
    for name in names:
        path = hf_dir / name
        if Path(name).name != name or not path.is_file():
            raise EdgeError(f"{index_path}: shard {name!r} is missing")
        shard = SafetensorsFile(path)
        shards.append(shard)
        for tname, ref in shard.tensors.items():
            if tname in tensors:
                raise EdgeError(f"{path}: tensor {tname!r} also appears in {tensors[tname].shard.path.name}")
            if wmap is not None and wmap.get(tname) != name:
                raise EdgeError(f"{path}: tensor {tname!r} is not listed for this shard in {index_path.name}")
            tensors[tname] = ref
    if wmap is not None:
        missing = sorted(set(wmap) - set(tensors))
        if missing:
            raise EdgeError(f"{hf_dir / wmap[missing[0]]}: tensor {missing[0]!r} listed in "
                            f"{index_path.name} is not in the file")
    return tensors, shards
