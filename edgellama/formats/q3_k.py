"""Q3_K: 256 weights per super-block of 16 sub-blocks of 16, 110 bytes, 3-bit values
with a signed 6-bit scale per sub-block.

    hmask:u8[32]  qs:u8[64]  scales:u8[12]  d:f16
    x_e = d * (sc_j - 32) * (q_e - 4),  j = e // 16,  q_e = low_e | high_e << 2 in 0..7
low_e is bits 2k, 2k+1 of qs[32h + l] and high_e bit e // 32 of hmask[l], where h = e // 128,
k = (e % 128) // 32, l = e % 32. sc_j (6 bits): the low 4 from nibble j // 8 of
scales[j % 8], the top 2 from bits 2 (j // 4) and up of scales[8 + j % 4].

Runtime tiles (lanes across rows, see base.TiledLinear):
    w  (nt, nb*16*3*R) u16  per sub-block 3 words: word i holds q of elements 5i..5i+4 in
                            bits 3k..3k+2 and bit i of q_15 in bit 15
    sc (nt, nb*16*R) i8     sc_j - 32
    d  (nt, nb*R) u16       f16 bits
114 bytes per super-block resident (110 in the file). Why 3-bit fields: decode multiplies
every field of a word by x with one shift and one int16 multiply-add (see prep_q3_k_x),
so a sub-block costs 18 of them; the file's 2-bit + 1-bit planes would cost 32.

Decode quantizes x to int8 per super-block (llama.cpp's Q8_K: one scale per 256), sums
each sub-block in int16 lanes (exact: |sum (q - 4) xq| <= 16 * 4 * 127), weights the
sub-block sums by sc in int32, and applies d and the x scale once per super-block.

Prefill is the record formats' int8 GEMM (q6_k.RewrittenTiles, x rounded per 32): each
tile is rewritten as Q6_K records (q6_records: q6 = q + 28, a 16-weight scale each, as
Q3_K's) and multiplied by q6_gemm, or on AMX tiles, while they are in its thread's
cache. Holding them for the whole matrix would take 6.6 bits a weight beside the 3.6
decode reads. Rewriting a tile costs about what eight decode products of it do (warm),
so a prompt of a few tokens costs more than decoding them one by one would; from about
a dozen tokens up it costs less (bench/results/design_measurements.json, "Q3_K and Q2_K prefill").
"""
from __future__ import annotations

from functools import cache

import numpy as np
from gguf.constants import LlamaFileType
from numba import njit, prange

from ..kernels.fp import f16_to_f32, get_f16, nearest_int, put_f16
from ..kernels.simd import Q6K_D, Q6K_QS, Q6K_RECORD, Q6K_SC, RECORD_ROWS
from .base import WeightFormat, block_sizes, release_pages, repack_halves
from .q6_k import RewrittenTiles

f32 = np.float32
QK, BS = block_sizes("Q3_K")   # weights and bytes per super-block
GROUP_MAX_EPS = f32(1e-15)
_CHUNK = 64                # super-blocks per parallel work item of the reference kernels


# --- shared with q2_k: ggml's rounding and the K-quant activation side --------------------

@njit(cache=True, inline="always")
def pack_2bit(L, out, o):
    # the low 2 bits of levels L (256,) -> out[o:o+64], ggml's Q2_K / Q3_K qs order: byte
    # 32h + l holds elements 128h + l + 32k in bits 2k
    for h in range(2):
        for l in range(32):
            e = 128 * h + l
            out[o + 32 * h + l] = L[e] | (L[e + 32] << 2) | (L[e + 64] << 4) | (L[e + 96] << 6)


@njit(cache=True, inline="always")
def quantize_x_block(x, b, xq):
    # x[256b:256b+256] -> xq (256,) int in [-127, 127], rounded to nearest; returns the
    # scale amax / 127 (as llama.cpp quantizes activations to Q8_K for K-quant dot products)
    amax = f32(0)
    for e in range(QK):
        amax = max(amax, abs(x[QK * b + e]))
    d = amax / f32(127)
    inv = f32(1) / d if d > 0 else f32(0)
    for e in range(QK):
        xq[e] = int(np.rint(x[QK * b + e] * inv))
    return d


@njit(cache=True, inline="always")
def put_scale(out, o, v):
    # store v as f16 at out[o:o+2]; True if it is not finite there: overflow, or NaN (huge
    # inputs make ggml's scale search inf / inf): a scale the file cannot hold
    put_f16(out, o, v)
    return (out[o + 1] & 0x7C) == 0x7C


@njit(cache=True, inline="always")
def tile_span(row0, rows, R, t):
    # lanes r0..r1 of tile t that rows row0..row0+rows of one stacked tensor fill
    return max(0, row0 - t * R), min(R, row0 + rows - t * R)


# --- reference quantize / dequantize (bit-exact with ggml's quantize_row_q3_K_ref) -------

@njit(cache=True, error_model="numpy")
def make_q3_quants(x, xo, L, lo):
    # ggml's make_q3_quants(16, nmax=4, x + xo, L + lo, do_rmse=true): levels in 0..7
    # (all 0 for an all-zero group) -> L[lo:lo+16] int8; returns the scale. The same f32
    # operations in the same order as the C (w x l is (w x) l, x sl2 / slx is (x sl2) / slx).
    mx = f32(0)
    amax = f32(0)
    for i in range(16):
        ax = abs(x[xo + i])
        if ax > amax:
            amax = ax
            mx = x[xo + i]
    if amax < GROUP_MAX_EPS:
        for i in range(16):
            L[lo + i] = 0
        return f32(0)
    iscale = f32(-4) / mx
    sumlx = f32(0)
    suml2 = f32(0)
    for i in range(16):
        v = x[xo + i]
        l = max(-4, min(3, nearest_int(iscale * v)))
        L[lo + i] = l
        w = v * v
        fl = f32(l)
        sumlx += w * v * fl
        suml2 += w * fl * fl
    for _ in range(5):
        changed = 0
        for i in range(16):
            v = x[xo + i]
            w = v * v
            li = f32(L[lo + i])
            slx = sumlx - w * v * li
            if slx > 0:
                sl2 = suml2 - w * li * li
                new_l = max(-4, min(3, nearest_int(v * sl2 / slx)))
                if new_l != L[lo + i]:
                    fn = f32(new_l)
                    slx += w * v * fn
                    sl2 += w * fn * fn
                    if sl2 > 0 and slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[lo + i] = new_l
                        sumlx = slx
                        suml2 = sl2
                        changed += 1
        if changed == 0:
            break
    for i in range(16):
        L[lo + i] += 4
    return sumlx / suml2 if suml2 > 0 else f32(0)


@njit(cache=True, inline="always")
def q3_scale(q, o, j):
    # sub-block j's 6-bit scale minus 32, from the 12 scale bytes at q[o:o+12]
    lo = (np.int32(q[o + j % 8]) >> (4 * (j // 8))) & 15
    hi = (np.int32(q[o + 8 + j % 4]) >> (2 * (j // 4))) & 3
    return (lo | (hi << 4)) - 32


@njit(cache=True, error_model="numpy")
def quantize_block(x, xo, out, o, L, scales):
    # ggml's quantize_row_q3_K_ref for the super-block x[xo:xo+256] -> out[o:o+110];
    # L (256,) i8 and scales (16,) f32 are scratch. Returns True if d is not finite as f16.
    max_scale = f32(0)
    amax = f32(0)
    for j in range(16):
        s = make_q3_quants(x, xo + 16 * j, L, 16 * j)
        scales[j] = s
        if abs(s) > amax:                    # strict: the first largest |scale| wins
            amax = abs(s)
            max_scale = s
    sc = out[o + 96:o + 108]
    sc[:] = 0
    over = False
    if max_scale != 0:                       # C's `if (max_scale)`: NaN passes too
        iscale = f32(-32) / max_scale
        for j in range(16):
            l = np.int32(np.int8(nearest_int(iscale * scales[j])))   # C stores it in int8_t
            l = max(-32, min(31, l)) + 32
            if j < 8:
                sc[j] = l & 15
            else:
                sc[j - 8] |= (l & 15) << 4
            sc[8 + j % 4] |= (l >> 4) << (2 * (j // 4))
        over = put_scale(out, o + 108, f32(1) / iscale)
    else:
        put_f16(out, o + 108, f32(0))
    d_all = get_f16(out, o + 108)
    for j in range(16):
        dl = d_all * f32(q3_scale(out, o + 96, j))
        if dl == 0:                          # keep make_q3_quants' levels (C: `if (!d)`)
            continue
        for i in range(16):
            L[16 * j + i] = max(-4, min(3, nearest_int(x[xo + 16 * j + i] / dl))) + 4
    hm = out[o:o + 32]
    hm[:] = 0
    for e in range(QK):                      # high bit of element e: bit e // 32 of hmask[e % 32]
        if L[e] > 3:
            hm[e % 32] |= 1 << (e // 32)
            L[e] -= 4
    pack_2bit(L, out, o + 32)
    return over


@njit(parallel=True, cache=True, error_model="numpy")
def quantize_q3_k(x, out):
    # x (nb*256,) f32 -> out (nb*110,) u8; returns (non-finite blocks, overflowing scales)
    nb = x.size // QK
    bad = 0
    over = 0
    for c in prange(-(-nb // _CHUNK)):
        L = np.empty(QK, np.int8)
        scales = np.empty(16, f32)
        for b in range(c * _CHUNK, min(nb, (c + 1) * _CHUNK)):
            chk = f32(0)
            amax = f32(0)
            for e in range(QK):
                chk += x[QK * b + e] * f32(0)   # NaN iff some value is NaN or inf
                amax = max(amax, abs(x[QK * b + e]))
            if np.isnan(chk):
                bad += 1
            # beyond |x| ~ 4e12 make_q3_quants' w x l = 4 x^3 overflows f32 and ggml may
            # write a zero scale (below, d overflows f16 first): too large all the same
            huge = not np.isfinite(f32(4) * amax * amax * amax)
            if quantize_block(x, QK * b, out, BS * b, L, scales) or huge:
                over += 1
    return bad, over


@njit(parallel=True, cache=True)
def dequantize_q3_k(q, out):
    # q (nb*110,) u8 -> out (nb*256,) f32, as gguf.quants: (d * (sc - 32)) * (q - 4)
    for b in prange(out.size // QK):
        o = BS * b
        d = get_f16(q, o + 108)
        for j in range(16):
            dl = d * f32(q3_scale(q, o + 96, j))
            h, k, l0 = j // 8, (j % 8) // 2, 16 * (j % 2)
            for i in range(16):
                low = (np.int32(q[o + 32 + 32 * h + l0 + i]) >> (2 * k)) & 3
                v = low | (((np.int32(q[o + l0 + i]) >> (j // 2)) & 1) << 2)
                out[QK * b + 16 * j + i] = dl * f32(v - 4)


# --- load: the file's blocks -> tiles ----------------------------------------------------

@njit(cache=True, parallel=True)
def repack_q3_k(raw, row0, w, sc):
    # raw (rows, nb*110) u8, file rows row0.. of W -> tiles w, sc (see the module doc).
    # Sub-block by sub-block of one tile (L2-resident): contiguous lane writes.
    rows = raw.shape[0]
    nb = raw.shape[1] // BS
    R = sc.shape[1] // (16 * nb)
    for t in prange(row0 // R, (row0 + rows - 1) // R + 1):
        r0, r1 = tile_span(row0, rows, R, t)
        src = raw[t * R + r0 - row0:t * R + r1 - row0]
        wt = w[t]
        for b in range(nb):
            o = BS * b
            for j in range(16):
                h, k, l0 = j // 8, (j % 8) // 2, 16 * (j % 2)
                g = 16 * b + j
                for r in range(r1 - r0):
                    blk = src[r, o:o + BS]
                    sc[t, g * R + r0 + r] = q3_scale(blk, 96, j)
                    w0 = 0
                    w1 = 0
                    w2 = 0
                    for i in range(16):
                        low = (np.int32(blk[32 + 32 * h + l0 + i]) >> (2 * k)) & 3
                        v = low | (((np.int32(blk[l0 + i]) >> (j // 2)) & 1) << 2)
                        if i < 5:
                            w0 |= v << (3 * i)
                        elif i < 10:
                            w1 |= v << (3 * i - 15)
                        elif i < 15:
                            w2 |= v << (3 * i - 30)
                        else:
                            w0 |= (v & 1) << 15
                            w1 |= ((v >> 1) & 1) << 15
                            w2 |= (v >> 2) << 15
                    wt[(3 * g) * R + r0 + r] = w0
                    wt[(3 * g + 1) * R + r0 + r] = w1
                    wt[(3 * g + 2) * R + r0 + r] = w2


# --- decode: x prepared once per matvec, then int16 sub-block sums ------------------------

@njit(cache=True, error_model="numpy")
def prep_q3_k_x(x, xq, co, xd):
    # x (n,) f32 -> xd (nb,) the x scale per super-block and, per sub-block g, co[g] (19,)
    # int16: for word i, co[g, 6i:6i+6] = (y0, y1 - 8 y0, .., y4 - 8 y3, 2^i y15 - 8 y4) with
    # y = xq[5i:5i+5]; then for a word u, sum_k ((u >> 3k) co[6i+k]) = sum of its fields
    # times their x (the terms telescope), its bit 15 counting 2^i q_15; co[g, 18] =
    # -4 sum(xq) for the -4 offset. Products and partial sums may wrap int16 but are exact
    # mod 2^16, and the total sum((q - 4) xq) is within 16 * 4 * 127 < 2^15: exact.
    for b in range(xd.size):
        xd[b] = quantize_x_block(x, b, xq)
        for j in range(16):
            y = xq[16 * j:16 * j + 16]
            c = co[16 * b + j]
            s = 0
            for i in range(3):
                c[6 * i] = y[5 * i]
                for k in range(1, 5):
                    c[6 * i + k] = y[5 * i + k] - 8 * y[5 * i + k - 1]
                c[6 * i + 5] = (1 << i) * y[15] - 8 * y[5 * i + 4]
            for i in range(16):
                s += y[i]
            c[18] = -4 * s


@njit(cache=True, fastmath=True, inline="always")
def q3_sub(wt, o, c, s):
    # s (R,) int16 = sum over one sub-block of (q - 4) xq, its 3 words wt[o:o+3R] (lanes
    # across rows) times the coefficients c = co[g] of prep_q3_k_x
    R = s.size
    a0 = c[0]; b01 = c[1]; b02 = c[2]; b03 = c[3]; b04 = c[4]; b05 = c[5]
    a1 = c[6]; b11 = c[7]; b12 = c[8]; b13 = c[9]; b14 = c[10]; b15 = c[11]
    a2 = c[12]; b21 = c[13]; b22 = c[14]; b23 = c[15]; b24 = c[16]; b25 = c[17]
    m = c[18]
    p0 = wt[o:o + R]; p1 = wt[o + R:o + 2 * R]; p2 = wt[o + 2 * R:o + 3 * R]
    for r in range(R):
        u0 = np.int32(p0[r]); u1 = np.int32(p1[r]); u2 = np.int32(p2[r])
        # only 16 bits are stored: LLVM narrows it all to int16 vector ops
        s[r] = np.int16(m + u0 * a0 + (u0 >> 3) * b01 + (u0 >> 6) * b02 + (u0 >> 9) * b03
                        + (u0 >> 12) * b04 + (u0 >> 15) * b05
                        + u1 * a1 + (u1 >> 3) * b11 + (u1 >> 6) * b12 + (u1 >> 9) * b13
                        + (u1 >> 12) * b14 + (u1 >> 15) * b15
                        + u2 * a2 + (u2 >> 3) * b21 + (u2 >> 6) * b22 + (u2 >> 9) * b23
                        + (u2 >> 12) * b24 + (u2 >> 15) * b25)


@cache
def matvec_q3_k(R):
    """The decode kernel for tiles of R rows. R is a compile-time constant here: the
    weighting loop then reads its 32 runs of lanes at fixed offsets from two pointers
    instead of 32 computed ones (a third less decode time at R = 256)."""

    @njit(cache=True, fastmath=True, parallel=True)
    def matvec(w, sc, d, co, xd, out, scratch, s16):
        # W (nt*R, n) Q3_K tiles w (nt, nb*48*R) u16, sc (nt, nb*16*R) i8, d (nt, nb*R)
        # u16 @ x (prep_q3_k_x: co, xd) -> out (d,); scratch (nt, R) f32, s16 (nt, 16*R)
        # int16. The int16 sums go through s16 so that their loop is int16-only (32
        # lanes a vector; mixed with the int32 weighting LLVM runs it 16 lanes wide).
        nt = w.shape[0]
        nb = xd.size
        for t in prange(nt):
            wt = w[t]
            acc = scratch[t]
            s = s16[t]
            acc[:] = 0
            for b in range(nb):
                for j in range(16):
                    g = 16 * b + j
                    q3_sub(wt, 3 * g * R, co[g], s[j * R:(j + 1) * R])
                sb = sc[t, 16 * b * R:16 * (b + 1) * R]
                db = d[t, b * R:(b + 1) * R]
                dx = xd[b]
                for r in range(R):
                    a = np.int32(0)              # |a| <= 16 * 32 * 8128 < 2^23
                    for j in range(16):
                        a = np.int32(a + np.int32(s[j * R + r]) * np.int32(sb[j * R + r]))
                    acc[r] += f16_to_f32(db[r]) * dx * f32(a)
            n = min(R, out.size - t * R)
            out[t * R:t * R + n] = acc[:n]
    return matvec


# --- prefill: a tile at a time as Q6_K records, multiplied while they are in cache ------

@njit(cache=True, inline="always")
def q3_level(u0, u1, u2, e):
    # level q (0..7) of element e (< 16) of a sub-block, from its 3 words
    if e == 15:
        return (u0 >> 15) | ((u1 >> 14) & 2) | ((u2 >> 13) & 4)
    u = u0 if e < 5 else (u1 if e < 10 else u2)
    return (u >> (3 * (e % 5))) & 7


@njit(cache=True)
def q6_records(w, sc, d, R, qt):
    # one Q3_K tile (w (nb*48*R,) u16, sc (nb*16*R,) i8, d (nb*R,) u16) -> qt (R/16 * nb *
    # Q6K_RECORD,) u8: its rows as Q6_K records (q6_k.py; simd.py's Q6K_* layout) with
    # q6 = q + 28, so d sc (q6 - 32) = d sc (q - 4): the same integers in the same sums.
    # q6 is 28..35: its low nibble (q + 12) & 15, its high bits 1 + q // 4.
    nb = d.size // R
    q32 = qt.view(np.uint32)
    q16 = qt.view(np.uint16)
    q8 = qt.view(np.int8)
    for s in range(R // RECORD_ROWS):
        for b in range(nb):
            rec = (s * nb + b) * Q6K_RECORD
            for lane in range(RECORD_ROWS):
                q16[(rec + Q6K_D) // 2 + lane] = d[b * R + RECORD_ROWS * s + lane]
            for k in range(8):
                ga = 16 * b + 2 * k            # the block's two sub-blocks: ga, ga + 1
                for h in range(2):
                    for lane in range(RECORD_ROWS):
                        q8[rec + Q6K_SC + 32 * k + 16 * h + lane] = sc[(ga + h) * R + RECORD_ROWS * s + lane]
                quads = (rec + Q6K_QS + 384 * k) // 4
                for lane in range(RECORD_ROWS):
                    r = RECORD_ROWS * s + lane
                    a0 = np.int32(w[3 * ga * R + r])
                    a1 = np.int32(w[(3 * ga + 1) * R + r])
                    a2 = np.int32(w[(3 * ga + 2) * R + r])
                    b0 = np.int32(w[(3 * ga + 3) * R + r])
                    b1 = np.int32(w[(3 * ga + 4) * R + r])
                    b2 = np.int32(w[(3 * ga + 5) * R + r])
                    for g in range(4):             # nibble quads: bytes j = 4g + i
                        v = 0
                        for i in range(4):
                            lo = (q3_level(a0, a1, a2, 4 * g + i) + 12) & 15
                            hi = (q3_level(b0, b1, b2, 4 * g + i) + 12) & 15
                            v |= (lo | (hi << 4)) << (8 * i)
                        q32[quads + 16 * g + lane] = v
                    for g in range(2):             # crumb quads: bytes j = 4g + i
                        v = 0
                        for i in range(4):
                            j = 4 * g + i
                            c = ((1 + (q3_level(a0, a1, a2, j) >> 2))
                                 | ((1 + (q3_level(a0, a1, a2, 8 + j) >> 2)) << 2)
                                 | ((1 + (q3_level(b0, b1, b2, j) >> 2)) << 4)
                                 | ((1 + (q3_level(b0, b1, b2, 8 + j) >> 2)) << 6))
                            v |= c << (8 * i)
                        q32[quads + 64 + 16 * g + lane] = v


@njit(cache=True, parallel=True)
def q6_tiles(w, sc, d, t0, t1, R, recs):
    # Q3_K tiles t0..t1 -> recs[:t1-t0] (q6_records), one tile a thread
    for t in prange(t0, t1):
        q6_records(w[t], sc[t], d[t], R, recs[t - t0])


# --- embedding: dequantized rows -----------------------------------------------------------

@njit(cache=True)
def rows_q3_k(w, sc, d, ids, out):
    # Q3_K tiles, ids (T,) -> out (T, n) f32 dequantized rows
    nb = out.shape[1] // QK
    R = d.shape[1] // nb
    for k in range(ids.size):
        t = ids[k] // R
        r = ids[k] % R
        row = out[k]
        for b in range(nb):
            dd = f16_to_f32(d[t, b * R + r])
            for j in range(16):
                g = 16 * b + j
                dl = dd * f32(sc[t, g * R + r])
                u0 = np.int32(w[t, 3 * g * R + r])
                u1 = np.int32(w[t, (3 * g + 1) * R + r])
                u2 = np.int32(w[t, (3 * g + 2) * R + r])
                for i in range(15):
                    u = u0 if i < 5 else (u1 if i < 10 else u2)
                    row[QK * b + 16 * j + i] = dl * f32(((u >> (3 * (i % 5))) & 7) - 4)
                v = (u0 >> 15) | ((u1 >> 14) & 2) | ((u2 >> 13) & 4)
                row[QK * b + 16 * j + 15] = dl * f32(v - 4)


class Q3KLinear(RewrittenTiles):
    """Q3_K in row tiles: w (nt, nb*48*R) u16, sc (nt, nb*16*R) i8, d (nt, nb*R) u16;
    prefill on them rewritten as Q6_K records (q6_records)."""

    def tile_spec(self):
        nb, nt, R = self.in_features // QK, self.nt, self.R
        return {"w": ((nt, nb * 48 * R), np.uint16), "sc": ((nt, nb * 16 * R), np.int8),
                "d": ((nt, nb * R), np.uint16)}

    def _load(self, raws):
        self._alloc_tiles()
        row0 = 0
        for raw in raws:
            repack_q3_k(raw, row0, self.w, self.sc)
            repack_halves(raw, row0, BS, 108, self.d)
            release_pages(raw)
            row0 += raw.shape[0]

    def decode_buffers(self):
        # per-tile sums (nt, R) f32, (nt, 16R) i16; prep_q3_k_x's xq, co, xd
        nb, nt, R = self.in_features // QK, self.nt, self.R
        return (np.zeros((nt, R), f32), np.zeros((nt, 16 * R), np.int16),
                np.zeros(QK, np.int16), np.zeros((nb * 16, 19), np.int16), np.zeros(nb, f32))

    def matvec(self, x, out, scratch=None):
        # int8 per 256 whether or not fine is set: fine would rewrite every tile per token
        acc, s16, xq, co, xd = self._buffers(scratch)
        prep_q3_k_x(x, xq, co, xd)
        matvec_q3_k(self.R)(self.w, self.sc, self.d, co, xd, out, acc, s16)

    def _rewrite(self, t0, t1, recs):
        q6_tiles(self.w, self.sc, self.d, t0, t1, self.R, recs)

    def _rows(self, ids, out):
        rows_q3_k(self.w, self.sc, self.d, ids, out)


Q3_K = WeightFormat("Q3_K", "hmask:u8[32], qs:u8[64], scales:u8[12] (6-bit), d:f16; "
                    "x=d*(sc-32)*(q-4)",
                    Q3KLinear, dequantize_q3_k, quantize_q3_k, LlamaFileType.MOSTLY_Q3_K_M)
