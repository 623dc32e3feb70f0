"""Numba kernels of the forward pass other than the linear layers (see linear.py).

Conventions: T tokens in a batch, E model dim, H query heads, KV key/value heads,
hd head dim, g = H // KV query heads per KV head, F ffn dim. Every kernel writes
into an output array; nothing here allocates per token. The KV cache holds IEEE
half floats; Numba has no float16 type, so kernels see the raw uint16 bits.
"""
from __future__ import annotations

import numba as nb
import numpy as np
from numba import prange

F32 = np.float32
_TILE = 64          # cache positions per attention tile (K/V tile stays in L1)
_DENORM = F32(2.0 ** -24)


@nb.njit(cache=True, error_model="numpy", fastmath=True)
def rmsnorm(x, w, eps, out):
    # x (T, E), w (E,) -> out (T, E) = x / sqrt(mean(x²) + eps) * w
    T, E = x.shape
    for t in range(T):
        ss = F32(0.0)
        for i in range(E):
            ss += x[t, i] * x[t, i]
        inv = F32(1.0) / np.sqrt(ss / F32(E) + F32(eps))
        for i in range(E):
            out[t, i] = x[t, i] * inv * w[i]


@nb.njit(cache=True, error_model="numpy", fastmath=True)
def rope(x, cos, sin):
    # x (T, nh, hd) in place; cos, sin (T, hd/2). Rotates adjacent pairs (2i, 2i+1),
    # the GGUF llama layout (the converter permuted HF's rotate-half rows into it).
    T, nh, hd = x.shape
    for t in range(T):
        for h in range(nh):
            for i in range(hd // 2):
                a, b = x[t, h, 2 * i], x[t, h, 2 * i + 1]
                c, s = cos[t, i], sin[t, i]
                x[t, h, 2 * i] = a * c - b * s
                x[t, h, 2 * i + 1] = a * s + b * c


@nb.njit(cache=True, error_model="numpy", fastmath=True)
def swiglu(gate, up, out):
    # gate, up (T, F) -> out (T, F) = silu(gate) * up
    T, F = gate.shape
    for t in range(T):
        for i in range(F):
            g = gate[t, i]
            out[t, i] = g / (F32(1.0) + np.exp(-g)) * up[t, i]


@nb.njit(cache=True, error_model="numpy", fastmath=True, inline="always")
def _half_tile(src, n, bits, dst):
    # src (>=n, hd) uint16 half bits -> dst (>=n, hd) f32; bits is dst viewed as uint32.
    # Two branch-free passes so LLVM vectorises both: rebias exponent, then subnormals.
    hd = src.shape[1]
    for p in range(n):
        for i in range(hd):
            h = np.uint32(src[p, i])
            em = h & np.uint32(0x7FFF)
            b = (em << np.uint32(13)) + np.uint32(0x38000000)
            b = b + np.uint32(0x38000000) if em >= np.uint32(0x7C00) else b   # inf / nan
            b = np.uint32(0) if em < np.uint32(0x0400) else b                  # zero / subnormal
            bits[p, i] = b | ((h & np.uint32(0x8000)) << np.uint32(16))
        for i in range(hd):
            h = np.uint32(src[p, i])
            sub = F32(h & np.uint32(0x3FF)) * _DENORM
            sub = -sub if h & np.uint32(0x8000) else sub
            dst[p, i] = sub if (h & np.uint32(0x7C00)) == 0 else dst[p, i]


@nb.njit(cache=True, error_model="numpy", fastmath=True, parallel=True)
def attention(q, k_cache, v_cache, pos0, scale, out, scratch):
    # q (T, H, hd) roped queries at positions pos0..pos0+T-1;
    # k_cache, v_cache (KV, ctx, hd) uint16 half bits of one layer, filled up to pos0+T;
    # out (T, H, hd). Causal: token t sees cache positions 0..pos0+t.
    # scratch (threads, 2·TILE·hd + g·TILE + g·hd + 2g) f32, one row per worker thread.
    # GQA: the g query heads of a KV head share each converted K/V tile; repeated K/V
    # is never materialised. Online softmax over tiles keeps memory O(TILE).
    T, H, hd = q.shape
    KV = k_cache.shape[0]
    g = H // KV
    for item in prange(T * KV):
        t, kvh = item // KV, item % KV
        n = pos0 + t + 1
        buf = scratch[nb.get_thread_id()]
        kf = buf[:_TILE * hd].reshape((_TILE, hd))
        vf = buf[_TILE * hd:2 * _TILE * hd].reshape((_TILE, hd))
        o = 2 * _TILE * hd
        s = buf[o:o + g * _TILE].reshape((g, _TILE))
        o += g * _TILE
        acc = buf[o:o + g * hd].reshape((g, hd))
        o += g * hd
        m, l = buf[o:o + g], buf[o + g:o + 2 * g]
        acc[:] = 0
        m[:] = -np.inf
        l[:] = 0
        for start in range(0, n, _TILE):
            cnt = min(_TILE, n - start)
            _half_tile(k_cache[kvh, start:start + cnt], cnt, kf.view(np.uint32), kf)
            for j in range(g):
                qh = q[t, kvh * g + j]
                mx = m[j]
                for p in range(cnt):
                    d = F32(0.0)
                    for i in range(hd):
                        d += qh[i] * kf[p, i]
                    d *= scale
                    s[j, p] = d
                    mx = max(mx, d)
                corr = np.exp(m[j] - mx)
                m[j] = mx
                tot = F32(0.0)
                for p in range(cnt):
                    e = np.exp(s[j, p] - mx)
                    s[j, p] = e
                    tot += e
                l[j] = l[j] * corr + tot
                for i in range(hd):
                    acc[j, i] *= corr
            _half_tile(v_cache[kvh, start:start + cnt], cnt, vf.view(np.uint32), vf)
            for j in range(g):
                for p in range(cnt):
                    w = s[j, p]
                    for i in range(hd):
                        acc[j, i] += w * vf[p, i]
        for j in range(g):
            inv = F32(1.0) / l[j]
            for i in range(hd):
                out[t, kvh * g + j, i] = acc[j, i] * inv


def attention_scratch(n_threads: int, n_heads: int, n_kv_heads: int, head_dim: int) -> np.ndarray:
    g = n_heads // n_kv_heads
    return np.empty((n_threads, 2 * _TILE * head_dim + g * _TILE + g * head_dim + 2 * g), F32)


@nb.njit(cache=True, error_model="numpy")
def add_inplace(x, y):
    # x (T, E) += y (T, E): the residual connection
    T, E = x.shape
    for t in range(T):
        for i in range(E):
            x[t, i] += y[t, i]
