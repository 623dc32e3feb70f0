"""Q6_K: 256 weights per super-block, 210 bytes, 6-bit values with an int8 scale per 16.

    ql:u8[128]  low 4 bits,  qh:u8[64]  high 2 bits,  scales:i8[16],  d:f16
    x_j = d * scales[j // 16] * (q_j - 32),  q_j = low_j | high_j << 4 in [0, 63]
Within each half h (128 weights) and l < 32: ql[64h + l] holds the low bits of j = 128h + l
(low nibble) and 128h + 64 + l (high nibble), ql[64h + 32 + l] those of 128h + 32 + l and
128h + 96 + l; qh[32h + l] the high bits of 128h + l, +32, +64, +96 (bits 0-1, 2-3, 4-5, 6-7).

Runtime tiles (lanes across rows, see base.TiledLinear), the file's 210 bytes per block:
    q (nt, nsub*26*R) u8   per block u of 32 weights (8 per super-block), at 26 u R:
                           16 R bytes of nibbles (byte j: the low 4 bits of elements j and
                           16 + j, as Q4_0), 8 R of crumbs (byte j: the high 2 bits of
                           elements j, j + 8, j + 16, j + 24), both as quads (simd.py), then
                           the int8 scales of elements 0..15 and of 16..31 (R bytes each)
    d (nt, nsb*R) u16      f16 bits, per super-block
Decode quantizes x to int8 per 32 (q4.prep_q8_x, as the other pair-dot formats; llama.cpp
uses one scale per 256 for Q6_K) and simd.q6_dot rebuilds the 6-bit values in registers
and sums scale * (q - 32) * x8 over each block exactly in int32; then f32 per block and
super-block. Prefill (q4.Int8Prefill) is simd.q6_gemm: the same sums for 4 rows of x per
weight load, its f32 sums kept in registers over all of a tile's blocks.
Why crumbs: a crumb quad serves two nibble quads with a shift and a mask each, so the
6-bit values cost no more loads than their bytes. The scales sit inside the quant stream
as Q4_K's do (q4_k.py measured why); decode prefetches the next block, as Q4_K does
(without: 18 against 24.5 GB/s one thread).
Measured on this 2-core EPYC VM (AVX-512 VNNI), 8 layers of Llama 3.2 1B shapes read from
DRAM, runs alternated with the int16 words this layout replaced and with Q4_K: decode one
thread 24.0-25.0 GB/s (words 18.1-21.4, Q4_K 19.8-20.7), two threads 39-46 when quiet
(words 34, Q4_K 36-39) and 30 with a busy neighbour, as the words and Q4_K then. Prefill
of an 8192 x 2048 matrix, T = 512, one thread: 435-453 GFLOP/s (Q4_K 308-348; the same
sums written to memory per block and scaled in a Numba loop, as Q4_K did then, 297-338), two
threads 622-832 when quiet (Q4_K 533-575; the words' dequantize + BLAS 192-220). Its AVX2
kernels on the same CPU, one thread, against Q4_K's AVX2 ones: decode 22-24 GB/s (Q4_K
20-22), prefill 168-186 GFLOP/s (Q4_K 199-222; per-block sums in memory 187-194, which
load each block's x words once per block instead of once per strip of 8 rows).
"""
from __future__ import annotations

import numpy as np
from gguf.constants import LlamaFileType
from numba import njit, prange

from ..fp import f16_to_f32, get_f16, nearest_int, put_f16
from ..simd import ISA, TOKENS, prefetch_run, q6_dot, q6_gemm
from .base import TiledLinear, WeightFormat, anon_array, quad_offset, release_pages
from .q4 import Int8Prefill, prep_q8_x

f32 = np.float32
QK = 256                   # weights per super-block
BS = 210                   # bytes per super-block
GROUP_MAX_EPS = f32(1e-15)
_CHUNK = 64                # super-blocks per parallel work item of the reference kernels


# --- reference quantize / dequantize (bit-exact with ggml's quantize_row_q6_K_ref) -------

@njit(cache=True)
def make_qx_quants_16(x, L):
    # ggml's make_qx_quants(16, nmax=32, x, L, rmse_type=1, qw=NULL) in its f32 order:
    # the scale of one 16-weight sub-block x (16,) f32, L (16,) <- q in [0, 63]. Tries
    # iscale = -(32 + 0.1 is) / max for is in -9..9 and keeps the best weighted (x^2)
    # least-squares fit.
    mx = f32(0.0)
    amax = f32(0.0)
    for i in range(16):
        ax = abs(x[i])
        if ax > amax:                            # strict: the first max-|x| element wins
            amax = ax
            mx = x[i]
    if amax < GROUP_MAX_EPS:
        L[:] = 0
        return f32(0.0)
    iscale = f32(-32.0) / mx
    sumlx = f32(0.0)
    suml2 = f32(0.0)
    for i in range(16):
        l = max(-32, min(31, nearest_int(iscale * x[i])))
        L[i] = l + 32
        w = x[i] * x[i]
        fl = f32(l)
        sumlx += w * x[i] * fl
        suml2 += w * fl * fl
    scale = sumlx / suml2 if suml2 != 0 else f32(0.0)
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        iscale = -(f32(32.0) + f32(0.1) * f32(step)) / mx
        sumlx = f32(0.0)
        suml2 = f32(0.0)
        for i in range(16):
            l = max(-32, min(31, nearest_int(iscale * x[i])))
            w = x[i] * x[i]
            fl = f32(l)
            sumlx += w * x[i] * fl
            suml2 += w * fl * fl
        if suml2 > 0 and sumlx * sumlx > best * suml2:
            for i in range(16):
                L[i] = 32 + max(-32, min(31, nearest_int(iscale * x[i])))
            scale = sumlx / suml2
            best = scale * sumlx
    return scale


@njit(cache=True)
def quantize_block(xb, blk, L, scales):
    # one super-block xb (256,) f32 -> blk (210,) u8, as quantize_row_q6_K_ref; L (256,),
    # scales (16,) scratch. Returns True if the magnitude is too large: d overflows f16,
    # or x^2 overflows f32 (|x| > 1.8e19: ggml's scales turn NaN and it writes zeros).
    max_scale = f32(0.0)
    max_abs = f32(0.0)
    over = False
    for s in range(16):
        sc = make_qx_quants_16(xb[16 * s:16 * s + 16], L[16 * s:16 * s + 16])
        scales[s] = sc
        over |= not np.isfinite(sc)
        if abs(sc) > max_abs:
            max_abs = abs(sc)
            max_scale = sc
    if max_abs < GROUP_MAX_EPS:                  # all sub-blocks ~zero: a zero block
        blk[:] = 0
        return over
    iscale = f32(-128.0) / max_scale
    over |= put_f16(blk, 208, f32(1.0) / iscale)
    dd = get_f16(blk, 208)
    for s in range(16):
        q = np.int8(min(127, nearest_int(iscale * scales[s])))
        blk[192 + s] = np.uint8(q & 0xFF)
        d = dd * f32(q)
        if d == 0:                               # ggml keeps make_qx_quants' L here
            continue
        for i in range(16 * s, 16 * s + 16):
            L[i] = max(-32, min(31, nearest_int(xb[i] / d))) + 32
    for h in range(2):
        for l in range(32):
            q1 = L[128 * h + l]
            q2 = L[128 * h + 32 + l]
            q3 = L[128 * h + 64 + l]
            q4 = L[128 * h + 96 + l]
            blk[64 * h + l] = np.uint8((q1 & 15) | ((q3 & 15) << 4))
            blk[64 * h + 32 + l] = np.uint8((q2 & 15) | ((q4 & 15) << 4))
            blk[128 + 32 * h + l] = np.uint8((q1 >> 4) | ((q2 >> 4) << 2)
                                             | ((q3 >> 4) << 4) | ((q4 >> 4) << 6))
    return over


@njit(parallel=True, cache=True)
def quantize_q6_k(x, out):
    # x (nb*256,) f32 -> out (nb*210,) u8; returns (non-finite blocks, overflowing scales)
    nb = x.size // QK
    bad = 0
    over = 0
    for c in prange(-(-nb // _CHUNK)):
        L = np.empty(QK, np.int64)
        scales = np.empty(16, f32)
        for b in range(c * _CHUNK, min(nb, (c + 1) * _CHUNK)):
            xb = x[b * QK:(b + 1) * QK]
            chk = f32(0.0)
            for j in range(QK):
                chk += xb[j] * f32(0.0)              # NaN iff some x is NaN or inf
            too_large = quantize_block(xb, out[b * BS:(b + 1) * BS], L, scales)
            if np.isnan(chk):
                bad += 1
            elif too_large:
                over += 1
    return bad, over


@njit(cache=True, inline="always")
def unpack_block(blk, u):
    # one file block blk (210,) u8 -> u (256,) its 6-bit values q_j in [0, 63]
    for h in range(2):
        for l in range(32):
            v0 = np.int64(blk[64 * h + l])
            v1 = np.int64(blk[64 * h + 32 + l])
            hb = np.int64(blk[128 + 32 * h + l])
            u[128 * h + l] = (v0 & 15) | ((hb & 3) << 4)
            u[128 * h + 32 + l] = (v1 & 15) | (((hb >> 2) & 3) << 4)
            u[128 * h + 64 + l] = (v0 >> 4) | (((hb >> 4) & 3) << 4)
            u[128 * h + 96 + l] = (v1 >> 4) | ((hb >> 6) << 4)


@njit(parallel=True, cache=True)
def dequantize_q6_k(q, out):
    # q (nb*210,) u8 -> out (nb*256,) f32, x = (d * scale) * (q - 32) as ggml rounds it
    nb = out.size // QK
    for c in prange(-(-nb // _CHUNK)):
        u = np.empty(QK, np.int64)
        for b in range(c * _CHUNK, min(nb, (c + 1) * _CHUNK)):
            blk = q[b * BS:(b + 1) * BS]
            unpack_block(blk, u)
            d = get_f16(blk, 208)
            for s in range(16):
                ds = d * f32(np.int8(blk[192 + s]))
                for i in range(16 * s, 16 * s + 16):
                    out[b * QK + i] = ds * f32(u[i] - 32)


# --- load: file blocks -> tiles ----------------------------------------------------------

@njit(cache=True, parallel=True)
def repack_q6_k(raw, row0, q, d):
    # raw (rows, nb*210) u8 -> rows row0.. of the tiles q (nt, nb*8*26*R) u8, d (nt, nb*R)
    # u16: per block u of 32 (8 per super-block) of row r, at 26 u R: nibble byte j (< 16)
    # = low bits of elements j | j+16 << 4 and crumb byte j (< 8) = high bits of j, j+8,
    # j+16, j+24 (2 bits each), both as quads; then its two int8 scales, R bytes each
    rows = raw.shape[0]
    nb = raw.shape[1] // BS
    R = d.shape[1] // nb
    for t in prange(row0 // R, (row0 + rows - 1) // R + 1):
        r0 = max(0, row0 - t * R)
        r1 = min(R, row0 + rows - t * R)
        v = np.empty(QK, np.int64)
        qt = q[t]
        for r in range(r0, r1):
            row = raw[t * R + r - row0]
            for b in range(nb):
                blk = row[b * BS:(b + 1) * BS]
                unpack_block(blk, v)
                d[t, b * R + r] = np.uint16(blk[208]) | (np.uint16(blk[209]) << np.uint16(8))
                for k in range(8):
                    o = 26 * (8 * b + k) * R
                    e = v[32 * k:32 * k + 32]
                    for j in range(16):
                        qt[quad_offset(o, R, r, j)] = (e[j] & 15) | ((e[16 + j] & 15) << 4)
                    for j in range(8):
                        qt[quad_offset(o + 16 * R, R, r, j)] = (
                            (e[j] >> 4) | ((e[8 + j] >> 4) << 2) | ((e[16 + j] >> 4) << 4)
                            | ((e[24 + j] >> 4) << 6))
                    qt[o + 24 * R + r] = blk[192 + 2 * k]
                    qt[o + 25 * R + r] = blk[193 + 2 * k]


# --- decode: x quantized to int8 once per matvec, then pair-dot sums -----------------------

@njit(cache=True, fastmath=True, parallel=True)
def matvec_q6_k(q, d, x8, xd, out, scratch, s32):
    # W (nt*R, n) Q6_K tiles @ x (q4.prep_q8_x) -> out (d,); scratch (nt, 2, R) f32,
    # s32 (nt, R) int32. Row . x = sum over super-blocks of d sum_u dx_u q6_dot_u, where
    # q6_dot_u = sum over block u's two sub-blocks of scale * sum((q - 32) x8), exact
    nt = q.shape[0]
    R = s32.shape[1]
    nsub = xd.size
    for t in prange(nt):
        qt = q[t]
        acc = scratch[t, 0]
        a1 = scratch[t, 1]
        s = s32[t]
        acc[:] = 0
        for b in range(nsub // 8):
            a1[:] = 0
            for k in range(8):
                u = 8 * b + k
                o = 26 * u * R
                prefetch_run(qt, o + 26 * R, 26 * R)
                q6_dot(qt, o, x8, 32 * u, s, R, ISA)
                dx = xd[u]
                for r in range(R):
                    a1[r] += dx * f32(s[r])
            db = d[t, b * R:(b + 1) * R]
            for r in range(R):
                acc[r] += f16_to_f32(db[r]) * a1[r]
        n = min(R, out.size - t * R)
        out[t * R:t * R + n] = acc[:n]


# --- prefill: int8 GEMM over the tiles ------------------------------------------------------

@njit(cache=True)
def sums16(x8, xs16):
    # x8 (m*16,) int8 -> xs16 (m,) int32, the sum of each 16 (q6_gemm's half-block sums)
    for i in range(xs16.size):
        s = 0
        for j in range(16 * i, 16 * i + 16):
            s += x8[j]
        xs16[i] = s


@njit(cache=True, parallel=True)
def matmul_q6_k(q, d, x8, xd, xs16, out, acc):
    # W (nt*R, n) Q6_K tiles @ x (q4.prep_q8_rows; x8 flat (Tp*n,), xs16 its sums per 16)
    # -> out (T, dout) = x W^T; acc (nt, TOKENS, R) f32: per-tile sums (simd.q6_gemm)
    T = out.shape[0]
    nt = q.shape[0]
    R = acc.shape[2]
    nsub = xd.shape[1]
    xdf = xd.reshape(-1)
    for t in prange(nt):
        a = acc[t]
        af = a.reshape(-1)
        c0 = t * R
        nc = min(R, out.shape[1] - c0)
        for t0 in range(0, T, TOKENS):
            q6_gemm(q[t], d[t], x8, xdf, xs16, af, nsub, t0, ISA)
            for k in range(min(TOKENS, T - t0)):
                out[t0 + k, c0:c0 + nc] = a[k, :nc]


# --- embedding: dequantized rows -----------------------------------------------------------

@njit(cache=True)
def rows_q6_k(q, qs, d, ids, out):
    # Q6_K tiles q (qs: the same bytes as int8), ids (T,) -> out (T, n) f32 dequantized
    # rows, (d * scale) * (q - 32) as ggml rounds them. A block's 6-bit values are built
    # first, quad by quad (its nibble quad g and crumb quad g % 2), then scaled
    nsub = out.shape[1] // 32
    R = d.shape[1] * 8 // nsub
    v = np.empty(32, np.int32)
    for i in range(ids.size):
        t = ids[i] // R
        r = ids[i] % R
        qt = q[t]
        row = out[i]
        for u in range(nsub):
            o = 26 * u * R
            for g in range(4):
                nq = o + 4 * R * g + 4 * r
                cq = o + 16 * R + 4 * R * (g & 1) + 4 * r
                f = 2 * (g >> 1)             # field f: element 4g + k, 2 + f: 16 + 4g + k
                for k in range(4):
                    nb = np.int32(qt[nq + k])
                    cb = np.int32(qt[cq + k]) >> f
                    v[4 * g + k] = (nb & 15) | ((cb & 3) << 4)
                    v[16 + 4 * g + k] = (nb >> 4) | (cb & 48)
            dd = f16_to_f32(d[t, u // 8 * R + r])
            ds0 = dd * f32(qs[t, o + 24 * R + r])
            ds1 = dd * f32(qs[t, o + 25 * R + r])
            y = row[32 * u:32 * u + 32]
            for j in range(16):
                y[j] = ds0 * f32(v[j] - 32)
                y[16 + j] = ds1 * f32(v[16 + j] - 32)


class Q6KLinear(Int8Prefill, TiledLinear):
    """Q6_K in row tiles: q (nt, nb*8*26*R) u8 (per block of 32: nibbles and crumbs as
    quads, then two int8 scales), d (nt, nb*R) u16."""

    def _load(self, raws):
        n = self.in_features
        nsub, nt, R = n // 32, self.nt, self.R
        self.q = anon_array((nt, nsub * 26 * R), np.uint8)   # zeroed: pad rows have d = 0
        self.d = anon_array((nt, nsub // 8 * R), np.uint16)
        row0 = 0
        for raw in raws:
            repack_q6_k(raw, row0, self.q, self.d)
            release_pages(raw)
            row0 += raw.shape[0]
        self._scratch = np.zeros((nt, 2, R), f32)
        self._s32 = np.zeros((nt, R), np.int32)
        self._x8 = np.zeros(n, np.int8)
        self._xd = np.zeros(nsub, f32)
        self._xs8 = np.zeros(nsub, np.int32)     # prep_q8_x's; q6_dot sums x8 itself
        self._xsum = np.zeros(nsub, f32)

    def matvec(self, x, out):
        prep_q8_x(x, self._x8, self._xd, self._xs8, self._xsum)
        matvec_q6_k(self.q, self.d, self._x8, self._xd, out, self._scratch, self._s32)

    def _gemm(self, x8, xd, xs8, xsum, out, acc):
        xs16 = np.empty(x8.size // 16, np.int32)
        sums16(x8, xs16)
        matmul_q6_k(self.q, self.d, x8, xd, xs16, out, acc)

    def _rows(self, ids, out):
        rows_q6_k(self.q, self.q.view(np.int8), self.d, ids, out)


Q6_K = WeightFormat("Q6_K", 14, QK, BS,
                    "ql:u8[128], qh:u8[64], scales:i8[16], d:f16; x=d*scale*(q6-32)",
                    Q6KLinear, dequantize_q6_k, quantize_q6_k, LlamaFileType.MOSTLY_Q6_K)
