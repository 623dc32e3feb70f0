"""Q5_0 and Q5_1: 32 weights per block, 5-bit values with an f16 scale (and min).

    Q5_0  22 bytes  d:f16, qh:u32, qs:u8[16]         x_j = (u_j - 16) * d
    Q5_1  24 bytes  d:f16, m:f16, qh:u32, qs:u8[16]  x_j = u_j * d + m
u_j = nibble_j | (bit j of qh) << 4; nibble j < 16 is the low nibble of qs[j], j >= 16 the
high nibble of qs[j - 16] (Q4 order).

At run time both are records.py's per-32-block records (simd.py's layout: the nibbles
as Q4's quads, the fifth bits beside them), multiplied by int8 x with the pair-dot and
AMX kernels Q4_0 and Q4_1 use: the values are unpacked to 0..31 in registers, and Q5_0's
offset of 16 comes off the integer sum as Q4_0's 8 does.
"""
from __future__ import annotations

import numpy as np
from gguf.constants import LlamaFileType
from numba import prange

from ..kernels.fp import get_f16, put_f16, wrap_u8
from ..kernels.jit import njit
from ..kernels.simd import KIND_Q5_0, KIND_Q5_1
from .base import WeightFormat, block_sizes
from .q4 import signed_absmax
from .records import BlocksLinear

f32 = np.float32
Q5_0_BYTES = block_sizes("Q5_0")[1]     # bytes per block of 32
Q5_1_BYTES = block_sizes("Q5_1")[1]


# --- reference quantize / dequantize (bit-exact with ggml's quantize_row_q5_*_ref) ------

@njit(cache=True, inline="always")
def _put_q5(out, o, u, j, qh):
    # store 5-bit u as weight j of a block whose qs start at out[o]; returns qh with bit j
    if j < 16:
        out[o + j] = (out[o + j] & 0xF0) | (u & 15)
    else:
        out[o + j - 16] = (out[o + j - 16] & 0x0F) | ((u & 15) << 4)
    return qh | (np.uint32((u >> 4) & 1) << np.uint32(j))


@njit(cache=True, inline="always")
def _put_u32(out, o, v):
    for k in range(4):
        out[o + k] = np.uint8((v >> np.uint32(8 * k)) & np.uint32(0xFF))


@njit(parallel=True, cache=True)
def quantize_q5_0(x, out):
    # x (nb*32,) f32 -> out (nb*22,) u8; returns (non-finite blocks, overflowing scales)
    nb = x.size // 32
    bad = 0
    over = 0
    for b in prange(nb):
        base = b * 32
        mx, finite = signed_absmax(x, base)
        if not finite:
            bad += 1
        d = mx / f32(-16.0)
        idv = f32(1.0) / d if d != 0 else f32(0.0)
        o = b * Q5_0_BYTES
        if put_f16(out, o, d):
            over += 1
        qh = np.uint32(0)
        for j in range(32):
            # C: MIN(31, (int8_t)(x*id + 16.5f)) stored in a uint8_t
            q = np.int8(wrap_u8(x[base + j] * idv + f32(16.5)))
            qh = _put_q5(out, o + 6, np.uint8(min(q, np.int8(31))), j, qh)
        _put_u32(out, o + 2, qh)
    return bad, over


@njit(parallel=True, cache=True)
def quantize_q5_1(x, out):
    # x (nb*32,) f32 -> out (nb*24,) u8; returns (non-finite blocks, overflowing d or m)
    nb = x.size // 32
    bad = 0
    over = 0
    for b in prange(nb):
        base = b * 32
        vmin = f32(np.finfo(np.float32).max)
        vmax = -vmin
        chk = f32(0.0)
        for j in range(32):
            v = x[base + j]
            chk += v * f32(0.0)
            vmin = min(vmin, v)        # as C: NaN never replaces
            vmax = max(vmax, v)
        if np.isnan(chk):
            bad += 1
        d = (vmax - vmin) / f32(31.0)
        idv = f32(1.0) / d if d != 0 else f32(0.0)
        o = b * Q5_1_BYTES
        o1 = put_f16(out, o, d)
        o2 = put_f16(out, o + 2, vmin)
        if o1 or o2:
            over += 1
        qh = np.uint32(0)
        for j in range(32):
            qh = _put_q5(out, o + 8, wrap_u8((x[base + j] - vmin) * idv + f32(0.5)), j, qh)
        _put_u32(out, o + 4, qh)
    return bad, over


@njit(cache=True, inline="always")
def _u5(q, o, j):
    # 5-bit value of weight j of the block whose qh is at q[o] (qs at q[o+4])
    hb = (q[o + j // 8] >> (j % 8)) & 1
    nib = q[o + 4 + j] & 15 if j < 16 else q[o + 4 + j - 16] >> 4
    return np.int32(nib) | (np.int32(hb) << 4)


@njit(parallel=True, cache=True)
def dequantize_q5_0(q, out):
    # q (nb*22,) u8 -> out (nb*32,) f32
    for b in prange(out.size // 32):
        o = b * Q5_0_BYTES
        d = get_f16(q, o)
        for j in range(32):
            out[b * 32 + j] = d * f32(_u5(q, o + 2, j) - 16)


@njit(parallel=True, cache=True)
def dequantize_q5_1(q, out):
    # q (nb*24,) u8 -> out (nb*32,) f32
    for b in prange(out.size // 32):
        o = b * Q5_1_BYTES
        d = get_f16(q, o)
        m = get_f16(q, o + 2)
        for j in range(32):
            out[b * 32 + j] = d * f32(_u5(q, o + 4, j)) + m


# --- runtime: records (records.py) ------------------------------------------------------

class Q5_0Linear(BlocksLinear):
    kind = KIND_Q5_0


class Q5_1Linear(BlocksLinear):
    kind = KIND_Q5_1


Q5_0 = WeightFormat("Q5_0", "d:f16, qh:u32, qs:u8[16]; x=(nibble|qh_bit<<4 - 16)*d",
                    Q5_0Linear, dequantize_q5_0, quantize_q5_0, LlamaFileType.MOSTLY_Q5_0)
Q5_1 = WeightFormat("Q5_1", "d:f16, m:f16, qh:u32, qs:u8[16]; x=(nibble|qh_bit<<4)*d+m",
                    Q5_1Linear, dequantize_q5_1, quantize_q5_1, LlamaFileType.MOSTLY_Q5_1)
