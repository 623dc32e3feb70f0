"""Q6_K: what is its own (test_conformance.py checks it against ggml, gguf-py and
the NumPy twin as every format): the counts of a block with NaN, inf or an overflowing
scale, the round-trip error, dequantizing the extreme codes, decode and prefill exact on
the int8 grid at the int32 extremes, the repack read back row by row, resident size.
"""
import format_cases as fc
import numpy as np
import pytest
from format_cases import check, extreme_activations
from quantize_cases import q6_k_cases

from edgellama.formats.q6_k import Q6_K


def gguf_dequant(q):
    return fc.gguf_dequant(q, Q6_K)


def quantize(x):
    return fc.quantize_counts(x, Q6_K)


# --- quantize ------------------------------------------------------------------------------

def test_quantize_counts_bad_blocks_and_overflow():
    x = np.random.default_rng(2).standard_normal((1, 1024)).astype(np.float32)
    x[0, 3] = np.nan
    x[0, 300] = np.inf
    x[0, 700] = 1e10                    # d = max_scale / 128 > 65504: f16 overflows
    assert quantize(x)[1] == (2, 1)


def test_quantize_round_trip_error():
    # a sanity bound independent of the oracle: each weight within its sub-block step
    x = q6_k_cases()["normal"]
    y = gguf_dequant(quantize(x)[0])
    step = np.abs(x.reshape(-1, 16)).max(1, keepdims=True) / 31
    assert np.all(np.abs(x.reshape(-1, 16) - y.reshape(-1, 16)) <= step)


# --- dequantize: gguf-py's bytes to floats -------------------------------------------------

def random_blocks(nb, rng, d_values=None):
    """nb Q6_K blocks of random bytes with finite f16 d (from d_values, else around 1e-2)."""
    return fc.random_blocks(nb, rng, Q6_K, d_values, d_at=208)


def test_dequantize_extreme_codes():
    q = np.concatenate([random_blocks(3, np.random.default_rng(3)), np.zeros((1, 210), np.uint8)])
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
    for x in extreme_activations(shape[1], rng):
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


def test_resident_size_is_file_size_and_padding():
    lin, _ = make((1030, 512))
    # 212 bytes per block of 256 (3392 per 16 rows: 32 of padding), pad rows incl.
    assert lin.q.nbytes == lin.nt * lin.R * 2 * 212
    assert lin.nt * lin.R - 1030 <= 1030 // 8
