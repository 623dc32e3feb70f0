"""IQ4_NL / IQ4_XS: what is their own (test_conformance.py checks them against
ggml, gguf-py and the NumPy twin as every format): the counts of a block with NaN, inf or
an overflowing scale, the round-trip error, the table lookup's ties, dequantizing the
extreme codes, decode exact on the int8 grid at the int16 edge, resident size.
"""
import format_cases as fc
import numpy as np
import pytest
from format_cases import check, extreme_activations, gguf_dequant
from format_cases import quantize_counts as quantize
from quantize_cases import iq4_cases

from edgellama.formats.iq4 import IQ4_NL, IQ4_XS, KVALUES, best_index

FORMATS = {"IQ4_NL": IQ4_NL, "IQ4_XS": IQ4_XS}


# --- quantize ------------------------------------------------------------------------------

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
    x = iq4_cases()["normal"]
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
def test_dequantize_extreme_codes(fmt):
    q = fc.format_blocks(fmt, 5, np.random.default_rng(3))
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
        raw = fc.format_blocks(fmt, rows * n // fmt.block_size, rng).reshape(rows, -1)
        blocks = raw.reshape(rows, -1, fmt.type_size)
        blocks[0, :, 1] = 0                                      # d = 2^-24 * k: f16 subnormal
    raw.setflags(write=False)                                    # read-only file views work
    lin = fmt.linear(fmt, [raw.reshape(-1)], [rows], n)
    return lin, gguf_dequant(raw, fmt).astype(np.float64).reshape(shape)


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS)
@pytest.mark.parametrize("rows", [300, 37])
def test_matvec_on_grid_is_exact_and_extremes(fmt, rows):
    # x on the int8 grid of every 32 (amax = 127 * 2^k): decode rounds nothing, so the
    # answer must be float-accurate. Weights at the table's ends (nibbles 0: -127,
    # 15: 113) with x = +-127 put each pair of table products at -+32258, the int16 edge,
    # and a block sum at 32 * 127 * 127.
    shape = (rows, 512)
    rng = np.random.default_rng(4)
    raw = fc.format_blocks(fmt, rows * 512 // fmt.block_size, rng).reshape(rows, -1, fmt.type_size)
    raw[:rows // 3, :, -16:] = 0
    raw[rows // 3:2 * rows // 3, :, -16:] = 0xFF
    if fmt is IQ4_XS:
        raw[:rows // 3, :, 8:] = 0
        raw[rows // 3:2 * rows // 3, :, 8:] = 0xFF
        raw[:rows // 2, :, 2:8] = 0                              # ls - 32 = -32
    lin, ref = make(fmt, shape, raw=raw.reshape(rows, -1))
    for x in extreme_activations(shape[1], rng):
        out = np.empty(shape[0], np.float32)
        lin.matvec(x, out)
        check(out, ref, x)


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS)
def test_resident_size_is_about_file_size(fmt):
    lin, _ = make(fmt, (1030, 512))
    tiles = sum(getattr(lin, name).nbytes for name in lin.tile_spec())
    per_row = 512 // fmt.block_size * fmt.type_size               # the file's bytes
    # IQ4_XS: records of 140 bytes a row per 256 weights (one i8 sub-scale per 32, 8
    # bytes where the file packs 6; 2 bytes of padding) where the file has 136
    assert tiles == lin.nt * lin.R * (per_row + (4 * 512 // 256 if fmt is IQ4_XS else 0))
