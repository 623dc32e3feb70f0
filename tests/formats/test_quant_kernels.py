"""formats.quantize / dequantize beyond what test_conformance.py checks of every
format: f16 rounding at every boundary, scale overflow refused with the tensor's name
and the largest representable values kept, row lengths, bf16 exactly."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize as ref_quantize

from edgellama import formats as K
from edgellama.errors import EdgeError

TYPES = {"Q8_0": T.Q8_0, "Q4_0": T.Q4_0, "Q4_1": T.Q4_1, "F16": T.F16, "BF16": T.BF16}


def test_f16_rounding_all_boundaries():
    # every f16 value, and the f32 values just around each midpoint between neighbours
    h = np.arange(0, 0x7C00, dtype=np.uint16).view(np.float16).astype(np.float32)
    mid = ((h[:-1].astype(np.float64) + h[1:]) / 2).astype(np.float32)
    around = np.concatenate([h, mid, np.nextafter(mid, 0), np.nextafter(mid, 1), -mid,
                             np.float32([65519.0, 65504.0, 2 ** -25, 2 ** -26])])
    around = around[: around.size // 32 * 32]
    got = K.quantize(around[None, :], "F16").view(np.uint16)[0]
    np.testing.assert_array_equal(got, around.astype(np.float16).view(np.uint16))


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


def test_bf16_writer_bits_and_counts_at_the_specials():
    # the writer's bits are gguf-py's (ggml's rounding) for inf, NaN and values that
    # round up to inf, not only for finite ones; quantize() refuses all of them, so the
    # counts are what tells it which message to give
    from edgellama.formats.floats import quantize_bf16
    x = np.float32([np.inf, -np.inf, np.nan, -np.nan, 3.4028235e38, -3.4028235e38,
                    3.3e38, 1.0, -0.0, 1e-40] * 4)
    x = np.concatenate([x, np.uint32([0x7F800001, 0xFFC00001, 0x7F7FFFFF, 0x00000001]).view(np.float32)])
    out = np.empty(x.size, np.uint16)
    bad, over = quantize_bf16(x, out.view(np.uint8))
    assert (bad, over) == (4 * 4 + 2, 4 * 2 + 1)
    ref = ref_quantize(x[None, :], T.BF16).view(np.uint16).reshape(-1)
    np.testing.assert_array_equal(out, ref)
