"""Each forward-pass kernel against a plain NumPy twin on random inputs."""
import numpy as np
import pytest

from edgellama.kernels import rows as K
from edgellama.kernels.target import FEATURES

rng = np.random.default_rng(0)


# every elementwise kernel in both forms: row after row (decode) and rows in parallel (prefill)
FORMS = pytest.mark.parametrize("E", [K.SERIAL, K.PARALLEL], ids=["serial", "parallel"])


@FORMS
def test_rmsnorm_matches_numpy(E):
    x = rng.standard_normal((5, 96)).astype(np.float32)
    w = rng.standard_normal(96).astype(np.float32)
    out = np.empty_like(x)
    E.rmsnorm(x, w, 1e-5, out)
    ref = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


@FORMS
def test_rope_rotates_adjacent_pairs(E):
    T, nh, hd = 3, 4, 16
    x = rng.standard_normal((T, nh, hd)).astype(np.float32)
    ang = rng.uniform(-10, 10, (T, hd // 2))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    y = x.copy()
    E.rope(y, cos, sin)
    z = x[..., 0::2] + 1j * x[..., 1::2]          # pair (2i, 2i+1) as a complex number
    z = z * np.exp(1j * ang)[:, None, :]
    np.testing.assert_allclose(y[..., 0::2], z.real, atol=1e-5)
    np.testing.assert_allclose(y[..., 1::2], z.imag, atol=1e-5)


@FORMS
def test_rope_neox_rotates_halves(E):
    # NEOX layout (Qwen): pair (i, i + hd/2), HF's rotate_half
    T, nh, hd = 3, 4, 16
    x = rng.standard_normal((T, nh, hd)).astype(np.float32)
    ang = rng.uniform(-10, 10, (T, hd // 2))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    y = x.copy()
    E.rope_neox(y, cos, sin)
    z = (x[..., :hd // 2] + 1j * x[..., hd // 2:]) * np.exp(1j * ang)[:, None, :]
    np.testing.assert_allclose(y, np.concatenate([z.real, z.imag], -1), atol=1e-5)


@FORMS
def test_head_norm_norms_each_head(E):
    # q/k norm (Qwen 3): heads at columns off.. of each row, each RMS-normed times w;
    # the columns around them untouched
    T, nh, hd, off = 5, 3, 32, 40
    x = (rng.standard_normal((T, off + nh * hd + 8)) * 5).astype(np.float32)
    w = rng.standard_normal(hd).astype(np.float32)
    y = x.copy()
    E.head_norm(y, off, nh, w, 1e-6)
    h = x[:, off:off + nh * hd].reshape(T, nh, hd).astype(np.float64)
    ref = h / np.sqrt((h ** 2).mean(-1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(y[:, off:off + nh * hd].reshape(T, nh, hd), ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(y[:, :off], x[:, :off])
    np.testing.assert_array_equal(y[:, off + nh * hd:], x[:, off + nh * hd:])


@FORMS
def test_swiglu(E):
    g = rng.standard_normal((4, 50)).astype(np.float32) * 4
    u = rng.standard_normal((4, 50)).astype(np.float32)
    ref = g / (1 + np.exp(-g.astype(np.float64))) * u
    out = np.empty_like(g)
    E.swiglu(np.concatenate([g, u], axis=1), out)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


@FORMS
def test_add(E):
    x, y = rng.standard_normal((2, 6, 40)).astype(np.float32)
    z = x.copy()
    E.add(z, y)
    np.testing.assert_array_equal(z, x + y)


def test_parallel_rows_are_the_serial_rows_bit_for_bit():
    # prefill (parallel) and a decoded token (serial) must give a row the same bits, as the
    # model passes them: q and k are column slices of one q|k|v buffer
    T, nh, hd, F = 9, 4, 64, 200
    qkv = rng.standard_normal((T, 2 * nh * hd)).astype(np.float32)
    ang = rng.uniform(-10, 10, (T, hd // 2))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    w = rng.standard_normal(nh * hd).astype(np.float32)
    gu = (rng.standard_normal((T, 2 * F)) * 3).astype(np.float32)
    outs = []
    for E in (K.SERIAL, K.PARALLEL):
        b = qkv.copy()
        q3 = b[:, :nh * hd].reshape(T, nh, hd)
        E.rope(q3, cos, sin)
        h = np.empty((T, nh * hd), np.float32)
        E.rmsnorm(b[:, nh * hd:].copy(), w, 1e-5, h)
        act = np.empty((T, F), np.float32)
        E.swiglu(gu, act)
        E.add(h, np.ascontiguousarray(b[:, :nh * hd]))
        outs.append((b, h, act))
    # a single row, as a decoded token runs it, gives the same bits as its row in a batch
    one = qkv[4:5].copy()
    K.SERIAL.rope(one[:, :nh * hd].reshape(1, nh, hd), cos[4:5], sin[4:5])
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(one, outs[1][0][4:5])


def test_qwen_kernels_give_a_row_the_same_bits_alone_and_in_a_batch():
    # q/k norm then NEOX rope, as the model runs them on its q|k|v buffer
    T, nh, hd = 9, 4, 64
    qkv = (rng.standard_normal((T, 2 * nh * hd)) * 3).astype(np.float32)
    ang = rng.uniform(-10, 10, (T, hd // 2))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    w = rng.standard_normal(hd).astype(np.float32)

    def run(E, b, c, s):
        E.head_norm(b, 0, nh, w, 1e-6)
        E.rope_neox(b[:, :nh * hd].reshape(len(b), nh, hd), c, s)
        return b
    batch = [run(E, qkv.copy(), cos, sin) for E in (K.SERIAL, K.PARALLEL)]
    np.testing.assert_array_equal(batch[0], batch[1])
    rows = [run(K.SERIAL, qkv[t:t + 1].copy(), cos[t:t + 1], sin[t:t + 1]) for t in range(T)]
    np.testing.assert_array_equal(np.concatenate(rows), batch[1])


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
