"""Q4_K: 256 weights per super-block of 8 sub-blocks of 32, 144 bytes, and the pieces
every "K-quant with 6-bit sub-block scales and mins" shares (Q4_K, Q5_K: see q5_k.py).

    d:f16  dmin:f16  scales:u8[12]  qs:u8[128]
    x = d * sc_s * q - dmin * m_s   for element e of sub-block s (e in 0..31)
q (4 bits) is nibble s % 2 of qs[32 (s // 2) + e]: sub-blocks 2p and 2p+1 share 32 bytes.
The 12 scale bytes hold sc_s and m_s (6 bits each), as ggml's get_scale_min_k4 reads them:
s < 4: sc = scales[s] & 63, m = scales[s+4] & 63; s >= 4: the low 4 bits from
scales[s+4] (sc low nibble, m high nibble), the top 2 from bits 6-7 of scales[s-4] (sc)
and scales[s] (m).

Runtime tiles (lanes across rows, see base.TiledLinear), shared by Q4_K and Q5_K:
    q (nt, nsub*S*R) u8     per sub-block u, at u*S*R: its quants ((S-2)*R bytes), then
                            its sc (R bytes), then its m (R bytes)
    d, dmin (nt, nsb*R) u16 f16 bits, per super-block
Q4_K: S = 18, the quants are the nibbles re-paired into Q4_0 order (byte j holds elements
j and j+16 of the sub-block) and stored as Q4_0's tiles store them (quads, simd.py), so
the same pair-dot kernel (simd.nib_dot on q4.prep_q8_x's int8 x) runs on them.
4.625 bits per weight resident (4.5 in the file). Decode: per sub-block the exact
int32 sum(q x8), weighted by sc_s and m_s in f32, then by d and dmin once per
super-block. Prefill (q4.Int8Prefill) is simd.q4k_gemm: the same sums for 4 rows of x
per tile, in registers.
Why sc and m sit inside the quant stream: read from DRAM (24 matrices of 2048 x 8192,
2 threads, this 2-core VM), the same kernel reads 0.79x Q4_0's bytes/s with sc and m in
arrays of their own, 0.89-0.92x interleaved, and 0.68x with d and dmin interleaved too.
Measured as committed (2048 x 8192, Q4_0 in the same run): decode 0.79-0.85x Q4_0's
bytes/s from DRAM and 0.8x from L3 with 2 threads (0.88x and 0.83x with one). Prefill
(8192 x 2048, T = 512, the other core busy with another job): one thread 325 GFLOP/s
with the scale and min passes over memory per sub-block, 579-581 with q4k_gemm (Q4_0
594-608 in the same runs: Q4_K's tile is 3% larger); 2 threads 252-330 -> 430 (Q4_0
429-447). Folding d and dmin into each sub-block's weights (no per-super-block sums)
measured 0.91-0.95x Q4_0's GFLOP/s in the same runs, one thread, against 0.97-0.98x.
"""
from __future__ import annotations

import numpy as np
from gguf.constants import LlamaFileType
from numba import njit, prange

from ..fp import f16_to_f32, get_f16, nearest_int, put_f16
from ..simd import ISA, TOKENS, nib_dot, prefetch_run, q4k_gemm
from .base import TiledLinear, WeightFormat, anon_array, quad_offset, release_pages
from .q4 import Int8Prefill, prep_q8_x

f32 = np.float32
QK_K = 256
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
# 8 _G sub-blocks at once, one per SIMD lane: a (4096, 3072) f32 matrix, 2 threads, this
# VM: Q4_K 18-20 -> 71-76 M values/s, Q5_K 22-27 -> 84-90 M/s (one sub-block at a time
# -> lanes); _G = 2 or 8 measured 34 and 53 M/s.
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
            bd, ov = quantize_k_group(x, b0, nbg, 15, f32(-1.0), f32(0.1), 20, out, 144, ws)
            bad += bd
            over += ov
            for g in range(nbg):
                o = (b0 + g) * 144
                for p in range(4):
                    for i in range(32):
                        out[o + 16 + 32 * p + i] = (Lq[g, 64 * p + i]
                                                    | (Lq[g, 64 * p + 32 + i] << 4))
    return bad, over


@njit(parallel=True, cache=True)
def dequantize_q4_k(q, out):
    # q (nb*144,) u8 -> out (nb*256,) f32, bit-exact with gguf-py
    for b in prange(out.size // QK_K):
        o = b * 144
        dsc = np.empty(8, f32)
        msc = np.empty(8, f32)
        k_scales(q, o + 4, get_f16(q, o), get_f16(q, o + 2), dsc, msc)
        y = out[b * QK_K:(b + 1) * QK_K]
        for p in range(4):
            for i in range(32):
                v = q[o + 16 + 32 * p + i]
                y[64 * p + i] = dsc[2 * p] * f32(v & 15) - msc[2 * p]
                y[64 * p + 32 + i] = dsc[2 * p + 1] * f32(v >> 4) - msc[2 * p + 1]


# --- load: file blocks -> tiles ------------------------------------------------------------

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
def repack_q4_k(raw, row0, q, d, dmin):
    # Q4_K rows raw (rows, nsb*144) u8 -> rows row0.. of the tiles q (nt, nsub*18*R), d,
    # dmin (nt, nsb*R): per sub-block s of row t*R + r, byte j (< 16) of its quads at
    # 18 s R = q_j | q_j+16 << 4, then sc and m (R bytes each). One pass per tile.
    rows = raw.shape[0]
    nsb = raw.shape[1] // 144
    R = d.shape[1] // nsb
    for t in prange(row0 // R, (row0 + rows - 1) // R + 1):
        r0 = max(0, row0 - t * R)
        r1 = min(R, row0 + rows - t * R)
        tile = raw[t * R + r0 - row0:t * R + r1 - row0]
        qt = q[t]
        repack_k_tile_scales(tile, 144, 18, r0, qt, d[t], dmin[t])
        for s in range(8 * nsb):
            sh = 4 * (s & 1)
            src = (s >> 3) * 144 + 16 + 32 * ((s & 7) >> 1)
            for r in range(r1 - r0):
                row = tile[r]
                for i in range(16):
                    qt[quad_offset(18 * s * R, R, r0 + r, i)] = (
                        ((row[src + i] >> sh) & 15) | (((row[src + 16 + i] >> sh) & 15) << 4))


# --- decode --------------------------------------------------------------------------------

@njit(cache=True, fastmath=True, parallel=True)
def matvec_q4_k(q, d, dmin, x8, xd, xsum, out, scratch, s32):
    # W (nt*R, n) Q4_K tiles @ x (prep_q8_x) -> out (d,); scratch (nt, 3, R) f32,
    # s32 (nt, R) int32. Row . x = sum over super-blocks of
    #   d sum_s sc_s dx_s sum(q x8)_s - dmin sum_s m_s sum(x)_s
    nt = q.shape[0]
    R = s32.shape[1]
    nsb = xd.size // 8
    for t in prange(nt):
        qt = q[t]
        acc = scratch[t, 0]
        a1 = scratch[t, 1]
        a2 = scratch[t, 2]
        s = s32[t]
        acc[:] = 0
        for b in range(nsb):
            a1[:] = 0
            a2[:] = 0
            for k in range(8):
                u = 8 * b + k
                o = 18 * u * R
                prefetch_run(qt, o + 18 * R, 18 * R)
                nib_dot(qt, o, x8, 32 * u, s, R, ISA)
                scu = qt[o + 16 * R:o + 17 * R]
                mu = qt[o + 17 * R:o + 18 * R]
                dx = xd[u]
                xs = xsum[u]
                for r in range(R):
                    a1[r] += f32(scu[r]) * (dx * f32(s[r]))
                    a2[r] += f32(mu[r]) * xs
            db = d[t, b * R:(b + 1) * R]
            mb = dmin[t, b * R:(b + 1) * R]
            for r in range(R):
                acc[r] += f16_to_f32(db[r]) * a1[r] - f16_to_f32(mb[r]) * a2[r]
        n = min(R, out.size - t * R)
        out[t * R:t * R + n] = acc[:n]


@njit(cache=True, parallel=True)
def matmul_q4_k(q, d, dmin, x8, xd, xsum, out, acc):
    # W (nt*R, n) Q4_K tiles @ x (q4.prep_q8_rows; x8 flat (Tp*n,)) -> out (T, dout) = x W^T;
    # acc (nt, TOKENS, R) f32: per-tile sums (simd.q4k_gemm)
    T = out.shape[0]
    nt = q.shape[0]
    R = acc.shape[2]
    nsub = xd.shape[1]
    xdf, xsumf = xd.reshape(-1), xsum.reshape(-1)
    for t in prange(nt):
        a = acc[t]
        af = a.reshape(-1)
        c0 = t * R
        nc = min(R, out.shape[1] - c0)
        for t0 in range(0, T, TOKENS):
            q4k_gemm(q[t], d[t], dmin[t], x8, xdf, xsumf, af, nsub, t0, ISA)
            for k in range(min(TOKENS, T - t0)):
                out[t0 + k, c0:c0 + nc] = a[k, :nc]


# --- prefill and embedding: dequantize from tiles (serial, exact: see q4.py) ----------------

@njit(cache=True, inline="always")
def k_tile_scales(q, d, dmin, S, t, u, R, dsc, msc):
    # lanes of tile t, sub-block u: d * sc and dmin * m (f32, as gguf-py) -> dsc, msc (R,)
    b = u // 8
    o = (S * u + S - 2) * R
    for r in range(R):
        dsc[r] = f16_to_f32(d[t, b * R + r]) * f32(q[t, o + r])
        msc[r] = f16_to_f32(dmin[t, b * R + r]) * f32(q[t, o + R + r])


@njit(cache=True)
def dequant_q4_k_tiles(q, d, dmin, t0, t1, wt):
    # Q4_K tiles t0..t1 -> wt (n, (t1-t0)*R) f32 = W[rows].T
    nsub = wt.shape[0] // 32
    R = d.shape[1] * 8 // nsub
    dsc = np.empty(R, f32)
    msc = np.empty(R, f32)
    for u in range(nsub):
        for t in range(t0, t1):
            k_tile_scales(q, d, dmin, 18, t, u, R, dsc, msc)
            c = (t - t0) * R
            for j in range(16):
                qj = q[t, quad_offset(18 * u * R, R, 0, j):]    # byte j of row r: qj[4r]
                lo = wt[32 * u + j, c:c + R]
                hi = wt[32 * u + 16 + j, c:c + R]
                for r in range(R):
                    lo[r] = dsc[r] * f32(qj[4 * r] & 15) - msc[r]
                    hi[r] = dsc[r] * f32(qj[4 * r] >> 4) - msc[r]


@njit(cache=True)
def rows_q4_k(q, d, dmin, ids, out):
    # Q4_K tiles, ids (T,) -> out (T, n) f32 dequantized rows
    nsub = out.shape[1] // 32
    R = d.shape[1] * 8 // nsub
    for i in range(ids.size):
        t = ids[i] // R
        r = ids[i] % R
        row = out[i]
        for u in range(nsub):
            b = u // 8
            ds = f16_to_f32(d[t, b * R + r]) * f32(q[t, (18 * u + 16) * R + r])
            ms = f16_to_f32(dmin[t, b * R + r]) * f32(q[t, (18 * u + 17) * R + r])
            for j in range(16):
                v = q[t, quad_offset(18 * u * R, R, r, j)]
                row[32 * u + j] = ds * f32(v & 15) - ms
                row[32 * u + 16 + j] = ds * f32(v >> 4) - ms


class KLinear(TiledLinear):
    """What Q4_K and Q5_K tiles share: q (nt, nsub*S*R) u8, each sub-block's quants then
    its 6-bit scale and min; d, dmin (nt, nsb*R) u16 f16 bits. A subclass sets S, fills
    the tiles (_repack) and adds its activation buffers."""
    S = 18                     # bytes per row per sub-block in q

    def _load(self, raws):
        n = self.in_features
        nsub, nt, R = n // 32, self.nt, self.R
        self.q = anon_array((nt, nsub * self.S * R), np.uint8)   # zeroed: pad rows add nothing
        self.d = anon_array((nt, nsub // 8 * R), np.uint16)
        self.dmin = anon_array((nt, nsub // 8 * R), np.uint16)
        row0 = 0
        for raw in raws:
            self._repack(raw, row0)
            release_pages(raw)
            row0 += raw.shape[0]
        self._scratch = np.zeros((nt, 3, R), f32)
        self._xd = np.zeros(nsub, f32)
        self._xsum = np.zeros(nsub, f32)

    def _repack(self, raw: np.ndarray, row0: int) -> None:
        """File rows raw (rows, row_bytes) -> rows row0.. of q, d, dmin."""
        raise NotImplementedError


class Q4KLinear(Int8Prefill, KLinear):
    """Q4_K in row tiles (KLinear, S = 18): 16 bytes of nibbles per row and sub-block, in
    Q4_0 order, as quads."""
    def _load(self, raws):
        super()._load(raws)
        self._s32 = np.zeros((self.nt, self.R), np.int32)
        self._x8 = np.zeros(self.in_features, np.int8)
        self._xs8 = np.zeros(self.in_features // 32, np.int32)   # unused by Q4_K's sums

    def _repack(self, raw, row0):
        repack_q4_k(raw, row0, self.q, self.d, self.dmin)

    def matvec(self, x, out):
        prep_q8_x(x, self._x8, self._xd, self._xs8, self._xsum)
        matvec_q4_k(self.q, self.d, self.dmin, self._x8, self._xd, self._xsum, out,
                    self._scratch, self._s32)

    def _gemm(self, x8, xd, xs8, xsum, out, acc):
        matmul_q4_k(self.q, self.d, self.dmin, x8, xd, xsum, out, acc)

    def _dequant_tiles(self, t0, t1, wt):
        dequant_q4_k_tiles(self.q, self.d, self.dmin, t0, t1, wt)

    def _rows(self, ids, out):
        rows_q4_k(self.q, self.d, self.dmin, ids, out)


Q4_K = WeightFormat("Q4_K", 12, QK_K, 144,
                    "d:f16, dmin:f16, scales:u8[12] (6-bit sc, m per 32), qs:u8[128]; "
                    "x=d*sc*nibble-dmin*m", Q4KLinear,
                    dequantize_q4_k, quantize_q4_k, LlamaFileType.MOSTLY_Q4_K_M)
