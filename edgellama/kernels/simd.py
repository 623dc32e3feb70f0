"""Integer dot products of 4-, 5-, 6- and 8-bit weights (and IQ4's table values) with
int8 activations, in the instructions each CPU has, for kernels that keep lanes across
rows; and prefetch.

Numba has no vector types and LLVM does not find the pair-dot instructions in plain
loops, so the tile intrinsics emit LLVM IR for the whole product of one tile of weights
with 1 row of x (decode) or 4 (prefill), scales applied, the float sums in registers:
`blocks_gemm` for the per-32-block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL),
`q4k_gemm` for Q4_K and Q5_K, `iq4xs_gemm` for IQ4_XS, `q6_gemm` for the K-quants of
16-weight sub-blocks, Q6_K, Q3_K and Q2_K (5-, 6- and 3-bit values rebuilt in registers
from nibbles or 2-bit fields and 1-bit or 2-bit fields; IQ4's 4-bit indices looked up in
a 16-byte table). Each takes the weights q, the activations as one
Q8X (x8, xd, xs, xsum), the output acc, the call's shape as one Tile made by tile(nb,
group, t0, tokens, kind) (tokens and kind compile-time constants), and the instruction
set: an index of isa.ISAS, ISA for this target. The instructions:

    VNNI (AVX-512)  vpdpbusd: 64 u8 x i8 products summed into 16 int32 lanes, 1 instruction
    AVX-VNNI        vpdpbusd on 256 bits: 32 products into 8 lanes (AVX2's shapes)
    AVX2            vpmaddubsw (u8 x i8 pairs -> int16) then vpmaddwd (-> int32)
    anything else   target-independent IR (widen, multiply, add), which LLVM lowers

Nothing here branches on which: the intrinsics read the row's fields (rows per vector,
sum_w, pairs_per_dot) and call its dot. A new instruction set is a row of isa.py's
table, ISAS, and its lowering functions there (isa.py's docstring says what else), not
an edit here. The row is chosen once (target.py), from the features Numba compiles for:
the host CPU's unless NUMBA_CPU_NAME / NUMBA_CPU_FEATURES say otherwise (Numba's kernel
cache is keyed by both, so a cache is never used on a CPU it was not built for).

The weights' layout: records, one per strip of 16 rows (RECORD_ROWS) and run of blocks
(a super-block of 256 weights for the K-quants), a strip's records in a row, each
holding the rows' scales and then their quants as "quads": 4 bytes of one row side by
side, so one 32-bit lane of a vector holds 4 bytes of one row,

    record[quads + 64 g + 4 l + i] = byte 4g + i of the block's bytes of row (lane) l

(16 bytes per row for nibbles: byte i holds element i in its low nibble and element
16 + i in its high one; 32 for int8; the per-format layouts below).
"""
from __future__ import annotations

from typing import NamedTuple

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.extending import intrinsic

from .fp import half_to_float_ir
from .isa import AVX2, AVX_VNNI, GENERIC, ISA_NAMES, ISAS, VNNI512, call_llvm, splat, target_isa  # noqa: F401
from .target import CPU_NAME, ISA  # noqa: F401  (ISA: the intrinsics' isa constant for this target)


def ir_ptr(context, builder, aty, arr, off, ty):
    """Pointer to arr[off] (a 1-d array of Numba type aty) as a ty*."""
    data = context.make_array(aty)(context, builder, arr).data
    return builder.bitcast(builder.gep(data, [off]), ty.as_pointer())


def _dot(builder, isa, n, pairs, signed, sum_w=None):
    """<n x i32>: per 32-bit lane, the sum over `pairs` (w <n x i32> of 4 weight bytes per
    lane, x i32 of 4 int8 activations, broadcast) of the 4 byte products, in the
    instructions of row `isa` of isa.ISAS (attention.py's scores take it so). Weights
    are u8 (no more pairs than the row's pairs_per_dot of their largest value) or, if
    signed, i8; sum_w: the row's sum_w of the pairs' weights, if the caller has
    them."""
    return ISAS[isa].dot(builder, n, pairs, signed, sum_w)


def _dot_bounded(builder, row, n, pairs, wmax, scale=None):
    """_dot of unsigned weights up to wmax: pairs in runs of row.pairs_per_dot(wmax), the
    runs' int32 sums added; times scale (<n x i32>) where given (row.scaled_dot)."""
    step = row.pairs_per_dot(wmax) or len(pairs)
    total = None
    for p0 in range(0, len(pairs), step):
        run = pairs[p0:p0 + step]
        part = row.dot(builder, n, run, False) if scale is None else row.scaled_dot(builder, n, run, scale)
        total = part if total is None else builder.add(total, part)
    return total


TOKENS = 4       # rows of x per call of the _gemm intrinsics (prefill)

# prefetch_ir's localities (LLVM's): into L1 and every level (x86 prefetcht0), or into
# L2 and beyond (prefetcht1)
L1, L2 = 3, 2
# Records ahead that a record loop prefetches, into L2: into L1, its few fill buffers cap
# the misses a core keeps in flight, and one record is less than the memory's latency
# ahead ("records prefetch into L2", bench/results/design_measurements.json)
RECORDS_AHEAD = 2
# but a decode product on AMD Zen 4 whose weights are nibbles or bytes used as they are
# (not rebuilt from fifth or sixth bits): there its blocks' lines prefetched just before
# their loads (0 ahead) read memory faster than records ahead, which still serve the 5-
# and 6-bit kernels best ("records prefetch on AMD Zen 4")
PLAIN_DECODE_AHEAD = 0 if CPU_NAME == "znver4" else RECORDS_AHEAD
# Row vectors a decode product walks side by side (_over_records), by CPU: on the Intel
# Xeons 4 record streams keep more of the memory's latency covered and share each block's
# x; on AMD Zen (measured on Zen 5 and Zen 4) one stream, each tile read in order, reads
# memory faster than 4 ("decode streams", "decode streams on AMD Zen 5", "records
# prefetch on AMD Zen 4": bench/results/design_measurements.json)
DECODE_STREAMS = 1 if CPU_NAME.startswith("znver") else 4


class Q8X(NamedTuple):
    """The activation side of a weight product: x quantized to int8 per block of 32
    (records.prep_q8_x / prep_q8_rows, the K-quants' sums from it), flat over the Tp rows
    of x. x8 (Tp*32nb,) int8 (amx: in A-tile order, records.amx_a_tiles); xd (Tp*nb,)
    f32 the block scales; xs int32 sums of x8, per block (xs8: Q4_0, Q5_0, IQ4) or per
    16 (xs16: Q6_K); xsum (Tp*nb,) f32 the sum of x as quantized, xd xs8 (Q4_1, Q4_K, Q5_K's
    mins). A field an intrinsic does not read may be None."""
    x8: object
    xd: object
    xs: object
    xsum: object


class Tile(NamedTuple):
    """The shape of one call of a weight-product intrinsic, made by tile() in kernels:
    nb blocks of 32 per row (of x and the weights), `group` blocks per record
    (BlocksLinear's G; K_GROUP for the K-quants), first row t0 of x, `tokens` rows of x
    (a constant, but for amx_blocks_gemm: a multiple of its AMX_TOKENS), `kind` the
    format (KIND_* for blocks_gemm and amx; 4 or 5 bits for q4k_gemm; 6 for q6_gemm;
    amx's KIND_IQ4_XS for iq4xs_gemm), a constant. The constants stay compile-time in its
    type: the codegen unrolls over tokens and picks the format's code by kind."""
    nb: int
    group: int
    t0: int
    tokens: int
    kind: int


K_GROUP = 8      # blocks of 32 per K-quant record: one super-block of 256


@intrinsic(prefer_literal=True)
def tile(typingctx, nb, group, t0, tokens, kind):
    # Tile(nb, group, t0, tokens, kind), a literal kind (and tokens, where literal) kept
    # in the tuple's type; Tile(...) itself would forget them
    if not isinstance(kind, types.IntegerLiteral):
        raise TypingError("tile(): kind must be a compile-time constant")
    fields = (types.intp, types.intp, types.intp,
              tokens if isinstance(tokens, types.IntegerLiteral) else types.intp, kind)
    ret = types.NamedTuple(fields, Tile)

    def codegen(context, builder, sig, args):
        vals = [context.cast(builder, v, ty, to) for v, ty, to in zip(args, sig.args, fields)]
        return context.make_tuple(builder, ret, vals)
    return ret(nb, group, t0, tokens, kind), codegen


def tile_constants(name, tile_ty, isa=None, constant_tokens=True):
    """(tokens, kind, isa) of an intrinsic's Tile type and isa argument, as Python ints
    (tokens None unless constant_tokens, isa None if not given); a TypingError saying
    what is wrong if the shape is not tile()'s or a needed constant is not one."""
    lit = lambda t: isinstance(t, types.IntegerLiteral)
    if not (isinstance(tile_ty, types.BaseNamedTuple) and tile_ty.instance_class is Tile
            and lit(tile_ty.types[4]) and (lit(tile_ty.types[3]) or not constant_tokens)):
        what = "tokens and kind" if constant_tokens else "kind"
        raise TypingError(f"{name}: the shape must come from simd.tile(...) with constant {what}")
    if isa is not None and not lit(isa):
        raise TypingError(f"{name}: isa must be a compile-time constant (an index of isa.ISAS)")
    return (tile_ty.types[3].literal_value if constant_tokens else None,
            tile_ty.types[4].literal_value, None if isa is None else isa.literal_value)


class Operands:
    """The arguments (q, x: Q8X, acc, shape: Tile[, isa]) of a weight-product intrinsic
    inside its codegen: ptr(name, off, ty) to element off of array q, x8, xd, xs, xsum
    or acc as a ty*; nb, group, t0 (and tokens where it is not a constant) as IR
    integers."""

    def __init__(self, context, builder, sig, args):
        self.context, self.builder = context, builder
        q_ty, x_ty, acc_ty, tile_ty = sig.args[:4]
        self.arrays = {"q": (q_ty, args[0]), "acc": (acc_ty, args[2])}
        for i, name in enumerate(Q8X._fields):
            self.arrays[name] = (x_ty.types[i], builder.extract_value(args[1], i))
        self.nb, self.group, self.t0, self.tokens = (builder.extract_value(args[3], i)
                                                     for i in range(4))
        self.k64 = lambda v: ir.Constant(self.nb.type, v)

    def ptr(self, name, off, ty):
        aty, arr = self.arrays[name]
        return ir_ptr(self.context, self.builder, aty, arr, off, ty)

    def nitems(self, name):
        aty, arr = self.arrays[name]
        return self.context.make_array(aty)(self.context, self.builder, arr).nitems

    def prefetch(self, off, locality=L1):
        """prefetch_ir of the line holding q[off]."""
        aty, arr = self.arrays["q"]
        prefetch_ir(self.context, self.builder, aty, arr, off, locality)


class _GemmFrame(Operands):
    """What the _gemm intrinsics share: their operands, the instruction set's row and rows
    per vector (n), their int and float vector types, the tile height R (acc holds
    `tokens` rows of R), the elements per row of x (32 per block), and loads of n f16
    scales."""

    def __init__(self, context, builder, sig, args, isa, tokens):
        super().__init__(context, builder, sig, args)
        self.isa = row = ISAS[isa]
        self.n = n = row.rows[0 if tokens == 1 else 1]
        self.wide, self.vf = ir.VectorType(ir.IntType(32), n), ir.VectorType(ir.FloatType(), n)
        self.R = builder.udiv(self.nitems("acc"), self.k64(tokens))
        self.ncol = builder.mul(self.nb, self.k64(32))   # elements per row of x

    def at(self, i, stride, const):
        """The offset const + i * stride, i an IR integer."""
        return _at(self.builder, i, stride, const)

    def fma(self, a, b, c):
        return call_llvm(self.builder, f"llvm.fma.v{self.n}f32", self.vf, [a, b, c])

    def f16s(self, name, off):
        """n f16 values of array `name` at off -> <n x float>."""
        b = self.builder
        v = b.load(self.ptr(name, off, ir.VectorType(ir.IntType(16), self.n)), align=2)
        return half_to_float_ir(b, v)


RECORD_ROWS = 16           # rows per strip of every record layout (below)
# Q4_K tiles (q4_k.py) are records, one per strip of RECORD_ROWS rows and super-block of
# 256 weights, all a strip's super-blocks in a row, then the next strip's; per record
# (byte offsets): the rows' d (f16) at Q4K_D, dmin at Q4K_DMIN, their 6-bit sc of the 8
# sub-blocks at Q4K_SC + 16 k + lane, m at Q4K_M + 16 k + lane, and sub-block k's
# nibbles at Q4K_QS + 256 k as quads of the strip's rows (byte 4g + i of lane l at
# 64 g + 4 l + i). A strip reads one address-ordered run, everything a product needs in it.
Q4K_D, Q4K_DMIN, Q4K_SC, Q4K_M, Q4K_QS = 0, 32, 64, 192, 320
Q4K_RECORD = Q4K_QS + 8 * 256                        # 2368 bytes, 37 cache lines
# Q5_K's records are Q4_K's and then the fifth bits: sub-block k's at Q5K_QH + 64 k, one
# 32-bit word per lane, bit 2g + h of its byte i the fifth bit of element 16 h + 4 g + i
# (the element whose low 4 bits sit in nibble h of byte i of quad g)
Q5K_QH = Q4K_RECORD
Q5K_RECORD = Q5K_QH + 8 * 64                         # 2880 bytes, 45 cache lines


def _at(builder, i, stride, const):
    """The offset const + i * stride, i an IR integer."""
    return builder.add(builder.mul(i, ir.Constant(i.type, stride)), ir.Constant(i.type, const))


def _k4_values(builder, load, quads, k, five):
    """The 8 nibble sets (_nibble_sets) of block k of a Q4_K record, or with its fifth bits
    of a Q5_K one (five); quads the byte offset of the record's lane, load(off) -> its
    <n x i32> at off."""
    hb = load(builder.add(quads, _at(builder, k, 64, Q5K_QH))) if five else None
    return _nibble_sets(builder, lambda g: load(builder.add(quads, _at(builder, k, 256, Q4K_QS + 64 * g))), hb)


def _over_records(builder, fr, block_bytes, tokens, sums_per_token, block, finish, rebuilt):
    """The loops of the record intrinsics (blocks_gemm, q4k_gemm, q6_gemm, iq4xs_gemm)
    over a tile of records of fr.group blocks of 32 weights, block_bytes each (a
    constant), fr.nb blocks a row: per vector of n rows (lanes lane.. of their strip) and
    record, with rec its byte offset in q: zero `sums_per_token` f32 vectors per token
    (sums[j][t]); for its blocks k (an IR loop index), prefetch into L2 the block's share
    of the record RECORDS_AHEAD on (PLAIN_DECODE_AHEAD for one token, unless the weights
    are `rebuilt` from fifth or sixth bits) and call block(g, k, rec, lane, sums) (g the
    record's index in the row, so block g * group + k of it); then finish(rec, lane, sums,
    totals), totals[t] one f32 vector per token that block or finish adds to and that is
    stored to acc[t R + row] at the end. The blocks are a loop, not unrolled, and the
    prefetch of the record ahead is spread over them: both measured faster ("records
    loop and prefetch", bench/results/design_measurements.json). Decode (one token) walks
    DECODE_STREAMS vectors of rows side by side, record by record ("decode streams")."""
    k64, n, vf, group = fr.k64, fr.n, fr.vf, fr.group
    records_ahead = PLAIN_DECODE_AHEAD if tokens == 1 and not rebuilt else RECORDS_AHEAD
    per_strip = RECORD_ROWS // n                        # row vectors per strip
    nsb = builder.udiv(fr.nb, group)                    # records per strip
    record = builder.mul(group, k64(block_bytes))

    def vectors(first, count, streams):
        # vectors first + streams i + s (s < streams) for i < count, side by side
        with cgutils.for_range(builder, count) as it:
            vecs = [builder.add(first, builder.add(builder.mul(it.index, k64(streams)), k64(s)))
                    for s in range(streams)]
            strips = [builder.udiv(v, k64(per_strip)) for v in vecs]
            lanes = [builder.mul(builder.urem(v, k64(per_strip)), k64(n)) for v in vecs]
            totals = [[cgutils.alloca_once(builder, vf) for _ in range(tokens)] for _ in vecs]
            sums = [[[cgutils.alloca_once(builder, vf) for _ in range(tokens)]
                     for _ in range(sums_per_token)] for _ in vecs]
            for a in (a for t in totals for a in t):
                builder.store(ir.Constant(vf, None), a)
            with cgutils.for_range(builder, nsb) as sblk:
                sb = sblk.index
                recs = [builder.mul(builder.add(builder.mul(st, nsb), sb), record) for st in strips]
                for a in (a for sv in sums for row in sv for a in row):
                    builder.store(ir.Constant(vf, None), a)
                with cgutils.for_range(builder, group) as blk:
                    k = blk.index
                    for rec in recs:
                        ahead = builder.add(builder.add(rec, builder.mul(record, k64(records_ahead))),
                                            fr.at(k, block_bytes, 0))
                        for line in range(0, block_bytes, 64):
                            fr.prefetch(builder.add(ahead, k64(line)), L2)
                    for rec, lane, sv in zip(recs, lanes, sums):
                        block(sb, k, rec, lane, sv)
                for rec, lane, sv, tv in zip(recs, lanes, sums, totals):
                    finish(rec, lane, sv, tv)
            for v, tv in zip(vecs, totals):
                r0 = builder.mul(v, k64(n))
                for t, a in enumerate(tv):
                    builder.store(builder.load(a),
                                  fr.ptr("acc", builder.add(builder.mul(fr.R, k64(t)), r0), vf), align=4)

    # the vectors in groups of DECODE_STREAMS, then of halves of that, down to single ones
    left, first, streams = builder.udiv(fr.R, k64(n)), k64(0), DECODE_STREAMS if tokens == 1 else 1
    while streams >= 1:
        count = builder.udiv(left, k64(streams))
        vectors(first, count, streams)
        first = builder.add(first, builder.mul(count, k64(streams)))
        left = builder.urem(left, k64(streams))
        streams //= 2


def _finish_d(fr, d_at):
    """A finish for _over_records: totals[t] += d sums[0][t], d the rows' f16 scales at
    byte d_at of the record (Q6_K's, IQ4_XS's super-block d)."""
    b = fr.builder

    def finish(rec, lane, sums, totals):
        dv = fr.f16s("q", b.add(rec, b.add(fr.k64(d_at), b.mul(lane, fr.k64(2)))))
        for t, a in enumerate(totals):
            b.store(fr.fma(dv, b.load(sums[0][t]), b.load(a)), a)
    return finish


def _finish_d_dmin(fr, d_at, dmin_at):
    """A finish for _over_records: totals[t] += d sums[0][t] - dmin sums[1][t], d and dmin
    the rows' f16 scales at bytes d_at and dmin_at of the record (the K-quants' mins)."""
    b = fr.builder

    def finish(rec, lane, sums, totals):
        halves = b.add(rec, b.mul(lane, fr.k64(2)))
        dv = fr.f16s("q", b.add(halves, fr.k64(d_at)))
        mnv = fr.f16s("q", b.add(halves, fr.k64(dmin_at)))
        for t, a in enumerate(totals):
            total = fr.fma(dv, b.load(sums[0][t]), b.load(a))
            b.store(fr.fma(b.fneg(mnv), b.load(sums[1][t]), total), a)
    return finish


def _x_words(builder, fr, tok, u):
    """The 8 i32 words (4 int8 each) of block u of row tok of x8."""
    xo = builder.add(builder.mul(tok, fr.ncol), builder.mul(u, fr.k64(32)))
    return [builder.load(fr.ptr("x8", builder.add(xo, fr.k64(4 * g)), ir.IntType(32)), align=1)
            for g in range(8)]


def _nibble_sets(builder, load, qh=None):
    """A block's 8 nibble sets from its 4 nibble quads (load(g) -> <n x i32> quad g): set
    f = 2 g + h quad g's low (h 0) or high (h 1) nibbles, a byte each; with qh (the
    block's fifth-bit words) each or-ed with its fifth bits at bit 4 (fifth_bits_moved)."""
    ws = []
    for g in range(4):
        w = load(g)
        c = lambda v: ir.Constant(w.type, [v] * w.type.count)
        ws += [builder.and_(w, c(0x0F0F0F0F)), builder.and_(builder.lshr(w, c(4)), c(0x0F0F0F0F))]
    if qh is not None:
        bit4 = ir.Constant(qh.type, [0x10101010] * qh.type.count)
        ws = [builder.or_(w, fifth_bits_moved(builder, qh, f, bit4)) for f, w in enumerate(ws)]
    return ws


def _nibble_pairs(ws, xw):
    """The (weights, x word) pairs of _nibble_sets ws and a block's x words xw: low
    nibbles (elements 4g..) with x words 0..3, high ones (16 + 4g..) with 4..7."""
    return [(ws[2 * g + h], xw[4 * h + g]) for g in range(4) for h in (0, 1)]


def _offset_dot(builder, fr, pairs, signed, sum_w, wmax, offset, si):
    """<n x i32>: the exact sum of the pairs' byte products (signed weights: the row's
    signed dot, sum_w its weight sums if any; else unsigned up to wmax, _dot_bounded),
    less offset times x's block sum xs[si] where offset is not 0."""
    row, n = fr.isa, fr.n
    dot = row.dot(builder, n, pairs, True, sum_w) if signed else _dot_bounded(builder, row, n, pairs, wmax)
    if offset:
        i32 = ir.IntType(32)
        off = builder.mul(builder.load(fr.ptr("xs", si, i32)), ir.Constant(i32, offset))
        dot = builder.sub(dot, splat(builder, off, n))
    return dot


# Per-32-block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL: records.py's BlocksLinear):
# what a record holds. Their records have G blocks (G = 8 when a row has a multiple of
# 8, else the largest power of 2 dividing its block count): the rows' f16 d of block k at
# 32 k + 2 lane, Q4_1's and Q5_1's m at 32 G + 32 k + 2 lane, then block k's quads at
# BLOCK_HEAD[kind] G + BLOCK_QUADS[kind] k (Q4, Q5 and IQ4_NL: the file's 16 nibble
# bytes, byte j holding the low 4 bits of elements j and 16 + j; Q8_0: its 32 int8),
# Q5's then followed by its fifth bits, one 32-bit word a row at 256 + 4 lane: bit f =
# 2 g + h of the word's byte i is element 16 h + 4 g + i's, so that shifting the word by
# 4 - f puts the bits that quad word g's low (h 0) or high (h 1) nibbles lack at bit 4
# of each byte (Q5_K's order, below). IQ4_NL's nibbles index IQ4_VALUES, looked up in
# registers (the instruction set's 16-entry byte lookup, isa.Isa.lookup).
KIND_Q4_0, KIND_Q4_1, KIND_Q8_0, KIND_Q5_0, KIND_Q5_1, KIND_IQ4_NL = 0, 1, 2, 3, 4, 5
BLOCK_HEAD = (32, 64, 32, 32, 64, 32)                # bytes of scales per block
BLOCK_QUADS = (256, 256, 512, 320, 320, 256)         # bytes of quads (and fifth bits) per block
BLOCK_BYTES = tuple(h + q for h, q in zip(BLOCK_HEAD, BLOCK_QUADS))   # per block, 16 rows
BLOCK_OFFSET = (8, 0, 0, 16, 0, 0)                   # value = code - offset (then times d)
BLOCK_MINS = (KIND_Q4_1, KIND_Q5_1)                  # kinds with a min m per block
BLOCK_FIVE = (KIND_Q5_0, KIND_Q5_1)                  # kinds with fifth bits
BLOCK_LUT = (KIND_IQ4_NL,)                           # kinds whose nibbles index IQ4_VALUES
# IQ4_NL's and IQ4_XS's 16 values (ggml's kvalues_iq4nl): value = d IQ4_VALUES[nibble]
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
IQ4_BIAS = 128             # IQ4_VALUES + 128 are bytes (1..241): unsigned pair-dot weights


def iq4_biased(row) -> bool:
    """Whether instruction set `row` (isa.Isa) takes IQ4's values as IQ4_VALUES +
    IQ4_BIAS, unsigned, the bias then coming off the sum as Q4_0's 8 does (its unsigned
    pair sums are exact for any byte: VNNI, generic); else as signed int8 (AVX2, whose
    vpmaddubsw pair sums of biased bytes would pass int16)."""
    return row.pairs_per_dot(255) is None


def lookup_values(builder, row, w, table):
    """<n x i32> w's bytes (each in [0, 16)) replaced by table[byte], in row's lookup."""
    b = ir.VectorType(ir.IntType(8), 4 * w.type.count)
    return builder.bitcast(row.lookup(builder, table, builder.bitcast(w, b)), w.type)


def fifth_bits_moved(builder, qh, f, mask, to=4):
    """The fifth bits of nibble set f = 2 g + h (layout above) at bit `to` of each byte
    (Q3_K's third bits: 2): qh shifted by to - f, and-ed with mask (1 << to in every
    byte, qh's vector type)."""
    ty = qh.type
    count = lambda c: ir.Constant(ty, [c] * ty.count) if isinstance(ty, ir.VectorType) else ir.Constant(ty, c)
    moved = (builder.shl(qh, count(to - f)) if f < to else
             builder.lshr(qh, count(f - to)) if f > to else qh)
    return builder.and_(moved, mask)


@intrinsic(prefer_literal=True)
def blocks_gemm(typingctx, q, x, acc, shape, isa):
    """One tile of a per-32-block format's records (q: R rows of shape.nb blocks,
    shape.group blocks a record, layout above) times shape.tokens rows t0.. of x (Q8X:
    x8, xd, xs = xs8, xsum): acc[k R + r] (f32, R = acc.size // tokens) = row r . x_{t0+k}
    = sum over blocks b of, with S the exact int32 sum of q x8:
        KIND_Q4_0  d dx (S - 8 xs8)     KIND_Q4_1  d dx S + m xsum     KIND_Q8_0  d dx S
        KIND_Q5_0  d dx (S - 16 xs8)    KIND_Q5_1  d dx S + m xsum     KIND_IQ4_NL  d dx S
    (IQ4_NL's S taken as the sum of (IQ4_VALUES + 128) x8 less 128 xs8 where the
    instruction set's unsigned dot is exact for bytes: iq4_biased). shape.kind,
    shape.tokens and isa (an index of isa.ISAS) constants. Each block's weights are
    loaded and unpacked once for the tokens, and the f32 sums of a vector of rows stay
    in registers over the whole row. Q4_0 from DRAM (16 x 16384 x 2048, this
    VM): 1.06-1.11x the bytes/s of the tiles the records replaced (per block 16 R bytes
    of quads, d apart, the pair-dot in passes over the rows), 2 threads, 1.10-1.11x with
    one."""
    TOK, KIND, ISA_ = tile_constants("blocks_gemm", shape, isa)
    lut = KIND in BLOCK_LUT
    biased = lut and iq4_biased(ISAS[ISA_])
    signed = KIND == KIND_Q8_0 or (lut and not biased)
    offset = IQ4_BIAS if biased else BLOCK_OFFSET[KIND]
    table = [v + IQ4_BIAS if biased else v for v in IQ4_VALUES]
    wmax = 255 if biased else 31 if KIND in BLOCK_FIVE else 15

    def codegen(context, builder, sig, args):
        f32 = ir.FloatType()
        fr = _GemmFrame(context, builder, sig, args, ISA_, TOK)
        k64, ptr, n, wide, vf, fma, at = fr.k64, fr.ptr, fr.n, fr.wide, fr.vf, fr.fma, fr.at
        nba, ga, t0a, row = fr.nb, fr.group, fr.t0, fr.isa
        head = builder.mul(ga, k64(BLOCK_HEAD[KIND]))      # the record's scales

        def block(g, k, rec, lane, sums):
            b = builder.add(builder.mul(g, ga), k)
            quads = builder.add(builder.add(rec, head), builder.mul(lane, k64(4)))
            load = lambda off: builder.load(ptr("q", builder.add(quads, at(k, BLOCK_QUADS[KIND], off)),
                                                wide), align=1)
            bytes8 = KIND == KIND_Q8_0
            if bytes8:                                   # Q8_0's 8 quads of int8
                ws = [load(64 * j) for j in range(8)]
            else:
                ws = _nibble_sets(builder, lambda g: load(64 * g), load(256) if KIND in BLOCK_FIVE else None)
            if lut:
                ws = [lookup_values(builder, row, w, table) for w in ws]
            sum_w = row.sum_w(builder, n, ws) if signed else None
            halves = builder.add(rec, builder.mul(lane, k64(2)))
            dv = fr.f16s("q", builder.add(halves, at(k, 32, 0)))
            mins = builder.add(halves, builder.mul(ga, k64(32)))     # the m after the d
            mv = fr.f16s("q", builder.add(mins, at(k, 32, 0))) if KIND in BLOCK_MINS else None
            for t, a in enumerate(sums[0]):
                tok = builder.add(t0a, k64(t))
                xw = _x_words(builder, fr, tok, b)
                si = builder.add(builder.mul(tok, nba), b)
                pairs = list(zip(ws, xw)) if bytes8 else _nibble_pairs(ws, xw)
                dot = _offset_dot(builder, fr, pairs, signed, sum_w, wmax, offset, si)
                dx = splat(builder, builder.load(ptr("xd", si, f32)), n)
                total = fma(builder.sitofp(dot, vf), builder.fmul(dv, dx), builder.load(a))
                if mv is not None:
                    total = fma(mv, splat(builder, builder.load(ptr("xsum", si, f32)), n), total)
                builder.store(total, a)

        def finish(rec, lane, sums, totals):
            for a, s_ in zip(totals, sums[0]):
                builder.store(builder.fadd(builder.load(a), builder.load(s_)), a)

        _over_records(builder, fr, BLOCK_BYTES[KIND], TOK, 1, block, finish, KIND in BLOCK_FIVE)
        return context.get_dummy_value()

    return types.void(q, x, acc, shape, isa), codegen


@intrinsic(prefer_literal=True)
def q4k_gemm(typingctx, q, x, acc, shape, isa, values=None, write=None):
    """One tile of Q4_K records (shape.kind 4 bits) or Q5_K records (5) (q: R rows of
    shape.nb sub-blocks of 32, layout above; shape.group K_GROUP) times shape.tokens rows
    t0.. of x (Q8X: x8, xd, xsum): acc[k R + r] (f32, R = acc.size // tokens) =
    row r . x_{t0+k} = sum over super-blocks of
        d sum_u sc_u dx_u S_u - dmin sum_u m_u xsum_u,   S_u the exact int32 sum(q x8).
    tokens (1 for decode, TOKENS for prefill), bits and isa constants. Each sub-block's
    values are unpacked once for the tokens (Q5_K's fifth bits or-ed in as Q6_K's
    crumbs are), or, given `values` (the tile's values tile), loaded from there (with
    `write` 1: rebuilt and stored there); the f32 sums of a vector of rows stay in
    registers over the whole row."""
    TOK, bits, kind = tile_constants("q4k_gemm", shape, isa)
    five = bits == 5
    block_bytes = (Q5K_RECORD if five else Q4K_RECORD) // 8
    mode = _values_mode(values, write)

    def codegen(context, builder, sig, args):
        i8, f32 = ir.IntType(8), ir.FloatType()
        fr = _GemmFrame(context, builder, sig, args, kind, TOK)
        k64, ptr, n, wide, vf, fma, at = fr.k64, fr.ptr, fr.n, fr.wide, fr.vf, fr.fma, fr.at
        nsa, t0a = fr.nb, fr.t0
        if mode:
            fr.arrays["values"] = (sig.args[5], args[5])

        def u8s(off):                                       # n u8 bytes of q -> <n x float>
            return builder.uitofp(builder.load(ptr("q", off, ir.VectorType(i8, n)), align=1), vf)

        def block(sb, k, rec, lane, sums):                  # sums: scale (a1), min (a2)
            u = builder.add(builder.mul(sb, k64(8)), k)
            ws = _block_values(builder, fr, mode, rec, block_bytes, k, lane, lambda: _k4_values(
                builder, lambda off: builder.load(ptr("q", off, wide), align=1),
                builder.add(rec, builder.mul(lane, k64(4))), k, five))
            scv = u8s(builder.add(builder.add(rec, lane), at(k, 16, Q4K_SC)))
            mv = u8s(builder.add(builder.add(rec, lane), at(k, 16, Q4K_M)))
            for t in range(TOK):
                tok = builder.add(t0a, k64(t))
                dot = _dot_bounded(builder, fr.isa, n, _nibble_pairs(ws, _x_words(builder, fr, tok, u)),
                                   (1 << bits) - 1)
                si = builder.add(builder.mul(tok, nsa), u)
                dx = splat(builder, builder.load(ptr("xd", si, f32)), n)
                a1, a2 = sums[0][t], sums[1][t]
                builder.store(fma(builder.sitofp(dot, vf), builder.fmul(scv, dx),
                                  builder.load(a1)), a1)
                xs = splat(builder, builder.load(ptr("xsum", si, f32)), n)
                builder.store(fma(mv, xs, builder.load(a2)), a2)

        _over_records(builder, fr, block_bytes, TOK, 2, block, _finish_d_dmin(fr, Q4K_D, Q4K_DMIN), five)
        return context.get_dummy_value()

    return types.void(q, x, acc, shape, isa, values if mode else types.none,
                      write if mode == "write" else types.none), codegen


# IQ4_XS tiles (iq4.py) are records as Q4_K's, one per strip of RECORD_ROWS rows and
# super-block; per record (byte offsets): the rows' d (f16) at IQ4XS_D, sub-block k's
# scales ls - 32 (int8) at IQ4XS_SC + 16 k + lane, and its nibbles (indices into
# IQ4_VALUES, byte j: elements j and 16 + j) at IQ4XS_QS + 256 k as quads of the strip's
# rows (byte 4g + i of lane l at 64 g + 4 l + i).
IQ4XS_D, IQ4XS_SC, IQ4XS_QS = 0, 32, 192            # 32 bytes of padding before the quads
IQ4XS_RECORD = IQ4XS_QS + 8 * 256                    # 2240 bytes, 35 cache lines


@intrinsic(prefer_literal=True)
def iq4xs_gemm(typingctx, q, x, acc, shape, isa):
    """One tile of IQ4_XS records (q: R rows of shape.nb sub-blocks of 32, layout above;
    shape.group K_GROUP) times shape.tokens rows t0.. of x (Q8X: x8, xd, xs = xs8):
    acc[k R + r] (f32, R = acc.size // tokens) = row r . x_{t0+k} = sum over super-blocks
    of d sum_u sc_u dx_u S_u, S_u the exact int32 sum of IQ4_VALUES[nibble] x8 (taken
    as blocks_gemm's IQ4_NL takes it: biased or signed, iq4_biased). tokens (1 for
    decode, TOKENS for prefill) and isa constants. Each sub-block's values are looked up
    once for the tokens, and the f32 sums of a vector of rows stay in registers over the
    whole row."""
    TOK, _, ISA_ = tile_constants("iq4xs_gemm", shape, isa)
    row = ISAS[ISA_]
    biased = iq4_biased(row)
    table = [v + IQ4_BIAS if biased else v for v in IQ4_VALUES]

    def codegen(context, builder, sig, args):
        i8, f32 = ir.IntType(8), ir.FloatType()
        fr = _GemmFrame(context, builder, sig, args, ISA_, TOK)
        k64, ptr, n, wide, vf, fma, at = fr.k64, fr.ptr, fr.n, fr.wide, fr.vf, fr.fma, fr.at
        nsa, t0a = fr.nb, fr.t0

        def block(sb, k, rec, lane, sums):
            u = builder.add(builder.mul(sb, k64(8)), k)
            quads = builder.add(rec, builder.mul(lane, k64(4)))
            ws = _nibble_sets(builder, lambda g: builder.load(
                ptr("q", builder.add(quads, at(k, 256, IQ4XS_QS + 64 * g)), wide), align=1))
            ws = [lookup_values(builder, row, w, table) for w in ws]
            sum_w = row.sum_w(builder, n, ws) if not biased else None
            sc_at = builder.add(builder.add(rec, lane), at(k, 16, IQ4XS_SC))
            scv = builder.sitofp(builder.load(ptr("q", sc_at, ir.VectorType(i8, n)), align=1), vf)
            for t in range(TOK):
                tok = builder.add(t0a, k64(t))
                si = builder.add(builder.mul(tok, nsa), u)
                dot = _offset_dot(builder, fr, _nibble_pairs(ws, _x_words(builder, fr, tok, u)), not biased,
                                  sum_w, 255, IQ4_BIAS if biased else 0, si)
                dx = splat(builder, builder.load(ptr("xd", si, f32)), n)
                a = sums[0][t]
                builder.store(fma(builder.sitofp(dot, vf), builder.fmul(scv, dx), builder.load(a)), a)

        _over_records(builder, fr, IQ4XS_RECORD // 8, TOK, 1, block, _finish_d(fr, IQ4XS_D), False)
        return context.get_dummy_value()

    return types.void(q, x, acc, shape, isa), codegen


# Q6_K tiles (q6_k.py) are records as Q4_K's, one per strip of RECORD_ROWS rows and
# super-block; per record (byte offsets): the rows' d (f16) at Q6K_D, the int8 scales of
# block k (of 32 weights) at Q6K_SC + 32 k + 16 h + lane for its elements 16 h.., and
# block k's quads at Q6K_QS + 384 k: 4 of nibbles (byte j: the low 4 bits of elements j
# and 16 + j), then 2 of crumbs (byte j: the high 2 bits of elements j, j + 8, j + 16,
# j + 24 at bits 0, 2, 4, 6); quad g at 64 g, byte 4g + i of lane l at 64 g + 4 l + i.
Q6K_D, Q6K_SC, Q6K_QS = 0, 32, 320                  # 32 bytes of padding before the quads
Q6K_RECORD = Q6K_QS + 8 * 384                        # 3392 bytes, 53 cache lines
# Q3_K's records (q3_k.py) are Q6_K's with 3-bit values: d at Q6K_D, the int8 sc - 32 at
# Q6K_SC as Q6_K's scales, then per block k at Q6K_QS + 192 k its low 2 bits as Q6_K's 2
# crumb quads and its third bits, one 32-bit word per lane at 128 + 4 lane: bit f = 2 g
# + h of byte i the third bit of element 16 h + 4 g + i (Q5's fifth bits' order)
Q3K_RECORD = Q6K_QS + 8 * 192                        # 1856 bytes, 29 cache lines
# Q2_K's records (q2_k.py): the rows' d (f16) at Q6K_D and dmin at Q2K_DMIN, the file's
# scale byte of block k's elements 16 h.. (4-bit sc, 4-bit m above it) at Q2K_SC + 32 k +
# 16 h + lane, then per block k at Q6K_QS + 128 k its 2-bit values as Q6_K's 2 crumb
# quads: the file's 84 bytes a row and super-block, nothing added
Q2K_DMIN, Q2K_SC = 32, 64
Q2K_RECORD = Q6K_QS + 8 * 128                        # 1344 bytes, 21 cache lines
# q6_gemm's kinds: the format's bits, and per kind its record and block bytes, what
# comes off each value (q - 32, q - 4, q), the largest value
K16_RECORD = {6: Q6K_RECORD, 3: Q3K_RECORD, 2: Q2K_RECORD}
K16_BLOCK = {6: 384, 3: 192, 2: 128}
K16_OFFSET = {6: 32, 3: 4, 2: 0}
K16_MAX = {6: 63, 3: 7, 2: 3}


def _crumbs(builder, n, cw, g, h):
    """The low 2 bits of elements 16 h + 4 g.. of a block (a byte each, <n x i32>) from its
    crumb quads cw (2 <n x i32>): quad g % 2 holds them in field g // 2 + 2 h."""
    f = (g >> 1) + 2 * h
    w = cw[g & 1] if f == 0 else builder.lshr(cw[g & 1], ir.Constant(cw[0].type, [2 * f] * n))
    return builder.and_(w, ir.Constant(cw[0].type, [0x03030303] * n))


def _q6_values(builder, n, quad):
    """Q6_K's 6-bit values of one block of n rows: (lo, hi), 4 <n x i32> each, lane g of
    lo holding elements 4g..4g+3 of a row, of hi 16 + 4g..; quad(j) loads quad j (nibble
    quads 0..3, crumb quads 4, 5; Q6_K's records above)."""
    i32 = ir.IntType(32)
    c = lambda v: ir.Constant(ir.VectorType(i32, n), [v] * n)
    nib = [quad(g) for g in range(4)]
    crumbs = [quad(4), quad(5)]
    lo, hi = [], []
    for g in range(4):
        # crumb quad g % 2 holds the high bits of elements 4g.. in field g // 2 and of
        # 16 + 4g.. in field 2 + g // 2: each moved to bits 4-5 of its byte
        cw, f = crumbs[g & 1], g >> 1
        clo = builder.shl(cw, c(4 - 2 * f))
        chi = cw if f == 0 else builder.lshr(cw, c(2))
        lo.append(builder.or_(builder.and_(nib[g], c(0x0F0F0F0F)), builder.and_(clo, c(0x30303030))))
        hi.append(builder.or_(builder.and_(builder.lshr(nib[g], c(4)), c(0x0F0F0F0F)),
                              builder.and_(chi, c(0x30303030))))
    return lo, hi


def _k16_values(builder, n, kind, quad):
    """A block's values of n rows in q6_gemm's kind (lo, hi as _q6_values'): quad(j) loads
    quad j of the block (Q6_K: 4 nibble and 2 crumb quads; Q3_K: 2 crumb quads and the
    third bits' words; Q2_K: 2 crumb quads)."""
    if kind == 6:
        return _q6_values(builder, n, quad)
    cw = [quad(0), quad(1)]
    third = quad(2) if kind == 3 else None
    bit2 = ir.Constant(cw[0].type, [0x04040404] * n)
    lo, hi = [], []
    for g in range(4):
        for h, out in ((0, lo), (1, hi)):
            v = _crumbs(builder, n, cw, g, h)
            if third is not None:            # bit 2 g + h of each byte, moved to bit 2
                v = builder.or_(v, fifth_bits_moved(builder, third, 2 * g + h, bit2, to=2))
            out.append(v)
    return lo, hi


def _k16_block_values(builder, n, kind, load, quads, k):
    """The 8 value vectors of block k of a record of q6_gemm's kind, lo then hi
    (_k16_values); quads and load as _k4_values'."""
    lo, hi = _k16_values(builder, n, kind, lambda j: load(
        builder.add(quads, _at(builder, k, K16_BLOCK[kind], Q6K_QS + 64 * j))))
    return lo + hi


def _q6_offsets(builder, n, xs, offset):
    """offset times each half's sum of x (xs: 2 i32), splat: the value's offset (Q6_K's
    -32 of q - 32) in _q6_sum."""
    return [splat(builder, builder.mul(v, ir.Constant(ir.IntType(32), offset)), n) for v in xs]


def _q6_sum(builder, row, n, lo, hi, xw, offs, scs, wmax):
    """<n x i32>: sc0 (S0 - off0) + sc1 (S1 - off1), S0 and S1 the exact sums of lo and
    hi (_q6_values, values up to wmax) times the x words xw (8 i32 of 4 int8), offs
    _q6_offsets (None: no offset, and the scales multiplied in as row.scaled_dot does),
    scs the rows' two scales (<n x i32>); row the instruction set's isa.Isa."""
    res = None
    for h, qs in enumerate((lo, hi)):
        pairs = [(qs[g], xw[4 * h + g]) for g in range(4)]
        if offs is None:
            term = _dot_bounded(builder, row, n, pairs, wmax, scs[h])
        else:
            term = builder.mul(scs[h], builder.sub(_dot_bounded(builder, row, n, pairs, wmax), offs[h]))
        res = term if res is None else builder.add(res, term)
    return res


def _q6_scales(builder, n, load_i8):
    """The two int8 scales of a block's n rows, <n x i32> each; load_i8(h) loads the
    <n x i8> of half h."""
    wide = ir.VectorType(ir.IntType(32), n)
    return [builder.sext(load_i8(h), wide) for h in range(2)]


@intrinsic(prefer_literal=True)
def q6_gemm(typingctx, q, x, acc, shape, isa, values=None, write=None):
    """One tile of the records of a K-quant with 16-weight sub-blocks (q: R rows of
    shape.nb blocks of 32, shape.group K_GROUP; shape.kind its bits: 6 Q6_K, 3 Q3_K, 2
    Q2_K, layouts above) times shape.tokens rows t0.. of x (Q8X: x8, xd, xs = xs16
    (Tp*2nb,) int32 its sums per 16, xsum = xsum16 (Tp*2nb,) f32, dx times them):
    acc[k R + r] (f32, R = acc.size // tokens) = row r . x_{t0+k} = sum over super-blocks
    of d sum over their blocks u of dx_u S_u, S_u = sum over u's two halves of scale *
    sum((q - offset) x8), exact in int32 (|S_u| <= 2 * 128 * 16 * 63 * 127), offset
    K16_OFFSET's. Q2_K's scale is the low nibble of its scale byte: dmin times the sum
    over halves of m xsum16 comes off (m the high nibble; xs is not read). In AVX2's
    prefill (int16_pairs, several tokens) Q6_K's and Q3_K's offsets come off the same
    way, m = offset * scale and dmin = d (a block's m made once for its tokens), and the
    scales multiply in the widening (isa.scaled_dot): fewer instructions a token than
    the offset and scale in int32 ("q6_gemm offsets in f32",
    bench/results/design_measurements.json); elsewhere they stay in int32, the bits of
    AMX's prefill (amx.py). tokens (1 for decode, TOKENS for prefill) and isa constants.
    Each block's values are built once for the tokens, or, given `values` (the tile's
    values tile), loaded from there (with `write` 1: built and stored there); the f32
    sums of a vector of rows stay in registers over the whole row."""
    TOK, kind, ISA_ = tile_constants("q6_gemm", shape, isa)
    if kind not in K16_RECORD:
        raise TypingError(f"q6_gemm: kind {kind} is not one of {sorted(K16_RECORD)}")
    # an f32 sum to take off: Q2_K's mins, and AVX2 prefill's offsets
    mins = kind == 2 or (K16_OFFSET[kind] and ISAS[ISA_].int16_pairs and TOK > 1)
    block_bytes = K16_RECORD[kind] // 8
    mode = _values_mode(values, write)

    def codegen(context, builder, sig, args):
        i8, i32, f32 = ir.IntType(8), ir.IntType(32), ir.FloatType()
        fr = _GemmFrame(context, builder, sig, args, ISA_, TOK)
        k64, ptr, n, wide, vf, fma = fr.k64, fr.ptr, fr.n, fr.wide, fr.vf, fr.fma
        at, nsa, t0a = fr.at, fr.nb, fr.t0
        c = lambda v: ir.Constant(wide, [v] * n)
        if mode:
            fr.arrays["values"] = (sig.args[5], args[5])

        def block(sb, k, rec, lane, sums):
            u = builder.add(builder.mul(sb, k64(8)), k)
            vals = _block_values(builder, fr, mode, rec, block_bytes, k, lane, lambda: _k16_block_values(
                builder, n, kind, lambda off: builder.load(ptr("q", off, wide), align=1),
                builder.add(rec, builder.mul(lane, k64(4))), k))
            lo, hi = vals[:4], vals[4:]
            sc_bytes = lambda h: builder.load(ptr("q", builder.add(builder.add(rec, lane), at(
                k, 32, (Q2K_SC if kind == 2 else Q6K_SC) + 16 * h)), ir.VectorType(i8, n)), align=1)
            if kind == 2:                       # the scale byte: sc in bits 0-3, m in 4-7
                both = [builder.zext(sc_bytes(h), wide) for h in range(2)]
                scs = [builder.and_(v, c(15)) for v in both]
                ms = [builder.uitofp(builder.lshr(v, c(4)), vf) for v in both]
            else:
                scs = _q6_scales(builder, n, sc_bytes)
                off = ir.Constant(vf, [float(K16_OFFSET[kind])] * n)
                ms = [builder.fmul(builder.sitofp(v, vf), off) for v in scs] if mins else None
            for t in range(TOK):
                tok = builder.add(t0a, k64(t))
                si = builder.add(builder.mul(tok, nsa), u)
                offs = None
                if not mins and K16_OFFSET[kind]:
                    xs = [builder.load(ptr("xs", builder.add(builder.mul(si, k64(2)), k64(h)), i32))
                          for h in range(2)]
                    offs = _q6_offsets(builder, n, xs, K16_OFFSET[kind])
                dot = _q6_sum(builder, fr.isa, n, lo, hi, _x_words(builder, fr, tok, u), offs, scs,
                              K16_MAX[kind])
                dx = splat(builder, builder.load(ptr("xd", si, f32)), n)
                a = sums[0][t]
                builder.store(fma(builder.sitofp(dot, vf), dx, builder.load(a)), a)
                if mins:
                    xm = [splat(builder, builder.load(ptr("xsum", builder.add(builder.mul(si, k64(2)), k64(h)),
                                                         f32)), n) for h in range(2)]
                    a = sums[1][t]
                    builder.store(fma(ms[1], xm[1], fma(ms[0], xm[0], builder.load(a))), a)

        if mins:
            _over_records(builder, fr, block_bytes, TOK, 2, block,
                          _finish_d_dmin(fr, Q6K_D, Q2K_DMIN if kind == 2 else Q6K_D), kind != 2)
        else:
            _over_records(builder, fr, block_bytes, TOK, 1, block, _finish_d(fr, Q6K_D), True)
        return context.get_dummy_value()

    return types.void(q, x, acc, shape, isa, values if mode else types.none,
                      write if mode == "write" else types.none), codegen


@intrinsic(prefer_literal=True)
def k_gemm(typingctx, q, x, acc, shape, isa, values=None, write=None):
    """q4k_gemm for a tile of Q4_K or Q5_K records (shape.kind 4 or 5), else q6_gemm (the
    16-weight sub-block K-quants: 6, 3, 2), the same arguments: the product kernels call
    one name for either. (A kernel that held one of the two in a closure variable
    instead was compiled afresh at every start: Numba's cache keys a closure by its
    variables' pickle, which an intrinsic's is not stable across processes.)"""
    _, kind, _ = tile_constants("k_gemm", shape, isa)
    gemm = q4k_gemm if kind in (4, 5) else q6_gemm
    return gemm._defn(typingctx, q, x, acc, shape, isa, values, write)


# Values tiles: a prefill of many tokens multiplies each tile of K-quant records by every
# group of TOKENS rows of x, and each group rebuilt a block's 5-, 6- or 3-bit values from
# nibbles, fifth bits and crumbs again. Given a values tile, the first group of a tile (a
# window of its rows) rebuilds them and stores them there, a byte each (`write` 1), and
# the others load them: the same integers, so the same sums and bits. Per block of 32 and
# strip of 16 rows, VALUES_BLOCK bytes, the blocks in record order: the block's 8 value
# vectors (the nibble sets of _k4_values, or _k16_values' lo then hi), vector j at 64 j,
# row (lane) l's 4 bytes at 64 j + 4 l, as the records' quads are laid out.
VALUES_BLOCK = 8 * 4 * RECORD_ROWS                   # 512 bytes
# the kinds whose prefill takes values tiles (bits): Q5_K, Q6_K and Q3_K; Q4_K's and
# Q2_K's values are a mask and a shift away, and loading them read slower ("values
# tiles", bench/results/design_measurements.json)
K_VALUES = (5, 6, 3)


def _values_mode(values, write):
    """None (no values tile: rebuild), "load" or "write" (rebuild and store) from a gemm
    intrinsic's optional arguments (values a 1-d u8 array, write the constant 1); a
    TypingError if they are something else."""
    if values is None or isinstance(values, types.NoneType):
        return None
    if not (isinstance(values, types.Array) and values.ndim == 1 and values.dtype == types.uint8):
        raise TypingError(f"values must be a 1-d uint8 array (a values tile), not {values}")
    if write is None or isinstance(write, types.NoneType):
        return "load"
    if not (isinstance(write, types.IntegerLiteral) and write.literal_value == 1):
        raise TypingError(f"write must be the constant 1, not {write}")
    return "write"


def _block_values(builder, fr, mode, rec, block_bytes, k, lane, rebuild):
    """The 8 value vectors of block k of the record at byte rec of q (records of
    block_bytes a block) for the n rows from `lane`: rebuild() them (mode None), load
    them from the values tile ("load"), or rebuild and store them there ("write")."""
    if mode is None:
        return rebuild()
    first = builder.udiv(rec, fr.k64(block_bytes))       # the record's first block (a constant divisor)
    at = builder.add(_at(builder, builder.add(first, k), VALUES_BLOCK, 0), builder.mul(lane, fr.k64(4)))
    ptrs = [fr.ptr("values", builder.add(at, fr.k64(64 * j)), fr.wide) for j in range(8)]
    if mode == "load":
        return [builder.load(p, align=1) for p in ptrs]
    vals = rebuild()
    for v, p in zip(vals, ptrs):
        builder.store(v, p, align=1)
    return vals


def prefetch_ir(context, builder, aty, arr, off, locality=L1):
    """llvm.prefetch (read) of the line holding arr[off] (a 1-d array of Numba type aty)
    into the cache levels `locality` says; off may lie past the end: a prefetch never
    faults."""
    i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
    data = context.make_array(aty)(context, builder, arr).data
    call_llvm(builder, "llvm.prefetch.p0", ir.VoidType(),
              [builder.bitcast(builder.gep(data, [off]), i8p), ir.Constant(i32, 0),
               ir.Constant(i32, locality), ir.Constant(i32, 1)])
