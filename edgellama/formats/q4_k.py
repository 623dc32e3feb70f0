"""Q4_K: 256 weights per super-block of 8 sub-blocks of 32, 144 bytes, and the pieces
every "K-quant with 6-bit sub-block scales and mins" shares (Q4_K, Q5_K: see q5_k.py).

    d:f16  dmin:f16  scales:u8[12]  qs:u8[128]
    x = d * sc_s * q - dmin * m_s   for element e of sub-block s (e in 0..31)
q (4 bits) is nibble s % 2 of qs[32 (s // 2) + e]: sub-blocks 2p and 2p+1 share 32 bytes.
The 12 scale bytes hold sc_s and m_s (6 bits each), as ggml's get_scale_min_k4 reads them:
s < 4: sc = scales[s] & 63, m = scales[s+4] & 63; s >= 4: the low 4 bits from
scales[s+4] (sc low nibble, m high nibble), the top 2 from bits 6-7 of scales[s-4] (sc)
and scales[s] (m).

Runtime tiles (lanes across rows, see base.TiledLinear): q (nt, R/16 * nsb * 2368) u8,
records of 16 rows and one super-block (layout in simd.py, Q4K_*): the rows' d and dmin,
their 6-bit sc and m decoded to bytes, then each sub-block's nibbles re-paired into Q4_0
order (byte j holds elements j and j+16) as quads of the 16 rows. 4.625 bits per weight
resident (4.5 in the file). Decode and prefill are one intrinsic, simd.q4k_gemm: per
sub-block the exact int32 sum(q x8) (x8 from records.prep_q8_x), weighted by sc and m in f32
registers, then by d and dmin once per super-block. Where AMX runs (amx.enabled()), a
Q4_K prefill of records.AMX_MIN_ROWS or more rows takes each sub-block's sums from a tile
instruction instead (amx.amx_blocks_gemm with kind KIND_Q4_K, records.MATMUL_AMX),
the same bits; Q5_K's too (KIND_Q5_K, its fifth bits or-ed into the unpacked bytes).
Why records: a strip of 16 rows reads one address-ordered run holding everything its
sums need; the earlier tiles (per sub-block 16 R bytes of quads then sc and m, a
pair-dot pass over the rows and the scales applied in a second pass) were slower
("Q4_K records", bench/results/design_measurements.json).
"""
from __future__ import annotations

import numpy as np
from gguf.constants import LlamaFileType
from numba import prange

from ..kernels.amx import KIND_Q4_K, KIND_Q5_K
from ..kernels.fp import get_f16, nearest_int, put_f16
from ..kernels.jit import njit
from ..kernels.simd import (Q4K_D, Q4K_DMIN, Q4K_M, Q4K_QS, Q4K_RECORD, Q4K_SC, Q5K_QH, Q5K_RECORD,
                    RECORD_ROWS, K_GROUP)
from .base import WeightFormat, block_sizes
from .records import K_QUANT, RecordLinear, kernels_by_kind, prep_q8_x

f32 = np.float32
QK_K, Q4K_BYTES = block_sizes("Q4_K")   # weights and bytes per super-block
Q5K_BYTES = block_sizes("Q5_K")[1]       # repack_k serves both
_CHUNK = 64                 # super-blocks per parallel work item of the quantizers


# --- the 12-byte 6-bit scales and mins (shared with q5_k) --------------------------------

@njit(cache=True, inline="always")
def get_scale_min_k4(q, o, j):
    # sub-block j's (scale, min), 6 bits each, from the 12 scale bytes at q[o:o+12]
    if j < 4:
        return q[o + j] & 63, q[o + j + 4] & 63
    sc = (q[o + j + 4] & 0xF) | ((q[o + j - 4] >> 6) << 4)
    m = (q[o + j + 4] >> 4) | ((q[o + j] >> 6) << 4)
    return sc, m


# Q4_K and Q5_K run ggml's make_qkx2_quants (q2_k.py has it one sub-block at a time) on
# 8 _G sub-blocks at once, one per SIMD lane: several times faster than one sub-block at
# a time, _G = 4 the best ("K-quant lanes", bench/results/design_measurements.json).
_G = 4                      # super-blocks per lane group of quantize_k_group
_S = 8 * _G                 # its sub-blocks, one per lane


@njit(cache=True, error_model="numpy", inline="always")
def make_qkx2_lanes(nmax, rmin, rdelta, nstep, xt, wt, L, Laux, v, m):
    # make_qkx2_quants(32, nmax, ..., use_mad false) for the _S sub-blocks in the lanes
    # (columns) of xt, wt (32, _S) f32 -> their levels L (32, _S) i32, scale v[0] and
    # the_min v[1] (_S,). Laux (32, _S) i32, v (13, _S) f32 and m (2, _S) bool are scratch.
    # Every loop over s runs across the lanes (SIMD), and each lane does the C's float32
    # operations in the C's order, so it is bit-exact; the C's branches become per-lane
    # selects: a lane with max == min (where the C returns early) or D <= 0 still computes
    # the step and keeps nothing of it (error_model numpy: x/0 gives inf or NaN).
    scale, mn, mx, sum_w, sum_x = v[0], v[1], v[2], v[3], v[4]
    iscale, best, sum_l, sum_l2, sum_xl = v[5], v[6], v[7], v[8], v[9]
    cur, this_scale, this_min = v[10], v[11], v[12]
    flat, better = m[0], m[1]
    for s in range(_S):
        mn[s] = xt[0, s]
        mx[s] = xt[0, s]
        sum_w[s] = wt[0, s]
        sum_x[s] = sum_w[s] * xt[0, s]
    for i in range(1, 32):
        for s in range(_S):
            x = xt[i, s]
            mn[s] = x if x < mn[s] else mn[s]      # noqa: FURB136 (the C's comparisons,
            mx[s] = x if x > mx[s] else mx[s]      # noqa: FURB136  NaN included)
            w = wt[i, s]
            sum_w[s] += w
            sum_x[s] += w * x
    for s in range(_S):
        mn[s] = f32(0) if mn[s] > f32(0) else mn[s]   # noqa: FURB136
        flat[s] = mx[s] == mn[s]
        iscale[s] = f32(nmax) / (mx[s] - mn[s])
        scale[s] = f32(1) / iscale[s]
        best[s] = f32(0)
    for i in range(32):
        for s in range(_S):
            l = max(0, min(nmax, nearest_int(iscale[s] * (xt[i, s] - mn[s]))))
            L[i, s] = l
            diff = scale[s] * f32(l) + mn[s] - xt[i, s]
            best[s] += wt[i, s] * (diff * diff)
    for step in range(nstep + 1):
        for s in range(_S):
            iscale[s] = (rmin + rdelta * f32(step) + f32(nmax)) / (mx[s] - mn[s])
            sum_l[s] = f32(0)
            sum_l2[s] = f32(0)
            sum_xl[s] = f32(0)
            cur[s] = f32(0)
        for i in range(32):
            for s in range(_S):
                l = max(0, min(nmax, nearest_int(iscale[s] * (xt[i, s] - mn[s]))))
                Laux[i, s] = l
                w = wt[i, s]
                fl = f32(l)
                sum_l[s] += w * fl
                sum_l2[s] += w * fl * fl
                sum_xl[s] += w * fl * xt[i, s]
        for s in range(_S):
            D = sum_w[s] * sum_l2[s] - sum_l[s] * sum_l[s]
            ts = (sum_w[s] * sum_xl[s] - sum_x[s] * sum_l[s]) / D
            tm = (sum_l2[s] * sum_x[s] - sum_l[s] * sum_xl[s]) / D
            if tm > f32(0):
                tm = f32(0)
                ts = sum_xl[s] / sum_l2[s]
            this_scale[s] = ts
            this_min[s] = tm
            better[s] = D > f32(0) and not flat[s]
        for i in range(32):
            for s in range(_S):
                diff = this_scale[s] * f32(Laux[i, s]) + this_min[s] - xt[i, s]
                cur[s] += wt[i, s] * (diff * diff)
        for s in range(_S):
            better[s] = better[s] and cur[s] < best[s]
        for i in range(32):
            for s in range(_S):
                L[i, s] = Laux[i, s] if better[s] else L[i, s]
        for s in range(_S):
            if better[s]:
                best[s] = cur[s]
                scale[s] = this_scale[s]
                mn[s] = this_min[s]
    for s in range(_S):
        scale[s] = f32(0) if flat[s] else scale[s]
        mn[s] = -mn[s]                                  # the_min
    for i in range(32):
        for s in range(_S):
            L[i, s] = 0 if flat[s] else L[i, s]


@njit(cache=True)
def k_group_scratch():
    # quantize_k_group's work arrays, one set per thread: xt, wt, L, Laux, v, m as
    # make_qkx2_lanes takes them, Lq (_G, 256) u8 the levels per super-block
    return (np.zeros((32, _S), f32), np.zeros((32, _S), f32), np.zeros((32, _S), np.int32),
            np.zeros((32, _S), np.int32), np.zeros((13, _S), f32), np.zeros((2, _S), np.bool_),
            np.zeros((_G, QK_K), np.uint8))


@njit(cache=True, error_model="numpy")
def quantize_k_group(x, b0, nbg, nmax, rmin, rdelta, nstep, out, bs, ws):
    # The part of ggml's quantize_row_q{4,5}_K_ref before the quants are packed, for the
    # nbg <= _G super-blocks b0.. of x (nb*256,) f32 at once (sub-block j of super-block
    # b0 + g in lane 8 g + j; absent ones' lanes compute on stale values, unused): writes
    # d, dmin (f16) and the 12 scale bytes to out[b*bs:b*bs+16] (blocks of bs bytes), the
    # levels (0..nmax) of super-block b0 + g to Lq[g] (256,). ws: k_group_scratch().
    # Returns (non-finite blocks, blocks whose d or dmin overflowed f16).
    xt, wt, L, Laux, v, m, Lq = ws
    bad = 0
    for g in range(nbg):
        chk = f32(0)
        for j in range(8):
            base = (b0 + g) * QK_K + 32 * j
            s = 8 * g + j
            sum_x2 = f32(0)
            for i in range(32):
                e = x[base + i]
                chk += e * f32(0)                # NaN iff some e is NaN or inf
                sum_x2 += e * e
            av_x = np.sqrt(sum_x2 / f32(32))
            for i in range(32):
                e = x[base + i]
                xt[i, s] = e
                wt[i, s] = av_x + abs(e)
        if chk != chk:                           # noqa: PLR0124
            bad += 1
    make_qkx2_lanes(nmax, rmin, rdelta, nstep, xt, wt, L, Laux, v, m)
    scales = v[0]
    mins = v[1]
    over = 0
    for g in range(nbg):
        b = b0 + g
        o = b * bs
        max_scale = f32(0)
        max_min = f32(0)
        for j in range(8):
            if scales[8 * g + j] > max_scale:    # noqa: PLR1730
                max_scale = scales[8 * g + j]
            if mins[8 * g + j] > max_min:        # noqa: PLR1730
                max_min = mins[8 * g + j]
        inv_scale = f32(63) / max_scale if max_scale > f32(0) else f32(0)
        inv_min = f32(63) / max_min if max_min > f32(0) else f32(0)
        for j in range(8):
            ls = min(63, nearest_int(inv_scale * scales[8 * g + j]) & 0xFF)  # (uint8_t), MIN
            lm = min(63, nearest_int(inv_min * mins[8 * g + j]) & 0xFF)
            if j < 4:
                out[o + 4 + j] = ls
                out[o + 8 + j] = lm
            else:
                out[o + 8 + j] = (ls & 0xF) | ((lm & 0xF) << 4)
                out[o + j] |= (ls >> 4) << 6
                out[o + 4 + j] |= (lm >> 4) << 6
        ov = put_f16(out, o, max_scale / f32(63))
        ov |= put_f16(out, o + 2, max_min / f32(63))
        if ov:
            over += 1
        d = get_f16(out, o)
        dmin = get_f16(out, o + 2)
        lq = Lq[g]
        for j in range(8):
            sc, mq = get_scale_min_k4(out, o + 4, j)
            dd = d * f32(sc)
            dm = dmin * f32(mq)
            for i in range(32):
                if dd == f32(0):
                    lq[32 * j + i] = L[i, 8 * g + j]     # make_qkx2_quants' levels
                else:
                    l = nearest_int((x[b * QK_K + 32 * j + i] + dm) / dd)
                    lq[32 * j + i] = max(0, min(nmax, l))
    return bad, over


@njit(cache=True, inline="always")
def k_scales(q, o, d, dmin, dsc, msc):
    # per sub-block d * sc and dmin * m (f32, as gguf-py computes them) of the block whose
    # scale bytes are q[o:o+12] -> dsc, msc (8,)
    for j in range(8):
        sc, m = get_scale_min_k4(q, o, j)
        dsc[j] = d * f32(sc)
        msc[j] = dmin * f32(m)


# --- reference quantize / dequantize -------------------------------------------------------

@njit(parallel=True, cache=True, error_model="numpy")
def quantize_q4_k(x, out):
    # x (nb*256,) f32 -> out (nb*144,) u8 as quantize_row_q4_K_ref;
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
            bd, ov = quantize_k_group(x, b0, nbg, 15, f32(-1.0), f32(0.1), 20, out, Q4K_BYTES, ws)
            bad += bd
            over += ov
            for g in range(nbg):
                o = (b0 + g) * Q4K_BYTES
                for p in range(4):
                    for i in range(32):
                        out[o + 16 + 32 * p + i] = (Lq[g, 64 * p + i]
                                                    | (Lq[g, 64 * p + 32 + i] << 4))
    return bad, over


@njit(parallel=True, cache=True)
def dequantize_q4_k(q, out):
    # q (nb*144,) u8 -> out (nb*256,) f32, bit-exact with gguf-py
    for b in prange(out.size // QK_K):
        o = b * Q4K_BYTES
        dsc = np.empty(8, f32)
        msc = np.empty(8, f32)
        k_scales(q, o + 4, get_f16(q, o), get_f16(q, o + 2), dsc, msc)
        y = out[b * QK_K:(b + 1) * QK_K]
        for p in range(4):
            for i in range(32):
                v = q[o + 16 + 32 * p + i]
                y[64 * p + i] = dsc[2 * p] * f32(v & 15) - msc[2 * p]
                y[64 * p + 32 + i] = dsc[2 * p + 1] * f32(v >> 4) - msc[2 * p + 1]


# --- load: file blocks -> records (Q4_K, and Q5_K with its fifth bits) -------------------

@njit(cache=True, parallel=True)
def repack_k(raw, row0, q, bs, record):
    # Q4_K (bs 144) or Q5_K (bs 176) rows raw (rows, nsb*bs) u8 -> rows row0.. of the
    # tiles q (nt, R/16*nsb*record): row t*R + r is lane r % 16 of strip r // 16, its
    # super-block b in record strip*nsb + b (simd.py's Q4K_* and Q5K_* layouts). One pass
    # per tile (L2-resident).
    rows = raw.shape[0]
    nsb = raw.shape[1] // bs
    R = q.shape[1] // (nsb * record) * RECORD_ROWS
    qs = bs - 128                                    # the nibbles: after Q5_K's qh[32]
    for t in prange(row0 // R, (row0 + rows - 1) // R + 1):
        r0 = max(0, row0 - t * R)
        r1 = min(R, row0 + rows - t * R)
        qt = q[t]
        for r in range(r0, r1):
            row = raw[t * R + r - row0]
            lane = r % RECORD_ROWS
            for b in range(nsb):
                o = b * bs
                rec = (r // RECORD_ROWS * nsb + b) * record
                for k in range(2):
                    qt[rec + Q4K_D + 2 * lane + k] = row[o + k]
                    qt[rec + Q4K_DMIN + 2 * lane + k] = row[o + 2 + k]
                for j in range(8):
                    sc, m = get_scale_min_k4(row, o + 4, j)
                    qt[rec + Q4K_SC + 16 * j + lane] = sc
                    qt[rec + Q4K_M + 16 * j + lane] = m
                    sh = 4 * (j & 1)
                    src = o + qs + 32 * (j >> 1)
                    dst = rec + Q4K_QS + 256 * j + 4 * lane
                    for i in range(16):
                        qt[dst + 64 * (i >> 2) + (i & 3)] = (
                            ((row[src + i] >> sh) & 15) | (((row[src + 16 + i] >> sh) & 15) << 4))
                    if bs == Q5K_BYTES:                    # bit j of qh[e]: element e's fifth bit
                        hw = rec + Q5K_QH + 64 * j + 4 * lane
                        for e in range(32):
                            h, g, i = e >> 4, (e >> 2) & 3, e & 3
                            qt[hw + i] |= ((row[o + 16 + e] >> j) & 1) << (2 * g + h)


# --- decode and prefill: simd.q4k_gemm --------------------------------------------------------

MATVEC_K, MATMUL_K = kernels_by_kind(K_QUANT, (4, 5))      # by bits: Q4_K, Q5_K


# --- embedding --------------------------------------------------------------------------------

@njit(cache=True)
def rows_k(q, ids, out, record):
    # Q4_K or Q5_K (record Q5K_RECORD) tiles, ids (T,) -> out (T, n) f32 dequantized rows,
    # bit-exact with gguf-py
    nsb = out.shape[1] // QK_K
    R = q.shape[1] // (nsb * record) * RECORD_ROWS
    for i in range(ids.size):
        t = ids[i] // R
        lane = ids[i] % R % RECORD_ROWS
        row = out[i]
        for b in range(nsb):
            rec = q[t, (ids[i] % R // RECORD_ROWS * nsb + b) * record:]
            d = get_f16(rec, Q4K_D + 2 * lane)
            dmin = get_f16(rec, Q4K_DMIN + 2 * lane)
            for j in range(8):
                ds = d * f32(rec[Q4K_SC + 16 * j + lane])
                ms = dmin * f32(rec[Q4K_M + 16 * j + lane])
                y = row[QK_K * b + 32 * j:]
                for e in range(16):
                    v = rec[Q4K_QS + 256 * j + 64 * (e >> 2) + 4 * lane + (e & 3)]
                    lo, hi = v & 15, v >> 4
                    if record == Q5K_RECORD:
                        hb = rec[Q5K_QH + 64 * j + 4 * lane + (e & 3)] >> (2 * ((e >> 2) & 3))
                        lo |= (hb & 1) << 4
                        hi |= (hb & 2) << 3
                    y[e] = ds * f32(lo) - ms
                    y[16 + e] = ds * f32(hi) - ms


class Q4KLinear(RecordLinear):
    """Q4_K in records of 16 rows and one super-block (simd.py's Q4K_* layout); Q5_K
    (q5_k.py) is this with BITS 5 (its fifth bits after the nibbles)."""
    BITS, BLOCK_BYTES, RECORD = 4, Q4K_BYTES, Q4K_RECORD

    def _strip_bytes(self):
        return self.in_features // QK_K * self.RECORD

    def _repack(self, raw, row0):
        repack_k(raw, row0, self.q, self.BLOCK_BYTES, self.RECORD)

    def _matvec(self, x, out, scratch):
        x8, xd, xs8, xsum, acc, counter = self._buffers(scratch)
        prep_q8_x(x, x8, xd, xs8, xsum)
        MATVEC_K[self.BITS](self.q, x8, xd, None, xsum, out, acc, K_GROUP, counter)

    def _amx_records(self):
        return (KIND_Q4_K if self.BITS == 4 else KIND_Q5_K), K_GROUP

    def _gemm(self, x8, xd, xs8, xsum, out, acc, sc):
        MATMUL_K[self.BITS](self.q, x8, xd, None, xsum.reshape(-1), out, acc, K_GROUP, self._values(xd, sc, self.BITS))

    def _rows(self, ids, out):
        rows_k(self.q, ids, out, self.RECORD)


Q4_K = WeightFormat("Q4_K", "d:f16, dmin:f16, scales:u8[12] (6-bit sc, m per 32), "
                    "qs:u8[128]; x=d*sc*nibble-dmin*m", Q4KLinear,
                    dequantize_q4_k, quantize_q4_k, LlamaFileType.MOSTLY_Q4_K_M)
