"""Each forward-pass kernel against a plain NumPy twin on random inputs."""
import numba
import numpy as np
import pytest

from edgellama import kernels as K
from edgellama.target import FEATURES

rng = np.random.default_rng(0)


def test_rmsnorm_matches_numpy():
    x = rng.standard_normal((5, 96)).astype(np.float32)
    w = rng.standard_normal(96).astype(np.float32)
    out = np.empty_like(x)
    K.rmsnorm(x, w, 1e-5, out)
    ref = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


def test_rope_rotates_adjacent_pairs():
    T, nh, hd = 3, 4, 16
    x = rng.standard_normal((T, nh, hd)).astype(np.float32)
    ang = rng.uniform(-10, 10, (T, hd // 2))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    y = x.copy()
    K.rope(y, cos, sin)
    z = x[..., 0::2] + 1j * x[..., 1::2]          # pair (2i, 2i+1) as a complex number
    z = z * np.exp(1j * ang)[:, None, :]
    np.testing.assert_allclose(y[..., 0::2], z.real, atol=1e-5)
    np.testing.assert_allclose(y[..., 1::2], z.imag, atol=1e-5)


def test_swiglu():
    g = rng.standard_normal((4, 50)).astype(np.float32) * 4
    u = rng.standard_normal((4, 50)).astype(np.float32)
    ref = g / (1 + np.exp(-g.astype(np.float64))) * u
    out = np.empty_like(g)
    K.swiglu(np.concatenate([g, u], axis=1), out)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


def test_fast_exp_matches_numpy():
    x = np.concatenate([-np.logspace(-8, 2.2, 5000), [0.0, -1e-30, -87.0, -120.0, -1e4, -np.inf]])
    x = x.astype(np.float32)
    got = np.array([K._exp_neg(v) for v in x], np.float32)
    ref = np.exp(x.astype(np.float64))
    normal = x >= -87
    # y = x - k ln2 is one fused multiply-add where the target has FMA; without (a generic
    # target), k ln2 rounds to f32 first: 4e-6 at k = -125, harmless in softmax
    np.testing.assert_allclose(got[normal], ref[normal], rtol=3e-7 if "fma" in FEATURES else 5e-6)
    assert np.all(got[~normal] < 2e-38) and np.all(got >= 0)   # clamped: e^-87, negligible


def numpy_attention(q, k, v, pos0):
    # q (T, H, hd); k, v (KV, n, hd) f32 -> (T, H, hd), causal from pos0
    T, H, hd = q.shape
    g = H // k.shape[0]
    out = np.empty_like(q)
    for t in range(T):
        for h in range(H):
            n = pos0 + t + 1
            s = k[h // g, :n] @ q[t, h] / np.sqrt(hd)
            p = np.exp(s - s.max())
            out[t, h] = (p / p.sum()) @ v[h // g, :n]
    return out


@pytest.mark.parametrize("T,pos0,H,KV,hd,qscale", [
    (1, 0, 4, 2, 16, 1), (1, 300, 8, 2, 64, 1), (7, 90, 6, 3, 32, 1), (70, 0, 4, 4, 8, 1),
    (2, 1100, 24, 8, 128, 1), (1, 1199, 32, 8, 64, 1),   # 3B and 1B shapes, to the end
    (3, 500, 8, 2, 64, 30),   # scores spanning hundreds: most weights underflow to zero
    (1, 200, 7, 1, 32, 1), (2, 50, 10, 2, 16, 1), (2, 60, 8, 1, 8, 1), (2, 90, 12, 2, 16, 1),
    (2, 100, 16, 1, 16, 1),   # 16 heads a group: past the register kernels, plain loops
    (2, 40, 4, 2, 6, 1),      # head dim not a multiple of 16: V by the plain loops
    (3, 70, 4, 2, 48, 1),     # 48 = 2 of g = 2's 4-vector passes short: single vectors
    (9, 250, 6, 2, 64, 1),    # token blocks of 4, 4, 1 across a 256-position chunk edge
    (13, 3, 24, 8, 128, 1),   # a block whose first tokens end before the last's full 16s
    (37, 11, 8, 2, 32, 1),    # more token blocks than threads, handed out from both ends
])
def test_attention_matches_numpy(T, pos0, H, KV, hd, qscale):
    ctx = 1200
    q = rng.standard_normal((T, H, hd)).astype(np.float32) * qscale
    n = pos0 + T
    k = (rng.standard_normal((n, KV, hd)) * 2).astype(np.float32)
    v = rng.standard_normal((n, KV, hd)).astype(np.float32)
    cap = K.kv_capacity(ctx)
    # the cache past n holds what an earlier, longer sequence left: never read
    kc = np.full((KV, cap // K.KV_BLOCK, hd, K.KV_BLOCK), np.float16(np.inf)).view(np.uint16)
    vc = np.full((KV, cap, hd), np.float16(np.nan)).view(np.uint16)
    K.kv_store(kc, vc, 0, k[:pos0], v[:pos0])     # the cached positions, then this batch's
    K.kv_store(kc, vc, pos0, k[pos0:], v[pos0:])
    out = np.empty_like(q)
    scratch = K.attention_scratch(numba.config.NUMBA_NUM_THREADS, H, KV, ctx, hd)
    K.attention(q, kc, vc, pos0, np.float32(hd ** -0.5), out, scratch)
    k16, v16 = (a.astype(np.float16).astype(np.float64).transpose(1, 0, 2) for a in (k, v))
    ref = numpy_attention(q.astype(np.float64), k16, v16, pos0)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)


def test_kv_store_rounds_as_numpy_and_places_by_layout():
    # f32 -> f16 at the edges: ties to even, subnormals, overflow to inf, NaN
    edges = np.array([0.0, -0.0, 1.0, 65504.0, 65520.0, 1e6, -1e6, 6e-8, 3e-8, 2.9e-8, 1e-10,
                      5.96e-8, 6.1e-5, 1.0009765625, 1.00048828125, 1.00146484375,
                      np.inf, -np.inf, np.nan], np.float32)
    T, KV, hd = 5, 2, 32
    k = rng.standard_normal((T, KV, hd)).astype(np.float32) * 100
    v = rng.standard_normal((T, KV, hd)).astype(np.float32)
    k.reshape(-1)[:edges.size] = edges
    v.reshape(-1)[-edges.size:] = edges
    kc = np.zeros((KV, 2, hd, K.KV_BLOCK), np.uint16)
    vc = np.zeros((KV, 2 * K.KV_BLOCK, hd), np.uint16)
    pos = 13                                     # positions 13..17 span two blocks
    K.kv_store(kc, vc, pos, k, v)
    with np.errstate(over="ignore"):
        k16, v16 = k.astype(np.float16).view(np.uint16), v.astype(np.float16).view(np.uint16)
    for t in range(T):
        p = pos + t
        np.testing.assert_array_equal(kc[:, p // 16, :, p % 16], k16[t])
        np.testing.assert_array_equal(vc[:, p], v16[t])
    assert not kc[:, 0, :, :13].any()            # nothing before pos written
