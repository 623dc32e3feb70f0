"""Q4_K: 256 weights per super-block of 8 sub-blocks of 32, 144 bytes, and the pieces
every "K-quant with 6-bit sub-block scales and mins" shares (Q4_K, Q5_K: see q5_k.py).

    d:f16  dmin:f16  scales:u8[12]  qs:u8[128]
    x = d * sc_s * q - dmin * m_s   for element e of sub-block s (e in 0..31)
q (4 bits) is nibble s % 2 of qs[32 (s // 2) + e]: sub-blocks 2p and 2p+1 share 32 bytes.
The 12 scale bytes hold sc_s and m_s (6 bits each), as ggml's get_scale_min_k4 reads them:
s < 4: sc = scales[s] & 63, m = scales[s+4] & 63; s >= 4: the low 4 bits from
scales[s+4] (sc low nibble, m high nibble), the top 2 from bits 6-7 of scales[s-4] (sc)
and scales[s] (m).

Runtime tiles (lanes across rows, see base.TiledLinear), shared by Q4_K and Q5_K:
    q (nt, nsub*S*R) u8     per sub-block u, at u*S*R: its quants ((S-2)*R bytes), then
                            its sc (R bytes), then its m (R bytes)
    d, dmin (nt, nsb*R) u16 f16 bits, per super-block
Q4_K: S = 18, the quants are the nibbles re-paired into Q4_0 order (byte j holds elements
j and j+16 of the sub-block), so q4.py's int16 kernel (q4_block + prep_q4_x) runs on them
unchanged. 4.625 bits per weight resident (4.5 in the file). Decode: per sub-block
sum(q xq) = s16 + 8 sum(xq) (as matvec_q4_1), weighted by sc_s and m_s in f32, then by
d and dmin once per super-block.
Why sc and m sit inside the quant stream: read from DRAM (24 matrices of 2048 x 8192,
2 threads, this 2-core VM), the same kernel reads 0.79x Q4_0's bytes/s with sc and m in
arrays of their own, 0.89-0.92x interleaved, and 0.68x with d and dmin interleaved too.
Measured as committed (2048 x 8192, Q4_0 in the same run): decode 0.79-0.85x Q4_0's
bytes/s from DRAM and 0.8x from L3 with 2 threads (0.88x and 0.83x with one); prefill
(T = 512) 1.0x Q4_0's time.
"""
from __future__ import annotations

import numpy as np
from gguf.constants import LlamaFileType
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..fp import f16_to_f32, get_f16, nearest_int, put_f16
from .base import TiledLinear, WeightFormat, anon_array, release_pages
from .q4 import prep_q4_x, q4_block

f32 = np.float32
QK_K = 256
_CHUNK = 64                 # super-blocks per parallel work item of the quantizers


# --- the 12-byte 6-bit scales and mins (shared with q5_k) --------------------------------

@njit(cache=True, inline="always")
def get_scale_min_k4(q, o, j):
    # sub-block j's (scale, min), 6 bits each, from the 12 scale bytes at q[o:o+12]
    if j < 4:
        return q[o + j] & 63, q[o + j + 4] & 63
    sc = (q[o + j + 4] & 0xF) | ((q[o + j - 4] >> 6) << 4)
    m = (q[o + j + 4] >> 4) | ((q[o + j] >> 6) << 4)
    return sc, m


@njit(cache=True, error_model="numpy", inline="always")
def make_qkx2_quants(n, nmax, x, xo, weights, L, lo, Laux, rmin, rdelta, nstep, use_mad):
    # ggml's make_qkx2_quants over x[xo:xo+n] -> L[lo:lo+n] in 0..nmax, Laux (n,) scratch;
    # returns (scale, the_min). The error is sum w |diff| if use_mad, else sum w diff^2
    # (Q2_K: n 16, use_mad; Q4_K, Q5_K: n 32). Same float32 operations in the same order
    # as the C, and IEEE division (callers compile with error_model numpy: x/0 is inf or
    # NaN, as in C, not an exception). Inlined: the callers' constants reach the loops.
    mn = x[xo]
    mx = x[xo]
    sum_w = weights[0]
    sum_x = sum_w * x[xo]
    for i in range(1, n):
        v = x[xo + i]
        if v < mn:                      # noqa: PLR1730 (the C's comparisons, NaN included)
            mn = v
        if v > mx:                      # noqa: PLR1730
            mx = v
        w = weights[i]
        sum_w += w
        sum_x += w * v
    if mn > f32(0):                     # noqa: PLR1730
        mn = f32(0)
    if mx == mn:
        for i in range(n):
            L[lo + i] = 0
        return f32(0), -mn
    iscale = f32(nmax) / (mx - mn)
    scale = f32(1) / iscale
    best_error = f32(0)
    for i in range(n):
        l = nearest_int(iscale * (x[xo + i] - mn))
        l = max(0, min(nmax, l))
        L[lo + i] = l
        diff = scale * f32(l) + mn - x[xo + i]
        best_error += weights[i] * (abs(diff) if use_mad else diff * diff)
    for step in range(nstep + 1):
        iscale = (rmin + rdelta * f32(step) + f32(nmax)) / (mx - mn)
        sum_l = f32(0)
        sum_l2 = f32(0)
        sum_xl = f32(0)
        for i in range(n):
            l = nearest_int(iscale * (x[xo + i] - mn))
            l = max(0, min(nmax, l))
            Laux[i] = l
            w = weights[i]
            fl = f32(l)
            sum_l += w * fl
            sum_l2 += w * fl * fl
            sum_xl += w * fl * x[xo + i]
        D = sum_w * sum_l2 - sum_l * sum_l
        if D > f32(0):
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            if this_min > f32(0):
                this_min = f32(0)
                this_scale = sum_xl / sum_l2
            cur_error = f32(0)
            for i in range(n):
                diff = this_scale * f32(Laux[i]) + this_min - x[xo + i]
                cur_error += weights[i] * (abs(diff) if use_mad else diff * diff)
            if cur_error < best_error:
                for i in range(n):
                    L[lo + i] = Laux[i]
                best_error = cur_error
                scale = this_scale
                mn = this_min
    return scale, -mn


@njit(cache=True, error_model="numpy")
def quantize_k_scales(x, xo, nmax, rmin, rdelta, nstep, out, o, L, Laux, weights, scales, mins):
    # The part of ggml's quantize_row_q{4,5}_K_ref before the quants are packed, for the
    # super-block x[xo:xo+256]: writes d, dmin (f16) and the 12 scale bytes to out[o:o+16],
    # leaves the levels (0..nmax) in L (256,) u8. Returns (finite, d or dmin overflowed).
    chk = f32(0)
    max_scale = f32(0)
    max_min = f32(0)
    for j in range(8):
        base = xo + 32 * j
        sum_x2 = f32(0)
        for i in range(32):
            v = x[base + i]
            chk += v * f32(0)                    # NaN iff some v is NaN or inf
            sum_x2 += v * v
        av_x = np.sqrt(sum_x2 / f32(32))
        for i in range(32):
            weights[i] = av_x + abs(x[base + i])
        sc, mn = make_qkx2_quants(32, nmax, x, base, weights, L, 32 * j, Laux, rmin, rdelta,
                                   nstep, False)
        scales[j] = sc
        mins[j] = mn
        if sc > max_scale:
            max_scale = sc
        if mn > max_min:
            max_min = mn
    inv_scale = f32(63) / max_scale if max_scale > f32(0) else f32(0)
    inv_min = f32(63) / max_min if max_min > f32(0) else f32(0)
    for j in range(8):
        ls = min(63, nearest_int(inv_scale * scales[j]) & 0xFF)   # (uint8_t) then MIN
        lm = min(63, nearest_int(inv_min * mins[j]) & 0xFF)
        if j < 4:
            out[o + 4 + j] = ls
            out[o + 8 + j] = lm
        else:
            out[o + 8 + j] = (ls & 0xF) | ((lm & 0xF) << 4)
            out[o + j] |= (ls >> 4) << 6
            out[o + 4 + j] |= (lm >> 4) << 6
    over = put_f16(out, o, max_scale / f32(63))
    over |= put_f16(out, o + 2, max_min / f32(63))
    d = get_f16(out, o)
    dmin = get_f16(out, o + 2)
    for j in range(8):
        sc, m = get_scale_min_k4(out, o + 4, j)
        dd = d * f32(sc)
        if dd == f32(0):
            continue                             # keeps make_qkx2_quants' levels
        dm = dmin * f32(m)
        for i in range(32):
            l = nearest_int((x[xo + 32 * j + i] + dm) / dd)
            L[32 * j + i] = max(0, min(nmax, l))
    return chk == chk, over


@njit(cache=True, inline="always")
def k_scales(q, o, d, dmin, dsc, msc):
    # per sub-block d * sc and dmin * m (f32, as gguf-py computes them) of the block whose
    # scale bytes are q[o:o+12] -> dsc, msc (8,)
    for j in range(8):
        sc, m = get_scale_min_k4(q, o, j)
        dsc[j] = d * f32(sc)
        msc[j] = dmin * f32(m)


# --- reference quantize / dequantize -------------------------------------------------------

@njit(parallel=True, cache=True, error_model="numpy")
def quantize_q4_k(x, out):
    # x (nb*256,) f32 -> out (nb*144,) u8 as quantize_row_q4_K_ref;
    # returns (non-finite blocks, blocks whose d or dmin overflow f16)
    nb = x.size // QK_K
    bad = 0
    over = 0
    for c in prange(-(-nb // _CHUNK)):
        L = np.empty(QK_K, np.uint8)
        Laux = np.empty(32, np.uint8)
        weights = np.empty(32, f32)
        scales = np.empty(8, f32)
        mins = np.empty(8, f32)
        for b in range(c * _CHUNK, min(nb, (c + 1) * _CHUNK)):
            o = b * 144
            ok, ov = quantize_k_scales(x, b * QK_K, 15, f32(-1.0), f32(0.1), 20, out, o,
                                       L, Laux, weights, scales, mins)
            if not ok:
                bad += 1
            if ov:
                over += 1
            for p in range(4):
                for i in range(32):
                    out[o + 16 + 32 * p + i] = L[64 * p + i] | (L[64 * p + 32 + i] << 4)
    return bad, over


@njit(parallel=True, cache=True)
def dequantize_q4_k(q, out):
    # q (nb*144,) u8 -> out (nb*256,) f32, bit-exact with gguf-py
    for b in prange(out.size // QK_K):
        o = b * 144
        dsc = np.empty(8, f32)
        msc = np.empty(8, f32)
        k_scales(q, o + 4, get_f16(q, o), get_f16(q, o + 2), dsc, msc)
        y = out[b * QK_K:(b + 1) * QK_K]
        for p in range(4):
            for i in range(32):
                v = q[o + 16 + 32 * p + i]
                y[64 * p + i] = dsc[2 * p] * f32(v & 15) - msc[2 * p]
                y[64 * p + 32 + i] = dsc[2 * p + 1] * f32(v >> 4) - msc[2 * p + 1]


# --- load: file blocks -> tiles ------------------------------------------------------------

@njit(cache=True, inline="always")
def repack_k_tile_scales(tile, bs, S, r0, qt, dt, mt):
    # d, dmin and the 6-bit scales and mins of the K-quant rows tile (n, nsb*bs) u8 -> lanes
    # r0..r0+n of one tile: dt, mt (nsb*R,) u16, and in qt (nsub*S*R,) u8 the sc of
    # sub-block u at (S u + S - 2) R + lane, its m R further
    n = tile.shape[0]
    nsb = tile.shape[1] // bs
    R = dt.size // nsb
    for b in range(nsb):
        o = b * bs
        for r in range(n):
            dt[b * R + r0 + r] = np.uint16(tile[r, o]) | (np.uint16(tile[r, o + 1]) << np.uint16(8))
            mt[b * R + r0 + r] = np.uint16(tile[r, o + 2]) | (np.uint16(tile[r, o + 3]) << np.uint16(8))
        for j in range(8):
            p = (S * (8 * b + j) + S - 2) * R + r0
            for r in range(n):
                sc, m = get_scale_min_k4(tile[r], o + 4, j)
                qt[p + r] = sc
                qt[p + R + r] = m


@njit(cache=True, parallel=True)
def repack_q4_k(raw, row0, q, d, dmin):
    # Q4_K rows raw (rows, nsb*144) u8 -> rows row0.. of the tiles q (nt, nsub*18*R), d,
    # dmin (nt, nsb*R): per sub-block s of row t*R + r, q[t, (18 s + j) R + r] =
    # q_j | q_j+16 << 4 (j < 16), then sc and m. One pass per tile, column by column
    # (the tile's rows stay in L2; contiguous writes)
    rows = raw.shape[0]
    nsb = raw.shape[1] // 144
    R = d.shape[1] // nsb
    for t in prange(row0 // R, (row0 + rows - 1) // R + 1):
        r0 = max(0, row0 - t * R)
        r1 = min(R, row0 + rows - t * R)
        tile = raw[t * R + r0 - row0:t * R + r1 - row0]
        qt = q[t]
        repack_k_tile_scales(tile, 144, 18, r0, qt, d[t], dmin[t])
        for s in range(8 * nsb):
            sh = 4 * (s & 1)
            src = (s >> 3) * 144 + 16 + 32 * ((s & 7) >> 1)
            for i in range(16):
                lane = qt[(18 * s + i) * R + r0:(18 * s + i) * R + r1]
                lo = tile[:, src + i]
                hi = tile[:, src + 16 + i]
                for r in range(r1 - r0):
                    lane[r] = ((lo[r] >> sh) & 15) | (((hi[r] >> sh) & 15) << 4)


# --- decode --------------------------------------------------------------------------------

@intrinsic
def prefetch(typingctx, arr, idx):
    # llvm.prefetch (read, keep in all cache levels) of the line holding arr[idx], 1-d arr
    def codegen(context, builder, sig, args):
        aty = sig.args[0]
        ary = context.make_array(aty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aty, ary, [args[1]], wraparound=False)
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), "llvm.prefetch.p0")
        builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(i32, 0), ir.Constant(i32, 3),
                          ir.Constant(i32, 1)])
        return context.get_dummy_value()
    return types.void(arr, idx), codegen


@njit(cache=True, inline="always")
def prefetch_run(a, lo, n):
    # prefetch the bytes a[lo:lo+n] (clipped to a), a 1-d u8 array: one call per 64 bytes.
    # The K-quant kernels prefetch the next sub-block. From DRAM (24 matrices of
    # 2048 x 8192, one thread, this VM): Q4_K 14.2 -> 17.1 GB/s, Q5_K 12.4 -> 18.3 GB/s
    # (Q4_0's kernel, 19.7 GB/s, gained nothing from the same).
    for i in range(lo, min(lo + n, a.size), 64):
        prefetch(a, i)


@njit(cache=True, fastmath=True, parallel=True)
def matvec_q4_k(q, d, dmin, xa, xb, xd, xm, xsum, out, scratch, s16):
    # W (nt*R, n) Q4_K tiles @ x (prep_q4_x) -> out (d,); scratch (nt, 3, R) f32,
    # s16 (nt, 1, R) int16. Row . x = sum over super-blocks of
    #   d sum_s sc_s dx_s sum(q xq)_s - dmin sum_s m_s sum(x)_s,  sum(q xq) = s16 - xm
    nt = q.shape[0]
    R = s16.shape[2]
    nsb = xd.size // 8
    for t in prange(nt):
        qt = q[t]
        acc = scratch[t, 0]
        a1 = scratch[t, 1]
        a2 = scratch[t, 2]
        s = s16[t, 0]
        acc[:] = 0
        for b in range(nsb):
            a1[:] = 0
            a2[:] = 0
            for k in range(8):
                u = 8 * b + k
                o = 18 * u * R
                prefetch_run(qt, o + 18 * R, 18 * R)
                q4_block(qt, o, xa, xb, 16 * u, s, xm[u])
                scu = qt[o + 16 * R:o + 17 * R]
                mu = qt[o + 17 * R:o + 18 * R]
                dx = xd[u]
                off = -f32(xm[u])
                xs = xsum[u]
                for r in range(R):
                    a1[r] += f32(scu[r]) * (dx * (f32(s[r]) + off))
                    a2[r] += f32(mu[r]) * xs
            db = d[t, b * R:(b + 1) * R]
            mb = dmin[t, b * R:(b + 1) * R]
            for r in range(R):
                acc[r] += f16_to_f32(db[r]) * a1[r] - f16_to_f32(mb[r]) * a2[r]
        n = min(R, out.size - t * R)
        out[t * R:t * R + n] = acc[:n]


# --- prefill and embedding: dequantize from tiles (serial, exact: see q4.py) ----------------

@njit(cache=True, inline="always")
def k_tile_scales(q, d, dmin, S, t, u, R, dsc, msc):
    # lanes of tile t, sub-block u: d * sc and dmin * m (f32, as gguf-py) -> dsc, msc (R,)
    b = u // 8
    o = (S * u + S - 2) * R
    for r in range(R):
        dsc[r] = f16_to_f32(d[t, b * R + r]) * f32(q[t, o + r])
        msc[r] = f16_to_f32(dmin[t, b * R + r]) * f32(q[t, o + R + r])


@njit(cache=True)
def dequant_q4_k_tiles(q, d, dmin, t0, t1, wt):
    # Q4_K tiles t0..t1 -> wt (n, (t1-t0)*R) f32 = W[rows].T
    nsub = wt.shape[0] // 32
    R = d.shape[1] * 8 // nsub
    dsc = np.empty(R, f32)
    msc = np.empty(R, f32)
    for u in range(nsub):
        for t in range(t0, t1):
            k_tile_scales(q, d, dmin, 18, t, u, R, dsc, msc)
            c = (t - t0) * R
            for j in range(16):
                qj = q[t, (18 * u + j) * R:(18 * u + j + 1) * R]
                lo = wt[32 * u + j, c:c + R]
                hi = wt[32 * u + 16 + j, c:c + R]
                for r in range(R):
                    lo[r] = dsc[r] * f32(qj[r] & 15) - msc[r]
                    hi[r] = dsc[r] * f32(qj[r] >> 4) - msc[r]


@njit(cache=True)
def rows_q4_k(q, d, dmin, ids, out):
    # Q4_K tiles, ids (T,) -> out (T, n) f32 dequantized rows
    nsub = out.shape[1] // 32
    R = d.shape[1] * 8 // nsub
    for i in range(ids.size):
        t = ids[i] // R
        r = ids[i] % R
        row = out[i]
        for u in range(nsub):
            b = u // 8
            ds = f16_to_f32(d[t, b * R + r]) * f32(q[t, (18 * u + 16) * R + r])
            ms = f16_to_f32(dmin[t, b * R + r]) * f32(q[t, (18 * u + 17) * R + r])
            for j in range(16):
                v = q[t, (18 * u + j) * R + r]
                row[32 * u + j] = ds * f32(v & 15) - ms
                row[32 * u + 16 + j] = ds * f32(v >> 4) - ms


class KLinear(TiledLinear):
    """What Q4_K and Q5_K tiles share: q (nt, nsub*S*R) u8, each sub-block's quants then
    its 6-bit scale and min; d, dmin (nt, nsb*R) u16 f16 bits; prep_q4_x's activation
    buffers. A subclass sets S and fills the tiles (_repack)."""
    S = 18                     # bytes per row per sub-block in q
    n_sums = 1                 # int16 sums per sub-block in the matvec

    def _load(self, raws):
        n = self.in_features
        nsub, nt, R = n // 32, self.nt, self.R
        self.q = anon_array((nt, nsub * self.S * R), np.uint8)   # zeroed: pad rows add nothing
        self.d = anon_array((nt, nsub // 8 * R), np.uint16)
        self.dmin = anon_array((nt, nsub // 8 * R), np.uint16)
        row0 = 0
        for raw in raws:
            self._repack(raw, row0)
            release_pages(raw)
            row0 += raw.shape[0]
        self._scratch = np.zeros((nt, 3, R), f32)
        self._s16 = np.zeros((nt, self.n_sums, R), np.int16)
        self._xa = np.zeros(n // 2, np.int16)
        self._xb = np.zeros(n // 2, np.int16)
        self._xd = np.zeros(nsub, f32)
        self._xm = np.zeros(nsub, np.int16)
        self._xsum = np.zeros(nsub, f32)

    def _repack(self, raw: np.ndarray, row0: int) -> None:
        """File rows raw (rows, row_bytes) -> rows row0.. of q, d, dmin."""
        raise NotImplementedError


class Q4KLinear(KLinear):
    """Q4_K in row tiles (KLinear, S = 18): 16 bytes of nibbles per row and sub-block, in
    Q4_0 order."""

    def _repack(self, raw, row0):
        repack_q4_k(raw, row0, self.q, self.d, self.dmin)

    def matvec(self, x, out):
        prep_q4_x(x, self._xa, self._xb, self._xd, self._xm, self._xsum)
        matvec_q4_k(self.q, self.d, self.dmin, self._xa, self._xb, self._xd, self._xm,
                    self._xsum, out, self._scratch, self._s16)

    def _dequant_tiles(self, t0, t1, wt):
        dequant_q4_k_tiles(self.q, self.d, self.dmin, t0, t1, wt)

    def _rows(self, ids, out):
        rows_q4_k(self.q, self.d, self.dmin, ids, out)


Q4_K = WeightFormat("Q4_K", 12, QK_K, 144,
                    "d:f16, dmin:f16, scales:u8[12] (6-bit sc, m per 32), qs:u8[128]; "
                    "x=d*sc*nibble-dmin*m", Q4KLinear,
                    dequantize_q4_k, quantize_q4_k, LlamaFileType.MOSTLY_Q4_K_M)
