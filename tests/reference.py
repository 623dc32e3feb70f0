"""Plain NumPy float32 reference of the forward pass of the families we run (llama,
qwen3, gemma3), for tests only.

Reads the file with gguf-py's GGUFReader and dequantizes with gguf.quants, so it
shares no code with the runtime. Readable first: loops over heads, full softmax.
"""
from __future__ import annotations

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


def load_reference(path):
    r = GGUFReader(str(path))
    arch = r.fields["general.architecture"].contents()
    meta = {k: f.contents() for k, f in r.fields.items()
            if k.startswith(arch + ".") or k == "general.architecture"}
    W = {t.name: dequantize(t.data, t.tensor_type).astype(np.float32).reshape(
        tuple(int(d) for d in reversed(t.shape))) for t in r.tensors}
    return meta, W


def rope_adjacent(x, positions, inv_freq):
    # x (T, nh, hd): rotate pairs (2i, 2i+1) by positions[t] * inv_freq[i]
    ang = positions[:, None].astype(np.float64) * inv_freq[None, :].astype(np.float64)
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., 0::2].astype(np.float64), x[..., 1::2].astype(np.float64)
    out = np.empty_like(x)
    out[..., 0::2] = a * c - b * s
    out[..., 1::2] = a * s + b * c
    return out


def rope_neox(x, positions, inv_freq):
    # x (T, nh, hd): rotate pairs (i, i + hd/2) by positions[t] * inv_freq[i] (rotate_half)
    ang = positions[:, None].astype(np.float64) * inv_freq[None, :].astype(np.float64)
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    m = x.shape[-1] // 2
    a, b = x[..., :m].astype(np.float64), x[..., m:].astype(np.float64)
    return np.concatenate([a * c - b * s, a * s + b * c], axis=-1).astype(x.dtype)


# llama.cpp's rope type per architecture (llama_model_rope_type): NEOX for these
NEOX_ARCHS = ("qwen3", "gemma3")


def gelu_tanh(x):
    x = x.astype(np.float64)
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def is_local(arch, meta, layer):
    # Gemma 3: five sliding-window layers, then a global one (llama.cpp's swa pattern 6)
    return arch == "gemma3" and f"{arch}.attention.sliding_window" in meta and (layer + 1) % 6 != 0


def rmsnorm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def exact_product(x, W, name):
    return x @ W[name].T


def reference_forward(meta, W, tokens, product=exact_product, cache=None, gelu=gelu_tanh):
    """Logits (T, V) for tokens at positions 0..T-1. product(x, W, name) is each matrix
    product x W[name]^T (a model of how a runtime rounds x can stand in); gelu, Gemma's
    activation (a model of a runtime's GELU can stand in). cache: a dict
    {"k": [...], "v": [...]} of each layer's stored K (roped) and V, (n, KV, hd) f32 of
    f16 values, for positions 0..n-1: the tokens then sit at n..n+T-1, see those
    positions too, and their K/V are appended (an empty dict starts one). Gemma 3's
    local layers mask what lies sliding_window positions or more behind a token."""
    arch = meta["general.architecture"]
    E = meta[f"{arch}.embedding_length"]
    H = meta[f"{arch}.attention.head_count"]
    KV = meta[f"{arch}.attention.head_count_kv"]
    L = meta[f"{arch}.block_count"]
    eps = meta[f"{arch}.attention.layer_norm_rms_epsilon"]
    theta = meta[f"{arch}.rope.freq_base"]
    hd = meta.get(f"{arch}.attention.key_length", E // H)
    rope = rope_neox if arch in NEOX_ARCHS else rope_adjacent
    gemma = arch == "gemma3"
    inv_freq = 1.0 / theta ** (np.arange(0, hd, 2) / hd)
    if "rope_freqs.weight" in W:
        inv_freq = inv_freq / W["rope_freqs.weight"]
    theta_local = meta.get(f"{arch}.rope.freq_base_swa", 10000.0)
    inv_freq_local = 1.0 / theta_local ** (np.arange(0, hd, 2) / hd)
    window = meta.get(f"{arch}.attention.sliding_window", 0)
    softcap = meta.get(f"{arch}.final_logit_softcapping", 0.0)
    T = len(tokens)
    if cache is not None and not cache:
        cache.update(k=[np.zeros((0, KV, hd), np.float32)] * L, v=[np.zeros((0, KV, hd), np.float32)] * L)
    n = 0 if cache is None else len(cache["k"][0])
    pos = np.arange(n, n + T)
    x = W["token_embd.weight"][np.asarray(tokens)]
    if gemma:
        x = x * np.float32(np.sqrt(E))
    mask = np.triu(np.full((T, n + T), -np.inf, np.float32), n + 1)
    behind = pos[:, None] - np.arange(n + T)[None, :]          # query pos - key pos
    local_mask = np.where(behind >= window, -np.inf, mask).astype(np.float32)
    for i in range(L):
        p = f"blk.{i}."
        local = is_local(arch, meta, i)
        h = rmsnorm(x, W[p + "attn_norm.weight"], eps)
        q = product(h, W, p + "attn_q.weight").reshape(T, H, hd)
        k = product(h, W, p + "attn_k.weight").reshape(T, KV, hd)
        if p + "attn_q_norm.weight" in W:      # qwen3: each head normed before RoPE
            q = rmsnorm(q, W[p + "attn_q_norm.weight"], eps)
            k = rmsnorm(k, W[p + "attn_k_norm.weight"], eps)
        f = inv_freq_local if local else inv_freq
        q, k = rope(q, pos, f), rope(k, pos, f)
        v = product(h, W, p + "attn_v.weight").reshape(T, KV, hd)
        # the cache stores K and V as f16
        k, v = k.astype(np.float16).astype(np.float32), v.astype(np.float16).astype(np.float32)
        if cache is not None:
            cache["k"][i] = k = np.concatenate([cache["k"][i], k])
            cache["v"][i] = v = np.concatenate([cache["v"][i], v])
        att = np.empty((T, H, hd), np.float32)
        for head in range(H):
            kvh = head // (H // KV)
            s = q[:, head] @ k[:, kvh].T / np.sqrt(hd) + (local_mask if local else mask)
            pr = np.exp(s - s.max(-1, keepdims=True))
            pr /= pr.sum(-1, keepdims=True)
            att[:, head] = pr @ v[:, kvh]
        o = product(att.reshape(T, H * hd), W, p + "attn_output.weight")
        if gemma:                               # each sublayer's output normed before the add
            o = rmsnorm(o, W[p + "post_attention_norm.weight"], eps)
        x = x + o
        h = rmsnorm(x, W[p + "ffn_norm.weight"], eps)
        g = product(h, W, p + "ffn_gate.weight")
        u = product(h, W, p + "ffn_up.weight")
        o = product((gelu(g) if gemma else g / (1 + np.exp(-g))) * u, W, p + "ffn_down.weight")
        if gemma:
            o = rmsnorm(o, W[p + "post_ffw_norm.weight"], eps)
        x = x + o
    out = "output.weight" if "output.weight" in W else "token_embd.weight"
    logits = product(rmsnorm(x, W["output_norm.weight"], eps), W, out)
    return softcap * np.tanh(logits / softcap) if softcap else logits
