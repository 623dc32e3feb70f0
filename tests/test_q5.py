"""Q5_0 / Q5_1: reference kernels bit-exact with ggml, runtime Linear vs a plain NumPy twin.

Quantization is compared with ggml's own bytes (quantize_row_q5_*_ref, what llama-quantize
writes): golden files made by ggml_quantize_chunk (tests/data/ggml_golden/q5_{0,1}_<case>.bin;
`python tests/test_q5.py` remakes them when llama-cpp-python is installed) and, when it is
installed, the live library as well.

Linear tolerance: float32 sums, 64 * eps32 * (|W| @ |x|) as in test_linear.py; decode also
rounds x to int8 per 32 weights (scale amax/127), so each x_i moves by at most
amax_32(i) / 254 and the output by at most |U| @ that, U = the part of W multiplied by the
rounded x: W itself for Q5_0, u * d for Q5_1 (its m * sum(x) term uses the exact x). The
on-grid test shows the integer part is exact (no rounding -> float tolerance only).
"""
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
import format_cases as fc
import ggml_oracle
from format_cases import check, gguf_dequant, live
from format_cases import quantize_counts as quantize

from edgellama.formats.q5 import Q5_0, Q5_1

FORMATS = {"Q5_0": Q5_0, "Q5_1": Q5_1}


# --- quantize: ggml's bytes ---------------------------------------------------------------

def _cases() -> dict[str, np.ndarray]:
    """Inputs regenerated from fixed seeds; each golden file stays well under 64 KB."""
    rng = np.random.default_rng(5)
    normal = rng.standard_normal((16, 512))
    outliers = rng.standard_normal((8, 256)) * 0.02
    outliers[rng.random(outliers.shape) < 0.02] *= 300           # a few spikes per row
    outliers[:, 77] = -40.0                                      # one column dominating
    zeros = rng.standard_normal((6, 256))
    zeros[0] = 0                                                 # all-zero row
    zeros[1, :32] = 0                                            # all-zero first block
    zeros[2, 32:64] = -0.0                                       # a block of -0.0
    zeros[3, ::2] = 0
    zeros[4] = -0.0
    zeros[5, 128:] = 1e-30
    constant = np.array([np.full(256, v) for v in (0.37, -2.5, 1e-3, 7.0, -1e-20, 65504.0)])
    tiny = np.array([rng.standard_normal(256) * s for s in
                     (1e-3, 1e-5, 1e-7, 1e-9, 1e-13, 1e-30, 1e-39, 1e-44)])
    huge = np.array([rng.standard_normal(256) * s for s in (1e3, 1e5, 3e5, 5e5, 1e6)])   # d overflows
    ties = np.concatenate([
        rng.integers(-16, 16, (4, 256)) * 0.125,                 # exactly on the 5-bit grid
        (rng.integers(-32, 32, (4, 256)) + 0.5) * 2.0 ** -6,     # halfway between points
        np.tile(np.repeat([1.0, -1.0, 0.5, -0.5], 8), (2, 8)),   # equal max |x|, both signs
        np.tile(np.repeat([-1.0, 1.0, -0.5, 0.5], 8), (2, 8)),
        np.tile(np.linspace(-1, 1, 32), (2, 8)),
    ])
    uniform = rng.uniform(-5, 5, (8, 384))
    cases = {"normal": normal, "outliers": outliers, "zeros": zeros, "constant": constant,
             "tiny": tiny, "huge": huge, "ties": ties, "uniform": uniform}
    return {k: np.asarray(v, np.float32) for k, v in cases.items()}


def overflowing_scales(x, fmt):
    """Blocks whose d (or m) rounds to f16 infinity, by NumPy's own f16 rounding."""
    b = x.reshape(-1, 32)
    with np.errstate(over="ignore"):
        if fmt is Q5_0:
            d = np.abs(b).max(1) / np.float32(16)
            return int(np.isinf(d.astype(np.float16)).sum())
        d = (b.max(1) - b.min(1)) / np.float32(31)
        return int((np.isinf(d.astype(np.float16)) | np.isinf(b.min(1).astype(np.float16))).sum())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", list(_cases()))
def test_quantize_matches_golden(fmt, case):
    x = _cases()[case]
    want = ggml_oracle.load_golden(fmt, case, x.shape)
    assert want is not None, f"missing golden file for {fmt} {case}: run python {__file__}"
    got, counts = quantize(x, FORMATS[fmt])
    assert counts == (0, overflowing_scales(x, FORMATS[fmt]))
    np.testing.assert_array_equal(got, want)


@live
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", list(_cases()))
def test_quantize_matches_live_ggml(fmt, case):
    x = _cases()[case]
    np.testing.assert_array_equal(quantize(x, FORMATS[fmt])[0], ggml_oracle.quantize(x, fmt))


@live
@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_random_scales_live(fmt):
    # many independent blocks at scales across the whole f16 range of d
    rng = np.random.default_rng(11)
    x = rng.standard_normal((64, 256)) * np.exp(rng.uniform(-25, 12, (64, 1)))
    x = x.astype(np.float32)
    np.testing.assert_array_equal(quantize(x, FORMATS[fmt])[0], ggml_oracle.quantize(x, fmt))


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_counts_bad_blocks_and_overflow(fmt):
    x = np.random.default_rng(2).standard_normal((1, 256)).astype(np.float32)
    x[0, 3] = np.nan
    x[0, 40] = np.inf
    x[0, 200] = 1e7                     # d = 1e7/16 (or /31) > 65504: f16 overflows
    assert quantize(x, FORMATS[fmt])[1] == (2, 2)   # the inf block's d is inf too


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_round_trip_error(fmt):
    # a sanity bound independent of the oracle: each weight within one step of its block
    x = _cases()["normal"]
    y = gguf_dequant(quantize(x, FORMATS[fmt])[0], FORMATS[fmt])
    span = np.ptp(x.reshape(-1, 32), 1, keepdims=True)
    assert np.all(np.abs(x.reshape(-1, 32) - y.reshape(-1, 32)) <= span / 31)


# --- dequantize: gguf-py's bytes to floats -------------------------------------------------

def random_blocks(nb, rng, fmt, d_values=None):
    """nb blocks of random bytes with finite f16 d (from d_values, else around 1e-2), and
    for Q5_1 a finite f16 m."""
    return fc.random_blocks(nb, rng, fmt, d_values, m_at=2 if fmt is Q5_1 else None)


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS)
def test_dequantize_bit_exact(fmt):
    rng = np.random.default_rng(3)
    extremes = np.float16([65504, -65504, 2 ** -24, -(2 ** -24), 6.1e-5, 0, -0.0, 1, 1e-3, 3.14])
    q = np.concatenate([random_blocks(64, rng, fmt), random_blocks(10, rng, fmt, extremes),
                        np.zeros((2, fmt.type_size), np.uint8)])
    h = 4 if fmt is Q5_1 else 2                                  # qh offset
    q[0, h:] = 0                                                 # every u = 0
    q[1, h:] = 0xFF                                              # every u = 31
    q[2, h:h + 4] = [0x55, 0xAA, 0x0F, 0xF0]                     # mixed high bits
    if fmt is Q5_1:
        q[3:13, 2:4] = extremes.reshape(10, 1).view(np.uint8)    # extreme m
    out = np.full(q.size // fmt.type_size * 32, np.nan, np.float32)
    fmt.dequantize(q.reshape(-1), out)
    np.testing.assert_array_equal(out.view(np.uint32),
                                  gguf_dequant(q, fmt).reshape(-1).view(np.uint32))


# --- runtime Linear ---------------------------------------------------------------------

def make(fmt, shape, seed=0, raw=None):
    """(Linear, W as float64)"""
    rows, n = shape
    if raw is None:
        rng = np.random.default_rng(seed)
        raw = random_blocks(rows * n // 32, rng, fmt).reshape(rows, -1)
        blocks = raw.reshape(rows, -1, fmt.type_size)
        blocks[0, :, 1] = 0                                      # d = 2^-24 * k: f16 subnormal
    raw.setflags(write=False)                                    # read-only file views work
    lin = fmt.linear(fmt, [raw.reshape(-1)], [rows], n)
    return lin, gguf_dequant(raw, fmt).astype(np.float64).reshape(shape)


SHAPES = [(300, 64), (37, 32), (1030, 160), (16, 96), (2000, 32)]


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matvec(fmt, shape):
    lin, ref = make(fmt, shape)
    assert (lin.out_features, lin.in_features, lin.nbytes) == (
        *shape, shape[0] * shape[1] // 32 * fmt.type_size)
    x = np.random.default_rng(1).standard_normal(shape[1]).astype(np.float32)
    x[:32] *= 1e-3                                               # a small block of x
    x[-7] = 30.0                                                 # an outlier
    out = np.full(shape[0], np.nan, np.float32)
    lin.matvec(x, out)
    check(out, ref, x, True)


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS)
def test_matvec_on_grid_is_exact_and_int16_extremes(fmt):
    # x on the int8 grid of every 32 (amax = 127 * 2^k): decode rounds nothing, so the
    # answer must be float-accurate. Weights at the extremes: every u = 0 or 31 with
    # x = +-127 puts a group sum (u - 16) xq at -+32512 / +31 * 16 * 127, the int16 edge.
    shape = (300, 256)
    rng = np.random.default_rng(4)
    raw = random_blocks(shape[0] * 8, rng, fmt).reshape(shape[0], 8, fmt.type_size)
    h = 4 if fmt is Q5_1 else 2
    raw[:100, :, h:] = 0
    raw[100:200, :, h:] = 0xFF
    lin, ref = make(fmt, shape, raw=raw.reshape(shape[0], -1))
    for x in (np.full(shape[1], 127, np.float32), np.full(shape[1], -127, np.float32),
              rng.integers(-127, 128, shape[1]).astype(np.float32)):
        x[::32] = 127
        x *= np.float32(2.0 ** -5)
        out = np.empty(shape[0], np.float32)
        lin.matvec(x, out)
        check(out, ref, x)


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS)
@pytest.mark.parametrize("T", [1, 7])
def test_matmul(fmt, T, monkeypatch):
    lin, ref = make(fmt, (300, 256))
    fc.check_matmul(lin, ref, T, monkeypatch)


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS)
def test_rows(fmt):
    lin, ref = make(fmt, (300, 256))
    fc.check_rows(lin, ref)


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS)
def test_dequant_tiles_match_gguf(fmt):
    lin, ref = make(fmt, (1030, 96), seed=5)
    fc.check_dequant_tiles(lin, ref)


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS)
def test_stacked(fmt):
    rng = np.random.default_rng(7)
    raws = [random_blocks(s * 3, rng, fmt).reshape(s, -1) for s in (150, 37, 37)]
    ref = np.concatenate([gguf_dequant(r, fmt).astype(np.float64).reshape(-1, 96) for r in raws])
    fc.check_stacked(fmt, raws, ref, rng)


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS)
def test_resident_size_is_file_size(fmt):
    lin, _ = make(fmt, (1030, 256))
    tiles = lin.w.nbytes + lin.d.nbytes + (lin.m.nbytes if fmt is Q5_1 else 0)
    assert tiles == lin.nt * lin.R * 8 * fmt.type_size            # type_size per block, pad incl.


def test_bad_size():
    with pytest.raises(ValueError):
        Q5_0.linear(Q5_0, [np.zeros(10, np.uint8)], [3], 32)
    with pytest.raises(ValueError):
        Q5_1.linear(Q5_1, [np.zeros(24, np.uint8)], [1], 48)


if __name__ == "__main__":
    # remake the golden files from ggml (needs llama-cpp-python)
    assert ggml_oracle.available(), "llama-cpp-python is needed to make golden files"
    for fmt in FORMATS:
        for name, x in _cases().items():
            ggml_oracle.make_golden(fmt, name, x)
            print(fmt, name, x.shape, ggml_oracle.golden_path(fmt, name).stat().st_size, "bytes")
