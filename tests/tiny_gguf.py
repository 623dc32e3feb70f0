"""Tiny random llama GGUF files written with gguf-py's own writer and quantizers, so
runtime tests do not depend on our converter."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFWriter
from gguf.quants import quantize


def llama3_rope_freqs(head_dim, theta, factor=32.0, low=1.0, high=4.0, orig=8192):
    """rope_freqs values for llama3 scaling, DESIGN.md §3 (independent of quant/convert)."""
    out = []
    for i in range(0, head_dim, 2):
        f = 1.0 / theta ** (i / head_dim)
        wl = 2 * np.pi / f
        if wl < orig / high:
            out.append(1.0)
        elif wl > orig / low:
            out.append(factor)
        else:
            s = (orig / wl - low) / (high - low)
            out.append(1.0 / ((1 - s) / factor + s))
    return np.array(out, np.float32)


def write_tiny_gguf(path: Path, qtype: str = "Q8_0", *, dim=64, layers=2, heads=4, kv_heads=2,
                    ffn=96, vocab=256, ctx=512, tied=True, rope_scaling=True, embed_type=None,
                    seed=0, theta=500000.0) -> Path:
    rng = np.random.default_rng(seed)
    hd = dim // heads
    w = GGUFWriter(str(path), "llama")
    w.add_name("tiny-random-llama")
    w.add_block_count(layers)
    w.add_context_length(ctx)
    w.add_embedding_length(dim)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)

    def add(name, arr, t):
        t = QT[t]
        if t in (QT.F32,):
            w.add_tensor(name, arr.astype(np.float32))
        elif t == QT.F16:
            w.add_tensor(name, arr.astype(np.float16))
        else:
            w.add_tensor(name, quantize(arr.astype(np.float32), t), raw_dtype=t)

    def mat(o, i, s=None):
        return (rng.standard_normal((o, i)) * (s or 1 / np.sqrt(i))).astype(np.float32)

    def norm():
        return (1 + 0.1 * rng.standard_normal(dim)).astype(np.float32)

    add("token_embd.weight", mat(vocab, dim, 1.0), embed_type or qtype)
    if rope_scaling:
        add("rope_freqs.weight", llama3_rope_freqs(hd, theta), "F32")
    for i in range(layers):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", norm(), "F32")
        add(p + "attn_q.weight", mat(heads * hd, dim), qtype)
        add(p + "attn_k.weight", mat(kv_heads * hd, dim), qtype)
        add(p + "attn_v.weight", mat(kv_heads * hd, dim), qtype)
        add(p + "attn_output.weight", mat(dim, heads * hd), qtype)
        add(p + "ffn_norm.weight", norm(), "F32")
        add(p + "ffn_gate.weight", mat(ffn, dim), qtype)
        add(p + "ffn_up.weight", mat(ffn, dim), qtype)
        add(p + "ffn_down.weight", mat(dim, ffn), qtype)
    add("output_norm.weight", norm(), "F32")
    if not tied:
        add("output.weight", mat(vocab, dim), embed_type or qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
