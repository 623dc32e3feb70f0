"""Each forward-pass kernel against a plain NumPy twin on random inputs."""
import numba
import numpy as np
import pytest

from edgellama import kernels as K

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
    K.swiglu(g, u, out)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


def test_half_conversion_is_exact_for_every_f16_value():
    bits = np.arange(65536, dtype=np.uint16).reshape(-1, 64)   # all values incl. subnormals, inf
    out = np.empty(bits.shape, np.float32)
    K._half_tile.py_func(bits, bits.shape[0], out.view(np.uint32), out)
    ref = bits.view(np.float16).astype(np.float32)
    finite = np.isfinite(ref)
    assert np.array_equal(out[finite].view(np.uint32), ref[finite].view(np.uint32))
    assert np.array_equal(np.isinf(out), np.isinf(ref))


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


@pytest.mark.parametrize("T,pos0,H,KV,hd", [(1, 0, 4, 2, 16), (1, 200, 8, 2, 64),
                                             (7, 90, 6, 3, 32), (70, 0, 4, 4, 8)])
def test_attention_matches_numpy(T, pos0, H, KV, hd):
    ctx = 512
    q = rng.standard_normal((T, H, hd)).astype(np.float32)
    k = np.zeros((KV, ctx, hd), np.float16)
    v = np.zeros((KV, ctx, hd), np.float16)
    n = pos0 + T
    k[:, :n] = rng.standard_normal((KV, n, hd)) * 2
    v[:, :n] = rng.standard_normal((KV, n, hd))
    out = np.empty_like(q)
    scratch = K.attention_scratch(numba.config.NUMBA_NUM_THREADS, H, KV, hd)
    K.attention(q, k.view(np.uint16), v.view(np.uint16), pos0, np.float32(hd ** -0.5), out, scratch)
    ref = numpy_attention(q, k.astype(np.float32), v.astype(np.float32), pos0)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)
