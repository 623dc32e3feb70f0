"""HF LlamaForCausalLM checkpoint -> GGUF, as llama.cpp's convert_hf_to_gguf.py writes it.

The converter is a name table plus two named transforms (Q/K row permutation,
llama3 rope_freqs), a shape check on every tensor against config.json, and the
metadata. Everything is validated before the output is created; tensors are then
streamed one chunk of rows at a time from the memory-mapped shards into a temp file
beside the output, which is renamed into place only when complete.

`--type` is one format for every matrix (q4_0 ... f32), or one of llama.cpp's K-quant
mixes (q4_k_m ...: a type per tensor, see mix.py). A mix's file is the one llama.cpp's
llama-quantize makes from our f32 file: same tensor order, types and bytes, and the two
keys llama-quantize rewrites (general.quantization_version, general.file_type) moved
last as it does.
"""
from __future__ import annotations

import errno
import math
import os
import re
import secrets
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
from gguf.constants import GGUFValueType as V

from edgellama.errors import EdgeError
from edgellama.models import FAMILIES

from edgellama.formats import FORMATS, WRITABLE, quantize, row_bytes
from edgellama.sampling import SamplingParams
from edgellama.gguf_write import GGUFStreamWriter
from . import mix
from .hf import I32_MAX, TensorRef, _show, load_json, open_checkpoint, want_float, want_int
from .hf_tokenizer import load_tokenizer

# HF architecture -> general.architecture (a family of edgellama/models)
HF_ARCHS = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}
SUPPORTED_ARCHS = tuple(HF_ARCHS)
SINGLE_TYPES = ("q4_0", "q4_1", "q8_0", "f16", "bf16", "f32")   # one format for every matrix
QTYPES = SINGLE_TYPES + tuple(mix.MIXES)
CHUNK_ELEMS = 1 << 23            # rows per chunk ~ 8M values: 32 MB of f32 in flight

# HF name (with {i} for the layer) -> GGUF name
NAME_TABLE = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "model.layers.{i}.input_layernorm.weight": "blk.{i}.attn_norm.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "blk.{i}.ffn_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "blk.{i}.attn_q.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "blk.{i}.attn_k.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "blk.{i}.attn_v.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "blk.{i}.attn_output.weight",
    "model.layers.{i}.self_attn.q_norm.weight": "blk.{i}.attn_q_norm.weight",    # qwen3
    "model.layers.{i}.self_attn.k_norm.weight": "blk.{i}.attn_k_norm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "blk.{i}.ffn_gate.weight",
    "model.layers.{i}.mlp.up_proj.weight": "blk.{i}.ffn_up.weight",
    "model.layers.{i}.mlp.down_proj.weight": "blk.{i}.ffn_down.weight",
}
IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")   # derived, not weights
_LAYER = re.compile(r"model\.layers\.(\d+)\.")

Progress = Callable[[str, int, int], None]     # (tensor name, bytes done, bytes total)


@dataclass(frozen=True)
class HParams:
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_vocab: int
    n_ctx: int
    rope_theta: float
    rms_eps: float
    tied: bool
    rope_scaling: dict | None
    explicit_head_dim: bool
    arch: str                      # general.architecture: llama, qwen3


@dataclass
class ConvertSummary:
    out_path: Path
    qtype: str
    tensors: list[tuple[str, str, tuple[int, ...]]]   # (gguf name, format, shape)
    n_params: int
    file_size: int
    seconds: float
    warnings: list[str] = field(default_factory=list)

    @property
    def type_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for _, fmt, _ in self.tensors:
            counts[fmt] = counts.get(fmt, 0) + 1
        return counts

    @property
    def bits_per_weight(self) -> float:
        """Tensor data bits per weight (metadata, e.g. a 128k-token vocabulary, excluded)."""
        data = sum(_nbytes(fmt, shape) for _, fmt, shape in self.tensors)
        return data * 8 / max(self.n_params, 1)

    def plan_lines(self) -> list[str]:
        """What each tensor became: one line per format, widest first, with its tensor
        and weight counts, its bits per weight and the tensors (layers, when not all)."""
        groups: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
        for name, fmt, shape in self.tensors:
            groups.setdefault(fmt, []).append((name, shape))
        n_layer = len({n.split(".")[1] for n, _, _ in self.tensors if n.startswith("blk.")})
        lines = []
        for fmt, items in sorted(groups.items(), key=lambda g: -_bpw(g[0])):
            weights = sum(math.prod(shape) for _, shape in items)
            lines.append(f"{fmt:6} {len(items):4} tensor{'s' if len(items) > 1 else ' '} "
                         f"{weights / 1e6:9.1f} M weights "
                         f"{_bpw(fmt):5.2f} bpw  {_describe([n for n, _ in items], n_layer)}")
        return lines


def _nbytes(fmt: str, shape: tuple[int, ...]) -> int:
    return math.prod(shape[:-1]) * row_bytes(FORMATS[fmt].type_id, shape[-1])


def _bpw(fmt: str) -> float:
    f = FORMATS[fmt]
    return f.type_size * 8 / f.block_size


def _layer_runs(layers: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    runs: list[list[int]] = []
    for i in layers:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else f"{r[0]}" for r in runs)


def _describe(names: list[str], n_layer: int) -> str:
    """Tensor names -> "token_embd; attn_v, ffn_down (layers 0-1, 3)": per-layer kinds
    sharing a set of layers are listed together, "all layers" left unsaid."""
    single = sorted(n.removesuffix(".weight") for n in names if not n.startswith("blk."))
    layers: dict[str, list[int]] = {}
    for n in names:
        if n.startswith("blk."):
            _, i, kind, _ = n.split(".")
            layers.setdefault(kind, []).append(int(i))
    by_set: dict[tuple[int, ...], list[str]] = {}
    for kind, ls in sorted(layers.items()):
        by_set.setdefault(tuple(sorted(ls)), []).append(kind)
    parts = [", ".join(single)] if single else []
    for ls, kinds in sorted(by_set.items(), key=lambda g: (len(g[0]) != n_layer, g[0])):
        where = "" if len(ls) == n_layer else f" (layer{'s' if len(ls) > 1 else ''} {_layer_runs(list(ls))})"
        parts.append(", ".join(kinds) + where)
    return "; ".join(parts)


def read_hparams(hf_dir: Path) -> HParams:
    """config.json, every value checked for type and for the range of the GGUF field it
    becomes (u32 sizes, f32 rope base and epsilon) and of what our loader accepts."""
    path = hf_dir / "config.json"
    cfg = load_json(path, "model config")
    archs = cfg.get("architectures")
    if not isinstance(archs, list) or not any(a in SUPPORTED_ARCHS for a in archs):
        raise EdgeError(f"{path}: unsupported architecture {_show(archs)} "
                        f"(supported: {', '.join(SUPPORTED_ARCHS)})")
    arch = next(HF_ARCHS[a] for a in archs if a in HF_ARCHS)

    def size(key, default=None):
        v = cfg.get(key, default)
        if v is None:
            raise EdgeError(f"{path}: missing '{key}'")
        return want_int(path, key, v)

    n_embd, n_head = size("hidden_size"), size("num_attention_heads")
    n_head_kv = size("num_key_value_heads", n_head)
    head_dim = size("head_dim", n_embd // n_head if n_embd % n_head == 0 else None)
    if n_head % n_head_kv:
        raise EdgeError(f"{path}: num_attention_heads {n_head} is not a multiple of "
                        f"num_key_value_heads {n_head_kv}")
    if head_dim % 2:
        raise EdgeError(f"{path}: head_dim {head_dim} must be even for RoPE")
    if head_dim * n_head != n_embd and arch == "llama":   # Qwen 3 states its own (0.6B: 128)
        raise EdgeError(f"{path}: head_dim {head_dim} x num_attention_heads {n_head} is not "
                        f"hidden_size {n_embd}; edgellama runs only models where they match")
    rs = cfg.get("rope_scaling")
    if rs is not None:
        if not isinstance(rs, dict):
            raise EdgeError(f"{path}: 'rope_scaling' must be an object or null, got {_show(rs)}")
        kind = rs.get("rope_type", rs.get("type"))
        if kind != "llama3":
            raise EdgeError(f"{path}: unsupported rope_scaling {_show(kind or rs)} (supported: llama3, none)")
        rs = dict(rs)
        for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if rs.get(k) is None:
                raise EdgeError(f"{path}: rope_scaling.{k} missing")
            rs[k] = want_float(path, f"rope_scaling.{k}", rs[k], 0.0)
        if not rs["low_freq_factor"] < rs["high_freq_factor"]:
            raise EdgeError(f"{path}: rope_scaling.low_freq_factor {rs['low_freq_factor']:g} must be "
                            f"below high_freq_factor {rs['high_freq_factor']:g}")
    tied = cfg.get("tie_word_embeddings", False)
    if not isinstance(tied, bool):
        raise EdgeError(f"{path}: 'tie_word_embeddings' must be true or false, got {_show(tied)}")
    if cfg.get("rms_norm_eps") is None:
        raise EdgeError(f"{path}: missing 'rms_norm_eps'")
    theta = cfg.get("rope_theta")
    return HParams(
        n_layer=size("num_hidden_layers"), n_embd=n_embd, n_ff=size("intermediate_size"),
        n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim, n_vocab=size("vocab_size"),
        n_ctx=size("max_position_embeddings"),
        rope_theta=want_float(path, "rope_theta", 10000.0 if theta is None else theta, 0.0),
        # the loader's range (edgellama.args): 0 < epsilon < 1
        rms_eps=want_float(path, "rms_norm_eps", cfg["rms_norm_eps"], 0.0, 1.0, hi_open=True),
        tied=tied, rope_scaling=rs, explicit_head_dim="head_dim" in cfg, arch=arch)


def permute_index(rows: int, n_heads: int) -> np.ndarray:
    """Source row for each output row of a Q/K matrix: HF's rotate-half order ->
    GGUF's interleaved pairs. Within each head, new row 2j+c = old row c*hd/2 + j."""
    hd = rows // n_heads
    return np.arange(rows).reshape(n_heads, 2, hd // 2).swapaxes(1, 2).reshape(-1)


def llama3_rope_factors(hp: HParams) -> np.ndarray:
    """rope_freqs.weight: per-frequency divisor for llama3 rope scaling, (head_dim/2,) f32."""
    rs = hp.rope_scaling
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    orig = rs["original_max_position_embeddings"]
    freqs = 1.0 / hp.rope_theta ** (np.arange(0, hp.head_dim, 2, dtype=np.float64) / hp.head_dim)
    out = []
    for f in freqs:
        wl = 2 * math.pi / f
        if wl < orig / high:
            out.append(1.0)
        elif wl > orig / low:
            out.append(factor)
        else:
            s = (orig / wl - low) / (high - low)
            out.append(1 / ((1 - s) / factor + s))
    return np.array(out, np.float32)


@dataclass
class _Plan:
    name: str
    shape: tuple[int, ...]
    fmt: str
    src: TensorRef | None = None
    index: np.ndarray | None = None        # row permutation, or None
    data: np.ndarray | None = None         # generated tensors (rope_freqs)


def _expected_shapes(hp: HParams) -> dict[str, tuple[int, ...]]:
    e, f, q, kv = hp.n_embd, hp.n_ff, hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
    shapes = {"token_embd.weight": (hp.n_vocab, e), "output_norm.weight": (e,)}
    if not hp.tied:
        shapes["output.weight"] = (hp.n_vocab, e)
    for i in range(hp.n_layer):
        shapes.update({f"blk.{i}.attn_norm.weight": (e,), f"blk.{i}.ffn_norm.weight": (e,),
                       f"blk.{i}.attn_q.weight": (q, e), f"blk.{i}.attn_k.weight": (kv, e),
                       f"blk.{i}.attn_v.weight": (kv, e), f"blk.{i}.attn_output.weight": (e, q),
                       f"blk.{i}.ffn_gate.weight": (f, e), f"blk.{i}.ffn_up.weight": (f, e),
                       f"blk.{i}.ffn_down.weight": (e, f)})
        if FAMILIES[hp.arch].qk_norm:
            shapes.update({f"blk.{i}.attn_q_norm.weight": (hp.head_dim,),
                           f"blk.{i}.attn_k_norm.weight": (hp.head_dim,)})
    return shapes


def _gguf_name(hf_name: str) -> str | None:
    m = _LAYER.match(hf_name)
    key = hf_name.replace(m.group(0), "model.layers.{i}.", 1) if m else hf_name
    target = NAME_TABLE.get(key)
    return target.format(i=m.group(1)) if target and m else target


def _mix_types(hp: HParams, shapes: dict[str, tuple[int, ...]], qtype: str,
               warnings: list[str]) -> dict[str, str]:
    """{name: format} of mix `qtype` (in llama-quantize's file order), with one warning
    summing up the tensors that fell back to another type, as llama-quantize does."""
    choices = mix.plan(qtype, shapes, hp.n_layer, hp.n_head, hp.n_head_kv, hp.arch)
    fell: dict[tuple[str, str], int] = {}
    for c in choices:
        if c.wanted:
            fell[c.wanted, c.type] = fell.get((c.wanted, c.type), 0) + 1
    if fell:
        how = ", ".join(f"{a} -> {b} ({k})" for (a, b), k in fell.items())
        warnings.append(f"{sum(fell.values())} of {len(choices)} tensors fell back to a type whose "
                        f"block fits their rows, as llama-quantize does: {how}")
    return {c.name: c.type for c in choices}


def _plan(hf_dir: Path, hp: HParams, tensors: dict[str, TensorRef], qtype: str,
          embed_type: str | None, warnings: list[str]) -> list[_Plan]:
    family = FAMILIES[hp.arch]
    per_layer = len(family.layer_tensors)
    if hp.n_layer * per_layer > len(tensors):
        raise EdgeError(f"{hf_dir / 'config.json'}: num_hidden_layers {hp.n_layer} needs "
                        f"{hp.n_layer * per_layer} layer tensors, but the checkpoint has "
                        f"{len(tensors)} tensors")
    expected = _expected_shapes(hp)
    found: dict[str, TensorRef] = {}
    for hf_name, ref in tensors.items():
        if IGNORED.fullmatch(hf_name):
            continue
        name = _gguf_name(hf_name)
        if name == "output.weight" and hp.tied:
            warnings.append(f"{hf_name}: ignored (tie_word_embeddings is true; token_embd is the output)")
            continue
        if name not in expected:
            raise EdgeError(f"{ref.shard.path}: unexpected tensor {hf_name!r} for a "
                            f"{family.name} model with {hp.n_layer} layers")
        if ref.shape != expected[name]:
            raise EdgeError(f"{ref.shard.path}: tensor {hf_name!r} has shape {list(ref.shape)} but "
                            f"config.json implies {list(expected[name])}")
        found[name] = ref
    missing = [n for n in expected if n not in found]
    if missing:
        raise EdgeError(f"{hf_dir}: checkpoint is missing tensor {missing[0]!r}"
                        f"{f' ({len(missing)} missing in all)' if len(missing) > 1 else ''}")
    plans = []
    if hp.rope_scaling is not None:
        plans.append(_Plan("rope_freqs.weight", (hp.head_dim // 2,), "F32",
                           data=llama3_rope_factors(hp)[None, :]))
    mix_types = None
    if qtype.lower() in mix.MIXES:
        shapes = {p.name: p.shape for p in plans} | expected
        mix_types = _mix_types(hp, shapes, qtype.lower(), warnings)
    for name, shape in expected.items():
        if len(shape) == 1:
            fmt = "F32"
        elif name in ("token_embd.weight", "output.weight") and embed_type:
            fmt = embed_type
        else:
            fmt = mix_types[name] if mix_types else qtype
        if fmt not in WRITABLE:
            raise EdgeError(f"{name}: --type {qtype.lower()} needs {fmt}, which edgellama cannot "
                            f"write yet (writable: {', '.join(WRITABLE)})")
        if FORMATS[fmt].block_size > 1 and shape[-1] % FORMATS[fmt].block_size:
            warnings.append(f"{name}: row length {shape[-1]} is not a multiple of "
                            f"{FORMATS[fmt].block_size}; written as F16 instead of {fmt}")
            fmt = "F16"
        index = None      # NEOX families keep HF's rotate-half rows
        if name.endswith("attn_q.weight") and not family.neox:
            index = permute_index(shape[0], hp.n_head)
        elif name.endswith("attn_k.weight") and not family.neox:
            index = permute_index(shape[0], hp.n_head_kv)
        plans.append(_Plan(name, shape, fmt, src=found[name], index=index))
    if mix_types:
        at = {n: i for i, n in enumerate(mix_types)}
        plans.sort(key=lambda p: at[p.name])
    return plans


def _chunks(p: _Plan, progress: Progress | None, total: int, done: list[int]):
    """Converted bytes of one tensor, a chunk of rows at a time."""
    if p.data is not None:
        out = quantize(p.data, p.fmt, p.name)
        done[0] += out.nbytes
        yield out
        return
    rows = p.shape[0] if len(p.shape) > 1 else 1
    cols = p.shape[-1]
    step = max(1, CHUNK_ELEMS // cols)
    try:
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            out = quantize(p.src.rows(r0, r1, p.index), p.fmt, p.name)
            done[0] += out.nbytes
            if progress:
                progress(p.name, done[0], total)
            yield out
            if p.index is None:
                p.src.release()   # this tensor's pages so far are done with
    finally:
        p.src.release()


# generation_config.json field -> GGUF key and type, as llama.cpp's converter writes them
_SAMPLING_KEYS = {"temperature": ("general.sampling.temp", V.FLOAT32),
                  "top_p": ("general.sampling.top_p", V.FLOAT32),
                  "top_k": ("general.sampling.top_k", V.INT32),
                  "min_p": ("general.sampling.min_p", V.FLOAT32)}


_NEUTRAL_SAMPLING = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)


def _sampling_defaults(hf_dir: Path) -> list[tuple[str, V, float | int]]:
    """The model's recommended sampling (generation_config.json), as GGUF keys. Each value
    must fit its GGUF field (f32, i32) and pass the loader's own rules (SamplingParams),
    else an EdgeError: convert never writes a recommendation the runtime would reject."""
    path = hf_dir / "generation_config.json"
    if not path.exists():
        return []
    cfg = load_json(path, "generation config")
    out = []
    for field, (key, vt) in _SAMPLING_KEYS.items():
        v = cfg.get(field)
        if v is None:
            continue
        if vt == V.INT32:
            v = want_int(path, field, v, 0, I32_MAX, " (0 turns it off)")
        else:
            v = float(np.float32(want_float(path, field, v, 0.0, lo_open=False)))
        problems: list[str] = []     # the loader's rules, from edgellama.sampling
        _NEUTRAL_SAMPLING.with_defaults_from({key: v}, problems.append)
        if problems:
            why = problems[0].split(": ", 1)[-1]
            raise EdgeError(f"{path}: '{field}' = {v:g} would be ignored by edgellama ({why}); "
                            f"fix or remove it in {path.name}")
        out.append((key, vt, v))
    return out


def _check_runtime_tokenizer(tok) -> None:
    """Build the runtime's tokenizer and chat format from exactly the metadata we are about
    to write (the loader's own rules, edgellama.tokenizer): a vocabulary, merges or special
    tokens it would refuse are refused here, before anything is written."""
    from edgellama.chat_template import ChatFormat
    from edgellama.tokenizer import Tokenizer
    keys = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id", "pad": "padding_token_id"}
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": tok.pre, "tokenizer.ggml.tokens": tok.tokens,
            "tokenizer.ggml.token_type": np.asarray(tok.token_types, np.int32),
            "tokenizer.ggml.merges": tok.merges,
            **{f"tokenizer.ggml.{keys[t]}": i for t, i in tok.special_ids.items()},
            **{f"tokenizer.ggml.add_{t}_token": on for t, on in tok.add_special.items()}}
    if tok.chat_template is not None:
        meta["tokenizer.chat_template"] = tok.chat_template
    try:
        ChatFormat(Tokenizer.from_metadata(meta), tok.chat_template)
    except EdgeError as e:
        raise EdgeError(f"{tok.source}: edgellama could not load the tokenizer this makes: {e}") from None


def _metadata(w: GGUFStreamWriter, hp: HParams, name: str, qtype: str, tok,
              sampling: list[tuple[str, V, float | int]]) -> None:
    # A mix's keys are those of our f32 file as llama-quantize rewrites them: it sets
    # general.quantization_version, then general.file_type, each by removing the key
    # and appending it (gguf_set_val_u32), so both end up last.
    m = mix.MIXES.get(qtype)
    a = hp.arch
    w.kv("general.architecture", V.STRING, a)
    w.kv("general.type", V.STRING, "model")
    w.kv("general.name", V.STRING, name)
    w.kv(f"{a}.block_count", V.UINT32, hp.n_layer)
    w.kv(f"{a}.context_length", V.UINT32, hp.n_ctx)
    w.kv(f"{a}.embedding_length", V.UINT32, hp.n_embd)
    w.kv(f"{a}.feed_forward_length", V.UINT32, hp.n_ff)
    w.kv(f"{a}.attention.head_count", V.UINT32, hp.n_head)
    w.kv(f"{a}.attention.head_count_kv", V.UINT32, hp.n_head_kv)
    w.kv(f"{a}.rope.freq_base", V.FLOAT32, hp.rope_theta)
    w.kv(f"{a}.attention.layer_norm_rms_epsilon", V.FLOAT32, hp.rms_eps)
    if hp.explicit_head_dim:
        w.kv(f"{a}.attention.key_length", V.UINT32, hp.head_dim)
        w.kv(f"{a}.attention.value_length", V.UINT32, hp.head_dim)
    if m is None:
        w.kv("general.file_type", V.UINT32, int(FORMATS[qtype.upper()].file_type))
    w.kv(f"{a}.vocab_size", V.UINT32, hp.n_vocab)
    w.kv(f"{a}.rope.dimension_count", V.UINT32, hp.head_dim)
    w.kv("tokenizer.ggml.model", V.STRING, "gpt2")
    w.kv("tokenizer.ggml.pre", V.STRING, tok.pre)
    w.kv("tokenizer.ggml.tokens", V.ARRAY, tok.tokens, V.STRING)
    w.kv("tokenizer.ggml.token_type", V.ARRAY, tok.token_types, V.INT32)
    w.kv("tokenizer.ggml.merges", V.ARRAY, tok.merges, V.STRING)
    keys = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id", "pad": "padding_token_id"}
    for typ, tid in tok.special_ids.items():
        w.kv(f"tokenizer.ggml.{keys[typ]}", V.UINT32, tid)
    for typ, on in tok.add_special.items():
        w.kv(f"tokenizer.ggml.add_{typ}_token", V.BOOL, on)
    if tok.chat_template is not None:
        w.kv("tokenizer.chat_template", V.STRING, tok.chat_template)
    for key, vt, value in sampling:
        w.kv(key, vt, value)
    w.kv("general.quantization_version", V.UINT32, 2)
    if m is not None:
        w.kv("general.file_type", V.UINT32, int(m.ftype))


def _model_name(hf_dir: Path) -> str:
    return hf_dir.resolve().name


# -- the output file: never an input, a temp name nobody can plant, no silent replace ---
_TMP_RE = re.compile(r"\..*\.edgellama-(\d+)-[0-9a-f]{16}\.tmp", re.S)
STALE_TMP_SECONDS = 600          # a temp file this old whose pid is gone is a killed convert's


def _tmp_name(out_path: Path) -> str:
    """`.{first 32 chars of the output name}.edgellama-{pid}-{16 random hex}.tmp`: at most
    ~170 bytes whatever the output name's length, unpredictable, recognisably ours."""
    return f".{out_path.name[:32]}.edgellama-{os.getpid()}-{secrets.token_hex(8)}.tmp"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return pid > 0             # someone else's live process (or nonsense: leave it)
    return True


def clean_stale_temps(folder: Path, now: float | None = None) -> list[str]:
    """Remove temp files of converts that were killed (SIGKILL, power loss) in `folder`:
    our name pattern, a regular file of ours (not a symlink), older than
    STALE_TMP_SECONDS and its pid not running. Returns the names removed."""
    now = time.time() if now is None else now
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for e in entries:
        m = _TMP_RE.fullmatch(e.name)
        if not m:
            continue
        try:
            st = e.stat(follow_symlinks=False)
            if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid()
                    or now - st.st_mtime < STALE_TMP_SECONDS or _pid_alive(int(m.group(1)))):
                continue
            os.unlink(e.path)
            removed.append(e.name)
        except OSError:
            continue
    return removed


def _input_ids(hf_dir: Path) -> dict[tuple[int, int], Path]:
    """(device, inode) of the checkpoint folder and of every file in it, symlinks followed."""
    ids = {}
    for p in [hf_dir, *hf_dir.iterdir()]:
        try:
            st = p.stat()
        except OSError:
            continue
        ids[st.st_dev, st.st_ino] = p
    return ids


def _refuse_input_as_output(hf_dir: Path, out_path: Path) -> None:
    try:
        st = out_path.stat()
    except OSError:
        return
    hit = _input_ids(hf_dir).get((st.st_dev, st.st_ino))
    if hit is not None:
        raise EdgeError(f"{out_path}: is the input {hit} (same file, through a link or not); "
                        f"choose another output path (--force does not allow this)")


def _refuse_special_output(out_path: Path) -> None:
    """--force replaces a regular file only: never a link (nor what it points to), a
    folder, a FIFO or a device (as root, /dev/null itself would go)."""
    try:
        mode = os.lstat(out_path).st_mode
    except OSError:
        return
    if not stat.S_ISREG(mode):
        what = "a link" if stat.S_ISLNK(mode) else "a directory" if stat.S_ISDIR(mode) \
            else "not a regular file"
        raise EdgeError(f"{out_path}: is {what}; --force replaces only a regular file, so it "
                        f"is left as it is: choose another output path")


_RENAME_NOREPLACE = 1


def _renameat2():
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn


def _publish(tmp: Path, out_path: Path, force: bool) -> None:
    """Move the finished temp file to out_path. With force, replace whatever is there (an
    atomic rename: a replaced file's content is never touched). Without, never replace a
    file that appeared meanwhile (a second convert to the same output): rename with
    RENAME_NOREPLACE, or hard link + unlink where that is missing."""
    if force:
        _refuse_special_output(out_path)
        os.replace(tmp, out_path)
        return
    exists = EdgeError(f"{out_path}: appeared while converting (another convert?); "
                       f"left as it is (use --force to overwrite)")
    fn = _renameat2()
    if fn is not None:
        import ctypes
        at_fdcwd = -100
        if fn(at_fdcwd, os.fsencode(tmp), at_fdcwd, os.fsencode(out_path), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err == errno.EEXIST:
            raise exists
        if err not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EPERM):
            raise OSError(err, os.strerror(err), str(out_path))
    try:
        os.link(tmp, out_path)
    except FileExistsError:
        raise exists from None
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EXDEV, errno.EMLINK):
            raise
        if os.path.lexists(out_path):    # no hard links here: a narrow race remains
            raise exists from None
        os.rename(tmp, out_path)
        return
    os.unlink(tmp)


def convert(hf_dir, out_path, qtype: str = "q8_0", embed_type: str | None = None,
            force: bool = False, progress: Progress | None = None,
            name: str | None = None) -> ConvertSummary:
    """Convert the HF checkpoint in `hf_dir` to a GGUF file at `out_path`.

    qtype: format of the 2-D weights (q4_0, q4_1, q8_0, f16, bf16, f32), or a
    llama.cpp K-quant mix (q2_k, q3_k_m, q4_k_s, q4_k_m, q5_k_s, q5_k_m, q6_k: a format
    per tensor, as llama-quantize picks them); 1-D tensors are always F32.
    embed_type: format of token_embd/output (default: the mix's choice; q8_0 when qtype
    is a 4-bit type; else qtype). progress(name, bytes_done, bytes_total) is called
    after every chunk. name: general.name (default: the directory's name)."""
    t0 = time.perf_counter()
    hf_dir, out_path = Path(hf_dir), Path(out_path)
    qtype = qtype.lower()
    if qtype not in QTYPES:
        raise EdgeError(f"unknown type {qtype!r} (choose from {', '.join(QTYPES)})")
    if embed_type is None and qtype not in mix.MIXES:
        embed_type = "q8_0" if qtype in ("q4_0", "q4_1") else qtype
    if embed_type is not None and embed_type.lower() not in SINGLE_TYPES:
        raise EdgeError(f"unknown embed type {embed_type!r} (choose from {', '.join(SINGLE_TYPES)})")
    if not hf_dir.is_dir():
        raise EdgeError(f"{hf_dir}: not a directory")
    if os.path.lexists(out_path) and not force:
        raise EdgeError(f"{out_path}: already exists (use --force to overwrite)")
    if not out_path.parent.is_dir():
        raise EdgeError(f"{out_path.parent}: output directory does not exist")
    _refuse_input_as_output(hf_dir, out_path)
    _refuse_special_output(out_path)

    hp = read_hparams(hf_dir)
    tensors, shards = open_checkpoint(hf_dir)
    warnings: list[str] = []
    clean_stale_temps(out_path.parent)
    tmp = out_path.with_name(_tmp_name(out_path))
    fd, created = None, False
    try:
        plans = _plan(hf_dir, hp, tensors, qtype.upper(), embed_type and embed_type.upper(), warnings)
        tok = load_tokenizer(hf_dir, hp.n_vocab, load_json(hf_dir / "config.json", "model config"))
        warnings += tok.warnings
        _check_runtime_tokenizer(tok)
        sampling = _sampling_defaults(hf_dir)
        # exclusive creation: never follows or reuses anything planted at that name
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
                     | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0), 0o666)
        created = True
        with open(fd, "wb") as f:
            fd = None
            w = GGUFStreamWriter(f)
            _metadata(w, hp, name or _model_name(hf_dir), qtype, tok, sampling)
            infos = [w.tensor(p.name, p.shape, FORMATS[p.fmt].type_id) for p in plans]
            w.write_header()
            total, done = sum(i.nbytes for i in infos), [0]
            for p in plans:
                w.tensor_data(p.name, _chunks(p, progress, total, done))
        _refuse_input_as_output(hf_dir, out_path)     # again: it may have changed meanwhile
        _publish(tmp, out_path, force)
    except BaseException:
        if fd is not None:
            os.close(fd)
        if created:
            tmp.unlink(missing_ok=True)
        raise
    finally:
        for s in shards:
            s.close()
    n_params = sum(int(np.prod(p.shape)) for p in plans)
    return ConvertSummary(out_path, qtype, [(p.name, p.fmt, p.shape) for p in plans], n_params,
                          out_path.stat().st_size, time.perf_counter() - t0, warnings)
