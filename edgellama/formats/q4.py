"""Q4_0 and Q4_1: 32 weights per block, 4-bit nibbles with an f16 scale (and min).

    Q4_0  18 bytes  d:f16, qs:u8[16]         x_j = (nibble_j - 8) * d
    Q4_1  20 bytes  d:f16, m:f16, qs:u8[16]  x_j = nibble_j * d + m
Element j < 16 is the low nibble of qs[j], j >= 16 the high nibble of qs[j - 16].

Runtime tiles (lanes across rows, see base.TiledLinear):
    q (nt, nb*16*R) u8 the file's nibble bytes as "quads" (simd.py: 4 bytes of a row
    side by side), d [, m] (nt, nb*R) u16 f16 bits
Decode quantizes x to int8 per block (prep_q8_x, as llama.cpp does) and sums nibble
times x8 exactly in int32 with the CPU's pair-dot instructions (simd.nib_dot); prefill
is an int8 GEMM over the tiles (Int8Prefill, simd.quads_gemm).
"""
from __future__ import annotations

import numpy as np
from gguf.constants import LlamaFileType
from numba import njit, prange

from ..fp import f16_to_f32, get_f16, put_f16, wrap_u8
from ..simd import ISA, KIND_Q4_0, KIND_Q4_1, KIND_Q8_0, TOKENS, nib_dot, quads_gemm
from .base import (TiledLinear, WeightFormat, anon_array, quad_offset, release_pages,
                   repack_halves, repack_quads)

f32 = np.float32


# --- reference quantize / dequantize (bit-exact with ggml's quantize_row_q4_*_ref) ------

@njit(cache=True, inline="always")
def signed_absmax(x, base):
    # x[base:base+32] -> (the element of largest |x|, the first on ties, as ggml's Q4_0 and
    # Q5_0; 0.0 for an all-zero block, so d = 0 / -k = -0.0 as ggml writes it (gguf-py
    # keeps x[0]'s sign there); False if some element is NaN or inf)
    mx = f32(0.0)
    amax = f32(0.0)
    chk = f32(0.0)
    for j in range(32):
        v = x[base + j]
        chk += v * f32(0.0)                      # NaN iff some v is NaN or inf
        if abs(v) > amax:                        # strict: the first max-|x| element wins
            amax = abs(v)
            mx = v
    return mx, chk == chk


@njit(parallel=True, cache=True)
def quantize_q4_0(x, out):
    # x (nb*32,) f32 -> out (nb*18,) u8; returns (non-finite blocks, overflowing scales)
    nb = x.size // 32
    bad = 0
    over = 0
    for b in prange(nb):
        base = b * 32
        mx, finite = signed_absmax(x, base)
        if not finite:
            bad += 1
        d = mx / f32(-8.0)
        idv = f32(1.0) / d if d != 0 else f32(0.0)
        o = b * 18
        if put_f16(out, o, d):
            over += 1
        for j in range(16):
            q0 = min(wrap_u8(np.trunc(x[base + j] * idv + f32(8.5))), np.uint8(15))
            q1 = min(wrap_u8(np.trunc(x[base + 16 + j] * idv + f32(8.5))), np.uint8(15))
            out[o + 2 + j] = q0 | (q1 << 4)
    return bad, over


@njit(parallel=True, cache=True)
def quantize_q4_1(x, out):
    # x (nb*32,) f32 -> out (nb*20,) u8; returns (non-finite blocks, overflowing d or m)
    nb = x.size // 32
    bad = 0
    over = 0
    for b in prange(nb):
        base = b * 32
        vmax = x[base]
        vmin = x[base]
        chk = f32(0.0)
        for j in range(32):
            v = x[base + j]
            chk += v * f32(0.0)
            vmax = max(vmax, v)
            vmin = min(vmin, v)
        if chk != chk:
            bad += 1
        d = (vmax - vmin) / f32(15.0)
        idv = f32(1.0) / d if d != 0 else f32(0.0)
        o = b * 20
        o1 = put_f16(out, o, d)
        o2 = put_f16(out, o + 2, vmin)
        if o1 or o2:
            over += 1
        for j in range(16):
            q0 = min(wrap_u8(np.trunc((x[base + j] - vmin) * idv + f32(0.5))), np.uint8(15))
            q1 = min(wrap_u8(np.trunc((x[base + 16 + j] - vmin) * idv + f32(0.5))), np.uint8(15))
            out[o + 4 + j] = q0 | (q1 << 4)
    return bad, over


@njit(parallel=True, cache=True)
def dequantize_q4_0(q, out):
    # q (nb*18,) u8 -> out (nb*32,) f32
    for b in prange(out.size // 32):
        o = b * 18
        d = get_f16(q, o)
        for j in range(16):
            byte = np.int64(q[o + 2 + j])
            out[b * 32 + j] = d * f32((byte & 15) - 8)
            out[b * 32 + 16 + j] = d * f32((byte >> 4) - 8)


@njit(parallel=True, cache=True)
def dequantize_q4_1(q, out):
    # q (nb*20,) u8 -> out (nb*32,) f32
    for b in prange(out.size // 32):
        o = b * 20
        d = get_f16(q, o)
        m = get_f16(q, o + 2)
        for j in range(16):
            byte = np.int64(q[o + 4 + j])
            out[b * 32 + j] = d * f32(byte & 15) + m
            out[b * 32 + 16 + j] = d * f32(byte >> 4) + m


# --- decode: x quantized to int8 once per matvec, then pair-dot sums ----------------------

@njit(cache=True, fastmath=True)
def prep_q8_x(x, x8, xd, xs8, xsum):
    # x (n,) f32 -> per block of 32, x quantized as llama.cpp's q8_0 activations:
    # x8 (n,) int8 = rint(x / xd) in [-127, 127], xd (nb,) the scale, xs8 (nb,) int32
    # = sum(x8), xsum (nb,) exact float sums of x (for formats with a min)
    for b in range(xd.size):
        xblk = x[32 * b:32 * b + 32]
        amax = f32(0)
        s = f32(0)
        for j in range(32):
            amax = max(amax, abs(xblk[j]))
            s += xblk[j]
        d = amax / f32(127)
        inv = f32(1) / d if d > 0 else f32(0)
        qs = 0
        for j in range(32):
            v = int(np.rint(xblk[j] * inv))
            x8[32 * b + j] = v
            qs += v
        xd[b] = d
        xs8[b] = qs
        xsum[b] = s


@njit(cache=True, fastmath=True, parallel=True)
def matvec_q4_0(q, d, x8, xd, xs8, out, scratch, s32):
    # W (nt*R, n) Q4_0 tiles q (nt, nb*16*R) quads, d (nt, nb*R) @ x (prep_q8_x) -> out (d,)
    # scratch (nt, R) f32, s32 (nt, R) int32: per-tile sums; sum((q - 8) x8) = s - 8 xs8
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
            nib_dot(qt, 16 * b * R, x8, 32 * b, s, R, ISA)
            db = dt[b * R:(b + 1) * R]
            dx = xd[b]
            off = 8 * xs8[b]
            for r in range(R):
                acc[r] += f16_to_f32(db[r]) * dx * f32(s[r] - off)
        n = min(R, out.size - t * R)
        out[t * R:t * R + n] = acc[:n]


@njit(cache=True, fastmath=True, parallel=True)
def matvec_q4_1(q, d, m, x8, xd, xsum, out, scratch, s32):
    # W (nt*R, n) Q4_1 tiles q (nt, nb*16*R) quads, d, m (nt, nb*R) @ x (prep_q8_x) -> out
    # row . x = sum_b d_b dx_b sum(q x8) + m_b sum(x)
    nt = q.shape[0]
    R = s32.shape[1]
    nb = xd.size
    for t in prange(nt):
        qt = q[t]
        acc = scratch[t]
        s = s32[t]
        acc[:] = 0
        for b in range(nb):
            nib_dot(qt, 16 * b * R, x8, 32 * b, s, R, ISA)
            db = d[t, b * R:(b + 1) * R]
            mb = m[t, b * R:(b + 1) * R]
            dx = xd[b]
            xs = xsum[b]
            for r in range(R):
                acc[r] += f16_to_f32(db[r]) * dx * f32(s[r]) + f16_to_f32(mb[r]) * xs
        n = min(R, out.size - t * R)
        out[t * R:t * R + n] = acc[:n]


# --- prefill: int8 GEMM over the tiles ------------------------------------------------------

@njit(cache=True, parallel=True)
def prep_q8_rows(x, x8, xd, xs8, xsum):
    # x (T, n) f32 -> prep_q8_x of each row: x8 (Tp, n) int8, xd, xs8, xsum (Tp, n/32);
    # rows T..Tp stay as they are (zero: they pad the last group of TOKENS rows)
    for i in prange(x.shape[0]):
        prep_q8_x(x[i], x8[i], xd[i], xs8[i], xsum[i])


@njit(cache=True, parallel=True)
def matmul_blocks(kind, q, d, m, x8, xd, xs8, xsum, out, acc):
    # W (nt*R, n) tiles of a per-32-block format (kind: KIND_Q4_0, _Q4_1 or _Q8_0; m
    # unused but for Q4_1) @ x (prep_q8_rows; x8 flat (Tp*n,)) -> out (T, dout) = x W^T.
    # acc (nt, TOKENS, R) f32: per-tile sums. A tile's weights (R rows, L2-sized) are
    # read once per group of TOKENS rows of x (simd.quads_gemm).
    T = out.shape[0]
    nt = q.shape[0]
    R = acc.shape[2]
    nb = xd.shape[1]
    xdf, xs8f, xsumf = xd.reshape(-1), xs8.reshape(-1), xsum.reshape(-1)
    for t in prange(nt):
        a = acc[t]
        af = a.reshape(-1)
        c0 = t * R
        nc = min(R, out.shape[1] - c0)
        for t0 in range(0, T, TOKENS):
            if kind == KIND_Q4_0:
                quads_gemm(q[t], d[t], m[t], x8, xdf, xs8f, xsumf, af, nb, t0, KIND_Q4_0, ISA)
            elif kind == KIND_Q4_1:
                quads_gemm(q[t], d[t], m[t], x8, xdf, xs8f, xsumf, af, nb, t0, KIND_Q4_1, ISA)
            else:
                quads_gemm(q[t], d[t], m[t], x8, xdf, xs8f, xsumf, af, nb, t0, KIND_Q8_0, ISA)
            for k in range(min(TOKENS, T - t0)):
                out[t0 + k, c0:c0 + nc] = a[k, :nc]


class Int8Prefill:
    """Prefill as an int8 GEMM for tiles the pair-dot kernels read (Q4_0, Q4_1, Q8_0,
    Q4_K): x is quantized to int8 per block of 32, row by row, as decode and llama.cpp
    do, and each tile of weights is multiplied in place, never dequantized. On this
    2-core EPYC (AVX-512 VNNI), Q4_0 8192 x 2048 at T = 512, 2 threads: 150-240 GFLOP/s
    against 30-65 for dequantize + BLAS; 480-540 with simd.quads_gemm (320 with the
    scales applied in a pass over memory per block, in the same runs)."""

    def matmul(self, x, out):
        T, n = x.shape
        Tp = -(-T // TOKENS) * TOKENS
        x8 = np.zeros((Tp, n), np.int8)
        xd, xsum = np.zeros((Tp, n // 32), f32), np.zeros((Tp, n // 32), f32)
        xs8 = np.zeros((Tp, n // 32), np.int32)
        prep_q8_rows(x, x8, xd, xs8, xsum)
        self._gemm(x8.reshape(-1), xd, xs8, xsum, out, np.empty((self.nt, TOKENS, self.R), f32))

    def _gemm(self, x8, xd, xs8, xsum, out, acc):
        """out (T, out_features) = x W^T from prep_q8_rows' arrays; acc (nt, TOKENS, R)
        f32 per-tile scratch."""
        raise NotImplementedError


# --- embedding: dequantized rows ----------------------------------------------------------

@njit(cache=True, fastmath=True)
def rows_q4(q, d, m, m_off, ids, out):
    # Q4 tiles, ids (T,) -> out (T, n) f32 dequantized rows
    nb = out.shape[1] // 32
    R = d.shape[1] // nb
    for i in range(ids.size):
        t = ids[i] // R
        r = ids[i] % R
        row = out[i]
        for b in range(nb):
            dd = f16_to_f32(d[t, b * R + r])
            mm = f16_to_f32(m[t, b * R + r]) * m_off if m_off == f32(1) else dd * m_off
            for j in range(16):
                v = q[t, quad_offset(16 * b * R, R, r, j)]
                row[32 * b + j] = f32(v & 15) * dd + mm
                row[32 * b + 16 + j] = f32(v >> 4) * dd + mm


class Q4Linear(Int8Prefill, TiledLinear):
    """Q4_0 / Q4_1 in row tiles: q (nt, nb*16*R) u8 quads (see simd.py), d [, m] (nt, nb*R)
    u16."""

    def _load(self, raws):
        n = self.in_features
        nb, nt, R = n // 32, self.nt, self.R
        has_m = self.type_name == "Q4_1"
        bs = self.fmt.type_size
        self.q = anon_array((nt, nb * 16 * R), np.uint8)   # zeroed: pad rows add nothing
        self.d = anon_array((nt, nb * R), np.uint16)
        self.m = anon_array((nt, nb * R), np.uint16) if has_m else self.d
        self.m_off = f32(1.0 if has_m else -8.0)           # Q4_1 adds m; Q4_0 adds -8 d
        row0 = 0
        for raw in raws:
            repack_halves(raw, row0, bs, 0, self.d)
            if has_m:
                repack_halves(raw, row0, bs, 2, self.m)
            repack_quads(raw, row0, bs, bs - 16, 16, self.q)
            release_pages(raw)
            row0 += raw.shape[0]
        self._scratch = np.zeros((nt, R), f32)
        self._s32 = np.zeros((nt, R), np.int32)
        self._x8 = np.zeros(n, np.int8)
        self._xd = np.zeros(nb, f32)
        self._xs8 = np.zeros(nb, np.int32)
        self._xsum = np.zeros(nb, f32)

    def matvec(self, x, out):
        prep_q8_x(x, self._x8, self._xd, self._xs8, self._xsum)
        if self.type_name == "Q4_0":
            matvec_q4_0(self.q, self.d, self._x8, self._xd, self._xs8, out,
                        self._scratch, self._s32)
        else:
            matvec_q4_1(self.q, self.d, self.m, self._x8, self._xd, self._xsum, out,
                        self._scratch, self._s32)

    def _gemm(self, x8, xd, xs8, xsum, out, acc):
        matmul_blocks(KIND_Q4_0 if self.type_name == "Q4_0" else KIND_Q4_1, self.q, self.d, self.m,
                      x8, xd, xs8, xsum, out, acc)

    def _rows(self, ids, out):
        rows_q4(self.q, self.d, self.m, self.m_off, ids, out)


Q4_0 = WeightFormat("Q4_0", 2, 32, 18, "d:f16, qs:u8[16]; x=(nibble-8)*d", Q4Linear,
                    dequantize_q4_0, quantize_q4_0, LlamaFileType.MOSTLY_Q4_0)
Q4_1 = WeightFormat("Q4_1", 3, 32, 20, "d:f16, m:f16, qs:u8[16]; x=nibble*d+m", Q4Linear,
                    dequantize_q4_1, quantize_q4_1, LlamaFileType.MOSTLY_Q4_1)
