"""Q6_K: 256 weights per super-block, 210 bytes, 6-bit values with an int8 scale per 16.

    ql:u8[128]  low 4 bits,  qh:u8[64]  high 2 bits,  scales:i8[16],  d:f16
    x_j = d * scales[j // 16] * (q_j - 32),  q_j = low_j | high_j << 4 in [0, 63]
Within each half h (128 weights) and l < 32: ql[64h + l] holds the low bits of j = 128h + l
(low nibble) and 128h + 64 + l (high nibble), ql[64h + 32 + l] those of 128h + 32 + l and
128h + 96 + l; qh[32h + l] the high bits of 128h + l, +32, +64, +96 (bits 0-1, 2-3, 4-5, 6-7).

Runtime tiles (lanes across rows, see base.TiledLinear), the file's 210 bytes per block:
    w  (nt, nb*16*6*R) u16  per 16-weight sub-block, 2 groups of 8 weights, 3 words each:
                            A = q0 | q1 << 6 | lo(q6) << 12,  B = q2 | q3 << 6 | lo(q7) << 12,
                            C = q4 | q5 << 6 | hi(q6) << 12 | hi(q7) << 14
    sc (nt, nb*16*R) i8,  d (nt, nb*R) u16 f16 bits
Why these words: decode multiplies each field of a word by x with one shift and one
int16 multiply-add (see prep_q6_k_x), so 6-bit values cost 10 multiplies per 8 weights
(a 4-bit + 2-bit split would cost 16), and a group's sum fits int16.
"""
from __future__ import annotations

import numpy as np
from gguf.constants import LlamaFileType
from numba import njit, prange

from ..fp import f16_to_f32, get_f16, nearest_int, put_f16
from .base import TiledLinear, WeightFormat, anon_array, release_pages

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
def repack_q6_k(raw, row0, w, sc, d):
    # raw (rows, nb*210) u8 -> rows row0.. of the tiles w (nt, nb*96*R) u16, sc (nt, nb*16*R)
    # u8 (int8 bits), d (nt, nb*R) u16. Block by block of one tile (its 52 KB at R = 256
    # stay in L2 while its lanes fill).
    rows = raw.shape[0]
    nb = raw.shape[1] // BS
    R = d.shape[1] // nb
    for t in prange(row0 // R, (row0 + rows - 1) // R + 1):
        r0 = max(0, row0 - t * R)
        r1 = min(R, row0 + rows - t * R)
        u = np.empty(QK, np.int64)
        wt = w[t]
        for b in range(nb):
            for r in range(r0, r1):
                blk = raw[t * R + r - row0, b * BS:(b + 1) * BS]
                unpack_block(blk, u)
                for s in range(16):
                    sc[t, (16 * b + s) * R + r] = blk[192 + s]
                    for g in range(2):
                        e = 16 * s + 8 * g
                        o = ((16 * b + s) * 6 + 3 * g) * R + r
                        wt[o] = u[e] | (u[e + 1] << 6) | ((u[e + 6] & 15) << 12)
                        wt[o + R] = u[e + 2] | (u[e + 3] << 6) | ((u[e + 7] & 15) << 12)
                        wt[o + 2 * R] = (u[e + 4] | (u[e + 5] << 6) | ((u[e + 6] >> 4) << 12)
                                         | ((u[e + 7] >> 4) << 14))
                d[t, b * R + r] = np.uint16(blk[208]) | (np.uint16(blk[209]) << np.uint16(8))


# --- decode: x prepared once per matvec, then int16 group sums --------------------------

@njit(cache=True, fastmath=True)
def prep_q6_k_x(x, xq, xc, xd):
    # x (n,) f32 -> per sub-block of 16, x quantized to int8 like llama.cpp's activations
    # but with a scale per 16 (xd (n/16,) f32 = amax/127; llama.cpp's q8_K uses one per
    # 256), xq (n,) int32 scratch, and xc (n/16*24,) int16: 12 coefficients per group of
    # 8 weights (x0..x7 = xq):
    #   A: x0, x1 - 64 x0, x6 - 64 x1     B: x2, x3 - 64 x2, x7 - 64 x3
    #   C: x4, x5 - 64 x4, 16 x6 - 64 x5, 16 x7 - 64 x6     -32 sum(x), 0
    # so that A c0 + (A >> 6) c1 + (A >> 12) c2 + (B ...) + (C ...) + (C >> 14) c9 + c10
    # = sum (q_i - 32) x_i: each shift exposes the next field and its coefficient cancels
    # the fields above it. In int16 every term may wrap, but the arithmetic is exact mod
    # 2^16 and the true sum is within 8 * 32 * 127 = 32512 < 2^15, so it comes out exact.
    for k in range(xd.size):
        amax = f32(0)
        for i in range(16 * k, 16 * k + 16):
            amax = max(amax, abs(x[i]))
        d = amax / f32(127)
        inv = f32(1) / d if d > 0 else f32(0)
        xd[k] = d
        for i in range(16 * k, 16 * k + 16):
            xq[i] = np.int32(np.rint(x[i] * inv))
    v = xq.reshape(-1, 8)
    c = xc.reshape(-1, 12)
    for m in range(v.shape[0]):
        v0 = v[m, 0]; v1 = v[m, 1]; v2 = v[m, 2]; v3 = v[m, 3]
        v4 = v[m, 4]; v5 = v[m, 5]; v6 = v[m, 6]; v7 = v[m, 7]
        c[m, 0] = v0; c[m, 1] = v1 - 64 * v0; c[m, 2] = v6 - 64 * v1
        c[m, 3] = v2; c[m, 4] = v3 - 64 * v2; c[m, 5] = v7 - 64 * v3
        c[m, 6] = v4; c[m, 7] = v5 - 64 * v4; c[m, 8] = 16 * v6 - 64 * v5
        c[m, 9] = 16 * v7 - 64 * v6
        c[m, 10] = -32 * (v0 + v1 + v2 + v3 + v4 + v5 + v6 + v7)
        c[m, 11] = 0


@njit(cache=True, inline="always")
def group_coefs(xc, o):
    # the 11 coefficients of one group, xc[o:o+11], as scalars hoisted out of lane loops
    return (np.int64(xc[o]), np.int64(xc[o + 1]), np.int64(xc[o + 2]), np.int64(xc[o + 3]),
            np.int64(xc[o + 4]), np.int64(xc[o + 5]), np.int64(xc[o + 6]), np.int64(xc[o + 7]),
            np.int64(xc[o + 8]), np.int64(xc[o + 9]), np.int64(xc[o + 10]))


@njit(cache=True, inline="always")
def group_sum(a, b, c, x):
    # sum over one group of 8 weights (words a, b, c: u16 values) times x (group_coefs),
    # wrapped to int16 (exact, see prep_q6_k_x); LLVM narrows the products to int16 lanes
    a = np.int64(a)
    b = np.int64(b)
    c = np.int64(c)
    return np.int16(x[10] + a * x[0] + (a >> 6) * x[1] + (a >> 12) * x[2]
                    + b * x[3] + (b >> 6) * x[4] + (b >> 12) * x[5]
                    + c * x[6] + (c >> 6) * x[7] + (c >> 12) * x[8] + (c >> 14) * x[9])


@njit(cache=True, fastmath=True, parallel=True)
def matvec_q6_k(w, sc, d, xc, xd, out, scratch, s16):
    # W (nt*R, n) Q6_K tiles w (nt, nb*96*R) u16, sc (nt, nb*16*R) i8, d (nt, nb*R) u16
    # @ x (prep_q6_k_x) -> out (d,); scratch (nt, 2, R) f32, s16 (nt, 2, R) int16: per-tile
    # sums. The int16 group sums get a loop of their own: without f32 in it LLVM makes it
    # twice as wide (32 lanes).
    nt = w.shape[0]
    R = scratch.shape[2]
    nb = xd.size // 16
    for t in prange(nt):
        wt = w[t]
        acc = scratch[t, 0]
        blk = scratch[t, 1]
        g0 = s16[t, 0]
        g1 = s16[t, 1]
        acc[:] = 0
        for b in range(nb):
            blk[:] = 0
            for s in range(16):
                k = 16 * b + s
                o = 6 * k * R
                a0 = wt[o:o + R]; b0 = wt[o + R:o + 2 * R]; c0 = wt[o + 2 * R:o + 3 * R]
                a1 = wt[o + 3 * R:o + 4 * R]; b1 = wt[o + 4 * R:o + 5 * R]
                c1 = wt[o + 5 * R:o + 6 * R]
                x0 = group_coefs(xc, 24 * k)
                x1 = group_coefs(xc, 24 * k + 12)
                for r in range(R):
                    g0[r] = group_sum(a0[r], b0[r], c0[r], x0)
                    g1[r] = group_sum(a1[r], b1[r], c1[r], x1)
                sk = sc[t, k * R:(k + 1) * R]
                dx = xd[k]
                for r in range(R):
                    blk[r] += f32(sk[r]) * dx * (f32(g0[r]) + f32(g1[r]))
            db = d[t, b * R:(b + 1) * R]
            for r in range(R):
                acc[r] += f16_to_f32(db[r]) * blk[r]
        n = min(R, out.size - t * R)
        out[t * R:t * R + n] = acc[:n]


# --- prefill and embedding: dequantize from tiles ----------------------------------------
# Serial on purpose (see q4.py); values are (d * scale) * (q - 32), as ggml rounds them.

@njit(cache=True, inline="always")
def group_values(a, b, c, ds):
    # one group's words a, b, c (u16 values) of one lane, scale ds -> its 8 weights (f32)
    a = np.int64(a)
    b = np.int64(b)
    c = np.int64(c)
    return (ds * f32((a & 63) - 32), ds * f32(((a >> 6) & 63) - 32),
            ds * f32((b & 63) - 32), ds * f32(((b >> 6) & 63) - 32),
            ds * f32((c & 63) - 32), ds * f32(((c >> 6) & 63) - 32),
            ds * f32(((a >> 12) | (((c >> 12) & 3) << 4)) - 32),
            ds * f32(((b >> 12) | ((c >> 14) << 4)) - 32))


@njit(cache=True, inline="always")
def dequant_word_pair(wd, ds, lo, hi):
    # the two 6-bit fields at bits 0 and 6 of the words wd (R,) u16, scales ds (R,) f32
    # -> lo, hi (R,) f32; q - 32 through int32: converted in 32-bit lanes, not 64
    for r in range(wd.size):
        v = np.int64(wd[r])
        lo[r] = ds[r] * f32(np.int32((v & 63) - 32))
        hi[r] = ds[r] * f32(np.int32(((v >> 6) & 63) - 32))


@njit(cache=True)
def dequant_q6_k_tiles(w, sc, d, t0, t1, wt):
    # Q6_K tiles t0..t1 -> wt (n, (t1-t0)*R) f32 = W[rows].T; each weight row of wt is an
    # R-wide run of lanes: contiguous writes. Two weight rows per loop: with all 8 of a
    # group in one loop, LLVM's overlap checks between its 12 arrays made it 3x slower.
    nb = wt.shape[0] // QK
    R = d.shape[1] // nb
    dd = np.empty(R, f32)
    ds = np.empty(R, f32)
    for b in range(nb):
        for t in range(t0, t1):
            c0 = (t - t0) * R
            db = d[t, b * R:(b + 1) * R]
            for r in range(R):
                dd[r] = f16_to_f32(db[r])
            for s in range(16):
                k = 16 * b + s
                sk = sc[t, k * R:(k + 1) * R]
                for r in range(R):
                    ds[r] = dd[r] * f32(sk[r])
                for g in range(2):
                    o = (6 * k + 3 * g) * R
                    j = 16 * k + 8 * g
                    wa = w[t, o:o + R]; wb = w[t, o + R:o + 2 * R]; wc = w[t, o + 2 * R:o + 3 * R]
                    dequant_word_pair(wa, ds, wt[j, c0:c0 + R], wt[j + 1, c0:c0 + R])
                    dequant_word_pair(wb, ds, wt[j + 2, c0:c0 + R], wt[j + 3, c0:c0 + R])
                    dequant_word_pair(wc, ds, wt[j + 4, c0:c0 + R], wt[j + 5, c0:c0 + R])
                    w6 = wt[j + 6, c0:c0 + R]
                    w7 = wt[j + 7, c0:c0 + R]
                    for r in range(R):
                        va = np.int64(wa[r]); vb = np.int64(wb[r]); vc = np.int64(wc[r])
                        w6[r] = ds[r] * f32(np.int32(((va >> 12) | (((vc >> 12) & 3) << 4)) - 32))
                        w7[r] = ds[r] * f32(np.int32(((vb >> 12) | ((vc >> 14) << 4)) - 32))


@njit(cache=True)
def rows_q6_k(w, sc, d, ids, out):
    # Q6_K tiles, ids (T,) -> out (T, n) f32 dequantized rows
    nb = out.shape[1] // QK
    R = d.shape[1] // nb
    for i in range(ids.size):
        t = ids[i] // R
        r = ids[i] % R
        for b in range(nb):
            dd = f16_to_f32(d[t, b * R + r])
            for s in range(16):
                k = 16 * b + s
                ds = dd * f32(sc[t, k * R + r])
                for g in range(2):
                    o = (6 * k + 3 * g) * R + r
                    v = group_values(w[t, o], w[t, o + R], w[t, o + 2 * R], ds)
                    j = 16 * k + 8 * g
                    for m in range(8):
                        out[i, j + m] = v[m]


class Q6KLinear(TiledLinear):
    """Q6_K in row tiles: w (nt, nb*96*R) u16, sc (nt, nb*16*R) i8, d (nt, nb*R) u16."""

    def _load(self, raws):
        n = self.in_features
        nb, nt, R = n // QK, self.nt, self.R
        self.w = anon_array((nt, nb * 96 * R), np.uint16)  # zeroed: pad rows have d = 0
        sc = anon_array((nt, nb * 16 * R), np.uint8)
        self.d = anon_array((nt, nb * R), np.uint16)
        row0 = 0
        for raw in raws:
            repack_q6_k(raw, row0, self.w, sc, self.d)
            release_pages(raw)
            row0 += raw.shape[0]
        self.sc = sc.view(np.int8)
        self._scratch = np.zeros((nt, 2, R), f32)
        self._s16 = np.zeros((nt, 2, R), np.int16)
        self._xq = np.zeros(n, np.int32)
        self._xc = np.zeros(n // 16 * 24, np.int16)
        self._xd = np.zeros(n // 16, f32)

    def matvec(self, x, out):
        prep_q6_k_x(x, self._xq, self._xc, self._xd)
        matvec_q6_k(self.w, self.sc, self.d, self._xc, self._xd, out, self._scratch,
                    self._s16)

    def _dequant_tiles(self, t0, t1, wt):
        dequant_q6_k_tiles(self.w, self.sc, self.d, t0, t1, wt)

    def _rows(self, ids, out):
        rows_q6_k(self.w, self.sc, self.d, ids, out)


Q6_K = WeightFormat("Q6_K", 14, QK, BS,
                    "ql:u8[128], qh:u8[64], scales:i8[16], d:f16; x=d*scale*(q6-32)",
                    Q6KLinear, dequantize_q6_k, quantize_q6_k, LlamaFileType.MOSTLY_Q6_K)
