"""Q3_K: what is its own (test_conformance.py checks it against ggml, gguf-py and
the NumPy twin as every format), and the helpers test_q2_k.py shares.

- quantize: an overflowing scale counted; every level the nearest (independent of ggml).
- decode: exactly W @ xq but for float rounding, xq = x rounded to int8 per 32 as the
  kernel does (a tighter bound than the conformance test's), and the sums at their
  bounds; resident size.
- prefill: the int32 sums at their bounds are exact, on the VNNI kernels and on AMX's
  tiles where they run (test_amx.py checks the tiles' bytes and bits).
"""
import numpy as np
import pytest
from format_cases import EPS, normalish, u24
from gguf import GGMLQuantizationType as G
from gguf.quants import dequantize as gguf_dequantize
from quantize_cases import K16_CASES as CASES

from edgellama.formats import records
from edgellama.formats.q3_k import Q3_K
from edgellama.kernels import amx

# (out, in): out not a multiple of any tile size (16 to 256 rows), in = 256 k
SHAPES = [(300, 256), (37, 512), (1030, 256), (16, 768)]


# --- calling a format's reference kernels ------------------------------------------------

def quantize(fmt, x: np.ndarray, counts=(0, 0)) -> np.ndarray:
    out = np.empty(x.size // 256 * fmt.type_size, np.uint8)
    assert fmt.quantize(np.ascontiguousarray(x, np.float32).reshape(-1), out) == counts
    return out.reshape(x.shape[0], -1)


# --- runtime Linear checks ---------------------------------------------------------------

def xq_twin(x: np.ndarray) -> np.ndarray:
    """x as the decode kernels see it: per 32, rounded to the int8 grid of amax / 127."""
    xb = x.reshape(-1, 32)
    dx = np.abs(xb).max(1, keepdims=True) / np.float32(127)
    inv = np.float32(1) / np.where(dx > 0, dx, np.float32(1))
    xq = np.where(dx > 0, np.rint(xb * inv), 0)
    return (xq * dx.astype(np.float64)).reshape(x.shape)


def check_matvec(got: np.ndarray, w: np.ndarray, wmag: np.ndarray, x: np.ndarray) -> None:
    """got = W @ x from a decode kernel; w (d, n) float64 the true W, wmag >= |w| term by
    term the magnitude of what is summed (|w| for Q3_K; |d sc q| + |dmin m| for Q2_K).

    With xq = xq_twin(x) the kernel's integer sums are exact, so got differs from W @ xq
    by float rounding only: an f32 multiply-add per block of 32 and a few per
    super-block, so (nb + 4) eps sum |terms| with nb the blocks of 32, with a margin of
    4. The distance to W @ x is then the x rounding, each x_i moving by at most
    amax_b / 254."""
    xq = xq_twin(x)
    nb = x.size // 32
    tol = 4 * (nb + 4) * EPS * (wmag @ np.abs(xq)) + 1e-37
    err = np.abs(got - w @ xq)
    assert np.all(err <= tol), np.max(err / tol)
    step = np.repeat(np.abs(x).reshape(-1, 32).max(1), 32) / 254
    assert np.all(np.abs(got - w @ x) <= tol + np.abs(w) @ step * 1.001)


def linear(fmt, datas: list[np.ndarray], n: int):
    for d in datas:
        d.setflags(write=False)                          # file views are read-only
    return fmt.linear(fmt, [d.reshape(-1) for d in datas], [d.shape[0] for d in datas], n)


def weights(shape, seed: int) -> np.ndarray:
    w = normalish(shape, seed)
    w[0] *= 1e-6                                         # tiny scales: f16 subnormal d
    w[1, :256] = np.abs(w[1, :256]) + 3                  # large offsets
    return w


def check_linear(fmt, shape, wmag_of) -> None:
    """matvec of fmt's Linear for W (shape): W @ xq but for float rounding."""
    q = quantize(fmt, weights(shape, 5))
    w = gguf_dequantize(q, G[fmt.name]).astype(np.float64).reshape(shape)
    lin = linear(fmt, [q], shape[1])
    x = normalish(shape[1], 6) * np.float32(3)
    out = np.full(shape[0], np.nan, np.float32)
    lin.matvec(x, out)
    check_matvec(out, w, wmag_of(q, shape), x)


def resident_bytes(lin) -> int:
    # the tiles: every array the Linear holds except its per-call scratch (names with _)
    return sum(v.nbytes for k, v in vars(lin).items() if isinstance(v, np.ndarray) and k[0] != "_")


# --- Q3_K --------------------------------------------------------------------------------

def q3_mag(q, shape):
    return np.abs(gguf_dequantize(q, G.Q3_K).astype(np.float64).reshape(shape))


def test_scale_overflow_counted():
    # d overflows f16 (1e9); from ~4e12 ggml's search overflows f32 and may write d = 0
    # (all zeros), which must not pass silently either
    x = normalish((4, 512), 6)
    x[0, :256] *= np.float32(1e9)
    x[2, 256:] *= np.float32(1e20)
    x[3, :256] *= np.float32(1e30)
    assert Q3_K.quantize(x.reshape(-1), np.empty(8 * 110, np.uint8)) == (0, 3)


def test_levels_are_nearest():
    # independent of ggml: with the stored d sc of each sub-block (when nonzero), every
    # level strictly inside -4..3 is the nearest to x / (d sc); one at an end is on its side
    x = np.concatenate([c().reshape(-1) for c in CASES.values()]).astype(np.float64)
    q = quantize(Q3_K, x.reshape(-1, 256)).reshape(-1, 110)
    w = gguf_dequantize(q, G.Q3_K).astype(np.float64).reshape(-1, 16, 16)
    probe = q.copy()
    probe[:, :96] = 0                                    # every level -4: gives -4 d sc
    dl = gguf_dequantize(probe, G.Q3_K).astype(np.float64).reshape(-1, 16, 16)[:, :, :1] / -4
    x = x.reshape(-1, 16, 16)
    lev = np.divide(w, dl, out=np.zeros_like(w), where=dl != 0)
    r = x - w
    tol = 0.5 * np.abs(dl) * (1 + 1e-6) + 4 * EPS * np.abs(x)
    on = np.broadcast_to(dl != 0, lev.shape)
    inner = on & (lev > -4) & (lev < 3)
    assert np.all(np.abs(r)[inner] <= tol[inner])
    pos = np.broadcast_to(dl > 0, lev.shape)
    neg = np.broadcast_to(dl < 0, lev.shape)
    for sel, below in ((pos & (lev == -4), True), (pos & (lev == 3), False),
                       (neg & (lev == -4), False), (neg & (lev == 3), True)):
        assert np.all(r[sel] <= tol[sel]) if below else np.all(r[sel] >= -tol[sel])


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matvec_is_w_times_rounded_x(shape):
    check_linear(Q3_K, shape, q3_mag)


def test_matvec_sums_at_their_bounds():
    # weights at level -4 or 3 with the extreme scales -32 and 31, x = +-127 (xq = x, the
    # x scale 1): row 0 all -4 with scale -32 reaches the sub-block sum -8128 (AVX2's int16
    # pair sums at 2 * 7 * 127 before the offset comes off) and the int32 sum 2 * 32 *
    # 8128 per block; W @ x is then exact
    n, d = 512, 40
    blk = np.zeros((d, n // 256, 110), np.uint8)
    lvl = (u24(d * n, 50).reshape(d, n // 256, 256) % 2).astype(np.uint8) * 7   # 0 or 7
    lvl[0] = 0
    lvl[1] = 7
    for e in range(256):
        blk[:, :, e % 32] |= (lvl[:, :, e] >> 2) << (e // 32)
        blk[:, :, 32 + 32 * (e // 128) + e % 32] |= (lvl[:, :, e] & 3) << (2 * ((e % 128) // 32))
    code = np.where(u24(d * n // 16, 51).reshape(d, n // 256, 16) % 2 == 0, 0, 63)  # -32, 31
    code[0] = 0
    for j in range(16):
        blk[:, :, 96 + j % 8] |= (code[:, :, j] & 15).astype(np.uint8) << (4 * (j // 8))
        blk[:, :, 104 + j % 4] |= (code[:, :, j] >> 4).astype(np.uint8) << (2 * (j // 4))
    blk[:, :, 108:110] = np.array([0x3C00], np.uint16).view(np.uint8)            # d = 1
    q = blk.reshape(d, -1)
    w = gguf_dequantize(q, G.Q3_K).astype(np.float64)
    assert np.all(w[0] == 128) and np.abs(w).max() == 128
    lin = linear(Q3_K, [q], n)
    for x in (np.full(n, 127, np.float32), np.where(w[3] > 0, 127, -127).astype(np.float32)):
        out = np.empty(d, np.float32)
        lin.matvec(x, out)
        np.testing.assert_array_equal(out, w @ x)


def test_resident_memory_about_file_size():
    q = quantize(Q3_K, normalish((1024, 1024), 60))
    lin = linear(Q3_K, [q], 1024)
    assert lin.nt * lin.R == 1024
    assert resident_bytes(lin) == q.nbytes * 116 // 110  # +6 bytes a block: scales as i8, padding


def check_rows(fmt, q: np.ndarray, shape) -> None:
    """The embedding's rows, read back from fmt's records of file rows q: gguf-py's values
    bit for bit."""
    lin = linear(fmt, [q], shape[1])
    rows = np.empty(shape, np.float32)
    lin.rows(np.arange(shape[0]), rows)
    want = gguf_dequantize(q, G[fmt.name]).reshape(shape)
    np.testing.assert_array_equal(rows.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_rows_are_the_files_values(shape):
    check_rows(Q3_K, quantize(Q3_K, weights(shape, 9)), shape)


# --- prefill ------------------------------------------------------------------------------

@pytest.fixture(params=["vnni", "amx"])
def prefill_path(request, monkeypatch):
    """Prefill on the VNNI kernels, or on AMX's tiles (skipped where they cannot run)."""
    was = amx._enabled
    if request.param == "amx" and not amx.use(True):
        amx._enabled = was
        pytest.skip("no AMX tiles here (the CPU, Numba's target or Linux's permission)")
    amx._enabled = request.param == "amx" and amx._enabled
    monkeypatch.setattr(records, "AMX_MIN_ROWS", 1)
    yield request.param
    amx._enabled = was


def test_prefill_at_the_extremes_is_exact(prefill_path):
    # levels -4 and 3 under scales -32 and 31 (q6 28 and 35: both crumb values), x at
    # +-127 in every block: x W^T exact, the int32 sums at their largest
    n, d = 512, 40
    blk = np.zeros((d, n // 256, 110), np.uint8)
    lvl = (u24(d * n, 52).reshape(d, n // 256, 256) % 2).astype(np.uint8) * 7
    for e in range(256):
        blk[:, :, e % 32] |= (lvl[:, :, e] >> 2) << (e // 32)
        blk[:, :, 32 + 32 * (e // 128) + e % 32] |= (lvl[:, :, e] & 3) << (2 * ((e % 128) // 32))
    code = np.where(u24(d * n // 16, 53).reshape(d, n // 256, 16) % 2 == 0, 0, 63)
    for j in range(16):
        blk[:, :, 96 + j % 8] |= (code[:, :, j] & 15).astype(np.uint8) << (4 * (j // 8))
        blk[:, :, 104 + j % 4] |= (code[:, :, j] >> 4).astype(np.uint8) << (2 * (j // 4))
    blk[:, :, 108:110] = np.array([0x3C00], np.uint16).view(np.uint8)
    q = blk.reshape(d, -1)
    w = gguf_dequantize(q, G.Q3_K).astype(np.float64)
    lin = linear(Q3_K, [q], n)
    x = np.where(u24(20 * n, 54).reshape(20, n) % 2 == 0, 127, -127).astype(np.float32)
    out = np.empty((20, d), np.float32)
    assert (lin._tokens(20)[0] == amx.AMX_TOKENS) == (prefill_path == "amx")
    lin.matmul(x, out)
    np.testing.assert_array_equal(out, x.astype(np.float64) @ w.T)
