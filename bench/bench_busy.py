"""edgellama with a busy neighbour against one thread on a quiet machine, interleaved.

    python bench/bench_busy.py [--shape llama-3.2-1b] [--type q4_0] [--reps 5] [--json OUT]
                               [--baseline DIR]

The target: with one CPU-bound process running beside it, edgellama's default settings
give at least 90% of what one thread does on a quiet machine, prefill and decode. The
cases run in turn, each measurement a fresh process (bench_llamacpp's worker: pp512
then tg32 at depth 0), so the machine's drift hits all of them alike:
- quiet, -t 1: the reference;
- quiet, default: every core on a quiet machine (its prefill share is how well
  prefill scales with threads);
- busy, -t 1: what fewer threads give;
- busy, default: what users get (the adaptive thread count);
- busy, every core: a thread on each core regardless (-t N), so one of them shares its
  core with the neighbour: how much a slow thread holds up the others (the work claimed
  one at a time, kernels/claim.py, is meant to keep this near the default's).
The table shows medians and each case as a share of the reference. With --baseline DIR
the same cases run for the checkout DIR too, in alternation (bench_llamacpp's workers).
"""
from __future__ import annotations

import argparse
import json
import statistics

from bench_llamacpp import busy_process, run_one

CASES = (("quiet, -t 1", 0, 1), ("quiet, default", 0, None), ("busy, -t 1", 1, 1),
         ("busy, default", 1, None), ("busy, every core", 1, "cores"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--type", default="q4_0")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--baseline", help="another edgellama checkout to run beside this one")
    a = ap.parse_args()

    from edgellama.benchmark import shape_file
    from edgellama.machine import cpu_name, default_threads
    from edgellama.kernels.simd import ISA, ISA_NAMES
    path = str(shape_file(a.shape, a.type))
    cores = default_threads()          # on a quiet machine: the physical cores
    trees = ["edgellama"] + (["baseline"] if a.baseline else [])
    got = {tree: {name: [] for name, _, _ in CASES} for tree in trees}
    for rep in range(a.reps):
        for name, busy, threads in CASES:
            for tree in trees:
                with busy_process(busy):
                    r = run_one(tree, path, cores if threads == "cores" else threads, 0, 512, 32,
                                a.baseline)
                got[tree][name].append(r)
                print(f"{rep + 1}/{a.reps} {tree} {name}: pp {r['pp']:.1f} tg {r['tg']:.1f} t/s "
                      f"({r['threads']} threads)", flush=True)
    med = {tree: {name: {k: statistics.median(r[k] for r in rs) for k in ("pp", "tg")}
                  for name, rs in cases.items()} for tree, cases in got.items()}
    print(f"\n{a.shape} {a.type} on {cpu_name()}, {ISA_NAMES[ISA]} kernels; pp512, tg32, "
          f"median of {a.reps}")
    for tree in trees:
        ref = med[tree][CASES[0][0]]
        print(f"\n{'this checkout' if tree == 'edgellama' else a.baseline}\n")
        print("| case | prefill t/s | of quiet -t 1 | decode t/s | of quiet -t 1 |")
        print("|---|---|---|---|---|")
        for name, m in med[tree].items():
            print(f"| {name} | {m['pp']:.1f} | {m['pp'] / ref['pp']:.0%} | {m['tg']:.1f} | "
                  f"{m['tg'] / ref['tg']:.0%} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": cpu_name(), "kernels": ISA_NAMES[ISA], "file": path,
                       "reps": a.reps, "baseline": a.baseline, "runs": got["edgellama"],
                       "medians": med["edgellama"], "baseline_runs": got.get("baseline"),
                       "baseline_medians": med.get("baseline")}, f, indent=1)


if __name__ == "__main__":
    main()
