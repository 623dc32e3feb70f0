"""llama.cpp's K-quant mixes for llama and Qwen 3 models: which GGML type each tensor gets.

A port of `llama_tensor_get_type` and its callers in llama.cpp's src/llama-quant.cpp,
for the llama and qwen3 architectures without an importance matrix, as built into
llama-cpp-python 0.3.36 (`llama_model_quantize`, what `llama-quantize` runs). With it,
`convert --type q4_k_m` writes the file llama-quantize makes from our F32 file:

* only 2-D tensors named *weight, not *_norm.weight, are quantized (1-D stay F32, as
  Qwen 3's attn_q_norm / attn_k_norm);
* output.weight, and token_embd.weight when the embedding is tied (no output.weight),
  take the output rule: Q8_0 if its rows are not a multiple of 256, else Q6_K;
* attn_v, ffn_down and attn_output get more bits per mix (tables below), by position:
  the i-th attn_v of n (counted in file order) and the i-th ffn_down of n_layer;
* a type whose block does not divide the row length falls back (FALLBACK), and to F16
  if that does not fit either (rows not a multiple of 32);
* tensors are written in llama-quantize's order: names without a layer sorted, then
  layer by layer, names sorted within a layer.

Qwen 3 takes the same rules but one: llama.cpp names model sizes per architecture, and
only a llama of 80 layers with grouped-query attention is its "70B" (attn_v bumped to
Q5_K); Qwen 3 has no such size. Rules for other architectures, MoE models (n_expert),
Falcon and the IQ/TQ mixes are left out: edgellama converts dense llama and Qwen 3
checkpoints only.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType


@dataclass(frozen=True)
class Mix:
    name: str       # llama-quantize's name, e.g. "Q4_K_M"
    ftype: int      # general.file_type it writes (LLAMA_FTYPE_MOSTLY_*)
    default: str    # the type of every tensor no rule bumps (llama_ftype_get_default_type)


MIXES = {m.name.lower(): m for m in (
    Mix("Q2_K", LlamaFileType.MOSTLY_Q2_K, "Q2_K"),
    Mix("Q3_K_M", LlamaFileType.MOSTLY_Q3_K_M, "Q3_K"),
    Mix("Q4_K_S", LlamaFileType.MOSTLY_Q4_K_S, "Q4_K"),
    Mix("Q4_K_M", LlamaFileType.MOSTLY_Q4_K_M, "Q4_K"),
    Mix("Q5_K_S", LlamaFileType.MOSTLY_Q5_K_S, "Q5_K"),
    Mix("Q5_K_M", LlamaFileType.MOSTLY_Q5_K_M, "Q5_K"),
    Mix("Q6_K", LlamaFileType.MOSTLY_Q6_K, "Q6_K"),
)}


def use_more_bits(i: int, n: int) -> bool:
    """The first and last eighth of the layers and every third one between them."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


# Per mix: rule(i, n, n_gqa) -> type, or None to keep the mix's default. i of n is the
# tensor's position among its kind in file order: llama.cpp's i_attention_wv of
# n_attention_wv (attn_v tensors in the file) and i_ffn_down of n_layer; attn_output
# rules ignore it.
ATTN_V = {
    "Q2_K": lambda i, n, gqa: "Q4_K" if gqa >= 4 else "Q3_K",
    "Q3_K_M": lambda i, n, gqa: "Q5_K" if i < 2 else "Q4_K",
    "Q4_K_S": lambda i, n, gqa: "Q5_K" if i < 4 else None,
    "Q4_K_M": lambda i, n, gqa: "Q6_K" if use_more_bits(i, n) else None,
    "Q5_K_M": lambda i, n, gqa: "Q6_K" if use_more_bits(i, n) else None,
}
FFN_DOWN = {
    "Q2_K": lambda i, n, gqa: "Q3_K",
    "Q3_K_M": lambda i, n, gqa: "Q5_K" if i < n // 16 else "Q4_K",   # Q3_K only for Falcon
    "Q4_K_S": lambda i, n, gqa: "Q5_K" if i < n // 8 else None,
    "Q4_K_M": lambda i, n, gqa: "Q6_K" if use_more_bits(i, n) else None,
    "Q5_K_M": lambda i, n, gqa: "Q6_K" if use_more_bits(i, n) else None,
}
ATTN_OUTPUT = {
    "Q2_K": lambda i, n, gqa: "Q3_K",
    "Q3_K_M": lambda i, n, gqa: "Q4_K",
}
RULES = {"attn_v": ATTN_V, "ffn_down": FFN_DOWN, "attn_output": ATTN_OUTPUT}

# tensor_type_fallback: a type whose block does not divide the row length -> a 32-block
# type of about as many bits. (Older llama.cpp sent Q2_K/Q3_K to IQ4_NL; the one in
# llama-cpp-python 0.3.36 sends them to Q4_0.)
FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}

_LAYER = re.compile(r"blk\.(\d+)\.")


def block_size(type_name: str) -> int:
    return GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][0]


def file_order(names) -> list[str]:
    """Tensor names in the order llama-quantize writes them (llama_model_loader's
    weights_map: layer number first, -1 for tensors outside a layer, then the name)."""
    def key(name):
        m = _LAYER.match(name)
        return (int(m.group(1)) if m else -1, name)
    return sorted(names, key=key)


def quantized(name: str, shape: tuple[int, ...]) -> bool:
    """tensor_allows_quantization, for the tensors a llama model has."""
    return len(shape) >= 2 and name.endswith("weight") and "_norm.weight" not in name


@dataclass(frozen=True)
class Choice:
    name: str
    type: str                   # the GGML type written
    wanted: str | None = None   # the type the rules chose, when it had to fall back


def _fallback(wanted: str, cols: int) -> str:
    if cols % block_size(wanted) == 0:
        return wanted
    t = FALLBACK.get(wanted)        # Q8_0 (and anything else) has none: F16
    return t if t and cols % block_size(t) == 0 else "F16"


def plan(mix_name: str, tensors: dict[str, tuple[int, ...]], n_layer: int, n_head: int,
         n_head_kv: int, arch: str = "llama") -> list[Choice]:
    """The type of every tensor ({name: NumPy shape}) of a model of architecture `arch`
    (llama or qwen3) in mix `mix_name` (a key of MIXES), in llama-quantize's file order."""
    mix = MIXES[mix_name]
    names = file_order(tensors)
    tied = "output.weight" not in tensors
    gqa = n_head // n_head_kv
    # llama.cpp calls an 80-layer llama with grouped-query attention "70B": its attn_v
    # (8x smaller than attn_q) gets Q5_K instead of Q3_K / Q4_K. An 80-layer qwen3 is of
    # no named size there (llm_type UNKNOWN): no bump.
    is_70b = arch == "llama" and n_layer == 80 and n_head != n_head_kv
    counts = {"attn_v": sum(n.endswith("attn_v.weight") for n in names), "ffn_down": n_layer}
    seen = dict.fromkeys(counts, 0)
    out = []
    for name in names:
        shape = tensors[name]
        if not quantized(name, shape):
            out.append(Choice(name, "F32"))
            continue
        cols = shape[-1]
        kind = name.split(".")[-2]
        if name == "output.weight" or (tied and name == "token_embd.weight"):
            # the output rule: the block size tested is the mix's default type's
            t = "Q8_0" if cols % block_size(mix.default) else "Q6_K"
        elif kind in RULES:
            rule = RULES[kind].get(mix.name)
            t = (rule and rule(seen.get(kind, 0), counts.get(kind, 0), gqa)) or mix.default
            if kind == "attn_v" and is_70b and t in ("Q3_K", "Q4_K"):
                t = "Q5_K"
            if kind in seen:
                seen[kind] += 1
        else:
            t = mix.default
        final = _fallback(t, cols)
        out.append(Choice(name, final, t if final != t else None))
    return out
