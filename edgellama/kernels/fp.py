"""Float conversions usable inside Numba kernels (Numba has no float16 type).

Weights and the KV cache hold IEEE half (f16) or bfloat16 bits as uint16; these
helpers turn them into float32 in registers, and round float32 to f16 bits exactly
as NumPy and ggml do (nearest even) when a block scale is written.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .jit import njit
from .target import HALF_NATIVE


def _like(ty, c):
    # the constant c of an integer or float type, or splat across a vector type
    if isinstance(ty, ir.VectorType):
        return ir.Constant(ty, [ir.Constant(ty.element, c)] * ty.count)
    return ir.Constant(ty, c)


def half_to_float_ir(builder, bits, native: bool = HALF_NATIVE):
    """IR: IEEE half bits (i16 or <n x i16>) -> float (or <n x float>), exactly.

    With F16C (or AArch64) LLVM's fpext, one vcvtph2ps that also vectorises in loops
    (faster than bit twiddling through a scratch buffer: "fp16 conversion" in
    bench/results/design_measurements.json). Without it,
    fpext would become a call of __extendhfsf2, which Numba cannot link, so: the
    exponent and mantissa moved into place and scaled by 2^112 (exact for normal and
    subnormal halves), inf/NaN given the all-ones exponent, the sign put back.
    """
    n = bits.type.count if isinstance(bits.type, ir.VectorType) else None
    i32 = ir.VectorType(ir.IntType(32), n) if n else ir.IntType(32)
    f32 = ir.VectorType(ir.FloatType(), n) if n else ir.FloatType()
    if native:
        h = ir.VectorType(ir.HalfType(), n) if n else ir.HalfType()
        return builder.fpext(builder.bitcast(bits, h), f32)
    h = builder.zext(bits, i32)
    em = builder.and_(h, _like(i32, 0x7FFF))
    shifted = builder.shl(em, _like(i32, 13))
    finite = builder.bitcast(builder.fmul(builder.bitcast(shifted, f32), _like(f32, 2.0 ** 112)), i32)
    infnan = builder.or_(shifted, _like(i32, 0x7F800000))
    mag = builder.select(builder.icmp_unsigned(">=", em, _like(i32, 0x7C00)), infnan, finite)
    sign = builder.shl(builder.and_(h, _like(i32, 0x8000)), _like(i32, 16))
    return builder.bitcast(builder.or_(mag, sign), f32)


@intrinsic
def f16_to_f32(typingctx, h):
    # u16 f16 bits -> f32
    def codegen(context, builder, sig, args):
        return half_to_float_ir(builder, args[0])
    return types.float32(types.uint16), codegen


@intrinsic
def _f32_to_f16_native(typingctx, x):
    # f32 -> u16 f16 bits, rounded to nearest even (as NumPy's astype(float16)): LLVM's
    # fptrunc float -> half, vcvtps2ph (F16C), vectorises in loops
    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return types.uint16(types.float32), codegen


def bf16_to_float_ir(builder, bits):
    """IR: bfloat16 bits (i16 or <n x i16>) -> float (or <n x float>), exactly: the top
    half of the f32 bit pattern."""
    n = bits.type.count if isinstance(bits.type, ir.VectorType) else None
    i32 = ir.VectorType(ir.IntType(32), n) if n else ir.IntType(32)
    f32 = ir.VectorType(ir.FloatType(), n) if n else ir.FloatType()
    return builder.bitcast(builder.shl(builder.zext(bits, i32), _like(i32, 16)), f32)


@intrinsic
def bf16_to_f32(typingctx, h):
    # u16 bf16 bits -> f32
    def codegen(context, builder, sig, args):
        return bf16_to_float_ir(builder, args[0])
    return types.float32(types.uint16), codegen


@njit(cache=True, inline="always")
def bf16_bits(n):
    # f32 bits (u32) -> bf16 bits (u16), nearest even; NaN stays a quiet NaN, inf inf
    # (ggml_compute_fp32_to_bf16)
    if (n & 0x7FFFFFFF) > 0x7F800000:
        return np.uint16(((n >> 16) & 0xFFFF) | 64)
    return np.uint16((np.uint64(n) + np.uint64(0x7FFF + ((n >> 16) & 1))) >> 16)


@njit(cache=True, fastmath=True, inline="always")
def float_at(w, i, k, kind):
    # element k of row i of W as f32: kind 0 f32, 1 f16 bits, 2 bf16 bits (a runtime
    # int: LLVM hoists the test out of the loop, where numba.literally would re-type
    # every call, tens of milliseconds each)
    if kind == 0:
        return w[i, k]
    if kind == 1:
        return f16_to_f32(w[i, k])
    return bf16_to_f32(w[i, k])


@njit(cache=True, inline="always")
def f16_bits(x):
    # f32 -> IEEE half bits, round to nearest even (NumPy's npy_floatbits_to_halfbits)
    f = np.float32(x).view(np.uint32)
    sign = np.uint16((f >> 16) & 0x8000)
    e = (f >> 23) & 0xFF
    mant = f & 0x7FFFFF
    if e == 0xFF:
        if mant == 0:
            return sign | np.uint16(0x7C00)
        return sign | np.uint16(0x7E00)
    if e >= 143:
        return sign | np.uint16(0x7C00)          # overflow to inf
    if e <= 112:                                 # half subnormal or zero
        if e < 102:
            return sign
        full = mant | 0x800000
        shift = 126 - e
        h = full >> shift
        rem = full & ((np.uint32(1) << shift) - 1)
        half = np.uint32(1) << (shift - 1)
        if rem > half or (rem == half and (h & 1) == 1):
            h += 1
        return sign | np.uint16(h)
    h = ((e - 112) << 10) | (mant >> 13)
    rem = mant & 0x1FFF
    if rem > 0x1000 or (rem == 0x1000 and (h & 1) == 1):
        h += 1                                   # a carry into the exponent is correct
    return sign | np.uint16(h)


# f32 -> f16 bits in kernels: one instruction where the target has it, else the integer
# rounding above (fptrunc would become a call Numba cannot link)
f32_to_f16 = _f32_to_f16_native if HALF_NATIVE else f16_bits


@njit(cache=True, inline="always")
def put_f16(out, o, x):
    # store x as little-endian fp16 at out[o:o+2] (u8); True if it overflowed to inf
    h = f16_bits(x)
    out[o] = np.uint8(h & 0xFF)
    out[o + 1] = np.uint8(h >> 8)
    return (h & 0x7FFF) == 0x7C00


@njit(cache=True, inline="always")
def get_f16(q, o):
    # little-endian fp16 at q[o:o+2] (u8) -> f32
    return f16_to_f32(np.uint16(q[o]) | (np.uint16(q[o + 1]) << np.uint16(8)))


@njit(cache=True, inline="always")
def wrap_u8(v):
    # NumPy's f32 -> int8/uint8 cast on x86: NaN/inf/|v| >= 2**31 -> 0, else wrap mod 256
    if not (abs(v) < np.float32(2147483648.0)):
        return np.uint8(0)
    return np.uint8(np.int64(v) & 0xFF)


@intrinsic
def f32_bits(typingctx, v):
    # f32 -> its IEEE bit pattern as int32 (a register bitcast; Numba's scalar .view
    # does not compile inside njit functions)
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.int32(types.float32), codegen


@njit(cache=True, inline="always")
def nearest_int(v):
    # ggml's nearest_int: round half to even via the 1.5 * 2^23 trick (|v| < 2^22)
    return ((f32_bits(np.float32(v) + np.float32(12582912.0)) & np.int32(0x007FFFFF))
            - np.int32(0x00400000))
