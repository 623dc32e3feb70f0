"""The standard benchmark suite: Llama 3.2 1B and 3B shapes × Q4_0 and Q8_0 —
pp512, tg128, tg128 at depth (the context filled), memory at ctx 8192 — plus
conversion throughput (bench_convert.py).

    python bench/run_suite.py [--reps 2] [--skip-convert] [--out bench/results]

Each model runs in its own `edgellama bench --json` process, so memory peaks are
the model's alone. Writes suite.json (every figure, with the machine) and suite.md
(the table docs/benchmarks.md shows).
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = [("llama-3.2-1b", "q4_0"), ("llama-3.2-1b", "q8_0"),
           ("llama-3.2-3b", "q4_0"), ("llama-3.2-3b", "q8_0")]


def run_model(shape: str, qtype: str, ctx: int, reps: int) -> dict:
    exe = shutil.which("edgellama")
    if exe is None:
        sys.exit("the edgellama command is not installed: pip install . first")
    cmd = [exe, "bench", "--full", "--shape", shape, "--type", qtype, "--ctx", str(ctx), "-r", str(reps),
           "--json"]
    print("$", " ".join(cmd[1:]), flush=True)
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(f"{shape} {qtype} failed: {res.stderr.strip()}")
    return json.loads(res.stdout)


def table(results: list[dict]) -> str:
    head = ("| model | type | pp512 t/s | tg128 t/s | tg128 @ depth t/s | decode % of ceiling "
            "(d0 / depth) | prefill vs NumPy | peak RSS / predicted | load s | JIT s |")
    lines = [head, "|" + "---|" * 10]
    for r in results:
        s, m = r["speed"], r["memory"]
        lines.append(
            f"| {r['shape']} | {r['qtype']} | {s['pp_tps']:.1f} ± {s['pp_sd']:.1f} | "
            f"{s['tg_tps']:.2f} ± {s['tg_sd']:.2f} | {s['tg_depth_tps']:.2f} (d{r['depth']}) | "
            f"{s['tg_ceiling_ratio'] * 100:.0f}% / {s['tg_depth_ceiling_ratio'] * 100:.0f}% "
            f"(ceiling {s['read_bandwidth_gbs']:.0f} GB/s) | {s['pp_vs_numpy'] * 100:.0f}% | "
            f"{m['rss_peak'] / 2**20:.0f} / {m['predicted_total'] / 2**20:.0f} MiB | "
            f"{r['load_seconds']:.2f} | {r['jit_seconds']:.1f} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--skip-convert", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    results = []
    for shape, qtype in CONFIGS:
        r = run_model(shape, qtype, args.ctx, args.reps)
        r.update(shape=shape, qtype=qtype)
        results.append(r)
    suite = {"date": time.strftime("%Y-%m-%d"), "machine": results[0]["machine"],
             "threads": results[0]["threads"], "ctx": args.ctx, "models": results}
    if not args.skip_convert:
        conv = args.out / "convert.json"
        subprocess.run([sys.executable, str(ROOT / "bench" / "bench_convert.py"), "--out", str(conv)],
                       check=True)
        suite["convert"] = json.loads(conv.read_text())
    suite["seconds"] = time.time() - t0
    (args.out / "suite.json").write_text(json.dumps(suite, indent=2))
    m = suite["machine"]
    md = (f"Measured {suite['date']} on {m['cpu']}, {m['cores']} cores, "
          f"{m['mem_total_bytes'] / 2**30:.0f} GiB, {suite['threads']} threads, ctx {args.ctx}, "
          f"random weights with the real shapes:\n\n" + table(results) + "\n")
    (args.out / "suite.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
