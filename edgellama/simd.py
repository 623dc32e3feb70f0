"""Integer dot products of 4-bit weights with int8 activations, in the instructions each
CPU has, for kernels that keep lanes across rows.

Numba has no vector types and LLVM does not find the pair-dot instructions in plain
loops, so `nib_dot` emits LLVM IR for one block of 32 weights of R rows:

    VNNI (AVX-512)  vpdpbusd: 64 u8 x i8 products summed into 16 int32 lanes, 1 instruction
    AVX2            vpmaddubsw (u8 x i8 pairs -> int16) then vpmaddwd (-> int32)
    anything else   target-independent IR (widen, multiply, add), which LLVM lowers

The instruction set is chosen once from the host CPU's features (Numba's kernel cache
is keyed by the CPU, so a cache is never used on a CPU it was not built for).

The weights' layout ("quads"): for block b of a tile of R rows, 16 bytes per row, byte
i of a row holding element i (low nibble) and element 16 + i (high nibble); bytes are
grouped by four per row, so one 32-bit lane holds 4 consecutive bytes of one row:

    tile[o + 4R g + 4r + k] = byte 4g + k of row r    (g, k in 0..3; o the block's start)
"""
from __future__ import annotations

import llvmlite.binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

GENERIC, AVX2, VNNI512 = 0, 1, 2


def host_isa() -> int:
    f = llvm.get_host_cpu_features()
    if f.get("avx512vnni") and f.get("avx512bw"):
        return VNNI512
    if f.get("avx2"):
        return AVX2
    return GENERIC


ISA = host_isa()
ISA_NAMES = {GENERIC: "generic", AVX2: "AVX2 (vpmaddubsw)", VNNI512: "AVX-512 VNNI (vpdpbusd)"}


def ir_ptr(context, builder, aty, arr, off, ty):
    """Pointer to arr[off] (a 1-d array of Numba type aty) as a ty*."""
    data = context.make_array(aty)(context, builder, arr).data
    return builder.bitcast(builder.gep(data, [off]), ty.as_pointer())


def _x86(builder, name, ret, args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]),
                                        name)
    return builder.call(fn, args)


def _splat(builder, scalar, n):
    vt = ir.VectorType(scalar.type, n)
    one = builder.insert_element(ir.Constant(vt, None), scalar, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(one, ir.Constant(vt, None),
                                  ir.Constant(ir.VectorType(ir.IntType(32), n), [0] * n))


@intrinsic(prefer_literal=True)
def nib_dot(typingctx, q, o, x8, xo, acc, nr, isa):
    """acc[:nr] (int32) = for each row r of the quads at q[o:] (u8, layout above), the
    sum over its 32 weights of nibble * x8[xo + element] (x8 int8). nr a multiple of
    16; isa a constant (GENERIC, AVX2 or VNNI512). Exact: |sum| <= 32 * 15 * 128."""
    if not isinstance(isa, types.IntegerLiteral):
        return None
    kind = isa.literal_value

    def codegen(context, builder, sig, args):
        i8, i16, i32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
        qa, oa, xa, xoa, acca, nra = args[:6]
        k64 = lambda v: ir.Constant(oa.type, v)
        ptr = lambda k, off, ty: ir_ptr(context, builder, sig.args[k], args[k], off, ty)
        n = 16 if kind == VNNI512 else 8                    # rows per vector
        wide = ir.VectorType(i32, n)
        # the 8 x words (4 int8 each) of the block: low-nibble elements 4g..4g+3, high 16+4g..
        xw = [builder.load(ptr(2, builder.add(xoa, k64(4 * g + 16 * h)), i32), align=1)
              for h in (0, 1) for g in range(4)]
        mask = ir.Constant(wide, [0x0F0F0F0F] * n)
        four = ir.Constant(wide, [4] * n)
        with cgutils.for_range(builder, builder.udiv(nra, k64(n))) as loop:
            r0 = builder.mul(loop.index, k64(n))
            words = []
            for g in range(4):
                p = builder.add(builder.add(oa, builder.mul(nra, k64(4 * g))), builder.mul(r0, k64(4)))
                w = builder.load(ptr(0, p, wide), align=1)
                words.append((builder.and_(w, mask), builder.and_(builder.lshr(w, four), mask)))
            if kind == VNNI512:
                total = ir.Constant(wide, None)
                for g, (lo, hi) in enumerate(words):
                    for v, xv in ((lo, xw[g]), (hi, xw[4 + g])):
                        total = _x86(builder, "llvm.x86.avx512.vpdpbusd.512", wide,
                                     [total, v, _splat(builder, xv, n)])
            elif kind == AVX2:
                b32, h16 = ir.VectorType(i8, 32), ir.VectorType(i16, 16)
                s = None
                for g, (lo, hi) in enumerate(words):
                    for v, xv in ((lo, xw[g]), (hi, xw[4 + g])):
                        # u8 x i8 pairs -> int16: |2 * 15 * 128| per pair, 8 pairs per
                        # lane over the block: < 2^15, so the int16 sums are exact
                        pr = _x86(builder, "llvm.x86.avx2.pmadd.ub.sw", h16,
                                  [builder.bitcast(v, b32), builder.bitcast(_splat(builder, xv, n), b32)])
                        s = pr if s is None else builder.add(s, pr)
                total = _x86(builder, "llvm.x86.avx2.pmadd.wd", wide,
                             [s, ir.Constant(h16, [1] * 16)])
            else:
                b4, h4 = ir.VectorType(i8, 4 * n), ir.VectorType(i16, 4 * n)
                s = ir.Constant(h4, None)
                for g, (lo, hi) in enumerate(words):
                    for v, xv in ((lo, xw[g]), (hi, xw[4 + g])):
                        xs = builder.sext(builder.bitcast(_splat(builder, xv, n), b4), h4)
                        s = builder.add(s, builder.mul(builder.zext(builder.bitcast(v, b4), h4), xs))
                s = builder.sext(s, ir.VectorType(i32, 4 * n))
                total = None
                for k in range(4):     # the 4 int16 sums of each row's 32-bit lane
                    part = builder.shuffle_vector(s, s, ir.Constant(ir.VectorType(i32, n),
                                                                    [4 * i + k for i in range(n)]))
                    total = part if total is None else builder.add(total, part)
            builder.store(total, ptr(4, r0, wide), align=4)
        return context.get_dummy_value()

    return types.void(q, o, x8, xo, acc, nr, isa), codegen
