"""Numba kernels of the forward pass other than the linear layers (those are in formats/).

Conventions: T tokens in a batch, E model dim, H query heads, KV key/value heads,
hd head dim, g = H // KV query heads per KV head, F ffn dim. Every kernel writes
into an output array; nothing here allocates per token. Attention is in attention.py;
the register kernels of its f16 cache (_scores, _weighted) are here. Numba has no
float16 type, so kernels see an f16 cache's raw uint16 bits.
"""
from __future__ import annotations

from typing import NamedTuple

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .fp import half_to_float_ir
from .jit import njit
from .simd import call_llvm, ir_ptr, prefetch_ir, splat
from .target import FEATURES

F32 = np.float32
_MIN_LOGIT = F32(-30.0)   # softmax weights below e^-30 of the max count as zero
_PREFETCH = 4096    # f16 elements (8 KiB) ahead that attention prefetches K and V (the
                    # gain: "attention prefetch", bench/results/design_measurements.json)


# The elementwise kernels are row kernels (_*_row) run over a batch's rows: one after
# another (rmsnorm, rope, swiglu, add_inplace), or in parallel for prefill (the *_rows
# kernels below). Both run the same row kernel, so a row's result is the same bits
# whichever runs it (speculative verification relies on that).

@njit(cache=True, error_model="numpy", fastmath=True)
def _rmsnorm_row(x, w, eps, out):
    # x (E,), w (E,) -> out (E,) = x / sqrt(mean(x²) + eps) * w
    E = x.size
    ss = F32(0.0)
    for i in range(E):
        ss += x[i] * x[i]
    inv = F32(1.0) / np.sqrt(ss / F32(E) + F32(eps))
    for i in range(E):
        out[i] = x[i] * inv * w[i]


@njit(cache=True, error_model="numpy", fastmath=True)
def rmsnorm(x, w, eps, out):
    # x (T, E), w (E,) -> out (T, E), row by row
    for t in range(x.shape[0]):
        _rmsnorm_row(x[t], w, eps, out[t])


@njit(cache=True, error_model="numpy", fastmath=True)
def _rope_row(x, cos, sin):
    # x (nh, hd) in place; cos, sin (hd/2,). Rotates adjacent pairs (2i, 2i+1), the GGUF
    # llama layout (the converter permuted HF's rotate-half rows into it).
    nh, hd = x.shape
    for h in range(nh):
        for i in range(hd // 2):
            a, b = x[h, 2 * i], x[h, 2 * i + 1]
            c, s = cos[i], sin[i]
            x[h, 2 * i] = a * c - b * s
            x[h, 2 * i + 1] = a * s + b * c


@njit(cache=True, error_model="numpy", fastmath=True)
def rope(x, cos, sin):
    # x (T, nh, hd) in place; cos, sin (T, hd/2), row by row
    for t in range(x.shape[0]):
        _rope_row(x[t], cos[t], sin[t])


@njit(cache=True, error_model="numpy", fastmath=True)
def _rope_neox_row(x, cos, sin):
    # x (nh, hd) in place; cos, sin (hd/2,). Rotates pairs (i, i + hd/2), the NEOX layout
    # (HF's rotate_half; GGUF keeps HF's rows for these families: Qwen, Gemma).
    nh, hd = x.shape
    m = hd // 2
    for h in range(nh):
        for i in range(m):
            a, b = x[h, i], x[h, m + i]
            c, s = cos[i], sin[i]
            x[h, i] = a * c - b * s
            x[h, m + i] = a * s + b * c


@njit(cache=True, error_model="numpy", fastmath=True)
def rope_neox(x, cos, sin):
    # x (T, nh, hd) in place; cos, sin (T, hd/2), row by row
    for t in range(x.shape[0]):
        _rope_neox_row(x[t], cos[t], sin[t])


@njit(cache=True, error_model="numpy", fastmath=True)
def _head_norm_row(x, off, nh, w, eps):
    # x (W,) in place: the nh heads x[off + h hd : off + (h+1) hd], each RMS-normed and
    # scaled by w (hd,) (Qwen 3's q/k norm). It takes the whole C-contiguous row, not a
    # (nh, hd) view: a view of one token is contiguous and of several is not, and Numba's
    # two compilations sum the squares in different orders (verify's rows must have the
    # bits of one-token steps).
    hd = w.size
    for h in range(nh):
        v = x[off + h * hd:off + (h + 1) * hd]
        _rmsnorm_row(v, w, eps, v)


@njit(cache=True, error_model="numpy", fastmath=True)
def head_norm(x, off, nh, w, eps):
    # x (T, W) in place, row by row
    for t in range(x.shape[0]):
        _head_norm_row(x[t], off, nh, w, eps)


@intrinsic
def _bits_as_f32(typingctx, bits):
    # int32 bit pattern -> the f32 with those bits (a register move, vectorises)
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


@njit(cache=True, error_model="numpy", fastmath=True, inline="always")
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


@njit(cache=True, error_model="numpy", fastmath=True, inline="always")
def _sigmoid(z):
    # 1 / (1 + e) for z >= 0, e / (1 + e) below, e = e^-|z| <= 1: _exp_neg's range, and
    # SIMD (np.exp is a libm call per element: 4% of a 1B prefill)
    e = _exp_neg(-abs(z))
    return (F32(1.0) if z >= F32(0.0) else e) / (F32(1.0) + e)


@njit(cache=True, error_model="numpy", fastmath=True)
def _swiglu_row(gate_up, out):
    # gate_up (2F,) = [gate | up] -> out (F,) = silu(gate) * up, silu(g) = g sigmoid(g).
    # One C-contiguous array, not two column slices of it: Numba vectorises only loops
    # over arrays it knows are contiguous (the slices took 12% of a 1B prefill).
    F = out.size
    for i in range(F):
        g = gate_up[i]
        out[i] = g * _sigmoid(g) * gate_up[F + i]


@njit(cache=True, error_model="numpy", fastmath=True)
def swiglu(gate_up, out):
    # gate_up (T, 2F) -> out (T, F), row by row
    for t in range(out.shape[0]):
        _swiglu_row(gate_up[t], out[t])


_GELU_C = F32(2.0 * 0.7978845608028654)       # 2 sqrt(2/pi)
_GELU_A = F32(0.044715)


@njit(cache=True, error_model="numpy", fastmath=True)
def _geglu_row(gate_up, out):
    # gate_up (2F,) = [gate | up] -> out (F,) = gelu(gate) * up, GELU's tanh form
    # 0.5 g (1 + tanh(u)), u = sqrt(2/pi) (g + 0.044715 g³), written g sigmoid(2u) to
    # use the branch-free _sigmoid (SIMD; np.tanh is a libm call per element)
    F = out.size
    for i in range(F):
        g = gate_up[i]
        z = _GELU_C * g * (F32(1.0) + _GELU_A * g * g)
        out[i] = g * _sigmoid(z) * gate_up[F + i]


@njit(cache=True, error_model="numpy", fastmath=True)
def geglu(gate_up, out):
    # gate_up (T, 2F) -> out (T, F), row by row
    for t in range(out.shape[0]):
        _geglu_row(gate_up[t], out[t])


@njit(cache=True, error_model="numpy", fastmath=True)
def softcap(x, cap):
    # x (T, V) in place: cap tanh(x / cap) (Gemma's final-logit soft-capping), tanh(y) as
    # 1 - 2 / (e^2y + 1) from e^-2|y| (_exp_neg: SIMD)
    inv = F32(1.0) / F32(cap)
    for t in range(x.shape[0]):
        for i in range(x.shape[1]):
            y = x[t, i] * inv
            e = _exp_neg(F32(-2.0) * abs(y))
            th = (F32(1.0) - e) / (F32(1.0) + e)
            x[t, i] = F32(cap) * (th if y >= F32(0.0) else -th)


def _f16x16(builder, p):
    # <16 x float>: the 16 IEEE halves at p (an i16 vector pointer), widened
    return half_to_float_ir(builder, builder.load(p, align=2))


def _fma(builder, a, b, c):
    # a * b + c, <16 x float>, one fused multiply-add
    return call_llvm(builder, "llvm.fma.v16f32", a.type, [a, b, c])


# Registers, in 16-float vectors: 32 zmm hold 32 of them on AVX-512, 16 ymm only 8 (each
# is two ymm) on AVX2 and other targets; a few stay free for the loaded K or V. (Numba's
# kernel cache is keyed by the CPU, so these never meet another CPU's cache.)
_AVX512 = "avx512f" in FEATURES
_VREGS = 28 if _AVX512 else 7


class Rows(NamedTuple):
    """The g rows of f32 a register kernel of attention reads or writes (query rows,
    scores, softmax weights, outputs): row j's elements from a[off + j stride]."""
    a: object
    off: int
    stride: int


def in_passes(builder, total, per, passes):
    """A register kernel's blocks in passes of `per` (as many as fit the registers), then
    the blocks left over one a pass: passes(first, count, bp) emits `count` passes of bp
    blocks from block `first`."""
    k = lambda v: ir.Constant(total.type, v)
    full = builder.udiv(total, k(per))
    passes(k(0), full, per)
    if per > 1:
        done = builder.mul(full, k(per))
        passes(done, builder.sub(total, done), 1)


def rows_ir(builder, sig, args, k):
    """(array type, array, off, stride) of the Rows argument k inside a codegen."""
    ty, val = sig.args[k], args[k]
    return (ty.types[0],) + tuple(builder.extract_value(val, i) for i in range(3))


def _unroll(g):
    # K blocks per pass of _scores16: g·u sums, each one chain of dependent FMAs; two FMA
    # units of 4 cycles' latency want 8 chains of full registers in flight, as far as the
    # registers go (3B, g = 3, depth 4096: one block a pass ran at half speed on AVX-512)
    chains = 8 if _AVX512 else 4
    return max(1, min(4, -(-chains // g), _VREGS // (g + 1)))


def _vcols(g):
    # 16-column vectors of V per pass of _weighted16: g·c sums and c V vectors in registers
    return max(1, min(4, _VREGS // (g + 1)))


@intrinsic(prefer_literal=True)
def _scores16(typingctx, kt, koff, q, s, hd, nblk, g):
    """s.a[s.off + j s.stride + 16 b + l] = sum_i q.a[q.off + j q.stride + i] K(b, i, l)
    for the nblk blocks b of 16 positions (lanes l) from koff, K(b, i, l) the f16 bits
    kt[koff + 16 hd b + 16 i + l], j < g (a constant); q and s Rows. Each K vector is
    loaded and widened once for the g query heads, whose sums stay in registers over
    the whole head dimension, _unroll(g) blocks a pass."""
    if not isinstance(g, types.IntegerLiteral):
        return None
    G = g.literal_value
    U = _unroll(G)

    def codegen(context, builder, sig, args):
        koa, hda, nba = args[1], args[4], args[5]
        qty, qa, qoa, qsa = rows_ir(builder, sig, args, 2)
        sty, sa, soa, ssa = rows_ir(builder, sig, args, 3)
        f32, h16 = ir.FloatType(), ir.VectorType(ir.IntType(16), 16)
        v16 = ir.VectorType(f32, 16)
        k64 = lambda v: ir.Constant(koa.type, v)
        bstride = builder.mul(hda, k64(16))

        def passes(first, count, u):
            # `count` passes of u blocks each, from block `first`
            accs = [[cgutils.alloca_once(builder, v16) for _ in range(u)] for _ in range(G)]
            with cgutils.for_range(builder, count) as pas:
                b0 = builder.add(first, builder.mul(pas.index, k64(u)))
                base = [builder.add(koa, builder.mul(builder.add(b0, k64(b)), bstride))
                        for b in range(u)]
                for row in accs:
                    for a in row:
                        builder.store(ir.Constant(v16, None), a)
                with cgutils.for_range(builder, hda) as it:
                    at = [builder.add(base[b], builder.mul(it.index, k64(16))) for b in range(u)]
                    for b in range(u):
                        prefetch_ir(context, builder, sig.args[0], args[0],
                                    builder.add(at[b], k64(_PREFETCH)))
                    kf = [_f16x16(builder, ir_ptr(context, builder, sig.args[0], args[0], at[b], h16))
                          for b in range(u)]
                    for j, row in enumerate(accs):
                        qj = builder.add(builder.add(qoa, builder.mul(k64(j), qsa)), it.index)
                        qj = splat(builder, builder.load(ir_ptr(context, builder, qty, qa, qj, f32)), 16)
                        for b, a in enumerate(row):
                            builder.store(_fma(builder, qj, kf[b], builder.load(a)), a)
                for j, row in enumerate(accs):
                    for b, a in enumerate(row):
                        o = builder.add(builder.add(soa, builder.mul(k64(j), ssa)),
                                        builder.mul(builder.add(b0, k64(b)), k64(16)))
                        builder.store(builder.load(a), ir_ptr(context, builder, sty, sa, o, v16), align=4)

        in_passes(builder, nba, U, passes)
        return context.get_dummy_value()

    return types.void(kt, koff, q, s, hd, nblk, g), codegen


@intrinsic(prefer_literal=True)
def _weighted16(typingctx, v, voff, w, out, hd, n, g):
    """out.a[out.off + j out.stride + c] += sum_p w.a[w.off + j w.stride + p] V(p, c) for
    c < hd, j < g (a constant), over the n positions p, V(p, c) the f16 bits
    v[voff + p hd + c]; w and out Rows: _vcols(g) vectors of 16 columns a pass over the
    positions (then single vectors for the rest), their g sums in registers; hd a
    multiple of 16."""
    if not isinstance(g, types.IntegerLiteral):
        return None
    G = g.literal_value
    C = _vcols(G)

    def codegen(context, builder, sig, args):
        voa, hda, na = args[1], args[4], args[5]
        wty, wa, woa, wsa = rows_ir(builder, sig, args, 2)
        oty, oa, ooa, osa = rows_ir(builder, sig, args, 3)
        f32, h16 = ir.FloatType(), ir.VectorType(ir.IntType(16), 16)
        v16 = ir.VectorType(f32, 16)
        k64 = lambda v: ir.Constant(voa.type, v)

        def passes(first, count, cw):
            # `count` passes of cw vectors of columns each, from column `first`
            accs = [[cgutils.alloca_once(builder, v16) for _ in range(cw)] for _ in range(G)]
            with cgutils.for_range(builder, count) as grp:
                c0 = builder.add(first, builder.mul(grp.index, k64(16 * cw)))
                outs = [[ir_ptr(context, builder, oty, oa,
                                builder.add(builder.add(ooa, builder.mul(k64(j), osa)),
                                            builder.add(c0, k64(16 * c))), v16) for c in range(cw)]
                        for j in range(G)]
                for j in range(G):
                    for c in range(cw):
                        builder.store(builder.load(outs[j][c], align=4), accs[j][c])
                with cgutils.for_range(builder, na) as pos:
                    row = builder.add(builder.add(voa, builder.mul(pos.index, hda)), c0)
                    for c in range(0, cw, 2):     # a line holds 2 vectors
                        prefetch_ir(context, builder, sig.args[0], args[0],
                                    builder.add(row, k64(_PREFETCH + 16 * c)))
                    vs = [_f16x16(builder, ir_ptr(context, builder, sig.args[0], args[0],
                                                  builder.add(row, k64(16 * c)), h16))
                          for c in range(cw)]
                    for j in range(G):
                        wj = builder.add(builder.add(woa, builder.mul(k64(j), wsa)), pos.index)
                        wj = splat(builder, builder.load(ir_ptr(context, builder, wty, wa, wj, f32)), 16)
                        for c in range(cw):
                            a = accs[j][c]
                            builder.store(_fma(builder, wj, vs[c], builder.load(a)), a)
                for j in range(G):
                    for c in range(cw):
                        builder.store(builder.load(accs[j][c]), outs[j][c], align=4)

        full = builder.udiv(hda, k64(16 * C))
        passes(k64(0), full, C)
        if C > 1:
            done = builder.mul(full, k64(16 * C))
            passes(done, builder.udiv(builder.sub(hda, done), k64(16)), 1)   # columns left
        return context.get_dummy_value()

    return types.void(v, voff, w, out, hd, n, g), codegen


@njit(cache=True, inline="always")
def _scores(kt, koff, q, s, hd, nblk, g):
    # _scores16 with g as a constant, for the group sizes Llama models use (1..8; the
    # caller takes the plain loops for others)
    if g == 4:
        _scores16(kt, koff, q, s, hd, nblk, 4)
    elif g == 3:
        _scores16(kt, koff, q, s, hd, nblk, 3)
    elif g == 8:
        _scores16(kt, koff, q, s, hd, nblk, 8)
    elif g == 2:
        _scores16(kt, koff, q, s, hd, nblk, 2)
    elif g == 1:
        _scores16(kt, koff, q, s, hd, nblk, 1)
    elif g == 6:
        _scores16(kt, koff, q, s, hd, nblk, 6)
    elif g == 5:
        _scores16(kt, koff, q, s, hd, nblk, 5)
    elif g == 7:
        _scores16(kt, koff, q, s, hd, nblk, 7)


@njit(cache=True, inline="always")
def _weighted(v, voff, w, out, hd, n, g):
    # _weighted16 with g as a constant (1..8, as _scores)
    if g == 4:
        _weighted16(v, voff, w, out, hd, n, 4)
    elif g == 3:
        _weighted16(v, voff, w, out, hd, n, 3)
    elif g == 8:
        _weighted16(v, voff, w, out, hd, n, 8)
    elif g == 2:
        _weighted16(v, voff, w, out, hd, n, 2)
    elif g == 1:
        _weighted16(v, voff, w, out, hd, n, 1)
    elif g == 6:
        _weighted16(v, voff, w, out, hd, n, 6)
    elif g == 5:
        _weighted16(v, voff, w, out, hd, n, 5)
    elif g == 7:
        _weighted16(v, voff, w, out, hd, n, 7)


@njit(cache=True, error_model="numpy")
def _add_row(x, y):
    # x (E,) += y (E,)
    for i in range(x.size):
        x[i] += y[i]


@njit(cache=True, error_model="numpy")
def add_inplace(x, y):
    # x (T, E) += y (T, E): the residual connection, row by row
    for t in range(x.shape[0]):
        _add_row(x[t], y[t])


# -- prefill's rows in parallel ----------------------------------------------------------
# A decoded token's one row is less work than starting and joining the workers; prefill's
# hundreds of rows go to the threads (serially, they would bound how much faster prefill
# gets with more threads: bench_decode_split.py --prefill shows their share).

@njit(cache=True, parallel=True)
def rmsnorm_rows(x, w, eps, out):
    for t in nb.prange(x.shape[0]):
        _rmsnorm_row(x[t], w, eps, out[t])


@njit(cache=True, parallel=True)
def rope_rows(x, cos, sin):
    for t in nb.prange(x.shape[0]):
        _rope_row(x[t], cos[t], sin[t])


@njit(cache=True, parallel=True)
def rope_neox_rows(x, cos, sin):
    for t in nb.prange(x.shape[0]):
        _rope_neox_row(x[t], cos[t], sin[t])


@njit(cache=True, parallel=True)
def head_norm_rows(x, off, nh, w, eps):
    for t in nb.prange(x.shape[0]):
        _head_norm_row(x[t], off, nh, w, eps)


@njit(cache=True, parallel=True)
def swiglu_rows(gate_up, out):
    for t in nb.prange(out.shape[0]):
        _swiglu_row(gate_up[t], out[t])


@njit(cache=True, parallel=True)
def geglu_rows(gate_up, out):
    for t in nb.prange(out.shape[0]):
        _geglu_row(gate_up[t], out[t])


@njit(cache=True, parallel=True)
def add_rows(x, y):
    for t in nb.prange(x.shape[0]):
        _add_row(x[t], y[t])


class Elementwise(NamedTuple):
    rmsnorm: object
    rope: object
    swiglu: object
    add: object
    rope_neox: object
    head_norm: object
    geglu: object


SERIAL = Elementwise(rmsnorm, rope, swiglu, add_inplace, rope_neox, head_norm, geglu)
PARALLEL = Elementwise(rmsnorm_rows, rope_rows, swiglu_rows, add_rows, rope_neox_rows,
                       head_norm_rows, geglu_rows)
PARALLEL_ROWS = 32    # rows from which a batch's elementwise kernels run in parallel
                      # (fewer: batched decode, speculative checks)


def elementwise(T: int) -> Elementwise:
    """The elementwise kernels for a batch of T rows, looked up in this module as it is
    called: the warm-up's dry run (jit.kernels_called) and bench_decode_split's region
    count stand in for kernels there, which a tuple of the kernels themselves would
    bypass."""
    g = globals()
    return Elementwise(*(g[k.py_func.__name__] for k in
                         (PARALLEL if T >= PARALLEL_ROWS else SERIAL)))
