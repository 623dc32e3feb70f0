"""Tiny random GGUF files (llama, qwen3, gemma3) written with gguf-py's own writer and
quantizers, so runtime tests do not depend on our converter."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFWriter
from gguf.quants import quantize


def llama3_rope_freqs(head_dim, theta, factor=32.0, low=1.0, high=4.0, orig=8192):
    """rope_freqs values for llama3 rope scaling (written out here, independent of
    quant/convert.llama3_rope_factors)."""
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


CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\\n' }}{% endif %}")
TINY_MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s", "e n", "l l", "he ll", "hell o"]
TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_VOCAB = 256 + len(TINY_MERGES) + len(TINY_SPECIALS)   # 271


def add_tiny_tokenizer(w: GGUFWriter, vocab: int = TINY_VOCAB, chat_template: str | None = CHATML):
    """A small SmolLM2-style gpt2 vocabulary: the 256 byte tokens in byte order, the
    merge results in merge order, then control tokens; unused padding up to `vocab`."""
    from edgellama.bytelevel import byte_to_unicode
    b2u = byte_to_unicode()
    tokens = [b2u[b] for b in range(256)] + [m.replace(" ", "") for m in TINY_MERGES] + TINY_SPECIALS
    types = [1] * (256 + len(TINY_MERGES)) + [3] * len(TINY_SPECIALS)
    if vocab < len(tokens):
        raise ValueError(f"vocab {vocab} < {len(tokens)} tokens of the tiny tokenizer")
    tokens += [f"<|unused_{i}|>" for i in range(vocab - len(tokens))]
    types += [5] * (vocab - len(types))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(TINY_MERGES)
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(False)
    if chat_template is not None:
        w.add_chat_template(chat_template)


GGUF_PY_QUANTIZES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")


def write_tiny_gguf(path: Path, qtype: str = "Q8_0", *, dim=64, layers=2, heads=4, kv_heads=2,
                    ffn=96, vocab=256, ctx=512, tied=True, rope_scaling=True, embed_type=None,
                    seed=0, theta=500000.0, tokenizer=False, chat_template=CHATML,
                    arch="llama", head_dim=None, key_length=None, skip=(), window=None,
                    softcap=None, theta_swa=None) -> Path:
    """A tiny random GGUF of family `arch`: "llama", or "qwen3" (per-head q/k norm
    weights, NEOX RoPE, attention.key_length = head_dim, default dim // heads; pass
    rope_scaling=False, as Qwen 3 has none). tokenizer=True adds a small gpt2 vocabulary
    (see add_tiny_tokenizer; `vocab` must then be at least TINY_VOCAB). skip: tensor
    names left out, key_length: the head dim the metadata states (key/value length, rope
    dims) if not the tensors' (broken files for tests). "gemma3": qwen3's and a norm of
    each sublayer's output (post_attention_norm, post_ffw_norm); window: its
    attention.sliding_window (default 512), softcap: final_logit_softcapping, theta_swa:
    rope.freq_base_swa (both left out by default, as in Google's files)."""
    rng = np.random.default_rng(seed)
    hd = head_dim or dim // heads
    w = GGUFWriter(str(path), arch)
    w.add_name(f"tiny-random-{arch}")
    w.add_block_count(layers)
    w.add_context_length(ctx)
    w.add_embedding_length(dim)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    qk = arch in ("qwen3", "gemma3")
    if qk:
        w.add_key_length(key_length or hd)
        w.add_value_length(key_length or hd)
    w.add_rope_dimension_count(key_length or hd)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(1e-6 if arch == "gemma3" else 1e-5)
    if arch == "gemma3":
        w.add_sliding_window(window or 512)
        if softcap:
            w.add_final_logit_softcapping(softcap)
        if theta_swa:
            w.add_float32(f"{arch}.rope.freq_base_swa", theta_swa)
    w.add_vocab_size(vocab)
    if tokenizer:
        add_tiny_tokenizer(w, vocab, chat_template)

    def add(name, arr, t):
        if name in skip:
            return
        t = QT[t]
        if t in (QT.F32,):
            w.add_tensor(name, arr.astype(np.float32))
        elif t == QT.F16:
            w.add_tensor(name, arr.astype(np.float16))
        elif t.name in GGUF_PY_QUANTIZES:
            w.add_tensor(name, quantize(arr.astype(np.float32), t), raw_dtype=t)
        else:   # gguf-py has no quantizer for K-quants / IQ4_NL: ours (bit-exact with ggml)
            from edgellama.formats import quantize as ours
            w.add_tensor(name, ours(arr.astype(np.float32), t.name), raw_dtype=t)

    def mat(o, i, s=None):
        return (rng.standard_normal((o, i)) * (s or 1 / np.sqrt(i))).astype(np.float32)

    def norm(n=dim):
        return (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    add("token_embd.weight", mat(vocab, dim, 1.0), embed_type or qtype)
    if rope_scaling:
        add("rope_freqs.weight", llama3_rope_freqs(hd, theta), "F32")
    for i in range(layers):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", norm(), "F32")
        # qwen3: q and k rows 4x larger, as trained Qwen's are; its per-head norms undo it
        qs = 4 / np.sqrt(dim) if qk else None
        add(p + "attn_q.weight", mat(heads * hd, dim, qs), qtype)
        add(p + "attn_k.weight", mat(kv_heads * hd, dim, qs), qtype)
        add(p + "attn_v.weight", mat(kv_heads * hd, dim), qtype)
        if qk:
            add(p + "attn_q_norm.weight", norm(hd), "F32")
            add(p + "attn_k_norm.weight", norm(hd), "F32")
        add(p + "attn_output.weight", mat(dim, heads * hd), qtype)
        add(p + "ffn_norm.weight", norm(), "F32")
        add(p + "ffn_gate.weight", mat(ffn, dim), qtype)
        add(p + "ffn_up.weight", mat(ffn, dim), qtype)
        add(p + "ffn_down.weight", mat(dim, ffn), qtype)
        if arch == "gemma3":
            add(p + "post_attention_norm.weight", norm(), "F32")
            add(p + "post_ffw_norm.weight", norm(), "F32")
    add("output_norm.weight", norm(), "F32")
    if not tied:
        add("output.weight", mat(vocab, dim), embed_type or qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
