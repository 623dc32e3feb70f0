"""AMX prefill against the VNNI kernels, one matrix product at a time, in one process.

    python bench/bench_amx.py [--types q4_0,q4_k,q5_k,q6_k] [--tokens 128,512]
                              [-t 1,2] [--rounds 5] [--json OUT]

For each weight type, thread count and prompt length: one matrix of random weights with
the 1B model's gate/up shape (8192 x 2048) and its down shape (2048 x 8192), x of
`tokens` rows; the product timed on the VNNI kernels and on AMX tiles in turn (best of
--rounds alternating rounds of 0.3 s each, so both paths see the same machine), and
AMX's speed-up. The two paths give the same bits (tests/formats/test_amx.py); here only
time is measured. Needs a CPU with AMX and Linux's permission for the tiles.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numba
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from edgellama.benchmark import random_weights  # noqa: E402  (after the sys.path line)
from edgellama.formats import FORMATS, linear  # noqa: E402
from edgellama.kernels import amx  # noqa: E402
from edgellama.machine import cpu_name  # noqa: E402
from edgellama.scratch import Scratch  # noqa: E402

SHAPES = {"gate/up": (8192, 2048), "down": (2048, 8192)}


def _best(fn, seconds: float) -> float:
    """Best seconds of one call of fn over `seconds` of calls."""
    fn()
    best, end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(qtype: str, shape: tuple[int, int], tokens: int, rounds: int) -> dict:
    rng = np.random.default_rng(0)
    lin = linear(FORMATS[qtype].type_id, [(random_weights(rng, *shape, qtype, 1.0), shape)])
    x = rng.standard_normal((tokens, shape[1])).astype(np.float32)
    out, sc = np.empty((tokens, shape[0]), np.float32), Scratch()
    best = {False: float("inf"), True: float("inf")}
    for _ in range(rounds):
        for on in (False, True):
            amx.use(on)
            best[on] = min(best[on], _best(lambda: lin.matmul(x, out, sc), 0.3))
    amx.use(True)
    return {"type": qtype, "shape": list(shape), "tokens": tokens,
            "vnni_ms": round(best[False] * 1e3, 3), "amx_ms": round(best[True] * 1e3, 3),
            "amx_speedup": round(best[False] / best[True], 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="q4_0,q4_1,q5_0,q5_1,q8_0,q4_k,q5_k,q6_k")
    ap.add_argument("--tokens", default="128,512")
    ap.add_argument("-t", "--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    if not amx.use(True):
        sys.exit("bench_amx: no AMX tiles here (the CPU, Numba's target or Linux's permission)")
    rows = []
    for threads in (int(t) for t in args.threads.split(",")):
        numba.set_num_threads(threads)
        for qtype in args.types.upper().split(","):
            for name, shape in SHAPES.items():
                for tokens in (int(t) for t in args.tokens.split(",")):
                    r = measure(qtype, shape, tokens, args.rounds) | {"threads": threads, "matrix": name}
                    rows.append(r)
                    print(f"{threads} threads {qtype:5} {name:7} {tokens:4} tokens: VNNI {r['vnni_ms']:8.2f} ms"
                          f"  AMX {r['amx_ms']:8.2f} ms  {r['amx_speedup']:.2f}x", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "machine": cpu_name(), "numba_threads": numba.config.NUMBA_NUM_THREADS,
            "kernels": amx.kernels_name(), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
