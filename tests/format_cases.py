"""What the weight-format tests share: portable inputs, calls into a format's reference
kernels, and the runtime-Linear checks against a plain NumPy twin (W dequantized by
gguf-py, then x @ W.T in float64).

Linear tolerance: every kernel sums float32 products, so the error of one output is at
most about n * eps32 * sum_i |w_i x_i| (worst case), typically far less: we allow
64 * eps32 * (|W| @ |x|), a bound that does not grow with these small n. Decode kernels
that round x to int8 per `block` weights (scale amax/127) move each x_i by at most
amax_block(i) / 254, and so the output by at most |U| @ that, U the part of W multiplied
by the rounded x (W itself unless a format says otherwise); `check` adds that bound.
"""
import warnings

import ggml_oracle
import numpy as np
import pytest
from gguf import GGMLQuantizationType as G
from gguf.quants import dequantize as ref_dequantize

EPS = float(np.finfo(np.float32).eps)
live = pytest.mark.skipif(not ggml_oracle.available(), reason="llama-cpp-python not installed")


# --- inputs made with exact integer arithmetic (no RNG stream, no libm): the golden files'
# inputs are the same on every machine and NumPy version ---------------------------------

def u24(count: int, seed: int) -> np.ndarray:
    """splitmix64 of a counter -> 24-bit integers as float64 (exact, portable)."""
    z = (np.arange(count, dtype=np.uint64) + np.uint64(seed << 32)) * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return ((z ^ (z >> np.uint64(31))) >> np.uint64(40)).astype(np.float64)


def normalish(shape, seed: int) -> np.ndarray:
    """Roughly N(0, 1): a sum of four uniforms on a 2^-24 grid (exact in float64)."""
    n = int(np.prod(shape))
    u = u24(4 * n, seed).reshape(4, n).sum(0) * 2.0 ** -24
    return ((u - 2.0) * 1.75).reshape(shape).astype(np.float32)


def extreme_activations(n: int, rng: np.random.Generator) -> list[np.ndarray]:
    """x (n,) f32 already on each block's int8 grid (amax 127 * 2^-5, no rounding): all
    +127, all -127, and random codes; the decode kernels' widest integer sums."""
    out = []
    for x in (np.full(n, 127, np.float32), np.full(n, -127, np.float32),
              rng.integers(-127, 128, n).astype(np.float32)):
        x[::32] = 127
        out.append(x * np.float32(2.0 ** -5))
    return out


# --- a format's reference kernels -----------------------------------------------------------

def gguf_dequant(q, fmt) -> np.ndarray:
    """gguf-py's values of the blocks q of format fmt (float32)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)    # inf scales in extreme cases
        return np.asarray(ref_dequantize(q, G[fmt.name]), np.float32)


def quantize_counts(x, fmt):
    """(fmt's bytes of x (rows, row_bytes), its (bad, over) counts), written over garbage:
    every byte must be written."""
    out = np.full(x.size // fmt.block_size * fmt.type_size, 0xAA, np.uint8)
    counts = fmt.quantize(x.reshape(-1), out)
    return out.reshape(x.shape[0], -1), counts


def random_blocks(nb, rng, fmt, d_values=None, d_at=0, m_at=None):
    """nb blocks of random bytes with a finite f16 d at byte d_at (from d_values, else
    around 1e-2) and, if m_at is given, a finite f16 m there."""
    q = rng.integers(0, 256, (nb, fmt.type_size), dtype=np.uint8)
    if d_values is None:
        d_values = rng.standard_normal(nb) * 1e-2
    q[:, d_at:d_at + 2] = np.asarray(d_values, np.float16).reshape(nb, 1).view(np.uint8)
    if m_at is not None:
        q[:, m_at:m_at + 2] = np.float16(rng.standard_normal((nb, 1))).view(np.uint8)
    return q


# Byte offsets in a block of its f16 scales: d first, then the min's scale (m, dmin) of
# the formats with one. Random blocks get finite values there.
SCALES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q5_0": (0,), "Q5_1": (0, 2),
          "IQ4_NL": (0,), "IQ4_XS": (0,), "Q2_K": (80, 82), "Q3_K": (108,),
          "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def format_blocks(fmt, nb, rng, d_values=None, m_values=None):
    """nb blocks of fmt: random bytes, finite f16 scales (d from d_values, else around
    1e-2; a min's scale from m_values, else around 1e-2), as random_blocks."""
    halves = SCALES[fmt.name]
    q = random_blocks(nb, rng, fmt, d_values, halves[0], halves[1] if len(halves) > 1 else None)
    if m_values is not None and len(halves) > 1:
        q[:, halves[1]:halves[1] + 2] = np.asarray(m_values, np.float16).reshape(nb, 1).view(np.uint8)
    return q


def weight_parts(raw, fmt):
    """The blocks raw (rows, row_bytes) as gguf-py's W (float64) and the magnitude of
    what a kernel sums per weight: |W|, or for a format with a min (w = d q + m, or
    d sc q - dmin m) |the q part| + |the min part|, each from gguf-py with the other's
    scale zeroed."""
    rows = raw.shape[0]
    w = gguf_dequant(raw, fmt).astype(np.float64).reshape(rows, -1)
    halves = SCALES.get(fmt.name, ())
    if len(halves) < 2:
        return w, np.abs(w)
    parts = []
    for zero in (halves[1], halves[0]):
        b = raw.reshape(-1, fmt.type_size).copy()
        b[:, zero:zero + 2] = 0
        parts.append(gguf_dequant(b, fmt).astype(np.float64).reshape(rows, -1))
    return w, np.abs(parts[0]) + np.abs(parts[1])


# --- runtime Linear -------------------------------------------------------------------------

def bf16_round(x):
    """x (f32) rounded to bf16 as ggml_compute_fp32_to_bf16 rounds it (nearest even; NaN a
    quiet NaN), as f32: what BF16 weights' prefill on the pair products multiplies
    (float_gemm.bf16_gemm)."""
    x = np.asarray(x, np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint32)
    nan = (x.view(np.uint32) & 0x7FFFFFFF) > 0x7F800000
    r[nan] = (x.view(np.uint32)[nan] >> 16) | 64
    return (r << 16).view(np.float32)


def check(got, ref_w, x, x_quantized=False, block=32, mag=None):
    """got = x @ ref_w.T to float32 accuracy; x_quantized: x was rounded to int8 per
    block (True) or to bf16 ("bf16": then got = bf16(x) @ ref_w.T to float32 accuracy).
    mag (default |ref_w|): the magnitude of what a kernel sums per weight, where that is
    more than |w| (a format with a min sums d q x and m x apart: |d q| + |m|)."""
    if x_quantized == "bf16":
        x, x_quantized = bf16_round(x), False
    want = x.astype(np.float64) @ ref_w.T
    mag = np.abs(ref_w) if mag is None else mag
    tol = 64 * EPS * (np.abs(x) @ mag.T) + 1e-30
    if x_quantized:   # x (n,) or (T, n), rounded per block of each row
        step = np.repeat(np.abs(x).reshape(-1, block).max(1), block).reshape(x.shape) / 254
        tol += step @ mag.T * 1.01
    assert got.shape == want.shape
    assert np.all(np.abs(got - want) <= tol), np.max(np.abs(got - want) / tol)


def check_matmul(lin, ref_w, T, x_quantized=False, mag=None):
    """Prefill of T tokens; x_quantized: the format's prefill rounds x to int8 per block
    (formats.records.RecordLinear) or to bf16 ("bf16")."""
    rows, n = ref_w.shape
    x = np.random.default_rng(2).standard_normal((T, n)).astype(np.float32)
    out = np.full((T, rows), np.nan, np.float32)
    lin.matmul(x, out)
    check(out, ref_w, x, x_quantized=x_quantized, mag=mag)


def check_rows(lin, ref_w):
    """Embedding lookup: gguf-py's values bit for bit (the sign of zeros too); a row past
    the end refused."""
    rows, n = ref_w.shape
    ids = np.array([0, rows - 1, 5, 5, 128, 64, 255], np.int64)
    out = np.full((ids.size, n), np.nan, np.float32)
    lin.rows(ids, out)
    want = ref_w[ids].astype(np.float32)
    np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))
    with pytest.raises(IndexError):
        lin.rows(np.array([rows]), out[:1])
