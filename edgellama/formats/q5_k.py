"""Q5_K: 256 weights per super-block of 8 sub-blocks of 32, 176 bytes.

    d:f16  dmin:f16  scales:u8[12]  qh:u8[32]  qs:u8[128]
    x = d * sc_s * (q + 16 h) - dmin * m_s   for element e of sub-block s
q and the 6-bit scales as in Q4_K (q4_k.py); h, the fifth bit, is bit s of qh[e].

Runtime tiles: q4_k.py's records (Q4KLinear with BITS 5), each sub-block's fifth bits
after the nibble quads, one 32-bit word per row (layout in simd.py, Q5K_*); decode and
prefill are simd.q4k_gemm, which ors the fifth bits into the nibbles in registers.
5.625 bits per weight resident (5.5 in the file). Records replaced tiles of ten u16
words of three 5-bit values per row and sub-block, summed in int16 lanes, and
dequantized for BLAS in prefill: both slower ("Q5_K records",
bench/results/design_measurements.json).
"""
from __future__ import annotations

import numpy as np
from gguf.constants import LlamaFileType
from numba import prange

from ..kernels.fp import get_f16
from ..kernels.jit import njit
from ..kernels.simd import Q5K_RECORD
from .base import WeightFormat
from .q4_k import _CHUNK, _G, Q5K_BYTES, QK_K, Q4KLinear, k_group_scratch, k_scales, quantize_k_group

f32 = np.float32


# --- reference quantize / dequantize -------------------------------------------------------

@njit(parallel=True, cache=True, error_model="numpy")
def quantize_q5_k(x, out):
    # x (nb*256,) f32 -> out (nb*176,) u8 as quantize_row_q5_K_ref;
    # returns (non-finite blocks, blocks whose d or dmin overflow f16)
    nb = x.size // QK_K
    bad = 0
    over = 0
    for c in prange(-(-nb // _CHUNK)):
        ws = k_group_scratch()
        Lq = ws[6]
        end = min(nb, (c + 1) * _CHUNK)
        for b0 in range(c * _CHUNK, end, _G):
            nbg = min(_G, end - b0)
            bd, ov = quantize_k_group(x, b0, nbg, 31, f32(-0.5), f32(0.1), 15, out, Q5K_BYTES, ws)
            bad += bd
            over += ov
            for g in range(nbg):
                o = (b0 + g) * Q5K_BYTES
                L = Lq[g]
                for i in range(32):
                    h = 0
                    for p in range(4):
                        l1 = L[64 * p + i]
                        l2 = L[64 * p + 32 + i]
                        h |= (l1 >> 4) << (2 * p) | (l2 >> 4) << (2 * p + 1)
                        out[o + 48 + 32 * p + i] = (l1 & 15) | ((l2 & 15) << 4)
                    out[o + 16 + i] = h
    return bad, over


@njit(parallel=True, cache=True)
def dequantize_q5_k(q, out):
    # q (nb*176,) u8 -> out (nb*256,) f32, bit-exact with gguf-py
    for b in prange(out.size // QK_K):
        o = b * Q5K_BYTES
        dsc = np.empty(8, f32)
        msc = np.empty(8, f32)
        k_scales(q, o + 4, get_f16(q, o), get_f16(q, o + 2), dsc, msc)
        y = out[b * QK_K:(b + 1) * QK_K]
        for p in range(4):
            for i in range(32):
                v = q[o + 48 + 32 * p + i]
                h = q[o + 16 + i] >> (2 * p)
                y[64 * p + i] = dsc[2 * p] * f32((v & 15) | ((h & 1) << 4)) - msc[2 * p]
                y[64 * p + 32 + i] = (dsc[2 * p + 1] * f32((v >> 4) | ((h & 2) << 3))
                                      - msc[2 * p + 1])


class Q5KLinear(Q4KLinear):
    """Q5_K in Q4_K's records, with the fifth bits (simd.py's Q5K_* layout)."""
    BITS, BLOCK_BYTES, RECORD = 5, Q5K_BYTES, Q5K_RECORD


Q5_K = WeightFormat("Q5_K", "d:f16, dmin:f16, scales:u8[12] (6-bit sc, m per 32), "
                    "qh:u8[32], qs:u8[128]; x=d*sc*(nibble+16*bit)-dmin*m", Q5KLinear,
                    dequantize_q5_k, quantize_q5_k, LlamaFileType.MOSTLY_Q5_K_M)
