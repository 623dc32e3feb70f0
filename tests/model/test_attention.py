"""Attention over every KV cache type against a plain NumPy twin, and the cache's stores
bit-exact with gguf-py's reference quantizers (ggml's quantize_row_q*_ref)."""
import numba
import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as QT
from gguf.quants import dequantize, quantize
from scipy.linalg import hadamard as hadamard_matrix

from edgellama.kernels import attention as A
from edgellama.kernels.target import TARGET
from edgellama.kv_cache import CACHE_TYPES, KVCache

rng = np.random.default_rng(0)
# compiling the kernels (a clean clone) must not trip Numba's pedantic IR checks: their
# warnings would reach users' terminals on first start
pytestmark = pytest.mark.filterwarnings("error::numba.core.errors.NumbaIRAssumptionWarning")


class Args:
    def __init__(self, layers=1, kv=2, hd=64, heads=None):
        self.n_layers, self.n_kv_heads, self.head_dim = layers, kv, hd
        self.n_heads = heads or kv


def scratch(H, KV, hd):
    return tuple(np.zeros(s, d) for s, d in
                 A.attention_scratch_shapes(numba.config.NUMBA_NUM_THREADS, H, KV, hd))


def ggml_round_trip(x, cache_type):
    """x (..., 32k) f32 through gguf-py's quantizer and dequantizer (f16: a cast)."""
    if cache_type == "f16":
        return x.astype(np.float16).astype(np.float32)
    qt = {"q8_0": QT.Q8_0, "q4_0": QT.Q4_0}[cache_type]
    return dequantize(quantize(x, qt), qt).reshape(x.shape)


def cache_round_trip(x, cache_type):
    """x (..., 32k) f32 as the cache stores it: ggml's q8_0; for q4_0 ggml's layout with
    attention._q4_block's scale (the search's winner by the closed form of its error, then
    that or ggml's own, whichever leaves the smaller error), in NumPy block by block."""
    if cache_type != "q4_0":
        return ggml_round_trip(x, cache_type)
    b = x.reshape(-1, 32)
    b64 = b.astype(np.float64)
    mx = b[np.arange(len(b)), np.abs(b).argmax(1)].astype(np.float64)
    rank, best_s = np.full(len(b), np.inf), np.zeros(len(b))
    best_d = np.zeros(len(b), np.float32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for i in A._Q4_SEARCH:
            s = -(8.0 + 0.1 * i) / mx
            levels = np.clip(np.rint(b64 * s[:, None]), -8.0, 7.0)
            sumlx, suml2 = (b64 * levels).sum(1), (levels * levels).sum(1)   # exact sums
            d = (sumlx / suml2).astype(np.float32)
            d16 = d.astype(np.float16).astype(np.float64)
            r = d16 * (d16 * suml2 - 2.0 * sumlx)
            better = r < rank
            rank, best_s, best_d = (np.where(better, r, rank), np.where(better, s, best_s),
                                    np.where(better, d, best_d))
        levels = np.clip(np.rint(b64 * best_s[:, None]), -8.0, 7.0)
        searched = best_d.astype(np.float16).astype(np.float64)[:, None] * levels
    ref = ggml_round_trip(b, "q4_0").astype(np.float64)
    take = (mx != 0) & (_sq_error(b, searched) < _sq_error(b, ref))
    return np.where(take[:, None], searched, ref).astype(np.float32).reshape(x.shape)


def _sq_error(b, y):
    # Σ (b - y)² per block (rows of 32) in f64, index order
    e = np.zeros(len(b))
    for j in range(32):
        d = b[:, j].astype(np.float64) - y[:, j]
        e += d * d
    return e


def q8_activations(x):
    """x (..., 32k) f32 as attention quantizes q: per block of 32, d = amax / 127 and
    rint(x * (1 / d)) in f32 (prep_q8_x, llama.cpp's q8_0 activations); returns the
    exact value d * q8 in f64."""
    b = x.reshape(*x.shape[:-1], -1, 32)
    d = np.abs(b).max(-1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d > 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q8 = np.rint(b * inv)
    return (q8 * d.astype(np.float64)).reshape(x.shape)


def numpy_attention(q, k, v, pos0):
    # q (T, H, hd) f64 scaled; k, v (n, KV, hd) f64 -> (T, H, hd), causal from pos0
    T, H, hd = q.shape
    g = H // k.shape[1]
    out = np.zeros((T, H, hd))
    for t in range(T):
        for h in range(H):
            n = pos0 + t + 1
            s = k[:n, h // g] @ q[t, h]
            p = np.exp(s - s.max())
            out[t, h] = (p / p.sum()) @ v[:n, h // g]
    return out


def v_rounding(q, k, c, pos0):
    """(T, H, hd) f64: how far a q8_0 V's weight rounding may move each output
    (attention._round_weights: per chunk of 256 positions, query row and V block of 32,
    each weight times the block's V scale rounded to a step of 1/W16 of the largest
    weight times the largest scale, half a step at most), in the softmax's units: per
    chunk, half a step times the sum of the chunk's |V int8|. q (T, H, hd), k (n, KV, hd)
    f64 as numpy_attention takes them; c the cache (1 layer); 0 for other V types, and
    where V sums in f32 (Isa.v_int16 unset)."""
    T, H, hd = q.shape
    KV = k.shape[1]
    g = H // KV
    bound = np.zeros((T, H, hd))
    if c.type_v != "q8_0" or not TARGET.v_int16:
        return bound
    n_all = pos0 + T
    vi = np.abs(c.arrays["vq"][0, :, :n_all].astype(np.float64)).transpose(1, 0, 2)
    d = c.arrays["vs"][0, :, :n_all].view(np.float16).astype(np.float64).transpose(1, 0, 2)
    for t in range(T):
        n = pos0 + t + 1
        for h in range(H):
            s = k[:n, h // g] @ q[t, h]
            p = np.exp(s - s.max())
            p /= p.sum()
            for c0 in range(0, n, A._CHUNK):
                top = p[c0:n][:A._CHUNK].max() * d[c0:n][:A._CHUNK, h // g].max(0)
                half_step = top / A.W16 * 0.5 * (1 + 1e-3)
                bound[t, h] += np.repeat(half_step, A.QBLOCK) * vi[c0:n][:A._CHUNK, h // g].sum(0)
    return bound


def assert_within(out, ref, rtol, atol, slack):
    # |out - ref| <= atol + rtol |ref| + slack, elementwise
    err = np.abs(out - ref) - (atol + rtol * np.abs(ref) + slack)
    assert err.max() <= 0, f"worst excess {err.max():.3g} at {np.unravel_index(err.argmax(), err.shape)}"


@pytest.mark.parametrize("cache_type", ["q8_0", "q4_0"])
def test_stores_bit_exact_with_reference(cache_type):
    # K and V of every position read back as cache_round_trip (q8_0: gguf-py's quantize ->
    # dequantize; q4_0: its NumPy twin of the scale search): the same values and scales,
    # in attention's arrangement (k_values/v_values read the layout)
    T, KV, hd = 37, 2, 96
    x = rng.standard_normal((2, T, KV, hd)).astype(np.float32) * 3
    x[0, 0, 0, :32] = 0                                   # an all-zero block
    x[0, 1, 0, :32] = np.arange(32) - 15.5                # ties of x / d
    x[1, 2, 1, 32:64] = np.float32(1e-30)                 # tiny values
    x[1, 3, 0, :32] = -x[1, 3, 0, :32]
    c = KVCache(Args(1, KV, hd), 64, cache_type, cache_type, rotate=False)
    c.write(0, 5, x[0].copy(), x[1].copy())               # positions 5..41 span 3 blocks
    np.testing.assert_array_equal(c.k_values(0, 5, 5 + T), cache_round_trip(x[0], cache_type))
    np.testing.assert_array_equal(c.v_values(0, 5, 5 + T), cache_round_trip(x[1], cache_type))
    assert not c.k_values(0, 0, 5).any() and not c.v_values(0, 0, 5).any()


def test_q4_0_scale_search_is_never_worse_than_ggml():
    # every block's squared error at most ggml's quantize_row_q4_0_ref's, and over many
    # near-Gaussian blocks (what rotated K and V look like) clearly less; the blocks that
    # ggml's rounding already fits best (one value and zeros, all zero) keep its bytes
    x = rng.standard_normal((4096, 2, 64)).astype(np.float32)
    x[0, 0, :32] = 0
    x[1, 0, :32] = 0
    x[1, 0, 5] = -3.0
    c = KVCache(Args(1, 2, 64), 4096, "q4_0", "q4_0", rotate=False)
    c.write(0, 0, x.copy(), x.copy())
    ours = c.k_values(0, 0, 4096).reshape(-1, 32).astype(np.float64)
    ggml = ggml_round_trip(x, "q4_0").reshape(-1, 32).astype(np.float64)
    b = x.reshape(-1, 32)
    e_ours, e_ggml = _sq_error(b, ours), _sq_error(b, ggml)
    assert (e_ours <= e_ggml).all()
    assert e_ours.sum() < 0.92 * e_ggml.sum()
    np.testing.assert_array_equal(ours[[0, 4]], ggml[[0, 4]])   # (t, h, b) = (0, 0, 0), (1, 0, 0)
    np.testing.assert_array_equal(c.v_values(0, 0, 4096), c.k_values(0, 0, 4096))


def test_f16_store_rounds_as_numpy():
    edges = np.array([0.0, -0.0, 1.0, 65504.0, 65520.0, 1e6, -1e6, 6e-8, 3e-8, 2.9e-8, 1e-10,
                      5.96e-8, 6.1e-5, 1.0009765625, 1.00048828125, 1.00146484375,
                      np.inf, -np.inf, np.nan], np.float32)
    T, KV, hd = 5, 2, 32
    k = rng.standard_normal((T, KV, hd)).astype(np.float32) * 100
    v = rng.standard_normal((T, KV, hd)).astype(np.float32)
    k.reshape(-1)[:edges.size] = edges
    v.reshape(-1)[-edges.size:] = edges
    c = KVCache(Args(1, KV, hd), 32)
    c.write(0, 13, k.copy(), v.copy())
    with np.errstate(over="ignore"):
        k16, v16 = k.astype(np.float16), v.astype(np.float16)
    np.testing.assert_array_equal(c.k_values(0, 13, 18).astype(np.float16).view(np.uint16),
                                  k16.view(np.uint16))
    np.testing.assert_array_equal(c.v_values(0, 13, 18).astype(np.float16).view(np.uint16),
                                  v16.view(np.uint16))
    assert not c.arrays["k"][0, :, 0, :, :13].any()       # nothing before pos written


def test_hadamard_matches_matrix():
    x = rng.standard_normal((3, 2, 96)).astype(np.float32)
    y = x.copy()
    A.hadamard(y, 32)
    H = hadamard_matrix(32) / np.sqrt(32)
    np.testing.assert_allclose(y, (x.reshape(3, 2, 3, 32) @ H).reshape(x.shape), atol=1e-5)
    A.hadamard(y, 32)                                     # its own inverse
    np.testing.assert_allclose(y, x, atol=1e-5)


SHAPES = [
    (1, 0, 4, 2, 64, 1), (1, 300, 8, 2, 64, 1), (7, 90, 6, 3, 32, 1),
    (2, 1100, 24, 8, 128, 1), (1, 1199, 32, 8, 64, 1),   # 3B and 1B shapes, to the end
    (3, 500, 8, 2, 64, 30),   # scores spanning hundreds: most weights underflow to zero
    (1, 200, 7, 1, 32, 1),
    (2, 100, 20, 2, 32, 1),   # 10 heads a group: register kernels in groups of 8 (4) and 2
    (9, 250, 6, 2, 64, 1),    # a token block across a 256-position chunk edge
    (13, 3, 24, 8, 128, 1),   # a block whose first tokens end before the last's full 16s
    (37, 11, 8, 2, 32, 1),    # more token blocks (16, 16, 5) than threads, from both ends
    (20, 600, 24, 8, 128, 1),  # whole chunks scored for a block's 48 rows at once, then
                               # the diagonal token by token; a second, short block
    (18, 700, 10, 2, 32, 1),  # 80 rows of a whole chunk in groups, 5 heads a group
    (3, 280, 6, 2, 96, 1),    # 3 blocks of 32: a quantized V's pass of 2, then 1 left over
]
F16_ONLY = [
    (70, 0, 4, 4, 8, 1), (2, 50, 10, 2, 16, 1), (2, 60, 8, 1, 8, 1),
    (2, 100, 16, 1, 16, 1),   # 16 heads a group
    (2, 40, 4, 2, 6, 1),      # head dim not a multiple of 16: plain loops
    (3, 70, 4, 2, 48, 1),     # 48 = 2 of g = 2's 4-vector passes short: single vectors
]
# Each K/V type pair compiles its own attention kernel (a long compile). The default run
# keeps the pairs that take every K type's scores and every V type's weighted sum, with
# a quantized K beside an f16 V (the pairs test_rotation_... compiles anyway); the other
# mixed pairs join the same code paths, and run under -m slow.
DEFAULT_PAIRS = {("f16", "f16"), ("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "f16")}
CASES = [pytest.param(kt, vt, *s, marks=() if (kt, vt) in DEFAULT_PAIRS else pytest.mark.slow)
         for s in SHAPES for kt in CACHE_TYPES for vt in CACHE_TYPES] + \
        [("f16", "f16", *s) for s in F16_ONLY]


@pytest.mark.parametrize("type_k,type_v,T,pos0,H,KV,hd,qscale", CASES)
def test_attention_matches_numpy(type_k, type_v, T, pos0, H, KV, hd, qscale):
    # The twin takes the cache's K and V as stored (the stores are checked above) and q
    # as attention rounds it for a quantized K; what is left is f32 summation and
    # _exp_neg's ~1e-7, hence the tolerance; a score's f32 rounding grows with its size
    # (qscale), and moves its weight by as much.
    ctx = 1200
    scale = np.float32(hd ** -0.5)
    q = rng.standard_normal((T, H, hd)).astype(np.float32) * qscale
    n = pos0 + T
    k = (rng.standard_normal((n, KV, hd)) * 2).astype(np.float32)
    v = rng.standard_normal((n, KV, hd)).astype(np.float32)
    c = KVCache(Args(1, KV, hd, H), ctx, type_k, type_v, rotate=False)
    for a in c.arrays.values():                           # what a longer sequence left
        a.view(np.uint8)[...] = 0x7C                      # (f16 bits 0x7C7C: inf)
    c.write(0, 0, k[:pos0].copy(), v[:pos0].copy())       # the cached positions, then this batch's
    c.write(0, pos0, k[pos0:].copy(), v[pos0:].copy())
    out = np.empty_like(q)
    c.attend(0, pos0, q, scale, out, scratch(H, KV, hd))
    qs = q * scale
    q64 = q8_activations(qs) if type_k != "f16" else qs.astype(np.float64)
    k64 = c.k_values(0, 0, n).astype(np.float64)
    ref = numpy_attention(q64, k64, c.v_values(0, 0, n).astype(np.float64), pos0)
    assert_within(out, ref, 1e-4, 2e-5 * qscale, v_rounding(q64, k64, c, pos0))


@numba.njit
def _max_of(s, off, n):
    return A._max_of(s, off, n)


def test_max_of_matches_numpy():
    # the softmax's running max: 16 lanes a step, then the rest; any offset and length,
    # the largest value first, last (in the rest when n is not a multiple of 16) or
    # between. A wrong max would not show in attention's result (the softmax cancels
    # it) unless it were too small by enough to overflow, so it is checked on its own
    base = rng.standard_normal(300).astype(np.float32) - 5
    for off in (0, 1, 3, 17, 38):
        for n in (1, 2, 15, 16, 17, 31, 32, 33, 100, 262 - off):
            for at in {off, off + n - 1, off + n // 2}:
                s = base.copy()
                s[at] = 2.0
                assert _max_of(s, off, n) == 2.0, (off, n, at)
            assert _max_of(base, off, n) == base[off:off + n].max(), (off, n)


def _q8_v_sum_py(values, off, dv, w, n, g, hd, out, dvf, kernel):
    # a q8_0 V's weighted sum as attention's chunk step takes it: the scales by block,
    # scaled (_scale_v_blocks), the weights rounded (_round_weights), the int16 dots
    # (kernel: A._weighted_i16_g)
    nbk = hd // A.QBLOCK
    dvt, mx, wq, winv = A._v_scratch(dvf, nbk)
    for b in range(nbk):
        for p in range(n):
            dvt[b * A._CHUNK + p] = dv[p, b]
    A._scale_v_blocks(dvt, n, nbk, mx)
    A._round_weights(A.Rows(w, 0, A._CHUNK), n, dvt, mx, nbk, g, wq, winv)
    kernel(A.Run(values, off, dvt, 0), wq, winv, A.Rows(out, 0, hd), hd, n, g)


_q8_v_sum = numba.njit(_q8_v_sum_py)
# as attention calls it: from a caller licensed to contract and reassociate
_q8_v_sum_fastmath = numba.njit(fastmath=True)(_q8_v_sum_py)


def q8_v_sum_twin(values, off, dv, w, n, g, hd, out):
    """_q8_v_sum in NumPy, the same f32 steps: per block, dm = max dv, t = dv (W16 / dm);
    per row, mw = max w, r = 1 / mw; q = rint((w r) t); out += f32(sum_p q V) (mw dm / W16)."""
    f32 = np.float32
    V = values[off:off + n * hd].reshape(n, hd).astype(np.int64)
    res = out.reshape(-1, hd)[:g].copy()
    for b in range(hd // A.QBLOCK):
        dm = max(f32(0), dv[:n, b].max())
        t = dv[:n, b] * (f32(A.W16) / dm if dm > 0 else f32(0))
        for j in range(g):
            mw = max(f32(0), w[j, :n].max())
            r = f32(1) / mw if mw > 0 else f32(0)
            q = np.rint((w[j, :n] * r) * t).astype(np.int64)
            assert 0 <= q.min() and q.max() <= A.W16
            cols = slice(b * A.QBLOCK, (b + 1) * A.QBLOCK)
            res[j, cols] += (q @ V[:, cols]).astype(f32) * (mw * dm / f32(A.W16))
    return res


def _check_q8_v_sum(hd, q8_v_sum, kernel):
    # every row count a call takes (1.._GMAX: passes of _i16_blocks(g) blocks and the
    # blocks left over), odd and even position counts up to a chunk, V bytes at both
    # ends, weights from zero to one (a row all zero), a block of zero scales, outputs
    # added to; the scratch and the weights' rows past n hold values that would count if read
    f32 = np.float32
    r = np.random.default_rng(hd)
    nbk = hd // A.QBLOCK
    dvf = np.full(A.v_scratch_size(nbk), 0.75, f32)    # garbage that would count
    for g in range(1, A._GMAX + 1):
        for n in (1, 2, 37, 255, 256):
            off = 3 * hd
            values = r.integers(-128, 128, off + (n + 1) * hd).astype(np.int8)
            values[off:off + hd] = 127
            values[off + hd:off + 2 * hd] = -128
            dv = (r.random((n, nbk)) * 0.05).astype(f32)
            if g == 2:
                dv[:, -1] = 0                                # a block of zero scales
            w = np.full((g, A._CHUNK), 0.5, f32)            # past n: must not count
            w[:, :n] = r.random((g, n)).astype(f32) ** 4
            if g > 2:
                w[-1, :n] = 0                                # a row with no weight
            out = r.standard_normal(g * hd).astype(f32)
            want = q8_v_sum_twin(values, off, dv, w, n, g, hd, out)
            q8_v_sum(values, off, dv, w.reshape(-1), n, g, hd, out, dvf, kernel)
            np.testing.assert_array_equal(out.reshape(g, hd), want, err_msg=f"g {g} n {n}")


@pytest.mark.parametrize("hd", [32, 64, 96, 128, 256])
def test_q8_v_weighted_sum_is_its_twin_bit_for_bit(hd):
    _check_q8_v_sum(hd, _q8_v_sum, A._weighted_i16_g)


def test_q8_v_weighted_sum_compiled_first_by_attention_keeps_its_own_arithmetic():
    # Numba compiles a kernel that leaves fastmath unset with its first caller's licence
    # (attention's is fastmath), and the kernel cache keeps that build: the scaled sums
    # were added with a fused multiply-add, one ulp from the twin, in every later run.
    # A fresh, uncached copy of the kernel, compiled first from a fastmath caller:
    licence = A._weighted_i16_g.targetoptions["fastmath"]
    fresh = numba.njit(fastmath=licence)(A._weighted_i16_g.py_func)
    _check_q8_v_sum(128, _q8_v_sum_fastmath, fresh)


def _prompt(T, pos0, H, KV, hd):
    """scale, and random q (T, H, hd) of a prompt after pos0 cached positions with its
    k and v (pos0 + T, KV, hd), f32."""
    q = rng.standard_normal((T, H, hd)).astype(np.float32)
    k = rng.standard_normal((pos0 + T, KV, hd)).astype(np.float32)
    v = rng.standard_normal((pos0 + T, KV, hd)).astype(np.float32)
    return np.float32(hd ** -0.5), q, k, v


@pytest.mark.parametrize("type_k,type_v", [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "f16")])
def test_rotation_leaves_attention_unchanged_but_for_rounding(type_k, type_v):
    # Rotated and unrotated caches hold the same attention: each against the exact f64
    # result, within the bound of its types' rounding (q: 1/254 of a block's amax; K, V:
    # q8_0 1/254, q4_0 1/16 of a block's amax; the rotated one within the same)
    T, pos0, H, KV, hd = 2, 300, 8, 2, 64
    scale, q, k, v = _prompt(T, pos0, H, KV, hd)
    exact = numpy_attention((q * scale).astype(np.float64), k.astype(np.float64),
                            v.astype(np.float64), pos0)
    errs = {}
    for rotate in (False, True):
        c = KVCache(Args(1, KV, hd, H), 512, type_k, type_v, rotate=rotate)
        c.write(0, 0, k.copy(), v.copy())
        out = np.empty_like(q)
        c.attend(0, pos0, q.copy(), scale, out, scratch(H, KV, hd))
        errs[rotate] = np.abs(out - exact).max()
    # V's rounding alone moves the output by up to its step; K's and q's move the weights
    step = {"f16": 1e-3, "q8_0": 4 / 254, "q4_0": 4 / 16}
    bound = step[type_v] + 4 * step[type_k]
    assert errs[False] < bound and errs[True] < bound, errs


@pytest.mark.parametrize("type_k,type_v,pos0", [
    ("f16", "f16", 5000),      # 20 chunks: 5 splits of _SPLIT_CHUNKS
    ("q8_0", "q4_0", 4700),    # a short last split
    ("q8_0", "q8_0", 4700),    # a q8_0 V's rounded weights, per split
    ("f16", "f16", 40000),     # more chunks than _MAX_SPLITS runs of 4: fewer, longer splits
])
def test_decode_at_depth_splits_positions(type_k, type_v, pos0):
    # A decoded token's positions are split among work items and the partial softmaxes
    # merged (attention's flash decoding); the result must still be the twin's, and the
    # same bits at every thread count (the splits follow the depth, not the threads).
    H, KV, hd = 8, 2, 64
    scale = np.float32(hd ** -0.5)
    q = rng.standard_normal((1, H, hd)).astype(np.float32)
    n = pos0 + 1
    k = (rng.standard_normal((n, KV, hd)) * 2).astype(np.float32)
    v = rng.standard_normal((n, KV, hd)).astype(np.float32)
    c = KVCache(Args(1, KV, hd, H), n, type_k, type_v, rotate=False)
    c.write(0, 0, k, v)
    outs = []
    for threads in sorted({1, numba.config.NUMBA_NUM_THREADS}):
        numba.set_num_threads(threads)
        try:
            out = np.empty_like(q)
            c.attend(0, pos0, q.copy(), scale, out, scratch(H, KV, hd))
        finally:
            numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        outs.append(out)
    qs = q * scale
    q64 = q8_activations(qs) if type_k != "f16" else qs.astype(np.float64)
    k64 = c.k_values(0, 0, n).astype(np.float64)
    ref = numpy_attention(q64, k64, c.v_values(0, 0, n).astype(np.float64), pos0)
    assert_within(outs[0], ref, 1e-4, 2e-5, v_rounding(q64, k64, c, pos0))
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])


@pytest.mark.parametrize("type_k,type_v", [("f16", "f16"), ("q8_0", "q4_0")])
def test_prefill_items_give_the_same_bits_at_every_thread_count(type_k, type_v):
    # A prompt's work items (KV heads x token blocks) go to whichever thread is free
    # (claim.py); each item's sums are its own, so the output is the same bits at every
    # thread count and the twin's. out starts as NaN: an item nobody ran would show.
    H, KV, hd, T, pos0 = 8, 2, 64, 150, 300
    scale, q, k, v = _prompt(T, pos0, H, KV, hd)
    c = KVCache(Args(1, KV, hd, H), pos0 + T, type_k, type_v, rotate=False)
    c.write(0, 0, k, v)
    outs = []
    for threads in sorted({1, numba.config.NUMBA_NUM_THREADS}):
        numba.set_num_threads(threads)
        try:
            for _ in range(2):
                out = np.full_like(q, np.nan)
                c.attend(0, pos0, q.copy(), scale, out, scratch(H, KV, hd))
                outs.append(out)
        finally:
            numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    exact = numpy_attention((q * scale).astype(np.float64), c.k_values(0, 0, pos0 + T).astype(np.float64),
                            c.v_values(0, 0, pos0 + T).astype(np.float64), pos0)
    assert np.abs(outs[0] - exact).max() < 0.05
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])


def test_decode_store_of_few_positions_is_the_parallel_store():
    # a write of fewer than _PARALLEL_STORE positions takes the stores' serial form: the
    # same bytes as the parallel form writes, for every cache type
    from edgellama import kv_cache
    H, KV, hd = 4, 4, 64
    k = rng.standard_normal((3, KV, hd)).astype(np.float32)
    v = rng.standard_normal((3, KV, hd)).astype(np.float32)
    for cache_type in CACHE_TYPES:
        caches = [KVCache(Args(1, KV, hd, H), 64, cache_type, cache_type) for _ in range(2)]
        caches[0].write(0, 17, k.copy(), v.copy())          # serial (3 < _PARALLEL_STORE)
        old = kv_cache._PARALLEL_STORE
        kv_cache._PARALLEL_STORE = 1
        try:
            caches[1].write(0, 17, k.copy(), v.copy())      # parallel
        finally:
            kv_cache._PARALLEL_STORE = old
        for name, a in caches[0].arrays.items():
            assert a.any(), (cache_type, name)
            np.testing.assert_array_equal(a, caches[1].arrays[name], err_msg=f"{cache_type} {name}")
