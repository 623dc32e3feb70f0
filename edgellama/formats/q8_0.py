"""Q8_0: 32 weights per block, 34 bytes: d:f16, qs:i8[32]; x_j = qs[j] * d.

Runtime tiles: records.py's per-32-block records (Q8_0Linear, a BlocksLinear), the 32
int8 of each block as quads. Decode quantizes x to int8 per block (records.prep_q8_x),
as llama.cpp's q8_0 x q8_0 dot does, and sums exactly in int32 with the CPU's pair-dot
instructions (simd.blocks_gemm).
"""
from __future__ import annotations

import numpy as np
from gguf.constants import LlamaFileType
from numba import prange

from ..kernels.fp import get_f16, put_f16, wrap_u8
from ..kernels.jit import njit
from ..kernels.simd import KIND_Q8_0
from .base import WeightFormat, block_sizes
from .records import BlocksLinear

f32 = np.float32
Q8_0_BYTES = block_sizes("Q8_0")[1]     # bytes per block of 32


@njit(parallel=True, cache=True)
def quantize_q8_0(x, out):
    # x (nb*32,) f32 -> out (nb*34,) u8; returns (non-finite blocks, overflowing scales)
    nb = x.size // 32
    bad = 0
    over = 0
    for b in prange(nb):
        base = b * 32
        amax = f32(0.0)
        chk = f32(0.0)
        for j in range(32):
            v = x[base + j]
            chk += v * f32(0.0)                  # NaN iff some v is NaN or inf
            a = abs(v)
            if a > amax:
                amax = a
        if chk != chk:
            bad += 1
        d = amax / f32(127.0)
        idv = f32(1.0) / d if d != 0 else f32(0.0)
        o = b * Q8_0_BYTES
        if put_f16(out, o, d):
            over += 1
        for j in range(32):
            v = x[base + j] * idv
            a = abs(v)
            fl = np.floor(a)
            r = fl + np.floor(f32(2.0) * (a - fl))   # round half away from zero
            out[o + 2 + j] = wrap_u8(r if v >= 0 else -r)
    return bad, over


@njit(parallel=True, cache=True)
def dequantize_q8_0(q, out):
    # q (nb*34,) u8 -> out (nb*32,) f32
    for b in prange(out.size // 32):
        o = b * Q8_0_BYTES
        d = get_f16(q, o)
        for j in range(32):
            out[b * 32 + j] = f32(np.int8(q[o + 2 + j])) * d


class Q8_0Linear(BlocksLinear):
    kind = KIND_Q8_0


Q8_0 = WeightFormat("Q8_0", "d:f16, qs:i8[32]; x=q*d", Q8_0Linear,
                    dequantize_q8_0, quantize_q8_0, LlamaFileType.MOSTLY_Q8_0)
