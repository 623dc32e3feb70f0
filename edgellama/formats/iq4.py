"""IQ4_NL and IQ4_XS: 4-bit indices into a fixed non-linear table of 16 int8 values.

    IQ4_NL   32 per block,  18 bytes  d:f16, qs:u8[16]
             x_j = d * KVALUES[nibble_j]
    IQ4_XS  256 per block, 136 bytes  d:f16, scales_h:u16, scales_l:u8[4], qs:u8[128]
             sub-block i (32 weights, qs[16i:16i+16]) has the 6-bit scale
             ls_i = (scales_l[i/2] >> 4(i%2)) & 15 | ((scales_h >> 2i) & 3) << 4
             x_j = d * (ls_i - 32) * KVALUES[nibble_j]
Nibble j < 16 of a 32-block is the low nibble of its qs[j], j >= 16 the high one of
qs[j - 16] (Q4 order).

Runtime tiles (lanes across rows, see base.TiledLinear): the nibbles exactly as Q4_0,
    q (nt, nb*16*R) u8,  d (nt, nd*R) u16 f16 bits (per 32 for NL, per 256 for XS),
    XS: sc (nt, nb*R) i8 = ls - 32 per 32 weights (8 bytes per 256 where the file has 6).
Decode: x is quantized to int8 per 32 (records.prep_q8_x, as llama.cpp's q8 activations), and
each weight costs a lookup in the 16-entry table KVALUES * xq_j of its x value and an add.
Numba has no vector table lookup (an indexed load becomes a gather, far slower), so
`kv_dot_acc` writes the inner step in target-independent LLVM IR, which LLVM lowers to a
variable permute (one vpermw per vector with AVX-512BW; pshufb sequences with AVX2, where
it is slower: "IQ4 table lookup", bench/results/design_measurements.json).
"""
from __future__ import annotations

import numpy as np
from gguf.constants import LlamaFileType
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..kernels.fp import f16_to_f32, get_f16, nearest_int, put_f16
from .base import (
    TiledLinear,
    WeightFormat,
    block_sizes,
    release_pages,
    repack_bytes,
    repack_halves,
)
from ..kernels.simd import ir_ptr, splat
from .records import prep_q8_x

f32 = np.float32
NL_BYTES = block_sizes("IQ4_NL")[1]          # bytes per block of 32
QK_XS, XS_BYTES = block_sizes("IQ4_XS")     # weights and bytes per super-block
KVALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                   np.int8)
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


# --- decode: a 16-entry table lookup per weight --------------------------------------------
# Numba cannot express a vector table lookup, so the two intrinsics below are LLVM IR
# without target intrinsics: per vector of lanes, a vector built from
# `extractelement(table, index)`, which LLVM's backends lower to a variable permute.

def _ir_nibbles(builder, p, n):
    # the n bytes at p (i8*) -> their low and high nibbles as two <n x i16>
    nv = ir.VectorType(ir.IntType(16), n)
    v = builder.zext(builder.load(builder.bitcast(p, ir.VectorType(ir.IntType(8), n).as_pointer()),
                                  align=1), nv)
    return builder.and_(v, ir.Constant(nv, [15] * n)), builder.lshr(v, ir.Constant(nv, [4] * n))


def _ir_lookup(builder, table, idx):
    # <n x i16>: table[idx[k]] per lane k, table <16 x i16>, idx <n x i16> in [0, 16)
    res = ir.Constant(idx.type, None)
    for k in range(idx.type.count):
        kk = ir.Constant(ir.IntType(32), k)
        res = builder.insert_element(
            res, builder.extract_element(table, builder.extract_element(idx, kk)), kk)
    return res


_KV_IR = ir.Constant(ir.VectorType(ir.IntType(16), 16), [int(v) for v in KVALUES])


@intrinsic(prefer_literal=True)
def kv_dot_acc(typingctx, xq, xo, src, so, stride, acc, nr, lanes, nbytes):
    """acc[:nr] (int32) += sum over i < nbytes of KVALUES[v & 15] xq[xo + i] +
    KVALUES[v >> 4] xq[xo + 16 + i], v = src[so + i stride:][:nr]: nbytes nibble bytes
    (j = xo % 32, j+1, ..) of one block, lanes across nr rows; xq int16 in [-127, 127];
    lanes (the vector width, dividing nr) and nbytes constants.

    The tables KVALUES * xq (one <16 x i16> per weight) are made once per call. A pair of
    table values fits int16 (127 * 127 * 2 = 32258); it is widened to int32 before the next
    pair is added."""
    if not isinstance(lanes, types.IntegerLiteral) or not isinstance(nbytes, types.IntegerLiteral):
        return None
    n = lanes.literal_value
    m = nbytes.literal_value

    def codegen(context, builder, sig, args):
        i16, i32 = ir.IntType(16), ir.IntType(32)
        wide = ir.VectorType(i32, n)
        k64 = lambda v: ir.Constant(args[1].type, v)
        ptr = lambda k, off, ty: ir_ptr(context, builder, sig.args[k], args[k], off, ty)

        def table(off):
            return builder.mul(_KV_IR, splat(builder, builder.load(ptr(0, off, i16)), 16))

        tabs = [(table(builder.add(args[1], k64(i))), table(builder.add(args[1], k64(16 + i))))
                for i in range(m)]
        with cgutils.for_range(builder, builder.udiv(args[6], k64(n))) as loop:
            r0 = builder.mul(loop.index, k64(n))
            a = ptr(5, r0, wide)
            total = builder.load(a, align=4)
            for i, (t_lo, t_hi) in enumerate(tabs):
                so = builder.add(builder.add(args[3], builder.mul(args[4], k64(i))), r0)
                lo, hi = _ir_nibbles(builder, ptr(2, so, ir.IntType(8)), n)
                pair = builder.add(_ir_lookup(builder, t_lo, lo), _ir_lookup(builder, t_hi, hi))
                total = builder.add(total, builder.sext(pair, wide))
            builder.store(total, a, align=4)
        return context.get_dummy_value()

    return types.void(xq, xo, src, so, stride, acc, nr, lanes, nbytes), codegen


@intrinsic(prefer_literal=True)
def kv_values(typingctx, src, so, lo, hi, nr, lanes):
    """lo[:nr], hi[:nr] (int16) = KVALUES[v & 15], KVALUES[v >> 4] for the nibble bytes
    v = src[so:so+nr]; lanes (the vector width, dividing nr) a constant."""
    if not isinstance(lanes, types.IntegerLiteral):
        return None
    n = lanes.literal_value

    def codegen(context, builder, sig, args):
        nv = ir.VectorType(ir.IntType(16), n)
        k64 = lambda v: ir.Constant(args[1].type, v)
        ptr = lambda k, off, ty: ir_ptr(context, builder, sig.args[k], args[k], off, ty)
        with cgutils.for_range(builder, builder.udiv(args[4], k64(n))) as loop:
            r0 = builder.mul(loop.index, k64(n))
            v_lo, v_hi = _ir_nibbles(builder, ptr(0, builder.add(args[1], r0), ir.IntType(8)), n)
            builder.store(_ir_lookup(builder, _KV_IR, v_lo), ptr(2, r0, nv), align=2)
            builder.store(_ir_lookup(builder, _KV_IR, v_hi), ptr(3, r0, nv), align=2)
        return context.get_dummy_value()

    return types.void(src, so, lo, hi, nr, lanes), codegen


@njit(cache=True)
def prep_iq4_x(x, x8, xd, xs8, xsum, xq):
    # x (n,) f32 -> prep_q8_x's int8 x per block of 32 (scale xd), widened to xq (n,)
    # int16 for the table products
    prep_q8_x(x, x8, xd, xs8, xsum)
    for i in range(x8.size):
        xq[i] = x8[i]


@njit(cache=True, inline="always")
def iq4_block(qt, o, xq, b, a32, R):
    # a32 (R,) int32 += sum over the 16 nibble bytes of block b at qt[o:o+16R] (lanes
    # across rows) of KVALUES[nibble] xq: two passes of 8 bytes (16 tables; 4 bytes a
    # pass was slower, 16 spill registers)
    for j in range(0, 16, 8):
        if R % 32 == 0:
            kv_dot_acc(xq, 32 * b + j, qt, o + j * R, R, a32, R, 32, 8)
        else:
            kv_dot_acc(xq, 32 * b + j, qt, o + j * R, R, a32, R, 16, 8)


@njit(cache=True, fastmath=True, parallel=True)
def matvec_iq4_nl(q, d, xq, xd, out, scratch, s32):
    # W (nt*R, n) IQ4_NL tiles q (nt, nb*16*R), d (nt, nb*R) @ x (prep_iq4_x) -> out (d,)
    # scratch (nt, R) f32, s32 (nt, R) int32: per-tile sums
    nt = q.shape[0]
    R = scratch.shape[1]
    for t in prange(nt):
        qt = q[t]
        acc = scratch[t]
        a32 = s32[t]
        acc[:] = 0
        a32[:] = 0
        for b in range(xd.size):
            iq4_block(qt, 16 * b * R, xq, b, a32, R)
            db = d[t, b * R:(b + 1) * R]
            dx = xd[b]
            for r in range(R):
                acc[r] += f16_to_f32(db[r]) * dx * f32(a32[r])
                a32[r] = 0
        n = min(R, out.size - t * R)
        out[t * R:t * R + n] = acc[:n]


@njit(cache=True, fastmath=True, parallel=True)
def matvec_iq4_xs(q, d, sc, xq, xd, out, scratch, s32):
    # W (nt*R, n) IQ4_XS tiles q (nt, nb*16*R), d (nt, nb/8*R), sc (nt, nb*R) i8
    # @ x (prep_iq4_x) -> out (d,); nb = n / 32, scratch / s32 (nt, R) as matvec_iq4_nl
    nt = q.shape[0]
    R = scratch.shape[1]
    for t in prange(nt):
        qt = q[t]
        acc = scratch[t]
        a32 = s32[t]
        acc[:] = 0
        a32[:] = 0
        for b in range(xd.size):
            iq4_block(qt, 16 * b * R, xq, b, a32, R)
            db = d[t, (b // 8) * R:(b // 8 + 1) * R]
            sb = sc[t, b * R:(b + 1) * R]
            dx = xd[b]
            for r in range(R):
                acc[r] += f16_to_f32(db[r]) * f32(sb[r]) * dx * f32(a32[r])
                a32[r] = 0
        n = min(R, out.size - t * R)
        out[t * R:t * R + n] = acc[:n]


# --- prefill and embedding: dequantize from tiles (serial: see base.TiledLinear._dequant_tiles)

@njit(cache=True)
def dequant_iq4_tiles(q, d, sc, per_d, t0, t1, wt):
    # IQ4 tiles t0..t1 -> wt (n, (t1-t0)*R) f32 = W[rows].T, gguf's values exactly:
    # block b's scale is d[b // per_d] (times sc[b] if sc has a row, IQ4_XS)
    nb = wt.shape[0] // 32
    R = q.shape[1] // (16 * nb)
    dsc = np.empty(R, f32)
    vlo = np.empty(R, np.int16)
    vhi = np.empty(R, np.int16)
    for b in range(nb):
        for t in range(t0, t1):
            for r in range(R):
                dsc[r] = f16_to_f32(d[t, (b // per_d) * R + r])
                if sc.shape[0]:
                    dsc[r] *= f32(sc[t, b * R + r])
            c = (t - t0) * R
            for j in range(16):
                if R % 32 == 0:
                    kv_values(q[t], (16 * b + j) * R, vlo, vhi, R, 32)
                else:
                    kv_values(q[t], (16 * b + j) * R, vlo, vhi, R, 16)
                lo = wt[32 * b + j, c:c + R]
                hi = wt[32 * b + 16 + j, c:c + R]
                for r in range(R):
                    lo[r] = dsc[r] * f32(vlo[r])
                    hi[r] = dsc[r] * f32(vhi[r])


@njit(cache=True)
def rows_iq4(q, d, sc, per_d, ids, out):
    # IQ4 tiles, ids (T,) -> out (T, n) f32 dequantized rows (values as dequant_iq4_tiles)
    nb = out.shape[1] // 32
    R = q.shape[1] // (16 * nb)
    for i in range(ids.size):
        t = ids[i] // R
        r = ids[i] % R
        row = out[i]
        for b in range(nb):
            dd = f16_to_f32(d[t, (b // per_d) * R + r])
            if sc.shape[0]:
                dd *= f32(sc[t, b * R + r])
            for j in range(16):
                v = q[t, (16 * b + j) * R + r]
                row[32 * b + j] = dd * _KVF[v & 15]
                row[32 * b + 16 + j] = dd * _KVF[v >> 4]


@njit(cache=True, parallel=True)
def repack_xs_scales(raw, row0, dst):
    # ls - 32 of every sub-block of raw (rows, nb*136) u8 IQ4_XS -> rows row0.. of
    # dst (nt, nb*8*R) i8 (lanes across rows)
    rows = raw.shape[0]
    nb = raw.shape[1] // XS_BYTES
    R = dst.shape[1] // (nb * 8)
    for t in prange(row0 // R, (row0 + rows - 1) // R + 1):
        r0 = max(0, row0 - t * R)
        r1 = min(R, row0 + rows - t * R)
        for b in range(nb):
            for i in range(8):
                lane = dst[t, (8 * b + i) * R + r0:(8 * b + i) * R + r1]
                for r in range(r1 - r0):
                    lane[r] = xs_scale(raw[t * R + r0 - row0 + r], XS_BYTES * b, i)


class IQ4Linear(TiledLinear):
    """IQ4_NL / IQ4_XS in row tiles: q (nt, nb*16*R) u8 nibbles, d (nt, nd*R) u16,
    IQ4_XS sc (nt, nb*R) i8 (nb = in_features / 32)."""

    def _setup(self, fmt, splits, in_features):
        super()._setup(fmt, splits, in_features)
        self.per_d = 8 if self.type_name == "IQ4_XS" else 1   # 32-blocks per f16 scale

    def tile_spec(self):
        nb, nt, R = self.in_features // 32, self.nt, self.R
        return {"q": ((nt, nb * 16 * R), np.uint8), "d": ((nt, nb // self.per_d * R), np.uint16),
                "sc": ((nt, nb * R) if self.per_d > 1 else (0, 0), np.int8)}

    def _load(self, raws):
        bs = self.fmt.type_size
        xs = self.per_d > 1
        self._alloc_tiles()
        row0 = 0
        for raw in raws:
            repack_halves(raw, row0, bs, 0, self.d)
            repack_bytes(raw, row0, bs, bs - 16 * self.per_d, bs, self.q)
            if xs:
                repack_xs_scales(raw, row0, self.sc)
            release_pages(raw)
            row0 += raw.shape[0]

    def decode_buffers(self):
        # per-tile sums (nt, R) f32 and i32; prep_iq4_x's x8, xd, xs8, xsum, xq
        n, nb, nt, R = self.in_features, self.in_features // 32, self.nt, self.R
        return (np.zeros((nt, R), f32), np.zeros((nt, R), np.int32), np.zeros(n, np.int8),
                np.zeros(nb, f32), np.zeros(nb, np.int32), np.zeros(nb, f32),
                np.zeros(n, np.int16))

    def matvec(self, x, out, scratch=None):
        acc, s32, x8, xd, xs8, xsum, xq = self._buffers(scratch)
        prep_iq4_x(x, x8, xd, xs8, xsum, xq)
        if self.per_d == 1:
            matvec_iq4_nl(self.q, self.d, xq, xd, out, acc, s32)
        else:
            matvec_iq4_xs(self.q, self.d, self.sc, xq, xd, out, acc, s32)

    def _dequant_tiles(self, t0, t1, wt):
        dequant_iq4_tiles(self.q, self.d, self.sc, self.per_d, t0, t1, wt)

    def _rows(self, ids, out):
        rows_iq4(self.q, self.d, self.sc, self.per_d, ids, out)


IQ4_NL = WeightFormat("IQ4_NL", "d:f16, qs:u8[16]; x=d*KVALUES[nibble]", IQ4Linear,
                      dequantize_iq4_nl, quantize_iq4_nl, LlamaFileType.MOSTLY_IQ4_NL)
IQ4_XS = WeightFormat("IQ4_XS", "d:f16, scales_h:u16, scales_l:u8[4], qs:u8[128]; "
                      "x=d*(ls-32)*KVALUES[nibble], ls 6 bits per 32", IQ4Linear,
                      dequantize_iq4_xs, quantize_iq4_xs, LlamaFileType.MOSTLY_IQ4_XS)
