"""Build Hugging Face-layout Llama checkpoints for tests (importable by any test module).

    write_tiny_llama(dir, tokenizer_dir=..., hidden=64, layers=2, ...) -> Path
        a random Llama-3.2-shaped checkpoint (config.json, safetensors, tokenizer files);
    gguf_to_hf_checkpoint(gguf_path, dir) -> Path
        the HF checkpoint a GGUF llama file came from (real weights, e.g. SmolLM2), with
        Q/K rows un-permuted back to HF order and a tokenizer.json rebuilt from the GGUF.

Convert either with `quant.convert.convert(dir, out.gguf, qtype=...)` to get a GGUF.
"""
from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np

LLAMA3_SCALING = {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192, "rope_type": "llama3"}
LLAMA3_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
                   "<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
                   "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
_PRE = {
    "llama-bpe": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": (
            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
            r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")},
         "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
    "smollm": {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]},
}


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], dtype: str = "bf16") -> None:
    """Write float tensors as bf16 / f16 / f32 safetensors (bf16 rounded to nearest even)."""
    header, blobs, off = {}, [], 0
    for name, x in tensors.items():
        x = np.asarray(x, np.float32)
        if dtype == "bf16":
            # round to nearest even; unchecked so tests can plant NaN/inf
            u = x.view(np.uint32).astype(np.uint64)
            raw = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16).tobytes()
        else:
            raw = x.astype(np.float16 if dtype == "f16" else np.float32).tobytes()
        header[name] = {"dtype": dtype.upper(), "shape": list(x.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for b in blobs:
            f.write(b)


def _save_weights(d: Path, tensors: dict[str, np.ndarray], dtype: str, shards: int) -> None:
    names = list(tensors)
    if shards == 1:
        write_safetensors(d / "model.safetensors", tensors, dtype)
        return
    wmap = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s::shards]
        write_safetensors(d / fname, {n: tensors[n] for n in part}, dtype)
        wmap.update({n: fname for n in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))


def write_tiny_llama(d, *, tokenizer_dir=None, hidden: int = 64, layers: int = 2, heads: int = 4,
                     kv_heads: int = 2, ffn: int = 128, vocab: int = 128256, tied: bool = True,
                     dtype: str = "bf16", rope_scaling: dict | None = LLAMA3_SCALING,
                     tokenizer: str | None = "llama3", instruct: bool = True, shards: int = 1,
                     seed: int = 0) -> Path:
    """A random LlamaForCausalLM checkpoint in `d`, shaped like Llama 3.2 but tiny.

    tokenizer: "llama3" copies tokenizer.json + tokenizer_config.json from
    `tokenizer_dir` (the real Llama 3 tokenizer), "tiktoken" copies only
    tokenizer.model + tokenizer_config.json, None writes no tokenizer. instruct=True
    sets eos to <|eot_id|>, adds a chat template and a generation_config.json with the
    list of end ids. Weights ~ N(0, 0.02), norms ~ 1 + N(0, 0.1)."""
    d = Path(d)
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    hd = hidden // heads
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": hd, "intermediate_size": ffn, "vocab_size": vocab, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "rope_scaling": rope_scaling,
        "tie_word_embeddings": tied, "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009] if instruct else 128001, "torch_dtype": "bfloat16",
    }
    (d / "config.json").write_text(json.dumps(config, indent=2))

    def w(*shape):
        return rng.normal(0, 0.02, size=shape).astype(np.float32)

    t = {"model.embed_tokens.weight": w(vocab, hidden),
         "model.norm.weight": 1 + rng.normal(0, 0.1, hidden).astype(np.float32)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = 1 + rng.normal(0, 0.1, hidden).astype(np.float32)
        t[p + "post_attention_layernorm.weight"] = 1 + rng.normal(0, 0.1, hidden).astype(np.float32)
        t[p + "self_attn.q_proj.weight"] = w(heads * hd, hidden)
        t[p + "self_attn.k_proj.weight"] = w(kv_heads * hd, hidden)
        t[p + "self_attn.v_proj.weight"] = w(kv_heads * hd, hidden)
        t[p + "self_attn.o_proj.weight"] = w(hidden, heads * hd)
        t[p + "mlp.gate_proj.weight"] = w(ffn, hidden)
        t[p + "mlp.up_proj.weight"] = w(ffn, hidden)
        t[p + "mlp.down_proj.weight"] = w(hidden, ffn)
    if not tied:
        t["lm_head.weight"] = w(vocab, hidden)
    _save_weights(d, t, dtype, shards)

    if tokenizer is not None:
        src = Path(tokenizer_dir)
        tcfg = json.loads((src / "tokenizer_config.json").read_text())
        if instruct:
            tcfg["eos_token"] = "<|eot_id|>"
            tcfg["chat_template"] = LLAMA3_TEMPLATE
            (d / "generation_config.json").write_text(json.dumps(
                {"bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
                 "do_sample": True, "temperature": 0.6, "top_p": 0.9}))
        (d / "tokenizer_config.json").write_text(json.dumps(tcfg))
        shutil.copy(src / ("tokenizer.json" if tokenizer == "llama3" else "tokenizer.model"), d)
    return d


_HF_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight", "attn_norm": "input_layernorm",
             "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
             "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj",
             "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    # GGUF interleaved-pair rows -> HF rotate-half rows (inverse of the converter's permute)
    hd = w.shape[0] // n_heads
    return w.reshape(n_heads, hd // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


def gguf_to_hf_checkpoint(gguf_path, d, dtype: str = "bf16") -> Path:
    """Write the HF checkpoint that a llama GGUF corresponds to (weights dequantized with
    gguf-py, Q/K un-permuted; tokenizer.json rebuilt from the GGUF vocab and merges with
    the matching pre-tokenizer; tokenizer_config.json with the chat template)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    d = Path(d)
    d.mkdir(parents=True, exist_ok=True)
    r = GGUFReader(gguf_path)
    kv = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    n_head, n_kv = kv["llama.attention.head_count"], kv["llama.attention.head_count_kv"]
    tensors, names = {}, {t.name for t in r.tensors}
    for t in r.tensors:
        if t.name == "rope_freqs.weight":
            continue
        x = dequantize(t.data, t.tensor_type).reshape(tuple(reversed([int(s) for s in t.shape])))
        x = np.asarray(x, np.float32)
        if t.name.startswith("blk."):
            _, i, kind, _ = t.name.split(".")
            if kind == "attn_q":
                x = _unpermute(x, n_head)
            elif kind == "attn_k":
                x = _unpermute(x, n_kv)
            hf = f"model.layers.{i}.{_HF_NAMES[kind]}.weight"
        else:
            hf = _HF_NAMES[t.name]
        tensors[hf] = x
    _save_weights(d, tensors, dtype, 1)

    n_embd = kv["llama.embedding_length"]
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": n_embd,
        "num_hidden_layers": kv["llama.block_count"], "num_attention_heads": n_head,
        "num_key_value_heads": n_kv, "intermediate_size": kv["llama.feed_forward_length"],
        "vocab_size": len(kv["tokenizer.ggml.tokens"]),
        "max_position_embeddings": kv["llama.context_length"],
        "rms_norm_eps": kv["llama.attention.layer_norm_rms_epsilon"],
        "rope_theta": kv["llama.rope.freq_base"], "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": kv.get("tokenizer.ggml.bos_token_id"), "eos_token_id": kv.get("tokenizer.ggml.eos_token_id"),
    }
    if kv["llama.rope.dimension_count"] != n_embd // n_head:
        config["head_dim"] = kv["llama.rope.dimension_count"]
    (d / "config.json").write_text(json.dumps(config, indent=2))

    tokens, types = kv["tokenizer.ggml.tokens"], kv["tokenizer.ggml.token_type"]
    added = [{"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": ty == 3}
             for i, (tok, ty) in enumerate(zip(tokens, types)) if ty in (3, 4)]
    tj = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
          "normalizer": None, "pre_tokenizer": _PRE[kv["tokenizer.ggml.pre"]],
          "post_processor": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                             "use_regex": False},
          "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
          "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                    "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                    "ignore_merges": False,
                    "vocab": {tok: i for i, (tok, ty) in enumerate(zip(tokens, types)) if ty != 5},
                    "merges": kv["tokenizer.ggml.merges"]}}
    (d / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False), encoding="utf-8")
    tcfg = {"tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False,
            "added_tokens_decoder": {str(a["id"]): {k: v for k, v in a.items() if k != "id"} for a in added}}
    for typ, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("unk", "unknown_token_id"),
                     ("pad", "padding_token_id")):
        if f"tokenizer.ggml.{key}" in kv:
            tcfg[f"{typ}_token"] = tokens[kv[f"tokenizer.ggml.{key}"]]
    for typ in ("bos", "eos"):
        if f"tokenizer.ggml.add_{typ}_token" in kv:
            tcfg[f"add_{typ}_token"] = kv[f"tokenizer.ggml.add_{typ}_token"]
    if "tokenizer.chat_template" in kv:
        tcfg["chat_template"] = kv["tokenizer.chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(tcfg, ensure_ascii=False), encoding="utf-8")
    return d
