"""Q5_K: 256 weights per super-block of 8 sub-blocks of 32, 176 bytes.

    d:f16  dmin:f16  scales:u8[12]  qh:u8[32]  qs:u8[128]
    x = d * sc_s * (q + 16 h) - dmin * m_s   for element e of sub-block s
q and the 6-bit scales as in Q4_K (q4_k.py); h, the fifth bit, is bit s of qh[e].

Runtime tiles: Q4_K's (q4_k.Q4KLinear) plus the fifth bits,
    qh (nt, nsub*2*R) u16  word w of sub-block s of a row: bit k = h of element 16 w + k
5.625 bits per weight resident (5.5 in the file). Decode adds sum(h xq) per sub-block to
Q4_K's sum: an int16 sum over the two words, sum_k (v >> k) c_k with c_0 = xq_0,
c_k = xq_k - 2 xq_k-1 (no masks: bit i of v enters (v >> k) with weight 2^(i-k), and
those weights telescope to xq_i). Products wrap, but int16 arithmetic is exact mod 2^16
and the result, at most 32 * 127 = 4064 in magnitude, comes out exact; the 4-bit part
keeps its own sum (a 5-bit one, up to 16 * 32 * 127, would not fit int16).
"""
from __future__ import annotations

import numpy as np
from gguf.constants import LlamaFileType
from numba import njit, prange

from ..fp import f16_to_f32, get_f16
from .base import WeightFormat, anon_array
from .q4 import prep_q4_x
from .q4_k import _CHUNK, QK_K, KLinear, k_scales, k_tile_scales, quantize_k_scales

f32 = np.float32


# --- reference quantize / dequantize -------------------------------------------------------

@njit(parallel=True, cache=True, error_model="numpy")
def quantize_q5_k(x, out):
    # x (nb*256,) f32 -> out (nb*176,) u8 as quantize_row_q5_K_ref;
    # returns (non-finite blocks, blocks whose d or dmin overflow f16)
    nb = x.size // QK_K
    bad = 0
    over = 0
    for c in prange(-(-nb // _CHUNK)):
        L = np.empty(QK_K, np.uint8)
        Laux = np.empty(32, np.uint8)
        weights = np.empty(32, f32)
        scales = np.empty(8, f32)
        mins = np.empty(8, f32)
        for b in range(c * _CHUNK, min(nb, (c + 1) * _CHUNK)):
            o = b * 176
            ok, ov = quantize_k_scales(x, b * QK_K, 31, f32(-0.5), f32(0.1), 15, out, o,
                                       L, Laux, weights, scales, mins)
            if not ok:
                bad += 1
            if ov:
                over += 1
            for i in range(32):
                h = 0
                for p in range(4):
                    l1 = L[64 * p + i]
                    l2 = L[64 * p + 32 + i]
                    h |= (l1 >> 4) << (2 * p) | (l2 >> 4) << (2 * p + 1)
                    out[o + 48 + 32 * p + i] = (l1 & 15) | ((l2 & 15) << 4)
                out[o + 16 + i] = h
    return bad, over


@njit(parallel=True, cache=True)
def dequantize_q5_k(q, out):
    # q (nb*176,) u8 -> out (nb*256,) f32, bit-exact with gguf-py
    for b in prange(out.size // QK_K):
        o = b * 176
        dsc = np.empty(8, f32)
        msc = np.empty(8, f32)
        k_scales(q, o + 4, get_f16(q, o), get_f16(q, o + 2), dsc, msc)
        y = out[b * QK_K:(b + 1) * QK_K]
        for p in range(4):
            for i in range(32):
                v = q[o + 48 + 32 * p + i]
                h = q[o + 16 + i] >> (2 * p)
                y[64 * p + i] = dsc[2 * p] * f32((v & 15) | ((h & 1) << 4)) - msc[2 * p]
                y[64 * p + 32 + i] = (dsc[2 * p + 1] * f32((v >> 4) | ((h & 2) << 3))
                                      - msc[2 * p + 1])


# --- load -----------------------------------------------------------------------------------

@njit(cache=True, inline="always")
def q5_word(raw, o, s, w):
    # word w (0..9) of sub-block s (0..7) of the Q5_K block at raw[o:o+176] (see module doc)
    h = w // 5
    i = w % 5
    v = 0
    for f in range(3):
        e = 15 * h + 3 * i + f
        q = ((raw[o + 48 + 32 * (s >> 1) + e] >> (4 * (s & 1))) & 15) | (((raw[o + 16 + e] >> s) & 1) << 4)
        v |= q << (5 * f)
    e = 30 + h
    q = ((raw[o + 48 + 32 * (s >> 1) + e] >> (4 * (s & 1))) & 15) | (((raw[o + 16 + e] >> s) & 1) << 4)
    return v | (((q >> i) & 1) << 15)


@njit(cache=True, parallel=True)
def repack_q5_k_words(raw, row0, q5):
    # Q5_K rows raw (rows, nsb*176) u8 -> rows row0.. of q5 (nt, nsub*10*R) u16:
    # q5[t, (10 s + w) R + r] = q5_word of sub-block s of row t*R + r
    rows = raw.shape[0]
    nsb = raw.shape[1] // 176
    R = q5.shape[1] // (80 * nsb)
    for t in prange(row0 // R, (row0 + rows - 1) // R + 1):
        r0 = max(0, row0 - t * R)
        r1 = min(R, row0 + rows - t * R)
        qt = q5[t]
        for r in range(r1 - r0):
            row = raw[t * R + r0 + r - row0]
            for u in range(8 * nsb):
                for w in range(10):
                    qt[(10 * u + w) * R + r0 + r] = q5_word(row, (u >> 3) * 176, u & 7, w)


# --- decode ---------------------------------------------------------------------------------

@njit(cache=True)
def prep_q5_x(xa, xb, xc, xm5):
    # From prep_q4_x's xa, xb (per block of 32, xq_j = xa_j, xq_j+16 = xb_j + 16 xa_j):
    # xc (nsub*40,) int16, the coefficients of the fields of the 10 words of a sub-block
    # (fields y_0..y_3 at bits 0, 5, 10, 15: c_0 = y_0, c_f = y_f - 32 y_f-1, |.| <= 6096),
    # xm5 (nsub, 2) int16, -16 sum(xq) over the 16 elements of each half (|.| <= 32512)
    xq = np.empty(32, np.int64)
    for u in range(xm5.shape[0]):
        for j in range(16):
            xq[j] = xa[16 * u + j]
            xq[16 + j] = xb[16 * u + j] + 16 * xa[16 * u + j]
        for h in range(2):
            xm5[u, h] = -16 * (xq[15 * h:15 * h + 15].sum() + xq[30 + h])
            for i in range(5):
                c = xc[40 * u + 4 * (5 * h + i):40 * u + 4 * (5 * h + i) + 4]
                e = 15 * h + 3 * i
                c[0] = xq[e]
                c[1] = xq[e + 1] - 32 * xq[e]
                c[2] = xq[e + 2] - 32 * xq[e + 1]
                c[3] = (xq[30 + h] << i) - 32 * xq[e + 2]


@njit(cache=True, fastmath=True)
def q5_block(qt, o, xc, k, sa, sb, ma, mb):
    # sa, sb (R,) int16 = ma, mb + sum over the two halves of one sub-block of
    # (q - 16) xq: words qt[o:o+10R] (lanes across rows), coefficients xc[k:k+40]
    R = sa.size
    sa[:] = ma
    sb[:] = mb
    for i in range(5):
        a0 = xc[k + 4 * i]; a1 = xc[k + 4 * i + 1]; a2 = xc[k + 4 * i + 2]; a3 = xc[k + 4 * i + 3]
        b0 = xc[k + 20 + 4 * i]; b1 = xc[k + 21 + 4 * i]
        b2 = xc[k + 22 + 4 * i]; b3 = xc[k + 23 + 4 * i]
        pa = qt[o + i * R:o + (i + 1) * R]
        pb = qt[o + (5 + i) * R:o + (6 + i) * R]
        for r in range(R):
            v = np.int32(pa[r])
            u = np.int32(pb[r])
            # wide in Numba's typing, 16 bits stored: int16 vector ops (as q4_block)
            sa[r] = np.int16(sa[r] + v * a0 + (v >> 5) * a1 + (v >> 10) * a2 + (v >> 15) * a3)
            sb[r] = np.int16(sb[r] + u * b0 + (u >> 5) * b1 + (u >> 10) * b2 + (u >> 15) * b3)


@njit(cache=True, fastmath=True, parallel=True)
def matvec_q5_k(q5, sc, mn, d, dmin, xc, xd, xm5, xsum, out, scratch, s16):
    # W (nt*R, n) Q5_K tiles @ x (prep_q4_x, prep_q5_x) -> out (d,); scratch (nt, 3, R)
    # f32, s16 (nt, 2, R) int16. As matvec_q4_k, with sum(q xq) = sa + sb - xm5_0 - xm5_1
    nt = q5.shape[0]
    R = s16.shape[2]
    nsb = xd.size // 8
    for t in prange(nt):
        qt = q5[t]
        acc = scratch[t, 0]
        a1 = scratch[t, 1]
        a2 = scratch[t, 2]
        sa = s16[t, 0]
        sb = s16[t, 1]
        acc[:] = 0
        for b in range(nsb):
            a1[:] = 0
            a2[:] = 0
            for k in range(8):
                u = 8 * b + k
                q5_block(qt, 10 * u * R, xc, 40 * u, sa, sb, xm5[u, 0], xm5[u, 1])
                scu = sc[t, u * R:(u + 1) * R]
                mu = mn[t, u * R:(u + 1) * R]
                dx = xd[u]
                off = -f32(np.int32(xm5[u, 0]) + np.int32(xm5[u, 1]))
                xs = xsum[u]
                for r in range(R):
                    qx = f32(np.int32(sa[r]) + np.int32(sb[r])) + off
                    a1[r] += f32(scu[r]) * (dx * qx)
                    a2[r] += f32(mu[r]) * xs
            db = d[t, b * R:(b + 1) * R]
            mb = dmin[t, b * R:(b + 1) * R]
            for r in range(R):
                acc[r] += f16_to_f32(db[r]) * a1[r] - f16_to_f32(mb[r]) * a2[r]
        n = min(R, out.size - t * R)
        out[t * R:t * R + n] = acc[:n]


# --- prefill and embedding (serial, exact) --------------------------------------------------

@njit(cache=True)
def dequant_q5_k_tiles(q5, sc, mn, d, dmin, t0, t1, wt):
    # Q5_K tiles t0..t1 -> wt (n, (t1-t0)*R) f32 = W[rows].T
    nsub = wt.shape[0] // 32
    R = sc.shape[1] // nsub
    dsc = np.empty(R, f32)
    msc = np.empty(R, f32)
    top = np.empty((2, R), np.int32)
    for u in range(nsub):
        for t in range(t0, t1):
            k_tile_scales(sc, mn, d, dmin, t, u, R, dsc, msc)
            c = (t - t0) * R
            top[:] = 0
            for w in range(10):
                h = w // 5
                i = w % 5
                qw = q5[t, (10 * u + w) * R:(10 * u + w + 1) * R]
                for f in range(3):
                    y = wt[32 * u + 15 * h + 3 * i + f, c:c + R]
                    for r in range(R):
                        y[r] = dsc[r] * f32((qw[r] >> (5 * f)) & 31) - msc[r]
                for r in range(R):
                    top[h, r] |= (qw[r] >> 15) << i
            for h in range(2):
                y = wt[32 * u + 30 + h, c:c + R]
                for r in range(R):
                    y[r] = dsc[r] * f32(top[h, r]) - msc[r]


@njit(cache=True)
def rows_q5_k(q5, sc, mn, d, dmin, ids, out):
    # Q5_K tiles, ids (T,) -> out (T, n) f32 dequantized rows
    nsub = out.shape[1] // 32
    R = sc.shape[1] // nsub
    for i in range(ids.size):
        t = ids[i] // R
        r = ids[i] % R
        row = out[i]
        for u in range(nsub):
            b = u // 8
            ds = f16_to_f32(d[t, b * R + r]) * f32(sc[t, u * R + r])
            ms = f16_to_f32(dmin[t, b * R + r]) * f32(mn[t, u * R + r])
            top0 = 0
            top1 = 0
            for w in range(10):
                v = q5[t, (10 * u + w) * R + r]
                e = 15 * (w // 5) + 3 * (w % 5)
                for f in range(3):
                    row[32 * u + e + f] = ds * f32((v >> (5 * f)) & 31) - ms
                if w < 5:
                    top0 |= (v >> 15) << w
                else:
                    top1 |= (v >> 15) << (w - 5)
            row[32 * u + 30] = ds * f32(top0) - ms
            row[32 * u + 31] = ds * f32(top1) - ms


class Q5KLinear(KLinear):
    """Q5_K in row tiles: KLinear's scales plus q5 (nt, nsub*10*R) u16, the words."""
    n_sums = 2

    def _alloc_quants(self):
        nsub = self.in_features // 32
        self.q5 = anon_array((self.nt, nsub * 10 * self.R), np.uint16)
        self._xc = np.zeros(nsub * 40, np.int16)
        self._xm5 = np.zeros((nsub, 2), np.int16)

    def _repack_quants(self, raw, row0):
        repack_q5_k_words(raw, row0, self.q5)

    def matvec(self, x, out):
        prep_q4_x(x, self._xa, self._xb, self._xd, self._xm, self._xsum)
        prep_q5_x(self._xa, self._xb, self._xc, self._xm5)
        matvec_q5_k(self.q5, self.sc, self.mn, self.d, self.dmin, self._xc, self._xd,
                    self._xm5, self._xsum, out, self._scratch, self._s16)

    def _dequant_tiles(self, t0, t1, wt):
        dequant_q5_k_tiles(self.q5, self.sc, self.mn, self.d, self.dmin, t0, t1, wt)

    def _rows(self, ids, out):
        rows_q5_k(self.q5, self.sc, self.mn, self.d, self.dmin, ids, out)


Q5_K = WeightFormat("Q5_K", 13, QK_K, 176,
                    "d:f16, dmin:f16, scales:u8[12] (6-bit sc, m per 32), qh:u8[32], "
                    "qs:u8[128]; x=d*sc*(nibble+16*bit)-dmin*m", Q5KLinear,
                    dequantize_q5_k, quantize_q5_k, LlamaFileType.MOSTLY_Q5_K_M)
