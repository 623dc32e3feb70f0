"""Every quantized Linear against an exact model of its activation rounding.

The kernels round x to int8 per block (scale amax/127, round to nearest, as llama.cpp's
q8_0 / q8_K activations) and then add exact integer dot products. Whatever else they do
must cost no more than float32 rounding: the output is checked against x̂ W^T in float64,
x̂ the NumPy twin's rounded x, with the float tolerance only (64 eps32 |x̂| |W|). A path that
adds error beyond the int8 rounding fails here; format_cases.check, which allows the
whole rounding error, cannot see such a path (it let an exact float sum(x) in Q4_1's
min term pass, and with it answers six times further from full precision than llama.cpp's).

ACTIVATIONS says, per format, how decode and prefill round x: 32 or 256 (elements per
int8 block) or 0 (float activations: dequantize + BLAS).
"""
import numpy as np
import pytest

from edgellama.formats import FORMATS, linear
from edgellama.formats import quantize as quantize_rows
from edgellama.formats.records import RecordLinear

EPS = np.finfo(np.float32).eps

# format: (decode, prefill) activation blocks
ACTIVATIONS = {
    "Q4_0": (32, 32), "Q4_1": (32, 32), "Q5_0": (32, 32), "Q5_1": (32, 32), "Q8_0": (32, 32),
    "Q4_K": (32, 32), "Q5_K": (32, 32), "Q6_K": (32, 32),
    "IQ4_NL": (32, 32), "IQ4_XS": (32, 32), "Q2_K": (32, 32), "Q3_K": (32, 32),
}
QUANTIZED = [n for n, f in FORMATS.items() if f.block_size > 1]


def test_every_quantized_format_is_listed():
    assert sorted(ACTIVATIONS) == sorted(QUANTIZED)


def rounded_x(x: np.ndarray, block: int) -> np.ndarray:
    """x (..., n) f32 -> x̂ float64: per block, d = amax/127 (f32), q = rint(x * (1/d)),
    x̂ = d q; block 0: x itself."""
    if block == 0:
        return x.astype(np.float64)
    xb = x.reshape(*x.shape[:-1], -1, block)
    d = (np.abs(xb).max(-1, keepdims=True) / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d > 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = np.rint(xb * inv)
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(x.shape)


def weights(fmt_name: str, shape, rng) -> tuple[np.ndarray, np.ndarray]:
    """(the format's bytes of a W whose blocks have a mean far from zero, W dequantized
    float64). An offset per 32 weights makes every min term and zero point count."""
    rows, n = shape
    w = rng.standard_normal(shape).astype(np.float32)
    w += np.repeat(rng.uniform(-3, 3, (rows, n // 32)), 32, axis=1).astype(np.float32)
    raw = quantize_rows(w, fmt_name)
    fmt = FORMATS[fmt_name]
    ref = np.empty(raw.size // fmt.type_size * fmt.block_size, np.float32)
    fmt.dequantize(raw.reshape(-1), ref)
    return raw, ref.astype(np.float64).reshape(shape)


def activations(shape, rng) -> np.ndarray:
    """x with blocks of very different scales and an outlier, as hidden states have."""
    x = rng.standard_normal(shape).astype(np.float32)
    x *= np.repeat(np.exp(rng.uniform(-3, 3, (*shape[:-1], shape[-1] // 32))), 32, axis=-1
                   ).astype(np.float32)
    x[..., 5] = 40.0
    return x


def check_exact(got, ref_w, xh):
    want = xh @ ref_w.T
    tol = 64 * EPS * (np.abs(xh) @ np.abs(ref_w).T) + 1e-30
    err = np.abs(got.astype(np.float64) - want)
    assert np.all(err <= tol), f"error {np.max(err / tol):.1f}x the float32 bound"


@pytest.mark.parametrize("name", QUANTIZED)
def test_decode_is_exact_given_the_rounded_x(name):
    rng = np.random.default_rng(0)
    shape = (48, 512)
    raw, ref = weights(name, shape, rng)
    lin = linear(FORMATS[name].type_id, [(raw, shape)])
    for _ in range(3):
        x = activations(shape[1:], rng)
        out = np.full(shape[0], np.nan, np.float32)
        lin.matvec(x, out)
        check_exact(out, ref, rounded_x(x, ACTIVATIONS[name][0]))


@pytest.mark.parametrize("name", QUANTIZED)
def test_prefill_is_exact_given_the_rounded_x(name):
    rng = np.random.default_rng(1)
    shape = (48, 512)
    raw, ref = weights(name, shape, rng)
    lin = linear(FORMATS[name].type_id, [(raw, shape)])
    x = activations((9, shape[1]), rng)
    out = np.full((9, shape[0]), np.nan, np.float32)
    lin.matmul(x, out)
    check_exact(out, ref, rounded_x(x, ACTIVATIONS[name][1]))


def split_x(x: np.ndarray) -> np.ndarray:
    """x̂ of RecordLinear.fine: x rounded per 32, plus its float32 residual rounded per 32."""
    xh = rounded_x(x, 32)
    return xh + rounded_x(x - xh.astype(np.float32), 32)


RECORDS = [n for n in QUANTIZED if issubclass(FORMATS[n].linear, RecordLinear)]


def test_the_record_formats_are_the_ones_with_fine_activations():
    assert sorted(RECORDS) == ["IQ4_NL", "IQ4_XS", "Q2_K", "Q3_K", "Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K",
                               "Q6_K", "Q8_0"]



@pytest.mark.parametrize("name", RECORDS)
def test_fine_activations_are_exact_given_the_split_x(name):
    rng = np.random.default_rng(2)
    shape = (48, 512)
    raw, ref = weights(name, shape, rng)
    lin = linear(FORMATS[name].type_id, [(raw, shape)])
    lin.fine = True
    x = activations((5, shape[1]), rng)
    out = np.full((5, shape[0]), np.nan, np.float32)
    lin.matmul(x, out)
    check_exact(out, ref, split_x(x))
    vec = np.full(shape[0], np.nan, np.float32)
    lin.matvec(x[0], vec)
    check_exact(vec, ref, split_x(x[:1])[0])
    # the residual's rounding error is at most 1/254 of the first's: x̂ within xd/508
    xd = np.abs(x.reshape(5, -1, 32)).max(-1, keepdims=True) / 127
    assert np.all(np.abs(split_x(x) - x).reshape(5, -1, 32) <= xd / 508 * (1 + 1e-5) + 1e-12)
