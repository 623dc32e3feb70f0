"""Where a decoded token's (or a prefill's) time goes, per thread count, beside the read ceiling.

    python bench/bench_decode_split.py [-m FILE | --shape llama-3.2-1b --type q4_0]
                                       [-t 1,2,4,8,16] [--depth 0] [--prefill T]
                                       [--reps 7] [--json OUT]

For each thread count, in one process, medians of --reps rounds of 8 decode steps (or
one prefill of T tokens), per token:

  token        the whole pass (forward at --depth cached positions)
  products     every layer's matrix products alone (q/k/v, output projection, gate/up,
               down), with the pass's input sizes
  output       the output (vocabulary) matrix alone (prefill: the last token's row)
  attention    every layer's K/V write and cache attention at the same depth
  elementwise  RMSNorm, RoPE, SwiGLU and the residual adds of every layer
  python       the same pass with every kernel replaced by a no-op: the interpreter's
               time between the kernels, which no thread count shortens (decode only:
               a prefill's NumPy products, which are no kernels of ours, would still run)
  rest         token minus the above: the kernels' calls and what no part names

For decode with per-32-block weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL), `join wait`
is how long the threads idle at the ends of the layers' products: each product run once
more, its tiles claimed as the decode kernels claim them, with every thread's first
start and last finish stamped (the CPU's cycle counter); the mean over threads of the
last finish minus its own, as a share of the products' time and in ms a token (a thread
with no tile idles through its product), and `late start` the mean of each thread's
first start after the calling thread's. Then the parallel regions a pass opens (counted
by wrapping every parallel kernel for one pass) with what one costs here: an empty
region (one trivial item per thread) against a serial kernel call of the same signature,
so `regions x cost` is the launch-and-join time a pass spends at that thread count. The
ceiling is a parallel sum over 2 GiB at the same thread count; decode can be no faster
than its bytes over the ceiling. Parts measured alone may find their weights in a large
L3 cache (the output matrix of a 1B model fits some server L3s) where the whole pass
does not: `rest` then absorbs the difference.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

N_TOKENS = 8


def _median_time(fn, reps: int, inner: int = 1) -> float:
    """Median seconds of one call of fn (each round: `inner` calls)."""
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        out.append((time.perf_counter() - t0) / inner)
    return statistics.median(out)


def count_regions(run_one_token) -> tuple[int, dict[str, int]]:
    """How many parallel kernels (each one region: start the workers, join them) one call
    of run_one_token launches from Python, by kernel name: the package's parallel kernels
    are wrapped with a counter for the call (jit.kernels_replaced)."""
    from edgellama.kernels.jit import kernels_replaced
    counts: dict[str, int] = {}

    def counted(kernel):
        if not kernel.targetoptions.get("parallel"):
            return None
        name = f"{kernel.py_func.__module__.split('.')[-1]}.{kernel.py_func.__name__}"

        def run(*args):
            counts[name] = counts.get(name, 0) + 1
            return kernel(*args)
        return run

    with kernels_replaced(counted):
        run_one_token()
    return sum(counts.values()), counts


def region_cost(reps: int) -> tuple[float, float]:
    """(seconds of an empty parallel region at the current thread count, seconds of a
    serial kernel call with the same arguments): the first minus the second is what
    starting and joining the workers costs."""
    import numba
    import numpy as np
    from numba import njit, prange

    @njit(parallel=True)
    def par(a):
        for i in prange(a.size):
            a[i] += 1.0

    @njit
    def ser(a):
        for i in range(a.size):
            a[i] += 1.0

    a = np.zeros(numba.get_num_threads(), np.float32)
    par(a), ser(a)
    return _median_time(lambda: par(a), reps, 200), _median_time(lambda: ser(a), reps, 200)


_STAMPED = {}


def _stamped_kernels(kind):
    """(matvec, now): records.MATVEC_BLOCKS[kind] (its tiles claimed as it claims them,
    each by blocks_gemm of that kind) with each thread's first start and last finish
    stamped in begins, ends (threads,) int64 (begins zero before), and the cycle counter;
    compiled on first use."""
    if kind not in _STAMPED:
        import numba
        from llvmlite import ir
        from numba import njit, prange, types
        from numba.extending import intrinsic
        from edgellama.kernels.claim import take
        from edgellama.kernels.isa import call_llvm
        from edgellama.kernels.simd import ISA, Q8X, blocks_gemm, tile

        @intrinsic
        def cycles(typingctx):
            def codegen(context, builder, sig, args):
                return call_llvm(builder, "llvm.readcyclecounter", ir.IntType(64), [])
            return types.int64(), codegen

        @njit(parallel=True)
        def matvec(q, x8, xd, xs8, xsum, out, acc, G, counter, begins, ends):
            R = acc.shape[1]
            x = Q8X(x8, xd, xs8, xsum)
            counter[0] = 0
            for _ in prange(q.shape[0]):
                me = numba.get_thread_id()
                if begins[me] == 0:
                    begins[me] = cycles()
                while True:
                    t = take(counter)
                    if t >= q.shape[0]:
                        break
                    blocks_gemm(q[t], x, acc[t], tile(xd.size, G, 0, 1, kind), ISA)
                    n = min(R, out.size - t * R)
                    out[t * R:t * R + n] = acc[t, :n]
                    ends[me] = cycles()

        @njit
        def now():
            return cycles()
        _STAMPED[kind] = matvec, now
    return _STAMPED[kind]


def join_wait(m, reps: int) -> tuple[float, float] | None:
    """(wait, late): the shares of the layers' product time the average thread idles
    before each product's last thread finishes (module docstring), and of it before its
    first item starts (a worker waking late), medians of reps passes; None unless every
    layer product is a per-32-block format."""
    import numba
    import numpy as np
    from edgellama.formats.records import BlocksLinear, prep_q8_x
    ws = [w for layer in m.layers for w in m.layer_linears(layer)]
    if not all(isinstance(w, BlocksLinear) for w in ws):
        return None
    threads = numba.get_num_threads()
    rng = np.random.default_rng(1)
    runs = []
    for w in ws:
        x8, xd, xs8, xsum, acc, counter = w.decode_buffers()
        prep_q8_x(rng.standard_normal(w.in_features).astype(np.float32), x8, xd, xs8, xsum)
        runs.append((w, (x8, xd, xs8, xsum), np.empty(w.out_features, np.float32), acc, counter))
    shares = []
    n = numba.config.NUMBA_NUM_THREADS
    for _ in range(reps + 1):                   # the first pass compiles and warms
        idle = late = span = 0
        for w, x, out, acc, counter in runs:
            begins = np.zeros(n, np.int64)
            matvec, now = _stamped_kernels(w.kind)
            ends = np.full(n, now(), np.int64)
            start = ends[0]
            matvec(w.q, *x, out, acc, w.group, counter, begins, ends)
            last = ends[:threads].max()
            idle += (last - ends[:threads]).mean()
            late += (np.where(begins[:threads] > 0, begins[:threads], last) - start).mean()
            span += last - start
        shares.append((idle / span, late / span))
    return (statistics.median(s[0] for s in shares[1:]), statistics.median(s[1] for s in shares[1:]))


def _no_op(*args) -> None:
    """A kernel's stand-in that runs nothing (bench's `python` part)."""


def split(m, depth: int, reps: int, T: int = 1) -> dict:
    """The parts of a pass of T tokens (1: a decode step) of Transformer m at `depth`,
    seconds per token each (medians)."""
    import numpy as np
    from edgellama.kernels import rows as K
    from edgellama.kernels import attention as A
    import numba

    a = m.args
    seq = m.new_sequence()
    rng = np.random.default_rng(0)
    if depth:
        seq.fill_random(depth, rng)
    sc = seq.scratch
    steps = N_TOKENS if T == 1 else 1          # passes a round
    ids = rng.integers(0, a.vocab_size, T)

    def token():
        seq.truncate(depth)
        for i in range(steps):
            m.forward(ids if T > 1 else [1000 + i], seq)

    # inputs of each product, at the sizes a pass gives them
    xs = {n: rng.standard_normal((T, n)).astype(np.float32) for n in
          {w.in_features for w in m.linears()}}
    per_layer = [(w, np.empty((T, w.out_features), np.float32))
                 for layer in m.layers for w in m.layer_linears(layer)]
    out_buf = np.empty((1, m.output.out_features), np.float32)

    def product(w, x, o):
        if T == 1:
            w.matvec(x[0], o[0], sc)
        else:
            w.matmul(x, o, sc)

    def products():
        for _ in range(steps):
            for w, o in per_layer:
                product(w, xs[w.in_features], o)

    def output():                              # prefill: the last token's logits only
        for _ in range(steps):
            m.output.matvec(xs[m.output.in_features][-1], out_buf[0], sc)

    hd, H, KV = a.head_dim, a.n_heads, a.n_kv_heads
    q = rng.standard_normal((T, H, hd)).astype(np.float32)
    k = rng.standard_normal((T, KV, hd)).astype(np.float32)
    v = rng.standard_normal((T, KV, hd)).astype(np.float32)
    att = np.empty((T, H, hd), np.float32)
    att_scratch = tuple(sc.get(f"attention_{i}", shape, dt) for i, (shape, dt) in enumerate(
        A.attention_scratch_shapes(numba.config.NUMBA_NUM_THREADS, H, KV, hd)))
    scale = np.float32(hd ** -0.5)

    def attention():
        for i in range(steps):
            for li in range(a.n_layers):
                p = depth + i * T
                seq.cache.write(li, p, k, v)
                seq.cache.attend(li, p, q.copy(), scale, att, att_scratch)

    x = rng.standard_normal((T, a.dim)).astype(np.float32)
    h = np.empty_like(x)
    gate_up = rng.standard_normal((T, 2 * a.ffn_dim)).astype(np.float32)
    act = np.empty((T, a.ffn_dim), np.float32)
    cos = np.ones((T, hd // 2), np.float32)
    sin = np.zeros((T, hd // 2), np.float32)
    norm = m.layers[0].attn_norm
    E = K.elementwise(T)

    def elementwise():
        for _ in range(steps):
            for _ in range(a.n_layers):
                E.rmsnorm(x, norm, a.norm_eps, h)
                E.rope(q, cos, sin)
                E.rope(k, cos, sin)
                E.add(x, h)
                E.rmsnorm(x, norm, a.norm_eps, h)
                E.swiglu(gate_up, act)
                E.add(x, h)
            K.rmsnorm(x[-1:], norm, a.norm_eps, h[:1])

    parts = {"token": token, "products": products, "output": output,
             "attention": attention, "elementwise": elementwise}
    for f in parts.values():
        f()                                   # compiled, pages touched
    # rounds interleave the parts, so a drift in the machine's speed hits them alike
    times = {k: [] for k in parts}
    for _ in range(reps):
        for key, f in parts.items():
            times[key].append(_median_time(f, 1) / (steps * T))
    res = {key: statistics.median(v) for key, v in times.items()}
    res["python"] = 0.0
    if T == 1:
        from edgellama.kernels.jit import kernels_replaced
        with kernels_replaced(lambda kernel: _no_op), np.errstate(all="ignore"):
            token()
            res["python"] = _median_time(token, reps) / steps
    res["rest"] = res["token"] - sum(res[k] for k in res if k != "token")
    n, by_kernel = count_regions(lambda: (seq.truncate(depth), m.forward(ids if T > 1 else [7], seq)))
    res["regions"], res["regions_by_kernel"] = n, by_kernel
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", help="a GGUF file (default: --shape's random-weight file)")
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--type", default="q4_0")
    ap.add_argument("-t", "--threads", default=None,
                    help="thread counts, comma-separated (default: 1 and every power of 2 up to the cores)")
    ap.add_argument("--depth", type=int, default=0, help="cached positions a token attends to")
    ap.add_argument("--prefill", type=int, default=0, metavar="T",
                    help="split a prefill of T tokens instead of a decode step (times per token)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    import numba
    from edgellama.benchmark import decode_bytes, shape_file
    from edgellama.gguf import GGUFFile
    from edgellama.machine import ThreadPolicy, cpu_name, default_threads
    from edgellama.kernels.membw import measure_read_bandwidth
    from edgellama.model import Transformer
    from edgellama.kernels.amx import kernels_name

    cores = default_threads()
    if args.threads:
        counts = [int(t) for t in args.threads.split(",")]
    else:
        counts = sorted({1, cores} | {2 ** i for i in range(8) if 2 ** i <= cores})
    path = Path(args.model) if args.model else shape_file(args.shape, args.type)
    T = max(1, args.prefill)
    m = Transformer(GGUFFile(path), ctx=args.depth + max(4 * N_TOKENS, T),
                    threads=ThreadPolicy(max(counts)))
    m.wait_for_tiles()
    nbytes = decode_bytes(m, args.depth)
    rows = []
    for t in counts:
        m.threads = ThreadPolicy(t)
        m.threads.apply()
        ceiling = statistics.median(measure_read_bandwidth(keep=True) for _ in range(3))
        r = split(m, args.depth, args.reps, T)
        r["region_s"], r["serial_call_s"] = region_cost(args.reps)
        r["join_wait"] = join_wait(m, args.reps) if T == 1 else None
        r.update(threads=t, ceiling_gbs=ceiling, gbs=nbytes / r["token"] / 1e9)
        rows.append(r)
        ms = {k: r[k] * 1e3 for k in ("token", "products", "output", "attention", "elementwise", "python",
                                      "rest")}
        launch = r["regions"] * max(0.0, r["region_s"] - r["serial_call_s"]) * 1e3
        python = "" if T > 1 else f"python {ms['python']:.2f}, "
        wait = ("" if r["join_wait"] is None else
                f"join wait {r['join_wait'][0]:.0%} of products ({r['join_wait'][0] * ms['products']:.2f} ms; "
                f"late start {r['join_wait'][1]:.0%}) | ")
        print(f"{t:>2} threads{f', prefill {T}' if T > 1 else ''}: token {ms['token']:.3f} ms ({r['gbs']:.1f} GB/s, "
              f"{r['gbs'] / ceiling:.0%} of {ceiling:.1f}) | products {ms['products']:.2f}, "
              f"output {ms['output']:.2f}, attention {ms['attention']:.2f}, elementwise "
              f"{ms['elementwise']:.2f}, {python}rest {ms['rest']:.2f} | {wait}{r['regions']} regions x "
              f"{(r['region_s'] - r['serial_call_s']) * 1e6:.1f} us = {launch:.2f} ms "
              f"(a serial call {r['serial_call_s'] * 1e6:.1f} us)", flush=True)
    res = {"machine": cpu_name(), "file": str(path), "kernels": kernels_name(),
           "threading_layer": numba.threading_layer(), "depth": args.depth, "prefill": args.prefill,
           "decode_bytes": nbytes, "rows": rows}
    print(f"{path.name}, depth {args.depth}, {kernels_name()} kernels, threading layer "
          f"{res['threading_layer']}; regions a token opens: {rows[0]['regions_by_kernel']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
