"""Q8_0: 32 weights per block, 34 bytes: d:f16, qs:i8[32]; x_j = qs[j] * d.

Runtime tiles (lanes across rows, see base.TiledLinear):
    q (nt, nb*32*R) i8 as quads (simd.py),  d (nt, nb*R) u16 f16 bits
Decode quantizes x to int8 per block (q4.prep_q8_x), as llama.cpp's q8_0 x q8_0 dot
does, and sums exactly in int32 with the CPU's pair-dot instructions (simd.i8_dot).
"""
from __future__ import annotations

import numpy as np
from gguf.constants import LlamaFileType
from numba import njit, prange

from ..fp import f16_to_f32, get_f16, put_f16, wrap_u8
from ..simd import ISA, KIND_Q8_0, i8_dot
from .base import (TiledLinear, WeightFormat, anon_array, quad_offset, release_pages,
                   repack_halves, repack_quads)
from .q4 import Int8Prefill, matmul_blocks, prep_q8_x

f32 = np.float32


@njit(parallel=True, cache=True)
def quantize_q8_0(x, out):
    # x (nb*32,) f32 -> out (nb*34,) u8; returns (non-finite blocks, overflowing scales)
    nb = x.size // 32
    bad = 0
    over = 0
    for b in prange(nb):
        base = b * 32
        amax = f32(0.0)
        chk = f32(0.0)
        for j in range(32):
            v = x[base + j]
            chk += v * f32(0.0)                  # NaN iff some v is NaN or inf
            a = abs(v)
            if a > amax:
                amax = a
        if chk != chk:
            bad += 1
        d = amax / f32(127.0)
        idv = f32(1.0) / d if d != 0 else f32(0.0)
        o = b * 34
        if put_f16(out, o, d):
            over += 1
        for j in range(32):
            v = x[base + j] * idv
            a = abs(v)
            fl = np.floor(a)
            r = fl + np.floor(f32(2.0) * (a - fl))   # round half away from zero
            out[o + 2 + j] = wrap_u8(r if v >= 0 else -r)
    return bad, over


@njit(parallel=True, cache=True)
def dequantize_q8_0(q, out):
    # q (nb*34,) u8 -> out (nb*32,) f32
    for b in prange(out.size // 32):
        o = b * 34
        d = get_f16(q, o)
        for j in range(32):
            out[b * 32 + j] = f32(np.int8(q[o + 2 + j])) * d


@njit(cache=True, fastmath=True, parallel=True)
def matvec_q8_0(q, d, x8, xd, out, scratch, s32):
    # W (nt*R, n) Q8_0 tiles q (nt, nb*32*R) i8 quads, d (nt, nb*R) u16 @ x (prep_q8_x)
    # -> out (d,); scratch (nt, R) f32, s32 (nt, R) int32: per-tile sums
    nt = q.shape[0]
    R = s32.shape[1]
    nb = xd.size
    for t in prange(nt):
        qt = q[t]
        dt = d[t]
        acc = scratch[t]
        s = s32[t]
        acc[:] = 0
        for b in range(nb):
            i8_dot(qt, 32 * b * R, x8, 32 * b, s, R, ISA)
            db = dt[b * R:(b + 1) * R]
            dx = xd[b]
            for r in range(R):
                acc[r] += f16_to_f32(db[r]) * dx * f32(s[r])
        n = min(R, out.size - t * R)
        out[t * R:t * R + n] = acc[:n]


@njit(cache=True, fastmath=True)
def rows_q8(q, d, ids, out):
    # Q8_0 tiles, ids (T,) -> out (T, n) f32 dequantized rows
    nb = out.shape[1] // 32
    R = d.shape[1] // nb
    for i in range(ids.size):
        t = ids[i] // R
        r = ids[i] % R
        row = out[i]
        for b in range(nb):
            dd = f16_to_f32(d[t, b * R + r])
            for j in range(32):
                row[32 * b + j] = f32(q[t, quad_offset(32 * b * R, R, r, j)]) * dd


class Q8Linear(Int8Prefill, TiledLinear):
    """Q8_0 in row tiles: q (nt, nb*32*R) i8 quads, d (nt, nb*R) u16."""

    def _load(self, raws):
        nb, nt, R = self.in_features // 32, self.nt, self.R
        q = anon_array((nt, nb * 32 * R), np.uint8)
        self.d = anon_array((nt, nb * R), np.uint16)
        row0 = 0
        for raw in raws:
            repack_halves(raw, row0, 34, 0, self.d)
            repack_quads(raw, row0, 34, 2, 32, q)
            release_pages(raw)
            row0 += raw.shape[0]
        self.q = q.view(np.int8)
        self._scratch = np.zeros((nt, R), f32)
        self._s32 = np.zeros((nt, R), np.int32)
        self._x8 = np.zeros(self.in_features, np.int8)
        self._xd = np.zeros(nb, f32)
        self._xs8 = np.zeros(nb, np.int32)      # prep_q8_x's sums, unused here
        self._xsum = np.zeros(nb, f32)

    def matvec(self, x, out):
        prep_q8_x(x, self._x8, self._xd, self._xs8, self._xsum)
        matvec_q8_0(self.q, self.d, self._x8, self._xd, out, self._scratch, self._s32)

    def _gemm(self, x8, xd, xs8, xsum, out, acc):
        matmul_blocks(KIND_Q8_0, self.q, self.d, self.d, x8, xd, xs8, xsum, out, acc)

    def _rows(self, ids, out):
        rows_q8(self.q, self.d, ids, out)


Q8_0 = WeightFormat("Q8_0", 8, 32, 34, "d:f16, qs:i8[32]; x=q*d", Q8Linear,
                    dequantize_q8_0, quantize_q8_0, LlamaFileType.MOSTLY_Q8_0)
