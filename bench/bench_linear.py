"""Linear-layer micro-benchmark: decode GB/s vs the read ceiling, prefill vs NumPy BLAS.

    python bench/bench_linear.py [--quick] [--threads N]

Weights are random bytes in the GGUF block layouts (valid f16 scales), shaped like
Llama 3.2 1B / 3B (all layers + the output matrix, so the set is far larger than the
cache). Every speed is a ratio to a reference measured in the same run: the machine
is shared and noisy. Writes bench/results/linear.json.
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numba
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from edgellama.benchmark import random_weights  # noqa: E402  (after the sys.path line)
from edgellama.formats import FORMATS, WRITABLE, Linear, linear  # noqa: E402
from edgellama.kernels.membw import measure_read_bandwidth  # noqa: E402
from edgellama.scratch import Scratch  # noqa: E402

TYPES = {t: FORMATS[t].type_id for t in WRITABLE}   # those we can make random tensors of
# (layers, hidden, q rows, kv rows, ffn, vocab)
MODELS = {"1B": (16, 2048, 2048, 512, 8192, 128256), "3B": (28, 3072, 3072, 1024, 8192, 128256)}


def model_shapes(name: str) -> list[tuple[int, int]]:
    """(out, in) of every matrix one decode step reads, in forward order."""
    L, E, Q, KV, F, V = MODELS[name]
    layer = [(Q, E), (KV, E), (KV, E), (E, Q), (F, E), (F, E), (E, F)]
    return layer * L + [(V, E)]


def random_tensor(type_name: str, shape: tuple[int, int], rng) -> np.ndarray:
    """Bytes of a GGUF tensor of this type and shape (see benchmark.random_weights)."""
    return random_weights(rng, shape[0], shape[1], type_name, shape[1] ** -0.5)


def load(type_name: str, shapes, rng) -> tuple[list[Linear], float]:
    """Linear objects for `shapes` and the seconds spent in from_gguf (repacking)."""
    lins, t_load = [], 0.0
    for s in shapes:
        raw = random_tensor(type_name, s, rng)
        t = time.perf_counter()
        lins.append(linear(TYPES[type_name], [(raw, s)]))
        t_load += time.perf_counter() - t
    return lins, t_load


def first_call(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def measure_first_calls(rng) -> dict[str, float]:
    """Seconds of the first matvec + matmul + rows per type (JIT or Numba cache load)."""
    times = {}
    for name in TYPES:
        lin, t_load = load(name, [(64, 256)], rng)
        l = lin[0]
        x = np.ones((2, 256), np.float32)          # (T, in)
        o = np.empty((2, 64), np.float32)          # (T, out)
        times[name] = (t_load + first_call(lambda: l.matvec(x[0], o[0]))
                       + first_call(lambda: l.matmul(x, o)) + first_call(lambda: l.rows(np.arange(2), x)))
    return times


def cold_compile_times() -> dict[str, float]:
    """measure_first_calls in a fresh process with an empty Numba cache: the JIT cost."""
    code = ("import json, sys, numpy as np; sys.path.insert(0, %r); import bench_linear as b; "
            "print(json.dumps(b.measure_first_calls(np.random.default_rng(0))))" % str(Path(__file__).parent))
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, NUMBA_CACHE_DIR=d)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                             check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _fmt(times: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.2f}" for k, v in times.items())


def measure_decode(lins: list[Linear], reps: int = 5) -> float:
    """Best seconds for one decode step: a matvec through every matrix of `lins`."""
    rng = np.random.default_rng(1)
    xs = {n: rng.standard_normal(n).astype(np.float32) for n in {l.in_features for l in lins}}
    outs = [np.empty(l.out_features, np.float32) for l in lins]
    sc = Scratch()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for l, o in zip(lins, outs):
            l.matvec(xs[l.in_features], o, sc)
        best = min(best, time.perf_counter() - t)
    return best


def measure_prefill(lin: Linear, T: int = 512, reps: int = 3) -> tuple[float, float]:
    """Best seconds of lin.matmul and of NumPy f32 x @ W.T (W already f32), same shapes."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((T, lin.in_features)).astype(np.float32)
    out = np.empty((T, lin.out_features), np.float32)
    sc = Scratch()
    w = np.empty((lin.out_features, lin.in_features), np.float32)
    lin.rows(np.arange(lin.out_features), w)
    lin.matmul(x, out, sc)
    np.matmul(x, w.T, out=out)
    ours = theirs = float("inf")
    for _ in range(reps):
        t = time.perf_counter(); lin.matmul(x, out, sc); ours = min(ours, time.perf_counter() - t)
        t = time.perf_counter(); np.matmul(x, w.T, out=out); theirs = min(theirs, time.perf_counter() - t)
    return ours, theirs


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE


def measure_file_load(type_name: str, model: str, rng) -> dict:
    """Repack every matrix of `model` from a file mmap: seconds, file size, RSS growth."""
    shapes = model_shapes(model)
    with tempfile.NamedTemporaryFile(dir=os.environ.get("TMPDIR", "/tmp"), delete=False) as f:
        offsets = []
        for s in shapes:
            offsets.append(f.tell())
            raw = random_tensor(type_name, s, rng)
            f.write(raw.tobytes())
            f.write(b"\0" * (-f.tell() % 32))
        path = f.name
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:   # warm the page cache, as a second run of the CLI
            while f.read(1 << 26):
                pass
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        linear(TYPES[type_name], [(random_tensor(type_name, (16, 256), rng), (16, 256))])
        rss0 = rss_bytes()
        t = time.perf_counter()
        lins = []
        for s, off in zip(shapes, offsets):
            view = np.frombuffer(mm, np.uint8, count=_tensor_bytes(type_name, s), offset=off)
            lins.append(linear(TYPES[type_name], [(view, s)]))
            del view
        secs = time.perf_counter() - t
        rss = rss_bytes() - rss0
        del lins
        mm.close()
    finally:
        os.unlink(path)
    return {"type": type_name, "model": model, "file_bytes": size, "load_s": secs,
            "rss_growth_bytes": rss, "rss_over_file": rss / size}


def file_load_fresh_process(type_name: str, model: str) -> dict:
    """measure_file_load in a new process, so RSS growth is not hidden by reused heap."""
    code = ("import json, sys, numpy as np; sys.path.insert(0, %r); import bench_linear as b; "
            "print(json.dumps(b.measure_file_load(%r, %r, np.random.default_rng(0))))"
            % (str(Path(__file__).parent), type_name, model))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _tensor_bytes(type_name: str, shape) -> int:
    return shape[0] * FORMATS[type_name].row_bytes(shape[1])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1B only, fewer types")
    ap.add_argument("--threads", type=int, default=numba.config.NUMBA_NUM_THREADS)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "linear.json"))
    args = ap.parse_args(argv)
    numba.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    res: dict = {"threads": args.threads, "decode": [], "prefill": [], "jit_first_call_s": {}}

    c = measure_read_bandwidth(2 << 30, keep=True)
    ceilings: list = [{"threads": args.threads, "gb_s": [c]}]
    print(f"read-bandwidth ceiling (parallel f32 sum, 2 GiB): {c:.1f} GB/s, {args.threads} threads"
          f" (re-measured around every row below; load avg {os.getloadavg()[0]:.1f})")

    res["jit_first_call_s"] = measure_first_calls(rng)
    res["jit_compile_s"] = cold_compile_times()
    print("first calls, cache warm (s): " + _fmt(res["jit_first_call_s"]))
    print("first calls, cold cache = JIT compile (s): " + _fmt(res["jit_compile_s"]))

    quantized = [t for t in TYPES if FORMATS[t].block_size > 1]
    plan = [("1B", t) for t in TYPES] + [("3B", t) for t in quantized]
    if args.quick:
        plan = [("1B", t) for t in quantized]
    thread_counts = sorted({1, args.threads})
    print(f"\n{'model':5} {'type':5} {'GB':>6} {'load s':>7} {'thr':>3} {'ms/tok':>7} {'tok/s':>6} "
          f"{'GB/s':>6} {'ceil':>6} {'ratio':>6}")
    for model, tname in plan:
        lins, t_load = load(tname, model_shapes(model), rng)
        nbytes = sum(l.nbytes for l in lins)
        for th in thread_counts:
            numba.set_num_threads(th)
            measure_decode(lins, reps=1)
            c0 = measure_read_bandwidth(2 << 30, keep=True)
            secs = measure_decode(lins)
            c1 = measure_read_bandwidth(2 << 30, keep=True)
            ceil = max(c0, c1)             # the higher ceiling: a conservative ratio
            ceilings.append({"threads": th, "gb_s": [c0, c1]})
            gbs = nbytes / secs / 1e9
            res["decode"].append({"model": model, "type": tname, "threads": th,
                                  "weight_bytes": nbytes, "load_s": t_load, "decode_s": secs,
                                  "tok_s": 1 / secs, "gb_s": gbs, "ceiling_gb_s": ceil,
                                  "ratio": gbs / ceil})
            print(f"{model:5} {tname:5} {nbytes / 1e9:6.2f} {t_load:7.2f} {th:3} {secs * 1e3:7.1f} "
                  f"{1 / secs:6.1f} {gbs:6.1f} {ceil:6.1f} {gbs / ceil:6.2f}")
        numba.set_num_threads(args.threads)
        if not args.quick or tname == "Q4_0":
            for l in lins[:7]:             # one layer's matrices
                ours, theirs = measure_prefill(l)
                fl = 2 * 512 * l.out_features * l.in_features
                res["prefill"].append({"model": model, "type": tname,
                                       "shape": [l.out_features, l.in_features],
                                       "gflops": fl / ours / 1e9, "numpy_gflops": fl / theirs / 1e9,
                                       "ratio": theirs / ours})
        del lins
    print("\nprefill T=512 (x @ W.T), ours / NumPy f32 matmul on the same shapes:")
    print(f"{'model':5} {'type':5} {'shape':>12} {'GFLOP/s':>8} {'numpy':>8} {'ratio':>6}")
    for p in res["prefill"]:
        print(f"{p['model']:5} {p['type']:5} {str(tuple(p['shape'])):>12} {p['gflops']:8.1f} "
              f"{p['numpy_gflops']:8.1f} {p['ratio']:6.2f}")

    if not args.quick:
        fl = file_load_fresh_process("Q4_0", "3B")
        res["file_load"] = fl
        print(f"\nload 3B Q4_0 from a file mmap (page cache warm): {fl['load_s']:.2f} s, "
              f"file {fl['file_bytes'] / 1e9:.2f} GB, RSS growth {fl['rss_growth_bytes'] / 1e9:.2f} GB "
              f"({fl['rss_over_file']:.2f} x file)")
    res["ceilings_gb_s"] = ceilings
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"wrote {args.out}; max RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.1f} GB")
    return res


if __name__ == "__main__":
    main()
