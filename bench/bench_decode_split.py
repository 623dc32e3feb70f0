"""Where a decoded token's time goes, beside the read ceiling, in one process.

    python bench/bench_decode_split.py [--shape llama-3.2-1b] [--type q4_0] [--threads 2]
                                       [--reps 15] [--json OUT]

Per round, in turn: the read ceiling (a parallel sum over 2 GiB), 8 decoded tokens, and
8 tokens' matrix products alone (every layer's and the output's matvec, in forward
order, nothing between them). Decode can be no faster than its bytes
over the ceiling; the products' share of the token says what the rest (norms, RoPE, the
KV write, attention, Python between kernels) costs. Medians of --reps short rounds: the
machine's speed drifts by more than the effect within seconds.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

N_TOKENS = 8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--type", default="q4_0")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()

    import numpy as np
    from edgellama.benchmark import decode_bytes, shape_file
    from edgellama.gguf import GGUFFile
    from edgellama.machine import ThreadPolicy, cpu_name
    from edgellama.membw import measure_read_bandwidth
    from edgellama.model import Transformer
    from edgellama.simd import ISA, ISA_NAMES

    path = shape_file(a.shape, a.type)
    m = Transformer(GGUFFile(path), ctx=(a.reps + 2) * N_TOKENS + 8, threads=ThreadPolicy(a.threads))
    m.wait_for_tiles()
    linears = m.linears()
    x = np.random.default_rng(0).standard_normal(max(w.in_features for w in linears)).astype(np.float32)
    outs = [np.empty(w.out_features, np.float32) for w in linears]
    seq = m.new_sequence()

    def decode() -> float:
        t0 = time.perf_counter()
        for i in range(N_TOKENS):
            m.forward([1000 + i], seq)
        return (time.perf_counter() - t0) / N_TOKENS

    def products() -> float:
        t0 = time.perf_counter()
        for _ in range(N_TOKENS):
            for w, o in zip(linears, outs):
                w.matvec(x[:w.in_features], o, seq.scratch)
        return (time.perf_counter() - t0) / N_TOKENS

    m.forward([1], seq)
    decode(), products()                       # kernels loaded, pages touched
    rounds = [(measure_read_bandwidth(keep=True), decode(), products()) for _ in range(a.reps)]
    ceiling, token, prod = (statistics.median(r[i] for r in rounds) for i in range(3))
    nbytes = decode_bytes(m, seq.pos // 2)    # K/V at the mean depth decoded over
    res = {"machine": cpu_name(), "file": str(path), "threads": a.threads,
           "kernels": ISA_NAMES[ISA], "reps": a.reps, "decode bytes": nbytes,
           "ceiling GB/s": ceiling, "token ms": token * 1e3, "products ms": prod * 1e3,
           "rounds": [{"ceiling GB/s": c, "token ms": t * 1e3, "products ms": p * 1e3}
                      for c, t, p in rounds]}
    print(f"{path.name}, {a.threads} threads, {ISA_NAMES[ISA]} kernels, median of {a.reps}:\n"
          f"  ceiling {ceiling:.1f} GB/s: a token's {nbytes / 1e6:.0f} MB no faster than "
          f"{nbytes / ceiling / 1e6:.2f} ms\n"
          f"  decode  {token * 1e3:.2f} ms a token ({nbytes / token / 1e9 / ceiling:.0%} of the ceiling)\n"
          f"  matrix products alone {prod * 1e3:.2f} ms ({prod / token:.0%} of the token; "
          f"{nbytes / prod / 1e9 / ceiling:.0%} of the ceiling)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
