"""Automatic threads under a cgroup CPU limit, beside every core (the count before limits
were read): prompt and reply speed inside a cgroup with each --quotas limit.

    sudo python bench/bench_cpu_quota.py -m FILE [--quotas 1,1.5] [--reps 2] [--json OUT]

Needs root and a cgroup hierarchy with the cpu controller (v2 cpu.max, or v1's
cpu.cfs_quota_us): it makes a child group, sets its limit, and runs `edgellama bench -m
FILE -p 64 -n 64 --json` in it, automatic (`edgellama` reads the limit) and with -t set
to the cores the process may use (what the automatic count was before), alternating in
fresh processes; median of --reps each.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from edgellama.machine import cpu_quota, default_threads  # noqa: E402  (after the sys.path line)

PERIOD = 100_000   # microseconds


def make_group() -> tuple[Path, bool]:
    """A new cgroup for the runs (its directory, whether it is v2)."""
    v2 = Path("/sys/fs/cgroup/cgroup.controllers")
    if v2.exists() and "cpu" in v2.read_text().split():
        return Path(tempfile.mkdtemp(prefix="edgellama-bench-", dir="/sys/fs/cgroup")), True
    v1 = Path("/sys/fs/cgroup/cpu")
    if (v1 / "cpu.cfs_quota_us").exists():
        return Path(tempfile.mkdtemp(prefix="edgellama-bench-", dir=v1)), False
    sys.exit("error: no cgroup hierarchy with the cpu controller here (run as root on Linux)")


def set_limit(group: Path, v2: bool, cpus: float) -> None:
    if v2:
        (group / "cpu.max").write_text(f"{round(cpus * PERIOD)} {PERIOD}")
    else:
        (group / "cpu.cfs_period_us").write_text(str(PERIOD))
        (group / "cpu.cfs_quota_us").write_text(str(round(cpus * PERIOD)))


def run_in(group: Path, v2: bool, args: list[str]) -> dict:
    procs = group / ("cgroup.procs" if v2 else "tasks")
    out = subprocess.run([sys.executable, "-m", "edgellama", "bench", *args, "--json"],
                         preexec_fn=lambda: procs.write_text(str(os.getpid())),
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--quotas", default="1,1.5", help="CPU limits to run under, comma-separated")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if cpu_quota() is not None:
        sys.exit("error: this process is already under a CPU limit; run it outside one")
    cores = default_threads()
    group, v2 = make_group()
    common = ["-m", args.model, "-p", "64", "-n", "64", "--ctx", "512"]
    rows = []
    try:
        for cpus in [float(q) for q in args.quotas.split(",")]:
            set_limit(group, v2, cpus)
            runs: dict[str, list[dict]] = {"automatic": [], "every core": []}
            for _ in range(args.reps):
                runs["automatic"].append(run_in(group, v2, common))
                runs["every core"].append(run_in(group, v2, common + ["-t", str(cores)]))
            row = {"cpu_quota": cpus, "cores": cores,
                   "threads_prompt": runs["automatic"][0]["threads"],
                   "threads_reply": runs["automatic"][0]["threads_reply"]}
            for name, rs in runs.items():
                row[name] = {k: statistics.median(r["speed"][k] for r in rs) for k in ("pp_tps", "tg_tps")}
            a, e = row["automatic"], row["every core"]
            print(f"limit {cpus:g} CPUs on {cores} cores: automatic ({row['threads_prompt']} threads for "
                  f"prompts, {row['threads_reply']} for replies) prompt {a['pp_tps']:.1f} t/s, reply "
                  f"{a['tg_tps']:.1f}; every core ({cores}) {e['pp_tps']:.1f} and {e['tg_tps']:.1f}: "
                  f"{a['pp_tps'] / e['pp_tps']:.2f}x and {a['tg_tps'] / e['tg_tps']:.2f}x")
            rows.append(row)
    finally:
        group.rmdir()
    result = {"model": args.model, "reps": args.reps, "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
