"""Every weight format in the registry (edgellama.formats.FORMATS) against its references:
what each type's own tests (test_<type>.py) would otherwise repeat.

- quantize: bit-exact with ggml (llama-quantize's bytes, without an importance matrix):
  the golden files in tests/data/ggml_golden in every run, the live library on the golden
  inputs and larger ones when llama-cpp-python is installed (quantize_cases.py holds the
  inputs and remakes the files); bit-exact with gguf-py's quantizers where it has one;
  NaN/inf blocks counted and refused with the tensor's name.
- dequantize: bit-exact with gguf-py on random blocks (finite scales, extremes among
  them) and on our own bytes.
- runtime Linear (matvec, matvecs, matmul, rows, stacked tensors) against its NumPy twin,
  gguf-py's W in float64, to the tolerance format_cases.check derives: float32 sums, plus
  the rounding of x to int8 per block where the kernel does it (decode of every quantized
  type; prefill of the record formats, records.RecordLinear). Bounds: a row past the end,
  a wrong byte count and a row length off the block size are refused.
"""
import warnings

import format_cases as fc
import ggml_oracle
import numpy as np
import pytest
from format_cases import check, live
from gguf import GGMLQuantizationType as G
from gguf.quants import quantize as gguf_quantize
from quantize_cases import GOLDEN, LIVE, golden_counts, small_cases, small_edge_rows

from edgellama.errors import EdgeError
from edgellama.formats import FORMATS, quantize
from edgellama.formats.records import RecordLinear
from edgellama.kernels.target import BF16_PAIRS

ALL = list(FORMATS.values())
QUANTIZED = [f for f in ALL if f.block_size > 1]
name = lambda f: f.name     # noqa: E731  (test ids)

# Decode rounds x to int8 per 32 weights; the float types not at all.
X_BLOCK = 32
GGUF_PY_QUANTIZES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")


def unit(fmt) -> int:
    """The row-length step of the shapes tried: 32, or the format's block."""
    return max(32, fmt.block_size)


def shapes(fmt):
    # (out, in): out not a multiple of any tile size (16 to 256 rows); 37, 16 and 8 rows
    # give the narrowest tiles
    u = unit(fmt)
    return [(300, 2 * u), (37, u), (8, 3 * u), (16, 3 * u), (1030, 5 * u), (2000, u)]


def decode_rounds(fmt) -> bool:
    return fmt.block_size > 1


def prefill_rounds(fmt) -> bool | str:
    # int8 per block (the record formats), bf16 (BF16 on the bf16 pair products), or not
    if fmt.name == "BF16" and BF16_PAIRS:
        return "bf16"
    return issubclass(fmt.linear, RecordLinear)


# --- quantize ------------------------------------------------------------------------------

@pytest.mark.parametrize("type_name,case", [(t, c) for t in GOLDEN for c in GOLDEN[t]()])
def test_quantize_matches_ggml_golden(type_name, case):
    fmt = FORMATS[type_name]
    x = GOLDEN[type_name]()[case]
    want = ggml_oracle.load_golden(type_name, case, x.shape)
    assert want is not None, f"missing golden file for {type_name} {case}: run python tests/quantize_cases.py"
    got, counts = fc.quantize_counts(x, fmt)
    assert counts == golden_counts(fmt, case, x)
    np.testing.assert_array_equal(got, want)


@live
@pytest.mark.parametrize("type_name,case", [(t, c) for t in GOLDEN for c in GOLDEN[t]()])
def test_golden_files_are_ggml_today(type_name, case):
    x = GOLDEN[type_name]()[case]
    np.testing.assert_array_equal(ggml_oracle.quantize(x, type_name),
                                  ggml_oracle.load_golden(type_name, case, x.shape))


@live
@pytest.mark.parametrize("type_name,case", [(t, c) for t in LIVE for c in LIVE[t]])
def test_quantize_matches_ggml_live(type_name, case):
    x = LIVE[type_name][case]()
    got = fc.quantize_counts(x, FORMATS[type_name])[0]
    np.testing.assert_array_equal(got, ggml_oracle.quantize(x, type_name))


def test_every_writable_quantized_type_is_compared_with_ggml():
    assert {f.name for f in QUANTIZED if f.quantize is not None} <= set(GOLDEN) | set(LIVE)


@pytest.mark.parametrize("type_name", GGUF_PY_QUANTIZES)
@pytest.mark.parametrize("case", ["random", "uniform", "edge"])
def test_quantize_matches_gguf_py(type_name, case):
    x = small_cases()[case]
    fmt = FORMATS[type_name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # gguf-py warns on denormal scales
        ref = gguf_quantize(x, G[type_name]).view(np.uint8).reshape(x.shape[0], -1)
    got = quantize(x, type_name)
    assert got.shape == (x.shape[0], fmt.row_bytes(x.shape[1]))
    if type_name in ("Q4_0", "Q5_0"):
        # gguf-py and ggml differ in one place: an all-zero block whose first element is
        # -0.0 gets d = +0.0 from gguf-py, -0.0 from ggml (what llama-quantize writes): ours
        zero = ~x.reshape(-1, 32).any(axis=1) & np.signbit(x.reshape(-1, 32)[:, 0])
        ref = ref.copy()
        ref.reshape(-1, fmt.type_size)[zero, :2] = (0x00, 0x80)
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("fmt", ALL, ids=name)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_blocks_counted(fmt, bad):
    x = fc.normalish((3, 512), 5)
    x[1, 300] = bad
    x[2, 0] = bad
    assert fc.quantize_counts(x, fmt)[1][0] == 2       # (an inf may also overflow a scale)


@pytest.mark.parametrize("fmt", ALL, ids=name)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_refused_with_the_tensor_name(fmt, bad):
    x = np.zeros((2, unit(fmt) * 2), np.float32)
    x[1, 40] = bad
    with pytest.raises(EdgeError, match="blk.3.ffn_up.weight.*NaN or infinite"):
        quantize(x, fmt.name, "blk.3.ffn_up.weight")


# --- dequantize ----------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ALL, ids=name)
def test_dequantize_matches_gguf_py(fmt):
    # our bytes of a few inputs and of the golden cases (ggml's bytes), and for the
    # quantized types random blocks with finite scales (the f16 extremes among them, for
    # d and for a min's scale) and all-zero blocks
    xs = [small_cases()["random"], np.tile(small_edge_rows(), (1, 4))]
    xs += GOLDEN[fmt.name]().values() if fmt.name in GOLDEN else []
    qs = [q for q, counts in map(lambda x: fc.quantize_counts(x, fmt), xs)
          if counts == (0, 0)]                                 # (not inf scales)
    if fmt.block_size > 1:
        rng = np.random.default_rng(3)
        extremes = np.float16([65504, -65504, 2 ** -24, -(2 ** -24), 6.1e-5, 0, -0.0, 1, 1e-3, 3.14])
        qs.append(np.concatenate([fc.format_blocks(fmt, 64, rng),
                                  fc.format_blocks(fmt, 10, rng, extremes),
                                  fc.format_blocks(fmt, 10, rng, extremes[::-1], extremes),
                                  np.zeros((2, fmt.type_size), np.uint8)]))
    for q in qs:
        out = np.full(q.size // fmt.type_size * fmt.block_size, np.nan, np.float32)
        fmt.dequantize(q.reshape(-1), out)
        np.testing.assert_array_equal(out.view(np.uint32),
                                      fc.gguf_dequant(q, fmt).reshape(-1).view(np.uint32))


# --- runtime Linear ------------------------------------------------------------------------

def make_raw(fmt, shape, rng):
    """W (shape) in fmt as a file holds it (rows, row_bytes): random blocks, the first
    row's d an f16 subnormal; for the float types normal values, the first row tiny."""
    rows, n = shape
    if fmt.block_size == 1:
        w = rng.standard_normal(shape).astype(np.float32)
        w[0] *= 1e-6
        return fc.quantize_counts(w, fmt)[0]
    raw = fc.format_blocks(fmt, rows * n // fmt.block_size, rng).reshape(rows, -1)
    raw.reshape(rows, -1, fmt.type_size)[0, :, fc.SCALES[fmt.name][0] + 1] = 0
    return raw


def make(fmt, shape, seed=0):
    """(Linear of a random W in fmt, W as float64, the magnitude of its terms)."""
    raw = make_raw(fmt, shape, np.random.default_rng(seed))
    raw.setflags(write=False)                                    # read-only file views work
    lin = fmt.linear(fmt, [raw.reshape(-1)], [shape[0]], shape[1])
    return (lin, *fc.weight_parts(raw, fmt))


@pytest.mark.parametrize("fmt,shape", [(f, s) for f in ALL for s in shapes(f)],
                         ids=lambda v: v.name if hasattr(v, "name") else str(v))
def test_matvec(fmt, shape):
    lin, ref, mag = make(fmt, shape)
    assert (lin.out_features, lin.in_features, lin.type_name, lin.nbytes) == (
        *shape, fmt.name, shape[0] * fmt.row_bytes(shape[1]))
    x = np.random.default_rng(1).standard_normal(shape[1]).astype(np.float32)
    x[:32] *= 1e-3                                               # a small block of x
    x[-7] = 30.0                                                 # an outlier
    out = np.full(shape[0], np.nan, np.float32)
    lin.matvec(x, out)
    check(out, ref, x, decode_rounds(fmt), X_BLOCK, mag)


@pytest.mark.parametrize("fmt", ALL, ids=name)
@pytest.mark.parametrize("T", [1, 3])
def test_matvecs(fmt, T):
    # batched decode: rows of x with scales of their own, each as decode rounds it
    lin, ref, mag = make(fmt, (300, 2 * unit(fmt)))
    x = np.random.default_rng(2).standard_normal((T, lin.in_features)).astype(np.float32)
    x *= np.float32(10.0) ** np.arange(T, dtype=np.float32)[:, None]
    out = np.full((T, 300), np.nan, np.float32)
    lin.matvecs(x, out)
    check(out, ref, x, decode_rounds(fmt), X_BLOCK, mag)


@pytest.mark.parametrize("fmt", ALL, ids=name)
@pytest.mark.parametrize("T", [1, 7])
def test_matmul(fmt, T):
    lin, ref, mag = make(fmt, (300, 2 * unit(fmt)))
    fc.check_matmul(lin, ref, T, prefill_rounds(fmt), mag)


@pytest.mark.parametrize("fmt", ALL, ids=name)
def test_rows(fmt):
    lin, ref, _ = make(fmt, (300, 2 * unit(fmt)))
    fc.check_rows(lin, ref)


@pytest.mark.parametrize("fmt", ALL, ids=name)
def test_stacked(fmt):
    # q/k/v-like parts (150, 37, 37 rows: none a multiple of the tile size) as one W:
    # outputs split back, prefill, rows
    rng = np.random.default_rng(7)
    n = 2 * unit(fmt)
    raws = [make_raw(fmt, (s, n), rng) for s in (150, 37, 37)]
    lin = fmt.linear(fmt, [r.reshape(-1) for r in raws], [150, 37, 37], n)
    ref, mag = (np.concatenate(p) for p in zip(*(fc.weight_parts(r, fmt) for r in raws)))
    assert lin.out_features == 224 and lin.nbytes == sum(r.nbytes for r in raws)
    x = rng.standard_normal(n).astype(np.float32)
    out = np.full(224, np.nan, np.float32)
    lin.matvec(x, out)
    check(out, ref, x, decode_rounds(fmt), X_BLOCK, mag)
    assert [o.shape for o in lin.split(out)] == [(150,), (37,), (37,)]
    xs = rng.standard_normal((3, n)).astype(np.float32)
    outs = np.full((3, 224), np.nan, np.float32)
    lin.matmul(xs, outs)
    check(outs, ref, xs, prefill_rounds(fmt), 32, mag)
    assert lin.split(outs)[2].shape == (3, 37)
    ids = np.array([0, 149, 150, 186, 187, 223])
    rows = np.empty((ids.size, n), np.float32)
    lin.rows(ids, rows)
    np.testing.assert_array_equal(rows, ref[ids].astype(np.float32))


@pytest.mark.parametrize("fmt", ALL, ids=name)
def test_bad_size(fmt):
    n = unit(fmt)
    with pytest.raises(ValueError, match="needs"):
        fmt.linear(fmt, [np.zeros(fmt.row_bytes(n) * 3 - 1, np.uint8)], [3], n)
    if fmt.block_size > 1:
        with pytest.raises(ValueError, match=f"multiple of {fmt.block_size}"):
            fmt.linear(fmt, [np.zeros(fmt.type_size, np.uint8)], [1], fmt.block_size // 2)
