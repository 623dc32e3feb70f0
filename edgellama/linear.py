"""Linear layers: a weight matrix W (out_features, in_features) read from a GGUF tensor.

Q4_0 / Q4_1 / Q8_0 are repacked once at load into row tiles (see kernels_linear.py) and
the file's pages are then dropped from this process (the tiles hold the same bytes, so
resident memory stays about the file size). F32 / F16 / BF16 are used in place.

    matvec  decode, one token: out = W @ x
    matmul  prefill, T tokens: out = x @ W.T, by dequantizing a few MB of rows at a
            time and handing them to NumPy's BLAS
    rows    embedding lookup: dequantized rows of W
"""
from __future__ import annotations

import mmap

import numba
import numpy as np

from . import kernels_linear as K

F32, F16, Q4_0, Q4_1, Q8_0, BF16 = 0, 1, 2, 3, 8, 30
_NAMES = {F32: "F32", F16: "F16", Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0", BF16: "BF16"}
SUPPORTED_TYPES = tuple(_NAMES.values())   # the weight types the runtime computes with
# type -> (f16 halves per block, payload bytes per block of 32)
_BLOCKS = {Q4_0: (1, 16), Q4_1: (2, 16), Q8_0: (1, 32)}
_CHUNK_FLOATS = 1 << 20        # prefill dequantizes ~4 MB of W at a time (at least
_CHUNK_MIN_ROWS = 256          # 256 rows: narrower products run BLAS below its best)


_scratch = np.empty(0, np.float32)


def _prefill_scratch(size: int) -> np.ndarray:
    # One dequantization buffer shared by every Linear (a few MB, grown on demand):
    # per-layer buffers would add ~100 x 4-8 MB for a 1B model.
    global _scratch
    if _scratch.size < size:
        _scratch = np.empty(size, np.float32)
    return _scratch


def _tile_rows(out_features: int) -> int:
    # Widest tile that still gives every thread 2+ tiles and pads <= 1/8 of the rows:
    # wide tiles amortise each pass's loop overhead (one thread, GB/s per CPU-second,
    # Q4_0 2048x2048: R=16 4.4, 32 7.4, 64 10.2, 128 12.5, 256 14.2).
    for r in (256, 128, 64, 32):
        nt = -(-out_features // r)
        if nt >= 2 * numba.config.NUMBA_NUM_THREADS and nt * r - out_features <= out_features // 8:
            return r
    return 16


def _anon_array(shape: tuple[int, ...], dtype) -> np.ndarray:
    """A zeroed array in its own anonymous mapping, in ordinary 4 KiB pages.

    Load time is dominated by the kernel handing out the tiles' pages. np.empty asks
    for transparent huge pages on large arrays: on the VM measured here those cost
    ~2.7 s per GiB against ~0.36 s for 4 KiB pages (faulted in by the parallel repack;
    MAP_POPULATE did not measurably help).
    """
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return np.frombuffer(mmap.mmap(-1, max(n, 1)), dtype, count=int(np.prod(shape))).reshape(shape)


def _release_pages(data: np.ndarray) -> None:
    """Drop the pages under `data` from this process if it is a view of a file mmap.

    After repacking, the tiles are the only copy used; the file stays in the page cache
    and nothing is lost. Anything that is not a file mapping is left alone.
    """
    base = data
    while True:                    # np.frombuffer(mmap) -> memoryview -> mmap
        if isinstance(base, np.ndarray) and base.base is not None:
            base = base.base
        elif isinstance(base, memoryview):
            base = base.obj
        else:
            break
    if not isinstance(base, mmap.mmap) or base.closed:
        return
    start = data.ctypes.data - np.frombuffer(base, np.uint8).ctypes.data
    lo = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    hi = (start + data.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if hi > lo:
        base.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


class Linear:
    """W (out_features, in_features) of one GGML type; see the module docstring."""

    def __init__(self, type_id: int, out_features: int, in_features: int):
        if type_id not in _NAMES:
            raise ValueError(f"unsupported weight type id {type_id}")
        self.type_id = type_id
        self.type_name = _NAMES[type_id]
        self.out_features = out_features
        self.in_features = in_features

    @classmethod
    def from_gguf(cls, type_id: int, data: np.ndarray, shape: tuple[int, int]) -> "Linear":
        """W from one tensor's bytes (read-only view of the file is fine), shape (out, in)."""
        return cls.from_gguf_stacked(type_id, [(data, shape)])

    @classmethod
    def from_gguf_stacked(cls, type_id: int, parts) -> "Linear":
        """One W whose rows are the rows of several tensors (same type and in_features).

        parts: [(data, (out_i, in)), ...]. One matvec then does the work of several in one
        parallel launch, with wider row tiles (measured on SmolLM2-135M shapes: q/k/v and
        gate/up stacked take 15-30% less time than separate calls). split(out) gives
        the per-tensor views of an output.
        """
        shapes = [tuple(int(v) for v in s) for _, s in parts]
        in_f = shapes[0][1]
        if any(s[1] != in_f for s in shapes):
            raise ValueError(f"stacked tensors need one in_features, got {shapes}")
        self = cls(type_id, sum(s[0] for s in shapes), in_f)
        self.splits = [s[0] for s in shapes]
        raws = [np.asarray(d).reshape(-1).view(np.uint8) for d, _ in parts]
        if type_id in _BLOCKS:
            self._load_blocks(raws)
        else:
            dtype = np.float32 if type_id == F32 else np.uint16
            ws = [r.view(dtype).reshape(s) for r, s in zip(raws, shapes)]
            self.w = ws[0] if len(ws) == 1 else np.concatenate(ws)
            if len(ws) > 1:
                for r in raws:
                    _release_pages(r)
            self.nbytes = self.w.nbytes
        return self

    def split(self, out: np.ndarray) -> list[np.ndarray]:
        """Views of out (..., out_features) per stacked tensor, in order."""
        return np.split(out, np.cumsum(self.splits)[:-1], axis=-1)

    def _load_blocks(self, raws: list[np.ndarray]) -> None:
        nh, pl = _BLOCKS[self.type_id]
        n, d = self.in_features, self.out_features
        if n % 32:
            raise ValueError(f"{self.type_name} row length {n} is not a multiple of 32")
        nb = n // 32
        row_bytes = nb * (2 * nh + pl)
        self.nbytes = d * row_bytes
        for raw, rows in zip(raws, self.splits):
            if raw.size != rows * row_bytes:
                raise ValueError(f"{self.type_name} ({rows}, {n}) needs {rows * row_bytes} bytes,"
                                 f" got {raw.size}")
        R = self.R = _tile_rows(d)
        nt = self.nt = -(-d // R)
        self.q = _anon_array((nt, nb * pl * R), np.uint8)   # zeroed: pad rows add nothing
        h = _anon_array((nh, nt, nb * R), np.uint16)
        row0 = 0
        for raw, rows in zip(raws, self.splits):
            K.repack_blocks(raw.reshape(rows, -1), row0, nh, pl, self.q, h)
            _release_pages(raw)
            row0 += rows
        self.d = h[0]
        self.m = h[1] if nh == 2 else h[0]
        self.m_off = np.float32(1.0 if nh == 2 else -8.0)   # Q4_1 adds m; Q4_0 adds -8 d
        self._scratch = np.zeros((nt, 2, R) if pl == 32 else (nt, R), np.float32)
        if pl == 16:                   # x quantized per block, see prep_q4_x
            self._s16 = np.zeros((nt, R), np.int16)
            self._xa = np.zeros(n // 2, np.int16)
            self._xb = np.zeros(n // 2, np.int16)
            self._xd = np.zeros(nb, np.float32)
            self._xm = np.zeros(nb, np.int16)
            self._xsum = np.zeros(nb, np.float32)

    # --- decode ---------------------------------------------------------------------

    def matvec(self, x: np.ndarray, out: np.ndarray) -> None:
        """out (out_features,) f32 = W @ x, x (in_features,) f32."""
        t = self.type_id
        if t == Q4_0 or t == Q4_1:
            K.prep_q4_x(x, self._xa, self._xb, self._xd, self._xm, self._xsum)
            if t == Q4_0:
                K.matvec_q4_0(self.q, self.d, self._xa, self._xb, self._xd, self._xm, out,
                              self._scratch, self._s16)
            else:
                K.matvec_q4_1(self.q, self.d, self.m, self._xa, self._xb, self._xd, self._xm,
                              self._xsum, out, self._scratch, self._s16)
        elif t == Q8_0:
            K.matvec_q8_0(self.q.view(np.int8), self.d, x, out, self._scratch)
        elif t == F32:
            K.matvec_f32(self.w, x, out)
        elif t == F16:
            K.matvec_f16(self.w, x, out)
        else:
            K.matvec_bf16(self.w, x, out)

    # --- prefill --------------------------------------------------------------------

    def matmul(self, x: np.ndarray, out: np.ndarray) -> None:
        """out (T, out_features) f32 = x @ W.T, x (T, in_features) f32 C-contiguous."""
        if self.type_id == F32:
            np.matmul(x, self.w.T, out=out)
            return
        n, d = self.in_features, self.out_features
        step = self._chunk_rows()
        wbuf = _prefill_scratch(n * step)
        for r0 in range(0, d, step):
            r1 = min(d, r0 + step)
            if self.type_id in _BLOCKS:
                t0, t1 = r0 // self.R, -(-r1 // self.R)
                wt = wbuf[:n * (t1 - t0) * self.R].reshape(n, -1)
                if self.type_id == Q8_0:
                    K.dequant_q8_tiles(self.q.view(np.int8), self.d, t0, t1, wt)
                else:
                    K.dequant_q4_tiles(self.q, self.d, self.m, self.m_off, t0, t1, wt)
                np.matmul(x, wt[:, :r1 - r0], out=out[:, r0:r1])
            else:
                ws = wbuf[:(r1 - r0) * n].reshape(r1 - r0, n)
                self._widen(self.w[r0:r1], ws)
                np.matmul(x, ws.T, out=out[:, r0:r1])

    @property
    def scratch_nbytes(self) -> tuple[int, int]:
        """(bytes of this matrix's own decode buffers, bytes of the prefill
        dequantization buffer it needs — shared by all Linears: count the max once)."""
        own = sum(v.nbytes for k, v in vars(self).items()
                  if k.startswith("_") and isinstance(v, np.ndarray))
        return own, self.in_features * self._chunk_rows() * 4

    def _chunk_rows(self) -> int:
        unit = self.R if self.type_id in _BLOCKS else 16
        rows = max(_CHUNK_MIN_ROWS, _CHUNK_FLOATS // self.in_features)
        return max(unit, rows // unit * unit)

    def _widen(self, w16: np.ndarray, out: np.ndarray) -> None:
        # f16 / bf16 bits (r, n) -> out (r, n) f32 (NumPy's vectorised casts)
        if self.type_id == F16:
            out[:] = w16.view(np.float16)
        else:
            np.left_shift(w16, 16, out=out.view(np.uint32), dtype=np.uint32)

    # --- embedding ------------------------------------------------------------------

    def rows(self, ids: np.ndarray, out: np.ndarray) -> None:
        """out (T, in_features) f32 = W[ids], ids (T,) int."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.out_features):
            raise IndexError(f"row id out of range [0, {self.out_features})")
        t = self.type_id
        if t == Q8_0:
            K.rows_q8(self.q.view(np.int8), self.d, ids, out)
        elif t in _BLOCKS:
            K.rows_q4(self.q, self.d, self.m, self.m_off, ids, out)
        elif t == F32:
            np.take(self.w, ids, axis=0, out=out)
        else:
            self._widen(self.w[ids], out)

    def __repr__(self) -> str:
        return f"Linear({self.type_name}, out={self.out_features}, in={self.in_features})"
