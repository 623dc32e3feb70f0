"""What every weight format provides, and the machinery they share.

A format (one GGML type) is a `WeightFormat`: its block layout, its reference
quantize / dequantize over whole blocks (bit-exact with ggml), and its runtime form,
a `Linear` subclass that holds one weight matrix W (out_features, in_features) in
whatever layout its kernels read fastest:

    matvec   decode, one token: out = W @ x
    matvecs  batched decode, a few tokens of different sequences: one pass over W when
             the format has a multi-token kernel (records.RecordLinear), else a matvec each
    matmul   prefill, T tokens: out = x @ W.T, as an int8 GEMM over the tiles for the
             formats with pair-dot kernels (records.RecordLinear), a float GEMM for
             the float types (floats.FloatLinear)
    rows     embedding lookup: dequantized rows of W

A Linear holds only its weights: the buffers a call works in come from the `scratch`
argument (scratch.Scratch), or are allocated for the call when it is None, so one Linear
serves any number of sequences.

Quantized formats repack the file's blocks once at load into row tiles (`TiledLinear`)
and then drop the file's pages from this process, so resident memory stays about the
file size.
"""
from __future__ import annotations

import mmap
from collections.abc import Callable
from dataclasses import dataclass, field

import numba
import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from numba import prange

from ..kernels.jit import njit
from ..scratch import Scratch

def block_sizes(name: str) -> tuple[int, int]:
    """(elements, bytes) of one block of GGML type `name`, from gguf-py's table."""
    return GGML_QUANT_SIZES[GGMLQuantizationType[name]]


@dataclass(frozen=True)
class WeightFormat:
    name: str                  # GGML type name, e.g. "Q4_K"
    layout: str                # byte layout of one block, little-endian
    linear: type               # the runtime form, a Linear subclass
    # Whole blocks, flat arrays: dequantize(q (nb*type_size,) u8, out (nb*block_size,) f32);
    # quantize(x (nb*block_size,) f32, out (nb*type_size,) u8) -> (blocks with NaN/inf,
    # scales that overflow their storage). None: we read this type but do not write it.
    dequantize: Callable
    quantize: Callable | None = None
    file_type: int | None = None   # general.file_type of a file made mostly of this type
    # From gguf-py (GGMLQuantizationType, GGML_QUANT_SIZES) by name, never written out here:
    type_id: int = field(init=False)       # the type's id in a file
    block_size: int = field(init=False)    # elements per block
    type_size: int = field(init=False)     # bytes per block

    def __post_init__(self):
        object.__setattr__(self, "type_id", int(GGMLQuantizationType[self.name]))
        object.__setattr__(self, "block_size", block_sizes(self.name)[0])
        object.__setattr__(self, "type_size", block_sizes(self.name)[1])

    def row_bytes(self, n: int) -> int:
        assert n % self.block_size == 0, (self.name, n)
        return n // self.block_size * self.type_size


class Linear:
    """W (out_features, in_features) in one format; subclasses hold the data.

    Built from one or more tensors of the same format and row length whose rows are
    stacked (q/k/v, gate/up): one matvec then does the work of several in one parallel
    launch ("stacked matvec", bench/results/design_measurements.json); split(out) gives
    per-tensor views.
    """

    def __init__(self, fmt: WeightFormat, raws: list[np.ndarray], splits: list[int], in_features: int):
        # raws: per tensor, its bytes (u8, read-only file views are fine), rows = splits[i]
        self._setup(fmt, splits, in_features)
        rb = fmt.row_bytes(in_features)
        for raw, rows in zip(raws, splits):
            if raw.size != rows * rb:
                raise ValueError(f"{fmt.name} ({rows}, {in_features}) needs {rows * rb} bytes, "
                                 f"got {raw.size}")
        self._load([raw.reshape(rows, rb) for raw, rows in zip(raws, splits)])

    def _setup(self, fmt: WeightFormat, splits: list[int], in_features: int) -> None:
        """Everything but the data: what the shape and format determine."""
        if in_features <= 0 or not splits or min(splits) <= 0:
            raise ValueError(f"{fmt.name}: empty shape {splits} x {in_features}")
        if in_features % fmt.block_size:
            raise ValueError(f"{fmt.name} row length {in_features} is not a multiple of "
                             f"{fmt.block_size}")
        self.fmt = fmt
        self.type_id = fmt.type_id
        self.type_name = fmt.name
        self.in_features = in_features
        self.splits = list(splits)
        self.out_features = sum(splits)
        self.nbytes = self.out_features * fmt.row_bytes(in_features)
        # Linears with one key can share decode buffers (a tuple made once: every
        # matvec looks its buffers up by it)
        self.scratch_key = type(self), self.type_id, in_features, self.out_features

    # --- what a format implements ---------------------------------------------------

    def _load(self, raws: list[np.ndarray]) -> None:
        """Take the file rows (rows_i, row_bytes) u8 of each stacked tensor."""
        raise NotImplementedError

    def matvec(self, x: np.ndarray, out: np.ndarray, scratch: Scratch | None = None) -> None:
        """out (out_features,) f32 = W @ x, x (in_features,) f32."""
        raise NotImplementedError

    def decode_buffers(self) -> tuple:
        """New buffers for matvec to work in (scratch.linear keeps one set per
        scratch_key)."""
        return ()

    def matmul(self, x: np.ndarray, out: np.ndarray, scratch: Scratch | None = None) -> None:
        """out (T, out_features) f32 = x @ W.T, x (T, in_features) f32 C-contiguous."""
        raise NotImplementedError

    def _rows(self, ids: np.ndarray, out: np.ndarray) -> None:
        """out (T, in_features) f32 = W[ids], ids (T,) int64 already range-checked."""
        raise NotImplementedError

    # --- shared ---------------------------------------------------------------------

    def split(self, out: np.ndarray) -> list[np.ndarray]:
        """Views of out (..., out_features) per stacked tensor, in order."""
        return np.split(out, np.cumsum(self.splits)[:-1], axis=-1)

    def _buffers(self, scratch: Scratch | None) -> tuple:
        return self.decode_buffers() if scratch is None else scratch.linear(self)

    def matvecs(self, x: np.ndarray, out: np.ndarray, scratch: Scratch | None = None) -> None:
        """out (T, out_features) = x @ W.T for a few rows x (T, in_features), each as
        matvec computes it (batched decode). Formats with a multi-token kernel override
        this to read W once for all rows."""
        for i in range(x.shape[0]):
            self.matvec(x[i], out[i], scratch)

    def rows(self, ids: np.ndarray, out: np.ndarray) -> None:
        """out (T, in_features) f32 = W[ids], ids (T,) int."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.out_features):
            raise IndexError(f"row id out of range [0, {self.out_features})")
        self._rows(ids, out)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.type_name}, out={self.out_features}, in={self.in_features})"


# --- row tiles ------------------------------------------------------------------------

def tile_rows(out_features: int) -> int:
    """Rows per tile: the widest that still gives every thread 2+ tiles and pads <= 1/8
    of the rows. Wide tiles amortise each pass's loop overhead ("tile rows",
    bench/results/design_measurements.json)."""
    for r in (256, 128, 64, 32):
        nt = -(-out_features // r)
        if nt >= 2 * numba.config.NUMBA_NUM_THREADS and nt * r - out_features <= out_features // 8:
            return r
    return 16


def anon_array(shape: tuple[int, ...], dtype) -> np.ndarray:
    """A zeroed array in its own anonymous mapping, in ordinary 4 KiB pages.

    Load time is dominated by the kernel handing out the tiles' pages. np.empty asks
    for transparent huge pages on large arrays, which were several times slower to
    hand out ("tile pages", bench/results/design_measurements.json).
    """
    count = int(np.prod(shape))
    n = count * np.dtype(dtype).itemsize
    return np.frombuffer(mmap.mmap(-1, max(n, 1)), dtype, count=count).reshape(shape)


def release_pages(data: np.ndarray) -> None:
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


class TiledLinear(Linear):
    """A quantized W repacked into tiles of R rows with lanes across rows.

    For a tile of R output rows, byte j of block b of all R rows is contiguous, so a
    kernel's inner loop is an R-wide multiply-add of weight bytes by one broadcast x
    value: no per-block horizontal sum, and a block scale is one R-wide multiply.
    Rows past out_features are zero padding.

    A format declares its tiles in tile_spec() (names, shapes (nt, ..., R), dtypes): its
    _load allocates them (_alloc_tiles), repacks the file's rows into them and releases
    the file's pages; from_tiles rebuilds the Linear from those arrays alone (the tile
    cache's format: tile_cache.py).
    """

    TILE_ROWS = (16, 32, 64, 128, 256)

    def _setup(self, fmt, splits, in_features):
        super()._setup(fmt, splits, in_features)
        R = getattr(self, "R", None)     # given by shell(); else this machine's choice
        if R is not None and R not in self.TILE_ROWS:
            raise ValueError(f"{R} rows per tile, not one of {self.TILE_ROWS}")
        self.R = R or tile_rows(self.out_features)
        self.nt = -(-self.out_features // self.R)

    def tile_spec(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """name -> (shape, dtype) of every tile array this layout holds."""
        raise NotImplementedError

    def tiles(self) -> dict[str, np.ndarray]:
        return {k: getattr(self, k) for k in self.tile_spec()}

    def _alloc_tiles(self) -> None:
        for k, (shape, dtype) in self.tile_spec().items():
            setattr(self, k, anon_array(shape, dtype))    # zeroed: pad rows add nothing
        self._tiles_set()

    def _tiles_set(self) -> None:
        """After the tile arrays are in place (aliases between them)."""

    @classmethod
    def shell(cls, fmt: WeightFormat, splits: list[int], in_features: int,
              R: int | None = None) -> TiledLinear:
        """A Linear of this shape and R rows per tile (default: tile_rows') without its
        tiles: what tile_spec() expects."""
        lin = cls.__new__(cls)
        lin.R = R
        lin._setup(fmt, splits, in_features)
        return lin

    @classmethod
    def from_tiles(cls, fmt: WeightFormat, splits: list[int], in_features: int, R: int,
                   arrays: dict[str, np.ndarray]) -> TiledLinear:
        """The Linear whose tiles are `arrays`; ValueError unless they are exactly the
        arrays tile_spec() declares for this shape."""
        lin = cls.shell(fmt, splits, in_features, R)
        spec = lin.tile_spec()
        if set(arrays) != set(spec):
            raise ValueError(f"tiles {sorted(arrays)}, expected {sorted(spec)}")
        for k, (shape, dtype) in spec.items():
            a = arrays[k]
            if a.shape != tuple(shape) or a.dtype != np.dtype(dtype):
                raise ValueError(f"tile {k}: {a.dtype}{a.shape}, expected {np.dtype(dtype)}{shape}")
            setattr(lin, k, a)
        lin._tiles_set()
        return lin


@njit(cache=True, parallel=True)
def repack_bytes(raw, row0, bs, lo, hi, dst):
    # Bytes lo..hi of every block (bs bytes) of raw (rows, nb*bs) u8 -> rows row0.. of
    # the tiles dst (nt, nb*(hi-lo)*R) u8: dst[t, (b*(hi-lo) + j)*R + r] = byte lo+j of
    # block b of row t*R + r. Column by column of one tile (L2-resident): contiguous
    # writes, not row by row with strided writes ("repack order",
    # bench/results/design_measurements.json).
    rows = raw.shape[0]
    nb = raw.shape[1] // bs
    w = hi - lo
    R = dst.shape[1] // (nb * w)
    for t in prange(row0 // R, (row0 + rows - 1) // R + 1):
        r0 = max(0, row0 - t * R)                  # tile lanes r0..r1 <- raw rows
        r1 = min(R, row0 + rows - t * R)
        tile = raw[t * R + r0 - row0:t * R + r1 - row0]
        dt = dst[t]
        for b in range(nb):
            for j in range(w):
                o = (b * w + j) * R
                lane = dt[o + r0:o + r1]
                col = tile[:, b * bs + lo + j]
                for r in range(r1 - r0):
                    lane[r] = col[r]


@njit(cache=True, parallel=True)
def repack_halves(raw, row0, bs, off, dst):
    # The u16 (f16 bits) at byte off of every block of raw (rows, nb*bs) u8 -> rows
    # row0.. of dst (nt, nb*R) u16: dst[t, b*R + r] = that half of block b of row t*R + r
    rows = raw.shape[0]
    nb = raw.shape[1] // bs
    R = dst.shape[1] // nb
    for t in prange(row0 // R, (row0 + rows - 1) // R + 1):
        r0 = max(0, row0 - t * R)
        r1 = min(R, row0 + rows - t * R)
        tile = raw[t * R + r0 - row0:t * R + r1 - row0]
        dt = dst[t]
        for b in range(nb):
            lane = dt[b * R + r0:b * R + r1]
            lo = tile[:, b * bs + off]
            hi = tile[:, b * bs + off + 1]
            for r in range(r1 - r0):
                lane[r] = np.uint16(lo[r]) | (np.uint16(hi[r]) << np.uint16(8))
