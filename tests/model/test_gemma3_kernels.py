"""Gemma 3's kernels against plain NumPy twins: GELU gating, final-logit soft-capping, and
attention over a sliding window, from a ring of positions too."""
import numba
import numpy as np
import pytest

from edgellama.kernels import attention as A
from edgellama.kernels import rows as K
from edgellama.kv_cache import KVCache

rng = np.random.default_rng(0)


@pytest.mark.parametrize("E", [K.SERIAL, K.PARALLEL], ids=["serial", "parallel"])
def test_geglu(E):
    g = (rng.standard_normal((40, 50)) * 4).astype(np.float32)
    g[0, :3] = (-30, 30, 0)
    u = rng.standard_normal((40, 50)).astype(np.float32)
    g64 = g.astype(np.float64)
    ref = 0.5 * g64 * (1 + np.tanh(np.sqrt(2 / np.pi) * (g64 + 0.044715 * g64 ** 3))) * u
    out = np.empty_like(g)
    E.geglu(np.concatenate([g, u], axis=1), out)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


def test_softcap():
    x = (rng.standard_normal((3, 70)) * 50).astype(np.float32)
    x[0, :2] = (1e30, -1e30)
    ref = 30.0 * np.tanh(x.astype(np.float64) / 30.0)
    K.softcap(x, 30.0)
    np.testing.assert_allclose(x, ref, rtol=1e-5, atol=1e-5)


class _Args:
    n_layers, n_kv_heads, head_dim = 1, 2, 64


def _attention_twin(q, k, v, pos0, window, scale):
    # q (T, H, hd) at positions pos0.., k, v (P, KV, hd) of positions 0..P-1: token t
    # sees positions p with p <= pos0 + t and pos0 + t - p < window
    T, H, hd = q.shape
    g = H // k.shape[1]
    out = np.empty((T, H, hd))
    for t in range(T):
        p1 = pos0 + t
        lo = max(0, p1 - window + 1)
        for h in range(H):
            s = k[lo:p1 + 1, h // g].astype(np.float64) @ q[t, h] * scale
            w = np.exp(s - s.max())
            out[t, h] = w @ v[lo:p1 + 1, h // g] / w.sum()
    return out


@pytest.mark.parametrize("window,T,pos0", [(100, 300, 0), (300, 40, 700), (300, 1, 1500),
                                           (16, 1, 999), (512, 1, 5000)])
@pytest.mark.parametrize("ring", [False, True])
def test_windowed_attention(window, T, pos0, ring):
    # prefill blocks and decoded tokens (split over chunks at depth), each token's window
    # starting inside or across a chunk of 256; from a cache of the whole context or a ring
    H, hd = 4, 64
    P = pos0 + T
    k, v = rng.standard_normal((2, P, 2, hd)).astype(np.float32)
    q = rng.standard_normal((T, H, hd)).astype(np.float32)
    c = KVCache(_Args, P + 16 if not ring else 1 << 20, window=window if ring else 0)
    c.window = window
    for p in range(max(0, pos0 - window - 300) if ring else 0, P, 256):
        n = min(256, P - p)
        c.write(0, p, k[p:p + n].copy(), v[p:p + n].copy())
    assert c.ring == ring
    k16, v16 = k.astype(np.float16).astype(np.float32), v.astype(np.float16).astype(np.float32)
    scratch = tuple(np.zeros(s, d) for s, d in
                    A.attention_scratch_shapes(numba.config.NUMBA_NUM_THREADS, H, 2, hd))
    out = np.empty((T, H, hd), np.float32)
    c.attend(0, pos0, q.copy(), np.float32(0.125), out, scratch)
    np.testing.assert_allclose(out, _attention_twin(q, k16, v16, pos0, window, 0.125),
                               rtol=1e-4, atol=1e-5)
