"""Numba kernels of the linear layers (the class that owns them is linear.py).

Quantized weights are repacked at load into row tiles read with lanes across rows:
for a tile of R output rows, byte j of block b of all R rows is contiguous:
    Q4_0 / Q4_1  q (nt, nb, 16, R) u8,  d [, m] (nt, nb, R) u16 (f16 bits)
    Q8_0         q (nt, nb, 32, R) i8,  d (nt, nb, R) u16
so the inner loop is an R-wide multiply-add of weight bytes by one broadcast x value:
no per-block horizontal sum, the block scale is one R-wide multiply per block, and
the bytes read are the file's bytes (4 bits per weight, f16 scales). R (16..256) is a
runtime size; rows past out_features are zero padding. Q4 sums run in int16 lanes
against x quantized per block (see prep_q4_x); Q8_0 sums run in f32 (int8 x int8
products do not fit int16, and Q8_0 is memory-bound already).

Inner loops index 1-D slices with the loop counter itself: an index like o + r into a
bigger array makes LLVM fear a negative (wrap-around) index and fall back to scalar
byte inserts (3x slower, seen in inspect_asm).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

f32 = np.float32


# --- f16 / bf16 bits -> f32 (Numba has no float16 type) -------------------------------

@intrinsic
def f16_to_f32(typingctx, h):
    # u16 f16 bits -> f32: LLVM's fpext half -> float, which is vcvtph2ps (F16C, on
    # every AVX2 CPU) and vectorises in loops. 5-17% faster Q4_0 matvec than a
    # bit-twiddling conversion through a scratch buffer.
    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.uint16), codegen


@intrinsic
def bf16_to_f32(typingctx, h):
    # u16 bf16 bits -> f32: the top half of the f32 bit pattern
    def codegen(context, builder, sig, args):
        bits = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
        return builder.bitcast(bits, ir.FloatType())
    return types.float32(types.uint16), codegen


# --- activations prepared once per matvec --------------------------------------------

@njit(cache=True, fastmath=True)
def prep_q4_x(x, xa, xb, xd, xm, xsum):
    # x (n,) f32 -> per block of 32, x quantized like llama.cpp's q8_0 activations:
    # xq = round(x / xd) in [-127, 127], xd (nb,) the scale; then for a nibble byte
    # v = lo + 16 hi, lo xq_j + hi xq_j+16 = v xa_j + (v >> 4) xb_j with xa (n/2,) int16
    # = xq_j, xb = xq_j+16 - 16 xq_j (no nibble mask in the inner loop);
    # xm (nb,) int16 = -8 sum(xq); xsum (nb,) exact float sums of x.
    # Why int16: the kernels sum in int16 lanes (16 per 256-bit vector, vs 8 f32).
    # Products and partial sums may wrap, but int16 arithmetic is exact mod 2^16 and the
    # final sum((q - 8) xq) is within 32 * 8 * 127 = 32512 < 2^15, so it comes out exact.
    nb = xd.size
    for b in range(nb):
        xblk = x[32 * b:32 * b + 32]
        amax = f32(0)
        s = f32(0)
        for j in range(32):
            amax = max(amax, abs(xblk[j]))
            s += xblk[j]
        d = amax / f32(127)
        inv = f32(1) / d if d > 0 else f32(0)
        qs = 0
        for j in range(16):
            lo = int(np.rint(xblk[j] * inv))
            hi = int(np.rint(xblk[j + 16] * inv))
            xa[16 * b + j] = lo
            xb[16 * b + j] = hi - 16 * lo          # |.| <= 17 * 127
            qs += lo + hi
        xd[b] = d
        xm[b] = -8 * qs                            # |.| <= 8 * 32 * 127 < 2^15
        xsum[b] = s


# --- decode: quantized matvec ----------------------------------------------------------

@njit(cache=True, fastmath=True)
def _q4_block(qt, o, xa, xb, k, s, m):
    # s (R,) int16 = m + sum over one block of nibbles qt[o:o+16R] (16 bytes per row,
    # lanes across rows) times x (xa, xb from k = 16 b); 4 bytes of each row per pass.
    R = s.size
    s[:] = m
    for j in range(0, 16, 4):
        a0 = xa[k + j]; b0 = xb[k + j]; a1 = xa[k + j + 1]; b1 = xb[k + j + 1]
        a2 = xa[k + j + 2]; b2 = xb[k + j + 2]; a3 = xa[k + j + 3]; b3 = xb[k + j + 3]
        p = o + j * R
        q0 = qt[p:p + R]; q1 = qt[p + R:p + 2 * R]
        q2 = qt[p + 2 * R:p + 3 * R]; q3 = qt[p + 3 * R:p + 4 * R]
        for r in range(R):
            v0 = np.int16(q0[r]); v1 = np.int16(q1[r]); v2 = np.int16(q2[r]); v3 = np.int16(q3[r])
            # computed wide by Numba's typing, but only 16 bits are stored: LLVM narrows
            # the whole expression to int16 vector ops (vpmullw / vpaddw)
            s[r] = np.int16(s[r] + v0 * a0 + (v0 >> 4) * b0 + v1 * a1 + (v1 >> 4) * b1
                            + v2 * a2 + (v2 >> 4) * b2 + v3 * a3 + (v3 >> 4) * b3)


@njit(cache=True, fastmath=True, parallel=True)
def matvec_q4_0(q, d, xa, xb, xd, xm, out, scratch, s16):
    # W (nt*R, n) Q4_0 tiles q (nt, nb*16*R), d (nt, nb*R) @ x (prep_q4_x) -> out (d,)
    # scratch (nt, R) f32 and s16 (nt, R) int16: per-tile sums
    nt = q.shape[0]
    R = s16.shape[1]
    nb = xd.size
    for t in prange(nt):
        qt = q[t]
        dt = d[t]
        acc = scratch[t]
        s = s16[t]
        acc[:] = 0
        for b in range(nb):
            _q4_block(qt, 16 * b * R, xa, xb, 16 * b, s, xm[b])
            db = dt[b * R:(b + 1) * R]
            dx = xd[b]
            for r in range(R):
                acc[r] += f16_to_f32(db[r]) * dx * f32(s[r])
        n = min(R, out.size - t * R)
        out[t * R:t * R + n] = acc[:n]


@njit(cache=True, fastmath=True, parallel=True)
def matvec_q4_1(q, d, m, xa, xb, xd, xm, xsum, out, scratch, s16):
    # W (nt*R, n) Q4_1 tiles q (nt, nb*16*R), d, m (nt, nb*R) @ x (prep_q4_x) -> out (d,)
    # row . x = sum_b d_b dx_b sum(q xq) + m_b sum(x); sum(q xq) = s + 8 sum(xq) = s - xm
    nt = q.shape[0]
    R = s16.shape[1]
    nb = xd.size
    for t in prange(nt):
        qt = q[t]
        acc = scratch[t]
        s = s16[t]
        acc[:] = 0
        for b in range(nb):
            _q4_block(qt, 16 * b * R, xa, xb, 16 * b, s, xm[b])
            db = d[t, b * R:(b + 1) * R]
            mb = m[t, b * R:(b + 1) * R]
            dx = xd[b]
            off = -f32(xm[b])
            xs = xsum[b]
            for r in range(R):
                acc[r] += f16_to_f32(db[r]) * dx * (f32(s[r]) + off) + f16_to_f32(mb[r]) * xs
        n = min(R, out.size - t * R)
        out[t * R:t * R + n] = acc[:n]


@njit(cache=True, fastmath=True, parallel=True)
def matvec_q8_0(q, d, x, out, scratch):
    # W (nt*R, n) Q8_0 tiles q (nt, nb*32*R) i8, d (nt, nb*R) u16 @ x (n,) -> out (d,)
    # scratch (nt, 2, R) f32: per-tile sums
    nt = q.shape[0]
    R = scratch.shape[2]
    nb = x.size // 32
    for t in prange(nt):
        qt = q[t]
        dt = d[t]
        acc = scratch[t, 0]
        s = scratch[t, 1]
        acc[:] = 0
        for b in range(nb):
            s[:] = 0
            for j in range(0, 32, 4):
                k = 32 * b + j
                x0 = x[k]; x1 = x[k + 1]; x2 = x[k + 2]; x3 = x[k + 3]
                o = k * R
                q0 = qt[o:o + R]; q1 = qt[o + R:o + 2 * R]
                q2 = qt[o + 2 * R:o + 3 * R]; q3 = qt[o + 3 * R:o + 4 * R]
                for r in range(R):
                    s[r] += f32(q0[r]) * x0 + f32(q1[r]) * x1 + f32(q2[r]) * x2 + f32(q3[r]) * x3
            db = dt[b * R:(b + 1) * R]
            for r in range(R):
                acc[r] += f16_to_f32(db[r]) * s[r]
        n = min(R, out.size - t * R)
        out[t * R:t * R + n] = acc[:n]


# --- load: repack file blocks into row tiles --------------------------------------------

@njit(cache=True, parallel=True)
def repack_blocks(raw, row0, nh, pl, q, h):
    # raw (rows, nb*(2*nh+pl)) u8 file blocks [nh f16 halves, pl payload bytes], to be
    # rows row0.. of the tiles q (nt, nb*pl*R) u8, h (nh, nt, nb*R) u16.
    # Column by column of one tile (L2-resident): contiguous writes, 7x faster than
    # row by row with strided writes.
    rows = raw.shape[0]
    bs = 2 * nh + pl
    nb = raw.shape[1] // bs
    R = h.shape[2] // nb
    t0 = row0 // R
    for t in prange(t0, (row0 + rows - 1) // R + 1):
        qt = q[t]
        r0 = max(0, row0 - t * R)                  # tile lanes r0..r1 <- raw rows
        r1 = min(R, row0 + rows - t * R)
        n = r1 - r0
        tile = raw[t * R + r0 - row0:t * R + r1 - row0]
        for b in range(nb):
            o = b * bs
            for k in range(nh):
                hk = h[k, t, b * R + r0:b * R + r1]
                lo = tile[:, o + 2 * k]
                hi = tile[:, o + 2 * k + 1]
                for r in range(n):
                    hk[r] = np.uint16(lo[r]) | (np.uint16(hi[r]) << np.uint16(8))
            for j in range(pl):
                dst = qt[(b * pl + j) * R + r0:(b * pl + j) * R + r1]
                col = tile[:, o + 2 * nh + j]
                for r in range(n):
                    dst[r] = col[r]


# --- prefill: dequantize a run of tiles, transposed, for BLAS -------------------------
# Serial on purpose: this is a few % of the matmul's time, and a parallel region between BLAS
# calls fights BLAS's threads (spin-waits) and stalls whenever any core is busy.

@njit(cache=True, fastmath=True)
def dequant_q4_tiles(q, d, m, m_off, t0, t1, wt):
    # Q4 tiles t0..t1 -> wt (n, (t1-t0)*R) f32 = W[rows].T; m_off: Q4_0 -8 (x = (q-8) d),
    # Q4_1 1 (x = q d + m). Rows of wt are R-wide runs of lanes: contiguous writes.
    nb = wt.shape[0] // 32
    R = d.shape[1] // nb
    dsc = np.empty(R, f32)
    msc = np.empty(R, f32)
    for b in range(nb):
        for t in range(t0, t1):
            for r in range(R):
                dsc[r] = f16_to_f32(d[t, b * R + r])
                msc[r] = f16_to_f32(m[t, b * R + r]) * m_off
            c = (t - t0) * R
            for j in range(16):
                qj = q[t, (16 * b + j) * R:(16 * b + j + 1) * R]
                lo = wt[32 * b + j, c:c + R]
                hi = wt[32 * b + 16 + j, c:c + R]
                for r in range(R):
                    lo[r] = f32(qj[r] & 15) * dsc[r] + msc[r]
                    hi[r] = f32(qj[r] >> 4) * dsc[r] + msc[r]


@njit(cache=True, fastmath=True)
def dequant_q8_tiles(q, d, t0, t1, wt):
    # Q8_0 tiles t0..t1 -> wt (n, (t1-t0)*R) f32 = W[rows].T
    nb = wt.shape[0] // 32
    R = d.shape[1] // nb
    dsc = np.empty(R, f32)
    for b in range(nb):
        for t in range(t0, t1):
            for r in range(R):
                dsc[r] = f16_to_f32(d[t, b * R + r])
            c = (t - t0) * R
            for j in range(32):
                qj = q[t, (32 * b + j) * R:(32 * b + j + 1) * R]
                w = wt[32 * b + j, c:c + R]
                for r in range(R):
                    w[r] = f32(qj[r]) * dsc[r]


# --- embedding lookup ------------------------------------------------------------------

@njit(cache=True, fastmath=True)
def rows_q4(q, d, m, m_off, ids, out):
    # Q4 tiles, ids (T,) -> out (T, n) f32 dequantized rows
    nb = out.shape[1] // 32
    R = d.shape[1] // nb
    for i in range(ids.size):
        t = ids[i] // R
        r = ids[i] % R
        row = out[i]
        for b in range(nb):
            dd = f16_to_f32(d[t, b * R + r])
            mm = f16_to_f32(m[t, b * R + r]) * m_off if m_off == f32(1) else dd * m_off
            for j in range(16):
                v = q[t, (16 * b + j) * R + r]
                row[32 * b + j] = f32(v & 15) * dd + mm
                row[32 * b + 16 + j] = f32(v >> 4) * dd + mm


@njit(cache=True, fastmath=True)
def rows_q8(q, d, ids, out):
    # Q8_0 tiles, ids (T,) -> out (T, n) f32 dequantized rows
    nb = out.shape[1] // 32
    R = d.shape[1] // nb
    for i in range(ids.size):
        t = ids[i] // R
        r = ids[i] % R
        row = out[i]
        for b in range(nb):
            dd = f16_to_f32(d[t, b * R + r])
            for j in range(32):
                row[32 * b + j] = f32(q[t, (32 * b + j) * R + r]) * dd


# --- unquantized weights (file layout, rows contiguous) ---------------------------------

@njit(cache=True, fastmath=True, parallel=True)
def matvec_f32(w, x, out):
    # W (d, n) f32 @ x (n,) -> out (d,)
    for i in prange(w.shape[0]):
        row = w[i]
        s = f32(0)
        for k in range(x.size):
            s += row[k] * x[k]
        out[i] = s


@njit(cache=True, fastmath=True, parallel=True)
def matvec_f16(w, x, out):
    # W (d, n) f16 bits (u16) @ x (n,) -> out (d,)
    for i in prange(w.shape[0]):
        row = w[i]
        s = f32(0)
        for k in range(x.size):
            s += f16_to_f32(row[k]) * x[k]
        out[i] = s


@njit(cache=True, fastmath=True, parallel=True)
def matvec_bf16(w, x, out):
    # W (d, n) bf16 bits (u16) @ x (n,) -> out (d,)
    for i in prange(w.shape[0]):
        row = w[i]
        s = f32(0)
        for k in range(x.size):
            s += bf16_to_f32(row[k]) * x[k]
        out[i] = s
