"""Q2_K: 256 weights per super-block of 16 sub-blocks of 16, 84 bytes, 2-bit values
with a 4-bit scale and a 4-bit min per sub-block.

    scales:u8[16]  qs:u8[64]  d:f16  dmin:f16
    x_e = d * sc_j * q_e - dmin * m_j,  j = e // 16,  sc_j = scales[j] & 15, m_j = scales[j] >> 4
q_e (2 bits) is bits 2k, 2k+1 of qs[32h + l], where h = e // 128, k = (e % 128) // 32,
l = e % 32.

Runtime tiles (lanes across rows, see base.TiledLinear), the file's 84 bytes per block:
    w  (nt, nb*16*2*R) u16  per sub-block 2 words: word i holds q of elements 8i..8i+7
                            in bits 2k, 2k+1
    sc (nt, nb*16*R) u8     the scale bytes as in the file
    d, dmin (nt, nb*R) u16  f16 bits
Decode quantizes x to int8 per super-block (as q3_k.py), sums each sub-block's q xq in
int16 lanes (exact: |sum| <= 16 * 3 * 127), then per super-block weights the sums by sc
and the x sums of each sub-block by m in int32, and applies d, dmin and the x scale.

Prefill is the record formats' int8 GEMM (q6_k.RewrittenTiles, x rounded per 32, as
llama.cpp's q8_K sums): each tile is rewritten as Q6_K records with q6 = q + 32 and
Q2_K's mins beside them (q2_records, simd.py's Q2K_*), d sum sc (q6 - 32) x8 - dmin sum
m xs16 in q6_gemm (no AMX kernel takes the mins), while they are in its thread's cache.
"""
from __future__ import annotations

from functools import cache

import numpy as np
from gguf.constants import LlamaFileType
from numba import njit, prange

from ..kernels.fp import f16_to_f32, get_f16, nearest_int, put_f16
from ..kernels.simd import Q2K_DMIN, Q2K_M, Q2K_RECORD, Q6K_D, Q6K_QS, Q6K_SC, RECORD_ROWS
from .base import WeightFormat, block_sizes, release_pages, repack_bytes, repack_halves
from .q3_k import QK, pack_2bit, put_scale, quantize_x_block, tile_span
from .q6_k import RewrittenTiles

f32 = np.float32
BS = block_sizes("Q2_K")[1]   # bytes per super-block
_CHUNK = 64                # super-blocks per parallel work item of the reference kernels


# --- reference quantize / dequantize (bit-exact with ggml's quantize_row_q2_K_ref) -------

@njit(cache=True, error_model="numpy", inline="always")
def make_qkx2_quants(n, nmax, x, xo, weights, L, lo, Laux, rmin, rdelta, nstep):
    # ggml's make_qkx2_quants over x[xo:xo+n] -> L[lo:lo+n] in 0..nmax, Laux (n,) scratch;
    # returns (scale, the_min), with Q2_K's error measure sum w |diff| (use_mad). Q4_K and
    # Q5_K run the same search, squared error, in SIMD lanes (q4_k.make_qkx2_lanes). Same
    # float32 operations in the same order
    # as the C, and IEEE division (callers compile with error_model numpy: x/0 is inf or
    # NaN, as in C, not an exception). Inlined: the callers' constants reach the loops.
    mn = x[xo]
    mx = x[xo]
    sum_w = weights[0]
    sum_x = sum_w * x[xo]
    for i in range(1, n):
        v = x[xo + i]
        if v < mn:                      # noqa: PLR1730 (the C's comparisons, NaN included)
            mn = v
        if v > mx:                      # noqa: PLR1730
            mx = v
        w = weights[i]
        sum_w += w
        sum_x += w * v
    if mn > f32(0):                     # noqa: PLR1730
        mn = f32(0)
    if mx == mn:
        for i in range(n):
            L[lo + i] = 0
        return f32(0), -mn
    iscale = f32(nmax) / (mx - mn)
    scale = f32(1) / iscale
    best_error = f32(0)
    for i in range(n):
        l = nearest_int(iscale * (x[xo + i] - mn))
        l = max(0, min(nmax, l))
        L[lo + i] = l
        diff = scale * f32(l) + mn - x[xo + i]
        best_error += weights[i] * abs(diff)
    for step in range(nstep + 1):
        iscale = (rmin + rdelta * f32(step) + f32(nmax)) / (mx - mn)
        sum_l = f32(0)
        sum_l2 = f32(0)
        sum_xl = f32(0)
        for i in range(n):
            l = nearest_int(iscale * (x[xo + i] - mn))
            l = max(0, min(nmax, l))
            Laux[i] = l
            w = weights[i]
            fl = f32(l)
            sum_l += w * fl
            sum_l2 += w * fl * fl
            sum_xl += w * fl * x[xo + i]
        D = sum_w * sum_l2 - sum_l * sum_l
        if D > f32(0):
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            if this_min > f32(0):
                this_min = f32(0)
                this_scale = sum_xl / sum_l2
            cur_error = f32(0)
            for i in range(n):
                diff = this_scale * f32(Laux[i]) + this_min - x[xo + i]
                cur_error += weights[i] * abs(diff)
            if cur_error < best_error:
                for i in range(n):
                    L[lo + i] = Laux[i]
                best_error = cur_error
                scale = this_scale
                mn = this_min
    return scale, -mn


@njit(cache=True, error_model="numpy")
def quantize_block(x, xo, out, o, L, Laux, weights, scales, mins):
    # ggml's quantize_row_q2_K_ref for the super-block x[xo:xo+256] -> out[o:o+84]; the
    # other arrays are scratch. Returns True if d or dmin is not finite as f16.
    max_scale = f32(0)                  # sub-block scales and mins are >= 0 here
    max_min = f32(0)
    for j in range(16):
        for i in range(16):
            weights[i] = abs(x[xo + 16 * j + i])
        # ggml: make_qkx2_quants(16, 3, .., rmin -0.5, rdelta 0.1, nstep 15, use_mad true)
        scales[j], mins[j] = make_qkx2_quants(16, 3, x, xo + 16 * j, weights, L, 16 * j, Laux,
                                              f32(-0.5), f32(0.1), 15)
        if scales[j] > max_scale:       # noqa: PLR1730 (the C's comparisons, NaN included)
            max_scale = scales[j]
        if mins[j] > max_min:           # noqa: PLR1730
            max_min = mins[j]
    sc = out[o:o + 16]
    over = False
    if max_scale > 0:
        iscale = f32(15) / max_scale
        for j in range(16):
            sc[j] = nearest_int(iscale * scales[j]) & 0xFF      # C stores it in a uint8_t
        over = put_scale(out, o + 80, max_scale / f32(15))
    else:
        sc[:] = 0
        put_f16(out, o + 80, f32(0))
    if max_min > 0:
        iscale = f32(15) / max_min
        for j in range(16):
            sc[j] = (np.int32(sc[j]) | (nearest_int(iscale * mins[j]) << 4)) & 0xFF
        over |= put_scale(out, o + 82, max_min / f32(15))
    else:
        put_f16(out, o + 82, f32(0))
    dd = get_f16(out, o + 80)
    dmn = get_f16(out, o + 82)
    for j in range(16):
        dl = dd * f32(sc[j] & 15)
        if dl == 0:                         # keep make_qkx2_quants' levels (C: `if (!d)`)
            continue
        dm = dmn * f32(sc[j] >> 4)
        for i in range(16):
            L[16 * j + i] = max(0, min(3, nearest_int((x[xo + 16 * j + i] + dm) / dl)))
    pack_2bit(L, out, o + 16)
    return over


@njit(parallel=True, cache=True, error_model="numpy")
def quantize_q2_k(x, out):
    # x (nb*256,) f32 -> out (nb*84,) u8; returns (non-finite blocks, overflowing d or dmin)
    nb = x.size // QK
    bad = 0
    over = 0
    for c in prange(-(-nb // _CHUNK)):
        L = np.empty(QK, np.uint8)
        Laux = np.empty(16, np.uint8)
        weights = np.empty(16, f32)
        scales = np.empty(16, f32)
        mins = np.empty(16, f32)
        for b in range(c * _CHUNK, min(nb, (c + 1) * _CHUNK)):
            chk = f32(0)
            for e in range(QK):
                chk += x[QK * b + e] * f32(0)   # NaN iff some value is NaN or inf
            if np.isnan(chk):
                bad += 1
            if quantize_block(x, QK * b, out, BS * b, L, Laux, weights, scales, mins):
                over += 1
    return bad, over


@njit(parallel=True, cache=True)
def dequantize_q2_k(q, out):
    # q (nb*84,) u8 -> out (nb*256,) f32, as gguf.quants: (d sc) q - dmin m, two roundings
    for b in prange(out.size // QK):
        o = BS * b
        d = get_f16(q, o + 80)
        dmin = get_f16(q, o + 82)
        for j in range(16):
            dl = d * f32(q[o + j] & 15)
            ml = dmin * f32(q[o + j] >> 4)
            h, k, l0 = j // 8, (j % 8) // 2, 16 * (j % 2)
            for i in range(16):
                v = (q[o + 16 + 32 * h + l0 + i] >> (2 * k)) & 3
                out[QK * b + 16 * j + i] = dl * f32(v) - ml


# --- load: the file's blocks -> tiles ----------------------------------------------------

@njit(cache=True, parallel=True)
def repack_q2_k_words(raw, row0, w):
    # raw (rows, nb*84) u8, file rows row0.. of W -> the tiles' words w (see the module
    # doc). Sub-block by sub-block of one tile (L2-resident): contiguous lane writes.
    rows = raw.shape[0]
    nb = raw.shape[1] // BS
    R = w.shape[1] // (nb * 32)
    for t in prange(row0 // R, (row0 + rows - 1) // R + 1):
        r0, r1 = tile_span(row0, rows, R, t)
        src = raw[t * R + r0 - row0:t * R + r1 - row0]
        wt = w[t]
        for b in range(nb):
            for j in range(16):
                g = 16 * b + j
                o = BS * b + 16 + 32 * (j // 8) + 16 * (j % 2)
                sh = 2 * ((j % 8) // 2)
                for r in range(r1 - r0):
                    qs = src[r, o:o + 16]
                    w0 = 0
                    w1 = 0
                    for i in range(8):
                        w0 |= ((np.int32(qs[i]) >> sh) & 3) << (2 * i)
                        w1 |= ((np.int32(qs[8 + i]) >> sh) & 3) << (2 * i)
                    wt[2 * g * R + r0 + r] = w0
                    wt[(2 * g + 1) * R + r0 + r] = w1


# --- decode: x prepared once per matvec, then int16 sub-block sums ------------------------

@njit(cache=True, error_model="numpy")
def prep_q2_k_x(x, xq, co, bs, xd):
    # x (n,) f32 -> xd (nb,) the x scale per super-block and, per sub-block g (nb*16):
    # co[g] (16,) int16, for word i co[g, 8i:8i+8] = (y0, y1 - 4 y0, .., y7 - 4 y6) with
    # y = xq[8i:8i+8], so that sum_k ((u >> 2k) co[8i+k]) over a word u = its fields times
    # their x (the terms telescope; products and partial sums may wrap int16 but are exact
    # mod 2^16 and the total is within 16 * 3 * 127 < 2^15); bs[g] = sum(xq) for the mins.
    for b in range(xd.size):
        xd[b] = quantize_x_block(x, b, xq)
        for j in range(16):
            y = xq[16 * j:16 * j + 16]
            c = co[16 * b + j]
            s = 0
            for i in range(2):
                c[8 * i] = y[8 * i]
                for k in range(1, 8):
                    c[8 * i + k] = y[8 * i + k] - 4 * y[8 * i + k - 1]
            for i in range(16):
                s += y[i]
            bs[16 * b + j] = s


@njit(cache=True, fastmath=True, inline="always")
def q2_sub(wt, o, c, s):
    # s (R,) int16 = sum over one sub-block of q xq, its 2 words wt[o:o+2R] (lanes across
    # rows) times the coefficients c = co[g] of prep_q2_k_x
    R = s.size
    a0 = c[0]; b01 = c[1]; b02 = c[2]; b03 = c[3]
    b04 = c[4]; b05 = c[5]; b06 = c[6]; b07 = c[7]
    a1 = c[8]; b11 = c[9]; b12 = c[10]; b13 = c[11]
    b14 = c[12]; b15 = c[13]; b16 = c[14]; b17 = c[15]
    p0 = wt[o:o + R]; p1 = wt[o + R:o + 2 * R]
    for r in range(R):
        u0 = np.int32(p0[r]); u1 = np.int32(p1[r])
        # only 16 bits are stored: LLVM narrows it all to int16 vector ops
        s[r] = np.int16(u0 * a0 + (u0 >> 2) * b01 + (u0 >> 4) * b02 + (u0 >> 6) * b03
                        + (u0 >> 8) * b04 + (u0 >> 10) * b05 + (u0 >> 12) * b06 + (u0 >> 14) * b07
                        + u1 * a1 + (u1 >> 2) * b11 + (u1 >> 4) * b12 + (u1 >> 6) * b13
                        + (u1 >> 8) * b14 + (u1 >> 10) * b15 + (u1 >> 12) * b16 + (u1 >> 14) * b17)


@cache
def matvec_q2_k(R):
    """The decode kernel for tiles of R rows, R a compile-time constant (see q3_k.py)."""

    @njit(cache=True, fastmath=True, parallel=True)
    def matvec(w, sc, d, dmin, co, bs, xd, out, scratch, s16):
        # W (nt*R, n) Q2_K tiles w (nt, nb*32*R) u16, sc (nt, nb*16*R) u8, d, dmin
        # (nt, nb*R) u16 @ x (prep_q2_k_x: co, bs, xd) -> out (d,); scratch (nt, R) f32,
        # s16 (nt, 16*R) int16 (an int16-only loop: see q3_k.py)
        nt = w.shape[0]
        nb = xd.size
        for t in prange(nt):
            wt = w[t]
            acc = scratch[t]
            s = s16[t]
            acc[:] = 0
            for b in range(nb):
                for j in range(16):
                    g = 16 * b + j
                    q2_sub(wt, 2 * g * R, co[g], s[j * R:(j + 1) * R])
                sb = sc[t, 16 * b * R:16 * (b + 1) * R]
                db = d[t, b * R:(b + 1) * R]
                dm = dmin[t, b * R:(b + 1) * R]
                xb = bs[16 * b:16 * b + 16]
                dx = xd[b]
                for r in range(R):
                    a = np.int32(0)              # sum sc s,      |a| <= 16 * 15 * 6096
                    m = np.int32(0)              # 16 sum m bs,   |m| <= 16 * 16 * 15 * 2032
                    for j in range(16):
                        # 16 m = v - sc: no shift, which LLVM would do in int64 lanes
                        v = np.int32(sb[j * R + r])
                        lo = v & np.int32(15)
                        a = np.int32(a + np.int32(s[j * R + r]) * lo)
                        m = np.int32(m + (v - lo) * np.int32(xb[j]))
                    acc[r] += dx * (f16_to_f32(db[r]) * f32(a) - f16_to_f32(dm[r]) * f32(m >> 4))
            n = min(R, out.size - t * R)
            out[t * R:t * R + n] = acc[:n]
    return matvec


# --- prefill: a tile at a time as q6_gemm's Q2_K records ----------------------------------

@njit(cache=True)
def q2_records(w, sc, d, dmin, R, qt):
    # one Q2_K tile (w (nb*32*R,) u16, sc (nb*16*R,) u8, d, dmin (nb*R,) u16) -> qt (R/16 *
    # nb * Q2K_RECORD,) u8: its rows as Q6_K records with q6 = q + 32 (so d sc (q6 - 32) is
    # d sc q) and the mins (simd.py's Q6K_* and Q2K_* layouts). q6's low nibble is q, its
    # high bits 2: every crumb byte is 0xAA.
    nb = d.size // R
    q32 = qt.view(np.uint32)
    q16 = qt.view(np.uint16)
    for s in range(R // RECORD_ROWS):
        for b in range(nb):
            rec = (s * nb + b) * Q2K_RECORD
            for lane in range(RECORD_ROWS):
                q16[(rec + Q6K_D) // 2 + lane] = d[b * R + RECORD_ROWS * s + lane]
                q16[(rec + Q2K_DMIN) // 2 + lane] = dmin[b * R + RECORD_ROWS * s + lane]
            for k in range(8):
                ga = 16 * b + 2 * k            # the block's two sub-blocks: ga, ga + 1
                for h in range(2):
                    for lane in range(RECORD_ROWS):
                        v = sc[(ga + h) * R + RECORD_ROWS * s + lane]
                        qt[rec + Q6K_SC + 32 * k + 16 * h + lane] = v & 15
                        qt[rec + Q2K_M + 32 * k + 16 * h + lane] = v >> 4
                quads = (rec + Q6K_QS + 384 * k) // 4
                for lane in range(RECORD_ROWS):
                    r = RECORD_ROWS * s + lane
                    a0 = np.int32(w[2 * ga * R + r])
                    a1 = np.int32(w[(2 * ga + 1) * R + r])
                    b0 = np.int32(w[(2 * ga + 2) * R + r])
                    b1 = np.int32(w[(2 * ga + 3) * R + r])
                    for g in range(4):             # nibble quads: bytes j = 4g + i
                        ua = a0 if g < 2 else a1
                        ub = b0 if g < 2 else b1
                        v = 0
                        for i in range(4):
                            e = 2 * (4 * (g % 2) + i)
                            v |= (((ua >> e) & 3) | (((ub >> e) & 3) << 4)) << (8 * i)
                        q32[quads + 16 * g + lane] = v
                    for g in range(2):             # crumb quads
                        q32[quads + 64 + 16 * g + lane] = 0xAAAAAAAA


@njit(cache=True, parallel=True)
def q2_tiles(w, sc, d, dmin, t0, t1, R, recs):
    # Q2_K tiles t0..t1 -> recs[:t1-t0] (q2_records), one tile a thread
    for t in prange(t0, t1):
        q2_records(w[t], sc[t], d[t], dmin[t], R, recs[t - t0])


# --- embedding: dequantized rows -----------------------------------------------------------
# No fastmath: the values are gguf's bit for bit, (d sc) q - dmin m with two roundings
# (no fused multiply-add).

@njit(cache=True)
def rows_q2_k(w, sc, d, dmin, ids, out):
    # Q2_K tiles, ids (T,) -> out (T, n) f32 dequantized rows
    nb = out.shape[1] // QK
    R = d.shape[1] // nb
    for k in range(ids.size):
        t = ids[k] // R
        r = ids[k] % R
        row = out[k]
        for b in range(nb):
            dd = f16_to_f32(d[t, b * R + r])
            dm = f16_to_f32(dmin[t, b * R + r])
            for j in range(16):
                g = 16 * b + j
                v = sc[t, g * R + r]
                dl = dd * f32(v & 15)
                ml = dm * f32(v >> 4)
                for i in range(16):
                    u = np.int32(w[t, (2 * g + i // 8) * R + r])
                    row[QK * b + 16 * j + i] = dl * f32((u >> (2 * (i % 8))) & 3) - ml


class Q2KLinear(RewrittenTiles):
    """Q2_K in row tiles: w (nt, nb*32*R) u16, sc (nt, nb*16*R) u8, d, dmin (nt, nb*R) u16;
    prefill on them rewritten as Q2_K records (q2_records)."""
    mins = True

    def tile_spec(self):
        nb, nt, R = self.in_features // QK, self.nt, self.R
        return {"w": ((nt, nb * 32 * R), np.uint16), "sc": ((nt, nb * 16 * R), np.uint8),
                "d": ((nt, nb * R), np.uint16), "dmin": ((nt, nb * R), np.uint16)}

    def _load(self, raws):
        self._alloc_tiles()
        row0 = 0
        for raw in raws:
            repack_q2_k_words(raw, row0, self.w)
            repack_bytes(raw, row0, BS, 0, 16, self.sc)
            repack_halves(raw, row0, BS, 80, self.d)
            repack_halves(raw, row0, BS, 82, self.dmin)
            release_pages(raw)
            row0 += raw.shape[0]

    def decode_buffers(self):
        # per-tile sums (nt, R) f32, (nt, 16R) i16; prep_q2_k_x's xq, co, bs, xd
        nb, nt, R = self.in_features // QK, self.nt, self.R
        return (np.zeros((nt, R), f32), np.zeros((nt, 16 * R), np.int16),
                np.zeros(QK, np.int16), np.zeros((nb * 16, 16), np.int16),
                np.zeros(nb * 16, np.int16), np.zeros(nb, f32))

    def matvec(self, x, out, scratch=None):
        # int8 per 256 whether or not fine is set: fine would rewrite every tile per token
        acc, s16, xq, co, bs, xd = self._buffers(scratch)
        prep_q2_k_x(x, xq, co, bs, xd)
        matvec_q2_k(self.R)(self.w, self.sc, self.d, self.dmin, co, bs, xd, out, acc, s16)

    def _rewrite(self, t0, t1, recs):
        q2_tiles(self.w, self.sc, self.d, self.dmin, t0, t1, self.R, recs)

    def _rows(self, ids, out):
        rows_q2_k(self.w, self.sc, self.d, self.dmin, ids, out)


Q2_K = WeightFormat("Q2_K", "scales:u8[16] (4-bit sc | 4-bit m << 4), qs:u8[64], d:f16, "
                    "dmin:f16; x=d*sc*q-dmin*m", Q2KLinear, dequantize_q2_k, quantize_q2_k,
                    LlamaFileType.MOSTLY_Q2_K)
