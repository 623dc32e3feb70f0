"""Linear kernels vs a plain NumPy twin: dequantize with gguf-py, then x @ W.T (float64).

Tolerance: every kernel sums float32 products, so the error of one output is at most
about n * eps32 * sum_i |w_i x_i| (worst case), typically far less: we allow
64 * eps32 * (|W| @ |x|), a bound that does not grow with these small n.

The Q4_0 / Q4_1 / Q8_0 matvec also rounds x to int8 per block of 32 (scale amax/127, as
llama.cpp does for its q8_0 activations): each x_i moves by at most amax_b / 254, so
the output moves by at most sum_i |w_i| amax_b(i) / 254; that bound is added, and the
test checks that the error really is that small and that the rest is exact.
"""
import mmap

import format_cases as fc
import numpy as np
import pytest
from format_cases import check
from gguf import GGMLQuantizationType as G
from gguf.quants import dequantize, quantize

from edgellama.formats import linear

TYPES = [G.F32, G.F16, G.BF16, G.Q4_0, G.Q4_1, G.Q8_0]
# (out, in): out not a multiple of any tile size (tiles of 16 to 256 rows), in = 32 k
SHAPES = [(300, 64), (37, 32), (8, 96), (1030, 160), (2000, 32)]


def make(type_, shape, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape).astype(np.float32)
    w[0, :] *= 1e-6              # tiny scales: f16 subnormal block scales
    data = quantize(w, type_)    # uint8 (out, row bytes) as stored in a GGUF file
    ref = dequantize(data, type_).astype(np.float64).reshape(shape)
    data.setflags(write=False)
    return linear(int(type_), [(data, shape)]), ref


@pytest.mark.parametrize("type_", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matvec(type_, shape):
    lin, ref = make(type_, shape)
    assert (lin.out_features, lin.in_features, lin.type_name) == (*shape, type_.name)
    x = np.random.default_rng(1).standard_normal(shape[1]).astype(np.float32)
    out = np.full(shape[0], np.nan, np.float32)
    lin.matvec(x, out)
    check(out, ref, x, x_quantized=type_ in (G.Q4_0, G.Q4_1, G.Q8_0))


@pytest.mark.parametrize("type_", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("T", [1, 7])
def test_matmul(type_, T, monkeypatch):
    lin, ref = make(type_, (300, 64))
    fc.check_matmul(lin, ref, T, monkeypatch, x_quantized=type_ in (G.Q4_0, G.Q4_1, G.Q8_0))


@pytest.mark.parametrize("type_", TYPES, ids=lambda t: t.name)
def test_rows(type_):
    lin, ref = make(type_, (300, 64))
    fc.check_rows(lin, ref, bits=False)     # Q4_0's rows: q d - 8 d, +0.0 where gguf has -0.0


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


@pytest.mark.parametrize("type_", TYPES, ids=lambda t: t.name)
def test_stacked(type_):
    # q/k/v-like parts, none a multiple of the tile size: one W, outputs split back
    datas = [quantize(np.random.default_rng(i).standard_normal((s, 96)).astype(np.float32), type_)
             for i, s in enumerate((150, 37, 37))]
    lin = linear(int(type_), [(d, d.shape[:1] + (96,)) for d in datas])
    ref = np.concatenate([dequantize(d, type_).astype(np.float64).reshape(-1, 96) for d in datas])
    assert lin.out_features == 224 and lin.nbytes == sum(d.nbytes for d in datas)
    x = np.random.default_rng(5).standard_normal(96).astype(np.float32)
    out = np.full(224, np.nan, np.float32)
    lin.matvec(x, out)
    check(out, ref, x, x_quantized=type_ in (G.Q4_0, G.Q4_1, G.Q8_0))
    assert [o.shape for o in lin.split(out)] == [(150,), (37,), (37,)]
    xs = np.random.default_rng(6).standard_normal((3, 96)).astype(np.float32)
    outs = np.full((3, 224), np.nan, np.float32)
    lin.matmul(xs, outs)
    check(outs, ref, xs, x_quantized=type_ in (G.Q4_0, G.Q4_1, G.Q8_0))
    assert lin.split(outs)[2].shape == (3, 37)


def test_nbytes_and_bad_size():
    lin, _ = make(G.Q4_0, (300, 64))
    assert lin.nbytes == 300 * 2 * 18
    with pytest.raises(ValueError):
        linear(int(G.Q4_0), [(np.zeros(10, np.uint8), (300, 64))])


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
