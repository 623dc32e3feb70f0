"""Q2_K: what is its own (test_conformance.py checks it against ggml, gguf-py and
the NumPy twin as every format; inputs and helpers shared with test_q3_k.py).

- quantize (ggml's quantize_row_q2_K_ref: make_qkx2_quants with nmax 3, rmin -0.5,
  rdelta 0.1, 15 steps, mean absolute error): overflowing scales counted, every level the
  nearest (independent of ggml).
- decode: W @ xq but for float rounding (as test_q3_k.py), the sums at their bounds;
  resident size (the file's); the embedding's rows.
- prefill: exact at the sums' bounds.
"""
import numpy as np
import pytest
from format_cases import EPS, normalish, u24
from gguf import GGMLQuantizationType as G
from gguf.quants import dequantize as gguf_dequantize
from test_q3_k import CASES, SHAPES, check_linear, check_rows, linear, quantize, resident_bytes

from edgellama.formats.q2_k import Q2_K


def parts(q, shape):
    """(d sc q, dmin m) of every weight, float64 (gguf-py with dmin, then d, zeroed)."""
    q = q.reshape(-1, 84)
    only_d, only_m = q.copy(), q.copy()
    only_d[:, 82:84] = 0
    only_m[:, 80:82] = 0
    return (gguf_dequantize(only_d, G.Q2_K).astype(np.float64).reshape(shape),
            -gguf_dequantize(only_m, G.Q2_K).astype(np.float64).reshape(shape))


def q2_mag(q, shape):
    dq, m = parts(q, shape)
    return np.abs(dq) + np.abs(m)


def test_scale_overflow_counted():
    x = normalish((4, 512), 6)
    x[0, :256] *= np.float32(1e9)                       # d overflows f16
    x[2, 256:] = np.abs(x[2, 256:]) - np.float32(5e9)   # dmin overflows f16
    x[3, :256] *= np.float32(1e30)                      # ggml's search overflows f32
    assert Q2_K.quantize(x.reshape(-1), np.empty(8 * 84, np.uint8)) == (0, 3)


def test_levels_are_nearest():
    # independent of ggml: with the stored d sc and dmin m of each sub-block (d sc > 0),
    # every level strictly inside 0..3 is the nearest to (x + dmin m) / (d sc), and one at
    # an end is on its side
    x = np.concatenate([c().reshape(-1) for c in CASES.values()]).astype(np.float64)
    q = quantize(Q2_K, x.reshape(-1, 256))
    dq, m = parts(q, x.shape)
    probe = q.reshape(-1, 84).copy()
    probe[:, 16:80] = 0x55                               # every level 1: gives d sc - dmin m
    dl = parts(probe, x.shape)[0].reshape(-1, 16, 16)[:, :, :1]
    x, dq, m = (v.reshape(-1, 16, 16) for v in (x, dq, m))
    lev = np.divide(dq, dl, out=np.zeros_like(dq), where=dl > 0)
    r = x + m - dq
    tol = 0.5 * dl * (1 + 1e-6) + 4 * EPS * (np.abs(x) + m)
    on = np.broadcast_to(dl > 0, lev.shape)
    inner = on & (lev > 0) & (lev < 3)
    assert np.all(np.abs(r)[inner] <= tol[inner])
    assert np.all(r[on & (lev == 0)] <= tol[on & (lev == 0)])
    assert np.all(r[on & (lev == 3)] >= -tol[on & (lev == 3)])


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matvec_is_w_times_rounded_x(shape):
    check_linear(Q2_K, shape, q2_mag)


def extreme_blocks(n, d):
    """Q2_K rows (d, n) of levels 0 or 3 with the extreme scale and min codes 0 or 15 and
    d = dmin = 1; row 0 all 3 with scale and min 15 (its weights 30), and W float64."""
    blk = np.zeros((d, n // 256, 84), np.uint8)
    lvl = (u24(d * n, 50).reshape(d, n // 256, 256) % 2).astype(np.uint8) * 3   # 0 or 3
    lvl[0] = 3
    for e in range(256):
        blk[:, :, 16 + 32 * (e // 128) + e % 32] |= lvl[:, :, e] << (2 * ((e % 128) // 32))
    code = (u24(d * n // 16, 51).reshape(d, n // 256, 16) % 4).astype(np.uint8)
    blk[:, :, :16] = np.where(code & 1, 15, 0) | np.where(code & 2, 0xF0, 0)
    blk[0, :, :16] = 0xFF
    blk[:, :, 80:84] = np.array([0x3C00, 0x3C00], np.uint16).view(np.uint8)     # d = dmin = 1
    q = blk.reshape(d, -1)
    w = gguf_dequantize(q, G.Q2_K).astype(np.float64)
    assert np.all(w[0] == 30) and w.min() == -15
    return q, w


def test_matvec_sums_at_their_bounds():
    # x = +-127 (xq = x, the x scale 1): row 0 reaches the sub-block sum 16 * 3 * 127 =
    # 6096 and the int32 sum 2 * 15 * 6096 per block, and its mins 15 * 16 * 127 per 16;
    # W @ x is then exact
    n, d = 512, 40
    q, w = extreme_blocks(n, d)
    lin = linear(Q2_K, [q], n)
    for x in (np.full(n, 127, np.float32), np.where(w[3] > 0, 127, -127).astype(np.float32)):
        out = np.empty(d, np.float32)
        lin.matvec(x, out)
        np.testing.assert_array_equal(out, w @ x)


def test_prefill_at_the_extremes_is_exact():
    # prefill: the same weights by x at +-127 in every block of 32 (the x scale 1), so
    # the scale and min sums are exact integers and x W^T is exact
    n, d = 512, 40
    q, w = extreme_blocks(n, d)
    lin = linear(Q2_K, [q], n)
    x = np.where(u24(20 * n, 54).reshape(20, n) % 2 == 0, 127, -127).astype(np.float32)
    x[0] = 127
    out = np.empty((20, d), np.float32)
    lin.matmul(x, out)
    np.testing.assert_array_equal(out, x.astype(np.float64) @ w.T)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_rows_are_the_files_values(shape):
    check_rows(Q2_K, quantize(Q2_K, normalish(shape, 9)), shape)


def test_resident_memory_is_file_size():
    q = quantize(Q2_K, normalish((1024, 1024), 60))
    lin = linear(Q2_K, [q], 1024)
    assert lin.nt * lin.R == 1024
    assert resident_bytes(lin) == q.nbytes
