"""Products of float weights (F32, F16, BF16) with f32 activations: decode's row dot
(float_row_dot, below) and prefill's GEMM, our own, the weights widened to f32 a block
at a time inside each thread, the products in registers.

F16 / BF16 prefill used to widen each run of rows into a buffer on one thread and hand
it to NumPy's BLAS (which needs f32): the widening cost about as much as the products
and the two alternated, and BLAS's workers spun against Numba's ("float GEMM",
bench/results/design_measurements.json). Here each thread claims blocks of ROWS weight
rows, widens them K_STEP columns at a time into its own buffer (in L1 / L2), and
multiplies them there with every token:

    out (T, d) = x (T, n) @ W (d, n)^T

    xp (P, n, PANEL)  x packed once per product: panel p holds tokens p PANEL.. with
                      column k of x one contiguous run of PANEL tokens (a tile's stream
                      of x is sequential, not a 2 KB stride through the cache's sets)
    per row block     acc (ROWS, P PANEL) += W32 (ROWS, kc) @ xp[:, k0:k0 + kc] (or a run
                      of its panels, where the blocks are too few for the threads)
    register tile     MR rows x 2 vectors of tokens (float_tile): per column k, 2 vector
                      loads of xp, MR broadcasts of W32, 2 MR fused multiply-adds

The register tile's shape is the instruction set's row (isa.Isa.float_tile): 12 rows x
32 tokens in AVX-512's 32 registers, 6 x 16 in AVX2's 16. Each output is one
multiply-add chain over the columns in order, the same for every token and thread.

BF16 weights, where the target has AVX512_BF16 (isa.Isa.bf16_pairs), take the same
blocks and tiles on vdpbf16ps instead (bf16_gemm): the rows' bf16 pairs are copied as
they are, x is rounded to bf16 and packed as pairs of columns (pack_tokens_bf16), and
each instruction adds two products a lane: twice the multiplies of an f32 FMA, at
llama.cpp's precision for these weights (x in bf16) rather than f32's.
"""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.core.errors import TypingError
from numba.extending import intrinsic

from .amx import bf16_tiles_begin, tile_bf16, tile_load, tile_store, tile_zero, tiles_end
from .claim import take
from .fp import bf16_bits, bf16_to_float_ir, float_at, half_to_float_ir
from .isa import call_llvm, splat
from .jit import njit, overload
from .simd import L2
from .target import TARGET

MR, LANES = TARGET.float_tile     # register tile: MR weight rows x 2 vectors of LANES tokens
ROWS = 8 * MR                     # weight rows per block a thread claims
PANEL = 2 * LANES                 # tokens per panel of the packed activations
K_STEP = 256                      # columns of a block widened at a time (ROWS x K_STEP f32)


def _view(context, builder, aty, arr):
    """(byte pointer to element 0, row stride in bytes) of a 2-d f32 array."""
    a = context.make_array(aty)(context, builder, arr)
    return builder.bitcast(a.data, ir.IntType(8).as_pointer()), builder.extract_value(a.strides, 0)


class _BFloat(ir.types.Type):
    """LLVM's bfloat, which llvmlite's IR has no class for: AVX512_BF16's intrinsics take
    vectors of it."""

    def _to_string(self):
        return "bfloat"

    def __eq__(self, other):
        return isinstance(other, _BFloat)

    def __hash__(self):
        return hash("bfloat")


def _register_tile(name, w, kc, x, acc, vecs, pairs):
    """(signature, codegen) of float_tile (pairs False) or bf16_tile (pairs True): the
    type checks and the column loop with MR x vecs accumulators in registers."""
    if not (isinstance(vecs, types.IntegerLiteral) and vecs.literal_value in (1, 2)):
        raise TypingError(f"{name}: vecs must be the constant 1 or 2")
    want = types.uint32 if pairs else types.float32
    for a, dt in ((w, want), (x, want), (acc, types.float32)):
        if not (isinstance(a, types.Array) and a.ndim == 2 and a.dtype == dt):
            raise TypingError(f"{name}: a 2-d {dt} array expected, got {a}")
    if w.layout != "C":
        raise TypingError(f"{name}: w must be C-contiguous rows of K_STEP columns")
    V = vecs.literal_value

    def codegen(context, builder, sig, args):
        f32, i32 = ir.FloatType(), ir.IntType(32)
        vf = ir.VectorType(f32, LANES)
        ve = ir.VectorType(i32 if pairs else f32, LANES)      # a vector of w's or x's elements
        bf = ir.VectorType(_BFloat(), 2 * LANES)
        i64 = ir.IntType(64)
        wp, _ = _view(context, builder, sig.args[0], args[0])
        ws = ir.Constant(i64, 4 * K_STEP)
        kc = args[1]
        xp, xs = _view(context, builder, sig.args[2], args[2])
        ap, as_ = _view(context, builder, sig.args[3], args[3])

        def vec_at(base, row, stride, v, ty):
            off = builder.add(builder.mul(row, stride), ir.Constant(i64, 4 * LANES * v))
            return builder.bitcast(builder.gep(base, [off]), ty.as_pointer())

        def step(wk, xk, a):
            # a + w x: one fused multiply-add a lane, or (pairs) vdpbf16ps's two bf16
            # products a lane added to it
            if not pairs:
                return call_llvm(builder, f"llvm.fma.v{LANES}f32", vf, [wk, xk, a])
            return call_llvm(builder, f"llvm.x86.avx512bf16.dpbf16ps.{32 * LANES}", vf,
                             [a, builder.bitcast(wk, bf), builder.bitcast(xk, bf)])

        accs = [[vec_at(ap, ir.Constant(i64, r), as_, v, vf) for v in range(V)] for r in range(MR)]
        vals = [[builder.load(p, align=4) for p in row] for row in accs]
        # the column loop with the accumulators as phi nodes (kept in registers)
        pre = builder.block
        loop = builder.append_basic_block(f"{name}.loop")
        done = builder.append_basic_block(f"{name}.done")
        builder.cbranch(builder.icmp_signed(">", kc, ir.Constant(i64, 0)), loop, done)
        builder.position_at_end(loop)
        k = builder.phi(i64)
        k.add_incoming(ir.Constant(i64, 0), pre)
        phis = [[builder.phi(vf) for _ in range(V)] for _ in range(MR)]
        for r in range(MR):
            for v in range(V):
                phis[r][v].add_incoming(vals[r][v], pre)
        xv = [builder.load(vec_at(xp, k, xs, v, ve), align=4) for v in range(V)]
        kb = builder.mul(k, ir.Constant(i64, 4))
        new = []
        for r in range(MR):
            wrow = builder.add(builder.mul(ir.Constant(i64, r), ws), kb)
            wr = builder.load(builder.bitcast(builder.gep(wp, [wrow]), ve.element.as_pointer()), align=4)
            b = splat(builder, wr, LANES)
            new.append([step(b, xv[v], phis[r][v]) for v in range(V)])
        k1 = builder.add(k, ir.Constant(i64, 1))
        end = builder.block
        k.add_incoming(k1, end)
        for r in range(MR):
            for v in range(V):
                phis[r][v].add_incoming(new[r][v], end)
        builder.cbranch(builder.icmp_signed("<", k1, kc), loop, done)
        builder.position_at_end(done)
        results = [[builder.phi(vf) for _ in range(V)] for _ in range(MR)]
        for r in range(MR):
            for v in range(V):
                results[r][v].add_incoming(vals[r][v], pre)
                results[r][v].add_incoming(new[r][v], end)
                builder.store(results[r][v], accs[r][v], align=4)
        return context.get_dummy_value()

    return types.void(w, types.int64, x, acc, vecs), codegen


@intrinsic(prefer_literal=True)
def float_tile(typingctx, w, kc, x, acc, vecs):
    """acc (MR, vecs LANES) += w[:, :kc] @ x (kc, vecs LANES), all f32; w (MR, K_STEP)
    C-contiguous (its row stride a constant, so the broadcasts' addresses are one
    register and fixed offsets), x and acc any row strides (columns contiguous); vecs a
    constant, 1 or 2. The accumulators stay in registers over the kc columns."""
    return _register_tile("float_tile", w, kc, x, acc, vecs, False)


@intrinsic(prefer_literal=True)
def bf16_tile(typingctx, w, kc, x, acc, vecs):
    """float_tile's product over kc pairs of columns, on AVX512_BF16's vdpbf16ps (only
    where the target has it: isa.Isa.bf16_pairs): w (MR, K_STEP) u32, each the bf16 bits
    of a row's columns 2j (low half) and 2j + 1, as the file holds them; x (kc, vecs
    LANES) u32, each the same of a token, rounded to bf16 (pack_tokens_bf16). Per lane
    and pair the two products are exact in f32 and added to the sum (the instruction's
    own rounding: inputs' subnormals as zero, the result's flushed)."""
    return _register_tile("bf16_tile", w, kc, x, acc, vecs, True)


@njit(cache=True)
def _widen(w, r, k0, dst, kc, kind):
    # dst[:kc] = W[r, k0:k0 + kc] as f32 (fp.float_at's kinds; the loop vectorises as
    # contiguous loads)
    for k in range(kc):
        dst[k] = float_at(w, r, k0 + k, kind)


ROW_STEP = 4 * LANES              # columns per step of float_row_dot: 4 accumulators
ROW_AHEAD = 16 << 10              # bytes ahead of its loads that float_row_dot prefetches


@intrinsic
def float_row_dot(typingctx, w, r, x, kind):
    """f32: row r of W (d, n) times x[:m], m = n less n % ROW_STEP (the caller adds the
    rest); W f32, or f16 (kind 1) / bf16 (kind 2) bits as u16, C-contiguous; x f32.
    Decode's product of one row: four vectors of LANES accumulators take its columns in
    turn, so consecutive multiply-adds do not wait on each other (LLVM's own loop kept
    one), and each step prefetches the lines ROW_AHEAD bytes on into L2, into the next
    rows (the hardware's prefetch alone left decode waiting on memory: "float decode
    prefetch", bench/results/design_measurements.json). The four are added, then their
    lanes by halves."""
    if not (isinstance(w, types.Array) and w.ndim == 2 and w.layout == "C"
            and w.dtype in (types.float32, types.uint16)):
        raise TypingError(f"float_row_dot: C-contiguous 2-d float32 or uint16 weights expected, got {w}")
    if not (isinstance(x, types.Array) and x.ndim == 1 and x.dtype == types.float32):
        raise TypingError(f"float_row_dot: x must be 1-d float32, got {x}")
    bits16 = w.dtype == types.uint16

    def codegen(context, builder, sig, args):
        f32, i16, i32, i64 = ir.FloatType(), ir.IntType(16), ir.IntType(32), ir.IntType(64)
        vf = ir.VectorType(f32, LANES)
        wa = context.make_array(sig.args[0])(context, builder, args[0])
        xa = context.make_array(sig.args[2])(context, builder, args[2])
        n = builder.extract_value(wa.shape, 1)
        row = builder.gep(wa.data, [builder.mul(args[1], n)])        # element pointer
        row8 = builder.bitcast(row, ir.IntType(8).as_pointer())      # byte pointer
        m = builder.sub(n, builder.srem(n, ir.Constant(i64, ROW_STEP)))
        zero = ir.Constant(vf, None)

        def f16(bits):
            return half_to_float_ir(builder, bits)

        def bf16(bits):
            return bf16_to_float_ir(builder, bits)

        def row_sum(widen):
            # the loop over the row's steps, from the current block; leaves the builder
            # after it and returns (the four accumulators added, that block)
            wv = vf if widen is None else ir.VectorType(i16, LANES)
            pre = builder.block
            loop = builder.append_basic_block("float_row_dot.loop")
            done = builder.append_basic_block("float_row_dot.done")
            builder.cbranch(builder.icmp_signed(">", m, ir.Constant(i64, 0)), loop, done)
            builder.position_at_end(loop)
            k = builder.phi(i64)
            k.add_incoming(ir.Constant(i64, 0), pre)
            phis = [builder.phi(vf) for _ in range(4)]
            new = []
            esize = 4 if widen is None else 2
            for line in range(0, ROW_STEP * esize, 64):     # the step's lines ROW_AHEAD on
                at = builder.add(builder.mul(k, ir.Constant(i64, esize)), ir.Constant(i64, ROW_AHEAD + line))
                call_llvm(builder, "llvm.prefetch.p0", ir.VoidType(),
                          [builder.gep(row8, [at]), ir.Constant(i32, 0), ir.Constant(i32, L2), ir.Constant(i32, 1)])
            for a, acc in enumerate(phis):
                acc.add_incoming(zero, pre)
                ka = builder.add(k, ir.Constant(i64, a * LANES))
                wk = builder.load(builder.bitcast(builder.gep(row, [ka]), wv.as_pointer()), align=2)
                xk = builder.load(builder.bitcast(builder.gep(xa.data, [ka]), vf.as_pointer()), align=4)
                new.append(call_llvm(builder, f"llvm.fma.v{LANES}f32", vf,
                                     [wk if widen is None else widen(wk), xk, acc]))
            k1 = builder.add(k, ir.Constant(i64, ROW_STEP))
            end = builder.block
            k.add_incoming(k1, end)
            for acc, v in zip(phis, new):
                acc.add_incoming(v, end)
            builder.cbranch(builder.icmp_signed("<", k1, m), loop, done)
            builder.position_at_end(done)
            sums = []
            for v in new:
                s = builder.phi(vf)
                s.add_incoming(zero, pre)
                s.add_incoming(v, end)
                sums.append(s)
            return builder.fadd(builder.fadd(sums[0], sums[1]), builder.fadd(sums[2], sums[3])), done

        if not bits16:
            v, _ = row_sum(None)
        else:                                 # kind picks the widening, outside the loops
            is_f16 = builder.icmp_signed("==", args[3], ir.Constant(args[3].type, 1))
            with builder.if_else(is_f16) as (then, other):
                with then:
                    v16, b16 = row_sum(f16)
                with other:
                    vb, bb = row_sum(bf16)
            v = builder.phi(vf)
            v.add_incoming(v16, b16)
            v.add_incoming(vb, bb)
        lanes = LANES
        while lanes > 1:                      # the lanes' sum by halves
            lanes //= 2
            hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(i32, LANES),
                                                          [lanes + i if i < lanes else i for i in range(LANES)]))
            v = builder.fadd(v, hi)
        return builder.extract_element(v, ir.Constant(i32, 0))

    return types.float32(w, types.int64, x, types.int64), codegen


@njit(cache=True, parallel=True)
def pack_tokens(x, xp):
    # x (T, n) f32 -> xp (P, n, PANEL): panel p holds tokens p PANEL.. transposed, so a
    # tile's column k is one contiguous run (tokens past T zero: their sums are never
    # read, but garbage there could be subnormal, slow on some cores)
    T, n = x.shape
    runs = (n + 63) // 64
    for i in prange(xp.shape[0] * runs):
        p = i // runs
        k0 = (i - p * runs) * 64
        for k in range(k0, min(n, k0 + 64)):
            for j in range(PANEL):
                t = p * PANEL + j
                xp[p, k, j] = x[t, k] if t < T else np.float32(0)


@njit(cache=True, parallel=True)
def pack_tokens_bf16(x, xp2):
    # x (T, n) f32, n even -> xp2 (P, n/2, panel) u32: pack_tokens' layout of column pairs
    # (panel PANEL for bf16_tile, AMX_BF16_TOKENS for AMX's B tiles), each x[t, 2j] and
    # x[t, 2j + 1] rounded to bf16 (fp.bf16_bits) in the low and high half (tokens past
    # T zero)
    T, n = x.shape
    m = n // 2
    panel = xp2.shape[2]
    xb = x.view(np.uint32)
    runs = (m + 63) // 64
    for i in prange(xp2.shape[0] * runs):
        p = i // runs
        j0 = (i - p * runs) * 64
        for j in range(j0, min(m, j0 + 64)):
            for u in range(panel):
                t = p * panel + u
                if t < T:
                    lo = np.uint32(bf16_bits(xb[t, 2 * j]))
                    hi = np.uint32(bf16_bits(xb[t, 2 * j + 1]))
                    xp2[p, j, u] = lo | (hi << np.uint32(16))
                else:
                    xp2[p, j, u] = 0


@njit(cache=True)
def _block(w, kind, xp, T, out, r0, p0, p1, wb, acc):
    # out[p0 PANEL:p1 PANEL (at most T), r0:r0 + nr] = rows r0.. of W times panels p0..p1
    # of the packed tokens xp, in the thread's buffers wb (ROWS, K_STEP) and acc (ROWS,
    # P PANEL; columns as xp's tokens)
    d, n = w.shape
    nr = min(ROWS, d - r0)
    tiles = -(-nr // MR) * MR
    acc[:tiles, p0 * PANEL:p1 * PANEL] = 0    # (rows nr..tiles: products never read)
    for k0 in range(0, n, K_STEP):
        kc = min(K_STEP, n - k0)
        for r in range(nr):
            _widen(w, r0 + r, k0, wb[r], kc, kind)
        for p in range(p0, p1):
            t0 = p * PANEL
            if T - t0 > LANES:
                for m in range(0, tiles, MR):
                    float_tile(wb[m:m + MR], kc, xp[p, k0:k0 + kc],
                               acc[m:m + MR, t0:t0 + PANEL], 2)
            else:                             # the last tokens fill one vector
                for m in range(0, tiles, MR):
                    float_tile(wb[m:m + MR], kc, xp[p, k0:k0 + kc, :LANES],
                               acc[m:m + MR, t0:t0 + LANES], 1)
    for t in range(p0 * PANEL, min(T, p1 * PANEL)):
        for r in range(nr):
            out[t, r0 + r] = acc[r, t]


@njit(cache=True)
def _block_bf16(w2, xp2, T, out, r0, p0, p1, wb, acc):
    # _block on bf16_tile: w2 (d, n/2) u32 the file's bf16 weights as column pairs, xp2
    # pack_tokens_bf16's, wb (ROWS, K_STEP) u32 (K_STEP pairs: the rows copied, not
    # widened)
    d, m = w2.shape
    nr = min(ROWS, d - r0)
    tiles = -(-nr // MR) * MR
    acc[:tiles, p0 * PANEL:p1 * PANEL] = 0    # (rows nr..tiles: products never read)
    for j0 in range(0, m, K_STEP):
        jc = min(K_STEP, m - j0)
        wb[:nr, :jc] = w2[r0:r0 + nr, j0:j0 + jc]
        for p in range(p0, p1):
            t0 = p * PANEL
            if T - t0 > LANES:
                for k in range(0, tiles, MR):
                    bf16_tile(wb[k:k + MR], jc, xp2[p, j0:j0 + jc], acc[k:k + MR, t0:t0 + PANEL], 2)
            else:                             # the last tokens fill one vector
                for k in range(0, tiles, MR):
                    bf16_tile(wb[k:k + MR], jc, xp2[p, j0:j0 + jc, :LANES],
                              acc[k:k + MR, t0:t0 + LANES], 1)
    for t in range(p0 * PANEL, min(T, p1 * PANEL)):
        for r in range(nr):
            out[t, r0 + r] = acc[r, t]


def _item(w, kind, xp, T, out, r0, p0, p1, wb, acc):
    """_gemm's work item: _block, or _block_bf16 where the weights come as bf16 pairs
    (u32); chosen by the arguments' types, so that a target without AVX512_BF16 never
    compiles bf16_tile."""


@overload(_item)
def _item_typed(w, kind, xp, T, out, r0, p0, p1, wb, acc):
    if wb.dtype == types.uint32:
        return lambda w, kind, xp, T, out, r0, p0, p1, wb, acc: _block_bf16(w, xp, T, out, r0, p0, p1, wb, acc)
    return lambda w, kind, xp, T, out, r0, p0, p1, wb, acc: _block(w, kind, xp, T, out, r0, p0, p1, wb, acc)


@njit(cache=True, parallel=True)
def _gemm(w, kind, xp, T, out, parts, wbufs, accs, counter):
    # items: the row blocks x `parts` runs of panels, each claimed by the next free
    # thread (claim.py); a run of panels widens its rows again, so parts > 1 only where
    # the blocks alone would leave threads idle
    blocks = -(-w.shape[0] // ROWS)
    P = xp.shape[0]
    items = blocks * parts
    counter[0] = 0
    for _ in prange(items):
        while True:
            i = take(counter)
            if i >= items:
                break
            b = i // parts
            q = i - b * parts
            me = numba.get_thread_id()
            _item(w, kind, xp, T, out, b * ROWS, q * P // parts, (q + 1) * P // parts,
                  wbufs[me], accs[me])


def panels(T: int) -> int:
    """Panels of PANEL tokens that hold T tokens."""
    return -(-T // PANEL)


def token_parts(d: int, T: int, threads: int) -> int:
    """Runs of panels to split the tokens into: enough for 2 items a thread (a 2048-row
    product is 22 blocks of 96 rows, for 16 threads), at most one a panel."""
    return max(1, min(panels(T), -(-2 * threads // -(-d // ROWS))))


def float_gemm(w, kind, x, out, xp, wbufs, accs, counter, parts=1):
    """out (T, d) = x (T, n) @ W^T, W (d, n) f32 (kind 0) or f16 / bf16 bits as u16 (kind
    1 / 2), the tokens in `parts` runs (token_parts; the sums do not depend on it).
    Scratch: xp (panels(T), n, PANEL) f32; per thread wbufs (threads, ROWS, K_STEP) and
    accs (threads, ROWS, panels(T) PANEL) f32; counter (1,) int64."""
    pack_tokens(x, xp)
    _gemm(w, kind, xp, x.shape[0], out, parts, wbufs, accs, counter)


def bf16_gemm(w, x, out, xp2, wbufs, accs, counter, parts=1):
    """float_gemm of bf16 weights (u16 bits, n even) on bf16_tile, x rounded to bf16 as
    llama.cpp rounds it for these weights: where target.BF16_PAIRS. Scratch as
    float_gemm's, but xp2 (panels(T), n/2, PANEL) u32."""
    pack_tokens_bf16(x, xp2)
    _gemm(w.view(np.uint32), 2, xp2, x.shape[0], out, parts, wbufs.view(np.uint32), accs, counter)


# --- BF16 on AMX tiles (amx.py's tdpbf16ps) ---------------------------------------------------
#
#     out (T, d) = x (T, n) @ W (d, n)^T, per work item a block of `rows` weight rows:
#     per pair of token groups (32 tokens) and pair of 16-row strips, four C tiles
#     (strip x group) take the n/32 column blocks in turn, A the rows read in place, B x's
#     tiles; the block's rows stay in L2 across the token groups.

AMX_BF16_TOKENS = 16              # tokens a B tile holds


def amx_bf16_rows(n: int) -> int:
    """Weight rows a work item multiplies with every token: about 512 KiB of bf16 (in a
    core's L2), 32 to 128."""
    return max(32, min(128, (1 << 19) // (2 * n) // 32 * 32))


@njit(cache=True)
def _amx_bf16_strips(src, base, span, nr, xt, T, out, r0, cb):
    # out[:T, r0:r0 + nr] from rows base..base + span of src (span a multiple of 32,
    # rows past nr zero) on the tiles; xt (G, m, 16) u32 x's B tiles (G even), cb (4, 16,
    # 16) f32 the C tiles' landing place
    m = src.shape[1]
    stride = 4 * m                    # bytes from one row to the next
    G = xt.shape[0]
    bf16_tiles_begin()
    for g in range(0, G, 2):
        b0 = g * m * AMX_BF16_TOKENS
        b1 = b0 + m * AMX_BF16_TOKENS
        for s in range(0, span, 32):
            tile_zero(4)
            tile_zero(5)
            tile_zero(6)
            tile_zero(7)
            a0 = (base + s) * m
            a1 = a0 + 16 * m
            for kb in range(m // 16):
                tile_load(0, src, a0 + 16 * kb, stride)
                tile_load(1, src, a1 + 16 * kb, stride)
                tile_load(2, xt, b0 + 256 * kb, 64)
                tile_load(3, xt, b1 + 256 * kb, 64)
                tile_bf16(4, 0, 2)
                tile_bf16(5, 0, 3)
                tile_bf16(6, 1, 2)
                tile_bf16(7, 1, 3)
            tile_store(4, cb, 0)
            tile_store(5, cb, 256)
            tile_store(6, cb, 512)
            tile_store(7, cb, 768)
            for i in range(2):                # C tile 2 i + j: strip i, token group g + j
                rr = min(16, nr - s - 16 * i)
                for j in range(2):
                    t0 = (g + j) * AMX_BF16_TOKENS
                    for t in range(t0, min(T, t0 + AMX_BF16_TOKENS)):
                        for r in range(rr):
                            out[t, r0 + s + 16 * i + r] = cb[2 * i + j, r, t - t0]
    tiles_end()


@njit(cache=True, parallel=True)
def _amx_bf16(w2, xt, T, out, rows, pads, cbs):
    # the blocks of `rows` weight rows, one a work item; the last, where its strips would
    # run past the last row, from a zero-padded copy (pads[thread] (rows, m) u32)
    d = w2.shape[0]
    for b in prange(-(-d // rows)):
        me = numba.get_thread_id()
        r0 = b * rows
        nr = min(rows, d - r0)
        span = -(-nr // 32) * 32
        if r0 + span <= d:
            _amx_bf16_strips(w2, r0, span, nr, xt, T, out, r0, cbs[me])
        else:
            pad = pads[me]
            pad[:nr] = w2[r0:d]
            pad[nr:span] = 0
            _amx_bf16_strips(pad, 0, span, nr, xt, T, out, r0, cbs[me])


def amx_tokens(T: int) -> int:
    """Token groups of x's B tiles for T tokens: whole pairs of AMX_BF16_TOKENS."""
    return -(-T // (2 * AMX_BF16_TOKENS)) * 2


def amx_bf16_gemm(w, x, out, xt, pads, cbs):
    """out (T, d) = x (T, n) @ W^T, W (d, n) bf16 bits as u16 (n a multiple of 32), x
    rounded to bf16 as bf16_gemm rounds it, on AMX-BF16 tiles (amx.bf16_enabled() must be
    True). Scratch: xt (amx_tokens(T), n/2, AMX_BF16_TOKENS) u32; per thread pads
    (threads, amx_bf16_rows(n), n/2) u32 and cbs (threads, 4, 16, 16) f32."""
    pack_tokens_bf16(x, xt)
    _amx_bf16(w.view(np.uint32), xt, x.shape[0], out, amx_bf16_rows(x.shape[1]), pads, cbs)
