"""The instruction sets the kernels lower to: one table, ISAS, from which the CPU's row
is chosen once (target.py: ISA, TARGET, from the features Numba compiles for).

A row (Isa) says everything the kernels ask of an instruction set: its name for
reports, the target features it needs, the integer pair-dot lowering (`dot`: per
32-bit lane, the sum of 4 weight bytes times 4 int8 activations, over a list of
pairs), the 16-entry byte table lookup (`lookup`: IQ4's nibbles to their values),
how wide its vectors are and how many rows of weights the tile intrinsics
take per vector, the int16 word-pair dot (`word_dot`) and whether attention's q8_0
V sums with it (`v_int16`), whether its unsigned pair sums pass through int16 (so
callers split their pairs: `pairs_per_dot`), how halves convert to f32
(`half_native`), and whether AMX tiles can come on top (`has_tiles`). simd.py's
intrinsics, attention.py's quantized scores and V and amx.py read these fields; none of
them branches on the name.

A new instruction set (Arm's sdot, say): one row in ISAS (after the rows it beats,
before those that beat it), with its `needs`; its lowering functions here beside _dot_vnni / _dot_avx2 /
_dot_generic (the pair-dot, and weight sums if its signed dot wants them once per
block); and its integer model in tests/formats/test_isa_models.py (MODELS), which
checks each row's model against the exact sums at every caller's bounds.
tests/formats/test_isa.py checks every row has what the kernels use and lowers its dot
to machine code with only the features it needs; test_simd.py runs the intrinsics of
every row this CPU can run against NumPy twins.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import llvmlite.binding as llvm
from llvmlite import ir
from numba.core import cgutils

ARCH = llvm.get_process_triple().split("-")[0]


def call_llvm(builder, name, ret, args):
    """A call of the LLVM function or intrinsic `name` returning `ret`."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]),
                                        name)
    return builder.call(fn, args)


def splat(builder, scalar, n):
    """<n x type>: scalar in every lane."""
    vt = ir.VectorType(scalar.type, n)
    one = builder.insert_element(ir.Constant(vt, None), scalar, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(one, ir.Constant(vt, None),
                                  ir.Constant(ir.VectorType(ir.IntType(32), n), [0] * n))


# --- the pair-dot lowerings: dot(builder, n, pairs, signed, sum_w) -> <n x i32> ---------
# pairs: (w <n x i32> of 4 weight bytes per lane, x i32 of 4 int8 activations, broadcast);
# weights u8 (unsigned, < 64) or i8 (signed); x in [-127, 127] (records.prep_q8_x).

def _vpdpbusd(n):
    """LLVM's vpdpbusd over n int32 lanes: AVX-512 VNNI's (16) or, 8, AVX-VNNI's VEX form
    where the target has no AVX-512 VL (LLVM picks the encoding by the features)."""
    return f"llvm.x86.avx512.vpdpbusd.{32 * n}"


def _vnni_sum_w(builder, n, ws):
    """<n x i32>: per 32-bit lane, the sum of the int8 weight bytes of all of ws."""
    wide = ir.VectorType(ir.IntType(32), n)
    ones = ir.Constant(wide, [0x01010101] * n)
    sum_w = ir.Constant(wide, None)
    for w in ws:
        sum_w = call_llvm(builder, _vpdpbusd(n), wide, [sum_w, ones, w])
    return sum_w


def _dot_vnni(builder, n, pairs, signed, sum_w):
    """vpdpbusd: 4n u8 x i8 products summed into n int32 lanes, one instruction."""
    i32 = ir.IntType(32)
    wide = ir.VectorType(i32, n)
    name = _vpdpbusd(n)
    total = ir.Constant(wide, None)
    if not signed:
        for w, x in pairs:
            total = call_llvm(builder, name, wide, [total, w, splat(builder, x, n)])
        return total
    # vpdpbusd takes u8 x i8: (x + 128) . w, less 128 sum(w) (a second vpdpbusd by 1s)
    for w, x in pairs:
        xu = builder.xor(x, ir.Constant(i32, 0x80808080 - (1 << 32)))
        total = call_llvm(builder, name, wide, [total, splat(builder, xu, n), w])
    if sum_w is None:
        sum_w = _vnni_sum_w(builder, n, [w for w, _ in pairs])
    return builder.sub(total, builder.shl(sum_w, ir.Constant(wide, [7] * n)))


def _dot_avx2(builder, n, pairs, signed, sum_w, scale=None):
    """vpmaddubsw (u8 x i8 pairs -> int16, saturating) then vpmaddwd (-> int32); n = 8.
    Unsigned: all the pairs' int16 sums added before one widening (the caller keeps
    them below 2^15: pairs_per_dot), which multiplies them by `scale` (<n x i32>, each
    within int16) where given: a scaled dot's multiply in the widening's, not after."""
    i8, i16, i32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
    wide = ir.VectorType(i32, n)
    b32, h16 = ir.VectorType(i8, 32), ir.VectorType(i16, 16)
    ones16 = ir.Constant(h16, [1] * 16)
    if scale is not None:      # each lane's scale in both of its int16 halves
        low = builder.and_(scale, ir.Constant(wide, [0xFFFF] * n))
        ones16 = builder.bitcast(builder.or_(low, builder.shl(scale, ir.Constant(wide, [16] * n))), h16)
    total, s = None, None
    for w, x in pairs:
        wb, xb = builder.bitcast(w, b32), builder.bitcast(splat(builder, x, n), b32)
        if signed:   # u8 |w| x i8 x sign(w), as llama.cpp: pairs within 2 * 128 * 127
            xb = call_llvm(builder, "llvm.x86.avx2.psign.b", b32, [xb, wb])
            wb = call_llvm(builder, "llvm.abs.v32i8", b32, [wb, ir.Constant(ir.IntType(1), 0)])
        pr = call_llvm(builder, "llvm.x86.avx2.pmadd.ub.sw", h16, [wb, xb])
        if signed:   # two pairs could pass int16: widen each to int32
            pr = call_llvm(builder, "llvm.x86.avx2.pmadd.wd", wide, [pr, ones16])
            total = pr if total is None else builder.add(total, pr)
        else:        # the caller's bound keeps the int16 sum exact
            s = pr if s is None else builder.add(s, pr)
    return total if signed else call_llvm(builder, "llvm.x86.avx2.pmadd.wd", wide, [s, ones16])


def _dot_generic(builder, n, pairs, signed, sum_w):
    """Target-independent IR (widen, multiply, add; then the 4 sums of each 32-bit
    lane), which LLVM lowers to whatever the target has."""
    i8, i32 = ir.IntType(8), ir.IntType(32)
    wide, b4, w4 = ir.VectorType(i32, n), ir.VectorType(i8, 4 * n), ir.VectorType(i32, 4 * n)
    s = ir.Constant(w4, None)
    for w, x in pairs:
        wv = builder.bitcast(w, b4)
        wv = builder.sext(wv, w4) if signed else builder.zext(wv, w4)
        xv = builder.sext(builder.bitcast(splat(builder, x, n), b4), w4)
        s = builder.add(s, builder.mul(wv, xv))
    total = None
    for k in range(4):
        part = builder.shuffle_vector(s, s, ir.Constant(wide, [4 * i + k for i in range(n)]))
        total = part if total is None else builder.add(total, part)
    return total


# --- the word-pair dots: word_dot(builder, acc, a, b) -> <16 x i32> ------------------
# a, b <16 x i32> of two int16 each per lane: acc + a.lo b.lo + a.hi b.hi per lane, exact
# (the caller keeps the sums inside int32: attention's q8_0 V, 32767 x 127 a product).
# Rows that set v_int16 have it in one instruction; elsewhere the generic IR (LLVM makes
# AVX2's pmaddwd + paddd of it) serves the tests, and attention's V stays in f32, faster
# there (bench/results/design_measurements.json, "q8_0 V's weighted sum").

def _word_dot_vnni(builder, acc, a, b):
    """vpdpwssd: 32 int16 products summed in pairs into 16 int32 lanes, one instruction."""
    return call_llvm(builder, "llvm.x86.avx512.vpdpwssd.512", acc.type, [acc, a, b])


def _word_dot_generic(builder, acc, a, b):
    """Target-independent IR: widen the halves, multiply, add the even and odd products."""
    i16, i32 = ir.IntType(16), ir.IntType(32)
    wide = ir.VectorType(i32, 32)
    prod = builder.mul(*(builder.sext(builder.bitcast(v, ir.VectorType(i16, 32)), wide) for v in (a, b)))
    lanes = ir.VectorType(i32, 16)
    even, odd = (builder.shuffle_vector(prod, prod, ir.Constant(lanes, list(range(k, 32, 2))))
                 for k in (0, 1))
    return builder.add(acc, builder.add(even, odd))


# --- the 16-entry byte lookups: lookup(builder, table, idx) -> <m x i8> ----------------
# table: 16 ints in [-128, 255] (as bytes); idx <m x i8> in [0, 16), m a multiple of 16.

def _lookup_generic(builder, table, idx):
    """Target-independent IR: per byte an extractelement from the table, which LLVM
    lowers to what the target has (a variable permute, or a byte at a time)."""
    i8, i32 = ir.IntType(8), ir.IntType(32)
    tab = ir.Constant(ir.VectorType(i8, 16), [v & 0xFF for v in table])
    res = ir.Constant(idx.type, None)
    for k in range(idx.type.count):
        kk = ir.Constant(i32, k)
        res = builder.insert_element(res, builder.extract_element(tab, builder.extract_element(idx, kk)), kk)
    return res


def _pshufb(width, name):
    """pshufb over `width`-byte vectors (the 16-entry table in each 16-byte lane): one
    instruction per `width` bytes of idx (fewer bytes padded, more a power-of-2 number of
    runs, concatenated)."""
    i32 = ir.IntType(32)
    shuffle = lambda b, u, v, sel: b.shuffle_vector(u, v, ir.Constant(ir.VectorType(i32, len(sel)), sel))

    def lookup(builder, table, idx):
        vt = ir.VectorType(ir.IntType(8), width)
        tab = ir.Constant(vt, [v & 0xFF for v in table] * (width // 16))
        m = idx.type.count
        if m < width:
            part = shuffle(builder, idx, idx, list(range(m)) + [0] * (width - m))
            return shuffle(builder, call_llvm(builder, name, vt, [tab, part]), part, list(range(m)))
        parts = [call_llvm(builder, name, vt, [tab, shuffle(builder, idx, idx, list(range(p, p + width)))])
                 for p in range(0, m, width)]
        while len(parts) > 1:          # pairs of equal width concatenated
            size = parts[0].type.count
            parts = [shuffle(builder, parts[i], parts[i + 1], list(range(2 * size)))
                     for i in range(0, len(parts), 2)]
        return parts[0]
    return lookup


def _half(builder, v, h, lanes):
    """Half h (0 or 1) of vector v of 2 lanes elements."""
    sel = ir.Constant(ir.VectorType(ir.IntType(32), lanes), list(range(h * lanes, (h + 1) * lanes)))
    return builder.shuffle_vector(v, v, sel)


def _joined(builder, halves):
    """The two vectors of halves, one after the other."""
    n = 2 * halves[0].type.count
    return builder.shuffle_vector(halves[0], halves[1], ir.Constant(ir.VectorType(ir.IntType(32), n), list(range(n))))


X_MAX = 127           # |x8| at most (prep_q8_x never gives -128)
F16C = frozenset({"f16c", "avx"})   # x86's one-instruction f16 <-> f32 (F16C needs AVX's encoding)


@dataclass(frozen=True)
class Isa:
    """One instruction set: what the kernels ask of it (module docstring)."""
    name: str                      # for reports (ISA_NAMES, amx.kernels_name, --version)
    needs: frozenset[str]          # target features it needs, all of them
    pair_dot: Callable             # (builder, n, pairs, signed, sum_w) -> <n x i32>, n <= lanes
    lanes: int | None              # int32 lanes per vector register; None: LLVM splits any n
    rows: tuple[int, int]          # rows of weights per vector: decode (1 token), prefill (TOKENS)
    float_tile: tuple[int, int]    # float prefill's register tile (float_gemm.py): weight rows,
                                   # f32 lanes per vector (2 vectors of tokens), within the registers
    half: frozenset[str] | None    # features that make f16 -> f32 one instruction; None: never
    weight_sums: Callable | None = None   # (builder, n, ws): a signed dot's sum_w, once per block
    int16_pairs: bool = False      # unsigned pair sums are added in int16 before widening
                                   # (pair_dot then takes a scale to widen by: scaled_dot)
    tiles: frozenset[str] = frozenset()   # features of AMX tiles on top (amx.py); empty: none
    bf16_tiles: frozenset[str] = frozenset()   # features of AMX's bf16 tiles on top of those
                                   # (BF16 weights' prefill: float_gemm.amx_bf16_gemm)
    bf16_pairs: frozenset[str] = frozenset()   # features of vdpbf16ps on top (BF16 weights'
                                   # prefill: float_gemm.bf16_tile); empty: none
    lookup: Callable = _lookup_generic    # (builder, table, idx <m x i8>) -> <m x i8>: table[idx]
    word_dot: Callable = _word_dot_generic   # (builder, acc, a, b) -> <16 x i32>: int16 pair dots
    v_int16: bool = False          # a q8_0 V's weighted sum as word dots of int16 weights
                                   # (attention._weighted_i16) rather than f32 multiply-adds

    def dot(self, builder, n, pairs, signed, sum_w=None):
        """<n x i32>: per 32-bit lane, the sum over pairs of the 4 byte products (the
        lowering's conventions above); n twice the lanes goes as two halves."""
        if self.lanes is not None and n == 2 * self.lanes:
            half = lambda v, h: _half(builder, v, h, self.lanes)
            return _joined(builder, [self.dot(builder, self.lanes, [(half(w, h), x) for w, x in pairs],
                                              signed, None if sum_w is None else half(sum_w, h))
                                     for h in (0, 1)])
        return self.pair_dot(builder, n, pairs, signed, sum_w)

    def scaled_dot(self, builder, n, pairs, scale):
        """<n x i32>: scale (<n x i32>, |scale| <= 128) times the unsigned dot of pairs,
        exact (the caller keeps the pairs within pairs_per_dot); AVX2 multiplies in its
        widening, the others after the dot; n twice the lanes goes as two halves."""
        if self.lanes is not None and n == 2 * self.lanes:
            half = lambda v, h: _half(builder, v, h, self.lanes)
            return _joined(builder, [self.scaled_dot(builder, self.lanes, [(half(w, h), x) for w, x in pairs],
                                                     half(scale, h)) for h in (0, 1)])
        if self.int16_pairs:
            return self.pair_dot(builder, n, pairs, False, None, scale)
        return builder.mul(scale, self.pair_dot(builder, n, pairs, False, None))

    def sum_w(self, builder, n, ws):
        """What a signed dot of weights ws may take as its sum_w, once per block: the row's
        weight_sums (None where it has none); n twice the lanes goes as two halves."""
        if self.weight_sums is None:
            return None
        if self.lanes is not None and n == 2 * self.lanes:
            return _joined(builder, [self.weight_sums(builder, self.lanes,
                                                      [_half(builder, w, h, self.lanes) for w in ws])
                                     for h in (0, 1)])
        return self.weight_sums(builder, n, ws)

    def pairs_per_dot(self, wmax: int) -> int | None:
        """Unsigned pairs of weights up to wmax one dot may sum exactly: vpmaddubsw's
        int16 pair sums (2 wmax X_MAX each) added in int16 stay below 2^15; None: any."""
        return (2 ** 15 - 1) // (2 * wmax * X_MAX) if self.int16_pairs else None

    def half_native(self, features) -> bool:
        """Whether f16 -> f32 is one instruction (fp.half_to_float_ir's fpext): else the
        integer steps, as fpext would become a library call Numba cannot link."""
        return self.half is not None and self.half <= set(features)

    def has_tiles(self, features) -> bool:
        """Whether the AMX tile products (amx.py) can be compiled on top of this row."""
        return bool(self.tiles) and self.tiles <= set(features)

    def has_bf16_tiles(self, features) -> bool:
        """Whether BF16 prefill on AMX's tdpbf16ps (amx.py) can be compiled on top of this
        row: its tiles and their bf16 products."""
        return self.has_tiles(features) and bool(self.bf16_tiles) and self.bf16_tiles <= set(features)

    def has_bf16_pairs(self, features) -> bool:
        """Whether BF16 prefill's pair products (float_gemm.bf16_tile) can be compiled on
        top of this row."""
        return bool(self.bf16_pairs) and self.bf16_pairs <= set(features)


# f16 conversion without AVX2: F16C on x86, always on AArch64, else the integer steps
_GENERIC_HALF = {"x86_64": F16C, "i386": F16C, "i686": F16C,
                 "aarch64": frozenset(), "arm64": frozenset()}.get(ARCH)

# Plainest first: target_isa takes the last row whose needs the target has, so a new
# row goes after those it beats and before those that beat it (the names below keep
# the indices the intrinsics take).
ISAS = (
    Isa("generic", frozenset(), _dot_generic, lanes=None, rows=(8, 8), float_tile=(6, 4),
        half=_GENERIC_HALF),
    # AVX2 decode too takes a strip's 16 rows at once, as two halves of 8, to read each
    # line of a record once and load x once (1B Q4_0 matvec, one thread: 1.25x the bytes/s
    # of 8 rows); prefill's 4 tokens of 16 rows would not fit AVX2's 16 registers (0.75x)
    Isa("AVX2 (vpmaddubsw)", frozenset({"avx2"}), _dot_avx2, lanes=8, rows=(16, 8),
        float_tile=(6, 8), half=F16C, int16_pairs=True, lookup=_pshufb(32, "llvm.x86.avx2.pshuf.b")),
    # AVX-VNNI (Intel's client cores since Alder Lake: AVX2 and 256-bit vpdpbusd, no
    # AVX-512): AVX2's shapes, its pair-dot one instruction with no int16 bound
    Isa("AVX-VNNI (vpdpbusd)", frozenset({"avx2", "avxvnni"}), _dot_vnni, lanes=8, rows=(16, 8),
        float_tile=(6, 8), half=F16C, weight_sums=_vnni_sum_w, lookup=_pshufb(32, "llvm.x86.avx2.pshuf.b")),
    Isa("AVX-512 VNNI (vpdpbusd)", frozenset({"avx512vnni", "avx512bw"}), _dot_vnni, lanes=16,
        rows=(16, 16), float_tile=(12, 16), half=F16C, weight_sums=_vnni_sum_w,
        tiles=frozenset({"amx-tile", "amx-int8"}), bf16_tiles=frozenset({"amx-bf16"}),
        bf16_pairs=frozenset({"avx512bf16"}),
        lookup=_pshufb(64, "llvm.x86.avx512.pshuf.b.512"),
        word_dot=_word_dot_vnni, v_int16=True),
)
GENERIC, AVX2, AVX_VNNI, VNNI512 = 0, 1, 2, 3   # indices into ISAS: the intrinsics' isa constant
ISA_NAMES = {i: row.name for i, row in enumerate(ISAS)}


def target_isa(features) -> int:
    """The index in ISAS of the best row a target with these features can run."""
    return max(i for i, row in enumerate(ISAS) if row.needs <= set(features))
