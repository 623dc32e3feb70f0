"""`edgellama bench`: will this model fit, and how fast is it, on this machine?

Memory: the predicted breakdown (weights by type, KV cache from the formula,
scratch, process baseline) beside resident memory measured after load, after
prefill and at peak. Speed: prefill (pp) and decode (tg) tokens/s as mean ± sd,
decode at depth, achieved read bandwidth beside the ceiling measured in the same
run, prefill beside NumPy's float32 matmul on the same shapes, JIT compile and load
time apart. With a drafter (`--draft MODEL`, `--lookup`): speculative decoding's
acceptance and speed-up over plain decoding on one summarise-this-text prompt
(speculative()).

Speed and memory do not depend on weight values, so `--shape` benchmarks a GGUF
with the real Llama 3.2 shapes and random weights, generated once and cached.
"""
from __future__ import annotations

import os
import platform
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf.constants import GGUFValueType as V

from . import threading_layer
from .args import ModelArgs
from .kernels.amx import kernels_name
from .default_model import cache_dir
from .errors import EdgeError
from .formats import FORMATS, WRITABLE, quantize
from .gguf import GGUFFile
from .gguf_write import GGUFStreamWriter
from .kernels.jit import Compiling, warm_up
from .machine import (ThreadPolicy, cpu_name, peak_resident_memory, reset_peak_resident_memory,
                      resident_memory, total_memory)
from .kernels.membw import measure_read_bandwidth
from .kv_cache import DEFAULT_CACHE_TYPE, TYPE_PAIRS, KVCache, longest_context
from .model import Transformer
from .models import FAMILIES

MiB = 2 ** 20
GiB = 2 ** 30


@dataclass(frozen=True)
class Shape:
    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int = 128256
    theta: float = 500000.0
    train_ctx: int = 131072
    arch: str = "llama"              # general.architecture (edgellama/models)
    head_dim: int | None = None      # attention.key_length where not dim / heads
    window: int = 0                  # attention.sliding_window (gemma3)
    rope_scale: float = 1.0          # linear rope.scaling.factor (gemma3 4B: the global layers')

    def args(self) -> ModelArgs:
        """The hyperparameters a file of this shape has (for checks made before it exists)."""
        return ModelArgs(dim=self.dim, n_layers=self.layers, n_heads=self.heads,
                         n_kv_heads=self.kv_heads, ffn_dim=self.ffn, vocab_size=self.vocab,
                         norm_eps=1e-5, rope_theta=self.theta,
                         rope_dim=self.head_dim or self.dim // self.heads,
                         train_ctx=self.train_ctx, tied_output=True, family=FAMILIES[self.arch],
                         key_length=self.head_dim, sliding_window=self.window,
                         rope_scale=self.rope_scale)


SHAPE_TYPES = tuple(t for t in WRITABLE if t not in ("F32", "BF16"))   # --type for --shape
SHAPES = {
    "llama-3.2-1b": Shape(dim=2048, layers=16, heads=32, kv_heads=8, ffn=8192),
    "llama-3.2-3b": Shape(dim=3072, layers=28, heads=24, kv_heads=8, ffn=8192),
    # Qwen 3: GQA 16/8 (32/8 for 4B), head dim 128, a 40,960-token window; f16 K+V
    # 112 KiB a token for 0.6B and 1.7B (2 x 28 layers x 8 x 128 x 2 bytes: 4.4 GiB at
    # 40,960), 144 KiB for 4B (36 layers: 5.6 GiB)
    **{name: Shape(dim=d, layers=n, heads=h, kv_heads=8, ffn=f, vocab=151936, theta=1e6,
                   train_ctx=40960, arch="qwen3", head_dim=128)
       for name, d, n, h, f in (("qwen3-0.6b", 1024, 28, 16, 3072),
                                ("qwen3-1.7b", 2048, 28, 16, 6144),
                                ("qwen3-4b", 2560, 36, 32, 9728))},
    # Gemma 3 (HF configs; llama.cpp's GGUFs keep the tokenizer's 262,144 rows of the 4B's
    # 262,208-row embedding): head dim 256, five sliding-window layers to a global one; their
    # ring keeps window + 512 positions, so at 32,768 the 1B's f16 cache is 4 global layers
    # x 1 KV head x 256 x 2 x 2 bytes = 4 KiB a token (128 MiB) + 22 rings x 1,024 (22 MiB)
    "gemma3-1b": Shape(dim=1152, layers=26, heads=4, kv_heads=1, ffn=6912, vocab=262144,
                       theta=1e6, train_ctx=32768, arch="gemma3", head_dim=256, window=512),
    "gemma3-4b": Shape(dim=2560, layers=34, heads=8, kv_heads=4, ffn=10240, vocab=262144,
                       theta=1e6, train_ctx=131072, arch="gemma3", head_dim=256, window=1024,
                       rope_scale=8.0),
}


# -- random-weight files with real shapes ---------------------------------------
def random_weights(rng, rows: int, cols: int, qtype: str, scale: float) -> np.ndarray:
    """(rows, row_bytes) uint8 of a valid `qtype` tensor with values of magnitude about
    `scale` (so activations stay finite and normal): each row is one of 64 random
    normal rows quantized with the format's own quantizer (speed ignores the values,
    and quantizing every row of a 3B model with a K-quant would take minutes)."""
    pool = quantize(rng.standard_normal((64, cols), np.float32) * np.float32(scale), qtype)
    return pool[rng.integers(0, 64, rows)]


def bench_dir() -> Path:
    """Where the random-weight shape files are kept between runs."""
    return cache_dir() / "bench"


def _ours(name: str) -> bool:
    """A shape file's name (or its temporary's): only those are ever removed, as
    EDGELLAMA_CACHE may name a folder holding the user's own files."""
    return any(name in (shape_path(s, t).name, shape_path(s, t).with_suffix(".tmp").name)
               for s in SHAPES for t in SHAPE_TYPES)


def bench_files() -> list[Path]:
    """The shape files kept in bench_dir(), and temporaries of interrupted runs."""
    d = bench_dir()
    return sorted(p for p in d.iterdir() if _ours(p.name) and p.is_file()
                  and not p.is_symlink()) if d.is_dir() else []


def remove_bench_files() -> tuple[int, int]:
    """Delete every file bench_files() lists; returns (files, bytes) removed."""
    n = size = 0
    for p in bench_files():
        size += p.stat().st_size
        p.unlink()
        n += 1
    return n, size


def shape_path(name: str, qtype: str) -> Path:
    return bench_dir() / f"{name}-random-{qtype.lower()}.gguf"


def shape_file(name: str, qtype: str, quiet: bool = False, progress=None) -> Path:
    """Path of a cached GGUF with the shapes of `name` and random `qtype` weights
    (1-D tensors F32; the tied embedding as published files have it: Q6_K beside
    K-quants (llama.cpp's output rule), Q8_0 beside Q4_0 / Q4_1 (as our convert does)).
    Generating it reports progress(message) with the time left, if given; else one
    line on stdout unless quiet."""
    if name not in SHAPES:
        raise EdgeError(f"unknown --shape {name!r} (known: {', '.join(SHAPES)})")
    qtype = qtype.upper()
    if qtype not in SHAPE_TYPES:
        raise EdgeError(f"--type {qtype.lower()} is not offered for --shape "
                        f"({', '.join(t.lower() for t in SHAPE_TYPES)})")
    s = SHAPES[name]
    path = shape_path(name, qtype)
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    if progress is None and not quiet:
        print(f"Generating {path.name} (random weights, real shapes; once)...", flush=True)
    embed_type = "Q6_K" if qtype.endswith("_K") else "Q8_0" if qtype in ("Q4_0", "Q4_1") else qtype
    hd, gemma = s.head_dim or s.dim // s.heads, s.arch == "gemma3"
    qwen = s.arch == "qwen3" or gemma          # q/k norms, eps 1e-6
    tensors = [("token_embd.weight", s.vocab, s.dim, embed_type, 1.0)]
    for i in range(s.layers):
        p = f"blk.{i}."
        if gemma:
            tensors += [(p + "post_attention_norm.weight", 0, s.dim, "F32", 0),
                        (p + "post_ffw_norm.weight", 0, s.dim, "F32", 0)]
        if qwen:
            tensors += [(p + "attn_q_norm.weight", 0, hd, "F32", 0),
                        (p + "attn_k_norm.weight", 0, hd, "F32", 0)]
        tensors += [(p + "attn_norm.weight", 0, s.dim, "F32", 0),
                    (p + "attn_q.weight", s.heads * hd, s.dim, qtype, s.dim ** -0.5),
                    (p + "attn_k.weight", s.kv_heads * hd, s.dim, qtype, s.dim ** -0.5),
                    (p + "attn_v.weight", s.kv_heads * hd, s.dim, qtype, s.dim ** -0.5),
                    (p + "attn_output.weight", s.dim, s.heads * hd, qtype, s.dim ** -0.5),
                    (p + "ffn_norm.weight", 0, s.dim, "F32", 0),
                    (p + "ffn_gate.weight", s.ffn, s.dim, qtype, s.dim ** -0.5),
                    (p + "ffn_up.weight", s.ffn, s.dim, qtype, s.dim ** -0.5),
                    (p + "ffn_down.weight", s.dim, s.ffn, qtype, s.ffn ** -0.5)]
    tensors.append(("output_norm.weight", 0, s.dim, "F32", 0))
    tmp = path.with_suffix(".tmp")
    try:
        with open(tmp, "wb") as f:
            w = GGUFStreamWriter(f)
            a = s.arch
            for key, vtype, value in [
                ("general.architecture", V.STRING, a),
                ("general.name", V.STRING, f"{name} (random weights)"),
                ("general.file_type", V.UINT32, int(FORMATS[qtype].file_type)),
                (f"{a}.block_count", V.UINT32, s.layers),
                (f"{a}.context_length", V.UINT32, s.train_ctx),
                (f"{a}.embedding_length", V.UINT32, s.dim),
                (f"{a}.feed_forward_length", V.UINT32, s.ffn),
                (f"{a}.attention.head_count", V.UINT32, s.heads),
                (f"{a}.attention.head_count_kv", V.UINT32, s.kv_heads),
                *([(f"{a}.attention.key_length", V.UINT32, hd),
                   (f"{a}.attention.value_length", V.UINT32, hd)] if s.head_dim else []),
                (f"{a}.rope.dimension_count", V.UINT32, hd),
                (f"{a}.rope.freq_base", V.FLOAT32, s.theta),
                (f"{a}.attention.layer_norm_rms_epsilon", V.FLOAT32, 1e-6 if qwen else 1e-5),
                (f"{a}.vocab_size", V.UINT32, s.vocab),
                *([(f"{a}.attention.sliding_window", V.UINT32, s.window)] if s.window else []),
                *([(f"{a}.rope.scaling.type", V.STRING, "linear"),
                   (f"{a}.rope.scaling.factor", V.FLOAT32, s.rope_scale)]
                  if s.rope_scale != 1 else []),
            ]:
                w.kv(key, vtype, value)
            for tname, rows, cols, t, _ in tensors:
                w.tensor(tname, (rows, cols) if rows else (cols,), FORMATS[t].type_id)
            w.write_header()
            rng = np.random.default_rng(0)
            total = sum(rows * cols for _, rows, cols, _, _ in tensors)
            done, t0 = 0, time.perf_counter()
            shown = t0
            for tname, rows, cols, t, scale in tensors:
                if progress and done and time.perf_counter() - shown > 0.5:
                    shown = time.perf_counter()
                    left = (shown - t0) * (total - done) / done
                    progress(f"generating {path.name} (random weights, real shapes; once): "
                             f"{done / total:.0%}, about {left:.0f} s left")
                data = (np.ones(cols, np.float32) if not rows
                        else random_weights(rng, rows, cols, t, scale))
                w.tensor_data(tname, [data])
                done += rows * cols
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


# -- measuring -------------------------------------------------------------------
def _mean_sd(xs: list[float]) -> tuple[float, float]:
    a = np.asarray(xs, np.float64)
    return float(a.mean()), float(a.std(ddof=1)) if len(a) > 1 else 0.0


def _numpy_matmul_gflops(model: Transformer, T: int) -> float:
    """NumPy float32 matmul throughput on one layer's weight shapes, x (T, in) @ W.T."""
    shapes = [(w.out_features, w.in_features) for w in model.layer_linears(model.layers[0])]
    rng = np.random.default_rng(0)
    mats = [(rng.standard_normal((T, i), np.float32), rng.standard_normal((o, i), np.float32))
            for o, i in shapes]
    for x, w in mats:     # warm BLAS threads and caches
        x @ w.T
    t0 = time.perf_counter()
    for x, w in mats:
        x @ w.T
    flops = sum(2.0 * T * w.size for _, w in mats)
    return flops / (time.perf_counter() - t0) / 1e9


def _linear_params(model: Transformer) -> int:
    """Weights multiplied per token: every linear layer plus the output matrix."""
    return sum(w.out_features * w.in_features for w in model.linears())


def decode_bytes(model: Transformer, depth: int, type_k: str = DEFAULT_CACHE_TYPE,
                 type_v: str = DEFAULT_CACHE_TYPE) -> int:
    """Bytes read per decoded token: all linear weights, the output matrix and the
    K/V of `depth` cached positions in their cache types (the one embedding row is
    negligible)."""
    return sum(w.nbytes for w in model.linears()) + KVCache.bytes_needed(model.args, depth,
                                                                         type_k, type_v)


WORDS_PER_TOKEN = 0.75   # English text: a token is about three quarters of a word


class _Clock:
    """Time left in the run, for the progress line: each step's estimate, dropped once
    it is done. Estimates come from the time of one decode step (prefill reads a token
    in about a quarter of that, measured for Llama 3.2 shapes)."""

    def __init__(self, report, steps: dict[str, float]):
        self.report, self.steps = report, dict(steps)

    def left(self, step: str, fraction: float) -> float:
        """Seconds left, `fraction` of `step` being done; steps run in dict order."""
        names = list(self.steps)
        rest = sum(self.steps[n] for n in names[names.index(step) + 1:])
        return self.steps[step] * (1 - fraction) + rest

    def show(self, step: str, what: str, fraction: float = 0.0) -> None:
        left = self.left(step, fraction)
        self.report(f"{what}, about {left:.0f} s left" if left >= 1 else what)

    def done(self, step: str) -> None:
        del self.steps[step]


def run(path: Path, ctx: int = 8192, n_prompt: int = 512, n_gen: int = 128, depth: int | None = None,
        threads: int | None = None, reps: int = 3, budget_gib: float = 8.0, synthetic: bool = False,
        full: bool = True, type_k: str = DEFAULT_CACHE_TYPE, type_v: str = DEFAULT_CACHE_TYPE,
        progress=lambda msg: None, ceiling: bool = False) -> dict:
    """Measure one model file; returns every figure as a dict (the --json output).

    full=False is the quick check: memory with the whole KV cache resident, one prefill
    of n_prompt tokens and n_gen decoded tokens at the start of the context. full=True
    adds `reps` repetitions, decode at `depth` cached tokens (default: the context
    filled), the read-bandwidth ceiling and NumPy's matmul on the same shapes; ceiling
    measures the read ceiling in a quick check too. The KV cache stores K and V as type_k,
    type_v (kv_cache.CACHE_TYPES)."""
    policy = ThreadPolicy(threads)   # as edgellama.load: automatic unless -t
    reps = reps if full else 1
    # BLAS allocates per-thread work buffers on first use: count them in the baseline
    w = np.ones((512, 512), np.float32)
    w @ w
    reset_peak_resident_memory()   # generating a shape file here must not count
    base = resident_memory() or 0
    progress("loading the model")
    t0 = time.perf_counter()
    g = GGUFFile(path)
    with Compiling(lambda n, total, name: progress(f"compiling kernels (once; cached for later runs): {name}")) \
            as loading:
        model = Transformer(g, ctx, threads=policy, cache_type_k=type_k, cache_type_v=type_v)
    load_s = time.perf_counter() - t0 - loading.seconds
    progress("loading the model: writing its start-up tiles (first load only)")
    model.wait_for_tiles()         # a first load writes them on a thread: not while timing
    a = model.args
    if n_prompt + 1 > ctx:
        raise EdgeError(f"-p {n_prompt} does not fit --ctx {ctx}")
    depth = ctx - n_gen if depth is None else depth
    depth = max(0, min(depth, ctx - n_gen)) if full else 0
    rss_load = resident_memory() or 0
    # the KV cache's pages are mapped on first write: fill it to the end (synthetic K/V
    # in its types), so the memory measured is what a conversation filling the context
    # will use
    seq = model.new_sequence()
    progress(f"filling the KV cache to {ctx} tokens ({type_k} K, {type_v} V)")
    seq.fill_random(ctx, np.random.default_rng(1))

    def compiling(n, total, name):
        progress(f"compiling kernels (once; cached for later runs): {n}/{total} {name}" if total
                 else f"compiling kernels (once; cached for later runs): {name}")
    warm = warm_up(model, compiling)

    rng = np.random.default_rng(0)
    prompt = rng.integers(0, a.vocab_size, n_prompt)
    seq.reset()
    model.forward(prompt[:1], seq)
    t0 = time.perf_counter()
    model.forward(prompt[:1], seq)           # at position 1: a prompt may be one token
    step = time.perf_counter() - t0          # one decode step: the basis of the estimates
    # a prefill reads every weight (about 8 decode steps), then multiplies
    steps = {"pp": reps * (8 + n_prompt / 4) * step, "tg": reps * n_gen * step}
    if full or ceiling:
        steps.update(ceiling=4.0)
    if full:
        steps.update(depth=reps * n_gen * step * (1 + depth / 4096) if depth > 1 else 0.0,
                     numpy=2.0)
    clock = _Clock(progress, steps)

    pp = []
    for r in range(reps):
        clock.show("pp", f"reading a {n_prompt}-token prompt" + (f" {r + 1}/{reps}" if reps > 1 else ""),
                   r / reps)
        seq.reset()
        t0 = time.perf_counter()
        model.forward(prompt, seq)
        pp.append(n_prompt / (time.perf_counter() - t0))
    clock.done("pp")
    rss_prefill = resident_memory() or 0

    def decode(key: str, what: str, r: int) -> float:
        tok = int(prompt[0])
        t0 = time.perf_counter()
        for i in range(n_gen):
            if i % 8 == 0:
                clock.show(key, f"{what} {i}/{n_gen} tokens" + (f", run {r + 1}/{reps}" if reps > 1 else ""),
                           (r * n_gen + i) / (reps * n_gen))
            tok = int(np.argmax(model.forward([tok], seq)))
        return n_gen / (time.perf_counter() - t0)

    tg = []
    for r in range(reps):
        seq.reset()
        model.forward(prompt[:1], seq)
        tg.append(decode("tg", "replying", r))
    clock.done("tg")
    tg_depth = []
    if depth > 1:
        seq.fill_random(depth, rng)   # speed does not depend on the values
        for r in range(reps):
            seq.truncate(depth)
            tg_depth.append(decode("depth", f"replying at depth {depth}", r))
    if full:
        clock.done("depth")
    peak = peak_resident_memory() or 0

    read_ceiling = np_gflops = 0.0
    if full or ceiling:
        clock.show("ceiling", "measuring read bandwidth")
        read_ceiling = measure_read_bandwidth()
        clock.done("ceiling")
    if full:
        clock.show("numpy", "measuring NumPy matmul")
        np_gflops = _numpy_matmul_gflops(model, n_prompt)

    by_type = Counter()
    for t in g.tensors.values():
        by_type[t.type_name] += t.nbytes
    kv = KVCache.bytes_needed(a, ctx, type_k, type_v)
    scratch = seq.scratch.nbytes      # what the prefill and decode runs above used
    weights = sum(by_type.values())
    predicted = base + weights + kv + scratch
    # per cache type pair: the cache at this ctx, and the longest context the budget holds
    # beside everything else (at most the model's trained context)
    room = int(budget_gib * GiB) - (base + weights + scratch)
    by_cache_type = {f"{tk}/{tv}": {
        "type_k": tk, "type_v": tv, "bytes_per_token": KVCache.bytes_per_token(a, tk, tv),
        "kv_cache": KVCache.bytes_needed(a, ctx, tk, tv),
        "predicted_total": base + weights + scratch + KVCache.bytes_needed(a, ctx, tk, tv),
        "longest_ctx": min(a.train_ctx, longest_context(a, room, tk, tv))}
        for tk, tv in dict.fromkeys(TYPE_PAIRS + ((type_k, type_v),))
        if a.head_dim % 32 == 0 or tk == tv == "f16"}
    params = sum(int(np.prod(t.shape)) for t in g.tensors.values())
    pp_m, pp_sd = _mean_sd(pp)
    tg_m, tg_sd = _mean_sd(tg)
    tgd_m, tgd_sd = _mean_sd(tg_depth) if tg_depth else (0.0, 0.0)
    bytes0, bytesd = decode_bytes(model, 1, type_k, type_v), decode_bytes(model, depth, type_k, type_v)
    ours_gflops = 2.0 * _linear_params(model) * pp_m / 1e9
    speed = {"pp_tps": pp_m, "pp_sd": pp_sd, "tg_tps": tg_m, "tg_sd": tg_sd,
             "words_per_token": WORDS_PER_TOKEN,
             "decode_bytes_per_token": bytes0, "tg_gbs": bytes0 * tg_m / 1e9,
             "pp_gflops": ours_gflops}
    if full or ceiling:
        speed.update({"read_bandwidth_gbs": read_ceiling,
                      "tg_ceiling_ratio": bytes0 * tg_m / 1e9 / read_ceiling})
    if full:
        speed.update({
            "tg_depth_tps": tgd_m, "tg_depth_sd": tgd_sd,
            "decode_bytes_per_token_at_depth": bytesd, "tg_depth_gbs": bytesd * tgd_m / 1e9,
            "tg_depth_ceiling_ratio": bytesd * tgd_m / 1e9 / read_ceiling if tg_depth else 0.0,
            "numpy_matmul_gflops": np_gflops, "pp_vs_numpy": ours_gflops / np_gflops,
        })
    return {
        "model": g.get("general.name") or path.name, "file": str(path), "synthetic": synthetic,
        "full": full, "types": model.type_summary(), "size_bytes": weights, "params": params,
        "threads": policy.current, "threads_auto": policy.auto, "cpu_quota": policy.quota,
        "threads_reply": min(policy.current, policy.memory_bound_max),
        "threading_layer": threading_layer.name(), "ctx": ctx, "n_prompt": n_prompt, "n_gen": n_gen, "depth": depth,
        "reps": reps,
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "kernels": kernels_name(),
                    "python": platform.python_version(),
                    "mem_total_bytes": total_memory()},
        "load_seconds": load_s, "jit_seconds": warm.seconds + loading.seconds,
        "jit_compiled": warm.compiled + loading.count, "jit_cache_warm": not (warm.compiled + loading.count),
        "memory": {
            "weights_by_type": dict(by_type), "weights": weights,
            "kv_cache": kv, "kv_per_token": KVCache.bytes_per_token(a, type_k, type_v),
            "type_k": type_k, "type_v": type_v, "by_cache_type": by_cache_type,
            "train_ctx": a.train_ctx, "scratch": scratch, "baseline": base,
            "predicted_total": predicted, "rss_after_load": rss_load,
            "rss_after_prefill": rss_prefill, "rss_peak": peak,
            "budget": int(budget_gib * GiB),
        },
        "speed": speed,
    }


# a reply that repeats its input: where lookup pays, and a draft model has an easy time
ARTICLE = (
    "The city council met on Tuesday to discuss the new bicycle lanes planned for Main "
    "Street. Supporters said the lanes would make cycling safer and reduce traffic, "
    "while several shop owners worried that removing parking spaces would hurt their "
    "business. The council agreed to run a six-month trial of the lanes starting in "
    "March, after which it will count cyclists, measure traffic and survey the shops "
    "before making a final decision.")
SUMMARISE = f"Summarise this text in two sentences, reusing its words:\n\n{ARTICLE}"


def speculative(path: Path, draft: Path | None, lookup: bool, ctx: int = 2048, n_gen: int = 64,
                threads: int | None = None, draft_min: int = 0, draft_max: int = 16,
                progress=lambda msg: None) -> dict:
    """Speculative decoding against plain decoding on the same prompt (SUMMARISE, as a
    chat message), greedy, up to n_gen tokens each way: tokens/s of each, the speed-up,
    the tokens drafted and accepted, and whether the replies are the same token for
    token (they must be). The model needs its tokenizer."""
    from .llm import load
    from .sampling import SamplingParams
    from .speculative import PromptLookup
    llm = load(path, ctx=ctx, threads=threads)
    drafter = PromptLookup(draft_min=draft_min, draft_max=draft_max) if lookup else \
        llm.load_draft(draft, draft_min, draft_max)
    progress("speculative decoding: compiling kernels (once; cached for later runs)")
    for m in [llm.model] + ([drafter.model] if hasattr(drafter, "model") else []):
        warm_up(m)
    ids = llm.chat.encode_messages([{"role": "user", "content": SUMMARISE}])
    out = {"drafter": "lookup" if lookup else Path(draft).name, "prompt": "summarise",
           "prompt_tokens": len(ids), "draft_min": draft_min, "draft_max": draft_max}
    replies = {}
    for how, d in (("plain", None), ("speculative", drafter)):
        progress(f"speculative decoding: {how}, {n_gen} tokens")
        llm.reset()
        replies[how] = list(llm.generate(ids, max_tokens=n_gen,
                                         sampling=SamplingParams(temperature=0.0), drafter=d))
        out[f"{how}_tok_s"] = llm.stats.gen_tps
    out.update(tokens=len(replies["plain"]), drafted=llm.stats.drafted,
               accepted=llm.stats.accepted, speedup=out["speculative_tok_s"] / out["plain_tok_s"],
               same_tokens=replies["plain"] == replies["speculative"])
    return out


def speculative_line(r: dict) -> str:
    s = r["speculative"]
    rate = f" ({100 * s['accepted'] / s['drafted']:.0f}%)" if s["drafted"] else ""
    return (f"speculative ({s['drafter']}, a summarise-this-text prompt, {s['tokens']} tokens): "
            f"{s['speculative_tok_s']:.1f} tokens/s vs plain {s['plain_tok_s']:.1f}, "
            f"{s['speedup']:.2f}x; drafted {s['drafted']}, accepted {s['accepted']}{rate}"
            + ("" if s["same_tokens"] else "; the replies DIFFER (a bug: please report it)"))


def _needed(m: dict) -> int:
    """Memory the run needs: the peak measured (the KV cache was made resident), or the
    prediction if that is higher."""
    return max(m["rss_peak"], m["predicted_total"])


def cache_type_lines(r: dict) -> list[str]:
    """Per cache type pair: the KV cache at this ctx term by term, the total predicted,
    and the longest context that fits the budget."""
    m = r["memory"]
    budget = m["budget"]
    rest = m["predicted_total"] - m["kv_cache"]
    lines = [f"by KV cache type at ctx {r['ctx']} (weights + runtime {rest / GiB:.2f} GiB, "
             f"budget {budget / GiB:.3g} GiB):"]
    for name, c in m["by_cache_type"].items():
        fits = "fits" if c["predicted_total"] <= budget else "does not fit"
        longest = c["longest_ctx"]
        # a sliding-window model's local layers stop at their ring: the mean per token
        per = c["kv_cache"] / r["ctx"]
        lines.append(
            f"  {name:<10} {per / 1024:6.1f} KiB/token x {r['ctx']} = "
            f"{c['kv_cache'] / GiB:6.2f} GiB -> {c['predicted_total'] / GiB:6.2f} GiB, {fits}; "
            f"longest context in budget: {longest}"
            + (" (the model's whole window)" if longest >= m["train_ctx"] else ""))
    return lines


def summary(r: dict) -> str:
    """The answer in one sentence: does it fit, how fast do replies come."""
    m, s = r["memory"], r["speed"]
    need, budget = _needed(m), m["budget"]
    budget_s = f"{budget / GiB:.3g} GiB"
    fit = (f"fits in {budget_s} with {(budget - need) / GiB:.1f} GiB to spare" if need <= budget
           else f"does NOT fit in {budget_s} (needs {need / GiB:.1f} GiB)")
    words = s["tg_tps"] * s["words_per_token"]
    return (f"At ctx {r['ctx']} it {fit}; replies come at about {words:.1f} words/s "
            f"({s['tg_tps']:.1f} tokens/s), prompts are read at {s['pp_tps']:.0f} tokens/s "
            f"({s['words_per_token']} words per token, typical of English).")


def _thread_note(r: dict) -> str:
    """How the thread count was chosen, for the report's first line."""
    if r.get("cpu_quota") is not None:
        return (f" (automatic; the cgroup's CPU limit is {r['cpu_quota']:g}: "
                f"{r['threads_reply']} for replies)")
    return " (automatic)" if r.get("threads_auto") else ""


def format_quick(r: dict) -> str:
    """The quick check: what was measured, then the one-sentence answer."""
    m, s = r["memory"], r["speed"]
    runtime = m["predicted_total"] - m["weights"] - m["kv_cache"]
    lines = [
        f"model   {r['model']}: {r['types']}, {r['size_bytes'] / GiB:.2f} GiB, "
        f"{r['threads']} threads{_thread_note(r)} (Numba threading layer {r['threading_layer']})",
        f"memory  {_needed(m) / GiB:.2f} GiB at ctx {r['ctx']}: weights "
        f"{m['weights'] / GiB:.2f} GiB + KV cache {m['kv_cache'] / GiB:.2f} GiB "
        f"({m['type_k']} K, {m['type_v']} V) + runtime "
        f"{runtime / GiB:.2f} GiB predicted, {m['rss_peak'] / GiB:.2f} GiB measured at peak",
        f"speed   prompt {s['pp_tps']:.1f} tokens/s ({r['n_prompt']} tokens), reply "
        f"{s['tg_tps']:.1f} tokens/s ({r['n_gen']} tokens, start of a conversation)",
    ]
    if r["synthetic"]:
        lines.append("        (random weights with the real shapes: speed and memory do not "
                     "depend on the values)")
    lines += [speculative_line(r)] if "speculative" in r else []
    return "\n".join(lines + cache_type_lines(r) + [summary(r)])


def format_threads(reports: list[dict]) -> str:
    """A sweep over thread counts (bench -t 1,2,4): a row per count, decode's read
    bandwidth beside the ceiling measured at that count."""
    r0 = reports[0]
    depth = r0["full"] and r0["depth"] > 1
    head = ["threads", f"pp{r0['n_prompt']} t/s", f"tg{r0['n_gen']} t/s", "decode GB/s",
            "read ceiling GB/s", "of ceiling"] + ([f"tg @ d{r0['depth']} t/s"] if depth else [])
    rows = [head]
    for r in reports:
        s = r["speed"]
        rows.append([str(r["threads"]), f"{s['pp_tps']:.1f}", f"{s['tg_tps']:.2f}",
                     f"{s['tg_gbs']:.1f}", f"{s['read_bandwidth_gbs']:.1f}",
                     f"{s['tg_ceiling_ratio']:.0%}"] + ([f"{s['tg_depth_tps']:.2f}"] if depth else []))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = [f"model   {r0['model']}: {r0['types']}, {r0['size_bytes'] / GiB:.2f} GiB; "
             f"{r0['machine']['kernels']} kernels, Numba threading layer {r0['threading_layer']}"]
    lines += ["| " + " | ".join(c.rjust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(2, "| " + " | ".join("-" * w for w in widths) + " |")
    if r0["synthetic"]:
        lines.append("(random weights with the real shapes: speed does not depend on the values)")
    return "\n".join(lines)


def format_report(r: dict) -> str:
    """llama-bench style table, then the memory lines."""
    m, s = r["memory"], r["speed"]
    size = f"{r['size_bytes'] / GiB:.2f} GiB"
    params = f"{r['params'] / 1e9:.2f} B"
    name = r["model"]
    rows = [("model", "size", "params", "threads", "test", "t/s")]
    rows.append((name, size, params, str(r["threads"]), f"pp{r['n_prompt']}",
                 f"{s['pp_tps']:.2f} ± {s['pp_sd']:.2f}"))
    rows.append((name, size, params, str(r["threads"]), f"tg{r['n_gen']}",
                 f"{s['tg_tps']:.2f} ± {s['tg_sd']:.2f}"))
    if r["depth"] > 1:
        rows.append((name, size, params, str(r["threads"]), f"tg{r['n_gen']} @ d{r['depth']}",
                     f"{s['tg_depth_tps']:.2f} ± {s['tg_depth_sd']:.2f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(6)]
    lines = ["| " + " | ".join(c.ljust(w) if i < 4 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths))) + " |" for row in rows]
    lines.insert(1, "| " + " | ".join("-" * w for w in widths) + " |")
    verdict = "fits" if _needed(m) <= m["budget"] else "does NOT fit"
    err = (m["rss_peak"] - m["predicted_total"]) / m["predicted_total"] * 100
    types = ", ".join(f"{k} {v / MiB:.0f} MiB" for k, v in sorted(m["weights_by_type"].items(),
                                                                   key=lambda kv: -kv[1]))
    lines += [
        "",
        f"memory at ctx {r['ctx']} (predicted):",
        f"  weights     {m['weights'] / MiB:9.1f} MiB  ({types}; memory-mapped)",
        f"  KV cache    {m['kv_cache'] / MiB:9.1f} MiB  ({m['type_k']} K, {m['type_v']} V: "
        f"{m['kv_per_token'] / 1024:.1f} KiB per token x {r['ctx']})",
        f"  scratch     {m['scratch'] / MiB:9.1f} MiB",
        f"  baseline    {m['baseline'] / MiB:9.1f} MiB  (Python, NumPy, Numba before loading)",
        f"  total       {m['predicted_total'] / MiB:9.1f} MiB",
        f"memory measured: after load {m['rss_after_load'] / MiB:.0f} MiB, after prefill "
        f"{m['rss_after_prefill'] / MiB:.0f} MiB, peak {m['rss_peak'] / MiB:.0f} MiB "
        f"({err:+.1f}% vs predicted) -> {verdict} in {m['budget'] / GiB:.1f} GiB",
        f"bandwidth: read ceiling {s['read_bandwidth_gbs']:.1f} GB/s (measured now); decode reads "
        f"{s['decode_bytes_per_token'] / 1e9:.2f} GB/token -> {s['tg_gbs']:.1f} GB/s "
        f"({s['tg_ceiling_ratio'] * 100:.0f}% of ceiling)"
        + (f"; at depth {r['depth']}: {s['decode_bytes_per_token_at_depth'] / 1e9:.2f} GB/token -> "
           f"{s['tg_depth_gbs']:.1f} GB/s ({s['tg_depth_ceiling_ratio'] * 100:.0f}%)"
           if r["depth"] > 1 else ""),
        f"prefill: {s['pp_gflops']:.1f} GFLOP/s in linear layers vs NumPy f32 matmul "
        f"{s['numpy_matmul_gflops']:.1f} GFLOP/s on the same shapes ({s['pp_vs_numpy'] * 100:.0f}%); "
        f"integer kernels: {r['machine']['kernels']}; Numba threading layer {r['threading_layer']}",
        f"load {r['load_seconds']:.2f} s; JIT {r['jit_seconds']:.1f} s "
        f"({'cache warm' if r['jit_cache_warm'] else 'compiled now, cached for next time'})",
    ] + cache_type_lines(r)
    if r["synthetic"]:
        lines.append("(random weights with the real shapes: speed and memory do not depend on values; "
                     "decode at depth uses synthetic K/V)")
    lines += [speculative_line(r)] if "speculative" in r else []
    return "\n".join(lines + [summary(r)])

