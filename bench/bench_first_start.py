"""A first start: every kernel a model's forward pass needs compiled afresh (an empty
kernel cache), as `edgellama chat` does it before its first prompt, timed kernel by
kernel. Each run is a fresh process with a cache folder of its own; with --baseline DIR
(another checkout, e.g. `git worktree add /tmp/before REV`) that tree runs too, the two
alternating, so a drifting machine slows both alike.

    python bench/bench_first_start.py MODEL.gguf [MODEL.gguf ...] [--rounds 2]
                                      [--baseline DIR] [--json out.json]

Prints one line a run: kernels compiled, seconds compiling, and the slowest steps: each
kernel's compile where they compile in turn, or, where helper processes compile them
(jit.compile_in_processes: 2 cores or more), the time between one group of kernels
being handed out and the next.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Runs in the child: load, warm up with each kernel's compile timed, print one JSON line.
_CHILD = r"""
import json, sys, time
from edgellama import llm as L
from edgellama.kernels import jit
llm = L.load(sys.argv[1], ctx=256)
steps, last = [], [None, 0.0]
def show(n, total, name):
    now = time.perf_counter()
    if last[0] is not None:
        steps.append((last[0], now - last[1]))
    last[0], last[1] = name, now
w = jit.warm_up(llm.model, show)
if last[0] is not None:
    steps.append((last[0], time.perf_counter() - last[1]))
print(json.dumps({"compiled": w.compiled, "compile_seconds": w.compile_seconds,
                  "warm_seconds": w.seconds, "kernels": steps}))
"""


def run_once(tree: Path, model: str) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, EDGELLAMA_CACHE=cache, PYTHONPATH=str(tree))
        env.pop("NUMBA_CACHE_DIR", None)
        out = subprocess.run([sys.executable, "-c", _CHILD, model], env=env, cwd=tree,
                             capture_output=True, text=True)
    if out.returncode != 0:      # a file that does not load: the child's own last line
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        sys.exit(f"bench_first_start: {model} in {tree}: {last}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--baseline", type=Path, default=None, help="another checkout, run alternately")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    trees = [("this tree", ROOT)] + ([("baseline", args.baseline.resolve())] if args.baseline else [])
    results = []
    for r in range(args.rounds):
        for model in args.models:
            for name, tree in (trees if r % 2 == 0 else trees[::-1]):
                res = run_once(tree, model)
                slow = sorted(res["kernels"], key=lambda k: -k[1])[:3]
                print(f"round {r + 1} {name:9s} {Path(model).name}: {res['compiled']} kernels in "
                      f"{res['compile_seconds']:.1f} s; slowest "
                      + ", ".join(f"{k} {s:.1f} s" for k, s in slow), flush=True)
                results.append(dict(res, round=r + 1, tree=name, model=Path(model).name))
    if args.json:
        from edgellama.machine import cpu_name
        import numba
        Path(args.json).write_text(json.dumps({"machine": cpu_name(), "cores": os.cpu_count(),
                                               "numba_target": numba.config.CPU_NAME or "host",
                                               "runs": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
