"""Q4_K and Q5_K, the K-quants with 6-bit sub-block scales and mins, against ggml and gguf-py.

- quantize: bit-exact with ggml's quantize_row_q{4,5}_K_ref (what llama-quantize writes
  without an importance matrix): ggml's bytes saved as golden files (tests/data/ggml_golden)
  are compared in every run; with llama-cpp-python installed, the live library also checks
  those files and more and larger inputs. Regenerate the files with
  `python tests/test_k_scales6.py` (needs llama-cpp-python).
- dequantize: bit-exact with gguf-py, on ggml's bytes and on random bytes.
- runtime Linear: matvec, matmul, rows and the prefill tiles against gguf-py's dequantized
  W; the decode kernels' int16 sums at their bounds.

The inputs are made with exact integer arithmetic (no RNG stream, no libm), so the golden
files' inputs are the same on every machine and NumPy version.
"""
import sys
from pathlib import Path

import ggml_oracle
import numpy as np
import pytest
from format_cases import EPS, live, normalish, u24
from gguf import GGMLQuantizationType as G
from gguf.quants import Q4_K as GQ4_K
from gguf.quants import dequantize as ref_dequantize

from edgellama.formats import base
from edgellama.formats.q4_k import Q4_K
from edgellama.formats.q5_k import Q5_K

FMTS = {"Q4_K": Q4_K, "Q5_K": Q5_K}
NMAX = {"Q4_K": 15, "Q5_K": 31}


# --- inputs ----------------------------------------------------------------------------

def uniform(shape, seed: int, lo: float, hi: float) -> np.ndarray:
    u = u24(int(np.prod(shape)), seed) * 2.0 ** -24
    return (lo + (hi - lo) * u).reshape(shape).astype(np.float32)


def edge_rows() -> np.ndarray:
    """One super-block per row, each a path through the quantizer."""
    n = 256
    z = normalish((14, n), 7).astype(np.float64)
    ramp = np.arange(n) / 255.0
    rows = [np.zeros(n), np.full(n, -0.0), np.full(n, 0.37), np.full(n, -0.37),
            np.abs(z[0]) + 0.5,                          # all positive: min clamps to 0
            -np.abs(z[1]) - 0.5,                         # all negative
            2 * ramp - 1, 3 + ramp]
    r = z[2] * 0.01
    r[77] = 1e3                                          # one outlier
    rows.append(r)
    r = z[3].copy()
    for j in range(8):                                   # sub-blocks 2^-12 .. 2^9 apart:
        r[32 * j:32 * j + 32] *= 2.0 ** (3 * j - 12)     # small ones get sc = 0 or m = 0
    rows.append(r)
    r = z[4].copy()
    r[64:96] = 0                                         # one all-zero sub-block
    rows.append(r)
    r = z[5].copy()
    r[::2] = 0                                           # half zeros
    rows.append(r)
    rows += [z[6] * s for s in (1e-30, 1e-39, 1e-44)]    # f16-underflowing d, denormals
    rows.append(np.round(z[7] * 4) / 4)                  # values on a grid
    rows.append(np.where(z[8] > 0, 2.0 ** -20, -2.0 ** -20))
    r = z[9].copy()
    r[[3, 40, 90, 200]] = 2.5
    r[[9, 41, 91, 201]] = -2.5                           # ties for the extremes
    rows.append(r)
    rows.append(z[10] * 3e4)                             # large values
    rows.append(np.abs(z[11]) + 1e4)                     # large mins: dmin near its range
    r = z[12].copy()
    r[:128] = np.abs(r[:128]) + 2                        # positive half, mixed half
    rows.append(r)
    rows.append(np.repeat(z[13, :32], 8))                # repeated values
    return np.array(rows, np.float32)


def random_scaled(rows: int, n: int, seed: int) -> np.ndarray:
    """Sub-blocks with scales 2^-10 .. 2^10 apart and offsets of either sign (many scale
    and min codes, both top bits)."""
    shape = (rows, n // 32, 1)
    x = normalish((rows, n // 32, 32), seed).astype(np.float64)
    scale = 2.0 ** (u24(rows * n // 32, seed + 1) % 21 - 10).reshape(shape)
    shift = uniform(shape, seed + 2, -3, 3) * (u24(rows * n // 32, seed + 3).reshape(shape) % 2)
    return ((x + shift) * scale).reshape(rows, n).astype(np.float32)


CASES = {"random": lambda: normalish((24, 1024), 1),
         "scaled": lambda: random_scaled(32, 512, 2),
         "edge": edge_rows}


def quantize(x: np.ndarray, name: str) -> np.ndarray:
    f = FMTS[name]
    out = np.empty(x.size // 256 * f.type_size, np.uint8)
    bad, over = f.quantize(np.ascontiguousarray(x, np.float32).reshape(-1), out)
    assert (bad, over) == (0, 0)
    return out.reshape(x.shape[0], -1)


def dequantize(q: np.ndarray, name: str) -> np.ndarray:
    out = np.empty(q.size // FMTS[name].type_size * 256, np.float32)
    FMTS[name].dequantize(np.ascontiguousarray(q).reshape(-1), out)
    return out.reshape(q.shape[0], -1)


# --- quantize ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", FMTS)
@pytest.mark.parametrize("case", CASES)
def test_quantize_matches_ggml_golden(name, case):
    x = CASES[case]()
    golden = ggml_oracle.load_golden(name, case, x.shape)
    assert golden is not None, f"missing golden file: run `python {__file__}` with llama-cpp-python"
    np.testing.assert_array_equal(quantize(x, name), golden)


@live
@pytest.mark.parametrize("name", FMTS)
def test_golden_files_are_ggml_today(name):
    for case, make in CASES.items():
        x = make()
        np.testing.assert_array_equal(ggml_oracle.quantize(x, name),
                                      ggml_oracle.load_golden(name, case, x.shape))


@live
@pytest.mark.parametrize("name", FMTS)
@pytest.mark.parametrize("seed", [11, 12, 13])
def test_quantize_matches_ggml_live(name, seed):
    x = np.concatenate([normalish((64, 2048), seed),
                        random_scaled(256, 2048, seed + 100),
                        uniform((64, 2048), seed + 200, -1, 1) * 1e-3,
                        np.tile(edge_rows(), (1, 8))])
    np.testing.assert_array_equal(quantize(x, name), ggml_oracle.quantize(x, name))


@live
@pytest.mark.parametrize("name", FMTS)
def test_large_but_representable_matches_ggml(name):
    x = normalish((4, 512), 21) * 3e5                    # d, dmin up to ~2e4 (f16 max 65504)
    np.testing.assert_array_equal(quantize(x, name), ggml_oracle.quantize(x, name))


@pytest.mark.parametrize("name", FMTS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_blocks_counted(name, bad):
    x = normalish((3, 512), 5)
    x[1, 300] = bad
    x[2, 0] = bad
    out = np.empty(x.size // 256 * FMTS[name].type_size, np.uint8)
    assert FMTS[name].quantize(x.reshape(-1), out)[0] == 2   # (inf also overflows d)


@pytest.mark.parametrize("name", FMTS)
def test_scale_overflow_counted(name):
    x = normalish((3, 512), 6)
    x[0, :256] *= 1e9                                    # d overflows f16
    x[2, 256:] = np.abs(x[2, 256:]) - 5e9               # dmin overflows f16
    out = np.empty(x.size // 256 * FMTS[name].type_size, np.uint8)
    assert FMTS[name].quantize(x.reshape(-1), out) == (0, 2)


@pytest.mark.parametrize("name", FMTS)
@pytest.mark.parametrize("case", CASES)
def test_levels_are_nearest(name, case):
    # independent of ggml: with the block's stored scale d sc and min dmin m, every level
    # strictly inside 0..nmax is the nearest one to (x + dmin m) / (d sc), and a level at
    # either end is on the right side (sub-blocks with d sc = 0 keep the search's levels)
    x = CASES[case]().astype(np.float64).reshape(-1, 8, 32)
    dsc, msc, lev = fields(quantize(x.reshape(-1, 256), name), name)
    r = x + msc[:, :, None] - lev * dsc[:, :, None]
    tol = 0.5 * dsc[:, :, None] * (1 + 1e-6) + 4 * EPS * (np.abs(x) + msc[:, :, None])
    live_ = np.broadcast_to(dsc[:, :, None] > 0, lev.shape)
    inner = live_ & (lev > 0) & (lev < NMAX[name])
    assert np.all(np.abs(r)[inner] <= tol[inner])
    assert np.all(r[live_ & (lev == 0)] <= tol[live_ & (lev == 0)])
    assert np.all(r[live_ & (lev == NMAX[name])] >= -tol[live_ & (lev == NMAX[name])])


# --- dequantize --------------------------------------------------------------------------

def random_blocks(name: str, nblocks: int, seed: int) -> np.ndarray:
    """Random bytes with finite f16 d and dmin (normal and subnormal, either sign)."""
    ts = FMTS[name].type_size
    raw = (u24(nblocks * ts, seed).astype(np.uint64) & np.uint64(255)).astype(np.uint8)
    raw = raw.reshape(nblocks, ts)
    h = raw[:, :4].copy().view(np.uint16)
    h &= np.uint16(0xBBFF)                               # exponent <= 0b01110: finite, |.| < 1
    raw[:, :4] = h.view(np.uint8)
    return raw


@pytest.mark.parametrize("name", FMTS)
def test_dequantize_bit_exact(name):
    for q in (quantize(CASES["scaled"](), name), random_blocks(name, 4096, 3).reshape(16, -1)):
        ref = np.asarray(ref_dequantize(q, G[name]), np.float32).reshape(q.shape[0], -1)
        np.testing.assert_array_equal(dequantize(q, name).view(np.uint32), ref.view(np.uint32))


# --- runtime Linear ------------------------------------------------------------------------

def fields(q: np.ndarray, name: str):
    """(d sc, dmin m) (nb, 8) f64 and the levels (nb, 8, 32) of the blocks q (NumPy)."""
    nb = q.size // FMTS[name].type_size
    blk = q.reshape(nb, -1)
    d = blk[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blk[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = GQ4_K.get_scale_min(blk[:, 4:16])
    ql = blk[:, -128:].reshape(nb, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    lev = (ql & 15).reshape(nb, 8, 32).astype(np.int64)
    if name == "Q5_K":
        qh = blk[:, 16:48].reshape(nb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
        lev += 16 * (qh & 1).astype(np.int64)
    return ((d * sc.astype(np.float32)).astype(np.float64),
            (dmin * m.astype(np.float32)).astype(np.float64), lev)


def unpack(q: np.ndarray, name: str):
    """(d sc q, dmin m) per element of the blocks q (rows, row_bytes): W = A - B."""
    dsc, msc, lev = fields(q, name)
    a = dsc[:, :, None] * lev
    b = np.broadcast_to(msc[:, :, None], a.shape)
    return a.reshape(q.shape[0], -1), b.reshape(q.shape[0], -1)


def pack(name: str, d, dmin, sc, m, lev) -> np.ndarray:
    """Blocks from their fields (NumPy): d, dmin (nb,), sc, m (nb, 8) in 0..63, lev
    (nb, 256) in 0..NMAX; the layout gguf-py reads."""
    nb = lev.shape[0]
    sc = sc.astype(np.uint8)
    m = m.astype(np.uint8)
    scales = np.zeros((nb, 12), np.uint8)
    scales[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    lev = lev.astype(np.uint8).reshape(nb, 4, 2, 32)
    qs = ((lev[:, :, 0] & 15) | ((lev[:, :, 1] & 15) << 4)).reshape(nb, 128)
    parts = [np.asarray(d, np.float16).view(np.uint8).reshape(nb, 2),
             np.asarray(dmin, np.float16).view(np.uint8).reshape(nb, 2), scales]
    if name == "Q5_K":
        hi = (lev.reshape(nb, 8, 32) >> 4).astype(np.uint8)
        parts.append((hi << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1).astype(np.uint8))
    parts.append(qs)
    return np.concatenate(parts, axis=1)


def make(name, shape, seed=0):
    x = normalish(shape, seed)
    x[0] *= 1e-6                         # tiny scales: f16 subnormal d and dmin
    data = quantize(x, name)
    data.setflags(write=False)
    f = FMTS[name]
    return f.linear(f, [data.reshape(-1)], [shape[0]], shape[1]), data


def check(got, data, name, x, x_quantized=False):
    a, b = unpack(data, name)
    w = a - b
    want = x.astype(np.float64) @ w.T
    tol = 64 * EPS * (np.abs(x) @ (a + b).T) + 1e-30
    if x_quantized:
        # x is rounded to int8 per 32 (step amax/254), and both parts, d sc q and dmin m,
        # multiply that rounded x (test_activation_rounding checks it exactly)
        step = np.repeat(np.abs(x).reshape(-1, 32).max(1), 32).reshape(x.shape) / 254
        tol += step @ (np.abs(a) + np.abs(b)).T * 1.01
    assert got.shape == want.shape
    assert np.all(np.abs(got - want) <= tol), np.max(np.abs(got - want) / tol)


SHAPES = [(300, 256), (37, 512), (8, 768), (1030, 256), (2000, 256)]


@pytest.mark.parametrize("name", FMTS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matvec(name, shape):
    lin, data = make(name, shape)
    assert (lin.out_features, lin.in_features, lin.type_name) == (*shape, name)
    assert lin.nbytes == data.nbytes
    x = normalish(shape[1], 1)
    out = np.full(shape[0], np.nan, np.float32)
    lin.matvec(x, out)
    check(out, data, name, x, x_quantized=True)


@pytest.mark.parametrize("name", FMTS)
@pytest.mark.parametrize("T", [1, 7])
def test_matmul(name, T, monkeypatch):
    shape = (300, 512)
    monkeypatch.setattr(base, "_CHUNK_FLOATS", 512 * 40)   # several chunks, ragged last
    monkeypatch.setattr(base, "_CHUNK_MIN_ROWS", 1)
    lin, data = make(name, shape)
    x = normalish((T, shape[1]), 2)
    out = np.full((T, shape[0]), np.nan, np.float32)
    lin.matmul(x, out)
    check(out, data, name, x, x_quantized=True)          # prefill is an int8 GEMM too


@pytest.mark.parametrize("name", FMTS)
def test_rows_bit_exact(name):
    shape = (300, 512)
    lin, data = make(name, shape)
    ref = np.asarray(ref_dequantize(data, G[name]), np.float32).reshape(shape)
    ids = np.array([0, 299, 5, 5, 128, 64, 255], np.int64)
    out = np.full((ids.size, shape[1]), np.nan, np.float32)
    lin.rows(ids, out)
    np.testing.assert_array_equal(out, ref[ids])
    with pytest.raises(IndexError):
        lin.rows(np.array([300]), out[:1])


@pytest.mark.parametrize("name", FMTS)
def test_stacked(name):
    # q/k/v-like parts, none a multiple of the tile size: one W, outputs split back
    datas = [quantize(normalish((s, 512), 30 + i), name) for i, s in enumerate((150, 37, 37))]
    f = FMTS[name]
    lin = f.linear(f, [d.reshape(-1) for d in datas], [150, 37, 37], 512)
    data = np.concatenate(datas)
    assert lin.out_features == 224 and lin.nbytes == data.nbytes
    x = normalish(512, 3)
    out = np.full(224, np.nan, np.float32)
    lin.matvec(x, out)
    check(out, data, name, x, x_quantized=True)
    assert [o.shape for o in lin.split(out)] == [(150,), (37,), (37,)]
    ref = np.asarray(ref_dequantize(data, G[name]), np.float32).reshape(224, 512)
    rows = np.empty((224, 512), np.float32)
    lin.rows(np.arange(224), rows)
    np.testing.assert_array_equal(rows, ref)


def test_bad_size():
    with pytest.raises(ValueError, match="needs"):
        Q4_K.linear(Q4_K, [np.zeros(100, np.uint8)], [2], 256)
    with pytest.raises(ValueError, match="multiple of 256"):
        Q5_K.linear(Q5_K, [np.zeros(176, np.uint8)], [1], 128)


def grid_x(n: int, seed: int, sign=None) -> np.ndarray:
    # x on the int8 grid of every block of 32 (amax = 127 * 2^-5): decode rounds nothing
    k = (u24(n, seed) % 255 - 127) if sign is None else np.full(n, 127.0 * sign)
    k = k.reshape(-1, 32)
    k[:, 0] = 127
    return (k.reshape(-1) * 2.0 ** -5).astype(np.float32)


@pytest.mark.parametrize("name", FMTS)
def test_matvec_exact_at_int16_bounds(name):
    # Every level at its extreme, every scale at 63, x at +-127 on the int8 grid: the
    # pair-dot sums reach their bounds (AVX2's int16 pairs: Q4_K's 8 of 2 * 15 * 127,
    # Q5_K's 4 of 2 * 31 * 127). A sum that overflowed would be off by 2^16 d dx; without
    # rounding of x, only float summation error remains.
    nmax = NMAX[name]
    rows, n = 6, 512
    lev = np.zeros((rows, n), np.int64)
    lev[1] = nmax
    lev[2] = u24(n, 9) % (nmax + 1)                                 # random levels
    lev[3, ::2] = nmax                                               # alternating extremes
    lev[4, :256] = nmax
    lev[5] = np.where(np.arange(n) % 16 == 15, nmax, 0)              # every 16th
    nblk = rows * n // 256
    d = np.full(nblk, 2.0 ** -10)
    sc = np.full((nblk, 8), 63)
    m = np.tile([0, 63, 17, 63, 0, 1, 32, 63], (nblk, 1))
    data = pack(name, d, d * 0.5, sc, m, lev.reshape(nblk, 256)).reshape(rows, -1)
    f = FMTS[name]
    lin = f.linear(f, [data.reshape(-1)], [rows], n)
    for x in (grid_x(n, 0, 1), grid_x(n, 0, -1), grid_x(n, 10)):
        out = np.empty(rows, np.float32)
        lin.matvec(x, out)
        check(out, data, name, x)


if __name__ == "__main__":       # regenerate the golden files from ggml (llama-cpp-python)
    if not ggml_oracle.available():
        sys.exit("needs llama-cpp-python (ggml's quantizer)")
    for name in FMTS:
        for case, make_x in CASES.items():
            ggml_oracle.make_golden(name, case, make_x())
            print(f"wrote {Path(ggml_oracle.golden_path(name, case)).name}")
