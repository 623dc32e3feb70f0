"""Records: the tile layout of the formats with pair-dot kernels (Q4_0, Q4_1, Q5_0, Q5_1,
Q8_0, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS: every quantized type), and what they
share.

A record holds 16 rows (RECORD_ROWS) of a run of blocks, lanes across rows, in one
address-ordered run (simd.py describes each layout and reads it). Decode quantizes x to
int8 per block of 32 (prep_q8_x, as llama.cpp does) and sums q times x8 exactly in int32
with the CPU's pair-dot instructions; prefill is the same arithmetic as an int8 GEMM
(RecordLinear.matmul), each tile of weights multiplied in place, never dequantized.

The per-32-block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL) share one record layout
and one set of kernels here (BlocksLinear: records of 16 rows and G blocks, G =
record_group(nb), the rows' f16 d (and m) of each block, then the blocks' bytes as
quads, Q5's then its fifth bits; IQ4_NL's nibbles are looked up in the kernel); decode
and prefill are one intrinsic, simd.blocks_gemm, which keeps its f32 sums in registers
over a row.
Where the CPU has AMX and Linux grants the tiles (amx.enabled()), a prefill of
AMX_MIN_ROWS or more rows multiplies 16 rows of x by a block of 16 rows of weights per
tile instruction instead (amx.amx_blocks_gemm, matmul_blocks_amx), with the same bits.
"""
from __future__ import annotations

import numba
import numpy as np
from numba import get_thread_id, prange

from ..kernels import amx
from ..kernels.amx import (AMX_TOKENS, GROUPS, KIND_IQ4_XS, KIND_Q2_K, KIND_Q3_K, KIND_Q4_K, KIND_Q5_K,
                           KIND_Q6_K, amx_blocks_gemm)
from ..kernels.claim import take
from ..kernels.fp import get_f16
from ..kernels.jit import njit
from ..kernels.simd import (BLOCK_BYTES, BLOCK_HEAD, BLOCK_QUADS, IQ4_VALUES, ISA, KIND_IQ4_NL, KIND_Q4_0,
                            KIND_Q4_1, KIND_Q5_0, KIND_Q5_1, KIND_Q8_0, K_VALUES, RECORD_ROWS, TOKENS, Q8X,
                            blocks_gemm, iq4xs_gemm, k_gemm, tile)
from ..scratch import Scratch
from .base import TiledLinear, release_pages

f32 = np.float32
# A product of this many rows of x or more rebuilds each tile's K-quant values once (its
# first group of TOKENS rows stores them in a values tile, simd.py) rather than once for
# every TOKENS of them; fewer (decode, a few sequences or draft tokens) rebuild them as
# they go ("values tiles", bench/results/design_measurements.json). NO_VALUES: none.
VALUES_MIN_ROWS = 4 * TOKENS
NO_VALUES = np.zeros((1, 0), np.uint8)
# bytes of values a window of a tile's rows holds at most (a byte a weight), to stay in
# a core's L2 beside the window's records and x's rows while every group of TOKENS rows
# reads them (a down projection's tile of 256 rows would hold 2 MiB: "values tiles",
# bench/results/design_measurements.json)
VALUES_WINDOW = 256 << 10


def values_rows(R, n):
    """Rows of a tile of R rows of n weights that a values window takes: a multiple of
    RECORD_ROWS."""
    return min(R, max(RECORD_ROWS, VALUES_WINDOW // n // RECORD_ROWS * RECORD_ROWS))


# values_rows for the kernels: a kernel of its own, so that Python calls the plain
# function (warm-up's dry run stands recorders in for kernels, which return nothing)
values_rows_jit = njit(cache=True, inline="always")(values_rows)


# --- decode: x quantized to int8 once per matvec, then pair-dot sums ----------------------

# No reciprocal or contraction licence (fastmath=True had both): x * (1/d) must be that
# product, rounded once, or near-ties round as they like and no model can check the kernels
@njit(cache=True, fastmath={"nnan", "ninf", "nsz"})
def prep_q8_x(x, x8, xd, xs8, xsum):
    # x (n,) f32 -> per block of 32, x quantized as llama.cpp's q8_0 activations:
    # x8 (n,) int8 = rint(x / xd) in [-127, 127], xd (nb,) the scale, xs8 (nb,) int32
    # = sum(x8), xsum (nb,) = xd xs8, the sum of x as quantized, for formats with a min
    # (w = d q + m): the min term must see the same rounded x as the q term, or the
    # rounding errors e_j are weighted by w_j - m (all one sign, mean |m|) instead of w_j,
    # as llama.cpp's q8_1 s and q8_K bsums do. An exact float sum(x) here made Q4_1 six
    # times further from full precision than llama.cpp.
    for b in range(xd.size):
        xblk = x[32 * b:32 * b + 32]
        amax = f32(0)
        for j in range(32):
            amax = max(amax, abs(xblk[j]))
        d = amax / f32(127)
        inv = f32(1) / d if d > 0 else f32(0)
        qs = 0
        for j in range(32):
            v = int(np.rint(xblk[j] * inv))
            x8[32 * b + j] = v
            qs += v
        xd[b] = d
        xs8[b] = qs
        xsum[b] = d * f32(qs)


# --- prefill: int8 GEMM over the tiles ------------------------------------------------------

@njit(cache=True, parallel=True)
def prep_q8_rows(x, x8, xd, xs8, xsum):
    # x (T, n) f32 -> prep_q8_x of each row: x8 (Tp, n) int8, xd, xs8, xsum (Tp, n/32);
    # rows T..Tp stay as they are (zero: they pad the last group of TOKENS rows)
    for i in prange(x.shape[0]):
        prep_q8_x(x[i], x8[i], xd[i], xs8[i], xsum[i])


@njit(cache=True, parallel=True)
def prep_q8_split_rows(x, x8, xd, xs8, xsum):
    # x (T, n) f32 -> 2T rows of int8 activations whose sum is x to about 16 bits: row 2i is
    # prep_q8_x of x[i], row 2i+1 prep_q8_x of what it rounded away (x[i] - x8 xd, at
    # most xd/2 a block, so the second rounding error is at most xd/508)
    n = x.shape[1]
    for i in prange(x.shape[0]):
        prep_q8_x(x[i], x8[2 * i], xd[2 * i], xs8[2 * i], xsum[2 * i])
        r = np.empty(n, f32)
        for b in range(n // 32):
            for j in range(32 * b, 32 * b + 32):
                r[j] = x[i, j] - f32(x8[2 * i, j]) * xd[2 * i, b]
        prep_q8_x(r, x8[2 * i + 1], xd[2 * i + 1], xs8[2 * i + 1], xsum[2 * i + 1])


def amx_matmul_kernel(kind):
    """product_kernels' matmul on AMX tiles for one kind of records (amx.amx_blocks_gemm's
    kind, a constant of the kernel's code: a model compiles the kinds it holds and no
    others; each cached by its constant)."""

    @njit(cache=True, parallel=True)
    def matmul_amx(q, xa, xda, xsuma, nb, out, acc, G):
        # W (nt*R, n) records @ x -> out (T, dout), the same bits as the VNNI matmul: xa,
        # xda, xsuma flat, x8, xd, xsum as amx_a_tiles lays them out (Tp a multiple of
        # AMX_TOKENS, nb blocks a row; Q2_K's xsum its sums per 16, Q3_K's amx.Q3K_BIAS
        # times its block sums); G blocks a record; acc (nt, GROUPS * AMX_TOKENS, R)
        T = out.shape[0]
        R = acc.shape[2]
        span = GROUPS * AMX_TOKENS
        x = Q8X(xa, xda, None, xsuma)
        for t in prange(q.shape[0]):
            a = acc[t]
            af = a.reshape(-1)
            c0 = t * R
            nc = min(R, out.shape[1] - c0)
            for t0 in range(0, T, span):
                rows = min(GROUPS, (T - t0 + AMX_TOKENS - 1) // AMX_TOKENS) * AMX_TOKENS
                amx_blocks_gemm(q[t], x, af, tile(nb, G, t0, rows, kind))
                for k in range(min(span, T - t0)):
                    out[t0 + k, c0:c0 + nc] = a[k, :nc]
    return matmul_amx


MATMUL_AMX = {kind: amx_matmul_kernel(kind) for kind in (
    KIND_Q4_0, KIND_Q4_1, KIND_Q5_0, KIND_Q5_1, KIND_Q8_0, KIND_IQ4_NL,
    KIND_Q4_K, KIND_Q5_K, KIND_Q6_K, KIND_IQ4_XS, KIND_Q2_K, KIND_Q3_K)}


def matmul_blocks_amx(q, xa, xda, xsuma, nb, out, acc, G, kind):
    """The AMX matmul of records of `kind` (MATMUL_AMX; amx.enabled() must be True)."""
    MATMUL_AMX[kind](q, xa, xda, xsuma, nb, out, acc, G)


@njit(cache=True, parallel=True)
def amx_a_tiles(x8, xd, xsum, xa, xda, xsuma):
    # x8 (Tp, n) int8 -> xa (Tp/16, n/32, 16, 32): each A tile (16 tokens x one block's
    # 32 bytes) in 512 bytes in a row (strided by n, a tile's 16 rows fall in one or two
    # L1 sets, n a multiple of 2048, and miss each other out of the cache); xd (Tp, n/32)
    # -> xda (Tp/16, n/32, 16), a block's 16 scales in one line, and the sums xsum (Tp,
    # m) -> xsuma (Tp/16, m, 16) the same way (m = n/32, or n/16 for Q2_K's per 16)
    for g in prange(xa.shape[0]):
        for b in range(xa.shape[1]):
            for i in range(AMX_TOKENS):
                for j in range(32):
                    xa[g, b, i, j] = x8[g * AMX_TOKENS + i, 32 * b + j]
                xda[g, b, i] = xd[g * AMX_TOKENS + i, b]
        for c in range(xsum.shape[1]):
            for i in range(AMX_TOKENS):
                xsuma[g, c, i] = xsum[g * AMX_TOKENS + i, c]


class RecordLinear(TiledLinear):
    """What the record formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q2_K, Q3_K, Q4_K,
    Q5_K, Q6_K, IQ4_XS) share: their tiles q (nt, R/16 * strip bytes) u8, filled by _repack and then
    the file's pages released; decode's buffers (x quantized to int8 per block of 32 by prep_q8_x, per-tile sums);
    and prefill as an int8 GEMM: x is quantized to int8 per block of 32, row by row, as
    decode and llama.cpp do, and each tile of weights is multiplied in place, never
    dequantized. With fine set, decode and prefill multiply x as two int8 rows, x
    rounded and the residual rounded again (prep_q8_split_rows), in one pass over the
    weights: answers closer to full precision than llama.cpp's for the cost of the
    second row's arithmetic. Why an int8 GEMM and not dequantize + BLAS: "int8 prefill"
    in bench/results/design_measurements.json."""

    def tile_spec(self):
        return {"q": ((self.nt, self.R // RECORD_ROWS * self._strip_bytes()), np.uint8)}

    def _load(self, raws):
        self._alloc_tiles()
        row0 = 0
        for raw in raws:
            self._repack(raw, row0)
            release_pages(raw)
            row0 += raw.shape[0]

    def decode_buffers(self):
        # (x8, xd, xs8, xsum) of prep_q8_x, acc (nt, R) f32 per-tile sums, and the counter
        # the decode kernel's threads claim tiles from (kernels/claim.py)
        n = self.in_features
        return (np.zeros(n, np.int8), np.zeros(n // 32, f32), np.zeros(n // 32, np.int32),
                np.zeros(n // 32, f32), np.zeros((self.nt, self.R), f32), np.zeros(1, np.int64))

    def _strip_bytes(self) -> int:
        """Bytes of the records of one strip of 16 rows (a whole row's length)."""
        raise NotImplementedError

    def _repack(self, raw: np.ndarray, row0: int) -> None:
        """File rows raw (rows, row_bytes) -> rows row0.. of q."""
        raise NotImplementedError

    fine = False     # x as int8 plus its int8 residual (Transformer's activations="fine")

    def matvec(self, x, out, scratch=None):
        if self.fine:
            self.matmul(x[None], out[None], scratch)
        else:
            self._matvec(x, out, scratch)

    def _matvec(self, x, out, scratch):
        """out (out_features,) = W @ x with x quantized to int8 per block of 32 (prep_q8_x)."""
        raise NotImplementedError

    def _amx_records(self) -> tuple[int, int] | None:
        """(kind, blocks a record) amx.amx_blocks_gemm takes for these records, or None:
        no AMX kernel."""
        return None

    def _tokens(self, rows: int) -> tuple[int, int]:
        """For a product of `rows` rows of x: the rows its kernel takes at a time (x is
        padded with zero rows to a multiple) and the height of the per-tile sums: AMX's
        where these records have tiles, the rows are enough and AMX runs."""
        if self._amx_records() is not None and rows >= AMX_MIN_ROWS and amx.enabled():
            return AMX_TOKENS, GROUPS * AMX_TOKENS
        return TOKENS, TOKENS

    def _gemm_amx(self, x8, xd, xs8, xsum, out, acc, sc):
        """_gemm on AMX tiles (where _tokens chose them): x8, xd, xsum laid out as A tiles
        (amx_a_tiles), then matmul_blocks_amx (xs8 unused: the tiles fold in its terms)."""
        Tp, nb = xd.shape
        xa = sc.get("amx_xa", (Tp // AMX_TOKENS, nb, AMX_TOKENS, 32), np.int8)
        xda = sc.get("amx_xda", (Tp // AMX_TOKENS, nb, AMX_TOKENS))
        xsuma = sc.get("amx_xsuma", (Tp // AMX_TOKENS, xsum.shape[1], AMX_TOKENS))
        amx_a_tiles(x8.reshape(Tp, -1), xd, xsum, xa, xda, xsuma)
        self._amx_product(xa.reshape(-1), xda.reshape(-1), xsuma.reshape(-1), nb, out, acc, sc)

    def _amx_product(self, xa, xda, xsuma, nb, out, acc, sc):
        """matmul_blocks_amx over the tiles q, x laid out as A tiles (flat)."""
        kind, group = self._amx_records()
        matmul_blocks_amx(self.q, xa, xda, xsuma, nb, out, acc, group, kind)

    def matmul(self, x, out, scratch=None):
        T, n = x.shape
        rows = 2 * T if self.fine else T
        tok, height = self._tokens(rows)
        Tp = -(-rows // tok) * tok
        sc = scratch or Scratch()
        x8 = sc.get("q8_x8", (Tp, n), np.int8)
        xd, xsum = sc.get("q8_xd", (Tp, n // 32)), sc.get("q8_xsum", (Tp, n // 32))
        xs8 = sc.get("q8_xs8", (Tp, n // 32), np.int32)
        for a in (x8, xd, xsum, xs8):
            a[rows:] = 0              # rows past x's pad the last group of tok
        acc = sc.get("q8_acc", (self.nt, height, self.R))
        gemm = self._gemm_amx if height == GROUPS * AMX_TOKENS else self._gemm
        if not self.fine:
            prep_q8_rows(x, x8, xd, xs8, xsum)
            # the kernels write C-ordered rows: a column slice of stacked projections' output
            # (Q4_K_M's q and k beside a Q6_K v) goes through a scratch, so that each kernel
            # compiles for one array layout, not two
            dst = out if out.flags.c_contiguous else sc.get("q8_out", out.shape)
            gemm(x8.reshape(-1), xd, xs8, xsum, dst, acc, sc)
            if dst is not out:
                out[...] = dst
            return
        prep_q8_split_rows(x, x8, xd, xs8, xsum)
        parts = sc.get("q8_parts", (rows, out.shape[1]))
        gemm(x8.reshape(-1), xd, xs8, xsum, parts, acc, sc)
        np.add(parts[0::2], parts[1::2], out=out)

    # a few tokens cost one pass over the tiles, as one does
    matvecs = matmul

    def _gemm(self, x8, xd, xs8, xsum, out, acc, sc):
        """out (T, out_features) = x W^T from prep_q8_rows' arrays on the VNNI kernels;
        acc (nt, TOKENS, R) f32 per-tile scratch; sc the Scratch for other buffers."""
        raise NotImplementedError

    def _values(self, xd, sc, kind):
        """The K-quants' matmul's `values`: each thread's values tile (simd.py)
        for a product of VALUES_MIN_ROWS rows of x or more (xd (Tp, nb)) where `kind` is
        one of K_VALUES, else NO_VALUES."""
        if xd.shape[0] < VALUES_MIN_ROWS or kind not in K_VALUES:
            return NO_VALUES
        rows = values_rows(self.R, self.in_features)
        return sc.get("q8_values", (numba.get_num_threads(), rows * self.in_features), np.uint8)


# --- the records: load, decode, embedding ----------------------------------------------------

def record_group(nb: int) -> int:
    """Blocks per record for rows of nb blocks: 8 (256 weights), or the largest power of 2
    that divides nb."""
    g = 8
    while nb % g:
        g //= 2
    return g


@njit(cache=True, parallel=True)
def repack_blocks(raw, row0, q, G, kind):
    # rows raw (rows, nb*bs) u8 of a per-32-block format (kind KIND_*) -> rows row0.. of
    # the tiles q (nt, R/16 * nb*bb) u8 (bb = BLOCK_BYTES[kind]): row t*R + r is
    # lane r % 16 of strip r // 16, its block b block b % G of record strip*nb/G + b // G
    nq = 32 if kind == KIND_Q8_0 else 16             # quant bytes per row and block
    five = kind == KIND_Q5_0 or kind == KIND_Q5_1
    mins = kind == KIND_Q4_1 or kind == KIND_Q5_1
    qh = 4 if mins else 2                            # the fifth bits' u32 after d (and m)
    bs = qh + (4 if five else 0) + nq
    rows = raw.shape[0]
    nb = raw.shape[1] // bs
    bb = BLOCK_BYTES[kind]
    R = q.shape[1] // (nb * bb) * RECORD_ROWS
    for t in prange(row0 // R, (row0 + rows - 1) // R + 1):
        r0 = max(0, row0 - t * R)
        r1 = min(R, row0 + rows - t * R)
        qt = q[t]
        for r in range(r0, r1):
            row = raw[t * R + r - row0]
            lane = r % RECORD_ROWS
            for b in range(nb):
                o = b * bs
                k = b % G
                rec = (r // RECORD_ROWS * (nb // G) + b // G) * G * bb
                for i in range(2):
                    qt[rec + 32 * k + 2 * lane + i] = row[o + i]
                    if mins:
                        qt[rec + 32 * G + 32 * k + 2 * lane + i] = row[o + 2 + i]
                dst = rec + BLOCK_HEAD[kind] * G + BLOCK_QUADS[kind] * k + 4 * lane
                for j in range(nq):
                    qt[dst + 64 * (j >> 2) + (j & 3)] = row[o + bs - nq + j]
                if five:        # element e's bit to bit 2 (e % 16 // 4) + e // 16 of byte e % 4
                    h = 0
                    for i in range(4):
                        h |= np.int64(row[o + qh + i]) << (8 * i)
                    for i in range(4):
                        v = 0
                        for f in range(8):
                            v |= (h >> (16 * (f & 1) + 4 * (f >> 1) + i) & 1) << f
                        qt[dst + 256 + i] = v


# The intrinsic a weight type's product kernels run (product_kernels' family): the
# per-32-block formats' blocks_gemm, Q4_K and Q5_K's q4k_gemm, the 16-weight sub-block
# K-quants' q6_gemm (those two through k_gemm), IQ4_XS's iq4xs_gemm
BLOCKS, K_QUANT, SUB16, XS = range(4)


def product_kernels(family, kind):
    """(matvec, matmul) of one weight type's records: `family`'s intrinsic with `kind`
    (simd's KIND_*, or the K-quants' bits), both constants of the kernels' code, so that a
    model compiles the types it holds and no others (each pair cached by its constants;
    jit.kernels_replaced finds them where the format modules keep them). x comes as a
    Q8X's arrays: x8, xd, xs (sums per block or half-block, or None), xsum (or None);
    G blocks a record; matmul's values, each thread's values tile (K_VALUES kinds)."""
    UNPACK = family in (K_QUANT, SUB16) and kind in K_VALUES

    @njit(cache=True, parallel=True)
    def matvec(q, x8, xd, xs, xsum, out, acc, G, counter):
        # W (nt*R, n) records @ x (prep_q8_x; xd (nb,)) -> out (d,); acc (nt, R) f32
        # per-tile sums; the tiles claimed one at a time (claim.py: counter)
        R = acc.shape[1]
        nb = xd.size
        x = Q8X(x8, xd, xs, xsum)
        counter[0] = 0
        for _ in prange(q.shape[0]):
            while True:
                t = take(counter)
                if t >= q.shape[0]:
                    break
                shape = tile(nb, G, 0, 1, kind)    # in the loop: a parfor takes no Tile in
                if family == BLOCKS:
                    blocks_gemm(q[t], x, acc[t], shape, ISA)
                elif family == K_QUANT or family == SUB16:
                    k_gemm(q[t], x, acc[t], shape, ISA)
                else:
                    iq4xs_gemm(q[t], x, acc[t], shape, ISA)
                n = min(R, out.size - t * R)
                out[t * R:t * R + n] = acc[t, :n]

    @njit(cache=True, parallel=True)
    def matmul(q, x8, xd, xs, xsum, out, acc, G, values):
        # W (nt*R, n) records @ x (prep_q8_rows; x8 flat (Tp*n,), xd (Tp, nb), xs and
        # xsum flat) -> out (T, dout) = x W^T; acc (nt, TOKENS, R) f32 per-tile sums. A
        # tile's weights (R rows, L2-sized) are read once per group of TOKENS rows of x;
        # the tiles are claimed one at a time, as matvec's are (claim.py).
        # values (threads, values_rows(R, n) n) u8: each thread's values tile (the
        # K_VALUES kinds; none if 0 wide: each group of rows rebuilds the values as it
        # goes), which takes the tile a window of values_rows(R, n) rows at a time, the
        # window's first group of rows storing the values that the others load
        T = out.shape[0]
        R = acc.shape[2]
        nb = xd.shape[1]
        x = Q8X(x8, xd.reshape(-1), xs, xsum)
        strip = q.shape[1] // (R // RECORD_ROWS)        # bytes of a strip's records
        counter = np.zeros(1, np.int64)
        for _ in prange(q.shape[0]):
            unpacked, e, rw = False, values[0], R        # this thread's values tile, if any
            if UNPACK and values.shape[1] > 0:
                unpacked, e, rw = True, values[get_thread_id()], values_rows_jit(R, 32 * nb)
            while True:
                t = take(counter)
                if t >= q.shape[0]:
                    break
                af = acc[t].reshape(-1)
                for w0 in range(0, R, rw):
                    nw = min(rw, R - w0)
                    qw = q[t, w0 // RECORD_ROWS * strip:(w0 + nw) // RECORD_ROWS * strip]
                    aw = af[:TOKENS * nw]
                    c0 = t * R + w0
                    nc = max(0, min(nw, out.shape[1] - c0))
                    for t0 in range(0, T, TOKENS):
                        shape = tile(nb, G, t0, TOKENS, kind)
                        if family == BLOCKS:
                            blocks_gemm(qw, x, aw, shape, ISA)
                        elif family == K_QUANT or family == SUB16:
                            if UNPACK and unpacked and t0 == 0:
                                k_gemm(qw, x, aw, shape, ISA, e, 1)
                            elif UNPACK and unpacked:
                                k_gemm(qw, x, aw, shape, ISA, e)
                            else:
                                k_gemm(qw, x, aw, shape, ISA)
                        else:
                            iq4xs_gemm(qw, x, aw, shape, ISA)
                        for k in range(min(TOKENS, T - t0)):
                            out[t0 + k, c0:c0 + nc] = aw[k * nw:k * nw + nc]

    return matvec, matmul


def kernels_by_kind(family, kinds):
    """({kind: matvec}, {kind: matmul}): product_kernels(family, kind) of each kind."""
    pairs = {kind: product_kernels(family, kind) for kind in kinds}
    return {k: p[0] for k, p in pairs.items()}, {k: p[1] for k, p in pairs.items()}


MATVEC_BLOCKS, MATMUL_BLOCKS = kernels_by_kind(
    BLOCKS, (KIND_Q4_0, KIND_Q4_1, KIND_Q5_0, KIND_Q5_1, KIND_Q8_0, KIND_IQ4_NL))


_IQ4 = np.array(IQ4_VALUES, np.int32)


@njit(cache=True, fastmath=True)
def rows_blocks(q, ids, out, G, kind):
    # records of a per-32-block format, ids (T,) -> out (T, n) f32 dequantized rows
    nb = out.shape[1] // 32
    bb = BLOCK_BYTES[kind]
    R = q.shape[1] // (nb * bb) * RECORD_ROWS
    five = kind == KIND_Q5_0 or kind == KIND_Q5_1
    for i in range(ids.size):
        t = ids[i] // R
        lane = ids[i] % R % RECORD_ROWS
        row = out[i]
        for b in range(nb):
            k = b % G
            rec = q[t, (ids[i] % R // RECORD_ROWS * (nb // G) + b // G) * G * bb:]
            dd = get_f16(rec, 32 * k + 2 * lane)
            qs = rec[BLOCK_HEAD[kind] * G + BLOCK_QUADS[kind] * k + 4 * lane:]
            y = row[32 * b:32 * b + 32]
            if kind == KIND_Q8_0:
                for j in range(32):
                    y[j] = f32(np.int8(qs[64 * (j >> 2) + (j & 3)])) * dd
            else:
                mins = kind == KIND_Q4_1 or kind == KIND_Q5_1
                mm = get_f16(rec, 32 * G + 32 * k + 2 * lane) if mins else f32(0)
                off = 0 if mins or kind == KIND_IQ4_NL else 16 if five else 8
                for j in range(16):
                    v = qs[64 * (j >> 2) + (j & 3)]
                    lo, hi = np.int32(v & 15), np.int32(v >> 4)
                    if kind == KIND_IQ4_NL:
                        lo, hi = np.int32(_IQ4[lo]), np.int32(_IQ4[hi])
                    if five:        # the fifth bits' layout: repack_blocks
                        bits = np.int32(qs[256 + (j & 3)])
                        lo |= (bits >> (2 * (j >> 2)) & 1) << 4
                        hi |= (bits >> (2 * (j >> 2) + 1) & 1) << 4
                    if mins:
                        y[j] = f32(lo) * dd + mm
                        y[16 + j] = f32(hi) * dd + mm
                    else:           # as ggml: (u - off) d, whose zeros keep d's sign
                        y[j] = f32(lo - off) * dd
                        y[16 + j] = f32(hi - off) * dd


AMX_MIN_ROWS = 12    # fewer rows of x stay on the VNNI kernels: about even at 8, AMX 1.4x at 16 (1 thread)


class BlocksLinear(RecordLinear):
    """A per-32-block format in records of 16 rows and G blocks (simd.py's layout); each
    format's subclass names its kind (q4.py's Q4_0Linear and Q4_1Linear, q5.py's
    Q5_0Linear and Q5_1Linear, q8_0.py's Q8_0Linear, iq4.py's IQ4_NLLinear)."""
    kind: int          # simd's KIND_Q4_0, KIND_Q4_1, KIND_Q5_0, KIND_Q5_1, KIND_Q8_0 or KIND_IQ4_NL

    def _setup(self, fmt, splits, in_features):
        super()._setup(fmt, splits, in_features)
        self.group = record_group(self.in_features // 32)

    def _strip_bytes(self):
        return self.in_features // 32 * BLOCK_BYTES[self.kind]

    def _repack(self, raw, row0):
        repack_blocks(raw, row0, self.q, self.group, self.kind)

    def _matvec(self, x, out, scratch):
        x8, xd, xs8, xsum, acc, counter = self._buffers(scratch)
        prep_q8_x(x, x8, xd, xs8, xsum)
        MATVEC_BLOCKS[self.kind](self.q, x8, xd, xs8, xsum, out, acc, self.group, counter)

    def _amx_records(self):
        return self.kind, self.group

    def _gemm(self, x8, xd, xs8, xsum, out, acc, sc):
        MATMUL_BLOCKS[self.kind](self.q, x8, xd, xs8.reshape(-1), xsum.reshape(-1), out, acc, self.group,
                                 NO_VALUES)

    def _rows(self, ids, out):
        rows_blocks(self.q, ids, out, self.group, self.kind)
