"""Q2_K: 256 weights per super-block of 16 sub-blocks of 16, 84 bytes, 2-bit values
with a 4-bit scale and a 4-bit min per sub-block.

    scales:u8[16]  qs:u8[64]  d:f16  dmin:f16
    x_e = d * sc_j * q_e - dmin * m_j,  j = e // 16,  sc_j = scales[j] & 15, m_j = scales[j] >> 4
q_e (2 bits) is bits 2k, 2k+1 of qs[32h + l], where h = e // 128, k = (e % 128) // 32,
l = e % 32.

Runtime tiles are records of 16 rows and one super-block (records.py; simd.py's Q2K_*
layout), the file's 84 bytes a row and super-block: the rows' d and dmin, the scale
bytes as in the file, then per block of 32 its 2-bit values as Q6_K's crumb quads (byte
j: elements j, j + 8, j + 16, j + 24). Decode and prefill are simd.q6_gemm's kind 2: x
quantized to int8 per 32 (records.prep_q8_x; llama.cpp uses one scale per 256 for
Q2_K), each 16-weight sub-block's q x8 summed exactly in the CPU's pair-dot
instructions and weighted by its sc in int32, and dmin m times x's sum per 16 (as
rounded) taken off in f32; on AMX, prefill's integer sums are tile products (amx.py).
Why records of 2-bit values:
"Q2_K and Q3_K records" in bench/results/design_measurements.json.
"""
from __future__ import annotations

import numpy as np
from gguf.constants import LlamaFileType
from numba import prange

from ..kernels.amx import KIND_Q2_K
from ..kernels.fp import get_f16, nearest_int, put_f16
from ..kernels.jit import njit
from ..kernels.simd import K_GROUP, Q2K_DMIN, Q2K_RECORD, Q2K_SC, Q6K_D, Q6K_QS, RECORD_ROWS
from .base import WeightFormat, block_sizes
from .q3_k import QK, pack_2bit, put_scale, tile_span
from .q6_k import Sub16Linear, crumb, put_crumbs

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


# --- load: the file's blocks -> records ----------------------------------------------------

@njit(cache=True, parallel=True)
def repack_q2_k(raw, row0, q):
    # raw (rows, nb*84) u8 -> rows row0.. of the tiles q (nt, R/16*nb*1344) u8: row t*R +
    # r is lane r % 16 of strip r // 16, its super-block b in record strip*nb + b
    # (simd.py's Q2K_* layout): per block k of 32, crumb byte j (< 8) = elements j, j+8,
    # j+16, j+24 at bits 0, 2, 4, 6
    rows = raw.shape[0]
    nb = raw.shape[1] // BS
    R = q.shape[1] // (nb * Q2K_RECORD) * RECORD_ROWS
    for t in prange(row0 // R, (row0 + rows - 1) // R + 1):
        r0, r1 = tile_span(row0, rows, R, t)
        v = np.empty(QK, np.int32)
        qt = q[t]
        for r in range(r0, r1):
            row = raw[t * R + r - row0]
            lane = r % RECORD_ROWS
            for b in range(nb):
                blk = row[b * BS:(b + 1) * BS]
                for e in range(QK):
                    v[e] = (np.int32(blk[16 + 32 * (e // 128) + e % 32]) >> (2 * ((e % 128) // 32))) & 3
                rec = (r // RECORD_ROWS * nb + b) * Q2K_RECORD
                for i in range(2):
                    qt[rec + Q6K_D + 2 * lane + i] = blk[80 + i]
                    qt[rec + Q2K_DMIN + 2 * lane + i] = blk[82 + i]
                for j in range(16):      # sub-block j = 2 k + h
                    qt[rec + Q2K_SC + 16 * j + lane] = blk[j]
                for k in range(8):
                    o = rec + Q6K_QS + 128 * k + 4 * lane
                    put_crumbs(qt, o, v[32 * k:32 * k + 32], 0)


# --- embedding: dequantized rows -----------------------------------------------------------

@njit(cache=True)
def rows_q2_k(q, ids, out):
    # Q2_K records, ids (T,) -> out (T, n) f32 dequantized rows, (d sc) q - dmin m as
    # dequantize_q2_k
    nb = out.shape[1] // QK
    R = q.shape[1] // (nb * Q2K_RECORD) * RECORD_ROWS
    for i in range(ids.size):
        t = ids[i] // R
        lane = ids[i] % R % RECORD_ROWS
        row = out[i]
        for b in range(nb):
            rec = q[t, (ids[i] % R // RECORD_ROWS * nb + b) * Q2K_RECORD:]
            dd = get_f16(rec, Q6K_D + 2 * lane)
            dm = get_f16(rec, Q2K_DMIN + 2 * lane)
            for j in range(16):
                s = rec[Q2K_SC + 16 * j + lane]
                dl = dd * f32(s & 15)
                ml = dm * f32(s >> 4)
                o = Q6K_QS + 128 * (j // 2) + 4 * lane
                for i2 in range(16):
                    e = 16 * (j % 2) + i2           # element of block j // 2
                    row[QK * b + 16 * j + i2] = dl * f32(crumb(rec, o, e)) - ml


class Q2KLinear(Sub16Linear):
    """Q2_K in records of 16 rows and one super-block (simd.py's Q2K_* layout), the file's
    bytes: decode and prefill are q6_gemm's kind 2; on AMX, prefill takes each block's
    scaled integer dot from a tile instruction (amx.amx_blocks_gemm with kind KIND_Q2_K)
    and the mins from x's sums per 16 (as rounded), the same bits."""
    kind, record = 2, Q2K_RECORD

    def _repack(self, raw, row0):
        repack_q2_k(raw, row0, self.q)

    def _amx_records(self):
        return KIND_Q2_K, K_GROUP

    def _gemm_amx(self, x8, xd, xs8, xsum, out, acc, sc):
        # the mins take x's sums per 16 (q6_gemm's xsum16), laid out as the A tiles' sums
        super()._gemm_amx(x8, xd, xs8, self._sums16(x8, xd, sc)[1], out, acc, sc)

    def _rows(self, ids, out):
        rows_q2_k(self.q, ids, out)


Q2_K = WeightFormat("Q2_K", "scales:u8[16] (4-bit sc | 4-bit m << 4), qs:u8[64], d:f16, "
                    "dmin:f16; x=d*sc*q-dmin*m", Q2KLinear, dequantize_q2_k, quantize_q2_k,
                    LlamaFileType.MOSTLY_Q2_K)
