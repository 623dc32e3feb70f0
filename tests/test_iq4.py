"""IQ4_NL / IQ4_XS: reference kernels bit-exact with ggml, runtime Linear vs a NumPy twin.

Quantization is compared with ggml's own bytes (quantize_iq4_nl / quantize_iq4_xs without
an importance matrix, what llama-quantize writes, also for the IQ4_NL rows it substitutes in
K-quant mixes): golden files made by ggml_quantize_chunk
(tests/data/ggml_golden/iq4_{nl,xs}_<case>.bin; `python tests/test_iq4.py` remakes them when
llama-cpp-python is installed) and, when it is installed, the live library as well.

Linear tolerance: float32 sums, 64 * eps32 * (|W| @ |x|) as in test_linear.py; decode also
rounds x to int8 per 32 weights (scale amax/127), so each x_i moves by at most
amax_32(i) / 254 and the output by at most |W| @ that; both bounds are added. The on-grid
test shows the integer part is exact (no rounding -> float tolerance only).
"""
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
import format_cases as fc
import ggml_oracle
from format_cases import check, gguf_dequant, live, random_blocks
from format_cases import quantize_counts as quantize

from edgellama.formats.iq4 import IQ4_NL, IQ4_XS, KVALUES, best_index

FORMATS = {"IQ4_NL": IQ4_NL, "IQ4_XS": IQ4_XS}


# --- quantize: ggml's bytes ---------------------------------------------------------------

def _cases() -> dict[str, np.ndarray]:
    """Inputs regenerated from fixed seeds; each golden file stays well under 64 KB."""
    rng = np.random.default_rng(8)
    kv = KVALUES.astype(np.float64)
    normal = rng.standard_normal((16, 512))
    outliers = rng.standard_normal((8, 512)) * 0.02
    outliers[rng.random(outliers.shape) < 0.01] *= 300           # a few spikes per row
    outliers[:, 77] = -40.0                                      # one column dominating
    zeros = rng.standard_normal((6, 512))
    zeros[0] = 0                                                 # all-zero row
    zeros[1, :256] = 0                                           # all-zero super-block
    zeros[2, 32:96] = -0.0                                       # zero sub-blocks
    zeros[3, ::2] = 0
    zeros[4] = -0.0
    zeros[5, 256:] = 1e-16                                       # below GROUP_MAX_EPS
    constant = np.array([np.full(512, v) for v in (0.37, -2.5, 1e-3, 7.0, -1e-20, 65504.0)])
    tiny = np.array([rng.standard_normal(256) * s for s in
                     (1e-3, 1e-5, 1e-7, 1e-9, 1e-13, 1e-15, 1e-17, 1e-21, 1e-30, 1e-39)])
    huge = np.array([rng.standard_normal(256) * s for s in (1e3, 1e5, 3e5, 1e6)])
    ties = np.concatenate([
        kv[rng.integers(0, 16, (4, 256))] * 2.0 ** -7,           # exactly on the table grid
        (kv[:-1] + kv[1:])[rng.integers(0, 15, (4, 256))] * 2.0 ** -8,   # halfway points
        np.tile(np.repeat([1.0, -1.0, 0.5, -0.5], 8), (2, 8)),   # equal max |x|, both signs
        np.tile(np.linspace(-1, 1, 32), (2, 8)),
        np.tile(kv * kv[::-1] / 127, (2, 16)),
    ])
    uniform = rng.uniform(-5, 5, (8, 768))
    cases = {"normal": normal, "outliers": outliers, "zeros": zeros, "constant": constant,
             "tiny": tiny, "huge": huge, "ties": ties, "uniform": uniform}
    return {k: np.asarray(v, np.float32) for k, v in cases.items()}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", list(_cases()))
def test_quantize_matches_golden(fmt, case):
    x = _cases()[case]
    want = ggml_oracle.load_golden(fmt, case, x.shape)
    assert want is not None, f"missing golden file for {fmt} {case}: run python {__file__}"
    got, counts = quantize(x, FORMATS[fmt])
    assert counts == (0, 0)
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
    # many independent blocks at scales across the f32 range, past f16 overflow of d and
    # down to where x^2 underflows (ggml's weights): the same bytes whatever happens
    rng = np.random.default_rng(11)
    x = rng.standard_normal((64, 256)) * np.exp(rng.uniform(-60, 30, (64, 1)))
    x = x.astype(np.float32)
    np.testing.assert_array_equal(quantize(x, FORMATS[fmt])[0], ggml_oracle.quantize(x, fmt))


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS)
def test_quantize_counts_bad_blocks_and_overflow(fmt):
    x = np.random.default_rng(2).standard_normal((1, 1024)).astype(np.float32)
    x[0, 3] = np.nan
    x[0, 300] = np.inf
    x[0, 700] = 1e10                    # d ~ 1e10 / 127 (IQ4_XS: / 32 again) > 65504
    assert quantize(x, fmt)[1][0] == 2
    assert quantize(x, fmt)[1][1] >= 1
    x[0, 3] = x[0, 300] = 0
    assert quantize(x, fmt)[1] == (0, 1)


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS)
def test_quantize_round_trip_error(fmt):
    # a sanity bound independent of the oracle: each weight within the widest table gap
    # (24 of 127) of its block's scale, plus the 6-bit sub-scale rounding for IQ4_XS
    x = _cases()["normal"]
    y = gguf_dequant(quantize(x, fmt)[0], fmt)
    amax = np.abs(x.reshape(-1, 32)).max(1, keepdims=True)
    slack = 1.0 if fmt is IQ4_NL else 1.5
    assert np.all(np.abs(x.reshape(-1, 32) - y.reshape(-1, 32)) <= amax * 24 / 127 * slack)


def test_best_index_ties_and_ends():
    # nearest table value, exact midpoints go up (ggml's best_index_int8)
    kv = KVALUES.astype(np.float32)
    for i in range(15):
        mid = (kv[i] + kv[i + 1]) / 2
        assert best_index(mid) == i + 1
        assert best_index(np.nextafter(mid, np.float32(-200))) == i
        assert best_index(kv[i]) == i
    assert best_index(np.float32(-1e30)) == 0 and best_index(np.float32(1e30)) == 15
    assert best_index(np.float32(0.0)) == best_index(np.float32(-0.0)) == 8


# --- dequantize: gguf-py's bytes to floats -------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS)
def test_dequantize_bit_exact(fmt):
    rng = np.random.default_rng(3)
    extremes = np.float16([65504, -65504, 2 ** -24, -(2 ** -24), 6.1e-5, 0, -0.0, 1, 1e-3, 3.14])
    q = np.concatenate([random_blocks(64, rng, fmt), random_blocks(10, rng, fmt, extremes),
                        np.zeros((2, fmt.type_size), np.uint8)])
    q[0, -16:] = 0                                               # nibbles 0: -127
    q[1, -16:] = 0xFF                                            # nibbles 15: 113
    if fmt is IQ4_XS:
        q[2, 2:8] = 0                                            # every ls - 32 = -32
        q[3, 2:8] = 0xFF                                         # every ls - 32 = 31
        q[4, 2:8] = [0x55, 0xAA, 0x12, 0x34, 0x56, 0x78]
    out = np.full(q.size // fmt.type_size * fmt.block_size, np.nan, np.float32)
    fmt.dequantize(q.reshape(-1), out)
    np.testing.assert_array_equal(out.view(np.uint32),
                                  gguf_dequant(q, fmt).reshape(-1).view(np.uint32))


# --- runtime Linear ---------------------------------------------------------------------

def make(fmt, shape, seed=0, raw=None):
    rows, n = shape
    if raw is None:
        rng = np.random.default_rng(seed)
        raw = random_blocks(rows * n // fmt.block_size, rng, fmt).reshape(rows, -1)
        blocks = raw.reshape(rows, -1, fmt.type_size)
        blocks[0, :, 1] = 0                                      # d = 2^-24 * k: f16 subnormal
    raw.setflags(write=False)                                    # read-only file views work
    lin = fmt.linear(fmt, [raw.reshape(-1)], [rows], n)
    return lin, gguf_dequant(raw, fmt).astype(np.float64).reshape(shape)


# (out, in): out not a multiple of any tile size; 37 and 16 rows give 16-row tiles
SHAPES = {IQ4_NL: [(300, 64), (37, 32), (1030, 160), (16, 96), (2000, 32)],
          IQ4_XS: [(300, 256), (37, 512), (1030, 256), (16, 768), (2000, 256)]}


@pytest.mark.parametrize("fmt,shape", [(f, s) for f in SHAPES for s in SHAPES[f]],
                         ids=lambda v: v.name if hasattr(v, "name") else str(v))
def test_matvec(fmt, shape):
    lin, ref = make(fmt, shape)
    assert (lin.out_features, lin.in_features, lin.nbytes) == (
        *shape, shape[0] * shape[1] // fmt.block_size * fmt.type_size)
    x = np.random.default_rng(1).standard_normal(shape[1]).astype(np.float32)
    x[:32] *= 1e-3                                               # a small block of x
    x[-7] = 30.0                                                 # an outlier
    out = np.full(shape[0], np.nan, np.float32)
    lin.matvec(x, out)
    check(out, ref, x, x_quantized=True)


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS)
@pytest.mark.parametrize("rows", [300, 37])
def test_matvec_on_grid_is_exact_and_extremes(fmt, rows):
    # x on the int8 grid of every 32 (amax = 127 * 2^k): decode rounds nothing, so the
    # answer must be float-accurate. Weights at the table's ends (nibbles 0: -127,
    # 15: 113) with x = +-127 put each pair of table products at -+32258, the int16 edge,
    # and a block sum at 32 * 127 * 127.
    shape = (rows, 512)
    rng = np.random.default_rng(4)
    raw = random_blocks(rows * 512 // fmt.block_size, rng, fmt).reshape(rows, -1, fmt.type_size)
    raw[:rows // 3, :, -16:] = 0
    raw[rows // 3:2 * rows // 3, :, -16:] = 0xFF
    if fmt is IQ4_XS:
        raw[:rows // 3, :, 8:] = 0
        raw[rows // 3:2 * rows // 3, :, 8:] = 0xFF
        raw[:rows // 2, :, 2:8] = 0                              # ls - 32 = -32
    lin, ref = make(fmt, shape, raw=raw.reshape(rows, -1))
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
    lin, ref = make(fmt, (300, 512))
    fc.check_matmul(lin, ref, T, monkeypatch)


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS)
def test_rows(fmt):
    lin, ref = make(fmt, (300, 512))
    fc.check_rows(lin, ref)


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS)
def test_dequant_tiles_match_gguf(fmt):
    lin, ref = make(fmt, (1030, 256), seed=5)
    fc.check_dequant_tiles(lin, ref)


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS)
def test_stacked(fmt):
    rng = np.random.default_rng(7)
    n = 512
    raws = [random_blocks(s * n // fmt.block_size, rng, fmt).reshape(s, -1) for s in (150, 37, 37)]
    ref = np.concatenate([gguf_dequant(r, fmt).astype(np.float64).reshape(-1, n) for r in raws])
    fc.check_stacked(fmt, raws, ref, rng)


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS)
def test_resident_size_is_about_file_size(fmt):
    lin, _ = make(fmt, (1030, 512))
    tiles = lin.q.nbytes + lin.d.nbytes + lin.sc.nbytes
    per_row = 512 // fmt.block_size * fmt.type_size               # the file's bytes
    # IQ4_XS: one i8 sub-scale per 32 (8 bytes per 256) where the file packs 6
    assert tiles == lin.nt * lin.R * (per_row + (4 if fmt is IQ4_XS else 0))


def test_bad_size():
    with pytest.raises(ValueError):
        IQ4_NL.linear(IQ4_NL, [np.zeros(10, np.uint8)], [3], 32)
    with pytest.raises(ValueError):
        IQ4_XS.linear(IQ4_XS, [np.zeros(136, np.uint8)], [1], 128)


if __name__ == "__main__":
    # remake the golden files from ggml (needs llama-cpp-python)
    assert ggml_oracle.available(), "llama-cpp-python is needed to make golden files"
    for fmt in FORMATS:
        for name, x in _cases().items():
            ggml_oracle.make_golden(fmt, name, x)
            print(fmt, name, x.shape, ggml_oracle.golden_path(fmt, name).stat().st_size, "bytes")
