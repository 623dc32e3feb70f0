"""float_gemm.py, the products of F32 / F16 / BF16 weights. Prefill's GEMM: its products
against float64 NumPy within the error bound of an f32 sum in any order, over shapes that
leave partial register tiles, row blocks, column steps and token panels; the same bits
whatever the thread count; its register tile on its own; every instruction set's tile
shape, run here; BF16 on the pair products (x rounded as ggml rounds it, where the CPU
has AVX512_BF16) and on AMX-BF16 tiles (where it has those). Decode's row dot: exact
where every sum is, within the bound elsewhere."""
from types import FunctionType

import numba
import numpy as np
import pytest

from format_cases import bf16_round

from edgellama.kernels import float_gemm as fg
from edgellama.kernels.float_gemm import K_STEP, LANES, MR, PANEL, ROWS, float_tile
from edgellama.kernels.isa import ISAS
from edgellama.kernels.target import BF16_PAIRS, TARGET

EPS = np.finfo(np.float32).eps


def _weights(rng, d, n, kind):
    """(the weights as float_gemm takes them, the same values as f64)."""
    w = rng.standard_normal((d, n), dtype=np.float32)
    w[0, :5] = [0.0, -0.0, 6e-8, -3e-5, 1.5e4]          # f16 subnormals and a large one
    if kind == 0:
        return w, w.astype(np.float64)
    if kind == 1:
        h = w.astype(np.float16)
        return h.view(np.uint16), h.astype(np.float64)
    b = (w.view(np.uint32) >> 16).astype(np.uint16)       # bf16: the top half
    return b, (b.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _gemm(w, kind, x, parts=1, mr=MR, lanes=LANES):
    """float_gemm with scratch of NaNs (no reliance on zeros) for a tile of mr x lanes."""
    T, n = x.shape
    threads = numba.config.NUMBA_NUM_THREADS
    panel = 2 * lanes
    P = -(-T // panel)
    out = np.full((T, w.shape[0]), np.nan, np.float32)
    xp = np.full((P, n, panel), np.nan, np.float32)
    wb = np.full((threads, 8 * mr, K_STEP), np.nan, np.float32)
    acc = np.full((threads, 8 * mr, P * panel), np.nan, np.float32)
    fg.float_gemm(w, kind, x, out, xp, wb, acc, np.zeros(1, np.int64), parts)
    return out


def _check(out, x, wf):
    """|out - x wf^T| within n eps sum |x w| (the bound of any order of f32 sums; a
    dropped or doubled column would be about n times past it)."""
    n = x.shape[1]
    ref = x.astype(np.float64) @ wf.T
    bound = n * EPS * (np.abs(x.astype(np.float64)) @ np.abs(wf).T)
    assert np.isfinite(out).all()
    assert (np.abs(out - ref) <= bound).all(), np.max(np.abs(out - ref) / bound)


# d: one row; a partial register tile; whole blocks and one more tile; a partial block
# n: under one column step; whole steps and a bit
# T: one token; under a vector; a vector; a vector and one (a panel's second vector
# partly padding); panels and a lone vector of the last
SHAPES = [(1, 64, 1), (MR + 1, 2 * K_STEP + 32, LANES - 1), (2 * ROWS + MR, K_STEP, LANES),
          (ROWS + 5, K_STEP + 96, LANES + 1), (3 * MR, 96, 2 * PANEL + LANES - 3)]


@pytest.mark.parametrize("kind", [0, 1, 2], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("d,n,T", SHAPES)
def test_float_gemm_matches_float64_within_the_bound(kind, d, n, T):
    rng = np.random.default_rng(d * n + T)
    w, wf = _weights(rng, d, n, kind)
    x = rng.standard_normal((T, n), dtype=np.float32)
    _check(_gemm(w, kind, x), x, wf)


@pytest.mark.parametrize("parts", [1, 2, 3])
def test_float_gemm_bits_depend_on_neither_threads_nor_token_runs(parts):
    rng = np.random.default_rng(7)
    w, wf = _weights(rng, 3 * ROWS + 7, K_STEP + 64, 1)
    x = rng.standard_normal((2 * PANEL + 3, K_STEP + 64), dtype=np.float32)
    before = numba.get_num_threads()
    try:
        outs = []
        for th in sorted({1, numba.config.NUMBA_NUM_THREADS}):
            numba.set_num_threads(th)
            outs.append(_gemm(w, 1, x, parts))
    finally:
        numba.set_num_threads(before)
    _check(outs[0], x, wf)
    assert all(np.array_equal(o, _gemm(w, 1, x)) for o in outs)


def test_token_parts_give_every_thread_work():
    assert fg.token_parts(16 * ROWS, 512, 8) == 1             # 16 blocks for 8 threads
    assert fg.token_parts(8 * ROWS, 512, 16) == 4
    assert fg.token_parts(ROWS, PANEL + 1, 16) == 2            # at most one a panel
    assert fg.token_parts(ROWS, 1, 16) == 1


@numba.njit
def _tile(w, kc, x, acc, vecs):
    if vecs == 2:
        float_tile(w, kc, x, acc, 2)
    else:
        float_tile(w, kc, x[:, :LANES], acc[:, :LANES], 1)


@pytest.mark.parametrize("vecs", [1, 2])
@pytest.mark.parametrize("kc", [0, 1, 37, K_STEP])
def test_float_tile_is_one_fused_chain_per_output(vecs, kc):
    # acc += w[:, :kc] @ x, each output a chain of fused multiply-adds over k in order:
    # every product of these small integers and their sums are exact in f32, so the
    # result is exact whatever the rounding; the lanes past vecs vectors are untouched
    rng = np.random.default_rng(kc)
    w = rng.integers(-8, 9, (MR, K_STEP)).astype(np.float32)
    x = rng.integers(-8, 9, (K_STEP, PANEL)).astype(np.float32)
    acc = rng.integers(-99, 99, (MR, PANEL)).astype(np.float32)
    want = acc.copy()
    cols = vecs * LANES
    want[:, :cols] += w[:, :kc] @ x[:kc, :cols]
    _tile(w, kc, x, acc, vecs)
    assert np.array_equal(acc, want)


def test_the_kernel_takes_the_targets_tile():
    # the tile's shape is the target row's (its fit to the registers: test_isa)
    assert (MR, LANES) == TARGET.float_tile and PANEL == 2 * LANES and ROWS % MR == 0


@pytest.mark.parametrize("row", [pytest.param(r, id=r.name) for r in ISAS])
def test_every_rows_tile_shape_gives_the_product(monkeypatch, row):
    # each instruction set's tile shape (isa.Isa.float_tile), compiled afresh here with
    # the shape patched in (Numba freezes globals when it compiles): LLVM splits vectors
    # wider than this CPU's, so the AVX-512 shape's arithmetic runs on any x86
    mr, lanes = row.float_tile
    for name, value in (("MR", mr), ("LANES", lanes), ("ROWS", 8 * mr), ("PANEL", 2 * lanes)):
        monkeypatch.setattr(fg, name, value)
    for f in ("pack_tokens", "_block"):
        monkeypatch.setattr(fg, f, numba.njit(parallel=f != "_block")(getattr(fg, f).py_func))
    # _gemm's items on the _block just made (its _item overload keeps the one it compiled)
    g = fg._gemm.py_func
    items_here = FunctionType(g.__code__, {**g.__globals__, "_item": fg._block}, g.__name__)
    monkeypatch.setattr(fg, "_gemm", numba.njit(parallel=True)(items_here))
    rng = np.random.default_rng(mr * lanes)
    d, n, T = 2 * 8 * mr + mr + 3, K_STEP + 32, 2 * 2 * lanes + lanes - 1
    w, wf = _weights(rng, d, n, 1)
    x = rng.standard_normal((T, n), dtype=np.float32)
    _check(_gemm(w, 1, x, 2, mr, lanes), x, wf)


# decode's row dot (float_row_dot, through floats.matvec_float, which adds the columns
# past its steps): lengths under one step, one step, steps and a rest, and a model's
ROW_LENGTHS = [7, fg.ROW_STEP, 3 * fg.ROW_STEP + 5, 2048]


@pytest.mark.parametrize("kind", [0, 1, 2], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("n", ROW_LENGTHS)
def test_float_row_dot_is_exact_where_every_sum_is(kind, n):
    """Small integer weights and x: every product and partial sum is an integer under
    2^24, so any order of f32 sums gives W x exactly; a column read twice, skipped or
    taken from the wrong row or accumulator would not."""
    from edgellama.formats.floats import matvec_float
    rng = np.random.default_rng(n + kind)
    d = 9
    wi = rng.integers(-8, 9, (d, n)).astype(np.float32)
    x = rng.integers(-8, 9, n).astype(np.float32)
    w = [wi, wi.astype(np.float16).view(np.uint16), (wi.view(np.uint32) >> 16).astype(np.uint16)][kind]
    out = np.full(d, np.nan, np.float32)
    matvec_float(w, x, out, kind)
    np.testing.assert_array_equal(out, wi.astype(np.int64) @ x.astype(np.int64))


@pytest.mark.parametrize("kind", [0, 1, 2], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("n", ROW_LENGTHS)
def test_float_row_dot_matches_float64_within_the_bound(kind, n):
    """Random weights (f16 subnormals and a large one in row 0): within the bound of
    any order of f32 sums, row by row against its float64 twin."""
    from edgellama.formats.floats import matvec_float
    rng = np.random.default_rng(100 + n + kind)
    w, wf = _weights(rng, 5, n, kind)
    x = rng.standard_normal((1, n)).astype(np.float32)
    out = np.full(5, np.nan, np.float32)
    matvec_float(w, x[0], out, kind)
    _check(out[None, :], x, wf)


# BF16 prefill on AVX512_BF16's pair products (bf16_gemm: x rounded to bf16 as llama.cpp
# rounds it for these weights)

def test_bf16_packing_rounds_as_ggml_and_pairs_the_columns():
    """pack_tokens_bf16 (runs on every CPU): ties to even either way, a carry into the
    exponent, the largest finite value rounding to inf, inf, NaN, signed zero; column
    2j in each word's low half and 2j + 1 in its high half; tokens past T zero."""
    special = np.array([1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, 1 - 2.0 ** -25, -(1 + 2.0 ** -8),
                        np.finfo(np.float32).max, np.inf, -np.inf, np.nan, -0.0, 1e-40],
                       np.float32)
    rng = np.random.default_rng(3)
    T, n = PANEL + 5, 2 * K_STEP + 6
    x = rng.standard_normal((T, n)).astype(np.float32)
    x[0, :special.size] = special
    x[3, 1:special.size + 1] = special
    xp2 = np.full((2, n // 2, PANEL), 0xDEADBEEF, np.uint32)
    fg.pack_tokens_bf16(x, xp2)
    lo = (xp2 & 0xFFFF).astype(np.uint32) << 16
    hi = xp2 & 0xFFFF0000
    got = np.empty((2 * PANEL, n), np.float32)
    got[:, 0::2] = lo.view(np.float32).transpose(0, 2, 1).reshape(2 * PANEL, n // 2)
    got[:, 1::2] = hi.view(np.float32).transpose(0, 2, 1).reshape(2 * PANEL, n // 2)
    want = np.zeros_like(got)
    want[:T] = bf16_round(x)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    assert got[0, 0] == 1 and got[0, 1] == 1 + 2.0 ** -6 and got[0, 2] == 1
    assert got[0, 4] == np.inf and np.isnan(got[0, 7])


def _bf16_gemm(w, x, parts=1):
    """bf16_gemm with scratch of NaN bits (no reliance on zeros)."""
    T, n = x.shape
    threads = numba.config.NUMBA_NUM_THREADS
    P = -(-T // PANEL)
    out = np.full((T, w.shape[0]), np.nan, np.float32)
    xp2 = np.full((P, n // 2, PANEL), 0x7FC07FC0, np.uint32)
    wb = np.full((threads, ROWS, K_STEP), np.nan, np.float32)
    acc = np.full((threads, ROWS, P * PANEL), np.nan, np.float32)
    fg.bf16_gemm(w, x, out, xp2, wb, acc, np.zeros(1, np.int64), parts)
    return out


needs_bf16_pairs = pytest.mark.skipif(not BF16_PAIRS, reason="this CPU has no AVX512_BF16 "
                                      "(the packing and the choice of path are tested everywhere)")


@needs_bf16_pairs
@pytest.mark.parametrize("d,n,T", SHAPES)
def test_bf16_gemm_matches_float64_of_the_rounded_x_within_the_bound(d, n, T):
    rng = np.random.default_rng(d * n + T + 1)
    w, wf = _weights(rng, d, n, 2)
    w[0, :5] = 0                            # the bf16 pair products flush subnormals
    wf[0, :5] = 0
    x = rng.standard_normal((T, n), dtype=np.float32)
    _check(_bf16_gemm(w, x), bf16_round(x), wf)


@needs_bf16_pairs
def test_bf16_gemm_is_exact_where_every_sum_is():
    """Small integers: the pair products and every partial sum are exact in f32, so a
    column, row or token misplaced anywhere would show."""
    rng = np.random.default_rng(11)
    d, n, T = 2 * ROWS + MR + 3, 2 * K_STEP + 34, 2 * PANEL + LANES - 3
    wi = rng.integers(-8, 9, (d, n)).astype(np.float32)
    x = rng.integers(-8, 9, (T, n)).astype(np.float32)
    w = (wi.view(np.uint32) >> 16).astype(np.uint16)
    for parts in (1, 2, 3):
        np.testing.assert_array_equal(_bf16_gemm(w, x, parts), x.astype(np.int64) @ wi.T.astype(np.int64))


# BF16 prefill on AMX-BF16 tiles (amx_bf16_gemm: the same rounded x, tdpbf16ps)

def _amx_bf16_gemm(w, x):
    """amx_bf16_gemm with scratch of NaN bits (no reliance on zeros)."""
    T, n = x.shape
    threads = numba.config.NUMBA_NUM_THREADS
    out = np.full((T, w.shape[0]), np.nan, np.float32)
    xt = np.full((fg.amx_tokens(T), n // 2, fg.AMX_BF16_TOKENS), 0x7FC07FC0, np.uint32)
    pads = np.full((threads, fg.amx_bf16_rows(n), n // 2), 0x7FC07FC0, np.uint32)
    cbs = np.full((threads, 4, 16, 16), np.nan, np.float32)
    fg.amx_bf16_gemm(w, x, out, xt, pads, cbs)
    return out


@pytest.fixture
def bf16_tiles():
    """AMX-BF16 on; skips where it cannot run (the CPU, Numba's target, Linux's permission)."""
    from edgellama.kernels import amx
    was = amx._enabled
    if not (amx.use(True) and amx.bf16_enabled()):
        amx._enabled = was
        pytest.skip("no AMX-BF16 tiles here (the CPU, Numba's target or Linux's permission)")
    yield amx
    amx._enabled = was


# rows: a whole block, rows past the last strip pair (a zero-padded copy), fewer than a
# strip; columns: one column block, a block of 128 rows, of 32 (8192 wide); tokens: fewer
# than a B tile, an odd number of groups, several pairs
AMX_SHAPES = [(40, 64, 5), (300, 256, 17), (129, 2048, 33), (7, 96, 70), (48, 8192, 16)]


@pytest.mark.parametrize("d,n,T", AMX_SHAPES)
def test_amx_bf16_gemm_is_exact_where_every_sum_is(d, n, T, bf16_tiles):
    """Small integers: products and partial sums exact in f32, so any row, column, token
    or tile misplaced would show."""
    rng = np.random.default_rng(d + n + T)
    wi = rng.integers(-8, 9, (d, n)).astype(np.float32)
    x = rng.integers(-8, 9, (T, n)).astype(np.float32)
    w = (wi.view(np.uint32) >> 16).astype(np.uint16)
    np.testing.assert_array_equal(_amx_bf16_gemm(w, x), x.astype(np.int64) @ wi.T.astype(np.int64))


@pytest.mark.parametrize("d,n,T", AMX_SHAPES)
def test_amx_bf16_gemm_matches_float64_of_the_rounded_x_within_the_bound(d, n, T, bf16_tiles):
    rng = np.random.default_rng(d * n + T + 3)
    w, wf = _weights(rng, d, n, 2)
    w[0, :5] = 0                            # the tiles flush subnormals, as the pair products
    wf[0, :5] = 0
    x = rng.standard_normal((T, n), dtype=np.float32)
    _check(_amx_bf16_gemm(w, x), bf16_round(x), wf)


def test_bf16_weights_take_the_tiles_unless_fine_or_off(bf16_tiles, monkeypatch):
    """A BF16 Linear's prefill runs on the tiles where they run (x rounded to bf16), on
    the pair products with AMX off, in f32 with fine; each within its own bound."""
    from edgellama.formats import linear
    import gguf
    rng = np.random.default_rng(13)
    d, n, T = 40, 256, 9
    w, wf = _weights(rng, d, n, 2)
    w[0, :5] = 0
    wf[0, :5] = 0
    lin = linear(int(gguf.GGMLQuantizationType.BF16), [(w.view(np.uint8), (d, n))])
    x = rng.standard_normal((T, n), dtype=np.float32)
    calls = []
    real = fg.amx_bf16_gemm
    monkeypatch.setattr(fg, "amx_bf16_gemm", lambda *a: (calls.append(1), real(*a)))
    out = np.empty((T, d), np.float32)
    lin.matmul(x, out)
    assert calls == [1]
    _check(out, bf16_round(x), wf)
    bf16_tiles._enabled = False
    out[:] = np.nan
    lin.matmul(x, out)
    assert calls == [1]
    _check(out, bf16_round(x), wf)
    lin.fine = True
    bf16_tiles._enabled = True
    lin.matmul(x, out)
    assert calls == [1]
    _check(out, x, wf)


@needs_bf16_pairs
def test_bf16_weights_take_the_pair_products_unless_fine(monkeypatch):
    """A BF16 Linear's prefill without AMX: x rounded to bf16 by default (the pair
    products), in f32 with fine (the float GEMM), each within its own bound and not the
    other's."""
    from edgellama.formats import linear
    from edgellama.kernels import amx
    import gguf
    monkeypatch.setattr(amx, "_enabled", False)
    monkeypatch.setattr(fg, "amx_bf16_gemm", None)       # never called
    rng = np.random.default_rng(12)
    d, n, T = 40, K_STEP + 64, 9
    w, wf = _weights(rng, d, n, 2)
    w[0, :5] = 0
    wf[0, :5] = 0
    lin = linear(int(gguf.GGMLQuantizationType.BF16), [(w.view(np.uint8), (d, n))])
    x = rng.standard_normal((T, n), dtype=np.float32)
    out = np.empty((T, d), np.float32)
    lin.matmul(x, out)
    _check(out, bf16_round(x), wf)
    assert not np.allclose(out, x.astype(np.float64) @ wf.T, rtol=0, atol=1e-5)
    lin.fine = True
    lin.matmul(x, out)
    _check(out, x, wf)
