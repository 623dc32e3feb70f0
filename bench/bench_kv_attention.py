"""Attention alone, one layer of Llama 3.2 3B's shape (24 heads, 8 KV heads, head dim 128):
decode (1 token) and prefill (512 tokens) at depth, for each cache type pair beside the
f16 cache, interleaved in one process.

    python bench/bench_kv_attention.py [--depths 0,8192,32768] [--reps 5] [--layers 1]
                                       [--json out.json]

--layers N: a call attends over N layers' caches in turn and the time is per layer: one
layer's cache at depth 32768 (72 MB q8_0, 134 MB f16) may sit in a large L3, which favours
the smaller cache; a whole model's (28 layers) is read from memory, as N = 8 makes it.

Medians of `reps` calls each, rounds alternating the kernels, so a busy machine slows
all of them alike; the ratios are the result.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numba
import numpy as np

from edgellama.kernels import attention as A
from edgellama.kv_cache import KVCache

H, KV, HD = 24, 8, 128


def run(depths, reps, tokens=(1, 512), layers=1):
    rng = np.random.default_rng(0)
    threads = numba.config.NUMBA_NUM_THREADS
    pairs = [("f16", "f16"), ("q8_0", "q8_0"), ("q8_0", "f16"), ("q4_0", "q4_0")]
    results = []
    for depth in depths:
        for T in tokens:
            ctx = depth + T
            q = rng.standard_normal((T, H, HD)).astype(np.float32)
            k, v = rng.standard_normal((2, ctx, KV, HD)).astype(np.float32)
            out = np.empty_like(q)
            fns = {}
            args = type("Args", (), {"n_layers": layers, "n_kv_heads": KV, "head_dim": HD})
            for tk, tv in pairs:
                c = KVCache(args, ctx, tk, tv)
                for p0 in range(0, ctx, 4096):
                    c.write(0, p0, k[p0:p0 + 4096].copy(), v[p0:p0 + 4096].copy())
                for a in c.arrays.values():          # the other layers: copies of layer 0
                    a[1:] = a[0]
                scr = tuple(np.zeros(s, dt) for s, dt in A.attention_scratch_shapes(threads, H, KV, HD))

                def f(c=c, scr=scr):
                    for layer in range(layers):
                        c.attend(layer, depth, q.copy(), np.float32(HD ** -0.5), out, scr)
                fns[f"{tk}/{tv}"] = f
            for f in fns.values():
                f()                              # compile, warm
            times = {n: [] for n in fns}
            for _ in range(reps):
                for n, f in fns.items():
                    t0 = time.perf_counter()
                    f()
                    times[n].append((time.perf_counter() - t0) / layers)
            med = {n: float(np.median(t)) for n, t in times.items()}
            base = med["f16/f16"]
            row = {"depth": depth, "tokens": T, "layers": layers, "seconds": med,
                   "speedup_vs_f16": {n: base / s for n, s in med.items()}}
            results.append(row)
            print(f"depth {depth:6d} T {T:4d}: " + "  ".join(
                f"{n} {s * 1e3:8.2f} ms ({base / s:.2f}x)" for n, s in med.items()), flush=True)
    return results


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--depths", default="0,8192,32768")
    ap.add_argument("--tokens", default="1,512")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    res = run([int(d) for d in a.depths.split(",")], a.reps, [int(t) for t in a.tokens.split(",")],
              a.layers)
    if a.json:
        Path(a.json).write_text(json.dumps({"threads": numba.config.NUMBA_NUM_THREADS,
                                            "results": res}, indent=1))
    sys.exit(0)
