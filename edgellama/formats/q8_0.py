"""Q8_0: 32 weights per block, 34 bytes: d:f16, qs:i8[32]; x_j = qs[j] * d.

Runtime tiles (lanes across rows, see base.TiledLinear):
    q (nt, nb*32*R) i8,  d (nt, nb*R) u16 f16 bits
Sums run in f32 (int8 x int8 products do not fit int16 lanes, and Q8_0 is memory-bound
already).
"""
from __future__ import annotations

import numpy as np
from gguf.constants import LlamaFileType
from numba import njit, prange

from ..fp import f16_to_f32, get_f16, put_f16, wrap_u8
from .base import TiledLinear, WeightFormat, anon_array, release_pages, repack_bytes, repack_halves

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
def matvec_q8_0(q, d, x, out, scratch):
    # W (nt*R, n) Q8_0 tiles q (nt, nb*32*R) i8, d (nt, nb*R) u16 @ x (n,) -> out (d,)
    # scratch (nt, 2, R) f32: per-tile sums
    nt = q.shape[0]
    R = scratch.shape[2]
    nb = x.size // 32
    for t in prange(nt):
        qt = q[t]
        dt = d[t]
        acc = scratch[t, 0]
        s = scratch[t, 1]
        acc[:] = 0
        for b in range(nb):
            s[:] = 0
            for j in range(0, 32, 4):
                k = 32 * b + j
                x0 = x[k]; x1 = x[k + 1]; x2 = x[k + 2]; x3 = x[k + 3]
                o = k * R
                q0 = qt[o:o + R]; q1 = qt[o + R:o + 2 * R]
                q2 = qt[o + 2 * R:o + 3 * R]; q3 = qt[o + 3 * R:o + 4 * R]
                for r in range(R):
                    s[r] += f32(q0[r]) * x0 + f32(q1[r]) * x1 + f32(q2[r]) * x2 + f32(q3[r]) * x3
            db = dt[b * R:(b + 1) * R]
            for r in range(R):
                acc[r] += f16_to_f32(db[r]) * s[r]
        n = min(R, out.size - t * R)
        out[t * R:t * R + n] = acc[:n]


@njit(cache=True, fastmath=True)
def dequant_q8_tiles(q, d, t0, t1, wt):
    # Q8_0 tiles t0..t1 -> wt (n, (t1-t0)*R) f32 = W[rows].T (serial: see q4.py)
    nb = wt.shape[0] // 32
    R = d.shape[1] // nb
    dsc = np.empty(R, f32)
    for b in range(nb):
        for t in range(t0, t1):
            for r in range(R):
                dsc[r] = f16_to_f32(d[t, b * R + r])
            c = (t - t0) * R
            for j in range(32):
                qj = q[t, (32 * b + j) * R:(32 * b + j + 1) * R]
                w = wt[32 * b + j, c:c + R]
                for r in range(R):
                    w[r] = f32(qj[r]) * dsc[r]


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
                row[32 * b + j] = f32(q[t, (32 * b + j) * R + r]) * dd


class Q8Linear(TiledLinear):
    """Q8_0 in row tiles: q (nt, nb*32*R) i8, d (nt, nb*R) u16."""

    def _load(self, raws):
        nb, nt, R = self.in_features // 32, self.nt, self.R
        q = anon_array((nt, nb * 32 * R), np.uint8)
        self.d = anon_array((nt, nb * R), np.uint16)
        row0 = 0
        for raw in raws:
            repack_halves(raw, row0, 34, 0, self.d)
            repack_bytes(raw, row0, 34, 2, 34, q)
            release_pages(raw)
            row0 += raw.shape[0]
        self.q = q.view(np.int8)
        self._scratch = np.zeros((nt, 2, R), f32)

    def matvec(self, x, out):
        matvec_q8_0(self.q, self.d, x, out, self._scratch)

    def _dequant_tiles(self, t0, t1, wt):
        dequant_q8_tiles(self.q, self.d, t0, t1, wt)

    def _rows(self, ids, out):
        rows_q8(self.q, self.d, ids, out)


Q8_0 = WeightFormat("Q8_0", 8, 32, 34, "d:f16, qs:i8[32]; x=q*d", Q8Linear,
                    dequantize_q8_0, quantize_q8_0, LlamaFileType.MOSTLY_Q8_0)
