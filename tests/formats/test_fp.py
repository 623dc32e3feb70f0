"""fp's half-precision conversions, over every f16 bit pattern and edge floats, against
NumPy: the one-instruction forms the host compiles, and the integer forms a target with no
such instruction (NUMBA_CPU_NAME=generic on x86) gets."""
import numpy as np
import pytest
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from edgellama.kernels.fp import _f32_to_f16_native, f16_bits, half_to_float_ir
from edgellama.kernels.target import HALF_NATIVE

ALL_HALVES = np.arange(65536, dtype=np.uint32).astype(np.uint16)


def _widen(native: bool, lanes: int):
    """An njit kernel out[i] = f32(h[i]) through half_to_float_ir, lanes at a time."""
    vi = ir.VectorType(ir.IntType(16), lanes)
    vf = ir.VectorType(ir.FloatType(), lanes)

    @intrinsic
    def widen(typingctx, h, out, i):
        def codegen(context, builder, sig, args):
            ha, oa = (context.make_array(t)(context, builder, a) for t, a in zip(sig.args[:2], args[:2]))
            src = builder.bitcast(builder.gep(ha.data, [args[2]]), vi.as_pointer())
            dst = builder.bitcast(builder.gep(oa.data, [args[2]]), vf.as_pointer())
            builder.store(half_to_float_ir(builder, builder.load(src, align=2), native), dst, align=4)
            return context.get_dummy_value()
        return types.none(h, out, i), codegen

    @njit
    def run(h, out):
        for i in range(0, h.size, lanes):
            widen(h, out, i)
    return run


@pytest.mark.parametrize("native", [pytest.param(True, marks=pytest.mark.skipif(
    not HALF_NATIVE, reason="this target has no f16 conversion instruction")), False])
@pytest.mark.parametrize("lanes", [1, 16])
def test_half_to_float_every_bit_pattern(native, lanes):
    out = np.empty(65536, np.float32)
    _widen(native, lanes)(ALL_HALVES, out)
    want = ALL_HALVES.view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(out), nan)
    np.testing.assert_array_equal(out[~nan].view(np.uint32), want[~nan].view(np.uint32))  # ±0 too
    assert np.all(np.signbit(out) == np.signbit(want))


def _edge_floats() -> np.ndarray:
    rng = np.random.default_rng(0)
    # every half, halfway points between neighbours (ties to even), values that round into
    # the next binade, subnormal and overflow edges, infinities, NaN, random bit patterns
    h = ALL_HALVES.view(np.float16)
    fin = np.sort(np.unique(h[np.isfinite(h)].astype(np.float32)))
    mids = (fin[:-1].astype(np.float64) + fin[1:]) / 2
    edges = np.array([65504, 65519.99, 65520, 65536, 1e30, 2 ** -24, 2 ** -25, 2 ** -25 * 1.0001,
                      2 ** -26, 2 ** -14, 2 ** -14 * (1 - 2 ** -12), np.inf, -np.inf, np.nan, 0.0, -0.0])
    return np.concatenate([fin, mids.astype(np.float32), np.nextafter(mids.astype(np.float32), 0),
                           edges.astype(np.float32), rng.integers(0, 2 ** 32, 200000, dtype=np.uint32)
                           .view(np.float32)]).astype(np.float32)


@pytest.mark.parametrize("conv", [pytest.param(_f32_to_f16_native, marks=pytest.mark.skipif(
    not HALF_NATIVE, reason="this target has no f16 conversion instruction")), f16_bits],
    ids=["native", "integer"])
def test_float_to_half_rounds_like_numpy(conv):
    @njit
    def run(x, out):
        for i in range(x.size):
            out[i] = conv(x[i])
    x = _edge_floats()
    out = np.empty(x.size, np.uint16)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
    run(x, out)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(out.view(np.float16)), nan)
    np.testing.assert_array_equal(out[~nan], want[~nan].view(np.uint16))
