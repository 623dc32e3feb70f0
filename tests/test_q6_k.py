"""Q6_K: reference kernels bit-exact with ggml, runtime Linear vs a plain NumPy twin.

Quantization is compared with ggml's own bytes: golden files made by ggml_quantize_chunk
(tests/data/ggml_golden/q6_k_<case>.bin; `python tests/test_q6_k.py` remakes them when
llama-cpp-python is installed) and, when it is installed, the live library as well.

Linear tolerance: float32 sums, 64 * eps32 * (|W| @ |x|) as in test_linear.py; decode and
prefill also round x to int8 per 32 weights (scale amax/127), so each x_i moves by at most
amax_32(i) / 254 and the output by at most |W| @ that; both bounds are added. The
on-grid test shows the integer part is exact (no rounding -> float tolerance only).
"""
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
import format_cases as fc
import ggml_oracle
from format_cases import live

from edgellama.formats.q6_k import Q6_K


def gguf_dequant(q):
    return fc.gguf_dequant(q, Q6_K)


# --- quantize: ggml's bytes ---------------------------------------------------------------

def _cases() -> dict[str, np.ndarray]:
    """Inputs regenerated from fixed seeds; each golden file stays well under 64 KB."""
    rng = np.random.default_rng(6)
    normal = rng.standard_normal((16, 1024))
    outliers = rng.standard_normal((8, 512)) * 0.02
    outliers[rng.random(outliers.shape) < 0.01] *= 300           # a few spikes per row
    outliers[:, 77] = -40.0                                      # one column dominating
    zeros = rng.standard_normal((6, 512))
    zeros[0] = 0                                                 # all-zero row
    zeros[1, :256] = 0                                           # all-zero first block
    zeros[2, 16:48] = 0                                          # zero sub-blocks
    zeros[3, ::2] = 0
    zeros[4] = -0.0
    zeros[5, 256:] = 1e-16                                       # below GROUP_MAX_EPS
    constant = np.array([np.full(512, v) for v in (0.37, -2.5, 1e-3, 7.0, -1e-20, 65504.0)])
    tiny = np.array([rng.standard_normal(256) * s for s in
                     (1e-3, 1e-5, 1e-6, 1e-7, 1e-9, 1e-13, 1e-15, 1e-30, 1e-39, 1e-44)])
    huge = np.array([rng.standard_normal(256) * s for s in (1e3, 1e5, 3e7, 6e7, 1e38)])
    ties = np.concatenate([
        rng.integers(-32, 32, (4, 256)) * 0.125,                 # exactly on a 6-bit grid
        (rng.integers(-64, 64, (4, 256)) + 0.5) * 2.0 ** -6,     # halfway between points
        np.tile(np.repeat([1.0, -1.0, 0.5, -0.5], 4), (2, 16)),  # equal max |x|, both signs
        np.tile(np.linspace(-1, 1, 16), (2, 16)),
    ])
    uniform = rng.uniform(-5, 5, (8, 768))
    cases = {"normal": normal, "outliers": outliers, "zeros": zeros, "constant": constant,
             "tiny": tiny, "huge": huge, "ties": ties, "uniform": uniform}
    return {k: np.asarray(v, np.float32) for k, v in cases.items()}


def quantize(x):
    return fc.quantize_counts(x, Q6_K)


@pytest.mark.parametrize("case", list(_cases()))
def test_quantize_matches_golden(case):
    x = _cases()[case]
    want = ggml_oracle.load_golden("Q6_K", case, x.shape)
    assert want is not None, f"missing golden file for {case}: run python {__file__}"
    got, counts = quantize(x)
    # huge: 1e38 squares to inf in ggml's fit (it writes a zero block): flagged as too large
    assert counts == ((0, 1) if case == "huge" else (0, 0))
    np.testing.assert_array_equal(got, want)


@live
@pytest.mark.parametrize("case", list(_cases()))
def test_quantize_matches_live_ggml(case):
    x = _cases()[case]
    np.testing.assert_array_equal(quantize(x)[0], ggml_oracle.quantize(x, "Q6_K"))


@live
def test_quantize_random_scales_live():
    # many independent blocks at scales across the whole f16 range of d
    rng = np.random.default_rng(11)
    x = rng.standard_normal((64, 256)) * np.exp(rng.uniform(-25, 18, (64, 1)))
    x = x.astype(np.float32)
    np.testing.assert_array_equal(quantize(x)[0], ggml_oracle.quantize(x, "Q6_K"))


def test_quantize_counts_bad_blocks_and_overflow():
    x = np.random.default_rng(2).standard_normal((1, 1024)).astype(np.float32)
    x[0, 3] = np.nan
    x[0, 300] = np.inf
    x[0, 700] = 1e10                    # d = max_scale / 128 > 65504: f16 overflows
    assert quantize(x)[1] == (2, 1)


def test_quantize_round_trip_error():
    # a sanity bound independent of the oracle: each weight within its sub-block step
    x = _cases()["normal"]
    y = gguf_dequant(quantize(x)[0])
    step = np.abs(x.reshape(-1, 16)).max(1, keepdims=True) / 31
    assert np.all(np.abs(x.reshape(-1, 16) - y.reshape(-1, 16)) <= step)


# --- dequantize: gguf-py's bytes to floats -------------------------------------------------

def random_blocks(nb, rng, d_values=None):
    """nb Q6_K blocks of random bytes with finite f16 d (from d_values, else around 1e-2)."""
    return fc.random_blocks(nb, rng, Q6_K, d_values, d_at=208)


def test_dequantize_bit_exact():
    rng = np.random.default_rng(3)
    extremes = np.float16([65504, -65504, 2 ** -24, -(2 ** -24), 6.1e-5, 0, -0.0, 1, 1e-3, 3.14])
    q = np.concatenate([random_blocks(64, rng), random_blocks(10, rng, extremes),
                        np.zeros((2, 210), np.uint8)])
    q[-1, 192:208] = 0x80                                        # scales -128, d = 0
    q[0, 192:208] = [0x80, 0x7F] * 8                             # the int8 scale extremes
    q[1, :192] = 0                                               # every q = -32
    q[2, :192] = 0xFF                                            # every q = 31
    out = np.full(q.size // 210 * 256, np.nan, np.float32)
    Q6_K.dequantize(q.reshape(-1), out)
    np.testing.assert_array_equal(out.view(np.uint32), gguf_dequant(q).reshape(-1).view(np.uint32))


# --- runtime Linear ---------------------------------------------------------------------

def make(shape, seed=0, raw=None):
    rows, n = shape
    if raw is None:
        rng = np.random.default_rng(seed)
        raw = random_blocks(rows * n // 256, rng).reshape(rows, -1)
        raw[0, 208::210] = 0                                     # d = 2^-24 * k: f16 subnormal
        raw[0, 209::210] = 0
        raw[0, 208::210] = rng.integers(1, 255, n // 256)
    raw.setflags(write=False)                                    # read-only file views work
    lin = Q6_K.linear(Q6_K, [raw.reshape(-1)], [rows], n)
    return lin, gguf_dequant(raw).astype(np.float64).reshape(shape)


def check(got, ref_w, x, x_quantized=False):
    fc.check(got, ref_w, x, x_quantized)                 # x is rounded per 32 weights


SHAPES = [(300, 256), (37, 512), (1030, 256), (16, 768), (2000, 256)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matvec(shape):
    lin, ref = make(shape)
    assert (lin.out_features, lin.in_features, lin.nbytes) == (*shape, shape[0] * shape[1] // 256 * 210)
    x = np.random.default_rng(1).standard_normal(shape[1]).astype(np.float32)
    x[:16] *= 1e-3                                               # a small sub-block of x
    x[40] = 30.0                                                 # an outlier
    out = np.full(shape[0], np.nan, np.float32)
    lin.matvec(x, out)
    check(out, ref, x, x_quantized=True)


@pytest.mark.parametrize("T", [0, 1, 5])
def test_on_grid_is_exact_and_extremes(T):
    # x on the int8 grid of every 32 (amax = 127 * 2^k): decode (T = 0) and prefill round
    # nothing, so the answer must be float-accurate. Weights at the extremes: all
    # q - 32 = -32 or 31, scales -128, x = +-127: the largest int32 block sums.
    shape = (300, 512)
    rng = np.random.default_rng(4)
    raw = random_blocks(shape[0] * 2, rng).reshape(shape[0], -1)
    raw[:100, :192] = 0                                          # q = -32
    raw[100:200, :192] = 0xFF                                    # q = 31
    raw[:200, 192:208] = 0x80                                    # scale -128
    blocks = raw.reshape(-1, 210)
    blocks[:, 192:208] = blocks[:, 192:208] | 0x80               # negative scales only
    lin, ref = make(shape, raw=raw)
    for x in (np.full(shape[1], 127, np.float32), np.full(shape[1], -127, np.float32),
              rng.integers(-127, 128, shape[1]).astype(np.float32)):
        x[::32] = 127
        x *= np.float32(2.0 ** -5)
        if T == 0:
            out = np.full(shape[0], np.nan, np.float32)
            lin.matvec(x, out)
        else:
            xs = np.tile(x, (T, 1))
            xs[1:] *= np.float32(2.0 ** -3)              # rows of x with their own scales
            out = np.full((T, shape[0]), np.nan, np.float32)
            lin.matmul(xs, out)
            x = xs
        check(out, ref, x)


@pytest.mark.parametrize("T", [1, 7])
def test_matmul(T, monkeypatch):
    lin, ref = make((300, 512))
    fc.check_matmul(lin, ref, T, monkeypatch, x_quantized=True)


def test_rows():
    lin, ref = make((300, 512))
    fc.check_rows(lin, ref)


@pytest.mark.parametrize("shape", [(1030, 256), (37, 768)], ids=str)
def test_repack_round_trip(shape):
    # every row of the tiles (ragged last tile) read back as gguf-py's values, bit for
    # bit, with the scale and value extremes in some blocks
    rows, n = shape
    raw = random_blocks(rows * n // 256, np.random.default_rng(5)).reshape(rows, -1)
    blocks = raw.reshape(-1, 210)
    blocks[::7, 192:208] = 0x80                                  # scales -128
    blocks[1::7, 192:208] = 0x7F                                 # scales 127
    blocks[2::7, :192] = 0xFF                                    # every q = 63
    blocks[3::7, :192] = 0                                       # every q = 0
    lin, ref = make(shape, raw=raw)
    out = np.full(shape, np.nan, np.float32)
    lin.rows(np.arange(rows), out)
    np.testing.assert_array_equal(out.view(np.uint32), ref.astype(np.float32).view(np.uint32))


def test_stacked():
    rng = np.random.default_rng(7)
    raws = [random_blocks(s * 2, rng).reshape(s, -1) for s in (150, 37, 37)]
    ref = np.concatenate([gguf_dequant(r).astype(np.float64).reshape(-1, 512) for r in raws])
    fc.check_stacked(Q6_K, raws, ref, rng, int8_prefill=True)


def test_resident_size_is_file_size_and_padding():
    lin, _ = make((1030, 512))
    # 212 bytes per block of 256 (3392 per 16 rows: 32 of padding), pad rows incl.
    assert lin.q.nbytes == lin.nt * lin.R * 2 * 212
    assert lin.nt * lin.R - 1030 <= 1030 // 8


def test_bad_size():
    with pytest.raises(ValueError):
        Q6_K.linear(Q6_K, [np.zeros(10, np.uint8)], [3], 256)
    with pytest.raises(ValueError):
        Q6_K.linear(Q6_K, [np.zeros(210, np.uint8)], [1], 200)


if __name__ == "__main__":
    # remake the golden files from ggml (needs llama-cpp-python)
    assert ggml_oracle.available(), "llama-cpp-python is needed to make golden files"
    for name, x in _cases().items():
        ggml_oracle.make_golden("Q6_K", name, x)
        print(name, x.shape, ggml_oracle.golden_path("Q6_K", name).stat().st_size, "bytes")
