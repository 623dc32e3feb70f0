"""Attention over the KV cache of every cache type, read where it lies (kv_cache.py).

One kernel, `attention`, for prefill and decode: an online softmax over chunks of _CHUNK
positions (flash attention's form), so its scratch is a few chunks' scores per thread
whatever the context. Per chunk: the scores of the work item's query rows, the running
max and sum updated (the output so far rescaled when the max grows), then the weighted
sum of V added to the output; at the end the output is divided by the sum.

K and V are read in their stored type, never copied out dequantized:
    f16   scores and weighted sums as f32 multiply-adds of widened halves (kernels.py's
          register kernels)
    q8_0  K: q quantized per block of 32 to int8 (as llama.cpp's q8_0 activations), the
    q4_0  score an exact int32 pair-dot per block (simd._dot: vpdpbusd on AVX-512 VNNI,
          vpmaddubsw + vpmaddwd on AVX2, plain IR elsewhere) times the two block scales;
          V: each block's 32 values widened to f32 in registers, times the block's
          scale (a chunk's scales widened beforehand), and multiply-added with each
          head's weight; a q8_0 V where the instruction set has a one-instruction int16
          pair dot (Isa.v_int16: vpdpwssd) as exact integer sums instead, each weight
          times its block's scale rounded to int16 per chunk, row and block (15 bits of
          the largest: _round_weights), two positions a dot (_weighted_i16).
The cache layouts (kv_cache.py): K in blocks of 16 positions (one vector lane per
position), for q8_0 each block's int8 as quads (4 dims of one position in a 32-bit lane,
byte 4g + i of position l of head-dim block b at 512 b + 64 g + 4 l + i), for q4_0 its
ggml nibble bytes as quads (256 b + 64 g + 4 l + i holds dims 32b + 4g + i, low nibble,
and 32b + 16 + 4g + i, high), the f16 scales (nB, hd/32, 16); V by position, q8_0 int8
rows (cap, hd), q4_0 ggml nibble bytes (cap, hd/2), scales (cap, hd/32).
"""
from __future__ import annotations

from typing import NamedTuple

import numba as nb
import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..formats.records import prep_q8_x
from .claim import take
from .fp import f16_to_f32, f32_to_f16, half_to_float_ir
from .items import Items, call_item, item_address
from .jit import njit, overload
from .rows import (_AVX512, _MIN_LOGIT, _VREGS, Rows, _exp_neg, _fma, _scores, _weighted, in_passes,
                   rows_ir)
from .simd import ISA, L2, Q8X, _dot, call_llvm, ir_ptr, prefetch_ir, splat
from .target import TARGET

F32 = np.float32
KV_BLOCK = 16        # positions per block of K (one vector lane each)
QBLOCK = 32          # values per quantized block (ggml's QK8_0, QK4_0)
_CHUNK = 256         # positions per chunk of the online softmax (K and V stay in L2)
_NO_MAX = F32(-1e30)  # the running max before the first chunk
_SPLIT_CHUNKS = 4    # chunks of positions a decoded token's work item covers at depth
_MAX_SPLITS = 32     # splits of a decoded token's positions at most (longer ones cover more)
KIND_Q8, KIND_Q4 = 0, 1
W16 = 32767          # a q8_0 V's weights times scales, rounded to int16, reach this at most
_PREFETCH_Q = 16384  # bytes ahead that the quantized kernels prefetch K and V, into L2
                     # (prefetcht1: L1's few fill buffers would cap the misses in flight);
                     # 4 KiB, or into L1, left q8_0's decode at depth 32768 waiting on
                     # memory (bench/bench_kv_attention.py --layers 8)
_TB = 16             # query tokens per work item of prefill: they share each K/V chunk
                     # while it is in L2, so at depth the cache is read from memory T/_TB times
_GMAX = 8             # query rows per call of a register kernel (1.._GMAX; more go in
                     # groups): one token's g heads, all in one call
# A token block's rows over a whole chunk go in groups of _BATCH_F16 (f16 K or V) or
# _BATCH_Q (quantized) rows a call: their sums stay in registers (a 16-float vector is 2 of
# AVX2's 16 ymm), beside a block's K words or V values for the quantized types; on AVX2,
# 512 tokens at depth 8192 were fastest with 3 (bench/results/design_measurements.json).
_BATCH_F16 = 8 if _AVX512 else 4
_BATCH_Q = 8 if _AVX512 else 3


def kv_capacity(ctx: int) -> int:
    """Positions the KV cache holds for a context of ctx: whole blocks of K."""
    return -(-ctx // KV_BLOCK) * KV_BLOCK


# -- register kernels of the quantized types ----------------------------------------------

class Run(NamedTuple):
    """The stretch of one KV head's cache a register kernel reads: its values (int8 or
    nibble bytes) from element off of `values`, and their block scales (f16 bits, or f32
    widened beforehand) from element soff of `scales`."""
    values: object
    off: int
    scales: object
    soff: int


@intrinsic(prefer_literal=True)
def _scores_q16(typingctx, k, q, qoff, s, hd, nblk, g, kind):
    """s.a[s.off + j s.stride + 16 p + l] = sum over head-dim blocks b of dk(p, b, l)
    q.xd[qoff/32 + j nbk + b] S(j, p, b, l), for the nblk blocks p of 16 positions (lanes
    l) of the Run k (values from byte k.off of k.values, the layout of the module
    docstring; scales, f16 bits (nB, nbk, 16), from k.soff of k.scales), j < g (a
    constant), nbk = hd/32, S the exact int32 dot of position l's int8 K values of block
    b with row j of q.x8 (int8 rows of hd, from qoff): for q4_0 (nibble - 8) as sum(nibble
    q) - 8 q.xs[j, b]. q a Q8X (x8, xd, xs; xsum unused), s Rows. Each K vector is loaded
    and unpacked once for the g query heads."""
    if not isinstance(g, types.IntegerLiteral) or not isinstance(kind, types.IntegerLiteral):
        return None
    G, KIND = g.literal_value, kind.literal_value

    def codegen(context, builder, sig, args):
        qoa, hda, nba = args[2], args[4], args[5]
        kty, qty = sig.args[0], sig.args[1]
        kva, koa, ksv, ksa = (builder.extract_value(args[0], i) for i in range(4))
        q8a, qda, qsa = (builder.extract_value(args[1], i) for i in range(3))
        sty, sa, soa, ssa = rows_ir(builder, sig, args, 3)
        arrays = {"k": (kty.types[0], kva), "ks": (kty.types[2], ksv), "q8": (qty.types[0], q8a),
                  "qd": (qty.types[1], qda), "qs8": (qty.types[2], qsa), "s": (sty, sa)}
        i32, f32 = ir.IntType(32), ir.FloatType()
        v16, w16 = ir.VectorType(f32, 16), ir.VectorType(i32, 16)
        k64 = lambda v: ir.Constant(koa.type, v)
        ptr = lambda name, off, ty: ir_ptr(context, builder, *arrays[name], off, ty)
        nbk = builder.udiv(hda, k64(QBLOCK))
        bbytes = 512 if KIND == KIND_Q8 else 256          # K bytes per head-dim block
        pbytes = builder.mul(nbk, k64(bbytes))            # per block of 16 positions
        accs = [cgutils.alloca_once(builder, v16) for _ in range(G)]
        with cgutils.for_range(builder, nba) as pb:
            kbase = builder.add(koa, builder.mul(pb.index, pbytes))
            sbase = builder.add(ksa, builder.mul(pb.index, builder.mul(nbk, k64(16))))
            for a in accs:
                builder.store(ir.Constant(v16, None), a)
            with cgutils.for_range(builder, nbk) as blk:
                b = blk.index
                at = builder.add(kbase, builder.mul(b, k64(bbytes)))
                for line in range(0, bbytes, 64):
                    prefetch_ir(context, builder, *arrays["k"], builder.add(at, k64(_PREFETCH_Q + line)), L2)
                dk = half_to_float_ir(builder, builder.load(
                    ptr("ks", builder.add(sbase, builder.mul(b, k64(16))),
                        ir.VectorType(ir.IntType(16), 16)), align=2))
                words = [builder.load(ptr("k", builder.add(at, k64(64 * gq)), w16), align=1)
                         for gq in range(bbytes // 64)]
                if KIND == KIND_Q4:
                    m = ir.Constant(w16, [0x0F0F0F0F] * 16)
                    lo = [builder.and_(w, m) for w in words]
                    hi = [builder.and_(builder.lshr(w, ir.Constant(w16, [4] * 16)), m) for w in words]
                for j, a in enumerate(accs):
                    qrow = builder.add(qoa, builder.mul(k64(j), hda))
                    qb = builder.add(qrow, builder.mul(b, k64(QBLOCK)))
                    x = lambda e: builder.load(ptr("q8", builder.add(qb, k64(e)), i32), align=1)
                    if KIND == KIND_Q8:
                        isum = _dot(builder, ISA, 16, [(w, x(4 * gq)) for gq, w in enumerate(words)],
                                    True)
                    else:
                        pairs = [(lo[gq], x(4 * gq)) for gq in range(4)] + \
                                [(hi[gq], x(16 + 4 * gq)) for gq in range(4)]
                        isum = _dot(builder, ISA, 16, pairs, False)
                    qi = builder.add(builder.udiv(qoa, k64(QBLOCK)), builder.add(builder.mul(k64(j), nbk), b))
                    if KIND == KIND_Q4:
                        s8 = builder.load(ptr("qs8", qi, i32))
                        isum = builder.sub(isum, splat(builder, builder.shl(s8, ir.Constant(i32, 3)), 16))
                    scale = builder.fmul(dk, splat(builder, builder.load(ptr("qd", qi, f32)), 16))
                    builder.store(_fma(builder, builder.sitofp(isum, v16), scale, builder.load(a)), a)
            for j, a in enumerate(accs):
                o = builder.add(builder.add(soa, builder.mul(k64(j), ssa)), builder.mul(pb.index, k64(16)))
                builder.store(builder.load(a), ptr("s", o, v16), align=4)
        return context.get_dummy_value()

    return types.void(k, q, qoff, s, hd, nblk, g, kind), codegen


def _vblocks(g):
    # head-dim blocks of 32 columns (2 vectors) per pass of _weighted_q16: 2 g sums and 2
    # values per block in registers; two blocks give AVX-512 12 sums for g = 3, enough
    # independent FMA chains to keep both FMA units busy
    return max(1, min(2, _VREGS // (2 * (g + 1))))


@intrinsic(prefer_literal=True)
def _weighted_q16(typingctx, v, w, out, hd, n, g, kind):
    """out.a[out.off + j out.stride + c] += sum_p w.a[w.off + j w.stride + p] dv(p, c/32)
    V(p, c) for c < hd, j < g (a constant), over the n positions p of the Run v (values
    from byte v.off of v.values, q8_0: int8 rows of hd, q4_0: ggml nibble rows of hd/2;
    dv(p, b) = v.scales[v.soff + p hd/32 + b], f32, the block scales widened
    beforehand); w and out Rows: _vblocks(g) head-dim blocks of 32 columns a pass over
    the positions, their 2 g vector sums per block in registers. Each position's block
    is widened to f32 and scaled once, dv V, for the g heads (one multiply by a
    broadcast load), whose weights are broadcast loads into the FMAs."""
    if not isinstance(g, types.IntegerLiteral) or not isinstance(kind, types.IntegerLiteral):
        return None
    G, KIND = g.literal_value, kind.literal_value
    BP = _vblocks(G)

    def codegen(context, builder, sig, args):
        hda, na = args[3], args[4]
        vty = sig.args[0]
        vva, voa, dvv, dva = (builder.extract_value(args[0], i) for i in range(4))
        wty, wa, woa, wsa = rows_ir(builder, sig, args, 1)
        oty, oa, ooa, osa = rows_ir(builder, sig, args, 2)
        arrays = {"v": (vty.types[0], vva), "dv": (vty.types[2], dvv), "w": (wty, wa), "out": (oty, oa)}
        i8, f32 = ir.IntType(8), ir.FloatType()
        v16, b16, w16 = ir.VectorType(f32, 16), ir.VectorType(i8, 16), ir.VectorType(ir.IntType(32), 16)
        k64 = lambda v: ir.Constant(voa.type, v)
        ptr = lambda name, off, ty: ir_ptr(context, builder, *arrays[name], off, ty)
        nbk = builder.udiv(hda, k64(QBLOCK))
        rbytes = hda if KIND == KIND_Q8 else builder.udiv(hda, k64(2))
        bbytes = 32 if KIND == KIND_Q8 else 16

        def passes(first, count, bp):
            # `count` passes of bp blocks each, from block `first`
            accs = [[cgutils.alloca_once(builder, v16) for _ in range(2 * bp)] for _ in range(G)]
            with cgutils.for_range(builder, count) as grp:
                b0 = builder.add(first, builder.mul(grp.index, k64(bp)))
                outs = [[ptr("out", builder.add(builder.add(ooa, builder.mul(k64(j), osa)),
                                            builder.add(builder.mul(b0, k64(QBLOCK)), k64(16 * h))),
                             v16) for h in range(2 * bp)] for j in range(G)]
                for j in range(G):
                    for h in range(2 * bp):
                        builder.store(builder.load(outs[j][h], align=4), accs[j][h])
                with cgutils.for_range(builder, na) as pos:
                    row = builder.add(builder.add(voa, builder.mul(pos.index, rbytes)),
                                      builder.mul(b0, k64(bbytes)))
                    prefetch_ir(context, builder, *arrays["v"], builder.add(row, k64(_PREFETCH_Q)), L2)
                    dvp = builder.add(dva, builder.add(builder.mul(pos.index, nbk), b0))
                    vals = []
                    for bi in range(bp):
                        at = builder.add(row, k64(bi * bbytes))
                        if KIND == KIND_Q8:
                            ints = [builder.sext(builder.load(ptr("v", builder.add(at, k64(16 * h)), b16),
                                                              align=1), w16) for h in range(2)]
                        else:
                            raw = builder.zext(builder.load(ptr("v", at, b16), align=1), w16)
                            eight = ir.Constant(w16, [8] * 16)
                            ints = [builder.sub(builder.and_(raw, ir.Constant(w16, [15] * 16)), eight),
                                    builder.sub(builder.lshr(raw, ir.Constant(w16, [4] * 16)), eight)]
                        dv = splat(builder, builder.load(ptr("dv", builder.add(dvp, k64(bi)), f32)), 16)
                        vals += [builder.fmul(builder.sitofp(x, v16), dv) for x in ints]
                    for j in range(G):
                        wj = builder.add(builder.add(woa, builder.mul(k64(j), wsa)), pos.index)
                        wj = splat(builder, builder.load(ptr("w", wj, f32)), 16)
                        for h, a in enumerate(accs[j]):
                            builder.store(_fma(builder, wj, vals[h], builder.load(a)), a)
                for j in range(G):
                    for h in range(2 * bp):
                        builder.store(builder.load(accs[j][h]), outs[j][h], align=4)

        in_passes(builder, nbk, BP, passes)
        return context.get_dummy_value()

    return types.void(v, w, out, hd, n, g, kind), codegen


def _i16_blocks(g):
    # head-dim blocks of 32 columns a pass of _weighted_i16 takes: 2 g int32 sums a block in
    # registers, and 2 vectors of V's widened words
    return max(1, min(4, (_VREGS - 2) // (2 * g)))


def _lo_hi(t):
    # the head-dim column (of a block's 32) of int32 lane d of the low (t = 0) or high (t =
    # 1) interleave of two positions' words: punpcklwd / punpckhwd, per 128-bit lane
    return [8 * (d // 4) + 4 * t + d % 4 for d in range(16)]


@intrinsic(prefer_literal=True)
def _weighted_i16(typingctx, v, wq, winv, out, hd, n, g):
    """out.a[out.off + j out.stride + c] += f32(sum_p wq[(j nbk + b) _CHUNK + p] V(p, c))
    winv[j nbk + b] for c < hd (b = c/32, nbk = hd/32), j < g (a constant), over the n
    positions p of the Run v (int8 rows of hd from byte v.off of v.values; its scales
    unused: _round_weights put them in the weights), n rounded up to even (wq's entry
    past an odd n is 0). Two positions' int16 values interleave into int32 lanes (one
    punpck{l,h}wd each way), which take the two positions' weights, an int32 broadcast,
    as one word-pair dot (Isa.word_dot: vpdpwssd on AVX-512 VNNI); _i16_blocks(g) blocks
    a pass over the positions, their 2 g int32 sums a block in registers. The sums are
    exact: n W16 128 < 2^31."""
    if not isinstance(g, types.IntegerLiteral):
        return None
    G = g.literal_value
    BP = _i16_blocks(G)
    word_dot = TARGET.word_dot

    def codegen(context, builder, sig, args):
        hda, na = args[4], args[5]
        vty = sig.args[0]
        vva, voa = (builder.extract_value(args[0], i) for i in range(2))
        oty, oa, ooa, osa = rows_ir(builder, sig, args, 3)
        arrays = {"v": (vty.types[0], vva), "wq": (sig.args[1], args[1]),
                  "winv": (sig.args[2], args[2]), "out": (oty, oa)}
        i8, i16, i32, f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
        v16, w16 = ir.VectorType(f32, 16), ir.VectorType(i32, 16)
        k64 = lambda v: ir.Constant(voa.type, v)
        ptr = lambda name, off, ty: ir_ptr(context, builder, *arrays[name], off, ty)
        nbk = builder.udiv(hda, k64(QBLOCK))
        npairs = builder.udiv(builder.add(na, k64(1)), k64(2))
        lanes = ir.VectorType(i32, 32)
        mix = [ir.Constant(lanes, [x for c in _lo_hi(t) for x in (c, c + 32)]) for t in (0, 1)]
        order = [_lo_hi(0).index(c) if c in _lo_hi(0) else 16 + _lo_hi(1).index(c) for c in range(32)]

        def passes(first, count, bp):
            # `count` passes of bp blocks each, from block `first`
            accs = [[cgutils.alloca_once(builder, w16) for _ in range(2 * bp)] for _ in range(G)]
            with cgutils.for_range(builder, count) as grp:
                b0 = builder.add(first, builder.mul(grp.index, k64(bp)))
                for row in accs:
                    for a in row:
                        builder.store(ir.Constant(w16, None), a)
                with cgutils.for_range(builder, npairs) as pair:
                    p = builder.mul(pair.index, k64(2))
                    rows = [builder.add(builder.add(voa, builder.mul(builder.add(p, k64(t)), hda)),
                                        builder.mul(b0, k64(QBLOCK))) for t in (0, 1)]
                    for r in rows:
                        for line in range(0, 32 * bp, 64):
                            prefetch_ir(context, builder, *arrays["v"],
                                        builder.add(r, k64(_PREFETCH_Q + line)), L2)
                    for bi in range(bp):
                        words = [builder.sext(builder.load(ptr("v", builder.add(r, k64(32 * bi)),
                                                               ir.VectorType(i8, 32)), align=1),
                                              ir.VectorType(i16, 32)) for r in rows]
                        vals = [builder.bitcast(builder.shuffle_vector(words[0], words[1], m), w16)
                                for m in mix]
                        b = builder.add(b0, k64(bi))
                        for j in range(G):
                            row_jb = builder.add(builder.mul(k64(j), nbk), b)
                            wo = builder.add(builder.mul(row_jb, k64(_CHUNK)), p)
                            wp = splat(builder, builder.load(ptr("wq", wo, i32), align=4), 16)
                            for t in (0, 1):
                                a = accs[j][2 * bi + t]
                                builder.store(word_dot(builder, builder.load(a), vals[t], wp), a)
                # the block's 32 columns in order from the two interleaves, scaled, added
                for j in range(G):
                    for bi in range(bp):
                        b = builder.add(b0, k64(bi))
                        sc = builder.load(ptr("winv", builder.add(builder.mul(k64(j), nbk), b), f32))
                        sc = splat(builder, sc, 16)
                        lo, hi = (builder.load(accs[j][2 * bi + t]) for t in (0, 1))
                        for h in (0, 16):
                            cols = builder.shuffle_vector(lo, hi, ir.Constant(w16, order[h:h + 16]))
                            o = ptr("out", builder.add(builder.add(ooa, builder.mul(k64(j), osa)),
                                                       builder.add(builder.mul(b, k64(QBLOCK)), k64(h))), v16)
                            add = builder.fmul(builder.sitofp(cols, v16), sc)
                            builder.store(builder.fadd(builder.load(o, align=4), add), o, align=4)

        in_passes(builder, nbk, BP, passes)
        return context.get_dummy_value()

    return types.void(v, wq, winv, out, hd, n, g), codegen


@njit(cache=True, error_model="numpy", fastmath={"nnan", "ninf", "nsz"})
def _scale_v_blocks(dvt, n, nbk, mx):
    # dvt (nbk, _CHUNK): a chunk's n V scales by block -> mx[b] = max_p dv(p, b) and the
    # row scaled in place to t(p, b) = dv(p, b) (W16 / mx[b]) (0 where mx[b] = 0)
    for b in range(nbk):
        m = max(_max_of(dvt, b * _CHUNK, n), F32(0.0))
        mx[b] = m
        s = F32(W16) / m if m > F32(0.0) else F32(0.0)
        for p in range(n):
            dvt[b * _CHUNK + p] *= s


@njit(cache=True, error_model="numpy", fastmath={"nnan", "ninf", "nsz"})
def _round_weights(w, n, t, mx, nbk, g, wq, winv):
    """A q8_0 V's weights for _weighted_i16, in f32 steps a twin can repeat (no
    reassociation, reciprocal or contraction licence): for rows j < g of w (Rows), mw_j =
    max_p w_jp and r_j = 1 / mw_j; wq[(j nbk + b) _CHUNK + p] = rint(w_jp r_j t(p, b)), an
    int16 in [0, W16] (t and mx[:nbk] from _scale_v_blocks; 0 past n, to a multiple of
    16), and winv[j nbk + b] = mw_j mx[b] / W16: the step, 1/W16 of the largest product a
    row and block can have (0 where the row's weights or the block's scales are all 0)."""
    r = mx[nbk:nbk + _GMAX]
    for j in range(g):
        mw = max(_max_of(w.a, w.off + j * w.stride, n), F32(0.0))
        r[j] = F32(1.0) / mw if mw > F32(0.0) else F32(0.0)
        for b in range(nbk):
            winv[j * nbk + b] = mw * mx[b] / F32(W16)
    _round_rows(w, t, r, n, nbk, g, wq)


@intrinsic
def _round_rows(typingctx, w, t, r, n, nbk, g, wq):
    """wq[(j nbk + b) _CHUNK + p] = int16(rint(w.a[w.off + j w.stride + p] r[j] t[b _CHUNK
    + p])) for p < n, 0 from n to n rounded up to 16, j < g, b < nbk: 16 positions a step
    (each row of w, t and wq has _CHUNK elements)."""
    def codegen(context, builder, sig, args):
        wty, wa, woa, wsa = rows_ir(builder, sig, args, 0)
        na, nba, ga = args[3], args[4], args[5]
        arrays = {"w": (wty, wa), "t": (sig.args[1], args[1]), "r": (sig.args[2], args[2]),
                  "wq": (sig.args[6], args[6])}
        f32, i32 = ir.FloatType(), ir.IntType(32)
        v16, h16 = ir.VectorType(f32, 16), ir.VectorType(ir.IntType(16), 16)
        k64 = lambda v: ir.Constant(na.type, v)
        ptr = lambda name, off, ty: ir_ptr(context, builder, *arrays[name], off, ty)
        lanes = ir.Constant(ir.VectorType(na.type, 16), list(range(16)))
        with cgutils.for_range(builder, nba) as blk:
            with cgutils.for_range(builder, builder.udiv(builder.add(na, k64(15)), k64(16))) as it:
                p0 = builder.mul(it.index, k64(16))
                inside = builder.icmp_unsigned("<", builder.add(splat(builder, p0, 16), lanes),
                                               splat(builder, na, 16))
                to = builder.add(builder.mul(blk.index, k64(_CHUNK)), p0)
                tv = builder.load(ptr("t", to, v16), align=4)
                with cgutils.for_range(builder, ga) as j:
                    wo = builder.add(builder.add(woa, builder.mul(j.index, wsa)), p0)
                    rj = splat(builder, builder.load(ptr("r", j.index, f32)), 16)
                    x = builder.fmul(builder.fmul(builder.load(ptr("w", wo, v16), align=4), rj), tv)
                    x = builder.select(inside, x, ir.Constant(v16, None))
                    q = builder.trunc(builder.fptosi(call_llvm(builder, "llvm.rint.v16f32", v16, [x]),
                                                     ir.VectorType(i32, 16)), h16)
                    row_jb = builder.add(builder.mul(j.index, nba), blk.index)
                    qo = builder.add(builder.mul(row_jb, k64(_CHUNK)), p0)
                    builder.store(q, ptr("wq", qo, h16), align=2)
        return context.get_dummy_value()

    return types.void(w, t, r, n, nbk, g, wq), codegen


@njit(cache=True, fastmath=True)
def _scores_q(k, q, qoff, s, hd, nblk, g, kind):
    # _scores_q16 with g and kind as constants, g 1.._GMAX
    if kind == KIND_Q8:
        if g == 4:
            _scores_q16(k, q, qoff, s, hd, nblk, 4, 0)
        elif g == 3:
            _scores_q16(k, q, qoff, s, hd, nblk, 3, 0)
        elif g == 8:
            _scores_q16(k, q, qoff, s, hd, nblk, 8, 0)
        elif g == 2:
            _scores_q16(k, q, qoff, s, hd, nblk, 2, 0)
        elif g == 1:
            _scores_q16(k, q, qoff, s, hd, nblk, 1, 0)
        elif g == 6:
            _scores_q16(k, q, qoff, s, hd, nblk, 6, 0)
        elif g == 5:
            _scores_q16(k, q, qoff, s, hd, nblk, 5, 0)
        elif g == 7:
            _scores_q16(k, q, qoff, s, hd, nblk, 7, 0)
    else:
        if g == 4:
            _scores_q16(k, q, qoff, s, hd, nblk, 4, 1)
        elif g == 3:
            _scores_q16(k, q, qoff, s, hd, nblk, 3, 1)
        elif g == 8:
            _scores_q16(k, q, qoff, s, hd, nblk, 8, 1)
        elif g == 2:
            _scores_q16(k, q, qoff, s, hd, nblk, 2, 1)
        elif g == 1:
            _scores_q16(k, q, qoff, s, hd, nblk, 1, 1)
        elif g == 6:
            _scores_q16(k, q, qoff, s, hd, nblk, 6, 1)
        elif g == 5:
            _scores_q16(k, q, qoff, s, hd, nblk, 5, 1)
        elif g == 7:
            _scores_q16(k, q, qoff, s, hd, nblk, 7, 1)


@njit(cache=True, fastmath=True)
def _weighted_q(v, w, out, hd, n, g, kind):
    # _weighted_q16 with g and kind as constants, g 1.._GMAX
    if kind == KIND_Q8:
        if g == 4:
            _weighted_q16(v, w, out, hd, n, 4, 0)
        elif g == 3:
            _weighted_q16(v, w, out, hd, n, 3, 0)
        elif g == 8:
            _weighted_q16(v, w, out, hd, n, 8, 0)
        elif g == 2:
            _weighted_q16(v, w, out, hd, n, 2, 0)
        elif g == 1:
            _weighted_q16(v, w, out, hd, n, 1, 0)
        elif g == 6:
            _weighted_q16(v, w, out, hd, n, 6, 0)
        elif g == 5:
            _weighted_q16(v, w, out, hd, n, 5, 0)
        elif g == 7:
            _weighted_q16(v, w, out, hd, n, 7, 0)
    else:
        if g == 4:
            _weighted_q16(v, w, out, hd, n, 4, 1)
        elif g == 3:
            _weighted_q16(v, w, out, hd, n, 3, 1)
        elif g == 8:
            _weighted_q16(v, w, out, hd, n, 8, 1)
        elif g == 2:
            _weighted_q16(v, w, out, hd, n, 2, 1)
        elif g == 1:
            _weighted_q16(v, w, out, hd, n, 1, 1)
        elif g == 6:
            _weighted_q16(v, w, out, hd, n, 6, 1)
        elif g == 5:
            _weighted_q16(v, w, out, hd, n, 5, 1)
        elif g == 7:
            _weighted_q16(v, w, out, hd, n, 7, 1)


@njit(cache=True)
def _weighted_i16_g(v, wq, winv, out, hd, n, g):
    # _weighted_i16 with g as a constant, g 1.._GMAX
    if g == 4:
        _weighted_i16(v, wq, winv, out, hd, n, 4)
    elif g == 3:
        _weighted_i16(v, wq, winv, out, hd, n, 3)
    elif g == 8:
        _weighted_i16(v, wq, winv, out, hd, n, 8)
    elif g == 2:
        _weighted_i16(v, wq, winv, out, hd, n, 2)
    elif g == 1:
        _weighted_i16(v, wq, winv, out, hd, n, 1)
    elif g == 6:
        _weighted_i16(v, wq, winv, out, hd, n, 6)
    elif g == 5:
        _weighted_i16(v, wq, winv, out, hd, n, 5)
    elif g == 7:
        _weighted_i16(v, wq, winv, out, hd, n, 7)


@intrinsic
def _max_of(typingctx, s, off, n):
    """max of s[off:off + n], f32, n >= 1: 16 lanes a step (LLVM leaves a max reduction
    scalar), then the rest one by one."""
    def codegen(context, builder, sig, args):
        oa, na = args[1], args[2]
        f32 = ir.FloatType()
        v16 = ir.VectorType(f32, 16)
        k64 = lambda v: ir.Constant(oa.type, v)
        ptr = lambda off, ty: ir_ptr(context, builder, sig.args[0], args[0], off, ty)
        acc = cgutils.alloca_once_value(builder, splat(builder, builder.load(ptr(oa, f32)), 16))
        nv = builder.udiv(na, k64(16))
        with cgutils.for_range(builder, nv) as it:
            x = builder.load(ptr(builder.add(oa, builder.mul(it.index, k64(16))), v16), align=4)
            builder.store(call_llvm(builder, "llvm.maxnum.v16f32", v16, [builder.load(acc), x]), acc)
        m = cgutils.alloca_once_value(builder, call_llvm(
            builder, "llvm.vector.reduce.fmax.v16f32", f32, [builder.load(acc)]))
        rest = builder.add(oa, builder.mul(nv, k64(16)))
        with cgutils.for_range(builder, builder.sub(na, builder.mul(nv, k64(16)))) as it:
            x = builder.load(ptr(builder.add(rest, it.index), f32))
            builder.store(call_llvm(builder, "llvm.maxnum.f32", f32, [builder.load(m), x]), m)
        return builder.load(m)

    return types.float32(s, types.intp, types.intp), codegen


# -- f16 with a head dim not a multiple of 16: plain loops (functions of their own: inlined
# at each of attention's call sites, their loop variables trip Numba's SSA check)

@njit(cache=True, fastmath=True)
def _scores_plain(kq, base, q32, r, hd, s, soff, nblk, g):
    # s[soff + j _CHUNK + 16 blk + l] = q_{r+j} . K(blk, l), K f16 bits (nblk, hd, 16) from base
    for blk in range(nblk):
        for j in range(g):
            for lane in range(KV_BLOCK):
                acc = F32(0.0)
                for i in range(hd):
                    acc += q32[(r + j) * hd + i] * f16_to_f32(kq[base + (blk * hd + i) * KV_BLOCK + lane])
                s[soff + j * _CHUNK + blk * KV_BLOCK + lane] = acc


@njit(cache=True, fastmath=True)
def _weighted_plain(vq, base, hd, w, woff, n, out, ooff, g):
    # out[ooff + j hd + i] += sum_p w[woff + j _CHUNK + p] V(p, i), V f16 bits (n, hd) from base
    for p in range(n):
        for j in range(g):
            wp = w[woff + j * _CHUNK + p]
            for i in range(hd):
                out[ooff + j * hd + i] += wp * f16_to_f32(vq[base + p * hd + i])


# -- per cache type: scores of one token's g heads over a chunk, V's weighted sum ---------
# Chosen by the cache arrays' dtypes when the kernel compiles (uint16: f16 bits, int8:
# q8_0, uint8: q4_0), so each type pair compiles only its own code.

class Head(NamedTuple):
    """One KV head of one layer's K or V cache: its values and block scales (flat, the
    layouts of the module docstring; scales empty for f16), head dim hd, cap positions a
    head, head index kvh."""
    values: object
    scales: object
    hd: int
    cap: int
    kvh: int


class Query(NamedTuple):
    """A work item's query rows: f32 rows of hd (pre-scaled), and for a quantized K their
    int8 quantization per block of 32 with its scales and int32 block sums (prep_q8_x)."""
    f32: object
    x8: object
    xd: object
    xs: object


# The chunk helpers below, and the switches from a row count to a register kernel
# (_scores_q, _weighted_q, _weighted_i16_g), are functions attention calls, not inlined:
# each holds a register kernel for every row count 1.._GMAX, and inlined at attention's
# call sites they made its compile most of a first start (design_measurements.json:
# "Attention's compile"); called, each compiles once, at no loss of speed measured.
# Each states attention's float licence (fastmath) but _weighted_i16_g, whose sums are
# exact and whose twin scales and adds them without a fused multiply-add.
def _chunk_scores(k, c0, n, q, r, s, g, gm):
    """Scores of query rows r.. over n positions from c0 (njit only: see the overload)."""
    raise NotImplementedError


def _chunk_weighted(v, c0, n, w, out, g, gm, dvf):
    """V's weighted sum over n positions from c0 (njit only: see the overload)."""
    raise NotImplementedError


@overload(_chunk_scores, jit_options={"fastmath": True})
def _ov_chunk_scores(k, c0, n, q, r, s, g, gm):
    # scores s.a[s.off + j s.stride + p] = q_{r+j} . k_{c0+p}, p < n rounded up to 16, j < g,
    # gm rows a register-kernel call; k a Head, q a Query, s Rows of stride _CHUNK
    if k.types[0].dtype == types.uint16:
        def f16(k, c0, n, q, r, s, g, gm):
            hd = k.hd
            nblk = -(-n // KV_BLOCK)
            base = k.kvh * k.cap * hd + c0 * hd
            if hd % 16 == 0:
                for j0 in range(0, g, gm):
                    _scores(k.values, base, Rows(q.f32, (r + j0) * hd, hd),
                            Rows(s.a, s.off + j0 * s.stride, s.stride), hd, nblk, min(gm, g - j0))
            else:
                _scores_plain(k.values, base, q.f32, r, hd, s.a, s.off, nblk, g)
        return f16
    kind = KIND_Q8 if k.types[0].dtype == types.int8 else KIND_Q4

    def quant(k, c0, n, q, r, s, g, gm):
        hd = k.hd
        nbk = hd // QBLOCK
        per = hd * 16 if kind == KIND_Q8 else hd * 8           # bytes per 16 positions
        kb = k.kvh * (k.cap // KV_BLOCK) * per + (c0 // KV_BLOCK) * per
        sb = k.kvh * k.cap * nbk + c0 * nbk
        run, x = Run(k.values, kb, k.scales, sb), Q8X(q.x8, q.xd, q.xs, None)
        for j0 in range(0, g, gm):
            _scores_q(run, x, (r + j0) * hd, Rows(s.a, s.off + j0 * s.stride, s.stride), hd,
                      -(-n // KV_BLOCK), min(gm, g - j0), kind)
    return quant


def v_scratch_size(nbk):
    """f32 elements of a thread's scratch for a quantized V's weighted sum (_v_scratch)."""
    return nbk * _CHUNK + 2 * (nbk + _GMAX) + _GMAX * nbk * _CHUNK // 2 + _GMAX * nbk


@njit(cache=True, inline="always")
def _v_scratch(dvf, nbk):
    # dvf (v_scratch_size(nbk),) f32 -> for a q8_0 V: its scales by block dvt (nbk, _CHUNK)
    # f32, maxima mx (nbk + _GMAX,) f32, the rounded weights wq (_GMAX nbk, _CHUNK) int16
    # and their steps winv (_GMAX nbk,) f32
    a = nbk * _CHUNK
    b = a + 2 * (nbk + _GMAX)                # an even count: wq starts 4-byte aligned
    c = b + _GMAX * nbk * _CHUNK // 2
    return dvf[:a], dvf[a:a + nbk + _GMAX], dvf[b:c].view(np.int16), dvf[c:c + _GMAX * nbk]


@overload(_chunk_weighted, jit_options={"fastmath": True})
def _ov_chunk_weighted(v, c0, n, w, out, g, gm, dvf):
    # out.a[out.off + j out.stride + c] += sum_{p<n} w.a[w.off + j w.stride + p] v_{c0+p, c},
    # j < g, gm rows a register-kernel call; v a Head, w and out Rows (dvf
    # (v_scratch_size(hd/32),) f32 scratch: q4_0, the n positions' V scales, widened; q8_0,
    # those by block and the rounded weights, _v_scratch)
    if v.types[0].dtype == types.uint16:
        def f16(v, c0, n, w, out, g, gm, dvf):
            hd = v.hd
            base = v.kvh * v.cap * hd + c0 * hd
            if hd % 16 == 0:
                for j0 in range(0, g, gm):
                    _weighted(v.values, base, Rows(w.a, w.off + j0 * w.stride, w.stride),
                              Rows(out.a, out.off + j0 * out.stride, out.stride), hd, n,
                              min(gm, g - j0))
            else:
                _weighted_plain(v.values, base, hd, w.a, w.off, n, out.a, out.off, g)
        return f16
    kind = KIND_Q8 if v.types[0].dtype == types.int8 else KIND_Q4

    if kind == KIND_Q8 and TARGET.v_int16:
        def q8(v, c0, n, w, out, g, gm, dvf):
            hd = v.hd
            nbk = hd // QBLOCK
            first = v.kvh * v.cap + c0
            src = v.scales[first * nbk:(first + n) * nbk]
            dvt, mx, wq, winv = _v_scratch(dvf, nbk)
            for b in range(nbk):
                for p in range(n):
                    dvt[b * _CHUNK + p] = f16_to_f32(src[p * nbk + b])
            _scale_v_blocks(dvt, n, nbk, mx)
            run = Run(v.values, first * hd, dvt, 0)
            for j0 in range(0, g, gm):
                wj = Rows(w.a, w.off + j0 * w.stride, w.stride)
                _round_weights(wj, n, dvt, mx, nbk, min(gm, g - j0), wq, winv)
                _weighted_i16_g(run, wq, winv, Rows(out.a, out.off + j0 * out.stride, out.stride),
                                hd, n, min(gm, g - j0))
        return q8

    def quant(v, c0, n, w, out, g, gm, dvf):
        hd = v.hd
        nbk = hd // QBLOCK
        row = hd if kind == KIND_Q8 else hd // 2
        first = v.kvh * v.cap + c0
        src = v.scales[first * nbk:(first + n) * nbk]
        for i in range(src.size):              # from 0: vectorised (vcvtph2ps)
            dvf[i] = f16_to_f32(src[i])
        run = Run(v.values, first * row, dvf, 0)
        for j0 in range(0, g, gm):
            _weighted_q(run, Rows(w.a, w.off + j0 * w.stride, w.stride),
                        Rows(out.a, out.off + j0 * out.stride, out.stride), hd, n,
                        min(gm, g - j0), kind)
    return quant


def attention(q, kq, ks, vq, vs, KV, cap, pos0, scale, out, sf, s8, si, sp, window):
    # q (T, H, hd) roped queries at positions pos0..pos0+T-1; one layer's cache, flat:
    # kq, ks (K and its scales), vq, vs (V and its scales), KV heads of `cap` positions, in the
    # layouts of the module docstring (f16: ks, vs unused), filled up to pos0+T.
    # out (T, H, hd). Causal: token t sees positions 0..pos0+t; with a window W > 0 only
    # pos0+t-W+1..pos0+t (llama.cpp's standard SWA mask: masked where p1 - p0 >= W).
    # Position p lies at p % cap (a ring, kv_cache.py): cap is a multiple of _CHUNK or
    # above every position, so each chunk of positions is one run of the cache.
    # sf (threads, attention_scratch_shape) f32, s8 (threads, G hd) int8, si (threads, G
    # hd/32) int32, G = TB g: one row per thread. sp (KV _MAX_SPLITS, g (hd + 2)) f32: a
    # decoded token's partial outputs, maxima and sums per split.
    # GQA: the g query heads of a KV head share every K and V vector read; a work item is
    # one KV head and a block of up to TB tokens (rows tt g + j), which read K and V a
    # chunk at a time, then from L2. A chunk every token of the block sees whole (all but
    # the causal diagonal's) is scored and summed for all the block's rows in one call of
    # the register kernels, so each K/V vector is widened once per group of rows, not per g.
    # Token blocks are handed out first, last, second, second to last..., each item to
    # the next free thread (claim.py), so neighbouring items even out the causal work.
    # A decoded token (T = 1) at depth has one token block but KV heads x splits of its
    # positions (runs of _SPLIT_CHUNKS chunks, at most _MAX_SPLITS) as items, so more
    # threads than KV heads have work; the splits' partial softmaxes are merged after
    # (flash decoding). The splits follow the depth alone, so the sums' order, and the
    # result, is the same at every thread count and whichever thread takes an item.
    # Each work item runs _attention_item, called by address from _attention_items'
    # parallel loop (kernels/items.py: the body compiles once, not again inside the loop).
    _ITEMS.run(_attention_items, (0, 0, 0, 0),
               (q, kq, ks, vq, vs, KV, cap, pos0, scale, out, sf, s8, si, sp, window))


@njit(cache=True, error_model="numpy", fastmath=True, parallel=True)
def _attention_items(table, q, kq, ks, vq, vs, KV, cap, pos0, scale, out, sf, s8, si, sp, window):
    # attention's work items (split and ordered as it says) in parallel, each
    # _attention_item for these types at its address in `table`, then a decoded token's
    # splits merged; returns 0, or 1 having run nothing where the table lacks that address
    fptr = item_address(table, (0, 0, 0, 0),
                        (q, kq, ks, vq, vs, KV, cap, pos0, scale, out, sf, s8, si, sp, window))
    if fptr == 0:
        return 1
    T, H, hd = q.shape
    g = H // KV
    nblocks = -(-T // _TB)
    nsplit, per = 1, 0
    first = max(0, pos0 - window + 1) // _CHUNK * _CHUNK if window > 0 else 0
    if T == 1:
        nchunks = -(-(pos0 + 1 - first) // _CHUNK)
        nsplit = min(-(-nchunks // _SPLIT_CHUNKS), sp.shape[0] // KV)
        per = -(-nchunks // nsplit)                 # chunks a split
        nsplit = -(-nchunks // per)                 # none empty
    n = nblocks * KV * nsplit
    counter = np.zeros(1, np.int64)
    for _ in prange(n):
        while True:                                 # claimed one at a time (claim.py)
            item = take(counter)
            if item >= n:
                break
            call_item(fptr, (item, nsplit, per, first),
                      (q, kq, ks, vq, vs, KV, cap, pos0, scale, out, sf, s8, si, sp, window))
    if nsplit > 1:
        _merge_splits(sp, KV, nsplit, g, hd, out)
    return 0


@njit(cache=True, error_model="numpy", fastmath=True)
def _attention_item(item, nsplit, per, first, q, kq, ks, vq, vs, KV, cap, pos0, scale, out, sf, s8,
                    si, sp, window):
    # work item `item` of attention's nsplit splits of per chunks from position `first`
    T, H, hd = q.shape
    g = H // KV
    G = _TB * g
    nbk = hd // QBLOCK
    quant_k = ks.size > 0
    nblocks = -(-T // _TB)
    gk = min(g, _GMAX) if T == 1 else (_BATCH_Q if quant_k else _BATCH_F16)   # rows a call
    gv = min(g, _GMAX) if T == 1 else (_BATCH_Q if vs.size > 0 else _BATCH_F16)
    split, rest = item % nsplit, item // nsplit
    tb, kvh = rest // KV, rest % KV
    tb = tb // 2 if tb % 2 == 0 else nblocks - 1 - tb // 2
    t0 = tb * _TB
    nt = min(T, t0 + _TB) - t0
    buf = sf[nb.get_thread_id()]
    s = buf[:G * _CHUNK]
    q32 = buf[G * _CHUNK:G * (_CHUNK + hd)]
    mrow = buf[G * (_CHUNK + hd):G * (_CHUNK + hd + 1)]
    lrow = buf[G * (_CHUNK + hd + 1):G * (_CHUNK + hd + 2)]
    qd = buf[G * (_CHUNK + hd + 2):G * (_CHUNK + hd + 2) + G * nbk]
    xsum = buf[G * (_CHUNK + hd + 2) + G * nbk:G * (_CHUNK + hd + 2) + 2 * G * nbk]
    o32 = buf[G * (_CHUNK + hd + 2) + 2 * G * nbk:G * (_CHUNK + 2 * hd + 2) + 2 * G * nbk]
    dvf = buf[G * (_CHUNK + 2 * hd + 2) + 2 * G * nbk:]
    q8, qs8 = s8[nb.get_thread_id()], si[nb.get_thread_id()]
    kh, vh = Head(kq, ks, hd, cap, kvh), Head(vq, vs, hd, cap, kvh)
    qr = Query(q32, q8, qd, qs8)
    for tt in range(nt):
        for j in range(g):
            r = tt * g + j
            for i in range(hd):
                q32[r * hd + i] = q[t0 + tt, kvh * g + j, i] * scale
            if quant_k:
                prep_q8_x(q32[r * hd:(r + 1) * hd], q8[r * hd:(r + 1) * hd],
                          qd[r * nbk:(r + 1) * nbk], qs8[r * nbk:(r + 1) * nbk],
                          xsum[r * nbk:(r + 1) * nbk])
            mrow[r] = _NO_MAX
            lrow[r] = F32(0.0)
            for i in range(hd):
                o32[r * hd + i] = F32(0.0)
    end = pos0 + t0 + nt                          # positions the last token sees
    # the chunks from the first one the block's first token sees
    c_lo = max(0, pos0 + t0 - window + 1) // _CHUNK * _CHUNK if window > 0 else 0
    c_hi = end
    if nsplit > 1:
        c_lo = first + split * per * _CHUNK
        c_hi = min(end, c_lo + per * _CHUNK)
    for c0 in range(c_lo, c_hi, _CHUNK):
        pc = c0 % cap                             # where the chunk lies
        whole = c0 + _CHUNK <= pos0 + t0 + 1      # every token sees the whole chunk
        # scores, 16 positions at a time: a token's last block also scores positions
        # past its own, which the softmax never reads
        if whole:
            _chunk_scores(kh, pc, _CHUNK, qr, 0, Rows(s, 0, _CHUNK), nt * g, gk)
        else:
            for tt in range(nt):
                n = min(pos0 + t0 + tt + 1, c0 + _CHUNK) - c0
                if n > 0:
                    _chunk_scores(kh, pc, n, qr, tt * g, Rows(s, tt * g * _CHUNK, _CHUNK),
                                  g, gk)
        # the running max and sum; weights e^(s - max) below e^-30 of it are zero
        # (1e-13, far under f32 resolution next to the max's 1): tiny weights make
        # subnormal products, ~100x slower on x86
        for tt in range(nt):
            n = min(pos0 + t0 + tt + 1, c0 + _CHUNK) - c0
            # positions before m0 are outside the token's window: weight zero
            m0 = max(0, pos0 + t0 + tt - window + 1 - c0) if window > 0 else 0
            for j in range(g):
                if n <= 0:
                    continue
                r = tt * g + j
                sj = s[r * _CHUNK:r * _CHUNK + n]
                if m0 > 0:
                    for p in range(min(m0, n)):
                        sj[p] = F32(0.0)
                    if m0 >= n:
                        continue
                mx = _max_of(s, r * _CHUNK + m0, n - m0)
                if mx > mrow[r]:
                    d = mrow[r] - mx
                    f = _exp_neg(max(d, _MIN_LOGIT)) if d > _MIN_LOGIT else F32(0.0)
                    lrow[r] *= f
                    for i in range(hd):
                        o32[r * hd + i] *= f
                    mrow[r] = mx
                m = mrow[r]
                tot = F32(0.0)
                sv = sj[m0:]          # a loop from 0 vectorises (no negative indices)
                for p in range(sv.size):
                    x = sv[p] - m
                    e = _exp_neg(max(x, _MIN_LOGIT))
                    e = e if x > _MIN_LOGIT else F32(0.0)
                    sv[p] = e
                    tot += e
                lrow[r] += tot
        if whole:
            _chunk_weighted(vh, pc, _CHUNK, Rows(s, 0, _CHUNK), Rows(o32, 0, hd), nt * g, gv,
                            dvf)
        else:
            for tt in range(nt):
                n = min(pos0 + t0 + tt + 1, c0 + _CHUNK) - c0
                if n > 0:
                    _chunk_weighted(vh, pc, n, Rows(s, tt * g * _CHUNK, _CHUNK),
                                    Rows(o32, tt * g * hd, hd), g, gv, dvf)
    if nsplit > 1:                               # the split's part, merged below
        part = sp[kvh * nsplit + split]
        for j in range(g):
            for i in range(hd):
                part[j * hd + i] = o32[j * hd + i]
            part[g * hd + j] = mrow[j]
            part[g * hd + g + j] = lrow[j]
    else:
        for tt in range(nt):
            for j in range(g):
                r = tt * g + j
                inv = F32(1.0) / lrow[r]
                for i in range(hd):
                    out[t0 + tt, kvh * g + j, i] = o32[r * hd + i] * inv


_ITEMS = Items(__name__, "_attention_item")


@njit(cache=True, error_model="numpy", fastmath=True)
def _merge_splits(sp, KV, nsplit, g, hd, out):
    # sp (KV nsplit, g (hd + 2)): per KV head and split, the g rows' unnormalised outputs,
    # their running maxima and sums -> out (1, H, hd): each row's softmax over all splits
    for kvh in range(KV):
        for j in range(g):
            mx = _NO_MAX
            for s in range(nsplit):
                mx = max(mx, sp[kvh * nsplit + s, g * hd + j])
            tot = F32(0.0)
            o = out[0, kvh * g + j]
            for i in range(hd):
                o[i] = F32(0.0)
            for s in range(nsplit):
                part = sp[kvh * nsplit + s]
                d = part[g * hd + j] - mx
                f = _exp_neg(max(d, _MIN_LOGIT)) if d > _MIN_LOGIT else F32(0.0)
                tot += part[g * hd + g + j] * f
                for i in range(hd):
                    o[i] += part[j * hd + i] * f
            inv = F32(1.0) / tot
            for i in range(hd):
                o[i] *= inv


def attention_scratch_shapes(n_threads: int, n_heads: int, n_kv_heads: int,
                             head_dim: int) -> list[tuple[tuple[int, int], type]]:
    """Shapes and dtypes of attention's scratch arrays (sf, s8, si, sp): a chunk of
    scores and the query and output rows of one work item per thread, whatever the
    context, and a decoded token's partial results per split."""
    g = n_heads // n_kv_heads
    G = _TB * g
    nbk = head_dim // QBLOCK
    return [((n_threads, G * (_CHUNK + 2 * head_dim + 2) + 2 * G * nbk + v_scratch_size(nbk)), np.float32),
            ((n_threads, max(1, G * head_dim)), np.int8),
            ((n_threads, max(1, G * nbk)), np.int32),
            ((n_kv_heads * _MAX_SPLITS, g * (head_dim + 2)), np.float32)]


# -- storing K and V ---------------------------------------------------------------------

@njit(cache=True, inline="always")
def _roundf(v):
    # C's roundf (half away from zero), as ggml's and gguf-py's q8_0 reference
    a = abs(v)
    f = np.floor(a)
    b = f + np.floor(F32(2.0) * (a - f))
    return -b if v < 0 else b


@njit(cache=True)
def _q8_block(x, base, vals):
    # x[base:base+32] f32 -> vals (32,) int8 and the f32 scale d (ggml's
    # quantize_row_q8_0_ref: d = amax / 127, q = roundf(x / d) with x / d as x * (1/d))
    amax = F32(0.0)
    for j in range(QBLOCK):
        amax = max(amax, abs(x[base + j]))
    d = amax / F32(127.0)
    idv = F32(1.0) / d if d != 0 else F32(0.0)
    for j in range(QBLOCK):
        vals[j] = np.int8(_roundf(x[base + j] * idv))
    return d


@njit(cache=True)
def _q4_error(x, base, vals, d):
    # Σ (x - f16(d) (vals - 8))² over x[base:base+32], f64, in index order
    d16 = np.float64(f16_to_f32(f32_to_f16(d)))
    err = 0.0
    for j in range(QBLOCK):
        e = np.float64(x[base + j]) - d16 * (np.float64(vals[j]) - 8.0)
        err += e * e
    return err


@njit(cache=True, inline="always")
def _q4_level(v, s):
    # the q4_0 level (-8..7) of the value v at the inverse scale s
    return min(max(np.rint(np.float64(v) * s), -8.0), 7.0)


@njit(cache=True, fastmath={"reassoc"})
def _q4_sums(x, base, s):
    # levels l = clamp(rint(x s), -8, 7) of x[base:base+32] -> (Σ x l, Σ l²) in f64. Both
    # are exact in any order (a nonzero l needs |x| > x_max / 18, so every x l is a 28-bit
    # significand within 2^8 of the largest), so the sums may be vectorised (reassoc).
    sumlx = 0.0
    suml2 = 0.0
    for j in range(QBLOCK):
        lv = _q4_level(x[base + j], s)
        sumlx += np.float64(x[base + j]) * lv
        suml2 += lv * lv
    return sumlx, suml2


_Q4_SEARCH = (-9, -6, -3, 0, 3, 6, 9)   # scales -(8 + 0.1 i) / x_max tried by _q4_block: on
                                       # near-Gaussian blocks all of i = -9..9 gain no more


@njit(cache=True)
def _q4_block(x, base, vals):
    # x[base:base+32] f32 -> vals (32,) uint8 nibbles (level + 8) and the f32 scale d whose
    # f16 the cache stores: ggml's q4_0 layout, with whichever scale leaves the smaller
    # squared error Σ (x - f16(d) level)²: ggml's quantize_row_q4_0_ref's (d = the value
    # of largest |x| / -8, level = min(15, trunc(x / d + 8.5)) - 8), or the best of a
    # search as ggml's make_qx_quants does for weights: for each scale s of _Q4_SEARCH,
    # the levels clamp(rint(x s), -8, 7) and their least-squares d, ranked by the error's
    # closed form d16 (d16 Σl² - 2 Σxl) (Σx² left out). The winner's error and ggml's are
    # summed directly (f64, index order), so no block is further from x than ggml's
    # rounding leaves it (tests/model/test_attention.py has the NumPy twin).
    mx = F32(0.0)
    amax = F32(0.0)
    for j in range(QBLOCK):
        v = x[base + j]
        if abs(v) > amax:
            amax = abs(v)
            mx = v
    d = mx / F32(-8.0)
    idv = F32(1.0) / d if d != 0 else F32(0.0)
    for j in range(QBLOCK):
        vals[j] = min(np.uint8(np.int64(np.trunc(x[base + j] * idv + F32(8.5))) & 0xFF), np.uint8(15))
    if mx == 0:
        return d
    rank, best_s, best_d = np.inf, 0.0, F32(0.0)
    for i in _Q4_SEARCH:
        s = -(8.0 + 0.1 * i) / np.float64(mx)
        sumlx, suml2 = _q4_sums(x, base, s)
        dc = F32(sumlx / suml2)
        d16 = np.float64(f16_to_f32(f32_to_f16(dc)))
        r = d16 * (d16 * suml2 - 2.0 * sumlx)
        if r < rank:
            rank, best_s, best_d = r, s, dc
    d16 = np.float64(f16_to_f32(f32_to_f16(best_d)))
    err = 0.0
    for j in range(QBLOCK):
        e = np.float64(x[base + j]) - d16 * _q4_level(x[base + j], best_s)
        err += e * e
    if err < _q4_error(x, base, vals, d):
        d = best_d
        for j in range(QBLOCK):
            vals[j] = np.uint8(np.int64(_q4_level(x[base + j], best_s)) + 8)
    return d


# Each store is a serial kernel over a range of KV heads, and a parallel one over all heads
# for prefill's many positions. A decoded token's K or V (KV x hd values) goes through the
# serial one: a parallel region costs more than the work (bench/bench_decode_split.py).
# Position p is stored at p % cap: a sliding-window layer's ring (kv_cache.py) reuses the
# slots of positions its window has passed.

@njit(cache=True)
def store_f16_k_heads(kc, cap, pos, k, h0, h1):
    # k (T, KV, hd) f32 -> kc flat f16 bits (KV, cap/16, hd, 16) at positions pos.., heads h0..h1
    T, KV, hd = k.shape
    for h in range(h0, h1):
        for t in range(T):
            p = (pos + t) % cap
            base = h * cap * hd + (p // KV_BLOCK) * hd * KV_BLOCK + p % KV_BLOCK
            for i in range(hd):
                kc[base + i * KV_BLOCK] = f32_to_f16(k[t, h, i])


@njit(cache=True)
def store_f16_v_heads(vc, cap, pos, v, h0, h1):
    # v (T, KV, hd) f32 -> vc flat f16 bits (KV, cap, hd) at positions pos.., heads h0..h1
    T, KV, hd = v.shape
    for h in range(h0, h1):
        for t in range(T):
            base = (h * cap + (pos + t) % cap) * hd
            for i in range(hd):
                vc[base + i] = f32_to_f16(v[t, h, i])


@njit(cache=True)
def store_q_k_heads(kq, ks, cap, pos, k, q4, h0, h1):
    # k (T, KV, hd) f32 -> q8_0 (kq int8) or q4_0 (q4, kq uint8) K at positions pos.., heads
    # h0..h1, in the quads of the module docstring; ks f16 bits (KV, cap/16, hd/32, 16)
    T, KV, hd = k.shape
    nbk = hd // QBLOCK
    per = hd * 8 if q4 else hd * 16
    vals = np.empty(QBLOCK, kq.dtype)
    x = np.empty(QBLOCK, F32)
    for h in range(h0, h1):
        for t in range(T):
            p = (pos + t) % cap
            blk, lane = p // KV_BLOCK, p % KV_BLOCK
            kb = (h * (cap // KV_BLOCK) + blk) * per + 4 * lane
            for b in range(nbk):
                for j in range(QBLOCK):
                    x[j] = k[t, h, QBLOCK * b + j]
                if q4:
                    d = _q4_block(x, 0, vals)
                    for gq in range(4):
                        for i in range(4):
                            kq[kb + 256 * b + 64 * gq + i] = vals[4 * gq + i] | (vals[16 + 4 * gq + i] << 4)
                else:
                    d = _q8_block(x, 0, vals)
                    for gq in range(8):
                        for i in range(4):
                            kq[kb + 512 * b + 64 * gq + i] = vals[4 * gq + i]
                ks[((h * (cap // KV_BLOCK) + blk) * nbk + b) * KV_BLOCK + lane] = f32_to_f16(d)


@njit(cache=True)
def store_q_v_heads(vq, vs, cap, pos, v, q4, h0, h1):
    # v (T, KV, hd) f32 -> q8_0 (vq int8 rows of hd) or q4_0 (q4, vq uint8 rows of hd/2, ggml's
    # nibble bytes) V at positions pos.., heads h0..h1; vs f16 bits (KV, cap, hd/32)
    T, KV, hd = v.shape
    nbk = hd // QBLOCK
    row = hd // 2 if q4 else hd
    vals = np.empty(QBLOCK, vq.dtype)
    x = np.empty(QBLOCK, F32)
    for h in range(h0, h1):
        for t in range(T):
            p = h * cap + (pos + t) % cap
            for b in range(nbk):
                for j in range(QBLOCK):
                    x[j] = v[t, h, QBLOCK * b + j]
                if q4:
                    d = _q4_block(x, 0, vals)
                    for j in range(16):
                        vq[p * row + 16 * b + j] = vals[j] | (vals[16 + j] << 4)
                else:
                    d = _q8_block(x, 0, vals)
                    for j in range(QBLOCK):
                        vq[p * row + QBLOCK * b + j] = vals[j]
                vs[p * nbk + b] = f32_to_f16(d)


@njit(cache=True, parallel=True)
def store_f16_k(kc, cap, pos, k):
    for h in prange(k.shape[1]):
        store_f16_k_heads(kc, cap, pos, k, h, h + 1)


@njit(cache=True, parallel=True)
def store_f16_v(vc, cap, pos, v):
    for h in prange(v.shape[1]):
        store_f16_v_heads(vc, cap, pos, v, h, h + 1)


@njit(cache=True, parallel=True)
def store_q_k(kq, ks, cap, pos, k, q4):
    for h in prange(k.shape[1]):
        store_q_k_heads(kq, ks, cap, pos, k, q4, h, h + 1)


@njit(cache=True, parallel=True)
def store_q_v(vq, vs, cap, pos, v, q4):
    for h in prange(v.shape[1]):
        store_q_v_heads(vq, vs, cap, pos, v, q4, h, h + 1)


@njit(cache=True, fastmath=True)
def hadamard(x, m):
    # x (T, nh, hd) in place: each run of m values (m a power of 2 dividing hd) times the
    # orthonormal Walsh-Hadamard matrix H_m / sqrt(m), symmetric, so its own inverse
    T, nh, hd = x.shape
    norm = F32(1.0 / np.sqrt(m))
    for t in range(T):
        for h in range(nh):
            for b0 in range(0, hd, m):
                step = 1
                while step < m:
                    for i in range(b0, b0 + m, 2 * step):
                        for j in range(i, i + step):
                            a, c = x[t, h, j], x[t, h, j + step]
                            x[t, h, j] = a + c
                            x[t, h, j + step] = a - c
                    step *= 2
                for j in range(b0, b0 + m):
                    x[t, h, j] *= norm
