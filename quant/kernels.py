"""Numba quantize / dequantize kernels for Q8_0, Q4_0, Q4_1, F16 and BF16.

Output is bit-identical to gguf-py's `gguf.quants.quantize` (itself bit-identical to
ggml's reference C quantizers): every step is done in float32 in the same order —
the scale d in f32, id = 1/d in f32 (0 when d == 0), q from x*id (a multiply, not a
division), and d rounded to fp16 (nearest even) only when stored. Float-to-int casts
mimic NumPy's on x86: NaN, inf and huge values become 0, others wrap modulo 256;
that only matters for blocks whose f32 scale is denormal (1/d overflows), which
dequantize to 0 whatever their nibbles are.

Kernels work on flat arrays of whole blocks, prange over blocks (both cores even for
a single row), and return counts of non-finite inputs and of scales or values that
overflow fp16/bf16; `quantize` turns those into an EdgeError naming the tensor.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from edgellama.errors import EdgeError

from .blocks import FORMATS


@njit(cache=True, inline="always")
def _f16_bits(x):
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


@njit(cache=True, inline="always")
def _wrap_u8(v):
    # NumPy's f32 -> int8/uint8 cast on x86: NaN/inf/|v| >= 2**31 -> 0, else wrap mod 256
    if not (abs(v) < np.float32(2147483648.0)):
        return np.uint8(0)
    return np.uint8(np.int64(v) & 0xFF)


@njit(cache=True, inline="always")
def _put_f16(out, o, x):
    # store x as little-endian fp16 at out[o:o+2]; True if it overflowed to inf
    h = _f16_bits(x)
    out[o] = np.uint8(h & 0xFF)
    out[o + 1] = np.uint8(h >> 8)
    return (h & 0x7FFF) == 0x7C00


@njit(parallel=True, cache=True)
def quantize_q8_0(x, out):
    # x (nb*32,) f32 -> out (nb*34,) u8; returns (non-finite blocks, overflowing scales)
    nb = x.size // 32
    bad = 0
    over = 0
    for b in prange(nb):
        base = b * 32
        amax = np.float32(0.0)
        chk = np.float32(0.0)
        for j in range(32):
            v = x[base + j]
            chk += v * np.float32(0.0)           # NaN iff some v is NaN or inf
            a = abs(v)
            if a > amax:
                amax = a
        if chk != chk:
            bad += 1
        d = amax / np.float32(127.0)
        idv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
        o = b * 34
        if _put_f16(out, o, d):
            over += 1
        for j in range(32):
            v = x[base + j] * idv
            a = abs(v)
            fl = np.floor(a)
            r = fl + np.floor(np.float32(2.0) * (a - fl))   # round half away from zero
            out[o + 2 + j] = _wrap_u8(r if v >= 0 else -r)
    return bad, over


@njit(parallel=True, cache=True)
def quantize_q4_0(x, out):
    # x (nb*32,) f32 -> out (nb*18,) u8; returns (non-finite blocks, overflowing scales)
    nb = x.size // 32
    bad = 0
    over = 0
    for b in prange(nb):
        base = b * 32
        mx = x[base]                             # all-zero block: d keeps x[0]'s sign
        amax = abs(mx)
        chk = np.float32(0.0)
        for j in range(32):
            v = x[base + j]
            chk += v * np.float32(0.0)
            a = abs(v)
            if a > amax:                         # strict: the first max-|x| element wins
                amax = a
                mx = v
        if chk != chk:
            bad += 1
        d = mx / np.float32(-8.0)
        idv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
        o = b * 18
        if _put_f16(out, o, d):
            over += 1
        for j in range(16):
            q0 = min(_wrap_u8(np.trunc(x[base + j] * idv + np.float32(8.5))), np.uint8(15))
            q1 = min(_wrap_u8(np.trunc(x[base + 16 + j] * idv + np.float32(8.5))), np.uint8(15))
            out[o + 2 + j] = q0 | (q1 << 4)
    return bad, over


@njit(parallel=True, cache=True)
def quantize_q4_1(x, out):
    # x (nb*32,) f32 -> out (nb*20,) u8; returns (non-finite blocks, overflowing d or m)
    nb = x.size // 32
    bad = 0
    over = 0
    for b in prange(nb):
        base = b * 32
        vmax = x[base]
        vmin = x[base]
        chk = np.float32(0.0)
        for j in range(32):
            v = x[base + j]
            chk += v * np.float32(0.0)
            vmax = max(vmax, v)
            vmin = min(vmin, v)
        if chk != chk:
            bad += 1
        d = (vmax - vmin) / np.float32(15.0)
        idv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
        o = b * 20
        o1 = _put_f16(out, o, d)
        o2 = _put_f16(out, o + 2, vmin)
        if o1 or o2:
            over += 1
        for j in range(16):
            q0 = min(_wrap_u8(np.trunc((x[base + j] - vmin) * idv + np.float32(0.5))), np.uint8(15))
            q1 = min(_wrap_u8(np.trunc((x[base + 16 + j] - vmin) * idv + np.float32(0.5))),
                     np.uint8(15))
            out[o + 4 + j] = q0 | (q1 << 4)
    return bad, over


@njit(parallel=True, cache=True)
def quantize_f16(x, out):
    # x (n,) f32 -> out (n,) u16 fp16 bits; returns (non-finite values, overflows to inf)
    bad = 0
    over = 0
    for i in prange(x.size):
        v = x[i]
        if not (abs(v) <= np.float32(3.4028235e38)):
            bad += 1
        h = _f16_bits(v)
        if (h & 0x7FFF) == 0x7C00:
            over += 1
        out[i] = h
    return bad, over


@njit(parallel=True, cache=True)
def quantize_bf16(x, out):
    # x (n,) u32 (f32 bits) -> out (n,) u16 bf16 bits, nearest even (ggml_compute_fp32_to_bf16)
    bad = 0
    over = 0
    for i in prange(x.size):
        n = x[i]
        if (n & 0x7FFFFFFF) >= 0x7F800000:
            bad += 1
            h = np.uint16(((n & 0xFFFF0000) | (64 << 16)) >> 16)   # quiet NaN / inf as is
        else:
            h = np.uint16((np.uint64(n) + np.uint64(0x7FFF + ((n >> 16) & 1))) >> 16)
            if (h & 0x7FFF) == 0x7F80:
                over += 1
        out[i] = h
    return bad, over


@njit(parallel=True, cache=True)
def bf16_to_f32(src, out):
    # src (n,) u16 bf16 bits -> out (n,) u32: the bits of the exact f32 (view it as f32)
    for i in prange(src.size):
        out[i] = np.uint32(src[i]) << 16


@njit(parallel=True, cache=True)
def dequantize_q8_0(q, f16tab, out):
    # q (nb*34,) u8 -> out (nb*32,) f32; f16tab (65536,) f32 maps fp16 bits to values
    for b in prange(out.size // 32):
        o = b * 34
        d = f16tab[np.int64(q[o]) | (np.int64(q[o + 1]) << 8)]
        for j in range(32):
            out[b * 32 + j] = np.float32(np.int8(q[o + 2 + j])) * d


@njit(parallel=True, cache=True)
def dequantize_q4_0(q, f16tab, out):
    # q (nb*18,) u8 -> out (nb*32,) f32
    for b in prange(out.size // 32):
        o = b * 18
        d = f16tab[np.int64(q[o]) | (np.int64(q[o + 1]) << 8)]
        for j in range(16):
            byte = np.int64(q[o + 2 + j])
            out[b * 32 + j] = d * np.float32((byte & 15) - 8)
            out[b * 32 + 16 + j] = d * np.float32((byte >> 4) - 8)


@njit(parallel=True, cache=True)
def dequantize_q4_1(q, f16tab, out):
    # q (nb*20,) u8 -> out (nb*32,) f32
    for b in prange(out.size // 32):
        o = b * 20
        d = f16tab[np.int64(q[o]) | (np.int64(q[o + 1]) << 8)]
        m = f16tab[np.int64(q[o + 2]) | (np.int64(q[o + 3]) << 8)]
        for j in range(16):
            byte = np.int64(q[o + 4 + j])
            out[b * 32 + j] = d * np.float32(byte & 15) + m
            out[b * 32 + 16 + j] = d * np.float32(byte >> 4) + m


_QUANTIZE = {"Q8_0": quantize_q8_0, "Q4_0": quantize_q4_0, "Q4_1": quantize_q4_1,
             "F16": quantize_f16, "BF16": quantize_bf16}
_DEQUANTIZE = {"Q8_0": dequantize_q8_0, "Q4_0": dequantize_q4_0, "Q4_1": dequantize_q4_1}
F16_TABLE = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


def quantize(x: np.ndarray, fmt: str, name: str = "tensor") -> np.ndarray:
    """x (rows, n) float32 -> (rows, row_bytes) uint8 in format `fmt` (a FORMATS key).

    Raises EdgeError naming `name` for NaN/inf input or values whose scale (or value,
    for F16/BF16) does not fit the format."""
    f = FORMATS[fmt]
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, n = x.shape
    if n % f.block_size:
        raise EdgeError(f"{name}: row length {n} is not a multiple of {f.block_size} ({fmt})")
    if fmt == "F32":
        bad = int(np.count_nonzero(~np.isfinite(x)))
        if bad:
            raise EdgeError(f"{name}: {bad} NaN or infinite values")
        return x.view(np.uint8)
    flat = x.reshape(-1)
    if f.block_size == 1:
        out = np.empty(flat.size, np.uint16)
    else:
        out = np.empty(flat.size // f.block_size * f.type_size, np.uint8)
    bad, over = _QUANTIZE[fmt](flat.view(np.uint32) if fmt == "BF16" else flat, out)
    if bad:
        raise EdgeError(f"{name}: contains NaN or infinite values (in {bad} "
                        f"{'values' if f.block_size == 1 else 'blocks'}); refusing to write a broken file")
    if over:
        what = "values" if f.block_size == 1 else "block scales"
        raise EdgeError(f"{name}: magnitude too large for {fmt} ({over} {what} overflow "
                        f"{'bf16' if fmt == 'BF16' else 'fp16'}, max |x| = {float(np.abs(x).max()):.4g})")
    return out.view(np.uint8).reshape(rows, n // f.block_size * f.type_size)


def dequantize(data: np.ndarray, fmt: str) -> np.ndarray:
    """data (rows, row_bytes) uint8 in format `fmt` -> (rows, n) float32."""
    f = FORMATS[fmt]
    data = np.ascontiguousarray(data).view(np.uint8)
    rows = data.shape[0] if data.ndim > 1 else 1
    flat = data.reshape(-1)
    n_el = flat.size // f.type_size * f.block_size
    if fmt == "F32":
        out = flat.view(np.float32).copy()
    elif fmt == "F16":
        out = flat.view(np.float16).astype(np.float32)
    elif fmt == "BF16":
        out = np.empty(n_el, np.float32)
        bf16_to_f32(flat.view(np.uint16), out.view(np.uint32))
    else:
        out = np.empty(n_el, np.float32)
        _DEQUANTIZE[fmt](flat, F16_TABLE, out)
    return out.reshape(rows, n_el // rows)
