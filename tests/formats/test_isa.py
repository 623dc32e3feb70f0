"""isa.py's table: every row has what the kernels use, lowers its pair-dot with no more
than the features it needs, and the choice from a feature set is the one the kernels
made before the table (VNNI needs BW's bytes too, AVX-VNNI AVX2 too, AVX2 alone, else generic; f16 in one
instruction with F16C and AVX on x86; AMX tiles (with their bf16 products) and AVX512_BF16's pair products on top
of the VNNI row)."""
import ctypes

import llvmlite.binding as llvm
import numpy as np
import pytest
from llvmlite import ir

from edgellama.kernels import isa
from edgellama.kernels.isa import AVX2, AVX_VNNI, GENERIC, ISA_NAMES, ISAS, VNNI512, target_isa
from edgellama.kernels.simd import RECORD_ROWS, TOKENS
from edgellama.kernels.target import BF16_PAIRS, FEATURES, HALF_NATIVE, ISA, TARGET

ROWS = [pytest.param(row, id=row.name) for row in ISAS]


@pytest.mark.parametrize("row", ROWS)
def test_every_row_has_what_the_kernels_use(row):
    assert row.name and ISA_NAMES[ISAS.index(row)] == row.name
    assert isinstance(row.needs, frozenset) and isinstance(row.tiles, frozenset)
    assert isinstance(row.bf16_pairs, frozenset) and isinstance(row.bf16_tiles, frozenset)
    assert row.half is None or isinstance(row.half, frozenset)
    assert callable(row.pair_dot) and (row.weight_sums is None or callable(row.weight_sums))
    assert callable(row.word_dot) and isinstance(row.v_int16, bool)
    # the tile intrinsics take rows[0] rows a vector for one token, rows[1] for TOKENS,
    # whole vectors of a strip; dot takes its lanes or twice them (attention: 16)
    assert len(row.rows) == 2 and TOKENS > 1
    for n in (*row.rows, 16):
        assert RECORD_ROWS % n == 0
        assert row.lanes is None or n in (row.lanes, 2 * row.lanes)
    # float prefill's register tile (float_gemm.py): MR rows x 2 vectors of accumulators,
    # 2 vectors of x and a broadcast within the registers (32 with 16 f32 lanes, else 16)
    mr, lanes = row.float_tile
    assert mr > 0 and lanes in (4, 8, 16) and 2 * mr + 3 <= (32 if lanes == 16 else 16)
    # the unsigned callers' bounds: 8 nibble, 4 five-bit, 2 six-bit pairs a dot (or all)
    bounds = [row.pairs_per_dot(w) for w in (15, 31, 63)]
    assert bounds == ([8, 4, 2] if row.int16_pairs else [None] * 3)


def _lowered(row, n, signed):
    """The machine code of row.dot over two pairs for a target with just row.needs."""
    i32 = ir.IntType(32)
    wide = ir.VectorType(i32, n)
    m = ir.Module()
    fn = ir.Function(m, ir.FunctionType(wide, [wide, wide, i32, i32]), "f")
    b = ir.IRBuilder(fn.append_basic_block())
    w0, w1, x0, x1 = fn.args
    sum_w = row.sum_w(b, n, [w0, w1]) if signed else None
    b.ret(row.dot(b, n, [(w0, x0), (w1, x1)], signed, sum_w))
    return _assembled(m, row)


def _assembles_here(row):
    """Skip unless this LLVM's host has row's features (rows of another architecture are
    checked where they run); else ready the native assembler."""
    if not row.needs <= set(llvm.get_host_cpu_features()):
        pytest.skip(f"{row.name}: features of another architecture")
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()


def _assembled(module, row):
    """The machine code of an IR module for a target with just row.needs."""
    parsed = llvm.parse_assembly(str(module))
    parsed.verify()
    tm = llvm.Target.from_default_triple().create_target_machine(
        cpu="generic", features=",".join("+" + f for f in sorted(row.needs)))
    return tm.emit_assembly(parsed)


@pytest.mark.parametrize("row", ROWS)
def test_every_row_lowers_with_only_the_features_it_needs(row):
    # LLVM aborts the process on an intrinsic its target lacks: a row whose dot used more
    # than its needs would kill every run on a CPU with just those.
    _assembles_here(row)
    for n in sorted({*row.rows, 16}):
        for signed in (False, True):
            asm = _lowered(row, n, signed)
            if "(" in row.name:     # the instruction its reports name, e.g. vpdpbusd
                assert row.name.split("(")[1].rstrip(")") in asm


def _lowered_lookup(row, m):
    """The machine code of row.lookup of m index bytes, for a target with just row.needs."""
    vt = ir.VectorType(ir.IntType(8), m)
    mod = ir.Module()
    fn = ir.Function(mod, ir.FunctionType(vt, [vt]), "f")
    b = ir.IRBuilder(fn.append_basic_block())
    b.ret(row.lookup(b, list(range(-8, 8)), fn.args[0]))
    return _assembled(mod, row)


@pytest.mark.parametrize("row", ROWS)
def test_every_row_lowers_its_lookup_with_only_the_features_it_needs(row):
    # IQ4's 16-entry lookup at the widths blocks_gemm (4 bytes a row: 32, 64) and the AMX
    # B tiles (64) take; x86's rows in pshufb, one per vector
    _assembles_here(row)
    for m in sorted({4 * n for n in row.rows} | {64}):
        asm = _lowered_lookup(row, m)
        if row.lanes is not None:
            assert asm.count("pshufb") == -(-m // (4 * row.lanes))


def _word_dot_module(row):
    """f(acc, a, b, out: i32*): out[:16] = row.word_dot(acc, a, b), vectors of 16 int32."""
    i32 = ir.IntType(32)
    wide, ptr = ir.VectorType(i32, 16), ir.PointerType(i32)
    m = ir.Module()
    fn = ir.Function(m, ir.FunctionType(ir.VoidType(), [ptr] * 4), "f")
    b = ir.IRBuilder(fn.append_basic_block())
    acc, x, y = (b.load(b.bitcast(p, wide.as_pointer()), align=4) for p in fn.args[:3])
    b.store(row.word_dot(b, acc, x, y), b.bitcast(fn.args[3], wide.as_pointer()), align=4)
    b.ret_void()
    return m


@pytest.mark.parametrize("row", ROWS)
def test_every_row_word_dot_is_exact_with_only_the_features_it_needs(row):
    # attention's q8_0 V: per int32 lane, acc + the two int16 products, at the extremes its
    # caller reaches (weights up to 32767, V bytes -128..127), run where the CPU can
    _assembles_here(row)
    m = _word_dot_module(row)
    asm = _assembled(m, row)
    if row.v_int16:         # attention sums a q8_0 V with it: one instruction
        assert "vpdpwssd" in asm
    if not row.needs <= FEATURES:
        pytest.skip(f"{row.name}: Numba's target lacks its instructions")
    parsed = llvm.parse_assembly(str(m))
    tm = llvm.Target.from_default_triple().create_target_machine(
        cpu="generic", features=",".join("+" + f for f in sorted(row.needs)))
    engine = llvm.create_mcjit_compiler(parsed, tm)
    engine.finalize_object()
    f = ctypes.CFUNCTYPE(None, *[ctypes.c_void_p] * 4)(engine.get_function_address("f"))
    rng = np.random.default_rng(7)
    for _ in range(20):
        acc = rng.integers(-2**30, 2**30, 16, dtype=np.int32)
        a = rng.integers(-128, 128, 32).astype(np.int16)
        b = rng.integers(0, 32768, 32).astype(np.int16)
        a[:2], b[:2] = -128, 32767
        out = np.empty(16, np.int32)
        f(*(v.ctypes.data for v in (acc, a, b, out)))
        ref = acc.astype(np.int64) + (a.astype(np.int64) * b).reshape(16, 2).sum(1)
        np.testing.assert_array_equal(out, ref)


@pytest.mark.parametrize("features,want", [
    (set(), GENERIC),
    ({"sse4.2", "avx", "fma", "f16c"}, GENERIC),
    ({"avx", "avx2", "fma"}, AVX2),
    ({"avx2", "avx512f", "avx512bw"}, AVX2),                  # Skylake-X: no VNNI
    ({"avx2", "avx512f", "avx512vnni"}, AVX2),                # VNNI without BW's bytes
    ({"avx2", "avx512f", "avx512bw", "avx512vnni"}, VNNI512),
    ({"avx", "avx2", "fma", "f16c", "avxvnni"}, AVX_VNNI),     # Alder Lake and later clients
    ({"avx2", "avxvnni", "avx512f", "avx512bw", "avx512vnni"}, VNNI512),   # Sapphire Rapids
    ({"avx512bw", "avx512vnni", "amx-tile", "amx-int8"}, VNNI512),
])
def test_the_choice_from_features_is_as_before_the_table(features, want):
    assert target_isa(features) == want


@pytest.mark.parametrize("features", [set(), {"avx"}, {"f16c"}, {"avx", "f16c"},
                                      {"avx2", "f16c", "avx"}, {"avx2", "avx"},
                                      {"avx512vnni", "avx512bw", "avx", "f16c"},
                                      {"avx512vnni", "avx512bw", "avx2"}, {"avx2", "avxvnni", "avx", "f16c"}])
def test_half_conversion_and_tiles_as_before_the_table(features):
    row = ISAS[target_isa(features)]
    if isa.ARCH in ("x86_64", "i386", "i686"):
        assert row.half_native(features) == ({"f16c", "avx"} <= features)
    elif isa.ARCH in ("aarch64", "arm64"):
        assert row.half_native(features)
    amx = {"amx-tile", "amx-int8"}
    assert not row.has_tiles(features)
    assert row.has_tiles(features | amx) == (target_isa(features | amx) == VNNI512)
    # AMX's bf16 tiles only with the tiles, on the VNNI row
    assert not row.has_bf16_tiles(features | {"amx-bf16"})
    assert row.has_bf16_tiles(features | amx | {"amx-bf16"}) == (target_isa(features | amx) == VNNI512)
    # BF16 prefill's pair products likewise on top of the VNNI row only
    assert not row.has_bf16_pairs(features)
    assert (row.has_bf16_pairs(features | {"avx512bf16"})
            == (target_isa(features | {"avx512bf16"}) == VNNI512))


def test_this_target_is_the_tables_choice():
    assert TARGET is ISAS[ISA] and ISA == target_isa(FEATURES)
    assert HALF_NATIVE == TARGET.half_native(FEATURES)
    assert BF16_PAIRS == TARGET.has_bf16_pairs(FEATURES)
    from edgellama.kernels import amx
    assert amx.BF16_COMPILED == (TARGET.has_bf16_tiles(FEATURES) and isa.ARCH == "x86_64")
