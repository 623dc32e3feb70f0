"""The per-32-block record formats (Q4_0, Q4_1, Q8_0; every format's Linear is checked
against its NumPy twin in test_conformance.py): decode exact when x is on the
int8 grid, and the file's pages released after the repack; the float types' decode
at either count of rows side by side.
"""
import mmap

import numpy as np
import pytest
from format_cases import check
from gguf import GGMLQuantizationType as G
from gguf.quants import dequantize, quantize
from numba import njit

from edgellama.formats import floats, linear


def make(type_, shape, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape).astype(np.float32)
    w[0, :] *= 1e-6              # tiny scales: f16 subnormal block scales
    data = quantize(w, type_)    # uint8 (out, row bytes) as stored in a GGUF file
    ref = dequantize(data, type_).astype(np.float64).reshape(shape)
    data.setflags(write=False)
    return linear(int(type_), [(data, shape)]), ref


def test_int8_activation_quantization_is_exact_on_grid():
    # x already on the int8 grid of each block (amax = 127 * 2^k): no rounding, so the
    # integer block sums must give the float answer to float32 summation accuracy.
    shape = (300, 256)
    rng = np.random.default_rng(3)
    x = rng.integers(-127, 128, shape[1]).astype(np.float32)
    x[::32] = 127
    x *= np.float32(2.0 ** -5)
    for t in (G.Q4_0, G.Q4_1, G.Q8_0):
        lin, ref = make(t, shape)
        out = np.empty(shape[0], np.float32)
        lin.matvec(x, out)
        check(out, ref, x)


def _rss_file():
    # resident pages of file mappings in this process (bytes)
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("RssFile:"))


def test_repack_releases_file_pages(tmp_path):
    # Weights read from a file mmap are repacked; the mapping's pages are dropped from
    # the process but the data stays intact in the file and in the tiles.
    shape = (1024, 4096)
    make(G.Q4_0, (64, 64))       # JIT / cache load outside the RSS window
    data = quantize(np.random.default_rng(0).standard_normal(shape).astype(np.float32), G.Q4_0)
    path = tmp_path / "w.bin"
    path.write_bytes(b"\0" * 100 + data.tobytes())
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    view = np.frombuffer(mm, np.uint8, count=data.size, offset=100)
    assert int(view.sum()) == int(data.sum())                 # all pages now resident
    rss0 = _rss_file()
    lin = linear(int(G.Q4_0), [(view, shape)])
    assert rss0 - _rss_file() > data.nbytes // 2              # the file's pages are out
    np.testing.assert_array_equal(view, data.reshape(-1))   # refaults from the file
    x = np.ones(shape[1], np.float32)
    out = np.zeros(shape[0], np.float32)
    lin.matvec(x, out)
    check(out, dequantize(data, G.Q4_0).astype(np.float64), x, x_quantized=True)
    del view
    mm.close()


@pytest.mark.parametrize("streams", [1, 4])
@pytest.mark.parametrize("kind", [0, 1, 2])
def test_float_decode_rows_side_by_side_give_the_product(monkeypatch, streams, kind):
    """The float types' decode takes DECODE_STREAMS rows side by side (a CPU's choice):
    either count gives W x, over 37 rows (9 groups of 4 and one left). Compiled afresh
    with the count patched in, as Numba freezes a global when it compiles."""
    monkeypatch.setattr(floats, "DECODE_STREAMS", streams)
    fn = njit(fastmath=True, parallel=True)(floats.matvec_float.py_func)
    rng = np.random.default_rng(kind)
    w32 = rng.standard_normal((37, 320)).astype(np.float32)
    x = rng.standard_normal(320).astype(np.float32)
    w = [w32, w32.astype(np.float16).view(np.uint16),
         (w32.view(np.uint32) >> 16).astype(np.uint16)][kind]
    ref = [w32, w32.astype(np.float16).astype(np.float32),
           (w32.view(np.uint32) & 0xFFFF0000).view(np.float32)][kind].astype(np.float64) @ x
    out = np.full(37, np.nan, np.float32)
    fn(w, x, out, kind)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


@pytest.mark.parametrize("type_", [G.Q4_1, G.Q4_K, G.Q6_K])
def test_a_column_slice_of_the_output_gets_the_rows_a_whole_output_does(type_):
    # stacked projections of different types write column slices of one output (not
    # C-ordered): through a scratch, the same numbers, and the kernels see C-ordered rows
    # alone (one compile each, not one per layout)
    from edgellama.formats import q4_k, q6_k, quantize as ours, records
    w = np.random.default_rng(4).standard_normal((48, 512)).astype(np.float32)
    lin = linear(int(type_), [(ours(w, type_.name).reshape(48, -1), w.shape)])
    x = np.random.default_rng(5).standard_normal((20, 512)).astype(np.float32)
    whole = np.empty((20, 48), np.float32)
    lin.matmul(x, whole)
    stacked = np.full((20, 100), np.float32(7))
    lin.matmul(x, stacked[:, 30:78])
    assert np.array_equal(stacked[:, 30:78], whole)
    assert (stacked[:, :30] == 7).all() and (stacked[:, 78:] == 7).all()
    kernels = [*records.MATMUL_BLOCKS.values(), *q4_k.MATMUL_K.values(), *q6_k.MATMUL_K16.values()]
    outs = [sig[5] for k in kernels for sig in k.signatures]         # matmul's out
    assert outs and all(t.layout == "C" for t in outs)


@pytest.mark.parametrize("type_", [G.Q5_K, G.Q6_K, G.Q3_K, G.Q4_K])
def test_a_long_prompt_gets_the_bits_of_short_ones(type_):
    # a product of VALUES_MIN_ROWS rows of x or more unpacks each tile's values once, a
    # window of rows at a time (8192 columns: windows of 32 rows, several a tile, the last
    # tile's partly padding), where short ones rebuild them per group of TOKENS rows: the
    # same integer sums, so the same bits, row for row (Q4_K keeps rebuilding: a check of
    # the dispatch)
    from edgellama.formats import quantize as ours, records
    rng = np.random.default_rng(6)
    shape = (520, 8192)
    pool = ours(rng.standard_normal((64, shape[1])).astype(np.float32), type_.name).reshape(64, -1)
    lin = linear(int(type_), [(pool[rng.integers(0, 64, shape[0])], shape)])      # 64 rows, shuffled
    assert lin.R > records.values_rows(lin.R, shape[1]) and shape[0] % lin.R
    T = 3 * records.VALUES_MIN_ROWS + 5
    x = rng.standard_normal((T, shape[1])).astype(np.float32)
    long_ = np.empty((T, shape[0]), np.float32)
    lin.matmul(x, long_)
    short = np.empty_like(long_)
    step = records.VALUES_MIN_ROWS - 1
    for t0 in range(0, T, step):
        lin.matmul(x[t0:t0 + step], short[t0:t0 + step])
    np.testing.assert_array_equal(long_, short)
    assert np.isfinite(long_).all() and np.abs(long_).max() > 1
