"""Q5_K: 256 weights per super-block of 8 sub-blocks of 32, 176 bytes.

    d:f16  dmin:f16  scales:u8[12]  qh:u8[32]  qs:u8[128]
    x = d * sc_s * (q + 16 h) - dmin * m_s   for element e of sub-block s
q and the 6-bit scales as in Q4_K (q4_k.py); h, the fifth bit, is bit s of qh[e].

Runtime tiles (lanes across rows, see base.TiledLinear): q (nt, nsub*22*R) u8, per
sub-block u at 22 u R: per row ten u16 words (20 bytes, as R-wide lanes), then the rows'
sc (R bytes), then their m (R bytes); d, dmin (nt, nsb*R) u16 f16 bits per super-block.
5.625 bits per weight resident (5.5 in the file). The words are q5.py's
(Q5_0 / Q5_1): per group of 16 weights (half a sub-block), word k holds values 3k, 3k+1,
3k+2 in bits 0-4, 5-9, 10-14 and bit k of value 15 in bit 15; each word summed in int16
lanes as w a0 + (w >> 5) a1 + (w >> 10) a2 + (w >> 15) a3 with coefficients from
q5.prep_q5_x. A group sums (q - 16) xq, within 16*16*127 < 2^15: exact in int16 however
the partial sums wrap (one sum over all 32 could reach 65024 and would not fit). Q5_K
sub-blocks are Q5's blocks of 32 with a 6-bit scale and min instead of f16 ones, so the
activation prep is q5.py's unchanged.
Measured (2048 x 8192, Q4_0 in the same run, this 2-core VM): decode 0.88-1.04x Q4_0's
bytes/s from DRAM and 0.71-0.79x from L3 with 2 threads (0.88x and 0.8x with one), so
1.2-1.4x and 1.5-1.7x Q4_0's time per weight; prefill (T = 512) 1.0x Q4_0's time.
Q4_K's nibble kernel plus a separate int16 sum over a plane of fifth bits read 0.6-0.7x
from L3; words summed one at a time over the lanes (5 passes), 0.6x from DRAM.
"""
from __future__ import annotations

import numpy as np
from gguf.constants import LlamaFileType
from numba import njit, prange

from ..fp import f16_to_f32, get_f16
from ..simd import prefetch_run
from .base import TiledLinear, WeightFormat, anon_array, release_pages
from .q4_k import _CHUNK, _G, QK_K, get_scale_min_k4, k_group_scratch, k_scales, quantize_k_group
from .q5 import prep_q5_x, q5_block

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
        ws = k_group_scratch()
        Lq = ws[6]
        end = min(nb, (c + 1) * _CHUNK)
        for b0 in range(c * _CHUNK, end, _G):
            nbg = min(_G, end - b0)
            bd, ov = quantize_k_group(x, b0, nbg, 31, f32(-0.5), f32(0.1), 15, out, 176, ws)
            bad += bd
            over += ov
            for g in range(nbg):
                o = (b0 + g) * 176
                L = Lq[g]
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
    # word w (0..9) of sub-block s (0..7) of the Q5_K block at raw[o:o+176] (module doc):
    # group g = w // 5, k = w % 5: values 16g+3k, +1, +2 at bits 0, 5, 10, bit k of 16g+15
    ql = o + 48 + 32 * (s >> 1)
    v = 0
    for f in range(4):
        e = 16 * (w // 5) + (3 * (w % 5) + f if f < 3 else 15)
        q = ((raw[ql + e] >> (4 * (s & 1))) & 15) | (((raw[o + 16 + e] >> s) & 1) << 4)
        v |= q << (5 * f) if f < 3 else ((q >> (w % 5)) & 1) << 15
    return v


@njit(cache=True, inline="always")
def repack_k_tile_scales(tile, bs, S, r0, qt, dt, mt):
    # d, dmin and the 6-bit scales and mins of the K-quant rows tile (n, nsb*bs) u8 -> lanes
    # r0..r0+n of one tile: dt, mt (nsb*R,) u16, and in qt (nsub*S*R,) u8 the sc of
    # sub-block u at (S u + S - 2) R + lane, its m R further
    n = tile.shape[0]
    nsb = tile.shape[1] // bs
    R = dt.size // nsb
    for b in range(nsb):
        o = b * bs
        for r in range(n):
            dt[b * R + r0 + r] = np.uint16(tile[r, o]) | (np.uint16(tile[r, o + 1]) << np.uint16(8))
            mt[b * R + r0 + r] = np.uint16(tile[r, o + 2]) | (np.uint16(tile[r, o + 3]) << np.uint16(8))
        for j in range(8):
            p = (S * (8 * b + j) + S - 2) * R + r0
            for r in range(n):
                sc, m = get_scale_min_k4(tile[r], o + 4, j)
                qt[p + r] = sc
                qt[p + R + r] = m


@njit(cache=True, parallel=True)
def repack_q5_k(raw, row0, q, q16, d, dmin):
    # Q5_K rows raw (rows, nsb*176) u8 -> rows row0.. of the tiles q (nt, nsub*22*R) u8
    # (q16 its u16 view), d, dmin (nt, nsb*R): per sub-block s of row t*R + r,
    # q16[t, (11 s + w) R + r] = q5_word w (w < 10), then sc and m. One pass per tile,
    # column by column (the tile's rows stay in L2; contiguous writes)
    rows = raw.shape[0]
    nsb = raw.shape[1] // 176
    R = d.shape[1] // nsb
    for t in prange(row0 // R, (row0 + rows - 1) // R + 1):
        r0 = max(0, row0 - t * R)
        r1 = min(R, row0 + rows - t * R)
        tile = raw[t * R + r0 - row0:t * R + r1 - row0]
        repack_k_tile_scales(tile, 176, 22, r0, q[t], d[t], dmin[t])
        ht = q16[t]
        for u in range(8 * nsb):
            for w in range(10):
                lane = ht[(11 * u + w) * R + r0:(11 * u + w) * R + r1]
                for r in range(r1 - r0):
                    lane[r] = q5_word(tile[r], (u >> 3) * 176, u & 7, w)


# --- decode ---------------------------------------------------------------------------------

@njit(cache=True, fastmath=True, parallel=True)
def matvec_q5_k(q, q16, d, dmin, xc, xd, xm5, xsum, out, scratch, s16):
    # W (nt*R, n) Q5_K tiles q (q16 its u16 view) @ x (q5.prep_q5_x) -> out (d,);
    # scratch (nt, 3, R) f32, s16 (nt, 2, R) int16. Row . x = sum over super-blocks of
    #   d sum_s sc_s dx_s sum(q xq)_s - dmin sum_s m_s sum(x)_s, with
    # sum(q xq) = s0 + s1 - xm5[2u] - xm5[2u+1]
    nt = q.shape[0]
    R = s16.shape[2]
    nsb = xd.size // 8
    for t in prange(nt):
        qt = q[t]
        ht = q16[t]
        acc = scratch[t, 0]
        a1 = scratch[t, 1]
        a2 = scratch[t, 2]
        s0 = s16[t, 0]
        s1 = s16[t, 1]
        acc[:] = 0
        for b in range(nsb):
            a1[:] = 0
            a2[:] = 0
            for k in range(8):
                u = 8 * b + k
                o = 22 * u * R
                prefetch_run(qt, o + 22 * R, 22 * R)
                q5_block(ht, 11 * u * R, xc, 40 * u, s0, s1, xm5[2 * u], xm5[2 * u + 1])
                scu = qt[o + 20 * R:o + 21 * R]
                mu = qt[o + 21 * R:o + 22 * R]
                dx = xd[u]
                off = -f32(np.int32(xm5[2 * u]) + np.int32(xm5[2 * u + 1]))
                xs = xsum[u]
                for r in range(R):
                    qx = f32(np.int32(s0[r]) + np.int32(s1[r])) + off
                    a1[r] += f32(scu[r]) * (dx * qx)
                    a2[r] += f32(mu[r]) * xs
            db = d[t, b * R:(b + 1) * R]
            mb = dmin[t, b * R:(b + 1) * R]
            for r in range(R):
                acc[r] += f16_to_f32(db[r]) * a1[r] - f16_to_f32(mb[r]) * a2[r]
        n = min(R, out.size - t * R)
        out[t * R:t * R + n] = acc[:n]


# --- prefill and embedding (serial, exact) --------------------------------------------------

@njit(cache=True, inline="always")
def k_tile_scales(q, d, dmin, S, t, u, R, dsc, msc):
    # lanes of tile t, sub-block u: d * sc and dmin * m (f32, as gguf-py) -> dsc, msc (R,)
    b = u // 8
    o = (S * u + S - 2) * R
    for r in range(R):
        dsc[r] = f16_to_f32(d[t, b * R + r]) * f32(q[t, o + r])
        msc[r] = f16_to_f32(dmin[t, b * R + r]) * f32(q[t, o + R + r])


@njit(cache=True)
def dequant_q5_k_tiles(q, q16, d, dmin, t0, t1, wt):
    # Q5_K tiles t0..t1 -> wt (n, (t1-t0)*R) f32 = W[rows].T
    nsub = wt.shape[0] // 32
    R = d.shape[1] * 8 // nsub
    dsc = np.empty(R, f32)
    msc = np.empty(R, f32)
    top = np.empty((2, R), np.int32)
    for u in range(nsub):
        for t in range(t0, t1):
            k_tile_scales(q, d, dmin, 22, t, u, R, dsc, msc)
            c = (t - t0) * R
            top[:] = 0
            for w in range(10):
                g = w // 5
                k = w % 5
                qw = q16[t, (11 * u + w) * R:(11 * u + w + 1) * R]
                for f in range(3):
                    y = wt[32 * u + 16 * g + 3 * k + f, c:c + R]
                    for r in range(R):
                        y[r] = dsc[r] * f32((qw[r] >> (5 * f)) & 31) - msc[r]
                for r in range(R):
                    top[g, r] |= (qw[r] >> 15) << k
            for g in range(2):
                y = wt[32 * u + 16 * g + 15, c:c + R]
                for r in range(R):
                    y[r] = dsc[r] * f32(top[g, r]) - msc[r]


@njit(cache=True)
def rows_q5_k(q, q16, d, dmin, ids, out):
    # Q5_K tiles, ids (T,) -> out (T, n) f32 dequantized rows
    nsub = out.shape[1] // 32
    R = d.shape[1] * 8 // nsub
    for i in range(ids.size):
        t = ids[i] // R
        r = ids[i] % R
        row = out[i]
        for u in range(nsub):
            b = u // 8
            ds = f16_to_f32(d[t, b * R + r]) * f32(q[t, (22 * u + 20) * R + r])
            ms = f16_to_f32(dmin[t, b * R + r]) * f32(q[t, (22 * u + 21) * R + r])
            top0 = 0                             # values 15 and 31: bit 15 of the
            top1 = 0                             # words 0..4 and 5..9
            for w in range(10):
                v = q16[t, (11 * u + w) * R + r]
                e = 16 * (w // 5) + 3 * (w % 5)
                for f in range(3):
                    row[32 * u + e + f] = ds * f32((v >> (5 * f)) & 31) - ms
                if w < 5:
                    top0 |= (v >> 15) << w
                else:
                    top1 |= (v >> 15) << (w - 5)
            row[32 * u + 15] = ds * f32(top0) - ms
            row[32 * u + 31] = ds * f32(top1) - ms


class Q5KLinear(TiledLinear):
    """Q5_K in row tiles: ten u16 words, then sc and m, per row and sub-block."""
    S = 22                     # bytes per row per sub-block in q

    def _load(self, raws):
        n = self.in_features
        nsub, nt, R = n // 32, self.nt, self.R
        self.q = anon_array((nt, nsub * self.S * R), np.uint8)   # zeroed: pad rows add nothing
        self.q16 = self.q.view(np.uint16)                       # the words' view of the tiles
        self.d = anon_array((nt, nsub // 8 * R), np.uint16)
        self.dmin = anon_array((nt, nsub // 8 * R), np.uint16)
        row0 = 0
        for raw in raws:
            repack_q5_k(raw, row0, self.q, self.q16, self.d, self.dmin)
            release_pages(raw)
            row0 += raw.shape[0]
        self._scratch = np.zeros((nt, 3, R), f32)
        self._s16 = np.zeros((nt, 2, R), np.int16)
        self._x8 = np.zeros(n, np.int8)
        self._xd = np.zeros(nsub, f32)
        self._xs8 = np.zeros(nsub, np.int32)
        self._xsum = np.zeros(nsub, f32)
        self._xc = np.zeros(nsub * 40, np.int16)
        self._xm5 = np.zeros(nsub * 2, np.int16)

    def matvec(self, x, out):
        prep_q5_x(x, self._x8, self._xd, self._xs8, self._xsum, self._xc, self._xm5)
        matvec_q5_k(self.q, self.q16, self.d, self.dmin, self._xc, self._xd,
                    self._xm5, self._xsum, out, self._scratch, self._s16)

    def _dequant_tiles(self, t0, t1, wt):
        dequant_q5_k_tiles(self.q, self.q16, self.d, self.dmin, t0, t1, wt)

    def _rows(self, ids, out):
        rows_q5_k(self.q, self.q16, self.d, self.dmin, ids, out)


Q5_K = WeightFormat("Q5_K", 13, QK_K, 176,
                    "d:f16, dmin:f16, scales:u8[12] (6-bit sc, m per 32), qh:u8[32], "
                    "qs:u8[128]; x=d*sc*(nibble+16*bit)-dmin*m", Q5KLinear,
                    dequantize_q5_k, quantize_q5_k, LlamaFileType.MOSTLY_Q5_K_M)
