"""Decode and prefill at depth with each KV cache type, on one model in one process: the
cache types' speed relative to f16, the machine's drift shared by all of them.

    python bench/bench_kv_speed.py [--shape llama-3.2-3b] [--type q4_k]
                                   [--depths 0,8192,32768] [--pairs f16/f16,q8_0/q8_0]
                                   [--tg 8] [--pp 512] [--rounds 2] [--json OUT]

For each depth: one sequence per type pair, filled with synthetic K/V to the depth
(Sequence.fill_random); then `rounds` rounds, each decoding --tg tokens in every sequence
in turn (the cache truncated back to the depth first), and, with --pp, reading a --pp
token prompt at the depth. Medians over the rounds; ratios against the first pair.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

from edgellama.benchmark import shape_file
from edgellama.gguf import GGUFFile
from edgellama.machine import ThreadPolicy, cpu_name
from edgellama.model import Transformer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama-3.2-3b")
    ap.add_argument("--type", default="q4_k")
    ap.add_argument("--depths", default="0,8192,32768")
    ap.add_argument("--pairs", default="f16/f16,q8_0/q8_0")
    ap.add_argument("--tg", type=int, default=8)
    ap.add_argument("--pp", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    depths = [int(d) for d in a.depths.split(",")]
    pairs = [tuple(p.split("/")) for p in a.pairs.split(",")]
    path = shape_file(a.shape, a.type)
    policy = ThreadPolicy(a.threads)
    m = Transformer(GGUFFile(path), ctx=max(depths) + max(a.pp, a.tg) + 16, threads=policy)
    m.wait_for_tiles()
    rng = np.random.default_rng(0)
    rows = []
    for depth in depths:
        seqs = {}
        for tk, tv in pairs:
            s = m.new_sequence(ctx=depth + max(a.pp, a.tg) + 16, type_k=tk, type_v=tv)
            s.fill_random(depth, rng) if depth else None
            m.forward([1], s)                     # kernels compiled, pages touched
            seqs[f"{tk}/{tv}"] = s
        tg = {n: [] for n in seqs}
        pp = {n: [] for n in seqs}
        for _ in range(a.rounds):
            for n, s in seqs.items():
                s.truncate(depth)
                t0 = time.perf_counter()
                tok = 1
                for _ in range(a.tg):
                    tok = int(np.argmax(m.forward([tok], s)))
                tg[n].append(a.tg / (time.perf_counter() - t0))
                if a.pp:
                    s.truncate(depth)
                    t0 = time.perf_counter()
                    m.forward(rng.integers(0, 1000, a.pp), s)
                    pp[n].append(a.pp / (time.perf_counter() - t0))
        base = pairs[0][0] + "/" + pairs[0][1]
        row = {"depth": depth, "threads": policy.current,
               "tg_tps": {n: float(np.median(v)) for n, v in tg.items()},
               "pp_tps": {n: float(np.median(v)) for n, v in pp.items() if v}}
        row["tg_vs_first"] = {n: row["tg_tps"][n] / row["tg_tps"][base] for n in seqs}
        if a.pp:
            row["pp_vs_first"] = {n: row["pp_tps"][n] / row["pp_tps"][base] for n in seqs}
        rows.append(row)
        print(f"depth {depth}: decode " + ", ".join(
            f"{n} {row['tg_tps'][n]:.2f} t/s ({row['tg_vs_first'][n]:.2f}x)" for n in seqs)
            + ("" if not a.pp else "; prefill " + ", ".join(
                f"{n} {row['pp_tps'][n]:.1f} t/s ({row['pp_vs_first'][n]:.2f}x)" for n in seqs)),
            flush=True)
        del seqs
    if a.json:
        Path(a.json).write_text(json.dumps({
            "machine": cpu_name(), "cores": os.cpu_count(), "file": path.name,
            "load_average": os.getloadavg(), "tg": a.tg, "pp": a.pp, "rounds": a.rounds,
            "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
