"""Numba quantizers are bit-identical to gguf-py's reference (`gguf.quants`)."""
import warnings

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as ref_dequantize
from gguf.quants import quantize as ref_quantize

import ggml_oracle
from edgellama.errors import EdgeError
from edgellama import formats as K
from edgellama.formats import FORMATS

TYPES = {"Q8_0": T.Q8_0, "Q4_0": T.Q4_0, "Q4_1": T.Q4_1, "F16": T.F16, "BF16": T.BF16}


def _edge_rows() -> np.ndarray:
    rng = np.random.default_rng(1)
    rows = [np.zeros(64), np.full(64, -0.0), np.full(64, 0.37), np.full(64, -0.37)]
    r = rng.normal(size=64) * 0.01
    r[5] = 1e3                                       # one huge outlier
    rows.append(r)
    rows += [rng.normal(size=64) * s for s in (1e-30, 1e-39, 1e-44)]   # tiny / denormal
    r = rng.normal(size=64)
    r[[3, 50]] = 2.5
    r[[9, 40]] = -2.5                                # ties for the largest magnitude
    rows.append(r)
    r = rng.normal(size=64)
    r[[1, 33]] = -3.0
    r[[2, 34]] = 3.0                                 # ties, negative first
    rows.append(r)
    rows.append(rng.integers(-8, 8, size=64) * 0.125)    # values exactly on the grid
    rows.append((rng.integers(0, 2, size=64) - 0.5) * 2 ** -20)
    rows.append(np.clip(rng.normal(size=64) * 3e4, -65504, 65504))   # f16 near its range
    rows.append(np.linspace(-1, 1, 64))
    return np.array(rows, np.float32)


def _cases():
    rng = np.random.default_rng(0)
    return {"random": rng.normal(size=(67, 256)).astype(np.float32),
            "uniform": rng.uniform(-5, 5, size=(9, 96)).astype(np.float32),
            "edge": _edge_rows()}


@pytest.mark.parametrize("fmt", list(TYPES))
@pytest.mark.parametrize("case", ["random", "uniform", "edge"])
def test_quantize_bit_exact(fmt, case):
    x = _cases()[case]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # the oracle warns on denormal scales
        ref = ref_quantize(x, TYPES[fmt]).view(np.uint8).reshape(x.shape[0], -1)
    got = K.quantize(x, fmt)
    assert got.shape == (x.shape[0], x.shape[1] // FORMATS[fmt].block_size * FORMATS[fmt].type_size)
    if fmt == "Q4_0":
        # gguf-py and ggml differ in one place: an all-zero block whose first element is
        # -0.0 gets d = +0.0 from gguf-py, -0.0 from ggml (what llama-quantize writes): ours
        zero = ~x.reshape(-1, 32).any(axis=1)
        d = ref.reshape(-1, 18)[:, :2].copy()
        d[zero & np.signbit(x.reshape(-1, 32)[:, 0])] = (0x00, 0x80)
        ref = ref.copy()
        ref.reshape(-1, 18)[:, :2] = d
    np.testing.assert_array_equal(got, ref)


@pytest.mark.skipif(not ggml_oracle.available(), reason="needs llama-cpp-python (oracle extra)")
@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0", "Q4_1"])
def test_quantize_matches_ggml(fmt):
    for x in _cases().values():
        np.testing.assert_array_equal(K.quantize(x, fmt), ggml_oracle.quantize(x, fmt))


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0", "Q4_1", "BF16", "F16"])
def test_dequantize_matches_reference(fmt):
    x = np.concatenate([_cases()["random"][:, :64], _edge_rows()])
    q = K.quantize(x, fmt)
    ref = ref_dequantize(q, TYPES[fmt])
    got = K.dequantize(q, fmt)
    np.testing.assert_array_equal(got.view(np.uint32), np.asarray(ref, np.float32).view(np.uint32))


def test_f16_rounding_all_boundaries():
    # every f16 value, and the f32 values just around each midpoint between neighbours
    h = np.arange(0, 0x7C00, dtype=np.uint16).view(np.float16).astype(np.float32)
    mid = ((h[:-1].astype(np.float64) + h[1:]) / 2).astype(np.float32)
    around = np.concatenate([h, mid, np.nextafter(mid, 0), np.nextafter(mid, 1), -mid,
                             np.float32([65519.0, 65504.0, 2 ** -25, 2 ** -26])])
    around = around[: around.size // 32 * 32]
    got = K.quantize(around[None, :], "F16").view(np.uint16)[0]
    np.testing.assert_array_equal(got, around.astype(np.float16).view(np.uint16))


@pytest.mark.parametrize("fmt", list(TYPES) + ["F32"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_raises(fmt, bad):
    x = np.zeros((2, 64), np.float32)
    x[1, 40] = bad
    with pytest.raises(EdgeError, match="blk.3.ffn_up.weight.*NaN or infinite"):
        K.quantize(x, fmt, "blk.3.ffn_up.weight")


@pytest.mark.parametrize("fmt,big", [("Q8_0", 1e7), ("Q4_0", 6e5), ("Q4_1", -7e4), ("F16", 7e4),
                                     ("BF16", 3.4e38)])
def test_scale_overflow_raises(fmt, big):
    x = np.zeros((1, 64), np.float32)
    x[0, 7] = big
    with pytest.raises(EdgeError, match="token_embd.weight: magnitude too large"):
        K.quantize(x, fmt, "token_embd.weight")


@pytest.mark.parametrize("fmt,big", [("Q8_0", 8e6), ("Q4_0", 5e5), ("Q4_1", 6e4), ("F16", 65500.0)])
def test_large_but_representable_is_fine(fmt, big):
    x = np.zeros((1, 64), np.float32)
    x[0, 7] = big
    ref = ref_quantize(x, TYPES[fmt]).view(np.uint8).reshape(1, -1)
    np.testing.assert_array_equal(K.quantize(x, fmt), ref)


def test_row_length_must_fit_blocks():
    with pytest.raises(EdgeError, match="not a multiple of 32"):
        K.quantize(np.zeros((2, 48), np.float32), "Q4_0", "w")


def test_bf16_to_f32_exact():
    bits = np.arange(0, 65536, 7, dtype=np.uint32).astype(np.uint16)
    out = K.dequantize(bits.view(np.uint8)[None, :], "BF16")
    np.testing.assert_array_equal(out[0].view(np.uint32), bits.astype(np.uint32) << 16)
