"""Q4_0 and Q4_1: 32 weights per block, 4-bit nibbles with an f16 scale (and min).

    Q4_0  18 bytes  d:f16, qs:u8[16]         x_j = (nibble_j - 8) * d
    Q4_1  20 bytes  d:f16, m:f16, qs:u8[16]  x_j = nibble_j * d + m
Element j < 16 is the low nibble of qs[j], j >= 16 the high nibble of qs[j - 16].

Runtime tiles (lanes across rows, see base.TiledLinear):
    q (nt, nb*16*R) u8 nibble bytes,  d [, m] (nt, nb*R) u16 f16 bits
Decode quantizes x to int8 per block (as llama.cpp does) and sums in int16 lanes.
The 4-bit nibble kernels here are shared by every format whose runtime form is
"nibbles in Q4_0 order with a per-32 scale" (see q4_k.py).
"""
from __future__ import annotations

import numpy as np
from gguf.constants import LlamaFileType
from numba import njit, prange

from ..fp import f16_to_f32, get_f16, put_f16, wrap_u8
from .base import TiledLinear, WeightFormat, anon_array, release_pages, repack_bytes, repack_halves

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


# --- decode: x prepared once per matvec, then int16 nibble sums --------------------------

@njit(cache=True, fastmath=True)
def prep_q4_x(x, xa, xb, xd, xm, xsum):
    # x (n,) f32 -> per block of 32, x quantized like llama.cpp's q8_0 activations:
    # xq = round(x / xd) in [-127, 127], xd (nb,) the scale; then for a nibble byte
    # v = lo + 16 hi, lo xq_j + hi xq_j+16 = v xa_j + (v >> 4) xb_j with xa (n/2,) int16
    # = xq_j, xb = xq_j+16 - 16 xq_j (no nibble mask in the inner loop);
    # xm (nb,) int16 = -8 sum(xq); xsum (nb,) exact float sums of x.
    # Why int16: the kernels sum in int16 lanes (16 per 256-bit vector, vs 8 f32).
    # Products and partial sums may wrap, but int16 arithmetic is exact mod 2^16 and the
    # final sum((q - 8) xq) is within 32 * 8 * 127 = 32512 < 2^15, so it comes out exact.
    nb = xd.size
    for b in range(nb):
        xblk = x[32 * b:32 * b + 32]
        amax = f32(0)
        s = f32(0)
        for j in range(32):
            amax = max(amax, abs(xblk[j]))
            s += xblk[j]
        d = amax / f32(127)
        inv = f32(1) / d if d > 0 else f32(0)
        qs = 0
        for j in range(16):
            lo = int(np.rint(xblk[j] * inv))
            hi = int(np.rint(xblk[j + 16] * inv))
            xa[16 * b + j] = lo
            xb[16 * b + j] = hi - 16 * lo          # |.| <= 17 * 127
            qs += lo + hi
        xd[b] = d
        xm[b] = -8 * qs                            # |.| <= 8 * 32 * 127 < 2^15
        xsum[b] = s


@njit(cache=True, fastmath=True)
def q4_block(qt, o, xa, xb, k, s, m):
    # s (R,) int16 = m + sum over one block of nibbles qt[o:o+16R] (16 bytes per row,
    # lanes across rows) times x (xa, xb from k = 16 b); 4 bytes of each row per pass.
    R = s.size
    s[:] = m
    for j in range(0, 16, 4):
        a0 = xa[k + j]; b0 = xb[k + j]; a1 = xa[k + j + 1]; b1 = xb[k + j + 1]
        a2 = xa[k + j + 2]; b2 = xb[k + j + 2]; a3 = xa[k + j + 3]; b3 = xb[k + j + 3]
        p = o + j * R
        q0 = qt[p:p + R]; q1 = qt[p + R:p + 2 * R]
        q2 = qt[p + 2 * R:p + 3 * R]; q3 = qt[p + 3 * R:p + 4 * R]
        for r in range(R):
            v0 = np.int16(q0[r]); v1 = np.int16(q1[r]); v2 = np.int16(q2[r]); v3 = np.int16(q3[r])
            # computed wide by Numba's typing, but only 16 bits are stored: LLVM narrows
            # the whole expression to int16 vector ops (vpmullw / vpaddw)
            s[r] = np.int16(s[r] + v0 * a0 + (v0 >> 4) * b0 + v1 * a1 + (v1 >> 4) * b1
                            + v2 * a2 + (v2 >> 4) * b2 + v3 * a3 + (v3 >> 4) * b3)


@njit(cache=True, fastmath=True, parallel=True)
def matvec_q4_0(q, d, xa, xb, xd, xm, out, scratch, s16):
    # W (nt*R, n) Q4_0 tiles q (nt, nb*16*R), d (nt, nb*R) @ x (prep_q4_x) -> out (d,)
    # scratch (nt, R) f32 and s16 (nt, R) int16: per-tile sums
    nt = q.shape[0]
    R = s16.shape[1]
    nb = xd.size
    for t in prange(nt):
        qt = q[t]
        dt = d[t]
        acc = scratch[t]
        s = s16[t]
        acc[:] = 0
        for b in range(nb):
            q4_block(qt, 16 * b * R, xa, xb, 16 * b, s, xm[b])
            db = dt[b * R:(b + 1) * R]
            dx = xd[b]
            for r in range(R):
                acc[r] += f16_to_f32(db[r]) * dx * f32(s[r])
        n = min(R, out.size - t * R)
        out[t * R:t * R + n] = acc[:n]


@njit(cache=True, fastmath=True, parallel=True)
def matvec_q4_1(q, d, m, xa, xb, xd, xm, xsum, out, scratch, s16):
    # W (nt*R, n) Q4_1 tiles q (nt, nb*16*R), d, m (nt, nb*R) @ x (prep_q4_x) -> out (d,)
    # row . x = sum_b d_b dx_b sum(q xq) + m_b sum(x); sum(q xq) = s + 8 sum(xq) = s - xm
    nt = q.shape[0]
    R = s16.shape[1]
    nb = xd.size
    for t in prange(nt):
        qt = q[t]
        acc = scratch[t]
        s = s16[t]
        acc[:] = 0
        for b in range(nb):
            q4_block(qt, 16 * b * R, xa, xb, 16 * b, s, xm[b])
            db = d[t, b * R:(b + 1) * R]
            mb = m[t, b * R:(b + 1) * R]
            dx = xd[b]
            off = -f32(xm[b])
            xs = xsum[b]
            for r in range(R):
                acc[r] += f16_to_f32(db[r]) * dx * (f32(s[r]) + off) + f16_to_f32(mb[r]) * xs
        n = min(R, out.size - t * R)
        out[t * R:t * R + n] = acc[:n]


# --- prefill and embedding: dequantize from tiles ----------------------------------------
# Serial on purpose: this is a few % of the matmul's time, and a parallel region between BLAS
# calls fights BLAS's threads (spin-waits) and stalls whenever any core is busy.

@njit(cache=True, fastmath=True)
def dequant_q4_tiles(q, d, m, m_off, t0, t1, wt):
    # Q4 tiles t0..t1 -> wt (n, (t1-t0)*R) f32 = W[rows].T; m_off: Q4_0 -8 (x = (q-8) d),
    # Q4_1 1 (x = q d + m). Rows of wt are R-wide runs of lanes: contiguous writes.
    nb = wt.shape[0] // 32
    R = d.shape[1] // nb
    dsc = np.empty(R, f32)
    msc = np.empty(R, f32)
    for b in range(nb):
        for t in range(t0, t1):
            for r in range(R):
                dsc[r] = f16_to_f32(d[t, b * R + r])
                msc[r] = f16_to_f32(m[t, b * R + r]) * m_off
            c = (t - t0) * R
            for j in range(16):
                qj = q[t, (16 * b + j) * R:(16 * b + j + 1) * R]
                lo = wt[32 * b + j, c:c + R]
                hi = wt[32 * b + 16 + j, c:c + R]
                for r in range(R):
                    lo[r] = f32(qj[r] & 15) * dsc[r] + msc[r]
                    hi[r] = f32(qj[r] >> 4) * dsc[r] + msc[r]


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
                v = q[t, (16 * b + j) * R + r]
                row[32 * b + j] = f32(v & 15) * dd + mm
                row[32 * b + 16 + j] = f32(v >> 4) * dd + mm


class Q4Linear(TiledLinear):
    """Q4_0 / Q4_1 in row tiles: q (nt, nb*16*R) u8, d [, m] (nt, nb*R) u16."""

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
            repack_bytes(raw, row0, bs, bs - 16, bs, self.q)
            release_pages(raw)
            row0 += raw.shape[0]
        self._scratch = np.zeros((nt, R), f32)
        self._s16 = np.zeros((nt, R), np.int16)
        self._xa = np.zeros(n // 2, np.int16)
        self._xb = np.zeros(n // 2, np.int16)
        self._xd = np.zeros(nb, f32)
        self._xm = np.zeros(nb, np.int16)
        self._xsum = np.zeros(nb, f32)

    def matvec(self, x, out):
        prep_q4_x(x, self._xa, self._xb, self._xd, self._xm, self._xsum)
        if self.type_name == "Q4_0":
            matvec_q4_0(self.q, self.d, self._xa, self._xb, self._xd, self._xm, out,
                        self._scratch, self._s16)
        else:
            matvec_q4_1(self.q, self.d, self.m, self._xa, self._xb, self._xd, self._xm,
                        self._xsum, out, self._scratch, self._s16)

    def _dequant_tiles(self, t0, t1, wt):
        dequant_q4_tiles(self.q, self.d, self.m, self.m_off, t0, t1, wt)

    def _rows(self, ids, out):
        rows_q4(self.q, self.d, self.m, self.m_off, ids, out)


Q4_0 = WeightFormat("Q4_0", 2, 32, 18, "d:f16, qs:u8[16]; x=(nibble-8)*d", Q4Linear,
                    dequantize_q4_0, quantize_q4_0, LlamaFileType.MOSTLY_Q4_0)
Q4_1 = WeightFormat("Q4_1", 3, 32, 20, "d:f16, m:f16, qs:u8[16]; x=nibble*d+m", Q4Linear,
                    dequantize_q4_1, quantize_q4_1, LlamaFileType.MOSTLY_Q4_1)
