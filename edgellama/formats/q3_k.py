"""Q3_K: 256 weights per super-block of 16 sub-blocks of 16, 110 bytes, 3-bit values
with a signed 6-bit scale per sub-block.

    hmask:u8[32]  qs:u8[64]  scales:u8[12]  d:f16
    x_e = d * (sc_j - 32) * (q_e - 4),  j = e // 16,  q_e = low_e | high_e << 2 in 0..7
low_e is bits 2k, 2k+1 of qs[32h + l] and high_e bit e // 32 of hmask[l], where h = e // 128,
k = (e % 128) // 32, l = e % 32. sc_j (6 bits): the low 4 from nibble j // 8 of
scales[j % 8], the top 2 from bits 2 (j // 4) and up of scales[8 + j % 4].

Runtime tiles are records of 16 rows and one super-block (records.py; simd.py's
Q3K_RECORD layout), 116 bytes a row and super-block (110 in the file): the rows' d, the
scales as int8 sc - 32, then per block of 32 the low 2 bits of its values as Q6_K's
crumb quads and their third bits as one word a row, ordered as Q5's fifth bits. Decode
and prefill are simd.q6_gemm's kind 3: x quantized to int8 per 32 (records.prep_q8_x;
llama.cpp uses one scale per 256 for Q3_K), each 16-weight sub-block's (q - 4) x8
summed exactly in the CPU's pair-dot instructions and weighted by its scale in int32
(AVX2's prefill: q x8, the offset taken off in f32 as a min, as Q6_K's).
Where AMX runs, prefill multiplies the records on AMX's tiles, each value less 4 times
its scale in a byte (amx.py). Why records of 3-bit values: "Q2_K and Q3_K records" in
bench/results/design_measurements.json.
"""
from __future__ import annotations

import numpy as np
from gguf.constants import LlamaFileType
from numba import prange

from ..kernels.amx import KIND_Q3_K, Q3K_BIAS
from ..kernels.fp import get_f16, nearest_int, put_f16
from ..kernels.jit import njit
from ..kernels.simd import K_GROUP, Q3K_RECORD, Q6K_D, Q6K_QS, Q6K_SC, RECORD_ROWS
from .base import WeightFormat, block_sizes
from .q6_k import Sub16Linear, crumb, put_crumbs

f32 = np.float32
QK, BS = block_sizes("Q3_K")   # weights and bytes per super-block
GROUP_MAX_EPS = f32(1e-15)
_CHUNK = 64                # super-blocks per parallel work item of the reference kernels


# --- shared with q2_k: ggml's packing and scales, the tiles' spans ----------------------

@njit(cache=True, inline="always")
def pack_2bit(L, out, o):
    # the low 2 bits of levels L (256,) -> out[o:o+64], ggml's Q2_K / Q3_K qs order: byte
    # 32h + l holds elements 128h + l + 32k in bits 2k
    for h in range(2):
        for l in range(32):
            e = 128 * h + l
            out[o + 32 * h + l] = L[e] | (L[e + 32] << 2) | (L[e + 64] << 4) | (L[e + 96] << 6)


@njit(cache=True, inline="always")
def put_scale(out, o, v):
    # store v as f16 at out[o:o+2]; True if it is not finite there: overflow, or NaN (huge
    # inputs make ggml's scale search inf / inf): a scale the file cannot hold
    put_f16(out, o, v)
    return (out[o + 1] & 0x7C) == 0x7C


@njit(cache=True, inline="always")
def tile_span(row0, rows, R, t):
    # lanes r0..r1 of tile t that rows row0..row0+rows of one stacked tensor fill
    return max(0, row0 - t * R), min(R, row0 + rows - t * R)


# --- reference quantize / dequantize (bit-exact with ggml's quantize_row_q3_K_ref) -------

@njit(cache=True, error_model="numpy")
def make_q3_quants(x, xo, L, lo):
    # ggml's make_q3_quants(16, nmax=4, x + xo, L + lo, do_rmse=true): levels in 0..7
    # (all 0 for an all-zero group) -> L[lo:lo+16] int8; returns the scale. The same f32
    # operations in the same order as the C (w x l is (w x) l, x sl2 / slx is (x sl2) / slx).
    mx = f32(0)
    amax = f32(0)
    for i in range(16):
        ax = abs(x[xo + i])
        if ax > amax:
            amax = ax
            mx = x[xo + i]
    if amax < GROUP_MAX_EPS:
        for i in range(16):
            L[lo + i] = 0
        return f32(0)
    iscale = f32(-4) / mx
    sumlx = f32(0)
    suml2 = f32(0)
    for i in range(16):
        v = x[xo + i]
        l = max(-4, min(3, nearest_int(iscale * v)))
        L[lo + i] = l
        w = v * v
        fl = f32(l)
        sumlx += w * v * fl
        suml2 += w * fl * fl
    for _ in range(5):
        changed = 0
        for i in range(16):
            v = x[xo + i]
            w = v * v
            li = f32(L[lo + i])
            slx = sumlx - w * v * li
            if slx > 0:
                sl2 = suml2 - w * li * li
                new_l = max(-4, min(3, nearest_int(v * sl2 / slx)))
                if new_l != L[lo + i]:
                    fn = f32(new_l)
                    slx += w * v * fn
                    sl2 += w * fn * fn
                    if sl2 > 0 and slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[lo + i] = new_l
                        sumlx = slx
                        suml2 = sl2
                        changed += 1
        if changed == 0:
            break
    for i in range(16):
        L[lo + i] += 4
    return sumlx / suml2 if suml2 > 0 else f32(0)


@njit(cache=True, inline="always")
def q3_scale(q, o, j):
    # sub-block j's 6-bit scale minus 32, from the 12 scale bytes at q[o:o+12]
    lo = (np.int32(q[o + j % 8]) >> (4 * (j // 8))) & 15
    hi = (np.int32(q[o + 8 + j % 4]) >> (2 * (j // 4))) & 3
    return (lo | (hi << 4)) - 32


@njit(cache=True, error_model="numpy")
def quantize_block(x, xo, out, o, L, scales):
    # ggml's quantize_row_q3_K_ref for the super-block x[xo:xo+256] -> out[o:o+110];
    # L (256,) i8 and scales (16,) f32 are scratch. Returns True if d is not finite as f16.
    max_scale = f32(0)
    amax = f32(0)
    for j in range(16):
        s = make_q3_quants(x, xo + 16 * j, L, 16 * j)
        scales[j] = s
        if abs(s) > amax:                    # strict: the first largest |scale| wins
            amax = abs(s)
            max_scale = s
    sc = out[o + 96:o + 108]
    sc[:] = 0
    over = False
    if max_scale != 0:                       # C's `if (max_scale)`: NaN passes too
        iscale = f32(-32) / max_scale
        for j in range(16):
            l = np.int32(np.int8(nearest_int(iscale * scales[j])))   # C stores it in int8_t
            l = max(-32, min(31, l)) + 32
            if j < 8:
                sc[j] = l & 15
            else:
                sc[j - 8] |= (l & 15) << 4
            sc[8 + j % 4] |= (l >> 4) << (2 * (j // 4))
        over = put_scale(out, o + 108, f32(1) / iscale)
    else:
        put_f16(out, o + 108, f32(0))
    d_all = get_f16(out, o + 108)
    for j in range(16):
        dl = d_all * f32(q3_scale(out, o + 96, j))
        if dl == 0:                          # keep make_q3_quants' levels (C: `if (!d)`)
            continue
        for i in range(16):
            L[16 * j + i] = max(-4, min(3, nearest_int(x[xo + 16 * j + i] / dl))) + 4
    hm = out[o:o + 32]
    hm[:] = 0
    for e in range(QK):                      # high bit of element e: bit e // 32 of hmask[e % 32]
        if L[e] > 3:
            hm[e % 32] |= 1 << (e // 32)
            L[e] -= 4
    pack_2bit(L, out, o + 32)
    return over


@njit(parallel=True, cache=True, error_model="numpy")
def quantize_q3_k(x, out):
    # x (nb*256,) f32 -> out (nb*110,) u8; returns (non-finite blocks, overflowing scales)
    nb = x.size // QK
    bad = 0
    over = 0
    for c in prange(-(-nb // _CHUNK)):
        L = np.empty(QK, np.int8)
        scales = np.empty(16, f32)
        for b in range(c * _CHUNK, min(nb, (c + 1) * _CHUNK)):
            chk = f32(0)
            amax = f32(0)
            for e in range(QK):
                chk += x[QK * b + e] * f32(0)   # NaN iff some value is NaN or inf
                amax = max(amax, abs(x[QK * b + e]))
            if np.isnan(chk):
                bad += 1
            # beyond |x| ~ 4e12 make_q3_quants' w x l = 4 x^3 overflows f32 and ggml may
            # write a zero scale (below, d overflows f16 first): too large all the same
            huge = not np.isfinite(f32(4) * amax * amax * amax)
            if quantize_block(x, QK * b, out, BS * b, L, scales) or huge:
                over += 1
    return bad, over


@njit(parallel=True, cache=True)
def dequantize_q3_k(q, out):
    # q (nb*110,) u8 -> out (nb*256,) f32, as gguf.quants: (d * (sc - 32)) * (q - 4)
    for b in prange(out.size // QK):
        o = BS * b
        d = get_f16(q, o + 108)
        for j in range(16):
            dl = d * f32(q3_scale(q, o + 96, j))
            h, k, l0 = j // 8, (j % 8) // 2, 16 * (j % 2)
            for i in range(16):
                low = (np.int32(q[o + 32 + 32 * h + l0 + i]) >> (2 * k)) & 3
                v = low | (((np.int32(q[o + l0 + i]) >> (j // 2)) & 1) << 2)
                out[QK * b + 16 * j + i] = dl * f32(v - 4)


# --- load: the file's blocks -> records ----------------------------------------------------

@njit(cache=True, parallel=True)
def repack_q3_k(raw, row0, q):
    # raw (rows, nb*110) u8 -> rows row0.. of the tiles q (nt, R/16*nb*1856) u8: row t*R
    # + r is lane r % 16 of strip r // 16, its super-block b in record strip*nb + b
    # (simd.py's Q3K_RECORD layout): per block k of 32, crumb byte j (< 8) = the low 2
    # bits of elements j, j+8, j+16, j+24 at bits 0, 2, 4, 6; the third bits' word: bit
    # 8 i + 2 g + h that of element 16 h + 4 g + i
    rows = raw.shape[0]
    nb = raw.shape[1] // BS
    R = q.shape[1] // (nb * Q3K_RECORD) * RECORD_ROWS
    for t in prange(row0 // R, (row0 + rows - 1) // R + 1):
        r0, r1 = tile_span(row0, rows, R, t)
        v = np.empty(QK, np.int32)
        qt = q[t]
        q8 = qt.view(np.int8)
        for r in range(r0, r1):
            row = raw[t * R + r - row0]
            lane = r % RECORD_ROWS
            for b in range(nb):
                blk = row[b * BS:(b + 1) * BS]
                for e in range(QK):
                    l = e % 32
                    low = (np.int32(blk[32 + 32 * (e // 128) + l]) >> (2 * ((e % 128) // 32))) & 3
                    v[e] = low | (((np.int32(blk[l]) >> (e // 32)) & 1) << 2)
                rec = (r // RECORD_ROWS * nb + b) * Q3K_RECORD
                qt[rec + Q6K_D + 2 * lane] = blk[108]
                qt[rec + Q6K_D + 2 * lane + 1] = blk[109]
                for j in range(16):      # sub-block j = 2 k + h
                    q8[rec + Q6K_SC + 16 * j + lane] = q3_scale(blk, 96, j)
                for k in range(8):
                    o = rec + Q6K_QS + 192 * k + 4 * lane
                    e = v[32 * k:32 * k + 32]
                    put_crumbs(qt, o, e, 0)
                    for i in range(4):
                        bits = 0
                        for g in range(4):
                            for h in range(2):
                                bits |= (e[16 * h + 4 * g + i] >> 2) << (2 * g + h)
                        qt[o + 128 + i] = bits


@njit(cache=True, inline="always")
def q3_value(rec, k, lane, e):
    # level q (0..7) of element e (< 32) of block k of one row (lane) of a Q3_K record
    o = Q6K_QS + 192 * k + 4 * lane
    h, g, i = e // 16, (e % 16) // 4, e % 4
    return crumb(rec, o, e) | (((np.int32(rec[o + 128 + i]) >> (2 * g + h)) & 1) << 2)


# --- embedding: dequantized rows -----------------------------------------------------------

@njit(cache=True)
def rows_q3_k(q, ids, out):
    # Q3_K records, ids (T,) -> out (T, n) f32 dequantized rows, (d (sc - 32)) (q - 4)
    # as dequantize_q3_k
    nb = out.shape[1] // QK
    R = q.shape[1] // (nb * Q3K_RECORD) * RECORD_ROWS
    for i in range(ids.size):
        t = ids[i] // R
        lane = ids[i] % R % RECORD_ROWS
        row = out[i]
        for b in range(nb):
            rec = q[t, (ids[i] % R // RECORD_ROWS * nb + b) * Q3K_RECORD:]
            dd = get_f16(rec, Q6K_D + 2 * lane)
            for j in range(16):
                dl = dd * f32(np.int8(rec[Q6K_SC + 16 * j + lane]))
                for i2 in range(16):
                    row[QK * b + 16 * j + i2] = dl * f32(q3_value(rec, j // 2, lane, 16 * (j % 2) + i2) - 4)


class Q3KLinear(Sub16Linear):
    """Q3_K in records of 16 rows and one super-block (simd.py's Q3K_RECORD layout):
    decode and prefill are q6_gemm's kind 3; on AMX, prefill takes each block's scaled
    integer dot from a tile instruction (amx.amx_blocks_gemm with kind KIND_Q3_K), the
    same bits."""
    kind, record = 3, Q3K_RECORD

    def _repack(self, raw, row0):
        repack_q3_k(raw, row0, self.q)

    def _amx_records(self):
        return KIND_Q3_K, K_GROUP

    def _gemm_amx(self, x8, xd, xs8, xsum, out, acc, sc):
        # the tiles' bias comes off with x's block sums: Q3K_BIAS xs8, exact in f32
        bias = sc.get("q3_bias", xd.shape)
        np.multiply(xs8, Q3K_BIAS, out=bias, casting="unsafe")
        super()._gemm_amx(x8, xd, xs8, bias, out, acc, sc)

    def _rows(self, ids, out):
        rows_q3_k(self.q, ids, out)


Q3_K = WeightFormat("Q3_K", "hmask:u8[32], qs:u8[64], scales:u8[12] (6-bit), d:f16; "
                    "x=d*(sc-32)*(q-4)",
                    Q3KLinear, dequantize_q3_k, quantize_q3_k, LlamaFileType.MOSTLY_Q3_K_M)
