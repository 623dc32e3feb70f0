"""Q4_K and Q5_K, the K-quants with 6-bit sub-block scales and mins: what is their own
(test_conformance.py checks them against ggml, gguf-py and the NumPy twin as
every format).

- quantize (ggml's quantize_row_q{4,5}_K_ref): overflowing scales counted, every level
  the nearest (independent of ggml).
- decode: the pair-dot sums exact at their int16 bounds, the blocks built field by field.
"""
import numpy as np
import pytest
from format_cases import EPS, normalish, u24
from gguf.quants import Q4_K as GQ4_K
from quantize_cases import K32_CASES as CASES

from edgellama.formats.q4_k import Q4_K
from edgellama.formats.q5_k import Q5_K

FMTS = {"Q4_K": Q4_K, "Q5_K": Q5_K}
NMAX = {"Q4_K": 15, "Q5_K": 31}


def quantize(x: np.ndarray, name: str) -> np.ndarray:
    f = FMTS[name]
    out = np.empty(x.size // 256 * f.type_size, np.uint8)
    bad, over = f.quantize(np.ascontiguousarray(x, np.float32).reshape(-1), out)
    assert (bad, over) == (0, 0)
    return out.reshape(x.shape[0], -1)


# --- quantize ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", FMTS)
def test_scale_overflow_counted(name):
    x = normalish((3, 512), 6)
    x[0, :256] *= 1e9                                    # d overflows f16
    x[2, 256:] = np.abs(x[2, 256:]) - 5e9               # dmin overflows f16
    out = np.empty(x.size // 256 * FMTS[name].type_size, np.uint8)
    assert FMTS[name].quantize(x.reshape(-1), out) == (0, 2)


@pytest.mark.parametrize("name", FMTS)
@pytest.mark.parametrize("case", CASES)
def test_levels_are_nearest(name, case):
    # independent of ggml: with the block's stored scale d sc and min dmin m, every level
    # strictly inside 0..nmax is the nearest one to (x + dmin m) / (d sc), and a level at
    # either end is on the right side (sub-blocks with d sc = 0 keep the search's levels)
    x = CASES[case]().astype(np.float64).reshape(-1, 8, 32)
    dsc, msc, lev = fields(quantize(x.reshape(-1, 256), name), name)
    r = x + msc[:, :, None] - lev * dsc[:, :, None]
    tol = 0.5 * dsc[:, :, None] * (1 + 1e-6) + 4 * EPS * (np.abs(x) + msc[:, :, None])
    live_ = np.broadcast_to(dsc[:, :, None] > 0, lev.shape)
    inner = live_ & (lev > 0) & (lev < NMAX[name])
    assert np.all(np.abs(r)[inner] <= tol[inner])
    assert np.all(r[live_ & (lev == 0)] <= tol[live_ & (lev == 0)])
    assert np.all(r[live_ & (lev == NMAX[name])] >= -tol[live_ & (lev == NMAX[name])])


# --- decode --------------------------------------------------------------------------------

def fields(q: np.ndarray, name: str):
    """(d sc, dmin m) (nb, 8) f64 and the levels (nb, 8, 32) of the blocks q (NumPy)."""
    nb = q.size // FMTS[name].type_size
    blk = q.reshape(nb, -1)
    d = blk[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blk[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = GQ4_K.get_scale_min(blk[:, 4:16])
    ql = blk[:, -128:].reshape(nb, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    lev = (ql & 15).reshape(nb, 8, 32).astype(np.int64)
    if name == "Q5_K":
        qh = blk[:, 16:48].reshape(nb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
        lev += 16 * (qh & 1).astype(np.int64)
    return ((d * sc.astype(np.float32)).astype(np.float64),
            (dmin * m.astype(np.float32)).astype(np.float64), lev)


def unpack(q: np.ndarray, name: str):
    """(d sc q, dmin m) per element of the blocks q (rows, row_bytes): W = A - B."""
    dsc, msc, lev = fields(q, name)
    a = dsc[:, :, None] * lev
    b = np.broadcast_to(msc[:, :, None], a.shape)
    return a.reshape(q.shape[0], -1), b.reshape(q.shape[0], -1)


def pack(name: str, d, dmin, sc, m, lev) -> np.ndarray:
    """Blocks from their fields (NumPy): d, dmin (nb,), sc, m (nb, 8) in 0..63, lev
    (nb, 256) in 0..NMAX; the layout gguf-py reads."""
    nb = lev.shape[0]
    sc = sc.astype(np.uint8)
    m = m.astype(np.uint8)
    scales = np.zeros((nb, 12), np.uint8)
    scales[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    lev = lev.astype(np.uint8).reshape(nb, 4, 2, 32)
    qs = ((lev[:, :, 0] & 15) | ((lev[:, :, 1] & 15) << 4)).reshape(nb, 128)
    parts = [np.asarray(d, np.float16).view(np.uint8).reshape(nb, 2),
             np.asarray(dmin, np.float16).view(np.uint8).reshape(nb, 2), scales]
    if name == "Q5_K":
        hi = (lev.reshape(nb, 8, 32) >> 4).astype(np.uint8)
        parts.append((hi << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1).astype(np.uint8))
    parts.append(qs)
    return np.concatenate(parts, axis=1)


def check(got, data, name, x):
    """got = x @ W.T of the blocks data to float32 accuracy (x on the int8 grid)."""
    a, b = unpack(data, name)
    w = a - b
    want = x.astype(np.float64) @ w.T
    tol = 64 * EPS * (np.abs(x) @ (a + b).T) + 1e-30
    assert got.shape == want.shape
    assert np.all(np.abs(got - want) <= tol), np.max(np.abs(got - want) / tol)


def grid_x(n: int, seed: int, sign=None) -> np.ndarray:
    # x on the int8 grid of every block of 32 (amax = 127 * 2^-5): decode rounds nothing
    k = (u24(n, seed) % 255 - 127) if sign is None else np.full(n, 127.0 * sign)
    k = k.reshape(-1, 32)
    k[:, 0] = 127
    return (k.reshape(-1) * 2.0 ** -5).astype(np.float32)


@pytest.mark.parametrize("name", FMTS)
def test_matvec_exact_at_int16_bounds(name):
    # Every level at its extreme, every scale at 63, x at +-127 on the int8 grid: the
    # pair-dot sums reach their bounds (AVX2's int16 pairs: Q4_K's 8 of 2 * 15 * 127,
    # Q5_K's 4 of 2 * 31 * 127). A sum that overflowed would be off by 2^16 d dx; without
    # rounding of x, only float summation error remains.
    nmax = NMAX[name]
    rows, n = 6, 512
    lev = np.zeros((rows, n), np.int64)
    lev[1] = nmax
    lev[2] = u24(n, 9) % (nmax + 1)                                 # random levels
    lev[3, ::2] = nmax                                               # alternating extremes
    lev[4, :256] = nmax
    lev[5] = np.where(np.arange(n) % 16 == 15, nmax, 0)              # every 16th
    nblk = rows * n // 256
    d = np.full(nblk, 2.0 ** -10)
    sc = np.full((nblk, 8), 63)
    m = np.tile([0, 63, 17, 63, 0, 1, 32, 63], (nblk, 1))
    data = pack(name, d, d * 0.5, sc, m, lev.reshape(nblk, 256)).reshape(rows, -1)
    f = FMTS[name]
    lin = f.linear(f, [data.reshape(-1)], [rows], n)
    for x in (grid_x(n, 0, 1), grid_x(n, 0, -1), grid_x(n, 10)):
        out = np.empty(rows, np.float32)
        lin.matvec(x, out)
        check(out, data, name, x)
