"""IQ4_NL and IQ4_XS: 4-bit indices into a fixed non-linear table of 16 int8 values.

    IQ4_NL   32 per block,  18 bytes  d:f16, qs:u8[16]
             x_j = d * KVALUES[nibble_j]
    IQ4_XS  256 per block, 136 bytes  d:f16, scales_h:u16, scales_l:u8[4], qs:u8[128]
             sub-block i (32 weights, qs[16i:16i+16]) has the 6-bit scale
             ls_i = (scales_l[i/2] >> 4(i%2)) & 15 | ((scales_h >> 2i) & 3) << 4
             x_j = d * (ls_i - 32) * KVALUES[nibble_j]
Nibble j < 16 of a 32-block is the low nibble of its qs[j], j >= 16 the high one of
qs[j - 16] (Q4 order).

At run time both are records (records.py; simd.py's layouts): IQ4_NL the per-32-block
records Q4_0 has (records.BlocksLinear, kind KIND_IQ4_NL), IQ4_XS records of 16 rows and
one super-block (the rows' d, each sub-block's ls - 32 as int8, the nibbles as quads;
140 bytes a row per 256 weights where the file has 136). x is quantized to int8 per 32
(records.prep_q8_x, as llama.cpp's q8 activations); the kernels (simd.blocks_gemm,
simd.iq4xs_gemm) look the nibbles up in a 16-byte table in registers (one pshufb per
vector on x86: isa.Isa.lookup) and sum the values times x8 exactly with the pair-dot
instructions, decode and prefill alike. Where AMX runs (amx.enabled()), a prefill of
records.AMX_MIN_ROWS or more rows takes its integer sums from tile instructions instead
(amx.amx_blocks_gemm, kinds KIND_IQ4_NL and KIND_IQ4_XS), the same bits.
"""
from __future__ import annotations

import numpy as np
from gguf.constants import LlamaFileType
from numba import prange

from ..kernels.amx import KIND_IQ4_XS
from ..kernels.fp import get_f16, nearest_int, put_f16
from ..kernels.jit import njit
from ..kernels.simd import IQ4_VALUES, IQ4XS_D, IQ4XS_QS, IQ4XS_RECORD, IQ4XS_SC, K_GROUP, KIND_IQ4_NL, RECORD_ROWS
from .base import WeightFormat, block_sizes
from .records import NO_VALUES, XS, BlocksLinear, RecordLinear, prep_q8_x, product_kernels

f32 = np.float32
NL_BYTES = block_sizes("IQ4_NL")[1]          # bytes per block of 32
QK_XS, XS_BYTES = block_sizes("IQ4_XS")     # weights and bytes per super-block
KVALUES = np.array(IQ4_VALUES, np.int8)
_KVF = KVALUES.astype(np.float32)
GROUP_MAX_EPS = f32(1e-15)      # ggml: a sub-block with max |x| below this is all zero
NTRY = 7                        # llama-quantize's scale search (quantize_iq4_nl / _xs)


# --- reference quantize / dequantize (bit-exact with ggml's quantize_iq4_nl / _xs without
# an importance matrix, i.e. quantize_row_iq4_nl_impl with ntry = 7 and weights x^2) -----

@njit(cache=True, inline="always")
def best_index(x):
    # ggml's best_index_int8(16, kvalues_iq4nl, x): the nearest table value, ties upward
    if x <= _KVF[0]:
        return 0
    if x >= _KVF[15]:
        return 15
    ml = 0
    mu = 15
    while mu - ml > 1:
        mav = (ml + mu) // 2
        if x < _KVF[mav]:
            mu = mav
        else:
            ml = mav
    return mu - 1 if x - _KVF[mu - 1] < _KVF[mu] - x else mu


@njit(cache=True, error_model="numpy")
def fit_scale(x, base):
    # Scale of the 32 weights x[base:base+32] (0 if all below GROUP_MAX_EPS): the
    # weighted (w = x^2) least-squares scale for the table grid at d = max/127, then the
    # best of 2 NTRY + 1 grids id = (itry - 127) / max. All float32 in ggml's order.
    amax = f32(0)
    mx = f32(0)
    for j in range(32):
        ax = abs(x[base + j])
        if ax > amax:
            amax = ax
            mx = x[base + j]
    if amax < GROUP_MAX_EPS:
        return f32(0)
    idv = f32(1) / (-mx / _KVF[0])
    sumqx = f32(0)
    sumq2 = f32(0)
    for j in range(32):
        v = x[base + j]
        q = _KVF[best_index(idv * v)]
        w = v * v
        sumqx += w * q * v
        sumq2 += w * q * q
    d = sumqx / sumq2 if sumq2 > 0 else f32(0)
    best = d * sumqx
    for itry in range(-NTRY, NTRY + 1):
        idv = f32(itry + np.int64(KVALUES[0])) / mx
        sumqx = f32(0)
        sumq2 = f32(0)
        for j in range(32):
            v = x[base + j]
            q = _KVF[best_index(idv * v)]
            w = v * v
            sumqx += w * q * v
            sumq2 += w * q * q
        if sumq2 > 0 and sumqx * sumqx > best * sumq2:
            d = sumqx / sumq2
            best = d * sumqx
    return d


@njit(cache=True, inline="always")
def _put_nibbles(x, base, idv, out, o):
    # the 32 weights x[base:] as table indices of x * idv, packed in Q4 order at out[o:o+16]
    for j in range(16):
        out[o + j] = (best_index(idv * x[base + j])
                      | (best_index(idv * x[base + 16 + j]) << 4))


@njit(cache=True, inline="always")
def _non_finite(x, base, n):
    chk = f32(0)
    for j in range(n):
        chk += x[base + j] * f32(0)             # NaN iff some value is NaN or inf
    return np.isnan(chk)


@njit(parallel=True, cache=True, error_model="numpy")
def quantize_iq4_nl(x, out):
    # x (nb*32,) f32 -> out (nb*18,) u8; returns (non-finite blocks, overflowing scales)
    nb = x.size // 32
    bad = 0
    over = 0
    for b in prange(nb):
        if _non_finite(x, 32 * b, 32):
            bad += 1
        d = fit_scale(x, 32 * b)
        if put_f16(out, NL_BYTES * b, d):
            over += 1
        _put_nibbles(x, 32 * b, f32(1) / d if d != 0 else f32(0), out, NL_BYTES * b + 2)
    return bad, over


@njit(cache=True, error_model="numpy")
def quantize_xs_block(x, base, out, o):
    # the 256 weights x[base:] -> the IQ4_XS block at out[o:o+136]; True if d overflows f16
    scales = np.empty(8, np.float32)
    amax = f32(0)
    smax = f32(0)                                # the scale of largest magnitude, signed
    for i in range(8):
        scales[i] = fit_scale(x, base + 32 * i)
        if abs(scales[i]) > amax:
            amax = abs(scales[i])
            smax = scales[i]
    d = -smax / f32(32)
    over = put_f16(out, o, d)
    idv = f32(1) / d if d != 0 else f32(0)
    sh = 0
    for i in range(8):
        # bit for bit ggml's, NaN included (an overflowing d makes id * scale NaN -> 0)
        ls = min(31, max(-32, nearest_int(idv * scales[i])))
        dl = d * f32(ls)                         # the unrounded d, as ggml
        _put_nibbles(x, base + 32 * i, f32(1) / dl if dl != 0 else f32(0), out, o + 8 + 16 * i)
        ls += 32
        if i % 2 == 0:
            out[o + 4 + i // 2] = ls & 15
        else:
            out[o + 4 + i // 2] |= (ls & 15) << 4
        sh |= (ls >> 4) << (2 * i)
    out[o + 2] = sh & 0xFF
    out[o + 3] = sh >> 8
    return over


@njit(parallel=True, cache=True)
def quantize_iq4_xs(x, out):
    # x (nb*256,) f32 -> out (nb*136,) u8; returns (non-finite blocks, overflowing scales)
    nb = x.size // QK_XS
    bad = 0
    over = 0
    for b in prange(nb):
        if _non_finite(x, QK_XS * b, QK_XS):
            bad += 1
        if quantize_xs_block(x, QK_XS * b, out, XS_BYTES * b):
            over += 1
    return bad, over


@njit(parallel=True, cache=True)
def dequantize_iq4_nl(q, out):
    # q (nb*18,) u8 -> out (nb*32,) f32
    for b in prange(out.size // 32):
        d = get_f16(q, NL_BYTES * b)
        for j in range(16):
            v = q[NL_BYTES * b + 2 + j]
            out[32 * b + j] = d * _KVF[v & 15]
            out[32 * b + 16 + j] = d * _KVF[v >> 4]


@njit(cache=True, inline="always")
def xs_scale(q, o, i):
    # ls - 32 of sub-block i of the IQ4_XS block at q[o]
    lo = (q[o + 4 + i // 2] >> (4 * (i % 2))) & 15
    hi = (q[o + 2 + i // 4] >> (2 * (i % 4))) & 3
    return np.int32(lo | (hi << 4)) - 32


@njit(parallel=True, cache=True)
def dequantize_iq4_xs(q, out):
    # q (nb*136,) u8 -> out (nb*256,) f32
    for b in prange(out.size // QK_XS):
        o = XS_BYTES * b
        d = get_f16(q, o)
        for i in range(8):
            dl = d * f32(xs_scale(q, o, i))
            for j in range(16):
                v = q[o + 8 + 16 * i + j]
                out[QK_XS * b + 32 * i + j] = dl * _KVF[v & 15]
                out[QK_XS * b + 32 * i + 16 + j] = dl * _KVF[v >> 4]


# --- runtime: records (simd.py's layouts) ----------------------------------------------------
# IQ4_NL is a per-32-block format (records.BlocksLinear, kind KIND_IQ4_NL); IQ4_XS has
# records of its own, one per super-block, multiplied by simd.iq4xs_gemm.

class IQ4_NLLinear(BlocksLinear):
    kind = KIND_IQ4_NL


@njit(cache=True, parallel=True)
def repack_xs(raw, row0, q):
    # IQ4_XS rows raw (rows, nsb*136) u8 -> rows row0.. of the tiles q (nt, R/16 * nsb *
    # IQ4XS_RECORD): row t*R + r is lane r % 16 of strip r // 16, its super-block b in
    # record strip*nsb + b (simd.py's IQ4XS_* layout)
    rows = raw.shape[0]
    nsb = raw.shape[1] // XS_BYTES
    R = q.shape[1] // (nsb * IQ4XS_RECORD) * RECORD_ROWS
    for t in prange(row0 // R, (row0 + rows - 1) // R + 1):
        r0 = max(0, row0 - t * R)
        r1 = min(R, row0 + rows - t * R)
        qt = q[t]
        for r in range(r0, r1):
            row = raw[t * R + r - row0]
            lane = r % RECORD_ROWS
            for b in range(nsb):
                o = b * XS_BYTES
                rec = (r // RECORD_ROWS * nsb + b) * IQ4XS_RECORD
                qt[rec + IQ4XS_D + 2 * lane] = row[o]
                qt[rec + IQ4XS_D + 2 * lane + 1] = row[o + 1]
                for k in range(8):
                    qt[rec + IQ4XS_SC + 16 * k + lane] = np.uint8(xs_scale(row, o, k) & 0xFF)
                    dst = rec + IQ4XS_QS + 256 * k + 4 * lane
                    for j in range(16):
                        qt[dst + 64 * (j >> 2) + (j & 3)] = row[o + 8 + 16 * k + j]


matvec_xs, matmul_xs = product_kernels(XS, KIND_IQ4_XS)


@njit(cache=True)
def rows_xs(q, ids, out):
    # IQ4_XS records, ids (T,) -> out (T, n) f32 dequantized rows, bit-exact with gguf-py
    nsb = out.shape[1] // QK_XS
    R = q.shape[1] // (nsb * IQ4XS_RECORD) * RECORD_ROWS
    for i in range(ids.size):
        t = ids[i] // R
        lane = ids[i] % R % RECORD_ROWS
        row = out[i]
        for b in range(nsb):
            rec = q[t, (ids[i] % R // RECORD_ROWS * nsb + b) * IQ4XS_RECORD:]
            d = get_f16(rec, IQ4XS_D + 2 * lane)
            for k in range(8):
                dl = d * f32(np.int8(rec[IQ4XS_SC + 16 * k + lane]))
                y = row[QK_XS * b + 32 * k:]
                for j in range(16):
                    v = rec[IQ4XS_QS + 256 * k + 64 * (j >> 2) + 4 * lane + (j & 3)]
                    y[j] = dl * _KVF[v & 15]
                    y[16 + j] = dl * _KVF[v >> 4]


class IQ4_XSLinear(RecordLinear):
    """IQ4_XS in records of 16 rows and one super-block (simd.py's IQ4XS_* layout)."""

    def _strip_bytes(self):
        return self.in_features // QK_XS * IQ4XS_RECORD

    def _repack(self, raw, row0):
        repack_xs(raw, row0, self.q)

    def _matvec(self, x, out, scratch):
        x8, xd, xs8, xsum, acc, counter = self._buffers(scratch)
        prep_q8_x(x, x8, xd, xs8, xsum)
        matvec_xs(self.q, x8, xd, xs8, None, out, acc, K_GROUP, counter)

    def _amx_records(self):
        return KIND_IQ4_XS, K_GROUP

    def _gemm(self, x8, xd, xs8, xsum, out, acc, sc):
        matmul_xs(self.q, x8, xd, xs8.reshape(-1), None, out, acc, K_GROUP, NO_VALUES)

    def _rows(self, ids, out):
        rows_xs(self.q, ids, out)


IQ4_NL = WeightFormat("IQ4_NL", "d:f16, qs:u8[16]; x=d*KVALUES[nibble]", IQ4_NLLinear,
                      dequantize_iq4_nl, quantize_iq4_nl, LlamaFileType.MOSTLY_IQ4_NL)
IQ4_XS = WeightFormat("IQ4_XS", "d:f16, scales_h:u16, scales_l:u8[4], qs:u8[128]; "
                      "x=d*(ls-32)*KVALUES[nibble], ls 6 bits per 32", IQ4_XSLinear,
                      dequantize_iq4_xs, quantize_iq4_xs, LlamaFileType.MOSTLY_IQ4_XS)
