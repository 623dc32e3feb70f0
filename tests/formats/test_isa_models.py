"""The integer steps of every row of isa.ISAS (its pair-dot lowering), modelled in NumPy.

test_simd runs the kernels only where Numba's target has the instructions (this machine
may lack AVX-512 VNNI, or AVX2). These models follow each lowering lane by lane — byte
products, the int16 pair sums vpmaddubsw saturates, the int16 additions of several of
them before widening, vpdpbusd's u8 x i8 with the x + 128 trick for signed weights — and
are checked against the exact dot over the extreme operands of every caller: Q8_0's
signed bytes, Q4's nibbles, Q5_K's 5-bit and Q6_K's 6-bit values, with the pair counts
the row lets one dot take (Isa.pairs_per_dot). A model that saturates or wraps shows the
caller's bound wrong. A new row needs its model in MODELS.
"""
import numpy as np
import pytest

from edgellama.formats.records import prep_q8_x
from edgellama.kernels import isa
from edgellama.kernels.simd import IQ4_BIAS, IQ4_VALUES, iq4_biased


def _sat16(v):
    return np.clip(v, -32768, 32767)


def _wrap16(v):
    return ((v + 32768) % 65536) - 32768


def vnni_dot(w, x, signed):
    """w (pairs, 4) weight bytes of one lane, x (pairs, 4) int8: vpdpbusd sums u8 x i8
    products in int32; signed weights: (x + 128) . w - 128 sum(w) (x xor 0x80 as u8)."""
    if not signed:
        return int((w.astype(np.int64) * x).sum())
    xu = (x.astype(np.int64) + 128)                    # x ^ 0x80 read as u8
    assert xu.min() >= 0 and xu.max() <= 255
    return int((xu * w).sum() - 128 * w.sum())


def avx2_dot(w, x, signed, per_int16, scale=1):
    """vpmaddubsw: u8 w x i8 x, adjacent products summed to int16 with saturation;
    signed weights as |w| x sign(x, w); then per_int16 such results are added in int16
    (wrapping) before vpmaddwd widens them (signed: each widened alone), multiplying
    each int16 by `scale` (unsigned: isa.scaled_dot's scale in both int16 halves of the
    lane; 1 for a plain dot) and adding the lane's two products in int32."""
    if signed:
        x = np.where(w < 0, -x.astype(np.int64), np.where(w == 0, 0, x))
        w = np.abs(w.astype(np.int64))
        assert w.max() <= 255
    prods = w.astype(np.int64) * x
    pairs = _sat16(prods[:, 0::2] + prods[:, 1::2])     # (pairs, 2) int16 per 32-bit lane
    if signed:
        return int(pairs.sum())
    assert -32768 <= scale <= 32767
    total = 0
    for p0 in range(0, len(pairs), per_int16):
        widened = int((_wrap16(pairs[p0:p0 + per_int16].sum(axis=0)) * scale).sum())
        assert -2 ** 31 <= widened < 2 ** 31
        total += widened
    return total


def generic_dot(w, x, signed, per_int16):
    """Widened to int32 before any sum: exact for any count of pairs."""
    return int((w.astype(np.int64) * x).sum())


# each row's model, by its lowering: (w, x, signed, pairs summed in int16) -> the sum
MODELS = {isa._dot_vnni: lambda w, x, signed, per16: vnni_dot(w, x, signed),
          isa._dot_avx2: avx2_dot, isa._dot_generic: generic_dot}

# (weight range, pairs the caller has per block and half), as simd.py calls the row's dot
CALLERS = {
    "Q8_0": ((-128, 127), 8),
    "Q4 nibbles": ((0, 15), 8),           # blocks_gemm, q4k_gemm bits 4
    "Q5 values": ((0, 31), 8),            # blocks_gemm Q5_0 / Q5_1, q4k_gemm bits 5
    "Q6_K": ((0, 63), 4),                 # _q6_sum, per half
    "Q3_K": ((0, 7), 4),                  # _q6_sum of q6_gemm's kind 3, per half
    "Q2_K": ((0, 3), 4),                  # _q6_sum of q6_gemm's kind 2, per half
}


def _extremes(lo, hi, pairs, rng):
    """Weight and x bytes (pairs, 4): every lane at the corners that make sums largest,
    then random ones; x in prep_q8_x's range [-127, 127]."""
    cases = []
    for wv in (lo, hi):
        for xv in (-127, 127):
            cases.append((np.full((pairs, 4), wv), np.full((pairs, 4), xv)))
    for _ in range(200):
        cases.append((rng.integers(lo, hi + 1, (pairs, 4)), rng.integers(-127, 128, (pairs, 4))))
    return cases


def test_every_row_has_a_model():
    assert all(row.pair_dot in MODELS for row in isa.ISAS)


@pytest.mark.parametrize("row", [pytest.param(r, id=r.name) for r in isa.ISAS])
@pytest.mark.parametrize("caller", CALLERS)
def test_every_isa_model_is_exact_at_the_callers_bounds(caller, row):
    (lo, hi), pairs = CALLERS[caller]
    signed = lo < 0
    # simd._dot_bounded: unsigned pairs in runs of pairs_per_dot, each run one dot (one
    # int16 sum on AVX2); signed ones all in one dot, which widens each pair (AVX2: 1)
    step = pairs if signed else row.pairs_per_dot(hi) or pairs
    model = MODELS[row.pair_dot]
    rng = np.random.default_rng(0)
    for w, x in _extremes(lo, hi, pairs, rng):
        exact = int((w.astype(np.int64) * x).sum())
        got = sum(model(w[p0:p0 + step], x[p0:p0 + step], signed, 1 if signed else step)
                  for p0 in range(0, pairs, step))
        assert got == exact


@pytest.mark.parametrize("row", [pytest.param(r, id=r.name) for r in isa.ISAS])
def test_every_isa_model_is_exact_for_iq4_values(row):
    # blocks_gemm's IQ4_NL: the looked-up values as bytes + 128, unsigned, less 128 sum(x)
    # where the row's unsigned dot is exact for any byte (iq4_biased); else signed int8
    pairs = 8
    model = MODELS[row.pair_dot]
    values = np.array(IQ4_VALUES)
    rng = np.random.default_rng(2)
    cases = [(np.full((pairs, 4), v), np.full((pairs, 4), xv)) for v in (-127, 113) for xv in (-127, 127)]
    cases += [(rng.choice(values, (pairs, 4)), rng.integers(-127, 128, (pairs, 4))) for _ in range(200)]
    for w, x in cases:
        exact = int((w.astype(np.int64) * x).sum())
        if iq4_biased(row):
            step = row.pairs_per_dot(255) or pairs
            got = sum(model(w[p0:p0 + step] + IQ4_BIAS, x[p0:p0 + step], False, step)
                      for p0 in range(0, pairs, step)) - IQ4_BIAS * int(x.sum())
        else:
            got = model(w, x, True, 1)
        assert got == exact


# q6_gemm's scaled dots (isa.Isa.scaled_dot, per half-block): (values, pairs, scales)
SCALED = {
    "Q6_K": ((0, 63), 4, (-128, 127)),
    "Q3_K": ((0, 7), 4, (-32, 31)),
    "Q2_K": ((0, 3), 4, (0, 15)),
}


def scaled_model(row, w, x, per16, scale):
    """row.scaled_dot's integer steps: AVX2 multiplies in its widening (avx2_dot's
    scale), the others multiply the int32 dot after."""
    if row.int16_pairs:
        return avx2_dot(w, x, False, per16, scale)
    got = scale * MODELS[row.pair_dot](w, x, False, per16)
    assert -2 ** 31 <= got < 2 ** 31
    return got


@pytest.mark.parametrize("row", [pytest.param(r, id=r.name) for r in isa.ISAS])
@pytest.mark.parametrize("caller", SCALED)
def test_every_scaled_dot_is_exact_at_the_callers_bounds(caller, row):
    (lo, hi), pairs, (smin, smax) = SCALED[caller]
    step = row.pairs_per_dot(hi) or pairs
    rng = np.random.default_rng(1)
    for w, x in _extremes(lo, hi, pairs, rng):
        for scale in (smin, smax, int(rng.integers(smin, smax + 1))):
            got = sum(scaled_model(row, w[p0:p0 + step], x[p0:p0 + step], step, scale)
                      for p0 in range(0, pairs, step))
            assert got == scale * int((w.astype(np.int64) * x).sum())


def test_the_models_see_a_bound_broken():
    # one more nibble pair per int16 sum, or 6-bit values four at a time, would wrap: the
    # models are not exact by construction
    w, x = np.full((4, 4), 63), np.full((4, 4), 127)
    assert avx2_dot(w, x, False, 4) != int((w * x).sum())
    w, x = np.full((9, 4), 15), np.full((9, 4), -127)
    assert avx2_dot(w, x, False, 9) != int((w * x).sum())
    # IQ4's biased bytes (up to 241) in vpmaddubsw's int16 pairs saturate: AVX2 takes them signed
    w, x = np.full((1, 4), 113 + IQ4_BIAS), np.full((1, 4), 127)
    assert avx2_dot(w, x, False, 1) != int((w * x).sum())
    # a scale past int16 in the widening would not be vpmaddwd's
    with pytest.raises(AssertionError):
        avx2_dot(np.full((1, 4), 3), np.full((1, 4), 127), False, 1, 40000)


def test_activations_never_reach_minus_128():
    # vpdpbusd's x + 128 and vpmaddubsw's sign(x, w) need x >= -127: prep_q8_x's rounding
    # of the block's largest |x| to exactly 127 keeps every x there
    rng = np.random.default_rng(1)
    x = rng.standard_normal(32 * 64).astype(np.float32)
    x[::32] = -np.float32(3.4e38)
    x[1::32] = -np.float32(1e-38)
    x[64:96] = -np.float32(2.0) ** np.arange(-20, 12, dtype=np.float32)
    x8 = np.empty(x.size, np.int8)
    nb = x.size // 32
    xd, xs8, xsum = np.empty(nb, np.float32), np.empty(nb, np.int32), np.empty(nb, np.float32)
    prep_q8_x(x, x8, xd, xs8, xsum)
    assert x8.min() >= -127 and x8.max() <= 127
    assert (np.abs(x8.reshape(nb, 32)).max(1) == 127).all()
