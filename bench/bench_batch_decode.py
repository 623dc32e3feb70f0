"""Tokens/s of N sequences decoded together (Transformer.decode) beside one decoded alone.

    python bench/bench_batch_decode.py [--shape llama-3.2-1b] [--type q4_k] [--n 1,2,4]
                                       [--threads 2] [--tg 32] [--reps 3] [--json OUT]

One process, one model (random weights with the real shapes, edgellama.benchmark's
shape files: for K-quants Q4_K matrices and a Q6_K output, the types of a Q4_K_M file).
Each sequence first reads a prompt of its own length (16, 24, 32, ... tokens), so the
sequences decode at different positions; then `--tg` steps decode one token for every
sequence. N = 1 is the ordinary single-sequence path (forward of one token). The counts
are measured in turn within each repetition, so drift in the machine hits all alike;
the table shows medians. Generated tokens/s counts every sequence's tokens.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))   # this checkout's edgellama

import numpy as np  # noqa: E402


def prepare(m, n: int, rng) -> list:
    """n sequences, each after a prompt of its own length (16, 24, 32, ... tokens)."""
    seqs = [m.new_sequence() for _ in range(n)]
    for i, s in enumerate(seqs):
        m.forward(rng.integers(1000, 100000, 16 + 8 * i), s)
    return seqs


def step(m, seqs: list, rng) -> float:
    """Seconds of one decode step of every sequence: forward for one, decode for more."""
    toks = rng.integers(1000, 100000, len(seqs))
    t0 = time.perf_counter()
    if len(seqs) == 1:
        m.forward(toks, seqs[0])
    else:
        m.decode(seqs, toks)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--type", default="q4_k")
    ap.add_argument("--n", default="1,2,4")
    ap.add_argument("--threads", type=int, default=None, help="default: automatic")
    ap.add_argument("--tg", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--activations", default="int8", help="Transformer's activations mode")
    ap.add_argument("--json")
    a = ap.parse_args()

    from edgellama.benchmark import shape_file
    from edgellama.gguf import GGUFFile
    from edgellama.machine import ThreadPolicy, cpu_name
    from edgellama.model import Transformer
    from edgellama.kernels.amx import kernels_name

    path = shape_file(a.shape, a.type)
    counts = [int(v) for v in a.n.split(",")]
    m = Transformer(GGUFFile(path), ctx=16 + 8 * max(counts) + a.tg + 16, threads=ThreadPolicy(a.threads),
                    activations=a.activations)
    m.wait_for_tiles()
    rng = np.random.default_rng(0)
    got = {n: [] for n in counts}
    for _ in range(a.reps):
        seqs = {n: prepare(m, n, rng) for n in counts}
        for n in counts:
            step(m, seqs[n], rng)               # warm-up: kernels loaded, pages touched
        for _ in range(a.tg):                   # one step of each count in turn
            for n in counts:
                got[n].append(step(m, seqs[n], rng))
    ms = {n: statistics.median(got[n]) * 1e3 for n in counts}
    rows = [{"sequences": n, "step_ms": ms[n], "tok_s": n * 1e3 / ms[n],
             "vs_first": n * ms[counts[0]] / (counts[0] * ms[n])} for n in counts]
    res = {"machine": cpu_name(), "cores": os.cpu_count(), "file": str(path),
           "threads": m.threads.current, "kernels": kernels_name(), "tg": a.tg,
           "activations": a.activations,
           "reps": a.reps, "rows": rows}
    print(f"{path.name} on {res['machine']} ({res['cores']} cores), {res['threads']} threads, "
          f"{res['kernels']} kernels, activations {a.activations}; median of {a.reps} x {a.tg} steps each")
    print("| sequences | ms per step | tokens/s (all sequences) | × one |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['sequences']} | {r['step_ms']:.1f} | {r['tok_s']:.1f} | {r['vs_first']:.2f}× |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
