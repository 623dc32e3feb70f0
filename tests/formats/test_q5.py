"""Q5_0 / Q5_1: what is their own (test_conformance.py checks them against ggml,
gguf-py and the NumPy twin as every format): the counts of a block with NaN, inf or an
overflowing scale, the round-trip error, dequantizing the extreme codes, decode exact on
the int8 grid at the int16 edge, resident size.
"""
import format_cases as fc
import numpy as np
import pytest
from format_cases import check, extreme_activations, gguf_dequant
from format_cases import quantize_counts as quantize
from quantize_cases import q5_cases

from edgellama.formats.q5 import Q5_0, Q5_1

FORMATS = {"Q5_0": Q5_0, "Q5_1": Q5_1}


# --- quantize ------------------------------------------------------------------------------

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
    x = q5_cases()["normal"]
    y = gguf_dequant(quantize(x, FORMATS[fmt])[0], FORMATS[fmt])
    span = np.ptp(x.reshape(-1, 32), 1, keepdims=True)
    assert np.all(np.abs(x.reshape(-1, 32) - y.reshape(-1, 32)) <= span / 31)


# --- dequantize: gguf-py's bytes to floats -------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS)
def test_dequantize_extreme_codes(fmt):
    q = fc.format_blocks(fmt, 4, np.random.default_rng(3))
    h = 4 if fmt is Q5_1 else 2                                  # qh offset
    q[0, h:] = 0                                                 # every u = 0
    q[1, h:] = 0xFF                                              # every u = 31
    q[2, h:h + 4] = [0x55, 0xAA, 0x0F, 0xF0]                     # mixed high bits
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
        raw = fc.format_blocks(fmt, rows * n // 32, rng).reshape(rows, -1)
        blocks = raw.reshape(rows, -1, fmt.type_size)
        blocks[0, :, 1] = 0                                      # d = 2^-24 * k: f16 subnormal
    raw.setflags(write=False)                                    # read-only file views work
    lin = fmt.linear(fmt, [raw.reshape(-1)], [rows], n)
    return lin, gguf_dequant(raw, fmt).astype(np.float64).reshape(shape)


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS)
def test_matvec_on_grid_is_exact_and_int16_extremes(fmt):
    # x on the int8 grid of every 32 (amax = 127 * 2^k): decode rounds nothing, so the
    # answer must be float-accurate. Weights at the extremes: every u = 0 or 31 with
    # x = +-127, the largest pair sums (AVX2 adds u8 x i8 pairs in int16 lanes: 2 * 31 *
    # 127 a pair, so isa.pairs_per_dot(31) pairs a dot) and a block sum of 31 * 32 * 127.
    shape = (300, 256)
    rng = np.random.default_rng(4)
    raw = fc.format_blocks(fmt, shape[0] * 8, rng).reshape(shape[0], 8, fmt.type_size)
    h = 4 if fmt is Q5_1 else 2
    raw[:100, :, h:] = 0
    raw[100:200, :, h:] = 0xFF
    lin, ref = make(fmt, shape, raw=raw.reshape(shape[0], -1))
    for x in extreme_activations(shape[1], rng):
        out = np.empty(shape[0], np.float32)
        lin.matvec(x, out)
        check(out, ref, x)


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS)
def test_resident_size_is_file_size(fmt):
    lin, _ = make(fmt, (1030, 256))
    assert lin.q.nbytes == lin.nt * lin.R * 8 * fmt.type_size     # type_size per block, pad incl.
