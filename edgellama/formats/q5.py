"""Q5_0 and Q5_1: 32 weights per block, 5-bit values with an f16 scale (and min).

    Q5_0  22 bytes  d:f16, qh:u32, qs:u8[16]         x_j = (u_j - 16) * d
    Q5_1  24 bytes  d:f16, m:f16, qh:u32, qs:u8[16]  x_j = u_j * d + m
u_j = nibble_j | (bit j of qh) << 4; nibble j < 16 is the low nibble of qs[j], j >= 16 the
high nibble of qs[j - 16] (Q4 order).

Runtime tiles (lanes across rows, see base.TiledLinear):
    w (nt, nb*10*R) u16 words,  d [, m] (nt, nb*R) u16 f16 bits
The 20 value bytes of a block are repacked into ten 16-bit words, five per half-block
(group) of 16 weights: word k holds u[3k], u[3k+1], u[3k+2] in bits 0-4, 5-9, 10-14 and
bit k of u[15] in bit 15 (indices within the group). Same bytes as the file, and each
word is summed in int16 lanes with three shifts and four multiplies:
    w a0 + (w >> 5) a1 + (w >> 10) a2 + (w >> 15) a3
telescopes to u0 c0 + u1 c1 + u2 c2 + bit c3 for a0 = c0, a1 = c1 - 32 c0,
a2 = c2 - 32 c1, a3 = c3 - 32 c2 (all mod 2^16), c the int8 x values (c3 = 2^k x[15]):
11 int16 ops per 3.2 weights, against ~5.5 per weight for Q4's nibble sums plus a separate
high-bit plane. A group sums (u - 16) xq, within 16*16*127 < 2^15: exact in int16.
"""
from __future__ import annotations

import numpy as np
from gguf.constants import LlamaFileType
from numba import njit, prange

from ..kernels.fp import f16_to_f32, get_f16, put_f16, wrap_u8
from .base import TiledLinear, WeightFormat, block_sizes, release_pages, repack_halves
from .q4 import signed_absmax
from .records import prep_q8_x

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


# --- load: the file's blocks -> word tiles ------------------------------------------------

@njit(cache=True, parallel=True)
def repack_q5(raw, row0, bs, off, dst):
    # Values of every block (bs bytes, qh at byte off, qs after it) of raw (rows, nb*bs) u8
    # -> rows row0.. of the word tiles dst (nt, nb*10*R) u16 (layout: module docstring).
    rows = raw.shape[0]
    nb = raw.shape[1] // bs
    R = dst.shape[1] // (nb * 10)
    for t in prange(row0 // R, (row0 + rows - 1) // R + 1):
        r0 = max(0, row0 - t * R)
        r1 = min(R, row0 + rows - t * R)
        u = np.empty((r1 - r0, 32), np.int32)        # one block of the tile's rows
        for b in range(nb):
            for r in range(r1 - r0):
                row = raw[t * R + r0 - row0 + r]
                o = b * bs + off
                qh = (np.int32(row[o]) | (np.int32(row[o + 1]) << 8)
                      | (np.int32(row[o + 2]) << 16) | (np.int32(row[o + 3]) << 24))
                for j in range(16):
                    v = np.int32(row[o + 4 + j])
                    u[r, j] = (v & 15) | (((qh >> j) & 1) << 4)
                    u[r, 16 + j] = (v >> 4) | (((qh >> (16 + j)) & 1) << 4)
            for i in range(10):                       # word i: group i // 5, k = i % 5
                e = 16 * (i // 5) + 3 * (i % 5)
                top = 16 * (i // 5) + 15
                lane = dst[t, (10 * b + i) * R + r0:(10 * b + i) * R + r1]
                for r in range(r1 - r0):
                    lane[r] = np.uint16(u[r, e] | (u[r, e + 1] << 5) | (u[r, e + 2] << 10)
                                        | (((u[r, top] >> (i % 5)) & 1) << 15))


# --- decode: x prepared once per matvec, then int16 word sums ----------------------------

@njit(cache=True)
def prep_q5_x(x, x8, xd, xs8, xsum, c, xm5):
    # x (n,) f32 -> records.prep_q8_x's int8 x8 per block of 32 (scale xd, sums xs8 and
    # xsum) and from it c (nb*40,) int16, the 4 coefficients of
    # each of the 10 words of a block (module docstring), and xm5 (nb*2,) int16 =
    # -16 sum(xq) per group of 16, so that a group sums to sum((u - 16) xq): within
    # +-16*16*127 < 2^15, exact in int16 however the partial sums wrap.
    prep_q8_x(x, x8, xd, xs8, xsum)
    e = np.empty(16, np.int64)
    for b in range(xd.size):
        for g in range(2):
            tot = 0
            for j in range(16):
                e[j] = x8[32 * b + 16 * g + j]
                tot += e[j]
            xm5[2 * b + g] = -16 * tot
            for k in range(5):
                o = 4 * (10 * b + 5 * g + k)
                c0 = e[3 * k]
                c1 = e[3 * k + 1]
                c2 = e[3 * k + 2]
                c[o] = c0
                c[o + 1] = np.int16((c1 - 32 * c0) & 0xFFFF)
                c[o + 2] = np.int16((c2 - 32 * c1) & 0xFFFF)
                c[o + 3] = np.int16(((e[15] << k) - 32 * c2) & 0xFFFF)


@njit(cache=True, fastmath=True, inline="always")
def q5_block(q16, o, c, k, s0, s1, m0, m1):
    # s0, s1 (R,) int16 = m0, m1 + the words q16[o:o+5R], q16[o+5R:o+10R] (groups 0 and 1
    # of one block, lanes across rows) times their coefficients c[k:k+20], c[k+20:k+40]
    # (prep_q5_x)
    R = s0.size
    a00 = c[k]; a01 = c[k + 1]; a02 = c[k + 2]; a03 = c[k + 3]
    a10 = c[k + 4]; a11 = c[k + 5]; a12 = c[k + 6]; a13 = c[k + 7]
    a20 = c[k + 8]; a21 = c[k + 9]; a22 = c[k + 10]; a23 = c[k + 11]
    a30 = c[k + 12]; a31 = c[k + 13]; a32 = c[k + 14]; a33 = c[k + 15]
    a40 = c[k + 16]; a41 = c[k + 17]; a42 = c[k + 18]; a43 = c[k + 19]
    b00 = c[k + 20]; b01 = c[k + 21]; b02 = c[k + 22]; b03 = c[k + 23]
    b10 = c[k + 24]; b11 = c[k + 25]; b12 = c[k + 26]; b13 = c[k + 27]
    b20 = c[k + 28]; b21 = c[k + 29]; b22 = c[k + 30]; b23 = c[k + 31]
    b30 = c[k + 32]; b31 = c[k + 33]; b32 = c[k + 34]; b33 = c[k + 35]
    b40 = c[k + 36]; b41 = c[k + 37]; b42 = c[k + 38]; b43 = c[k + 39]
    w0 = q16[o:o + R]; w1 = q16[o + R:o + 2 * R]; w2 = q16[o + 2 * R:o + 3 * R]
    w3 = q16[o + 3 * R:o + 4 * R]; w4 = q16[o + 4 * R:o + 5 * R]
    y0 = q16[o + 5 * R:o + 6 * R]; y1 = q16[o + 6 * R:o + 7 * R]
    y2 = q16[o + 7 * R:o + 8 * R]; y3 = q16[o + 8 * R:o + 9 * R]
    y4 = q16[o + 9 * R:o + 10 * R]
    for r in range(R):
        # computed wide by Numba's typing, but only 16 bits are stored: LLVM narrows each
        # group sum to int16 vector ops (vpmullw / vpaddw)
        v0 = w0[r]; v1 = w1[r]; v2 = w2[r]; v3 = w3[r]; v4 = w4[r]
        s0[r] = np.int16(m0 + v0 * a00 + (v0 >> 5) * a01 + (v0 >> 10) * a02 + (v0 >> 15) * a03
                         + v1 * a10 + (v1 >> 5) * a11 + (v1 >> 10) * a12 + (v1 >> 15) * a13
                         + v2 * a20 + (v2 >> 5) * a21 + (v2 >> 10) * a22 + (v2 >> 15) * a23
                         + v3 * a30 + (v3 >> 5) * a31 + (v3 >> 10) * a32 + (v3 >> 15) * a33
                         + v4 * a40 + (v4 >> 5) * a41 + (v4 >> 10) * a42 + (v4 >> 15) * a43)
        v0 = y0[r]; v1 = y1[r]; v2 = y2[r]; v3 = y3[r]; v4 = y4[r]
        s1[r] = np.int16(m1 + v0 * b00 + (v0 >> 5) * b01 + (v0 >> 10) * b02 + (v0 >> 15) * b03
                         + v1 * b10 + (v1 >> 5) * b11 + (v1 >> 10) * b12 + (v1 >> 15) * b13
                         + v2 * b20 + (v2 >> 5) * b21 + (v2 >> 10) * b22 + (v2 >> 15) * b23
                         + v3 * b30 + (v3 >> 5) * b31 + (v3 >> 10) * b32 + (v3 >> 15) * b33
                         + v4 * b40 + (v4 >> 5) * b41 + (v4 >> 10) * b42 + (v4 >> 15) * b43)


@njit(cache=True, fastmath=True, parallel=True)
def matvec_q5(w, d, m, has_m, c, xd, xm5, xsum, out, scratch, s16):
    # W (nt*R, n) Q5 tiles w (nt, nb*10*R) u16, d [, m] (nt, nb*R) @ x -> out (d,)
    # (x from prep_q5_x). Q5_0: row . x = sum_b d dx (s0 + s1);
    # Q5_1: d dx sum(u xq) + m xsum (x as quantized), sum(u xq) = s0 + s1 - (xm5_0 + xm5_1).
    # scratch (nt, R) f32, s16 (nt, 2, R) int16: per-tile sums. The int16 group sums and
    # the f32 update are separate loops: fused, LLVM picks 16 lanes for both (f32 width),
    # halving the int16 throughput.
    nt = w.shape[0]
    R = scratch.shape[1]
    nb = xd.size
    for t in prange(nt):
        wt = w[t]
        acc = scratch[t]
        s0 = s16[t, 0]
        s1 = s16[t, 1]
        acc[:] = 0
        for b in range(nb):
            m0 = xm5[2 * b]
            m1 = xm5[2 * b + 1]
            q5_block(wt, 10 * b * R, c, 40 * b, s0, s1, m0, m1)
            db = d[t, b * R:(b + 1) * R]
            dx = xd[b]
            if has_m:
                mb = m[t, b * R:(b + 1) * R]
                off = -f32(np.int32(m0) + np.int32(m1))
                xs = xsum[b]
                for r in range(R):
                    acc[r] += (f16_to_f32(db[r]) * dx * (f32(np.int32(s0[r]) + np.int32(s1[r])) + off)
                               + f16_to_f32(mb[r]) * xs)
            else:
                for r in range(R):
                    acc[r] += f16_to_f32(db[r]) * dx * f32(np.int32(s0[r]) + np.int32(s1[r]))
        n = min(R, out.size - t * R)
        out[t * R:t * R + n] = acc[:n]


# --- prefill and embedding: dequantize from tiles (serial: see base.TiledLinear._dequant_tiles)

@njit(cache=True, inline="always")
def _value(u, d, m, has_m):
    # gguf's value of 5-bit u: Q5_1 u d + m, Q5_0 (u - 16) d (no + 0: keeps -0.0)
    return f32(u) * d + m if has_m else f32(u - 16) * d


@njit(cache=True)
def dequant_q5_tiles(w, d, m, has_m, t0, t1, wt):
    # Q5 tiles t0..t1 -> wt (n, (t1-t0)*R) f32 = W[rows].T, exactly gguf's values
    # (no fastmath: no fused multiply-add). The has_m branches sit outside the lane loops.
    nb = wt.shape[0] // 32
    R = d.shape[1] // nb
    dsc = np.empty(R, f32)
    msc = np.empty(R, f32)
    for b in range(nb):
        for t in range(t0, t1):
            for r in range(R):
                dsc[r] = f16_to_f32(d[t, b * R + r])
                msc[r] = f16_to_f32(m[t, b * R + r])
            c = (t - t0) * R
            for g in range(2):
                o = (10 * b + 5 * g) * R
                e = 32 * b + 16 * g
                for k in range(5):
                    wk = w[t, o + k * R:o + (k + 1) * R]
                    x0 = wt[e + 3 * k, c:c + R]
                    x1 = wt[e + 3 * k + 1, c:c + R]
                    x2 = wt[e + 3 * k + 2, c:c + R]
                    if has_m:
                        for r in range(R):
                            v = np.int32(wk[r])
                            x0[r] = f32(v & 31) * dsc[r] + msc[r]
                            x1[r] = f32((v >> 5) & 31) * dsc[r] + msc[r]
                            x2[r] = f32((v >> 10) & 31) * dsc[r] + msc[r]
                    else:
                        for r in range(R):
                            v = np.int32(wk[r])
                            x0[r] = f32((v & 31) - 16) * dsc[r]
                            x1[r] = f32(((v >> 5) & 31) - 16) * dsc[r]
                            x2[r] = f32(((v >> 10) & 31) - 16) * dsc[r]
                w0 = w[t, o:o + R]
                w1 = w[t, o + R:o + 2 * R]
                w2 = w[t, o + 2 * R:o + 3 * R]
                w3 = w[t, o + 3 * R:o + 4 * R]
                w4 = w[t, o + 4 * R:o + 5 * R]
                x15 = wt[e + 15, c:c + R]               # its 5 bits: the words' top bits
                for r in range(R):
                    u = (np.int32(w0[r] >> 15) | (np.int32(w1[r] >> 15) << 1)
                         | (np.int32(w2[r] >> 15) << 2) | (np.int32(w3[r] >> 15) << 3)
                         | (np.int32(w4[r] >> 15) << 4))
                    x15[r] = _value(u, dsc[r], msc[r], has_m)


@njit(cache=True)
def rows_q5(w, d, m, has_m, ids, out):
    # Q5 tiles, ids (T,) -> out (T, n) f32 dequantized rows (values as dequant_q5_tiles)
    nb = out.shape[1] // 32
    R = d.shape[1] // nb
    for i in range(ids.size):
        t = ids[i] // R
        r = ids[i] % R
        row = out[i]
        for b in range(nb):
            dd = f16_to_f32(d[t, b * R + r])
            mm = f16_to_f32(m[t, b * R + r])
            for g in range(2):
                top = 0
                for k in range(5):
                    v = np.int32(w[t, (10 * b + 5 * g + k) * R + r])
                    e = 32 * b + 16 * g + 3 * k
                    row[e] = _value(v & 31, dd, mm, has_m)
                    row[e + 1] = _value((v >> 5) & 31, dd, mm, has_m)
                    row[e + 2] = _value((v >> 10) & 31, dd, mm, has_m)
                    top |= (v >> 15) << k
                row[32 * b + 16 * g + 15] = _value(top, dd, mm, has_m)


class Q5Linear(TiledLinear):
    """Q5_0 / Q5_1 in row tiles: w (nt, nb*10*R) u16 words, d [, m] (nt, nb*R) u16."""

    def _setup(self, fmt, splits, in_features):
        super()._setup(fmt, splits, in_features)
        self.has_m = self.type_name == "Q5_1"

    def tile_spec(self):
        nb, nt, R = self.in_features // 32, self.nt, self.R
        spec = {"w": ((nt, nb * 10 * R), np.uint16), "d": ((nt, nb * R), np.uint16)}
        if self.has_m:
            spec["m"] = ((nt, nb * R), np.uint16)
        return spec

    def _tiles_set(self):
        if not self.has_m:
            self.m = self.d          # the kernels take m; Q5_0 never reads it

    def _load(self, raws):
        bs = self.fmt.type_size
        off = 4 if self.has_m else 2                    # byte offset of qh in a block
        self._alloc_tiles()
        row0 = 0
        for raw in raws:
            repack_halves(raw, row0, bs, 0, self.d)
            if self.has_m:
                repack_halves(raw, row0, bs, 2, self.m)
            repack_q5(raw, row0, bs, off, self.w)
            release_pages(raw)
            row0 += raw.shape[0]

    def decode_buffers(self):
        # per-tile sums (nt, R) f32, (nt, 2, R) i16; prep_q5_x's x8, xd, xs8, xsum, c, xm5
        n, nb, nt, R = self.in_features, self.in_features // 32, self.nt, self.R
        return (np.zeros((nt, R), f32), np.zeros((nt, 2, R), np.int16), np.zeros(n, np.int8),
                np.zeros(nb, f32), np.zeros(nb, np.int32), np.zeros(nb, f32),
                np.zeros(nb * 40, np.int16), np.zeros(nb * 2, np.int16))

    def matvec(self, x, out, scratch=None):
        acc, s16, x8, xd, xs8, xsum, c, xm5 = self._buffers(scratch)
        prep_q5_x(x, x8, xd, xs8, xsum, c, xm5)
        matvec_q5(self.w, self.d, self.m, self.has_m, c, xd, xm5, xsum, out, acc, s16)

    def _dequant_tiles(self, t0, t1, wt):
        dequant_q5_tiles(self.w, self.d, self.m, self.has_m, t0, t1, wt)

    def _rows(self, ids, out):
        rows_q5(self.w, self.d, self.m, self.has_m, ids, out)


Q5_0 = WeightFormat("Q5_0", "d:f16, qh:u32, qs:u8[16]; x=(nibble|qh_bit<<4 - 16)*d",
                    Q5Linear, dequantize_q5_0, quantize_q5_0, LlamaFileType.MOSTLY_Q5_0)
Q5_1 = WeightFormat("Q5_1", "d:f16, m:f16, qh:u32, qs:u8[16]; x=(nibble|qh_bit<<4)*d+m",
                    Q5Linear, dequantize_q5_1, quantize_q5_1, LlamaFileType.MOSTLY_Q5_1)
