"""AMX (Advanced Matrix Extensions) int8 tile products for prefill of the per-32-block
formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL), of the K-quants Q4_K, Q5_K, Q6_K, Q3_K
and Q2_K and of IQ4_XS, bit-identical to simd.blocks_gemm's (simd.q4k_gemm's,
simd.q6_gemm's, simd.iq4xs_gemm's) VNNI products; and the bf16 tile intrinsics of BF16
weights' prefill (the end of this module, float_gemm.amx_bf16_gemm).

One tdpbssd / tdpbsud multiplies a tile of 16 rows of x (A: 16 tokens x the 32 int8
of one block, packed 512 bytes in a row by records.amx_a_tiles) by one block of a strip
of 16 weight rows (B: 8 rows x 64 bytes, VNNI-packed: byte 4 g + i of column l =
element 4 g + i of weight row l). The records' quads (simd.py: record[quads + 64 g + 4 l + i] =
byte 4 g + i of row l's block bytes) ARE that B layout: a Q8_0 block's 512 quad bytes
load as B directly; a Q4 block's 256 nibble bytes unpack (and, shift) into 512 bytes,
B rows 0..3 the low nibbles (elements 0..15), rows 4..7 the high ones (16..31).

The int32 result C[t][r] is the exact S of blocks_gemm: tdpbssd (s8 x s8) for Q8_0;
for Q4_0 the nibbles less 8 (-8..7, s8), so C = S - 8 xs8 with no correction, and
Q5_0's 5-bit values (the fifth bits or-ed in) less 16, IQ4_NL's nibbles looked up
(IQ4_VALUES, s8: C = S); for Q4_1 and Q5_1 tdpbsud (s8 x u8 values). The scales then go on in the float operations of
blocks_gemm, in its order (per record of G blocks: s = fma(float(S), d dx, s) block by
block [+ fma(m, xsum, s)], then total += s), so every output has the same bits. A Q4_K
record (a super-block of 16 rows) holds its 8 sub-blocks' nibbles as the same quads:
tdpbsud per sub-block, then q4k_gemm's operations (s = fma(float(S), sc dx, s), mn =
fma(m, xsum, mn) sub-block by sub-block, then total = fma(d, s, total), total =
fma(-dmin, mn, total)). Q5_K's records are Q4_K's with the fifth bits or-ed into the
unpacked bytes (values 0..31, the same float steps). Q6_K's scales are per 16 weights,
so its tiles are half-blocks (A: 16 tokens x 16 bytes, B: 4 rows x 64) and its values
go in less 32 (s8, tdpbssd): C_h = S_h - 32 xs_h exactly, and q6_gemm's integer
sc0 C_0 + sc1 C_1 is formed in f32 as fma(C_1, sc1, C_0 sc0), exact because every
partial stays below 2^24 (|C_h| <= 16 * 32 * 127, |sc| <= 128), before its
fma(dot, dx, s) and fma(d, s, total). Q2_K's scales are per 16 weights too, but its
values (0..3) times their 4-bit scales fit a byte (<= 45): its B tiles are whole blocks
of the scaled values, so tdpbsud gives q6_gemm's integer dot sc0 S_0 + sc1 S_1 itself,
then its float steps (s = fma(float(C), dx, s), mn = fma(m1, xsum16_1, fma(m0,
xsum16_0, mn)) with x's sums per 16 as rounded, fma(d, s, total), fma(-dmin, mn,
total)): half the tile products and float steps a block of Q6_K's. Q3_K's values less
4 (-4..3) times their signed 6-bit scales lie in -124..128: its B bytes add Q3K_BIAS
(124) to make them unsigned (tdpbsud), C = dot + 124 xs8 (xs8 the block's sum of x8),
and dot = float(C) - 124 xs8 is exact in f32 (both below 2^24), then q6_gemm's
fma(dot, dx, s) and fma(d, s, total). IQ4_XS's records take Q4_K's steps without the
mins: its nibbles looked up (s8, tdpbssd, C = S), s = fma(float(C), sc dx, s) with its
int8 sc, then fma(d, s, total).

Linux hands out the tile state only to a process that asked for it
(arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)); without it the first tile
instruction dies of SIGILL. `enabled()` asks once; where it is refused (an old kernel,
no AMX, a VM without XFD) or Numba's target lacks amx-tile / amx-int8, prefill stays on
the VNNI kernels. Each kernel call loads its tile configuration itself (ldtilecfg is
per thread, and a parallel region's work items run on any thread) and releases the
tiles at its end.
"""
from __future__ import annotations

import ctypes
import os

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.extending import intrinsic

from .fp import half_to_float_ir
from .simd import (BLOCK_BYTES, BLOCK_FIVE, BLOCK_HEAD, BLOCK_LUT, BLOCK_MINS, BLOCK_OFFSET, BLOCK_QUADS,
                   IQ4_VALUES, IQ4XS_D, IQ4XS_QS, IQ4XS_RECORD, IQ4XS_SC, KIND_Q8_0, Q4K_D, Q4K_DMIN, Q4K_M,
                   Q2K_DMIN, Q2K_RECORD, Q2K_SC, Q3K_RECORD, Q4K_QS, Q4K_RECORD, Q4K_SC, Q5K_QH, Q5K_RECORD, Q6K_D, Q6K_QS,
                   Q6K_RECORD, Q6K_SC, RECORD_ROWS, Operands, _k16_values, _q6_values, call_llvm, fifth_bits_moved,
                   splat, tile_constants)
from .target import _ARCH, FEATURES, TARGET

# Numba's target has the tile instructions on top of the chosen instruction set (isa.py's
# row: its `tiles`), else the kernels compile to nothing and enabled() is False: LLVM
# aborts on an intrinsic its target lacks
COMPILED = TARGET.has_tiles(FEATURES) and _ARCH == "x86_64"
AMX_TOKENS = 16             # rows of x per A tile (a tile's 16 rows)
# amx_blocks_gemm's kinds for the K-quant records (simd.py's Q4K_*, Q5K_*, Q6K_* layouts),
# after simd's per-32-block KIND_Q4_0 .. KIND_IQ4_NL; IQ4_XS's (simd.py's IQ4XS_*),
# Q2_K's (simd.py's Q2K_*) and Q3_K's (Q3K_RECORD)
KIND_Q4_K, KIND_Q5_K, KIND_Q6_K, KIND_IQ4_XS, KIND_Q2_K, KIND_Q3_K = 6, 7, 8, 9, 10, 11
# what Q3_K's B bytes add to each sc (q - 4) (-124..128) to make it unsigned (0..252)
Q3K_BIAS = 124

SYS_ARCH_PRCTL = 158        # x86-64
ARCH_GET_XCOMP_PERM, ARCH_REQ_XCOMP_PERM = 0x1022, 0x1023
XFEATURE_XTILEDATA = 18


def request_permission() -> bool:
    """Ask Linux for the tile data state for this process (all its threads); True if
    it is granted (read back with ARCH_GET_XCOMP_PERM)."""
    if _ARCH != "x86_64" or not os.uname().sysname == "Linux":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        call = lambda *a: libc.syscall(*(ctypes.c_long(v) if isinstance(v, int) else v for v in a))
        if call(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0:
            return False
        bits = ctypes.c_uint64()
        if call(SYS_ARCH_PRCTL, ARCH_GET_XCOMP_PERM, ctypes.byref(bits)) != 0:
            return False
        return bool(bits.value >> XFEATURE_XTILEDATA & 1)
    except (OSError, AttributeError):
        return False


_enabled: bool | None = None


def enabled() -> bool:
    """Whether prefill of the per-32-block formats runs on AMX tiles: the kernels have
    the instructions, EDGELLAMA_AMX is not 0, and Linux granted the tile state (asked
    once, on the first call)."""
    global _enabled
    if _enabled is None:
        _enabled = COMPILED and os.environ.get("EDGELLAMA_AMX", "1") != "0" and request_permission()
    return _enabled


def use(on: bool) -> bool:
    """Turn the AMX prefill on (where it can run) or off; returns whether it is on.
    For tests and benchmarks that compare the two paths in one process."""
    global _enabled
    _enabled = bool(on) and COMPILED and request_permission()
    return _enabled


def kernels_name() -> str:
    """The instructions the matrix products run on, for reports."""
    name = TARGET.name
    if not enabled():
        return name
    return name + f" + AMX (tdpbssd/tdpbsud{', tdpbf16ps' if BF16_COMPILED else ''}) prefill"


# Tile registers: two sets of A (x rows), B (weights), C (int32 products), two blocks
# in flight (load, multiply, store of one block: 10.9 ns with two sets, 12.0 with one,
# a micro-benchmark on this Xeon)
SETS = ((0, 1, 2), (3, 4, 5))
GROUPS = 4                  # token groups (of AMX_TOKENS) per call: a Q4 block is unpacked once for them


def tile_config(kind: int) -> list[int]:
    """ldtilecfg's 64 bytes for records of `kind`, palette 1: byte 0 the palette, u16
    colsb of tile i at 16 + 2 i, u8 rows of tile i at 48 + i. A tile multiplies K = 32
    bytes a row (a block), Q6_K's K = 16 (a half-block, its scales' span)."""
    K = 16 if kind == KIND_Q6_K else 32
    cfg = [0] * 64
    cfg[0] = 1
    for ta, tb, tc in SETS:
        for tile, rows, colsb in ((ta, AMX_TOKENS, K), (tb, K // 4, 64), (tc, AMX_TOKENS, 64)):
            cfg[16 + 2 * tile] = colsb & 0xFF
            cfg[17 + 2 * tile] = colsb >> 8
            cfg[48 + tile] = rows
    return cfg


@intrinsic(prefer_literal=True)
def amx_blocks_gemm(typingctx, q, x, acc, shape):
    """One tile of a per-32-block format's records (q: R rows of shape.nb blocks,
    shape.group blocks a record, simd.py's layout), or of a K-quant's (KIND_Q4_K,
    KIND_Q5_K, KIND_Q6_K, KIND_Q3_K, KIND_Q2_K: a record a super-block, its 8 blocks of
    32 the blocks; Q6_K's tile products are half-blocks, Q3_K's and Q2_K's B bytes their
    values times their scales), times shape.tokens rows t0.. of x
    (a multiple of AMX_TOKENS, at most GROUPS of them; t0 a multiple of AMX_TOKENS):
    acc[k R + r] (f32, R = acc.size // (GROUPS * AMX_TOKENS)) = row r . x_{t0+k}, every
    bit as simd.blocks_gemm (simd.q4k_gemm, simd.q6_gemm) gives it. x: simd.Q8X of x8 as A tiles,
    flat (Tp/16, nb, 16, 32) int8 (group, block, token, byte), xd, xsum flat (Tp*nb,)
    f32; shape.kind a constant. Per strip of 16 rows and record: a Q4 record's
    blocks unpacked to B bytes once; per token group, each block's 16 x 16 int32
    products by one tile multiply (two blocks in flight), stored to a buffer of the
    record's blocks; then the float sums, block by block (blocks_gemm's order), the
    16 tokens' sums in registers."""
    _, KIND, _ = tile_constants("amx_blocks_gemm", shape, constant_tokens=False)

    def codegen(context, builder, sig, args):
        if not COMPILED:        # never called (enabled() is False): nothing to emit
            return context.get_dummy_value()
        i8, i16, i32, i64, f32 = (ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64),
                                  ir.FloatType())
        i8p = ir.IntType(8).as_pointer()
        ops = Operands(context, builder, sig, args)
        nba, ga, t0a = ops.nb, ops.group, ops.t0
        k64 = lambda v: ir.Constant(i64, v)
        nga = builder.udiv(ops.tokens, k64(AMX_TOKENS))        # token groups
        tile = lambda v: ir.Constant(i8, v)
        ptr = ops.ptr
        vf, vi = ir.VectorType(f32, 16), ir.VectorType(i32, 16)
        v64 = ir.VectorType(i8, 64)
        fma = lambda a, b, c: call_llvm(builder, "llvm.fma.v16f32", vf, [a, b, c])
        amx = lambda name, *a: _amx_call(builder, name, *a)
        _load_tile_config(builder, tile_config(KIND))
        # C of each tile product of a record (G <= 8 blocks, Q6_K's 16 half-blocks) for
        # two token groups, and a record's unpacked blocks as B bytes
        units = 2 if KIND == KIND_Q6_K else 1                 # tile products per block
        cbuf = cgutils.alloca_once(builder, ir.ArrayType(vi, 2 * 8 * units * AMX_TOKENS))
        cbuf.align = 64
        wbuf = cgutils.alloca_once(builder, ir.ArrayType(v64, 8 * 8))
        wbuf.align = 64
        cbase = builder.bitcast(cbuf, vi.as_pointer())
        wbase = builder.bitcast(wbuf, v64.as_pointer())
        sums = [cgutils.alloca_once(builder, vf) for _ in range(AMX_TOKENS)]
        k4 = KIND in (KIND_Q4_K, KIND_Q5_K)
        xs = KIND == KIND_IQ4_XS
        mins = ([cgutils.alloca_once(builder, vf) for _ in range(AMX_TOKENS)] if k4 or KIND == KIND_Q2_K
                else [])

        acc_n = ops.nitems("acc")
        R = builder.udiv(acc_n, k64(GROUPS * AMX_TOKENS))
        nsb = builder.udiv(nba, ga)                           # records per strip
        if k4 or xs or KIND in (KIND_Q6_K, KIND_Q2_K, KIND_Q3_K):
            size, qs, qb = ((Q6K_RECORD, Q6K_QS, 384) if KIND == KIND_Q6_K else
                            (Q2K_RECORD, Q6K_QS, 128) if KIND == KIND_Q2_K else
                            (Q3K_RECORD, Q6K_QS, 192) if KIND == KIND_Q3_K else
                            (IQ4XS_RECORD, IQ4XS_QS, 256) if xs else
                            (Q5K_RECORD if KIND == KIND_Q5_K else Q4K_RECORD, Q4K_QS, 256))
            record, share = k64(size), size // 8                  # share: a block's, to prefetch
            quads_at = lambda rec, k: builder.add(builder.add(rec, k64(qs)), builder.mul(k, k64(qb)))
        else:
            record, share = builder.mul(ga, k64(BLOCK_BYTES[KIND])), BLOCK_BYTES[KIND]
            quads_at = lambda rec, k: builder.add(builder.add(rec, builder.mul(ga, k64(BLOCK_HEAD[KIND]))),
                                                  builder.mul(k, k64(BLOCK_QUADS[KIND])))
        tdp = "tdpbsud" if KIND in (*BLOCK_MINS, KIND_Q4_K, KIND_Q5_K, KIND_Q2_K, KIND_Q3_K) else "tdpbssd"
        offset = BLOCK_OFFSET[KIND] if KIND < len(BLOCK_OFFSET) else 0

        def tile_block(rec, sb, tg, u, tset):
            """Tile product u of the record (block u; Q6_K: half u % 2 of block u // 2)
            times token group tg, into tile set tset's C."""
            ta, tb, tc = tset
            k = builder.udiv(u, k64(units))
            h = builder.urem(u, k64(units))                   # half-block: 16 of a block's 32
            if KIND == KIND_Q8_0:
                bptr = ptr("q", quads_at(rec, k), i8)
            else:                                             # Q6_K's half h: B rows 4h..4h+3
                bptr = builder.bitcast(builder.gep(wbase, [builder.add(builder.mul(k, k64(8)),
                                                                       builder.mul(h, k64(4)))]), i8p)
            b = builder.add(builder.mul(sb, ga), k)
            xo = builder.mul(builder.add(builder.mul(builder.add(builder.udiv(t0a, k64(AMX_TOKENS)), tg),
                                                     nba), b), k64(32 * AMX_TOKENS))
            amx("tileloadd64", tile(tb), bptr, k64(64))
            amx("tileloadd64", tile(ta), ptr("x8", builder.add(xo, builder.mul(h, k64(16))), i8), k64(32))
            amx("tilezero", tile(tc))
            amx(tdp, tile(tc), tile(ta), tile(tb))

        def store_block(hb, u, tset):
            cptr = builder.gep(cbase, [builder.add(hb, builder.mul(u, k64(AMX_TOKENS)))])
            amx("tilestored64", tile(tset[2]), builder.bitcast(cptr, i8p), k64(64))

        def half(tg):
            """cbuf's half for token group tg (of 8 x units tile products x 16 rows of C)."""
            return builder.mul(builder.and_(tg, k64(1)), k64(8 * units * AMX_TOKENS))

        def products(rec, sb, tg):
            """The integer products of the record's tile products for token group tg ->
            cbuf: two at a time, or one (G = 1)."""
            hb = half(tg)
            n_units = builder.mul(ga, k64(units))
            odd = builder.icmp_unsigned("==", n_units, k64(1))
            with builder.if_else(odd) as (one, two):
                with one:
                    tile_block(rec, sb, tg, k64(0), SETS[0])
                    store_block(hb, k64(0), SETS[0])
                with two:
                    with cgutils.for_range(builder, builder.udiv(n_units, k64(2))) as j_loop:
                        u0 = builder.mul(j_loop.index, k64(2))
                        u1 = builder.add(u0, k64(1))
                        tile_block(rec, sb, tg, u0, SETS[0])
                        tile_block(rec, sb, tg, u1, SETS[1])
                        store_block(hb, u0, SETS[0])
                        store_block(hb, u1, SETS[1])

        def over_blocks(sb, tg, body):
            """Zero token group tg's sums (and mins), then body(k, blk, hb) for each block k
            of the record: blk its index among x's blocks of the group (token t's scale
            and sum at blk AMX_TOKENS + t), hb the group's half of cbuf."""
            for a in (*sums, *mins):
                builder.store(ir.Constant(vf, None), a)
            gi = builder.add(builder.udiv(t0a, k64(AMX_TOKENS)), tg)     # token group in x
            hb = half(tg)
            with cgutils.for_range(builder, ga) as k_loop:
                k = k_loop.index
                body(k, builder.add(builder.mul(gi, nba), builder.add(builder.mul(sb, ga), k)), hb)

        def at_token(blk, t):
            """Token t's index in x's block scales and sums (xd, xsum) of block blk."""
            return builder.add(builder.mul(blk, k64(AMX_TOKENS)), k64(t))

        def finish_record(rec, r0, tg, d_at, dmin_at=None):
            """acc rows of token group tg = fma(d, s, acc) [then fma(-dmin, mn, .)], d
            (dmin) the record's rows' f16 scales at byte d_at (dmin_at) of it."""
            dv = half_to_float_ir(builder, builder.load(ptr("q", builder.add(rec, k64(d_at)),
                                                            ir.VectorType(i16, 16)), align=2))
            if dmin_at is not None:
                mnv = builder.fneg(half_to_float_ir(builder, builder.load(
                    ptr("q", builder.add(rec, k64(dmin_at)), ir.VectorType(i16, 16)), align=2)))
            arow = builder.mul(tg, k64(AMX_TOKENS))
            for t, s_ in enumerate(sums):
                p = ptr("acc", builder.add(builder.mul(R, builder.add(arow, k64(t))), r0), vf)
                total = fma(dv, builder.load(s_), builder.load(p, align=4))
                if dmin_at is not None:
                    total = fma(mnv, builder.load(mins[t]), total)
                builder.store(total, p, align=4)

        def float_sums_k(rec, sb, r0, tg):
            """acc rows of token group tg += the Q4_K (Q5_K) record's float sums, q4k_gemm's
            operations in its order: per sub-block fma(S, sc dx, s) and fma(m, xsum, mn),
            then once a record acc + d s - dmin mn; IQ4_XS's (iq4xs_gemm's) the same with
            its int8 sc and no mins: acc + d s."""
            bytes16 = lambda off: builder.load(ptr("q", off, ir.VectorType(i8, 16)), align=1)
            sc_at, d_at = (IQ4XS_SC, IQ4XS_D) if xs else (Q4K_SC, Q4K_D)

            def block(k, blk, hb):
                sc8 = bytes16(builder.add(rec, builder.add(k64(sc_at), builder.mul(k, k64(16)))))
                scv = builder.sitofp(sc8, vf) if xs else builder.uitofp(sc8, vf)
                if k4:
                    mv = builder.uitofp(bytes16(builder.add(rec, builder.add(k64(Q4K_M), builder.mul(k, k64(16))))),
                                        vf)
                crow = builder.add(hb, builder.mul(k, k64(AMX_TOKENS)))
                for t, s_ in enumerate(sums):
                    c = builder.load(builder.gep(cbase, [builder.add(crow, k64(t))]), align=64)
                    si = at_token(blk, t)
                    dx = splat(builder, builder.load(ptr("xd", si, f32)), 16)
                    builder.store(fma(builder.sitofp(c, vf), builder.fmul(scv, dx), builder.load(s_)), s_)
                    if k4:
                        xsv = splat(builder, builder.load(ptr("xsum", si, f32)), 16)
                        builder.store(fma(mv, xsv, builder.load(mins[t])), mins[t])
            over_blocks(sb, tg, block)
            finish_record(rec, r0, tg, d_at, Q4K_DMIN if k4 else None)

        def float_sums_q6(rec, sb, r0, tg):
            """acc rows of token group tg += the Q6_K record's float sums, q6_gemm's
            operations in its order: per block fma(dot, dx, s), dot = sc0 C_0 + sc1 C_1
            formed exactly in f32 (module docstring), then once a record fma(d, s, acc)."""
            def block(k, blk, hb):
                scs = [builder.sitofp(builder.load(ptr("q", builder.add(rec, builder.add(
                    k64(Q6K_SC + 16 * h), builder.mul(k, k64(32)))), ir.VectorType(i8, 16)), align=1), vf)
                    for h in range(2)]
                crow = builder.add(hb, builder.mul(k, k64(2 * AMX_TOKENS)))
                for t, s_ in enumerate(sums):
                    c0, c1 = (builder.sitofp(builder.load(builder.gep(cbase, [builder.add(
                        crow, k64(h * AMX_TOKENS + t))]), align=64), vf) for h in range(2))
                    dot = fma(c1, scs[1], builder.fmul(c0, scs[0]))
                    dx = splat(builder, builder.load(ptr("xd", at_token(blk, t), f32)), 16)
                    builder.store(fma(dot, dx, builder.load(s_)), s_)
            over_blocks(sb, tg, block)
            finish_record(rec, r0, tg, Q6K_D)

        def float_sums_q2(rec, sb, r0, tg):
            """acc rows of token group tg += the Q2_K record's float sums, q6_gemm's kind
            2 in its order: per block s = fma(dot, dx, s), dot = C (the scales are in the
            B bytes, module docstring), mn = fma(m1, xsum16_1, fma(m0, xsum16_0, mn)),
            then once a record acc + d s - dmin mn."""
            four = ir.Constant(ir.VectorType(i8, 16), [4] * 16)

            def block(k, blk, hb):
                ms = [builder.uitofp(builder.lshr(builder.load(ptr("q", builder.add(rec, builder.add(
                    k64(Q2K_SC + 16 * h), builder.mul(k, k64(32)))), ir.VectorType(i8, 16)), align=1), four), vf)
                    for h in range(2)]
                crow = builder.add(hb, builder.mul(k, k64(AMX_TOKENS)))
                for t, s_ in enumerate(sums):
                    c = builder.load(builder.gep(cbase, [builder.add(crow, k64(t))]), align=64)
                    dx = splat(builder, builder.load(ptr("xd", at_token(blk, t), f32)), 16)
                    builder.store(fma(builder.sitofp(c, vf), dx, builder.load(s_)), s_)
                    # xsum: x's sums per 16, (Tp/16, 2 nb, 16): half h of block blk at 2 blk + h
                    halves = [builder.add(builder.mul(blk, k64(2)), k64(h)) for h in range(2)]
                    xm = [splat(builder, builder.load(ptr("xsum", at_token(v, t), f32)), 16) for v in halves]
                    builder.store(fma(ms[1], xm[1], fma(ms[0], xm[0], builder.load(mins[t]))), mins[t])
            over_blocks(sb, tg, block)
            finish_record(rec, r0, tg, Q6K_D, Q2K_DMIN)

        def float_sums_q3(rec, sb, r0, tg):
            """acc rows of token group tg += the Q3_K record's float sums, q6_gemm's kind
            3 in its order: per block s = fma(dot, dx, s), dot = C - Q3K_BIAS xs8 formed
            exactly in f32 (xsum: Q3K_BIAS times x's block sums, module docstring), then
            once a record fma(d, s, acc)."""
            def block(k, blk, hb):
                crow = builder.add(hb, builder.mul(k, k64(AMX_TOKENS)))
                for t, s_ in enumerate(sums):
                    c = builder.load(builder.gep(cbase, [builder.add(crow, k64(t))]), align=64)
                    si = at_token(blk, t)
                    bias = splat(builder, builder.load(ptr("xsum", si, f32)), 16)
                    dx = splat(builder, builder.load(ptr("xd", si, f32)), 16)
                    builder.store(fma(builder.fsub(builder.sitofp(c, vf), bias), dx, builder.load(s_)), s_)
            over_blocks(sb, tg, block)
            finish_record(rec, r0, tg, Q6K_D)

        def float_sums(rec, sb, r0, tg):
            """acc rows of token group tg += the record's float sums, blocks_gemm's
            operations in its order."""
            if k4 or xs:
                return float_sums_k(rec, sb, r0, tg)
            if KIND == KIND_Q6_K:
                return float_sums_q6(rec, sb, r0, tg)
            if KIND == KIND_Q2_K:
                return float_sums_q2(rec, sb, r0, tg)
            if KIND == KIND_Q3_K:
                return float_sums_q3(rec, sb, r0, tg)

            def block(k, blk, hb):
                halves = builder.add(rec, builder.mul(k, k64(32)))
                dv = half_to_float_ir(builder, builder.load(ptr("q", halves, ir.VectorType(i16, 16)),
                                                            align=2))
                if KIND in BLOCK_MINS:
                    mv = half_to_float_ir(builder, builder.load(
                        ptr("q", builder.add(halves, builder.mul(ga, k64(32))), ir.VectorType(i16, 16)),
                        align=2))
                crow = builder.add(hb, builder.mul(k, k64(AMX_TOKENS)))
                for t, s_ in enumerate(sums):
                    c = builder.load(builder.gep(cbase, [builder.add(crow, k64(t))]), align=64)
                    si = at_token(blk, t)
                    dx = splat(builder, builder.load(ptr("xd", si, f32)), 16)
                    total = fma(builder.sitofp(c, vf), builder.fmul(dv, dx), builder.load(s_))
                    if KIND in BLOCK_MINS:
                        total = fma(mv, splat(builder, builder.load(ptr("xsum", si, f32)), 16), total)
                    builder.store(total, s_)
            over_blocks(sb, tg, block)
            arow = builder.mul(tg, k64(AMX_TOKENS))
            for t, s_ in enumerate(sums):
                p = ptr("acc", builder.add(builder.mul(R, builder.add(arow, k64(t))), r0), vf)
                builder.store(builder.fadd(builder.load(p, align=4), builder.load(s_)), p, align=4)

        def unpacked(rec, k):
            """Block k's values as B bytes: (lo, hi), 4 <64 x i8> each, lo[g] holding
            elements 4g..4g+3 of the 16 rows (row l's at bytes 4l..), hi[g] 16 + 4g..;
            Q4_0's less 8, Q5_0's less 16, Q6_K's less 32 and IQ4_NL's looked up (s8),
            Q4_1's, Q5_1's, Q4_K's, Q5_K's and Q2_K's unsigned."""
            byte = lambda v: ir.Constant(v64, [v] * 64)
            quads = quads_at(rec, k)
            if KIND == KIND_Q2_K:
                # its 2-bit values (crumb quads) times their half's 4-bit scale, a byte
                # each: a row's 4 bytes (<= 3) times its scale (<= 15) in one i32 multiply,
                # no byte carrying into the next (45 < 256)
                lo, hi = _k16_values(builder, 16, 2, lambda j: builder.load(
                    ptr("q", builder.add(quads, k64(64 * j)), vi), align=1))
                scs = [builder.zext(builder.and_(builder.load(ptr("q", builder.add(rec, builder.add(
                    k64(Q2K_SC + 16 * h), builder.mul(k, k64(32)))), ir.VectorType(i8, 16)), align=1),
                    ir.Constant(ir.VectorType(i8, 16), [15] * 16)), vi) for h in range(2)]
                return ([builder.bitcast(builder.mul(v, scs[0]), v64) for v in lo],
                        [builder.bitcast(builder.mul(v, scs[1]), v64) for v in hi])
            if KIND == KIND_Q3_K:
                # its 3-bit values less 4 times their half's int8 scale plus Q3K_BIAS, a
                # byte each, in byte arithmetic modulo 256: the true value is 0..252
                lo, hi = _k16_values(builder, 16, 3, lambda j: builder.load(
                    ptr("q", builder.add(quads, k64(64 * j)), vi), align=1))
                scs = [builder.bitcast(builder.mul(builder.zext(builder.load(ptr("q", builder.add(rec, builder.add(
                    k64(Q6K_SC + 16 * h), builder.mul(k, k64(32)))), ir.VectorType(i8, 16)), align=1), vi),
                    ir.Constant(vi, [0x01010101] * 16)), v64) for h in range(2)]   # a row's sc in its 4 bytes
                scaled = lambda v, h: builder.add(builder.mul(builder.sub(builder.bitcast(v, v64), byte(4)), scs[h]),
                                                  byte(Q3K_BIAS))
                return [scaled(v, 0) for v in lo], [scaled(v, 1) for v in hi]
            if KIND == KIND_Q6_K:
                lo, hi = _q6_values(builder, 16, lambda j: builder.load(
                    ptr("q", builder.add(quads, k64(64 * j)), vi), align=1))
                return ([builder.sub(builder.bitcast(v, v64), byte(32)) for v in lo],
                        [builder.sub(builder.bitcast(v, v64), byte(32)) for v in hi])
            qh = None                   # bit 2g + h of qh's byte i: element 16h + 4g + i's bit 4
            if KIND == KIND_Q5_K:
                qh = builder.load(ptr("q", builder.add(rec, builder.add(k64(Q5K_QH), builder.mul(k, k64(64)))),
                                      v64), align=1)
            elif KIND in BLOCK_FIVE:
                qh = builder.load(ptr("q", builder.add(quads, k64(256)), v64), align=1)
            lo, hi = [], []
            for g in range(4):
                w = builder.load(ptr("q", builder.add(quads, k64(64 * g)), v64), align=1)
                pair = [builder.and_(w, byte(0x0F)), builder.lshr(w, byte(4))]
                for h in range(2):
                    if qh is not None:
                        pair[h] = builder.or_(pair[h], fifth_bits_moved(builder, qh, 2 * g + h, byte(0x10)))
                    if offset:                  # q - 8 (Q4_0), q - 16 (Q5_0) as s8: C is S - offset xs8
                        pair[h] = builder.sub(pair[h], byte(offset))
                    if KIND in BLOCK_LUT or xs:     # IQ4: the nibbles' values, s8
                        pair[h] = TARGET.lookup(builder, IQ4_VALUES, pair[h])
                lo.append(pair[0])
                hi.append(pair[1])
            return lo, hi

        with cgutils.for_range(builder, builder.udiv(R, k64(RECORD_ROWS))) as strip_loop:
            strip = strip_loop.index
            r0 = builder.mul(strip, k64(RECORD_ROWS))
            with cgutils.for_range(builder, builder.mul(nga, k64(AMX_TOKENS))) as t_loop:
                builder.store(ir.Constant(vf, None),
                              ptr("acc", builder.add(builder.mul(R, t_loop.index), r0), vf), align=4)
            with cgutils.for_range(builder, nsb) as sb_loop:
                sb = sb_loop.index
                rec = builder.mul(builder.add(builder.mul(strip, nsb), sb), record)
                with cgutils.for_range(builder, ga) as k_loop:
                    k = k_loop.index
                    ahead = builder.add(builder.add(rec, record), builder.mul(k, k64(share)))
                    for line in range(0, share, 64):   # the next record, a block's share
                        ops.prefetch(builder.add(ahead, k64(line)))
                    if KIND != KIND_Q8_0:
                        # quads -> B rows 0..3 (elements 0..15), 4..7 (16..31)
                        wk = builder.mul(k, k64(8))
                        for g, (lo, hi) in enumerate(zip(*unpacked(rec, k))):
                            builder.store(lo, builder.gep(wbase, [builder.add(wk, k64(g))]), align=64)
                            builder.store(hi, builder.gep(wbase, [builder.add(wk, k64(4 + g))]), align=64)
                # token group tg's products go to cbuf half tg % 2 while the float sums
                # of tg - 1 read the other half: the tile unit and the vector units overlap
                products(rec, sb, k64(0))
                with cgutils.for_range(builder, nga) as tg_loop:
                    tg = tg_loop.index
                    nxt = builder.add(tg, k64(1))
                    with builder.if_then(builder.icmp_unsigned("<", nxt, nga)):
                        products(rec, sb, nxt)
                    float_sums(rec, sb, r0, tg)
        amx("tilerelease")
        return context.get_dummy_value()

    return types.void(q, x, acc, shape), codegen


# --- BF16 weights: tdpbf16ps tiles of the file's rows ----------------------------------------
#
# Prefill of BF16 weights (float_gemm.amx_bf16_gemm) on AMX-BF16, a tile instruction at a
# time from Numba code: A the weights, 16 rows x 32 bf16 read in place from the file's
# rows (a row stride apart), B x rounded to bf16, 16 column pairs x 16 tokens (the VNNI
# pair layout: u32 (kp, t) = x[t, 2 kp] | x[t, 2 kp + 1] << 16), C (16 rows x 16 tokens,
# f32) += sum over k of A[row, k] B[k, token]: 16 x 16 x 32 multiply-adds an
# instruction. Its products are bf16 x bf16 (exact in f32) summed in f32 with
# subnormal inputs and results flushed to zero, as vdpbf16ps (bf16_tile) does, in the
# tile unit's order: not bf16_tile's bits, within the same bound.
BF16_COMPILED = TARGET.has_bf16_tiles(FEATURES) and _ARCH == "x86_64"
BF16_A, BF16_B, BF16_C = (0, 1), (2, 3), (4, 5, 6, 7)   # 2 weight strips x 2 token groups


def bf16_enabled() -> bool:
    """Whether BF16 prefill runs on AMX-BF16 tiles: enabled() and the target has them."""
    return BF16_COMPILED and enabled()


def bf16_tile_config() -> list[int]:
    """ldtilecfg's 64 bytes for the BF16 tiles: every tile 16 rows x 64 bytes."""
    cfg = [0] * 64
    cfg[0] = 1
    for tile in (*BF16_A, *BF16_B, *BF16_C):
        cfg[16 + 2 * tile] = 64
        cfg[48 + tile] = 16
    return cfg


def _tile_arg(name, t):
    if not isinstance(t, types.IntegerLiteral) or not 0 <= t.literal_value < 8:
        raise TypingError(f"{name}: the tile must be a constant 0..7, not {t}")
    return t.literal_value


def _amx_call(builder, name, *args):
    call_llvm(builder, "llvm.x86." + name, ir.VoidType(), list(args))


def _load_tile_config(builder, cfg_bytes):
    """ldtilecfg of these 64 bytes (tile_config's, bf16_tile_config's) on this thread."""
    cfgt = ir.ArrayType(ir.IntType(8), 64)
    cfg = cgutils.alloca_once(builder, cfgt)
    builder.store(ir.Constant(cfgt, cfg_bytes), cfg)
    _amx_call(builder, "ldtilecfg", builder.bitcast(cfg, ir.IntType(8).as_pointer()))


def _element_ptr(context, builder, aty, arr, off):
    """i8* to element `off` of an array (flat, C order)."""
    data = context.make_array(aty)(context, builder, arr).data
    return builder.bitcast(builder.gep(data, [off]), ir.IntType(8).as_pointer())


@intrinsic
def bf16_tiles_begin(typingctx):
    """ldtilecfg of bf16_tile_config() on this thread (each work item loads it: any
    thread may run it)."""
    def codegen(context, builder, sig, args):
        if BF16_COMPILED:
            _load_tile_config(builder, bf16_tile_config())
        return context.get_dummy_value()
    return types.void(), codegen


@intrinsic
def tiles_end(typingctx):
    """tilerelease: this thread's tile state back to its initial state."""
    def codegen(context, builder, sig, args):
        if BF16_COMPILED:
            _amx_call(builder, "tilerelease")
        return context.get_dummy_value()
    return types.void(), codegen


@intrinsic(prefer_literal=True)
def tile_zero(typingctx, t):
    """tilezero of tile t (a constant)."""
    tile = _tile_arg("tile_zero", t)

    def codegen(context, builder, sig, args):
        if BF16_COMPILED:
            _amx_call(builder, "tilezero", ir.Constant(ir.IntType(8), tile))
        return context.get_dummy_value()
    return types.void(t), codegen


@intrinsic(prefer_literal=True)
def tile_load(typingctx, t, arr, off, stride):
    """tileloadd64 of tile t (a constant): its 16 rows of 64 bytes from element `off` of
    arr (flat, C order) on, `stride` bytes apart."""
    tile = _tile_arg("tile_load", t)

    def codegen(context, builder, sig, args):
        if BF16_COMPILED:
            _amx_call(builder, "tileloadd64", ir.Constant(ir.IntType(8), tile),
                      _element_ptr(context, builder, sig.args[1], args[1], args[2]), args[3])
        return context.get_dummy_value()
    return types.void(t, arr, types.int64, types.int64), codegen


@intrinsic(prefer_literal=True)
def tile_store(typingctx, t, arr, off):
    """tilestored64 of tile t (a constant) to element `off` of arr on, rows 64 bytes apart."""
    tile = _tile_arg("tile_store", t)

    def codegen(context, builder, sig, args):
        if BF16_COMPILED:
            _amx_call(builder, "tilestored64", ir.Constant(ir.IntType(8), tile),
                      _element_ptr(context, builder, sig.args[1], args[1], args[2]),
                      ir.Constant(ir.IntType(64), 64))
        return context.get_dummy_value()
    return types.void(t, arr, types.int64), codegen


@intrinsic(prefer_literal=True)
def tile_bf16(typingctx, c, a, b):
    """tdpbf16ps: tile c (f32) += tile a (bf16) x tile b (bf16 pairs), constants."""
    tc, ta, tb = (_tile_arg("tile_bf16", v) for v in (c, a, b))

    def codegen(context, builder, sig, args):
        if BF16_COMPILED:
            _amx_call(builder, "tdpbf16ps", *(ir.Constant(ir.IntType(8), v) for v in (tc, ta, tb)))
        return context.get_dummy_value()
    return types.void(c, a, b), codegen
