"""Numba kernels of the forward pass other than the linear layers (see linear.py).

Conventions: T tokens in a batch, E model dim, H query heads, KV key/value heads,
hd head dim, g = H // KV query heads per KV head, F ffn dim. Every kernel writes
into an output array; nothing here allocates per token. The KV cache holds IEEE
half floats; Numba has no float16 type, so kernels see the raw uint16 bits.
"""
from __future__ import annotations

import numba as nb
import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .fp import f16_to_f32
from .simd import call_llvm, ir_ptr, splat

F32 = np.float32
_TILE = 1024        # positions per chunk of the plain loops (each token's last n % 16
                    # positions, or group sizes over 8): a converted K/V row chunk in L1
_TB = 4             # query tokens per work item of prefill attention: they share every
                    # K/V chunk while it is in L2
_CHUNK = 256        # positions per K or V chunk of the register kernels (64 KiB of f16
                    # at head_dim 128)
_MIN_LOGIT = F32(-30.0)   # softmax weights below e^-30 of the max count as zero


@nb.njit(cache=True, error_model="numpy", fastmath=True)
def rmsnorm(x, w, eps, out):
    # x (T, E), w (E,) -> out (T, E) = x / sqrt(mean(x²) + eps) * w
    T, E = x.shape
    for t in range(T):
        ss = F32(0.0)
        for i in range(E):
            ss += x[t, i] * x[t, i]
        inv = F32(1.0) / np.sqrt(ss / F32(E) + F32(eps))
        for i in range(E):
            out[t, i] = x[t, i] * inv * w[i]


@nb.njit(cache=True, error_model="numpy", fastmath=True)
def rope(x, cos, sin):
    # x (T, nh, hd) in place; cos, sin (T, hd/2). Rotates adjacent pairs (2i, 2i+1),
    # the GGUF llama layout (the converter permuted HF's rotate-half rows into it).
    T, nh, hd = x.shape
    for t in range(T):
        for h in range(nh):
            for i in range(hd // 2):
                a, b = x[t, h, 2 * i], x[t, h, 2 * i + 1]
                c, s = cos[t, i], sin[t, i]
                x[t, h, 2 * i] = a * c - b * s
                x[t, h, 2 * i + 1] = a * s + b * c




@intrinsic
def _bits_as_f32(typingctx, bits):
    # int32 bit pattern -> the f32 with those bits (a register move, vectorises)
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


@nb.njit(cache=True, error_model="numpy", fastmath=True, inline="always")
def _exp_neg(x):
    # e^x for x <= 0 to ~1e-7 relative, branch-free so softmax loops vectorise (Numba
    # has no vector math library: np.exp would be one libm call per element).
    # e^x = 2^k · e^y with k = round(x·log2 e), y = x - k·ln 2 in [-0.35, 0.35];
    # e^y by its Taylor series to y^7 (truncation < 5e-9).
    x = max(x, F32(-87.0))
    k = np.rint(x * F32(1.4426950408889634))
    y = x - k * F32(0.6931471805599453)
    p = F32(1.0 / 5040)
    p = p * y + F32(1.0 / 720)
    p = p * y + F32(1.0 / 120)
    p = p * y + F32(1.0 / 24)
    p = p * y + F32(1.0 / 6)
    p = p * y + F32(0.5)
    p = p * y + F32(1.0)
    p = p * y + F32(1.0)
    return p * _bits_as_f32((np.int32(k) + np.int32(127)) << np.int32(23))


@nb.njit(cache=True, error_model="numpy", fastmath=True)
def swiglu(gate_up, out):
    # gate_up (T, 2F) = [gate | up] -> out (T, F) = silu(gate) * up, silu(g) = g sigmoid(g)
    # with sigmoid(g) = 1 / (1 + e) for g >= 0, e / (1 + e) below, e = e^-|g| <= 1:
    # _exp_neg's range, and SIMD (np.exp is a libm call per element: 4% of a 1B prefill).
    # One C-contiguous array, not two column slices of it: Numba vectorises only loops
    # over arrays it knows are contiguous (the slices took 12% of a 1B prefill).
    T, F = out.shape
    for t in range(T):
        for i in range(F):
            g = gate_up[t, i]
            e = _exp_neg(-abs(g))
            sig = (F32(1.0) if g >= F32(0.0) else e) / (F32(1.0) + e)
            out[t, i] = g * sig * gate_up[t, F + i]


def _f16x16(builder, p):
    # <16 x float>: the 16 IEEE halves at p (an i16 vector pointer), widened
    v = builder.load(p, align=2)
    return builder.fpext(builder.bitcast(v, ir.VectorType(ir.HalfType(), 16)),
                         ir.VectorType(ir.FloatType(), 16))


def _fma(builder, a, b, c):
    # a * b + c, <16 x float>, one fused multiply-add
    return call_llvm(builder, "llvm.fma.v16f32", a.type, [a, b, c])


def _unroll(G):
    # 16-position blocks per pass of _scores16: each accumulator is one chain of dependent
    # FMAs, and 2 FMA units of 4 cycles' latency need 8 chains in flight; at most 16
    # accumulators. (3B, g = 3, depth 4096: one block per pass ran at about half speed.)
    return max(1, min(4, -(-8 // G)))


@intrinsic(prefer_literal=True)
def _scores16(typingctx, kt, koff, stride, qs, hd, s, soff, sstride, nblk, g):
    """s[soff + j sstride + p] = sum_i qs[j hd + i] * K[i, p] for the nblk * 16 positions
    p from 0, K[i, p] the f16 bits kt[koff + i stride + p], j < g (a constant): each K
    vector is loaded and widened once for the g query heads, whose sums stay in
    registers over the whole head dimension, _unroll(g) blocks of 16 positions a pass."""
    if not isinstance(g, types.IntegerLiteral):
        return None
    G = g.literal_value
    U = _unroll(G)

    def codegen(context, builder, sig, args):
        koa, sta, hda, soa, ssa, nba = args[1], args[2], args[4], args[6], args[7], args[8]
        f32, i16 = ir.FloatType(), ir.IntType(16)
        v16 = ir.VectorType(f32, 16)
        k64 = lambda v: ir.Constant(koa.type, v)
        ptr = lambda k, off, ty: ir_ptr(context, builder, sig.args[k], args[k], off, ty)

        def passes(first, count, u):
            # `count` passes of u blocks each, from block `first`
            accs = [[cgutils.alloca_once(builder, v16) for _ in range(u)] for _ in range(G)]
            with cgutils.for_range(builder, count) as blk:
                p = builder.mul(builder.add(first, builder.mul(blk.index, k64(u))), k64(16))
                for row in accs:
                    for a in row:
                        builder.store(ir.Constant(v16, None), a)
                with cgutils.for_range(builder, hda) as it:
                    off = builder.add(builder.add(koa, builder.mul(it.index, sta)), p)
                    kf = [_f16x16(builder, ptr(0, builder.add(off, k64(16 * b)), ir.VectorType(i16, 16)))
                          for b in range(u)]
                    for j, row in enumerate(accs):
                        qj = builder.load(ptr(3, builder.add(builder.mul(k64(j), hda), it.index), f32))
                        qj = splat(builder, qj, 16)
                        for b, a in enumerate(row):
                            builder.store(_fma(builder, qj, kf[b], builder.load(a)), a)
                for j, row in enumerate(accs):
                    for b, a in enumerate(row):
                        o = builder.add(builder.add(soa, builder.mul(k64(j), ssa)), builder.add(p, k64(16 * b)))
                        builder.store(builder.load(a), ptr(5, o, v16), align=4)

        full = builder.udiv(nba, k64(U))
        passes(k64(0), full, U)
        if U > 1:
            done = builder.mul(full, k64(U))
            passes(done, builder.sub(nba, done), 1)     # the blocks left over
        return context.get_dummy_value()

    return types.void(kt, koff, stride, qs, hd, s, soff, sstride, nblk, g), codegen


@intrinsic(prefer_literal=True)
def _weighted16(typingctx, vt, voff, stride, i0, w, wstride, nblk, out, ooff, ostride, g):
    """out[ooff + j ostride + i0 + ii] += sum_p w[j wstride + p] * V[i0 + ii, p] for
    ii < 4, j < g (a constant), over the nblk * 16 positions p from 0, V[i, p] the f16
    bits vt[voff + i stride + p]: 4 V rows and g weight rows per step, 4 g sums in
    registers."""
    if not isinstance(g, types.IntegerLiteral):
        return None
    G = g.literal_value

    def codegen(context, builder, sig, args):
        vta, voa, sta, i0a, wa, wsa, nba, oa, ooa, osa = args[:10]
        f32, i16 = ir.FloatType(), ir.IntType(16)
        v16 = ir.VectorType(f32, 16)
        k64 = lambda v: ir.Constant(voa.type, v)
        ptr = lambda k, off, ty: ir_ptr(context, builder, sig.args[k], args[k], off, ty)
        accs = [[cgutils.alloca_once(builder, v16) for _ in range(4)] for _ in range(G)]
        for row in accs:
            for a in row:
                builder.store(ir.Constant(v16, None), a)
        with cgutils.for_range(builder, nba) as blk:
            p = builder.mul(blk.index, k64(16))
            vs = []
            for ii in range(4):
                off = builder.add(builder.add(voa, builder.mul(builder.add(i0a, k64(ii)), sta)), p)
                vs.append(_f16x16(builder, ptr(0, off, ir.VectorType(i16, 16))))
            for j in range(G):
                wj = builder.load(ptr(4, builder.add(builder.mul(k64(j), wsa), p), v16), align=4)
                for ii in range(4):
                    a = accs[j][ii]
                    builder.store(_fma(builder, wj, vs[ii], builder.load(a)), a)
        for j in range(G):
            for ii in range(4):
                o = builder.add(builder.add(ooa, builder.mul(k64(j), osa)), builder.add(i0a, k64(ii)))
                po = ptr(7, o, f32)
                tot = call_llvm(builder, "llvm.vector.reduce.fadd.v16f32", f32,
                                [ir.Constant(f32, 0.0), builder.load(accs[j][ii])])
                builder.store(builder.fadd(builder.load(po), tot), po)
        return context.get_dummy_value()

    return types.void(vt, voff, stride, i0, w, wstride, nblk, out, ooff, ostride, g), codegen


@nb.njit(cache=True, inline="always")
def _scores(kt, koff, stride, qs, hd, s, soff, sstride, nblk, g):
    # _scores16 with g as a constant, for the group sizes Llama models use (1..8; the
    # caller takes the plain loops for others)
    if g == 4:
        _scores16(kt, koff, stride, qs, hd, s, soff, sstride, nblk, 4)
    elif g == 3:
        _scores16(kt, koff, stride, qs, hd, s, soff, sstride, nblk, 3)
    elif g == 8:
        _scores16(kt, koff, stride, qs, hd, s, soff, sstride, nblk, 8)
    elif g == 2:
        _scores16(kt, koff, stride, qs, hd, s, soff, sstride, nblk, 2)
    elif g == 1:
        _scores16(kt, koff, stride, qs, hd, s, soff, sstride, nblk, 1)
    elif g == 6:
        _scores16(kt, koff, stride, qs, hd, s, soff, sstride, nblk, 6)
    elif g == 5:
        _scores16(kt, koff, stride, qs, hd, s, soff, sstride, nblk, 5)
    elif g == 7:
        _scores16(kt, koff, stride, qs, hd, s, soff, sstride, nblk, 7)


@nb.njit(cache=True, inline="always")
def _weighted(vt, voff, stride, i0, w, wstride, nblk, out, ooff, ostride, g):
    # _weighted16 with g as a constant (1..8, as _scores)
    if g == 4:
        _weighted16(vt, voff, stride, i0, w, wstride, nblk, out, ooff, ostride, 4)
    elif g == 3:
        _weighted16(vt, voff, stride, i0, w, wstride, nblk, out, ooff, ostride, 3)
    elif g == 8:
        _weighted16(vt, voff, stride, i0, w, wstride, nblk, out, ooff, ostride, 8)
    elif g == 2:
        _weighted16(vt, voff, stride, i0, w, wstride, nblk, out, ooff, ostride, 2)
    elif g == 1:
        _weighted16(vt, voff, stride, i0, w, wstride, nblk, out, ooff, ostride, 1)
    elif g == 6:
        _weighted16(vt, voff, stride, i0, w, wstride, nblk, out, ooff, ostride, 6)
    elif g == 5:
        _weighted16(vt, voff, stride, i0, w, wstride, nblk, out, ooff, ostride, 5)
    elif g == 7:
        _weighted16(vt, voff, stride, i0, w, wstride, nblk, out, ooff, ostride, 7)


@nb.njit(cache=True, error_model="numpy", fastmath=True, parallel=True)
def attention(q, kt_cache, vt_cache, pos0, scale, out, scratch):
    # q (T, H, hd) roped queries at positions pos0..pos0+T-1;
    # kt_cache, vt_cache (KV, hd, ctx): K and V of one layer transposed, f16 bits,
    # filled up to pos0+T. Positions are contiguous, so scores are multiply-adds over
    # positions and each output value is one long dot product over positions.
    # out (T, H, hd). Causal: token t sees positions 0..pos0+t.
    # scratch (threads, G·ctx + TILE + G + G·hd) f32 with G = TB·g, one row per thread.
    # GQA: the g query heads of a KV head share every K and V row converted; repeated
    # K/V is never materialised. A work item is one KV head and a block of up to TB
    # tokens (rows tt·g + j of its scratch): K and V are read a chunk at a time for all
    # of them, then from L2.
    T, H, hd = q.shape
    KV, _, ctx = kt_cache.shape
    g = H // KV
    G = _TB * g
    for item in prange(-(-T // _TB) * KV):
        t0, kvh = item // KV * _TB, item % KV
        nt = min(T, t0 + _TB) - t0
        buf = scratch[nb.get_thread_id()]
        s = buf[:G * ctx].reshape((G, ctx))
        row = buf[G * ctx:G * ctx + _TILE]    # one converted K or V row chunk
        tot_inv = buf[G * ctx + _TILE:G * ctx + _TILE + G]
        qs = buf[G * ctx + _TILE + G:G * ctx + _TILE + G + G * hd]
        kt, vt = kt_cache[kvh], vt_cache[kvh]
        kvo = kvh * hd * ctx
        for tt in range(nt):
            for j in range(g):
                for i in range(hd):
                    qs[(tt * g + j) * hd + i] = q[t0 + tt, kvh * g + j, i] * scale
        # scores s[tt g + j, p] = scale · q · k_p: 16 positions at a time in registers up
        # to each token's last full 16 (nfull(tt)), then its last positions. What a token
        # gets never depends on the other tokens of its block (nor on the batch size).
        reg = g <= 8 and hd % 4 == 0                  # the register kernels' shapes
        last = (pos0 + t0 + nt) // 16 * 16 if reg else 0
        for c0 in range(0, last, _CHUNK):
            for tt in range(nt):
                nblk = (min((pos0 + t0 + tt + 1) // 16 * 16, c0 + _CHUNK) - c0) // 16
                if nblk > 0:
                    _scores(kt_cache, kvo + c0, ctx, qs[tt * g * hd:], hd, buf,
                            tt * g * ctx + c0, ctx, nblk, g)
        for tt in range(nt):
            n = pos0 + t0 + tt + 1
            nfull = n // 16 * 16 if reg else 0
            for c0 in range(nfull, n, _TILE):
                m = min(n, c0 + _TILE) - c0
                for j in range(g):
                    s[tt * g + j, c0:c0 + m] = 0
                for i in range(hd):
                    ki = kt[i, c0:c0 + m]
                    for p in range(m):
                        row[p] = f16_to_f32(ki[p])
                    for j in range(g):
                        qi = qs[(tt * g + j) * hd + i]
                        sj = s[tt * g + j, c0:c0 + m]
                        for p in range(m):
                            sj[p] += qi * row[p]
            # softmax weights e^(s - max), unnormalised: out is divided by their sum at
            # the end. Weights below e^-30 (1e-13, far under f32 resolution next to the
            # max's 1) are zero: tiny weights would make subnormal products, ~100x slower
            # on x86.
            for j in range(g):
                sj = s[tt * g + j]
                mx = sj[0]
                for p in range(n):
                    mx = max(mx, sj[p])
                tot = F32(0.0)
                for p in range(n):
                    x = sj[p] - mx
                    e = _exp_neg(max(x, _MIN_LOGIT))
                    e = e if x > _MIN_LOGIT else F32(0.0)
                    sj[p] = e
                    tot += e
                out[t0 + tt, kvh * g + j] = 0
                tot_inv[tt * g + j] = F32(1.0) / tot
        # out[j, i] = Σ_p w[j, p] · v[i, p] / Σ_p w[j, p]: 16 positions and 4 rows of V at
        # a time in registers, then each token's last positions
        for c0 in range(0, last, _CHUNK):
            for tt in range(nt):
                nblk = (min((pos0 + t0 + tt + 1) // 16 * 16, c0 + _CHUNK) - c0) // 16
                if nblk > 0:
                    for i0 in range(0, hd, 4):
                        _weighted(vt_cache, kvo + c0, ctx, i0, buf[tt * g * ctx + c0:], ctx,
                                  nblk, out, ((t0 + tt) * H + kvh * g) * hd, hd, g)
        for tt in range(nt):
            n = pos0 + t0 + tt + 1
            for c0 in range(n // 16 * 16 if reg else 0, n, _TILE):
                m = min(n, c0 + _TILE) - c0
                for i in range(hd):
                    vi = vt[i, c0:c0 + m]
                    for p in range(m):
                        row[p] = f16_to_f32(vi[p])
                    for j in range(g):
                        sj = s[tt * g + j, c0:c0 + m]
                        d = F32(0.0)
                        for p in range(m):
                            d += sj[p] * row[p]
                        out[t0 + tt, kvh * g + j, i] += d
            for j in range(g):
                for i in range(hd):
                    out[t0 + tt, kvh * g + j, i] *= tot_inv[tt * g + j]


def attention_scratch(n_threads: int, n_heads: int, n_kv_heads: int, ctx: int,
                      head_dim: int) -> np.ndarray:
    G = _TB * (n_heads // n_kv_heads)
    return np.zeros((n_threads, G * ctx + _TILE + G + G * head_dim), F32)


@nb.njit(cache=True, error_model="numpy")
def add_inplace(x, y):
    # x (T, E) += y (T, E): the residual connection
    T, E = x.shape
    for t in range(T):
        for i in range(E):
            x[t, i] += y[t, i]
