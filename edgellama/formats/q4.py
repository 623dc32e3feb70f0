"""Q4_0 and Q4_1: 32 weights per block, 4-bit nibbles with an f16 scale (and min).

    Q4_0  18 bytes  d:f16, qs:u8[16]         x_j = (nibble_j - 8) * d
    Q4_1  20 bytes  d:f16, m:f16, qs:u8[16]  x_j = nibble_j * d + m
Element j < 16 is the low nibble of qs[j], j >= 16 the high nibble of qs[j - 16].

Runtime tiles: records.py's per-32-block records (BlocksLinear), shared with Q8_0; a
block's quads are the file's 16 nibble bytes.
"""
from __future__ import annotations

import numpy as np
from gguf.constants import LlamaFileType
from numba import prange

from ..kernels.fp import get_f16, put_f16, wrap_u8
from ..kernels.jit import njit
from ..kernels.simd import KIND_Q4_0, KIND_Q4_1
from .base import WeightFormat, block_sizes
from .records import BlocksLinear

f32 = np.float32
Q4_0_BYTES = block_sizes("Q4_0")[1]     # bytes per block of 32
Q4_1_BYTES = block_sizes("Q4_1")[1]


# --- reference quantize / dequantize (bit-exact with ggml's quantize_row_q4_*_ref) ------

@njit(cache=True, inline="always")
def signed_absmax(x, base):
    # x[base:base+32] -> (the element of largest |x|, the first on ties, as ggml's Q4_0 and
    # Q5_0; 0.0 for an all-zero block, so d = 0 / -k = -0.0 as ggml writes it (gguf-py
    # keeps x[0]'s sign there); False if some element is NaN or inf)
    mx = f32(0.0)
    amax = f32(0.0)
    chk = f32(0.0)
    for j in range(32):
        v = x[base + j]
        chk += v * f32(0.0)                      # NaN iff some v is NaN or inf
        if abs(v) > amax:                        # strict: the first max-|x| element wins
            amax = abs(v)
            mx = v
    return mx, chk == chk


@njit(parallel=True, cache=True)
def quantize_q4_0(x, out):
    # x (nb*32,) f32 -> out (nb*18,) u8; returns (non-finite blocks, overflowing scales)
    nb = x.size // 32
    bad = 0
    over = 0
    for b in prange(nb):
        base = b * 32
        mx, finite = signed_absmax(x, base)
        if not finite:
            bad += 1
        d = mx / f32(-8.0)
        idv = f32(1.0) / d if d != 0 else f32(0.0)
        o = b * Q4_0_BYTES
        if put_f16(out, o, d):
            over += 1
        for j in range(16):
            q0 = min(wrap_u8(np.trunc(x[base + j] * idv + f32(8.5))), np.uint8(15))
            q1 = min(wrap_u8(np.trunc(x[base + 16 + j] * idv + f32(8.5))), np.uint8(15))
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
        chk = f32(0.0)
        for j in range(32):
            v = x[base + j]
            chk += v * f32(0.0)
            vmax = max(vmax, v)
            vmin = min(vmin, v)
        if chk != chk:
            bad += 1
        d = (vmax - vmin) / f32(15.0)
        idv = f32(1.0) / d if d != 0 else f32(0.0)
        o = b * Q4_1_BYTES
        o1 = put_f16(out, o, d)
        o2 = put_f16(out, o + 2, vmin)
        if o1 or o2:
            over += 1
        for j in range(16):
            q0 = min(wrap_u8(np.trunc((x[base + j] - vmin) * idv + f32(0.5))), np.uint8(15))
            q1 = min(wrap_u8(np.trunc((x[base + 16 + j] - vmin) * idv + f32(0.5))), np.uint8(15))
            out[o + 4 + j] = q0 | (q1 << 4)
    return bad, over


@njit(parallel=True, cache=True)
def dequantize_q4_0(q, out):
    # q (nb*18,) u8 -> out (nb*32,) f32
    for b in prange(out.size // 32):
        o = b * Q4_0_BYTES
        d = get_f16(q, o)
        for j in range(16):
            byte = np.int64(q[o + 2 + j])
            out[b * 32 + j] = d * f32((byte & 15) - 8)
            out[b * 32 + 16 + j] = d * f32((byte >> 4) - 8)


@njit(parallel=True, cache=True)
def dequantize_q4_1(q, out):
    # q (nb*20,) u8 -> out (nb*32,) f32
    for b in prange(out.size // 32):
        o = b * Q4_1_BYTES
        d = get_f16(q, o)
        m = get_f16(q, o + 2)
        for j in range(16):
            byte = np.int64(q[o + 4 + j])
            out[b * 32 + j] = d * f32(byte & 15) + m
            out[b * 32 + 16 + j] = d * f32(byte >> 4) + m


class Q4_0Linear(BlocksLinear):
    kind = KIND_Q4_0


class Q4_1Linear(BlocksLinear):
    kind = KIND_Q4_1


Q4_0 = WeightFormat("Q4_0", "d:f16, qs:u8[16]; x=(nibble-8)*d", Q4_0Linear,
                    dequantize_q4_0, quantize_q4_0, LlamaFileType.MOSTLY_Q4_0)
Q4_1 = WeightFormat("Q4_1", "d:f16, m:f16, qs:u8[16]; x=nibble*d+m", Q4_1Linear,
                    dequantize_q4_1, quantize_q4_1, LlamaFileType.MOSTLY_Q4_1)
