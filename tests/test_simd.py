"""simd.nib_dot, i8_dot and the tile intrinsics (quads_gemm, q6_gemm, q4k_gemm),
in each instruction set (all are compiled here; the CPU must have the instructions to run
them, so the VNNI and AVX2 cases skip elsewhere), against a NumPy twin."""
import numpy as np
import pytest
from numba import literally, njit

from edgellama.simd import (AVX2, GENERIC, ISA, KIND_Q4_0, KIND_Q4_1, KIND_Q8_0, Q4K_D, Q4K_DMIN,
                            Q4K_M, Q4K_QS, Q4K_RECORD, Q4K_SC, Q5K_QH, Q5K_RECORD, Q6K_D, Q6K_QS,
                            Q6K_RECORD, Q6K_SC, RECORD_ROWS, TOKENS, VNNI512, host_isa, i8_dot,
                            nib_dot, q4k_gemm, q6_gemm, quads_gemm)

import llvmlite.binding as llvm

_F = llvm.get_host_cpu_features()
RUNS = {GENERIC: True, AVX2: bool(_F.get("avx2")),
        VNNI512: bool(_F.get("avx512vnni") and _F.get("avx512bw"))}


@njit
def _dot(q, o, x8, xo, acc, R, isa):
    # literally: one compiled entry per instruction set (the intrinsic wants a constant)
    nib_dot(q, o, x8, xo, acc, R, literally(isa))


def twin(q, o, x8, xo, R):
    """sum over 32 weights of nibble * x8 per row; byte i of row r at o + 4R(i//4) + 4r + i%4."""
    i = np.arange(16)
    idx = o + 4 * R * (i // 4)[None, :] + 4 * np.arange(R)[:, None] + (i % 4)[None, :]
    v = q[idx].astype(np.int64)
    x = x8.astype(np.int64)
    return (v & 15) @ x[xo:xo + 16] + (v >> 4) @ x[xo + 16:xo + 32]


def test_host_isa_is_what_the_kernels_use():
    assert ISA == host_isa() and RUNS[ISA]


@pytest.mark.parametrize("isa", [GENERIC, AVX2, VNNI512])
@pytest.mark.parametrize("R", [16, 32, 256])
def test_random_blocks_at_odd_offsets(isa, R):
    if not RUNS[isa]:
        pytest.skip("this CPU lacks the instructions")
    rng = np.random.default_rng(R + isa)
    q = rng.integers(0, 256, 16 * R + 64, dtype=np.uint8)
    x8 = rng.integers(-127, 128, 80, dtype=np.int8)
    for o, xo in [(0, 0), (7, 3), (33, 45)]:
        acc = np.full(R, 12345, np.int32)          # overwritten, not added to
        _dot(q, o, x8, xo, acc, R, isa)
        np.testing.assert_array_equal(acc, twin(q, o, x8, xo, R))


@pytest.mark.parametrize("isa", [GENERIC, AVX2, VNNI512])
@pytest.mark.parametrize("xval", [127, -127])
def test_extremes_are_exact(isa, xval):
    # every nibble 15, every x at the int8 bound: the largest sums, where int16
    # intermediate sums (AVX2, generic) would overflow if they were not bounded
    if not RUNS[isa]:
        pytest.skip("this CPU lacks the instructions")
    R = 16
    q = np.full(16 * R, 255, np.uint8)
    x8 = np.full(32, xval, np.int8)
    acc = np.zeros(R, np.int32)
    _dot(q, 0, x8, 0, acc, R, isa)
    assert (acc == 32 * 15 * xval).all()


@njit
def _dot8(q, o, x8, xo, acc, R, isa):
    i8_dot(q, o, x8, xo, acc, R, literally(isa))


def twin8(q, o, x8, xo, R):
    """sum over 32 int8 weights of w * x8 per row; byte j of row r at o + 4R(j//4) + 4r + j%4."""
    j = np.arange(32)
    idx = o + 4 * R * (j // 4)[None, :] + 4 * np.arange(R)[:, None] + (j % 4)[None, :]
    return q[idx].astype(np.int64) @ x8[xo:xo + 32].astype(np.int64)


@pytest.mark.parametrize("isa", [GENERIC, AVX2, VNNI512])
@pytest.mark.parametrize("R", [16, 32, 256])
def test_int8_random_blocks_at_odd_offsets(isa, R):
    if not RUNS[isa]:
        pytest.skip("this CPU lacks the instructions")
    rng = np.random.default_rng(R + isa)
    q = rng.integers(-128, 128, 32 * R + 64, dtype=np.int8)
    x8 = rng.integers(-127, 128, 80, dtype=np.int8)
    for o, xo in [(0, 0), (5, 3), (33, 45)]:
        acc = np.full(R, 12345, np.int32)
        _dot8(q, o, x8, xo, acc, R, isa)
        np.testing.assert_array_equal(acc, twin8(q, o, x8, xo, R))


@pytest.mark.parametrize("isa", [GENERIC, AVX2, VNNI512])
@pytest.mark.parametrize("w,x", [(-128, -127), (-128, 127), (127, 127), (127, -127)])
def test_int8_extremes_are_exact(isa, w, x):
    # -128 weights (no int8 negation) at the bounds of x: pair sums at the int16 edge
    if not RUNS[isa]:
        pytest.skip("this CPU lacks the instructions")
    R = 16
    acc = np.zeros(R, np.int32)
    _dot8(np.full(32 * R, w, np.int8), 0, np.full(32, x, np.int8), 0, acc, R, isa)
    assert (acc == 32 * w * x).all()


# --- quads_gemm: a tile of a per-32-block format times TOKENS rows of x ----------------------

@njit
def _gemm(kind, q, d, m, x8, xd, xs8, xsum, acc, nb, t0, isa):
    quads_gemm(q, d, m, x8, xd, xs8, xsum, acc, nb, t0, literally(kind), literally(isa))


@pytest.mark.parametrize("isa", [GENERIC, AVX2, VNNI512])
@pytest.mark.parametrize("kind", [KIND_Q4_0, KIND_Q4_1, KIND_Q8_0], ids=["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("extreme", [False, True], ids=["random", "bounds"])
def test_quads_gemm_matches_twin(isa, kind, extreme):
    if not RUNS[isa]:
        pytest.skip("this CPU lacks the instructions")
    R, nb, T, t0 = 32, 5, 2 * TOKENS, TOKENS       # the second group of TOKENS rows
    rng = np.random.default_rng(10 * isa + kind)
    bb = 32 if kind == KIND_Q8_0 else 16
    if extreme:      # all-15 nibbles / -128 weights against x at +-127
        q = np.full(bb * nb * R, 0x80 if kind == KIND_Q8_0 else 0xFF, np.uint8)
        x8 = np.where(rng.random((T, 32 * nb)) < 0.5, -127, 127).astype(np.int8)
    else:
        q = rng.integers(0, 256, bb * nb * R, dtype=np.uint8)
        x8 = rng.integers(-127, 128, (T, 32 * nb), dtype=np.int8)
    d = rng.standard_normal(nb * R).astype(np.float16)
    m = rng.standard_normal(nb * R).astype(np.float16)
    xd = rng.random((T, nb)).astype(np.float32)
    xs8 = x8.reshape(T, nb, 32).astype(np.int32).sum(axis=2)
    xsum = rng.standard_normal((T, nb)).astype(np.float32)
    acc = np.full(TOKENS * R, 7, np.float32)
    _gemm(kind, q, d.view(np.uint16), m.view(np.uint16), x8.reshape(-1), xd.reshape(-1),
          xs8.reshape(-1), xsum.reshape(-1), acc, nb, t0, isa)
    for k in range(TOKENS):
        tok = t0 + k
        want = np.zeros(R)
        for b in range(nb):
            xo = tok * 32 * nb + 32 * b
            dd, mm = d[b * R:(b + 1) * R].astype(np.float64), m[b * R:(b + 1) * R].astype(np.float64)
            if kind == KIND_Q8_0:
                S = twin8(q.view(np.int8), 32 * b * R, x8.reshape(-1), xo, R)
            else:
                S = twin(q, 16 * b * R, x8.reshape(-1), xo, R)
            if kind == KIND_Q4_0:
                S = S - 8 * xs8[tok, b]
            want += dd * xd[tok, b] * S + (mm * xsum[tok, b] if kind == KIND_Q4_1 else 0)
        np.testing.assert_allclose(acc[k * R:(k + 1) * R], want, rtol=2e-5,
                                   atol=2e-5 * np.abs(want).max())


# --- q6_gemm: Q6_K records (per 16 rows and super-block: d, int8 scales, nibble and crumb quads)

@njit
def _gemm6(q, x8, xd, xs16, acc, nsub, t0, tokens, isa):
    q6_gemm(q, x8, xd, xs16, acc, nsub, t0, literally(tokens), literally(isa))


def q6_records(d, sc, vals):
    """A tile of Q6_K records from per-row values: d (R, nsb) f16, sc (R, nsub, 2) i8 (the
    scales of elements 0..15 and 16..31 of each block), vals (R, nsub, 32) the 6-bit q."""
    R, nsb = d.shape
    rec = np.zeros((R // RECORD_ROWS, nsb, Q6K_RECORD), np.uint8)
    nib = (vals[:, :, :16] & 15) | ((vals[:, :, 16:] & 15) << 4)                 # (R, nsub, 16)
    hi = vals >> 4
    crumb = hi[:, :, :8] | (hi[:, :, 8:16] << 2) | (hi[:, :, 16:24] << 4) | (hi[:, :, 24:] << 6)
    for r in range(R):
        s, lane = divmod(r, RECORD_ROWS)
        for b in range(nsb):
            out = rec[s, b]
            out[Q6K_D + 2 * lane:Q6K_D + 2 * lane + 2] = d[r, b:b + 1].view(np.uint8)
            for k in range(8):
                u = 8 * b + k
                out[Q6K_SC + 32 * k + lane] = sc[r, u, 0].view(np.uint8)
                out[Q6K_SC + 32 * k + 16 + lane] = sc[r, u, 1].view(np.uint8)
                o = Q6K_QS + 384 * k + 4 * lane
                for j in range(16):
                    out[o + 64 * (j // 4) + j % 4] = nib[r, u, j]
                for j in range(8):
                    out[o + 256 + 64 * (j // 4) + j % 4] = crumb[r, u, j]
    return rec.reshape(-1)


def gemm6_case(isa, R, tokens, case):
    """q6_gemm's acc for a random tile of R rows, 2 super-blocks, and `tokens` rows t0.. of
    x, and its float64 twin: per super-block d sum_u dx_u S_u, S_u = sum over block u's
    halves of scale * sum((q - 32) x8). case "exact": d and the x scales 1 or 2 and
    |x8| <= 15, so every f32 step is exact; "q63", "q0": every q 63 or 0 against
    x8 = +-127 and scales at the int8 bounds, the largest sums (vpmaddubsw pairs at
    2 * 63 * 127, summed two by two in int16); "random"."""
    nsub, t0 = 16, tokens                           # the second group of rows of x
    T = 2 * tokens
    rng = np.random.default_rng(10 * isa + R + tokens)
    vals = rng.integers(0, 64, (R, nsub, 32))
    sc = rng.integers(-128, 128, (R, nsub, 2)).astype(np.int8)
    x8 = rng.integers(-127, 128, (T, 32 * nsub), dtype=np.int8)
    d = rng.standard_normal((R, nsub // 8)).astype(np.float16)
    xd = rng.random((T, nsub)).astype(np.float32)
    if case == "exact":                        # every sum an integer below 2^24
        x8 = rng.integers(-15, 16, x8.shape, dtype=np.int8)
        d = (2.0 ** rng.integers(0, 2, d.shape)).astype(np.float16)
        xd = (2.0 ** rng.integers(0, 2, xd.shape)).astype(np.float32)
    elif case in ("q63", "q0"):
        vals[:] = 63 if case == "q63" else 0
        sc = np.where(rng.random(sc.shape) < 0.5, -128, 127).astype(np.int8)
        x8 = np.where(rng.random(x8.shape) < 0.5, -127, 127).astype(np.int8)
        d[:] = 1
        xd[:] = 1
    xs16 = x8.reshape(T, 2 * nsub, 16).astype(np.int32).sum(axis=2)
    acc = np.full(tokens * R, 7, np.float32)
    _gemm6(q6_records(d, sc, vals), x8.reshape(-1), xd.reshape(-1), xs16.reshape(-1), acc,
           nsub, t0, tokens, isa)
    want = np.zeros((tokens, R))
    for k in range(tokens):
        tok = t0 + k
        xh = x8[tok].reshape(nsub, 2, 16).astype(np.int64)
        S = (sc.astype(np.int64)
             * np.einsum("ruhe,uhe->ruh", vals.reshape(R, nsub, 2, 16) - 32, xh)).sum(axis=2)
        blocks = (xd[tok].astype(np.float64) * S).reshape(R, nsub // 8, 8).sum(axis=2)
        want[k] = (d.astype(np.float64) * blocks).sum(axis=1)
    return acc.reshape(tokens, R), want


@pytest.mark.parametrize("isa", [GENERIC, AVX2, VNNI512])
@pytest.mark.parametrize("R", [16, 32, 256])
@pytest.mark.parametrize("tokens", [1, TOKENS])
@pytest.mark.parametrize("case", ["exact", "q63", "q0", "random"])
def test_q6_gemm_matches_twin(isa, R, tokens, case):
    if not RUNS[isa]:
        pytest.skip("this CPU lacks the instructions")
    got, want = gemm6_case(isa, R, tokens, case)
    if case == "exact":
        np.testing.assert_array_equal(got, want)
    elif case == "random":
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    else:   # sums past 2^24 round in f32; an int16 or int32 overflow would be off by 2^15+
        np.testing.assert_allclose(got, want, rtol=1e-6)


# --- q4k_gemm: Q4_K and Q5_K records (per 16 rows and super-block: d, dmin, sc, m, nibble
# quads; Q5_K then its fifth bits) ----------------------------------------------------------

@njit
def _gemm4k(q, x8, xd, xsum, acc, nsub, t0, tokens, bits, isa):
    q4k_gemm(q, x8, xd, xsum, acc, nsub, t0, literally(tokens), literally(bits), literally(isa))


def k_records(d, dmin, sc, m, vals, bits):
    """A tile of Q4_K (bits 4) or Q5_K (bits 5) records from per-row values: d, dmin
    (R, nsb) f16; sc, m (R, nsub) u8; vals (R, nsub, 32) the levels of each sub-block."""
    R, nsb = d.shape
    size = Q4K_RECORD if bits == 4 else Q5K_RECORD
    rec = np.zeros((R // RECORD_ROWS, nsb, size), np.uint8)
    nib = (vals[:, :, :16] & 15) | ((vals[:, :, 16:] & 15) << 4)                 # (R, nsub, 16)
    for r in range(R):
        s, lane = divmod(r, RECORD_ROWS)
        for b in range(nsb):
            out = rec[s, b]
            out[Q4K_D + 2 * lane:Q4K_D + 2 * lane + 2] = d[r, b:b + 1].view(np.uint8)
            out[Q4K_DMIN + 2 * lane:Q4K_DMIN + 2 * lane + 2] = dmin[r, b:b + 1].view(np.uint8)
            for k in range(8):
                u = 8 * b + k
                out[Q4K_SC + 16 * k + lane] = sc[r, u]
                out[Q4K_M + 16 * k + lane] = m[r, u]
                for j in range(16):
                    out[Q4K_QS + 256 * k + 64 * (j // 4) + 4 * lane + j % 4] = nib[r, u, j]
                if bits == 5:       # bit 2g + h of byte i: the fifth bit of element 16h + 4g + i
                    for e in range(32):
                        h, g, i = e // 16, e % 16 // 4, e % 4
                        out[Q5K_QH + 64 * k + 4 * lane + i] |= (vals[r, u, e] >> 4) << (2 * g + h)
    return rec.reshape(-1)


def gemm4k_case(isa, R, tokens, bits, case):
    """q4k_gemm's acc for a random tile of R rows, 2 super-blocks, and `tokens` rows t0.. of
    x, and its float64 twin: per super-block d sum_u sc_u dx_u S_u - dmin sum_u m_u xsum_u,
    S_u the sum of the sub-block's levels times x8. case "exact": d, dmin and the x
    scales 1 or 2, |x8| <= 7, integer xsum, so every f32 step is exact; "bounds": every
    level at its maximum (15 or 31: AVX2's int16 pair sums at their largest), sc = m = 63,
    x8 = +-127; "random"."""
    nsub, t0 = 16, tokens                           # the second group of rows of x
    T = 2 * tokens
    rng = np.random.default_rng(10 * isa + R + tokens + bits)
    vals = rng.integers(0, 1 << bits, (R, nsub, 32))
    sc, m = rng.integers(0, 64, (2, R, nsub), dtype=np.uint8)
    x8 = rng.integers(-127, 128, (T, 32 * nsub), dtype=np.int8)
    d = rng.standard_normal((R, nsub // 8)).astype(np.float16)
    dmin = rng.standard_normal((R, nsub // 8)).astype(np.float16)
    xd = rng.random((T, nsub)).astype(np.float32)
    xsum = rng.standard_normal((T, nsub)).astype(np.float32)
    if case == "exact":                            # every sum an integer below 2^24
        x8 = rng.integers(-7, 8, x8.shape, dtype=np.int8)
        d = (2.0 ** rng.integers(0, 2, d.shape)).astype(np.float16)
        dmin = (2.0 ** rng.integers(0, 2, d.shape)).astype(np.float16)
        xd = (2.0 ** rng.integers(0, 2, xd.shape)).astype(np.float32)
        xsum = rng.integers(-50, 51, xsum.shape).astype(np.float32)
    elif case == "bounds":
        vals[:] = (1 << bits) - 1
        sc[:] = m[:] = 63
        x8 = np.where(rng.random(x8.shape) < 0.5, -127, 127).astype(np.int8)
    acc = np.full(tokens * R, 7, np.float32)
    _gemm4k(k_records(d, dmin, sc, m, vals, bits), x8.reshape(-1), xd.reshape(-1),
            xsum.reshape(-1), acc, nsub, t0, tokens, bits, isa)
    want = np.zeros((tokens, R))
    for k in range(tokens):
        tok = t0 + k
        S = np.einsum("rue,ue->ru", vals, x8[tok].reshape(nsub, 32).astype(np.int64))
        a1 = (sc * xd[tok] * S).reshape(R, nsub // 8, 8).sum(axis=2)
        a2 = (m * xsum[tok].astype(np.float64)).reshape(R, nsub // 8, 8).sum(axis=2)
        want[k] = (d.astype(np.float64) * a1 - dmin.astype(np.float64) * a2).sum(axis=1)
    return acc.reshape(tokens, R), want


@pytest.mark.parametrize("isa", [GENERIC, AVX2, VNNI512])
@pytest.mark.parametrize("R", [16, 32, 256])
@pytest.mark.parametrize("tokens", [1, TOKENS])
@pytest.mark.parametrize("bits", [4, 5])
@pytest.mark.parametrize("case", ["exact", "bounds", "random"])
def test_q4k_gemm_matches_twin(isa, R, tokens, bits, case):
    if not RUNS[isa]:
        pytest.skip("this CPU lacks the instructions")
    got, want = gemm4k_case(isa, R, tokens, bits, case)
    if case == "exact":
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
