"""What each activation mode costs in speed: prefill and decode tokens/s, int8 / fine.

    python bench/bench_activations.py [--shape llama-3.2-1b] [--types q4_k,q8_0] [--reps 3]

Random weights with the real shapes (edgellama.benchmark.shape_file). One model per type
is loaded once and switched between the modes (Transformer.set_activations), the modes
interleaved rep by rep, so every ratio compares runs of one process on one machine state;
each figure is the best of --reps. What the modes buy in fidelity is bench_fidelity.py's.
JSON to --out (default bench/results/activations.json), a markdown table on stdout.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from edgellama.benchmark import shape_file  # noqa: E402
from edgellama.gguf import GGUFFile  # noqa: E402
from edgellama.machine import ThreadPolicy  # noqa: E402
from edgellama.model import ACTIVATIONS, Transformer  # noqa: E402
from quant_quality import cpu_name  # noqa: E402

MODES = ("int8", "fine")
assert sorted(MODES) == sorted(ACTIVATIONS)


def speeds(m: Transformer, pp: int, tg: int, rng) -> tuple[float, float]:
    """(prefill, decode) tokens/s of one run from position 0."""
    toks = rng.integers(0, m.args.vocab_size, pp + tg)
    seq = m.new_sequence()
    t0 = time.perf_counter()
    m.forward(toks[:pp], seq)
    t_pp = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(tg):
        m.forward(toks[pp + i:pp + i + 1], seq)
    return pp / t_pp, tg / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--types", default="q4_k,q8_0")
    ap.add_argument("--pp", type=int, default=256)
    ap.add_argument("--tg", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=str(ROOT / "bench/results/activations.json"))
    a = ap.parse_args()

    rows = []
    for qtype in a.types.split(","):
        m = Transformer(GGUFFile(shape_file(a.shape, qtype)), ctx=a.pp + a.tg + 8,
                        threads=ThreadPolicy(a.threads))
        m.wait_for_tiles()
        rng = np.random.default_rng(0)
        best = {mode: [0.0, 0.0] for mode in MODES}
        for mode in MODES:                      # warm-up: every mode's kernels compiled
            m.set_activations(mode)
            speeds(m, 16, 2, rng)
        for _ in range(a.reps):
            for mode in MODES:
                m.set_activations(mode)
                best[mode] = [max(b, s) for b, s in zip(best[mode], speeds(m, a.pp, a.tg, rng))]
        rows.append({"type": qtype, **{mode: {"pp": v[0], "tg": v[1]} for mode, v in best.items()}})
        print(f"{qtype}: done", file=sys.stderr)

    print(f"{a.shape}, random weights, pp{a.pp} and tg{a.tg} tokens/s, best of {a.reps} "
          f"interleaved ({cpu_name()}); ratios to int8 in brackets.\n")
    print("| type | int8 (default) pp / tg | fine pp / tg |")
    print("|---|---|---|")
    for r in rows:
        b = r["int8"]
        cells = [f"{r['int8']['pp']:.1f} / {r['int8']['tg']:.2f}"]
        for mode in MODES[1:]:
            v = r[mode]
            cells.append(f"{v['pp']:.1f} ({v['pp'] / b['pp']:.2f}×) / {v['tg']:.2f} ({v['tg'] / b['tg']:.2f}×)")
        print(f"| {r['type']} | {' | '.join(cells)} |")
    Path(a.out).write_text(json.dumps({"cpu": cpu_name(), "shape": a.shape, "pp": a.pp, "tg": a.tg,
                                       "reps": a.reps, "date": time.strftime("%Y-%m-%d"),
                                       "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
