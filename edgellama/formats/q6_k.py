"""Q6_K: 256 weights per super-block, 210 bytes, 6-bit values with an int8 scale per 16.

    ql:u8[128]  low 4 bits,  qh:u8[64]  high 2 bits,  scales:i8[16],  d:f16
    x_j = d * scales[j // 16] * (q_j - 32),  q_j = low_j | high_j << 4 in [0, 63]
Within each half h (128 weights) and l < 32: ql[64h + l] holds the low bits of j = 128h + l
(low nibble) and 128h + 64 + l (high nibble), ql[64h + 32 + l] those of 128h + 32 + l and
128h + 96 + l; qh[32h + l] the high bits of 128h + l, +32, +64, +96 (bits 0-1, 2-3, 4-5, 6-7).

Runtime tiles (lanes across rows, see base.TiledLinear): q (nt, R/16 * nsb * 3392) u8,
records of 16 rows and one super-block (layout in simd.py, Q6K_*): the rows' d, their
int8 scales, then per block of 32 weights 16 bytes of nibbles (byte j: the low 4 bits of
elements j and 16 + j, as Q4_0) and 8 of crumbs (byte j: the high 2 bits of elements j,
j + 8, j + 16, j + 24), both as quads of the strip's rows. 6.625 bits per weight resident
(6.5625 in the file). Decode quantizes x to int8 per 32 (records.prep_q8_x, as the other
pair-dot formats; llama.cpp uses one scale per 256 for Q6_K); decode and prefill are one
intrinsic, simd.q6_gemm, which rebuilds the 6-bit values in registers, sums
scale * (q - 32) * x8 over each block exactly in int32 (AVX2's prefill: scale * q * x8,
the offset taken off in f32 as a min), and keeps its f32 sums in registers over a whole
row. Where AMX runs, a prefill of records.AMX_MIN_ROWS or more
rows takes each half-block's sums from a tile instruction (amx.amx_blocks_gemm with kind
KIND_Q6_K, records.MATMUL_AMX), the same bits.
Why crumbs: a crumb quad serves two nibble quads with a shift and a mask each, so the
6-bit values cost no more loads than their bytes. Why records: as Q4_K's (q4_k.py), one
address-ordered run per strip of rows with its scales in it. Both replaced slower
layouts ("Q6_K records", bench/results/design_measurements.json).
"""
from __future__ import annotations

import numpy as np
from gguf.constants import LlamaFileType
from numba import prange

from ..kernels.amx import KIND_Q6_K
from ..kernels.fp import get_f16, nearest_int, put_f16
from ..kernels.jit import njit
from ..kernels.simd import K_GROUP, Q6K_D, Q6K_QS, Q6K_RECORD, Q6K_SC, RECORD_ROWS
from .base import WeightFormat, block_sizes
from .records import SUB16, RecordLinear, kernels_by_kind, prep_q8_x

f32 = np.float32
QK, BS = block_sizes("Q6_K")   # weights and bytes per super-block
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


# --- crumb quads: 2-bit fields of a block of 32 (Q6_K's high bits, Q3_K's and Q2_K's low) --

@njit(cache=True, inline="always")
def put_crumbs(qt, o, v, shift):
    # bits shift, shift+1 of v[e] (32 values of one row's block) -> its 2 crumb quads at
    # qt[o:] (o the block's quads plus 4 lane): byte j (< 8) holds elements j, j + 8,
    # j + 16, j + 24 at bits 0, 2, 4, 6
    for j in range(8):
        qt[o + 64 * (j >> 2) + (j & 3)] = (((v[j] >> shift) & 3) | (((v[8 + j] >> shift) & 3) << 2)
                                           | (((v[16 + j] >> shift) & 3) << 4)
                                           | (((v[24 + j] >> shift) & 3) << 6))


@njit(cache=True, inline="always")
def crumb(rec, o, e):
    # the 2-bit field of element e (< 32) from the crumb quads at rec[o:] (put_crumbs')
    return (np.int32(rec[o + 64 * ((e % 8) >> 2) + (e & 3)]) >> (2 * (e // 8))) & 3


# --- load: file blocks -> records --------------------------------------------------------

@njit(cache=True, parallel=True)
def repack_q6_k(raw, row0, q):
    # raw (rows, nb*210) u8 -> rows row0.. of the tiles q (nt, R/16*nb*3392) u8: row
    # t*R + r is lane r % 16 of strip r // 16, its super-block b in record strip*nb + b
    # (simd.py's Q6K_* layout): per block k of 32, nibble byte j (< 16) = low bits of
    # elements j | j+16 << 4 and crumb byte j (< 8) = high bits of j, j+8, j+16, j+24
    rows = raw.shape[0]
    nb = raw.shape[1] // BS
    R = q.shape[1] // (nb * Q6K_RECORD) * RECORD_ROWS
    for t in prange(row0 // R, (row0 + rows - 1) // R + 1):
        r0 = max(0, row0 - t * R)
        r1 = min(R, row0 + rows - t * R)
        v = np.empty(QK, np.int64)
        qt = q[t]
        for r in range(r0, r1):
            row = raw[t * R + r - row0]
            lane = r % RECORD_ROWS
            for b in range(nb):
                blk = row[b * BS:(b + 1) * BS]
                unpack_block(blk, v)
                rec = (r // RECORD_ROWS * nb + b) * Q6K_RECORD
                qt[rec + Q6K_D + 2 * lane] = blk[208]
                qt[rec + Q6K_D + 2 * lane + 1] = blk[209]
                for k in range(8):
                    e = v[32 * k:32 * k + 32]
                    qt[rec + Q6K_SC + 32 * k + lane] = blk[192 + 2 * k]
                    qt[rec + Q6K_SC + 32 * k + 16 + lane] = blk[193 + 2 * k]
                    o = rec + Q6K_QS + 384 * k + 4 * lane
                    for j in range(16):
                        qt[o + 64 * (j >> 2) + (j & 3)] = (e[j] & 15) | ((e[16 + j] & 15) << 4)
                    put_crumbs(qt, o + 256, e, 4)


# --- decode and prefill: simd.q6_gemm over x quantized to int8 -----------------------------

@njit(cache=True)
def sums16(x8, xs16):
    # x8 (m*16,) int8 -> xs16 (m,) int32, the sum of each 16 (q6_gemm's half-block sums)
    for i in range(xs16.size):
        s = 0
        for j in range(16 * i, 16 * i + 16):
            s += x8[j]
        xs16[i] = s


@njit(cache=True)
def scaled16(xd, xs16, xsum16):
    # xd (m,) f32 the x scales per 32, xs16 (2m,) int32 -> xsum16 (2m,) f32 = xd xs16,
    # the sum of each 16 of x as rounded (Q2_K's mins, AVX2 prefill's offsets)
    for i in range(xs16.size):
        xsum16[i] = xd[i // 2] * f32(xs16[i])


MATVEC_K16, MATMUL_K16 = kernels_by_kind(SUB16, (6, 3, 2))   # by bits: Q6_K, Q3_K, Q2_K


# --- embedding: dequantized rows -----------------------------------------------------------

@njit(cache=True)
def rows_q6_k(q, ids, out):
    # Q6_K tiles, ids (T,) -> out (T, n) f32 dequantized rows, (d * scale) * (q - 32) as
    # ggml rounds them. A block's 6-bit values are built first, quad by quad (its nibble
    # quad g and crumb quad g % 2), then scaled
    nb = out.shape[1] // QK
    R = q.shape[1] // (nb * Q6K_RECORD) * RECORD_ROWS
    v = np.empty(32, np.int32)
    for i in range(ids.size):
        t = ids[i] // R
        lane = ids[i] % R % RECORD_ROWS
        row = out[i]
        for b in range(nb):
            rec = q[t, (ids[i] % R // RECORD_ROWS * nb + b) * Q6K_RECORD:]
            dd = get_f16(rec, Q6K_D + 2 * lane)
            for k in range(8):
                o = Q6K_QS + 384 * k + 4 * lane
                for g in range(4):
                    f = 2 * (g >> 1)         # field f: element 4g + i, 2 + f: 16 + 4g + i
                    for i2 in range(4):
                        nq = np.int32(rec[o + 64 * g + i2])
                        cq = np.int32(rec[o + 256 + 64 * (g & 1) + i2]) >> f
                        v[4 * g + i2] = (nq & 15) | ((cq & 3) << 4)
                        v[16 + 4 * g + i2] = (nq >> 4) | (cq & 48)
                ds0 = dd * f32(np.int8(rec[Q6K_SC + 32 * k + lane]))
                ds1 = dd * f32(np.int8(rec[Q6K_SC + 32 * k + 16 + lane]))
                y = row[QK * b + 32 * k:QK * b + 32 * k + 32]
                for j in range(16):
                    y[j] = ds0 * f32(v[j] - 32)
                    y[16 + j] = ds1 * f32(v[16 + j] - 32)


class Sub16Linear(RecordLinear):
    """The K-quants of 16-weight sub-blocks (Q6_K, Q3_K, Q2_K): records of 16 rows and one
    super-block that simd.q6_gemm reads as `kind` (the format's bits), record bytes per
    strip and super-block; x's sums per 16 beside prep_q8_x's, and xd times them (Q2_K's
    mins, and in prefill the offsets where q6_gemm takes them off in f32)."""
    kind: int
    record: int

    def decode_buffers(self):
        # RecordLinear's, and q6_gemm's x sums per 16 and xd times them
        n = self.in_features
        return super().decode_buffers() + (np.zeros(n // 16, np.int32), np.zeros(n // 16, f32))

    def _strip_bytes(self):
        return self.in_features // QK * self.record

    def _matvec(self, x, out, scratch):
        x8, xd, xs8, xsum, acc, counter, xs16, xsum16 = self._buffers(scratch)
        prep_q8_x(x, x8, xd, xs8, xsum)
        sums16(x8, xs16)
        if self.kind == 2:
            scaled16(xd, xs16, xsum16)
        MATVEC_K16[self.kind](self.q, x8, xd, xs16, xsum16, out, acc, K_GROUP, counter)

    def _sums16(self, x8, xd, sc):
        """x's sums per 16 (x8 flat, xd (Tp, nb)): xs16 (2 Tp nb,) int32 and xsum16 (Tp,
        2 nb) f32, xd times them (q6_gemm's xs and xsum, AMX's Q2_K mins)."""
        xs16 = sc.get("q6_xs16", (x8.size // 16,), np.int32)
        xsum16 = sc.get("q6_xsum16", (xd.shape[0], 2 * xd.shape[1]))
        sums16(x8, xs16)
        scaled16(xd.reshape(-1), xs16, xsum16.reshape(-1))
        return xs16, xsum16

    def _gemm(self, x8, xd, xs8, xsum, out, acc, sc):
        xs16, xsum16 = self._sums16(x8, xd, sc)
        MATMUL_K16[self.kind](self.q, x8, xd, xs16, xsum16.reshape(-1), out, acc, K_GROUP, self._values(xd, sc, self.kind))


class Q6KLinear(Sub16Linear):
    """Q6_K in records of 16 rows and one super-block (simd.py's Q6K_* layout)."""
    kind, record = 6, Q6K_RECORD

    def _repack(self, raw, row0):
        repack_q6_k(raw, row0, self.q)

    def _amx_records(self):
        return KIND_Q6_K, K_GROUP

    def _rows(self, ids, out):
        rows_q6_k(self.q, ids, out)


Q6_K = WeightFormat("Q6_K", "ql:u8[128], qh:u8[64], scales:i8[16], d:f16; "
                    "x=d*scale*(q6-32)",
                    Q6KLinear, dequantize_q6_k, quantize_q6_k, LlamaFileType.MOSTLY_Q6_K)
