"""AMX prefill of the per-32-block formats, of the K-quants Q4_K, Q5_K, Q6_K, Q3_K and
Q2_K, and of IQ4_XS (amx.py, records.matmul_blocks_amx).

A NumPy twin of the tile arithmetic (tdpbssd / tdpbsud on the B tiles the kernel makes
of the records, then blocks_gemm's float operations in its order) is checked against
the exact integer sums from the file's bytes and against the VNNI kernels' bits on
every machine; where the CPU has AMX (and Linux grants the tiles), the AMX kernel
against the VNNI kernels, bit for bit; and the permission and fallback logic.
"""
import os
import subprocess
import sys
from pathlib import Path

import numba
import numpy as np
import pytest
from gguf import GGMLQuantizationType as G
from gguf.quants import quantize

from edgellama.kernels import amx
from edgellama import formats
from edgellama.formats import linear, records
from edgellama.kernels.simd import (BLOCK_BYTES, BLOCK_HEAD, BLOCK_QUADS, IQ4_VALUES, ISA, ISA_NAMES, ISAS, KIND_IQ4_NL,
                            KIND_Q4_0, KIND_Q4_1, KIND_Q5_0, KIND_Q5_1,
                            KIND_Q8_0, Q4K_D, Q4K_DMIN, Q4K_M, Q4K_QS, Q4K_RECORD, Q4K_SC,
                            IQ4XS_D, IQ4XS_QS, IQ4XS_RECORD, IQ4XS_SC, Q2K_DMIN, Q2K_RECORD, Q2K_SC, Q3K_RECORD, Q5K_QH,
                            Q5K_RECORD, Q6K_D, Q6K_QS, Q6K_RECORD, Q6K_SC, RECORD_ROWS, TOKENS)

f32, f64 = np.float32, np.float64
KINDS = {"Q4_0": (G.Q4_0, KIND_Q4_0), "Q4_1": (G.Q4_1, KIND_Q4_1), "Q8_0": (G.Q8_0, KIND_Q8_0),
         "Q5_0": (G.Q5_0, KIND_Q5_0), "Q5_1": (G.Q5_1, KIND_Q5_1), "IQ4_NL": (G.IQ4_NL, KIND_IQ4_NL)}
IQ4 = np.array(IQ4_VALUES, np.int8)


# --- the NumPy twin -------------------------------------------------------------------------

def tdp(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """tdpbssd / tdpbsud / tdpbusd / tdpbuud, signedness from the dtypes: a (16, K) int8
    or uint8 (A: K bytes per row), b (K/4, 64) int8 or uint8, VNNI-packed (byte 4n + i
    of row g is element 4g + i of column n) -> C (16, 16) int32, C[m, n] = sum_k
    a[m, k] b[k, n], from zero."""
    K = a.shape[1]
    bt = b.astype(np.int64).reshape(K // 4, 16, 4).transpose(1, 0, 2).reshape(16, K)   # [n, k]
    c = a.astype(np.int64) @ bt.T
    assert np.abs(c).max(initial=0) < 2 ** 31
    return c.astype(np.int32)


def fifth_bits(qh, h):
    """(4, 64) the fifth bits, at bit 4, of the low (h 0) or high (h 1) nibbles of the 4
    quad rows, from a block's 64 bytes of them (bit 2 g + h of byte i of lane l: element
    16 h + 4 g + i of row l; simd.py's layout)."""
    return np.stack([(qh >> (2 * g + h)) & 1 for g in range(4)]) << 4


def b_tile(rec: np.ndarray, G_: int, kind: int, k: int) -> np.ndarray:
    """The B tile (8, 64) the kernel makes of block k of a record: Q8_0's quads as int8;
    Q4's nibble quads, rows 0..3 the low nibbles (elements 0..15), 4..7 the high ones,
    uint8 (Q4_1), or less 8 as int8 (Q4_0); Q5's with their fifth bits, uint8 (Q5_1)
    or less 16 as int8 (Q5_0); IQ4_NL's nibbles' values, int8."""
    o = BLOCK_HEAD[kind] * G_ + BLOCK_QUADS[kind] * k
    quads = rec[o:o + BLOCK_QUADS[kind]]
    if kind == KIND_Q8_0:
        return quads.view(np.int8).reshape(8, 64)
    nib = quads[:256].reshape(4, 64)
    lo, hi = nib & 15, nib >> 4
    if kind in (KIND_Q5_0, KIND_Q5_1):
        lo, hi = lo | fifth_bits(quads[256:], 0), hi | fifth_bits(quads[256:], 1)
    t = np.concatenate([lo, hi])
    if kind == KIND_IQ4_NL:
        return IQ4[t]
    offset = {KIND_Q4_0: 8, KIND_Q5_0: 16}.get(kind)
    return (t.astype(np.int16) - offset).astype(np.int8) if offset else t


def fma(a, b, c):
    """f32 fma, as float64 a b (exact) + c rounded to f32 (the double rounding differs
    from one rounding in about 1 case in 2^29: none in these tests' inputs)."""
    return (f64(1) * a.astype(f64) * b.astype(f64) + c.astype(f64)).astype(f32)


def twin_records(lin, size, nrec, Tp, T, record):
    """The strip and record loops the twins share: per strip of RECORD_ROWS rows, total
    (Tp, RECORD_ROWS) f32 from zero, total = record(rec, sb, total) for each of the
    strip's nrec records of `size` bytes in turn; out (T, out_features) the totals."""
    R = lin.R
    out = np.zeros((T, lin.out_features), f32)
    for t in range(lin.nt):
        for strip in range(R // RECORD_ROWS):
            r0 = t * R + strip * RECORD_ROWS
            total = np.zeros((Tp, RECORD_ROWS), f32)
            for sb in range(nrec):
                o = (strip * nrec + sb) * size
                total = record(lin.q[t, o:o + size], sb, total)
            n = min(RECORD_ROWS, lin.out_features - r0)
            if n > 0:
                out[:, r0:r0 + n] = total[:T, :n]
    return out


def c_tiles(x8, b, B, lo=0, width=32):
    """C (Tp, 16) int32 of tdp for every group of 16 tokens: x8's bytes lo..lo+width of
    block b by the B tile."""
    at = 32 * b + lo
    return np.concatenate([tdp(x8[g:g + 16, at:at + width], B) for g in range(0, x8.shape[0], 16)])


def twin_matmul(lin, x8, xd, xsum, T):
    """out (T, out_features) of a BlocksLinear as the AMX kernel computes it: per strip
    and record, per block the int32 C of tdp (16 tokens at a time) and the f32 steps of
    simd.blocks_gemm: s = fma(float(C), d dx, s) [Q4_1, Q5_1: s = fma(m, xsum, s)] block by
    block from s = 0, then total += s record by record."""
    kind, G_ = lin.kind, lin.group
    Tp, nb = xd.shape

    def record(rec, sb, total):
        s = np.zeros_like(total)
        for k in range(G_):
            b = sb * G_ + k
            dv = rec[32 * k:32 * k + 32].view(np.float16).astype(f32)
            s = fma(c_tiles(x8, b, b_tile(rec, G_, kind, k)).astype(f32), dv[None] * xd[:, b:b + 1], s)
            if kind in (KIND_Q4_1, KIND_Q5_1):
                mv = rec[32 * G_ + 32 * k:32 * G_ + 32 * k + 32].view(np.float16).astype(f32)
                s = fma(np.broadcast_to(mv[None], s.shape), np.broadcast_to(xsum[:, b:b + 1], s.shape), s)
        return total + s
    return twin_records(lin, G_ * BLOCK_BYTES[kind], nb // G_, Tp, T, record)


def b_tile_q5(rec, k):
    """Q5_K's B tile (8, 64) uint8 of sub-block k: Q4_K's nibble rows with bit 4 from the
    fifth bits (bit 2g + h of byte i of lane l: element 16 h + 4 g + i of row l)."""
    quads = rec[Q4K_QS + 256 * k:Q4K_QS + 256 * (k + 1)].reshape(4, 64)
    qh = rec[Q5K_QH + 64 * k:Q5K_QH + 64 * (k + 1)]
    return np.concatenate([(quads & 15) | fifth_bits(qh, 0), (quads >> 4) | fifth_bits(qh, 1)])


def twin_matmul_k(lin, x8, xd, xsum, T):
    """out (T, out_features) of a Q4_K (Q5_K) Linear as the AMX kernel computes it: per
    strip and record (a super-block), per sub-block k the int32 C of tdpbsud (x8 by the
    sub-block's unsigned values, B rows 0..3 elements 0..15) and q4k_gemm's f32 steps:
    s = fma(float(C), sc dx, s), mn = fma(m, xsum, mn), then total = fma(d, s, total),
    total = fma(-dmin, mn, total) record by record."""
    five = lin.BITS == 5
    Tp, nsub = xd.shape

    def record(rec, sb, total):
        s, mn = np.zeros_like(total), np.zeros_like(total)
        for k in range(8):
            b = sb * 8 + k
            quads = rec[Q4K_QS + 256 * k:Q4K_QS + 256 * (k + 1)]
            B = b_tile_q5(rec, k) if five else np.concatenate([quads & 15, quads >> 4]).reshape(8, 64)
            scv = rec[Q4K_SC + 16 * k:Q4K_SC + 16 * k + 16].astype(f32)
            mv = rec[Q4K_M + 16 * k:Q4K_M + 16 * k + 16].astype(f32)
            s = fma(c_tiles(x8, b, B).astype(f32), scv[None] * xd[:, b:b + 1], s)
            mn = fma(np.broadcast_to(mv[None], s.shape), np.broadcast_to(xsum[:, b:b + 1], s.shape), mn)
        dv = rec[Q4K_D:Q4K_D + 32].view(np.float16).astype(f32)
        mnv = rec[Q4K_DMIN:Q4K_DMIN + 32].view(np.float16).astype(f32)
        total = fma(np.broadcast_to(dv[None], s.shape), s, total)
        return fma(np.broadcast_to(-mnv[None], s.shape), mn, total)
    return twin_records(lin, Q5K_RECORD if five else Q4K_RECORD, nsub // 8, Tp, T, record)


def twin_matmul_xs(lin, x8, xd, T):
    """out (T, out_features) of an IQ4_XS Linear as the AMX kernel computes it: per strip
    and record (a super-block), per sub-block k the int32 C of tdpbssd (x8 by the
    nibbles' values, B rows 0..3 elements 0..15) and iq4xs_gemm's f32 steps:
    s = fma(float(C), sc dx, s), then total = fma(d, s, total) record by record."""
    Tp, nsub = xd.shape

    def record(rec, sb, total):
        s = np.zeros_like(total)
        for k in range(8):
            b = sb * 8 + k
            quads = rec[IQ4XS_QS + 256 * k:IQ4XS_QS + 256 * (k + 1)]
            B = IQ4[np.concatenate([quads & 15, quads >> 4]).reshape(8, 64)]
            scv = rec[IQ4XS_SC + 16 * k:IQ4XS_SC + 16 * k + 16].view(np.int8).astype(f32)
            s = fma(c_tiles(x8, b, B).astype(f32), scv[None] * xd[:, b:b + 1], s)
        dv = rec[IQ4XS_D:IQ4XS_D + 32].view(np.float16).astype(f32)
        return fma(np.broadcast_to(dv[None], s.shape), s, total)
    return twin_records(lin, IQ4XS_RECORD, nsub // 8, Tp, T, record)


def b_tiles_q6(rec, k):
    """Q6_K's two B tiles (4, 64) int8 of block k, its halves (elements 0..15, 16..31):
    the 6-bit values less 32, rebuilt from the record's nibble and crumb quads."""
    quads = rec[Q6K_QS + 384 * k:Q6K_QS + 384 * (k + 1)].reshape(6, 64)
    nib, crumbs = quads[:4], quads[4:]
    lo = np.stack([(nib[g] & 15) | ((crumbs[g % 2] >> (2 * (g // 2)) & 3) << 4) for g in range(4)])
    hi = np.stack([(nib[g] >> 4) | ((crumbs[g % 2] >> (4 + 2 * (g // 2)) & 3) << 4) for g in range(4)])
    return [(v.astype(np.int16) - 32).astype(np.int8) for v in (lo, hi)]


def twin_matmul_q6(lin, x8, xd, T):
    """out (T, out_features) of a Q6_K Linear as the AMX kernel computes it: per strip,
    record (a super-block) and block, the int32 C_h of tdpbssd for each half h (x8's 16
    bytes by the values less 32), dot = fma(C_1, sc1, C_0 sc0) in f32, then q6_gemm's
    s = fma(dot, dx, s) block by block and total = fma(d, s, total) record by record."""
    Tp, nb = xd.shape

    def record(rec, sb, total):
        s = np.zeros_like(total)
        for k in range(8):
            b = sb * 8 + k
            C = [c_tiles(x8, b, B, 16 * h, 16).astype(f32) for h, B in enumerate(b_tiles_q6(rec, k))]
            sc = [rec[Q6K_SC + 32 * k + 16 * h:Q6K_SC + 32 * k + 16 * h + 16].view(np.int8).astype(f32)
                  for h in range(2)]
            dot = fma(C[1], np.broadcast_to(sc[1][None], s.shape), C[0] * sc[0][None])
            s = fma(dot, np.broadcast_to(xd[:, b:b + 1], s.shape), s)
        dv = rec[Q6K_D:Q6K_D + 32].view(np.float16).astype(f32)
        return fma(np.broadcast_to(dv[None], s.shape), s, total)
    return twin_records(lin, Q6K_RECORD, nb // 8, Tp, T, record)


def b_tile_q2(rec, k):
    """Q2_K's B tile (8, 64) uint8 of block k: the 2-bit values from the record's two
    crumb quads (row g of half h: crumb quad g % 2, field g // 2 + 2 h; rows 0..3 elements
    0..15, 4..7 16..31), each times its row's 4-bit scale of that half (<= 45)."""
    quads = rec[Q6K_QS + 128 * k:Q6K_QS + 128 * (k + 1)].reshape(2, 64)
    rows = []
    for h in range(2):
        sc = np.repeat(rec[Q2K_SC + 32 * k + 16 * h:Q2K_SC + 32 * k + 16 * h + 16] & 15, 4)  # byte 4 l + i: row l's
        rows += [((quads[g % 2] >> (2 * (g // 2 + 2 * h))) & 3) * sc for g in range(4)]
    return np.stack(rows).astype(np.uint8)


def sums_per_16(x8, xd):
    """(Tp, n/16) f32: each 16 of x as rounded, xd times the exact int sum of its x8
    (q6_k.scaled16's product)."""
    xs16 = x8.reshape(x8.shape[0], -1, 16).astype(np.int32).sum(axis=2)
    return np.repeat(xd, 2, axis=1) * xs16.astype(f32)


def twin_matmul_q2(lin, x8, xd, T):
    """out (T, out_features) of a Q2_K Linear as the AMX kernel computes it: per strip,
    record (a super-block) and block, the int32 C of tdpbsud (x8 by the values times
    their scales: C = sc0 S_0 + sc1 S_1 exactly) and q6_gemm's kind 2 f32 steps:
    s = fma(float(C), dx, s), mn = fma(m1, xsum16_1, fma(m0, xsum16_0, mn)) block by
    block, then total = fma(d, s, total), total = fma(-dmin, mn, total) record by
    record."""
    Tp, nb = xd.shape
    xsum16 = sums_per_16(x8, xd)

    def record(rec, sb, total):
        s, mn = np.zeros_like(total), np.zeros_like(total)
        for k in range(8):
            b = sb * 8 + k
            C = c_tiles(x8, b, b_tile_q2(rec, k)).astype(f32)
            m = [np.broadcast_to((rec[Q2K_SC + 32 * k + 16 * h:Q2K_SC + 32 * k + 16 * h + 16] >> 4)
                                 .astype(f32)[None], s.shape) for h in range(2)]
            s = fma(C, np.broadcast_to(xd[:, b:b + 1], s.shape), s)
            xm = [np.broadcast_to(xsum16[:, 2 * b + h:2 * b + h + 1], s.shape) for h in range(2)]
            mn = fma(m[1], xm[1], fma(m[0], xm[0], mn))
        dv = rec[Q6K_D:Q6K_D + 32].view(np.float16).astype(f32)
        mnv = rec[Q2K_DMIN:Q2K_DMIN + 32].view(np.float16).astype(f32)
        total = fma(np.broadcast_to(dv[None], s.shape), s, total)
        return fma(np.broadcast_to(-mnv[None], s.shape), mn, total)
    return twin_records(lin, Q2K_RECORD, nb // 8, Tp, T, record)


def b_tile_q3(rec, k):
    """Q3_K's B tile (8, 64) uint8 of block k: its 3-bit values (crumbs as Q2_K's, the
    third bit of row g of half h bit 2 g + h of the third bits' bytes, byte 4 l + i of
    lane l) less 4, times their row's int8 scale of that half, plus amx.Q3K_BIAS."""
    o = Q6K_QS + 192 * k
    quads = rec[o:o + 128].reshape(2, 64)
    third = rec[o + 128:o + 192]
    rows = []
    for h in range(2):
        sc = np.repeat(rec[Q6K_SC + 32 * k + 16 * h:Q6K_SC + 32 * k + 16 * h + 16].view(np.int8), 4)
        for g in range(4):
            q = ((quads[g % 2] >> (2 * (g // 2 + 2 * h))) & 3) | (((third >> (2 * g + h)) & 1) << 2)
            rows.append((q.astype(np.int32) - 4) * sc + amx.Q3K_BIAS)
    b = np.stack(rows)
    assert b.min() >= 0 and b.max() <= 252
    return b.astype(np.uint8)


def twin_matmul_q3(lin, x8, xd, xs8, T):
    """out (T, out_features) of a Q3_K Linear as the AMX kernel computes it: per strip,
    record (a super-block) and block, the int32 C of tdpbsud (x8 by the biased scaled
    values), dot = C - Q3K_BIAS xs8 in f32 (exact: q6_gemm's integer dot), q6_gemm's
    kind 3 f32 steps: s = fma(dot, dx, s) block by block, then total = fma(d, s, total)
    record by record."""
    Tp, nb = xd.shape

    def record(rec, sb, total):
        s = np.zeros_like(total)
        for k in range(8):
            b = sb * 8 + k
            C = c_tiles(x8, b, b_tile_q3(rec, k)).astype(f32)
            dot = C - (amx.Q3K_BIAS * xs8[:, b:b + 1]).astype(f32)
            s = fma(dot, np.broadcast_to(xd[:, b:b + 1], s.shape), s)
        dv = rec[Q6K_D:Q6K_D + 32].view(np.float16).astype(f32)
        return fma(np.broadcast_to(dv[None], s.shape), s, total)
    return twin_records(lin, Q3K_RECORD, nb // 8, Tp, T, record)


# the formats whose records are a super-block of 256 weights (the K-quants', IQ4_XS's)
SUPER_BLOCKS = {"Q4_K": G.Q4_K, "Q5_K": G.Q5_K, "Q6_K": G.Q6_K, "Q3_K": G.Q3_K, "Q2_K": G.Q2_K,
                "IQ4_XS": G.IQ4_XS}


def make(name, shape, seed):
    """A Linear of random weights in `name` (gguf-py's quantizer; the K-quants' and
    IQ4's ours, bit-exact with ggml's: gguf-py has none) and the file bytes."""
    type_ = SUPER_BLOCKS.get(name) or KINDS[name][0]
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape).astype(np.float32)
    w[1, :] *= 1e-6                         # f16 subnormal block scales
    ours = name in SUPER_BLOCKS or name == "IQ4_NL"
    data = formats.quantize(w, name) if ours else quantize(w, type_)
    return linear(int(type_), [(data, shape)]), data


def prep(x, pad=16):
    """prep_q8_rows' arrays for x (T, n), rows padded with zeros to a multiple of pad."""
    T, n = x.shape
    Tp = -(-T // pad) * pad
    x8, xd = np.zeros((Tp, n), np.int8), np.zeros((Tp, n // 32), f32)
    xs8, xsum = np.zeros((Tp, n // 32), np.int32), np.zeros((Tp, n // 32), f32)
    records.prep_q8_rows(x, x8, xd, xs8, xsum)
    return x8, xd, xs8, xsum


def file_sums(name, data, x8):
    """Per token, row and block, the exact int32 the tile product must give, from the
    file's bytes: S = sum q x8 (Q8_0, Q4_1, Q5_1; IQ4_NL's q its nibbles' values); Q4_0
    sum (q - 8) x8 = S - 8 xs8, Q5_0 sum (q - 16) x8."""
    rows = data.shape[0]
    if name == "Q8_0":
        q = data.reshape(rows, -1, 34)[:, :, 2:].view(np.int8).astype(np.int64)
    else:
        size = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "IQ4_NL": 18}[name]
        blocks = data.reshape(rows, -1, size)
        nib = blocks[:, :, -16:]
        q = np.concatenate([nib & 15, nib >> 4], axis=2).astype(np.int64)
        if name in ("Q5_0", "Q5_1"):               # the u32 before the nibbles: bit j, element j
            qh = blocks[:, :, -20:-16].copy().view("<u4").astype(np.int64)          # (rows, nb, 1)
            q |= ((qh >> np.arange(32)) & 1) << 4
        q -= {"Q4_0": 8, "Q5_0": 16}.get(name, 0)
        if name == "IQ4_NL":
            q = IQ4[q].astype(np.int64)
    x = x8.reshape(x8.shape[0], -1, 32).astype(np.int64)
    return np.einsum("rbe,tbe->trb", q, x)


@pytest.mark.parametrize("signs", ["ss", "su", "us", "uu"])
def test_tdp_model_is_the_instruction_definition(signs):
    # C[m][n] = sum over K/4 groups g and i of A[m][4g+i] B[g][4n+i], each byte read as
    # its instruction says (tdpbssd: both signed, tdpbsud: A signed, B unsigned, ...)
    rng = np.random.default_rng(len(signs) + ord(signs[0]) + 3 * ord(signs[1]))
    ta = np.int8 if signs[0] == "s" else np.uint8
    tb = np.int8 if signs[1] == "s" else np.uint8
    a = rng.integers(0, 256, (16, 64)).astype(np.uint8).view(ta)
    b = rng.integers(0, 256, (16, 64)).astype(np.uint8).view(tb)
    a[0] = np.array(-128 if ta is np.int8 else 255).astype(ta)     # the extremes
    b[:, 0:4] = np.array(-128 if tb is np.int8 else 255).astype(tb)
    want = np.zeros((16, 16), np.int64)
    for m in range(16):
        for n in range(16):
            want[m, n] = sum(int(a[m, 4 * g + i]) * int(b[g, 4 * n + i]) for g in range(16) for i in range(4))
    assert np.array_equal(tdp(a, b), want)


@pytest.mark.parametrize("name", list(KINDS))
def test_twin_tiles_give_the_exact_block_sums(name):
    # B tiles made of the records, A of x8: C is exactly the int32 the VNNI kernel's
    # float steps take (Q4_0 with its -8 folded in), for every token, row and block
    shape = (40, 96)                       # 3 blocks a row: records of one block
    lin, data = make(name, shape, 1)
    rng = np.random.default_rng(2)
    x8, xd, xs8, xsum = prep(rng.standard_normal((20, shape[1])).astype(f32))
    x8[0] = 127                            # the largest sums
    x8[1] = -127
    want = file_sums(name, data, x8)       # (Tp, rows, nb)
    kind, G_, R = lin.kind, lin.group, lin.R
    bb, nb = BLOCK_BYTES[kind], shape[1] // 32
    for r0 in range(0, shape[0], RECORD_ROWS):
        t, strip = divmod(r0, R)
        strip //= RECORD_ROWS
        for b in range(nb):
            sb, k = divmod(b, G_)
            o = (strip * (nb // G_) + sb) * G_ * bb
            B = b_tile(lin.q[t, o:o + G_ * bb], G_, kind, k)
            n = min(RECORD_ROWS, shape[0] - r0)
            for g in range(0, x8.shape[0], 16):
                C = tdp(x8[g:g + 16, 32 * b:32 * b + 32], B)
                assert np.array_equal(C[:, :n], want[g:g + 16, r0:r0 + n, b]), (r0, b, g)


@pytest.fixture
def vnni_only():
    """The VNNI path whatever this machine has; the AMX choice restored after."""
    was = amx._enabled
    amx._enabled = False
    yield
    amx._enabled = was


@pytest.mark.parametrize("name", list(KINDS))
@pytest.mark.parametrize("shape,T", [((300, 256), 17), ((100, 96), 5), ((64, 64), 1)])
def test_twin_has_the_vnni_kernels_bits(name, shape, T, vnni_only):
    # on every machine: the twin's float steps, in the AMX kernel's order, give the
    # VNNI path's bits (so the AMX kernel, computing the twin, does too)
    lin, _ = make(name, shape, T)
    x = np.random.default_rng(T).standard_normal((T, shape[1])).astype(f32)
    got = np.empty((T, shape[0]), f32)
    lin.matmul(x, got)
    x8, xd, _, xsum = prep(x)
    assert np.array_equal(got.view(np.int32), twin_matmul(lin, x8, xd, xsum, T).view(np.int32))


@pytest.mark.parametrize("name", SUPER_BLOCKS)
@pytest.mark.parametrize("shape,T", [((300, 256), 17), ((48, 512), 5), ((16, 256), 1)])
def test_super_block_twin_has_the_vnni_kernels_bits(name, shape, T, vnni_only):
    # the same for the super-block records: the twin of the AMX kernel gives q4k_gemm's
    # (q6_gemm's, iq4xs_gemm's) bits
    if name in ("Q6_K", "Q3_K") and ISAS[ISA].int16_pairs:
        pytest.skip("AVX2's q6_gemm takes Q6_K's and Q3_K's offsets off in f32; the bits AMX keeps "
                    "are the AVX-512 VNNI kernels', which this target does not run")
    lin, _ = make(name, shape, T)
    x = np.random.default_rng(T).standard_normal((T, shape[1])).astype(f32)
    x[0, :32] = 0                                 # a zero block of x (xd = 0)
    x[-1, 32:64] = 1e3                            # a block of x at +-127 (the largest sums)
    x[-1, 40] = -1e3
    got = np.empty((T, shape[0]), f32)
    lin.matmul(x, got)
    x8, xd, xs8, xsum = prep(x)
    twin = {"Q6_K": lambda: twin_matmul_q6(lin, x8, xd, T), "Q3_K": lambda: twin_matmul_q3(lin, x8, xd, xs8, T),
            "Q2_K": lambda: twin_matmul_q2(lin, x8, xd, T), "IQ4_XS": lambda: twin_matmul_xs(lin, x8, xd, T)
            }.get(name, lambda: twin_matmul_k(lin, x8, xd, xsum, T))()
    assert np.array_equal(got.view(np.int32), twin.view(np.int32))


def extreme_x8(seed):
    """x8 of 16 tokens x 256 as prep rounds it, tokens 0 and 1 at +127 and -127 (the
    largest sums)."""
    x8 = prep(np.random.default_rng(seed).standard_normal((16, 256)).astype(f32))[0]
    x8[0] = 127
    x8[1] = -127
    return x8


def strip_records(lin, size):
    """(first row, rows that are the file's, record bytes) of each strip of a Linear of
    20 rows and one super-block, records of `size` bytes."""
    for r0 in (0, 16):
        t, strip = divmod(r0, lin.R)
        o = strip // RECORD_ROWS * size
        yield r0, min(16, lin.out_features - r0), lin.q[t, o:o + size]


def test_q6_k_twin_tiles_give_the_exact_half_block_sums():
    # Q6_K's B tiles less 32, by x8's half-blocks: exactly sum((q - 32) x8) over each
    # 16 weights of the file's values (the B tiles rebuilt from the records are right)
    shape = (20, 256)
    lin, data = make("Q6_K", shape, 3)
    x8 = extreme_x8(4)
    ql, qh = data[:, :128].astype(np.int64), data[:, 128:192].astype(np.int64)
    q = np.zeros((shape[0], 256), np.int64)                # ggml's dequantize_row_q6_K order
    for h in range(2):
        for l in range(32):
            a, c = ql[:, 64 * h + l], ql[:, 64 * h + 32 + l]
            hb = qh[:, 32 * h + l]
            for j, v in enumerate((a & 15, c & 15, a >> 4, c >> 4)):
                q[:, 128 * h + 32 * j + l] = v | ((hb >> (2 * j)) & 3) << 4
    want = np.einsum("rbe,tbe->trb", (q - 32).reshape(shape[0], 16, 16),
                     x8.astype(np.int64).reshape(16, 16, 16))
    for r0, n, rec in strip_records(lin, Q6K_RECORD):
        for k in range(8):
            for h, B in enumerate(b_tiles_q6(rec, k)):
                C = tdp(x8[:, 32 * k + 16 * h:32 * k + 16 * h + 16], B)
                assert np.array_equal(C[:, :n], want[:, r0:r0 + n, 2 * k + h]), (r0, k, h)


def test_q2_k_twin_tiles_give_the_exact_scaled_block_sums():
    # Q2_K's B tiles (its values times their scales) by x8's blocks: exactly
    # sc0 sum(q x8) + sc1 sum(q x8) over the halves of each block, from the file's 2-bit
    # values and scale bytes (the B tiles made of the records are right, and the scaled
    # values fit the unsigned bytes tdpbsud reads)
    shape = (20, 256)
    lin, data = make("Q2_K", shape, 11)
    x8 = extreme_x8(12)
    data[2, :16] = 0xFF                                    # the largest scales (15) and mins
    lin = linear(int(G.Q2_K), [(data, shape)])
    qs = data[:, 16:80].astype(np.int64)                   # q_e: bits 2k of qs[32 h + l]
    e = np.arange(256)
    q = (qs[:, 32 * (e // 128) + e % 32] >> (2 * ((e % 128) // 32))) & 3
    sc = (data[:, :16] & 15).astype(np.int64)              # (rows, 16): per sub-block of 16
    half = np.einsum("rbe,tbe->trb", q.reshape(shape[0], 16, 16), x8.astype(np.int64).reshape(16, 16, 16))
    want = (half * sc[None]).reshape(16, shape[0], 8, 2).sum(axis=3)       # (tokens, rows, blocks)
    assert (q * np.repeat(sc, 16, axis=1)).max() == 45
    for r0, n, rec in strip_records(lin, Q2K_RECORD):
        for k in range(8):
            C = tdp(x8[:, 32 * k:32 * k + 32], b_tile_q2(rec, k))
            assert np.array_equal(C[:, :n], want[:, r0:r0 + n, k]), (r0, k)


def test_q3_k_twin_tiles_give_the_exact_scaled_block_sums():
    # Q3_K's B tiles (its values less 4 times their scales, biased) by x8's blocks, less
    # Q3K_BIAS times x8's block sums: exactly sum over the halves of sc sum((q - 4) x8),
    # from the file's bytes, at the extremes: scales -32 and 31, levels 0 and 7 (the
    # product 128 that no int8 holds is among them)
    shape = (20, 256)
    lin, data = make("Q3_K", shape, 13)
    data[2, 96:108] = 0                                    # row 2: every scale -32
    data[3, 96:108] = 0xFF                                 # row 3: every scale 31
    data[2:4, :96] = 0                                     # rows 2, 3: every level 0 (q - 4 = -4)
    data[4, :96] = 0xFF                                    # row 4: every level 7
    lin = linear(int(G.Q3_K), [(data, shape)])
    x8 = extreme_x8(14)
    xs8 = x8.reshape(16, 8, 32).astype(np.int64).sum(axis=2)
    e = np.arange(256)
    hm, qs, sb = data[:, :32].astype(np.int64), data[:, 32:96].astype(np.int64), data[:, 96:108].astype(np.int64)
    q = ((qs[:, 32 * (e // 128) + e % 32] >> (2 * ((e % 128) // 32))) & 3) | (((hm[:, e % 32] >> (e // 32)) & 1) << 2)
    j = np.arange(16)
    sc = ((sb[:, j % 8] >> (4 * (j // 8))) & 15 | ((sb[:, 8 + j % 4] >> (2 * (j // 4))) & 3) << 4) - 32
    half = np.einsum("rbe,tbe->trb", (q - 4).reshape(shape[0], 16, 16), x8.astype(np.int64).reshape(16, 16, 16))
    want = (half * sc[None]).reshape(16, shape[0], 8, 2).sum(axis=3)       # (tokens, rows, blocks)
    assert sc[2].min() == -32 and sc[3].max() == 31 and q[4].min() == 7
    for r0, n, rec in strip_records(lin, Q3K_RECORD):
        for k in range(8):
            C = tdp(x8[:, 32 * k:32 * k + 32], b_tile_q3(rec, k))
            got = C[:, :n].astype(np.int64) - amx.Q3K_BIAS * xs8[:, k:k + 1]
            assert np.array_equal(got, want[:, r0:r0 + n, k]), (r0, k)


# --- permission and fallback ------------------------------------------------------------------

@pytest.mark.parametrize("kind, K", [(KIND_Q4_0, 32), (amx.KIND_Q4_K, 32), (amx.KIND_Q6_K, 16), (amx.KIND_Q2_K, 32)])
def test_tile_config_bytes(kind, K):
    cfg = amx.tile_config(kind)
    assert len(cfg) == 64 and cfg[0] == 1 and cfg[1] == 0
    for ta, tb, tc in amx.SETS:
        colsb = lambda i: cfg[16 + 2 * i] | cfg[17 + 2 * i] << 8
        assert (cfg[48 + ta], colsb(ta)) == (16, K)          # A: 16 tokens x K bytes
        assert (cfg[48 + tb], colsb(tb)) == (K // 4, 64)     # B: K/4 rows of 4 x 16 bytes
        assert (cfg[48 + tc], colsb(tc)) == (16, 64)         # C: 16 x 16 int32
    unused = set(range(8)) - {i for s in amx.SETS for i in s}
    assert all(cfg[48 + i] == 0 and cfg[16 + 2 * i] == 0 for i in unused)


class _Refusing:
    """ctypes.CDLL's stand-in: a libc whose syscall() answers rc and records its calls."""

    def __init__(self, rc):
        self.calls = []
        this = self

        class Syscall:
            restype = None

            def __call__(self, *args):
                this.calls.append([getattr(a, "value", a) for a in args])
                return rc
        self.syscall = Syscall()

    def __call__(self, *a, **k):
        return self


def test_refused_permission_falls_back(monkeypatch):
    # arch_prctl refused (an old kernel, no AMX, a VM without XFD): no AMX, silently,
    # and prefill takes the VNNI kernels
    libc = _Refusing(-1)
    monkeypatch.setattr(amx.ctypes, "CDLL", libc)
    assert amx.request_permission() is False
    assert libc.calls[0][:3] == [amx.SYS_ARCH_PRCTL, amx.ARCH_REQ_XCOMP_PERM, amx.XFEATURE_XTILEDATA]
    monkeypatch.setattr(amx, "_enabled", None)
    assert amx.enabled() is False
    assert amx.kernels_name() == ISA_NAMES[ISA]
    lin, _ = make("Q4_0", (64, 64), 0)
    assert lin._tokens(64) == (TOKENS, TOKENS)


def test_granted_but_not_readable_back_falls_back(monkeypatch):
    # the request answers 0 but ARCH_GET_XCOMP_PERM does not show the bit: no AMX
    libc = _Refusing(0)
    monkeypatch.setattr(amx.ctypes, "CDLL", libc)
    assert amx.request_permission() is False
    assert [c[1] for c in libc.calls] == [amx.ARCH_REQ_XCOMP_PERM, amx.ARCH_GET_XCOMP_PERM]


def test_no_tile_instructions_in_the_target_falls_back(monkeypatch):
    monkeypatch.setattr(amx, "COMPILED", False)
    monkeypatch.setattr(amx, "_enabled", None)
    assert amx.enabled() is False and amx.use(True) is False


def _fresh_process(env_extra):
    env = dict(os.environ, **env_extra)
    code = "from edgellama.kernels import amx; print(amx.enabled(), amx.kernels_name())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True, cwd=Path(__file__).parents[2]).stdout.strip()


def _cpu_has_amx() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " amx_tile" in flags and " amx_int8" in flags


def test_a_fresh_process_asks_once_and_says_which_path():
    out = _fresh_process({})
    expect = amx.COMPILED and _cpu_has_amx()
    assert out.startswith(str(expect)), out
    assert ("AMX" in out) == out.startswith("True")
    assert _fresh_process({"EDGELLAMA_AMX": "0"}) == f"False {ISA_NAMES[ISA]}"


# --- the AMX kernel, where it runs ---------------------------------------------------------------

@pytest.fixture
def on_amx(monkeypatch):
    """AMX prefill on, for any number of rows of x; skips where it cannot run."""
    was = amx._enabled
    if not amx.use(True):
        amx._enabled = was
        pytest.skip("no AMX tiles here (the CPU, Numba's target or Linux's permission)")
    monkeypatch.setattr(records, "AMX_MIN_ROWS", 1)
    threads = numba.get_num_threads()
    numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))   # two workers' tile configs
    yield
    numba.set_num_threads(threads)
    amx._enabled = was


def _both(lin, x, fine=False):
    """(VNNI, AMX) products of x, AMX on around the second."""
    lin.fine = fine
    out = [np.empty((x.shape[0], lin.out_features), f32) for _ in range(2)]
    amx._enabled = False
    lin.matmul(x, out[0])
    amx._enabled = True
    calls = []
    real = records.matmul_blocks_amx
    records.matmul_blocks_amx = lambda *a: (calls.append(1), real(*a))
    try:
        lin.matmul(x, out[1])
    finally:
        records.matmul_blocks_amx = real
    assert calls, "the AMX kernel did not run"
    return out


@pytest.mark.parametrize("name, shape", [(n, s) for n in KINDS
                                         for s in [(300, 256), (100, 96), (48, 64)]]  # G = 8, 1, 2
                         + [(n, s) for n in SUPER_BLOCKS
                            for s in [(300, 256), (48, 2048), (16, 512)]])
def test_amx_prefill_has_the_vnni_bits(name, shape, on_amx):
    lin, _ = make(name, shape, 5)
    rng = np.random.default_rng(6)
    for T in (1, 5, 16, 17, 40, 70):                  # 70: two calls of GROUPS token groups
        x = rng.standard_normal((T, shape[1])).astype(f32)
        x[0, :32] = 0                                 # a zero block of x (xd = 0)
        vnni, got = _both(lin, x)
        assert np.array_equal(vnni.view(np.int32), got.view(np.int32)), (T, np.abs(vnni - got).max())


@pytest.mark.parametrize("name", [*KINDS, *SUPER_BLOCKS])
def test_amx_fine_activations_have_the_vnni_bits(name, on_amx):
    lin, _ = make(name, (80, 128 if name in KINDS else 256), 7)
    x = np.random.default_rng(8).standard_normal((9, lin.in_features)).astype(f32)
    vnni, got = _both(lin, x, fine=True)
    assert np.array_equal(vnni.view(np.int32), got.view(np.int32))


def test_amx_kernel_is_the_twin(on_amx):
    lin, _ = make("Q4_0", (200, 256), 9)
    x = np.random.default_rng(10).standard_normal((33, 256)).astype(f32)
    got = np.empty((33, 200), f32)
    lin.matmul(x, got)
    x8, xd, _, xsum = prep(x)
    assert np.array_equal(got.view(np.int32), twin_matmul(lin, x8, xd, xsum, 33).view(np.int32))
