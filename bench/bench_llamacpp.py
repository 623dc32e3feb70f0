"""edgellama beside llama.cpp on the same GGUF files, same thread counts, same depths.

    python bench/bench_llamacpp.py [--shape llama-3.2-1b] [--type q4_0|q4_k_m|q5_k_m|bf16|...] [--threads 1,2]
                                   [--depth 0] [--busy 0,1] [--reps 2] [--json OUT]
                                   [--baseline DIR]

llama.cpp runs through llama-cpp-python (`pip install -e ".[oracle]"`; an optional extra,
never a runtime dependency). Every measurement is a fresh process of its own, and the two
engines alternate (ours, theirs, ours, theirs, ...) so that drift in the machine's speed
hits both alike; the table shows medians and the ratio ours / llama.cpp.

An AVX2-only CPU, on one with AVX-512: build llama-cpp-python a second time with
CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF"
(`pip wheel --no-cache-dir`, unpacked into a directory put first on PYTHONPATH) and run
with NUMBA_CPU_NAME=haswell and NUMBA_CPU_FEATURES listing Haswell's features (+avx,
+avx2, +fma, +f16c, ...): both engines' kernels are then AVX2 code, as the table's
"kernels" line says, on this CPU's cores and memory.

Cases:
- pp: prompt processing of --pp tokens (batch 512) after `depth` tokens in the cache;
- tg: decoding --tg tokens one at a time after `depth` + --pp tokens;
- ceiling: the read bandwidth of a parallel sum over 2 GiB, measured in a process of its
  own between the engines' (with the row's thread count); decode's bytes per token
  (weights and K/V) times tokens/s over it says how close each engine is to the memory;
- --baseline DIR: another checkout of edgellama (say main's, beside a branch) runs as a
  third engine in the same alternation, so a change's before and after are measured in
  one run, each also as a ratio to llama.cpp (its kernels and tiles cached apart from
  this checkout's, in the cache folder's bench-baseline);
- busy 1: the same with one CPU-bound process running beside it (what a laptop with a
  browser open looks like). edgellama runs with its default thread setting there
  (the column "threads" says what it was asked for; default = adaptive), llama.cpp
  with the given count, as a user would run it;
- first, untimed: one short run of each edgellama tree, so that a first load's tile
  writing (tile_cache.py) is done and on disk before anything is timed.

The weights are random with the real shapes (speed does not depend on values; files
from `edgellama.benchmark.shape_file`; --type q4_k_m, q5_k_m, q3_k_m (and the other
K-quant mixes) and bf16 are llama.cpp's own quantizer's files from the shape's F16 file,
made once). llama.cpp fills its cache at depth by really
prefilling `depth` tokens (untimed); edgellama fills it with synthetic K/V.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time

ENGINES = ("edgellama", "llama.cpp")


# -- workers: run in their own process, print one JSON line ---------------------------

def _tokens(n: int, seed: int, vocab: int) -> list[int]:
    """n random token ids of a vocabulary (past its first ids, where control tokens sit)."""
    import numpy as np
    return np.random.default_rng(seed).integers(min(1000, vocab // 4), min(100000, vocab), n).tolist()


def worker_edgellama(path: str, threads: int | None, depth: int, pp: int, tg: int) -> dict:
    from edgellama.gguf import GGUFFile
    from edgellama.machine import ThreadPolicy
    from edgellama.model import Transformer
    policy = ThreadPolicy(threads)              # None: automatic, as edgellama.load does
    # Transformer, not edgellama.load: shape files have no tokenizer
    m = Transformer(GGUFFile(path), ctx=depth + pp + tg + 8, threads=policy)
    m.wait_for_tiles()
    V = m.args.vocab_size
    seq = m.new_sequence()
    m.forward(_tokens(16, 0, V), seq)                # warm-up: kernels loaded, pages touched
    m.forward(_tokens(1, 1, V), seq)
    seq.fill_random(depth, __import__("numpy").random.default_rng(0))
    t0 = time.perf_counter()
    m.forward(_tokens(pp, 2, V), seq)
    t_pp = time.perf_counter() - t0
    toks = _tokens(tg, 3, V)
    t0 = time.perf_counter()
    for t in toks:
        m.forward([t], seq)
    t_tg = time.perf_counter() - t0
    from edgellama.benchmark import decode_bytes
    return {"pp": pp / t_pp, "tg": tg / t_tg, "threads": policy.current,
            "bytes": decode_bytes(m, depth + pp + tg // 2)}


def worker_ceiling(threads: int | None) -> dict:
    """The read bandwidth of a parallel float32 sum over 2 GiB (the decode ceiling)."""
    import numba

    from edgellama.kernels.membw import measure_read_bandwidth
    if threads:
        numba.set_num_threads(threads)
    return {"gb_s": measure_read_bandwidth(2 << 30)}


def worker_llamacpp(path: str, threads: int, depth: int, pp: int, tg: int) -> dict:
    import llama_cpp
    from llama_cpp import Llama
    llm = Llama(model_path=path, n_ctx=depth + pp + tg + 8, n_threads=threads,
                n_threads_batch=threads, n_batch=512, n_ubatch=512, verbose=False)
    V = llm.n_vocab()

    def clear():
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm._ctx.ctx), True)
        llm.n_tokens = 0

    llm.eval(_tokens(16, 0, V))                       # warm-up, as ours
    llm.eval(_tokens(1, 1, V))
    clear()
    if depth:
        llm.eval(_tokens(depth, 4, V))
    t0 = time.perf_counter()
    llm.eval(_tokens(pp, 2, V))
    t_pp = time.perf_counter() - t0
    t0 = time.perf_counter()
    for t in _tokens(tg, 3, V):
        llm.eval([t])
    t_tg = time.perf_counter() - t0
    return {"pp": pp / t_pp, "tg": tg / t_tg, "threads": threads}


# -- files llama.cpp can load ---------------------------------------------------------

def with_tokenizer(path: str) -> str:
    """A copy of a random-weight shape file with a tokenizer added (llama.cpp refuses a
    model without one): a synthetic byte-level vocabulary (GPT-2 pre-tokenizer) of the
    model's size, no merges. Written once beside the original, as <name>-tok.gguf. A
    file with a tokenizer of its own (--file) is returned as it is."""
    from pathlib import Path

    from gguf.constants import GGUFValueType as V

    from edgellama.bytelevel import byte_to_unicode
    from edgellama.gguf import GGUFFile
    from edgellama.gguf_write import GGUFStreamWriter

    src = Path(path)
    dst = src.with_name(src.stem + "-tok.gguf")
    if dst.is_file():
        return str(dst)
    g = GGUFFile(src)
    if "tokenizer.ggml.model" in g.metadata:     # a real file (--file): loads as it is
        return path
    n_vocab = g.tensors["token_embd.weight"].shape[0]
    tokens = list(byte_to_unicode().values()) + [f"<|t{i}|>" for i in range(256, n_vocab)]
    tmp = dst.with_suffix(".tmp")
    try:
        with open(tmp, "wb") as f:
            w = GGUFStreamWriter(f)
            for key, value in g.metadata.items():
                w.kv(key, *_typed(value, g.metadata_types[key]))
            w.kv("tokenizer.ggml.model", V.STRING, "gpt2")
            w.kv("tokenizer.ggml.pre", V.STRING, "gpt-2")
            w.kv("tokenizer.ggml.tokens", V.ARRAY, tokens, V.STRING)
            w.kv("tokenizer.ggml.token_type", V.ARRAY, [1] * n_vocab, V.INT32)
            w.kv("tokenizer.ggml.merges", V.ARRAY, [], V.STRING)
            w.kv("tokenizer.ggml.bos_token_id", V.UINT32, n_vocab - 2)
            w.kv("tokenizer.ggml.eos_token_id", V.UINT32, n_vocab - 1)
            for t in g.tensors.values():
                w.tensor(t.name, t.shape, t.type_id)
            w.write_header()
            for t in g.tensors.values():
                w.tensor_data(t.name, [g.tensor_bytes(t.name)])
        tmp.replace(dst)
    finally:
        tmp.unlink(missing_ok=True)
    return str(dst)


def _typed(value, types):
    from gguf.constants import GGUFValueType as V
    if types[0] == V.ARRAY:
        return V.ARRAY, value, V(types[1])
    return V(types[0]), value


# -- driver ---------------------------------------------------------------------------

def instruction_sets() -> dict:
    """What each engine's kernels were built for: ours follow Numba's target (the host,
    or NUMBA_CPU_NAME / NUMBA_CPU_FEATURES: an AVX2 CPU can be stood in for that way,
    beside a llama.cpp built with -DGGML_NATIVE=OFF -DGGML_AVX512=OFF)."""
    import llama_cpp
    from edgellama.kernels.amx import kernels_name
    feats = llama_cpp.llama_print_system_info().decode().replace("|", " ").split()
    simd = [f for f, v in zip(feats, feats[2:])       # "AVX2 = 1 | F16C = 1 | ..."
            if v == "1" and f.startswith(("AVX", "FMA", "F16C", "AMX"))]
    return {"edgellama kernels": kernels_name(), "llama.cpp kernels": " ".join(simd)}


@contextlib.contextmanager
def busy_process(on: bool):
    """One CPU-bound process beside the benchmark (a spinning Python loop)."""
    if not on:
        yield
        return
    p = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        yield
    finally:
        p.kill()
        p.wait()


def run_one(engine: str, path: str, threads: int | None, depth: int, pp: int, tg: int,
            baseline: str | None = None) -> dict:
    """One measurement in a process of its own; engine "baseline": edgellama imported
    from the checkout `baseline`."""
    from edgellama.default_model import cache_dir
    if engine == "llama.cpp":
        path = with_tokenizer(path)
    env = None
    if engine == "baseline":
        # a cache folder of its own: a model keeps one tile file, so the two trees would
        # otherwise evict each other's and every run would repack and write its tiles
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [baseline, *filter(None, [os.environ.get("PYTHONPATH")])]),
            EDGELLAMA_CACHE=str(cache_dir() / "bench-baseline"))
        engine = "edgellama"
    cmd = [sys.executable, __file__, "--worker", engine]
    if engine != "ceiling":
        cmd += ["--file", path, "--depth", str(depth), "--pp", str(pp), "--tg", str(tg)]
    if threads is not None:
        cmd += ["--worker-threads", str(threads)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        sys.exit(f"{engine} failed: {res.stderr.strip()[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


# --type values made by llama.cpp's own quantizer from the shape's F16 file (its mixes,
# which we do not write, and BF16): llama-cpp-python's file type constant for each
LLAMACPP_MIXES = {"q3_k_s": "Q3_K_S", "q3_k_m": "Q3_K_M", "q3_k_l": "Q3_K_L", "q4_k_s": "Q4_K_S",
                  "q4_k_m": "Q4_K_M", "q5_k_s": "Q5_K_S", "q5_k_m": "Q5_K_M", "bf16": "BF16"}


def llamacpp_mix(shape: str, mix: str) -> str:
    """llama.cpp's own quantization `mix` (a LLAMACPP_MIXES key) of the shape's random
    F16 file (Q4_K_M: its quantizer's mix of Q4_K, Q6_K and the rest), made once beside
    it."""
    import ctypes
    import llama_cpp
    from edgellama.benchmark import shape_file
    src = shape_file(shape, "F16")
    dst = src.with_name(src.name.replace("-f16", f"-{mix}-llamacpp"))
    if not dst.is_file():
        p = llama_cpp.llama_model_quantize_default_params()
        p.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{LLAMACPP_MIXES[mix]}")
        tmp = dst.with_suffix(".part")
        try:
            if llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(p)):
                raise SystemExit(f"llama.cpp could not quantize {src} to {LLAMACPP_MIXES[mix]}")
            tmp.replace(dst)
        finally:
            tmp.unlink(missing_ok=True)      # a failed or interrupted run leaves no part file
    return str(dst)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--type", default="q4_0")
    ap.add_argument("--file", help="a GGUF to use instead of --shape/--type")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--depth", default="0")
    ap.add_argument("--busy", default="0", help="0, 1 or 0,1: with a competing busy process")
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--tg", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--baseline", help="another edgellama checkout to run beside this one")
    ap.add_argument("--worker", choices=(*ENGINES, "ceiling"), help=argparse.SUPPRESS)
    ap.add_argument("--worker-threads", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()

    if a.worker == "ceiling":
        print(json.dumps(worker_ceiling(a.worker_threads)))
        return
    if a.worker:
        fn = worker_edgellama if a.worker == "edgellama" else worker_llamacpp
        print(json.dumps(fn(a.file, a.worker_threads, int(a.depth), a.pp, a.tg)))
        return

    from edgellama.benchmark import shape_file
    from edgellama.machine import cpu_name
    if a.file:
        path = a.file
    elif a.type.lower() in LLAMACPP_MIXES:
        path = llamacpp_mix(a.shape, a.type.lower())
    else:
        path = str(shape_file(a.shape, a.type))
    engines = (*ENGINES, "baseline") if a.baseline else ENGINES
    # a tree's first load of a file repacks it and writes its tiles (tile_cache.py): do
    # that untimed, and flush it to disk, so that no timed run shares the machine with
    # the writeback
    for e in engines:
        if e != "llama.cpp":
            run_one(e, path, None, 0, 16, 1, a.baseline)
    os.sync()
    rows = []
    for busy in (int(b) for b in a.busy.split(",")):
        for depth in (int(d) for d in a.depth.split(",")):
            for threads in (int(t) for t in a.threads.split(",")):
                got = {e: [] for e in (*engines, "ceiling")}
                with busy_process(busy):
                    for _ in range(a.reps):
                        for e in got:
                            # busy: ours at its default (adaptive) setting, as users run it
                            t = None if (busy and e in ("edgellama", "baseline")) else threads
                            got[e].append(run_one(e, path, t, depth, a.pp, a.tg, a.baseline))
                row = {"busy": busy, "depth": depth, "threads": threads,
                       "ceiling GB/s": statistics.median(r["gb_s"] for r in got["ceiling"]),
                       "decode bytes": got["edgellama"][0]["bytes"]}
                for e in engines:
                    for k in ("pp", "tg"):
                        row[f"{e} {k}"] = statistics.median(r[k] for r in got[e])
                rows.append(row)
                print(_line(row), flush=True)
    result = {"machine": cpu_name(), "cores": os.cpu_count(), "file": path,
              "pp": a.pp, "tg": a.tg, "reps": a.reps, **instruction_sets(), "rows": rows}
    if a.baseline:
        result["baseline"] = os.path.abspath(a.baseline)
    print("\n" + table(result))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


def _of_ceiling(r: dict, engine: str) -> float:
    """Decode's bytes/s (weights and K/V read per token) as a share of the ceiling."""
    return r[f"{engine} tg"] * r["decode bytes"] / 1e9 / r["ceiling GB/s"]


def _line(r: dict) -> str:
    base = "baseline pp" in r
    return (f"busy={r['busy']} depth={r['depth']} threads={r['threads']}: "
            f"pp {r['edgellama pp']:.1f} / {r['llama.cpp pp']:.1f}"
            + (f" (baseline {r['baseline pp']:.1f})" if base else "") + "  "
            f"tg {r['edgellama tg']:.1f} / {r['llama.cpp tg']:.1f}"
            + (f" (baseline {r['baseline tg']:.1f})" if base else "") + "  "
            f"(of a {r['ceiling GB/s']:.0f} GB/s ceiling: {_of_ceiling(r, 'edgellama'):.0%} / "
            f"{_of_ceiling(r, 'llama.cpp'):.0%})")


def table(res: dict) -> str:
    out = [f"{os.path.basename(res['file'])} on {res['machine']} ({res['cores']} cores); "
           f"pp{res['pp']}, tg{res['tg']}, median of {res['reps']}",
           f"kernels: edgellama {res.get('edgellama kernels', '?')}; "
           f"llama.cpp {res.get('llama.cpp kernels', '?')}",
           "",
           "| threads | depth | busy | prefill ours / llama.cpp t/s | ratio | "
           "decode ours / llama.cpp t/s | ratio | decode, % of the read ceiling (GB/s) |",
           "|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        ours_t = "default" if r["busy"] else r["threads"]
        out.append(f"| {ours_t} vs {r['threads']} | {r['depth']} | {'yes' if r['busy'] else 'no'} | "
                   f"{r['edgellama pp']:.1f} / {r['llama.cpp pp']:.1f} | "
                   f"{r['edgellama pp'] / r['llama.cpp pp']:.2f}× | "
                   f"{r['edgellama tg']:.1f} / {r['llama.cpp tg']:.1f} | "
                   f"{r['edgellama tg'] / r['llama.cpp tg']:.2f}× | "
                   f"{_of_ceiling(r, 'edgellama'):.0%} / {_of_ceiling(r, 'llama.cpp'):.0%} "
                   f"({r['ceiling GB/s']:.0f}) |")
    if "baseline" in res:
        out += ["", f"baseline: {res['baseline']}", "",
                "| threads | depth | busy | prefill ours / baseline t/s | ratio | "
                "decode ours / baseline t/s | ratio | baseline / llama.cpp, prefill and decode |",
                "|---|---|---|---|---|---|---|---|"]
        for r in res["rows"]:
            out.append(f"| {r['threads']} | {r['depth']} | {'yes' if r['busy'] else 'no'} | "
                       f"{r['edgellama pp']:.1f} / {r['baseline pp']:.1f} | "
                       f"{r['edgellama pp'] / r['baseline pp']:.2f}× | "
                       f"{r['edgellama tg']:.1f} / {r['baseline tg']:.1f} | "
                       f"{r['edgellama tg'] / r['baseline tg']:.2f}× | "
                       f"{r['baseline pp'] / r['llama.cpp pp']:.2f}×, "
                       f"{r['baseline tg'] / r['llama.cpp tg']:.2f}× |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
