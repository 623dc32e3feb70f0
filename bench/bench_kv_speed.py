"""Decode and prefill at depth with each KV cache type, on one model in one process: the
cache types' speed relative to f16, the machine's drift shared by all of them.

    python bench/bench_kv_speed.py [--shape llama-3.2-3b] [--type q4_k]
                                   [--depths 0,8192,32768] [--pairs f16/f16,q8_0/q8_0]
                                   [--tg 8] [--pp 512] [--rounds 2] [--json OUT]

For each depth: one sequence per type pair, filled with synthetic K/V to the depth
(Sequence.fill_random); then `rounds` rounds, each decoding --tg tokens in every sequence
in turn (the cache truncated back to the depth first), and, with --pp, reading a --pp
token prompt at the depth. Medians over the rounds; ratios against the first pair.

--llamacpp adds llama.cpp (llama-cpp-python) on the same file, each type pair with flash
attention off (f16/f16 only: llama.cpp quantizes V only with it) and on, in a process of
its own per row: its cache is filled to `depth` as ours is, synthetically (the K/V rows of
16 really read tokens repeated, loaded through llama_state_seq_set_data; --llamacpp-read
reads `depth` real tokens instead, which takes minutes at depth 8192 here), then a --pp
prompt and --tg decoded tokens are timed.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

from edgellama.benchmark import shape_file
from edgellama.gguf import GGUFFile
from edgellama.machine import ThreadPolicy, cpu_name
from edgellama.model import Transformer


def llamacpp_synthetic_fill(llm, depth: int) -> None:
    """Fill llama.cpp's cache for sequence 0 to `depth` positions without reading them:
    read 16 tokens, take the sequence's state (llama_state_seq_get_data), repeat its
    cells' K/V rows to `depth` cells and load it back. The state layout (llama.cpp's
    llama_kv_cache::state_write): 8 bytes, n_stream u32, cell_count u32, per cell
    (pos i32, n_seq u32, seq ids i32...), v_trans u32, n_layer u32, per layer K (type i32,
    row bytes u64, rows), then per layer V: rows as K, or transposed (type i32, element
    bytes u32, n_embd u32, n_embd × cells elements). The layout is checked byte for byte
    against the state's size, so a changed layout stops the bench, not skews it."""
    import ctypes

    import llama_cpp
    n = 16
    llm.eval(list(range(1000, 1000 + n)))
    size = llama_cpp.llama_state_seq_get_size(llm.ctx, 0)
    buf = (ctypes.c_uint8 * size)()
    llama_cpp.llama_state_seq_get_data(llm.ctx, buf, size, 0)
    b = np.frombuffer(bytes(buf), np.uint8)
    u32 = lambda o: int(b[o:o + 4].view(np.uint32)[0])      # noqa: E731
    head, cells = b[:8], u32(12)
    if u32(8) != 1 or cells != n:
        raise SystemExit(f"llama.cpp state: unexpected header (streams {u32(8)}, cells {cells})")
    o = 16
    for _ in range(n):                                        # pos, n_seq, seq ids
        o += 8 + 4 * u32(o + 4)
    v_trans, n_layer = u32(o), u32(o + 4)
    # pieces: (bytes of the 16-cell state, how to repeat them to `depth` cells)
    pieces = [(head, None), (np.array([1, depth], np.uint32).view(np.uint8), None),
              (np.stack([np.arange(depth), np.ones(depth), np.zeros(depth)], 1).astype(
                  np.int32).reshape(-1).view(np.uint8), None), (b[o:o + 8], None)]
    o += 8
    for part in ("k", "v"):
        for _ in range(n_layer):
            if part == "v" and v_trans:        # n_embd rows of one element per cell
                el, n_embd = u32(o + 4), u32(o + 8)
                rows = b[o + 12:o + 12 + n_embd * n * el].reshape(n_embd, n, el)
                pieces += [(b[o:o + 12], None), (rows, 1)]
                o += 12 + n_embd * n * el
            else:                              # a row per cell
                row = int(b[o + 4:o + 12].view(np.uint64)[0])
                pieces += [(b[o:o + 12], None), (b[o + 12:o + 12 + n * row].reshape(n, row), 0)]
                o += 12 + n * row
    if o != size:
        raise SystemExit(f"llama.cpp state: layout read {o} of {size} bytes; not the one "
                         "this bench knows (use --llamacpp-read)")
    grow = lambda a, ax: a.size if ax is None else a.size // n * depth      # noqa: E731
    state = np.empty(sum(grow(a, ax) for a, ax in pieces), np.uint8)
    at = 0
    for a, ax in pieces:                       # written in place: the state is GiBs at depth
        dst = state[at:at + grow(a, ax)]
        if ax is None:
            dst[:] = a
        else:
            shape = list(a.shape)
            shape[ax] = depth
            dst = dst.reshape(shape)
            for c0 in range(0, depth, n):
                sl = [slice(None)] * a.ndim
                sl[ax] = slice(c0, min(c0 + n, depth))
                src = [slice(None)] * a.ndim
                src[ax] = slice(0, min(n, depth - c0))
                dst[tuple(sl)] = a[tuple(src)]
        at += grow(a, ax)
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm.ctx), True)
    if not llama_cpp.llama_state_seq_set_data(
            llm.ctx, state.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), state.size, 0):
        raise SystemExit(f"llama.cpp refused the synthetic state of {depth} cells")
    llm.n_tokens = depth
    llm.input_ids[:depth] = 1000


def llamacpp_worker(path: str, depth: int, pp: int, tg: int, tk: str, tv: str, fa: bool,
                    threads: int, read: bool) -> dict:
    import llama_cpp
    ids = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0,
           "q4_0": llama_cpp.GGML_TYPE_Q4_0}
    llm = llama_cpp.Llama(model_path=path, n_ctx=depth + pp + tg + 8, n_threads=threads,
                          n_threads_batch=threads, n_batch=512, n_ubatch=512, type_k=ids[tk],
                          type_v=ids[tv], flash_attn=fa, verbose=False)
    rng = np.random.default_rng(0)
    if depth and read:
        llm.eval(rng.integers(1000, 100000, depth).tolist())
    elif depth:
        llamacpp_synthetic_fill(llm, depth)
    t0 = time.perf_counter()
    llm.eval(rng.integers(1000, 100000, pp).tolist()) if pp else None
    t_pp = time.perf_counter() - t0
    t0 = time.perf_counter()
    for t in rng.integers(1000, 100000, tg).tolist():
        llm.eval([t])
    return {"pp_tps": pp / t_pp if pp else 0.0, "tg_tps": tg / (time.perf_counter() - t0)}


def llamacpp_rows(path, depths, pairs, pp, tg, threads, read) -> list[dict]:
    import subprocess
    import sys
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_llamacpp import with_tokenizer
    tok_path = with_tokenizer(str(path))
    rows = []
    for depth in depths:
        for tk, tv in pairs:
            for fa in ((False, True) if (tk, tv) == ("f16", "f16") else (True,)):
                cmd = [sys.executable, __file__, "--llamacpp-worker", json.dumps(
                    [tok_path, depth, pp, tg, tk, tv, fa, threads, read])]
                res = subprocess.run(cmd, capture_output=True, text=True)
                if res.returncode:
                    sys.exit(f"llama.cpp failed: {res.stderr[-2000:]}")
                row = {"depth": depth, "pair": f"{tk}/{tv}", "flash_attn": fa,
                       **json.loads(res.stdout.strip().splitlines()[-1])}
                rows.append(row)
                print(f"llama.cpp depth {depth} {tk}/{tv} flash_attn={fa}: decode "
                      f"{row['tg_tps']:.2f} t/s, prefill {row['pp_tps']:.1f} t/s", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama-3.2-3b")
    ap.add_argument("--type", default="q4_k")
    ap.add_argument("--depths", default="0,8192,32768")
    ap.add_argument("--pairs", default="f16/f16,q8_0/q8_0")
    ap.add_argument("--tg", type=int, default=8)
    ap.add_argument("--pp", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--llamacpp", action="store_true")
    ap.add_argument("--llamacpp-read", action="store_true",
                    help="fill llama.cpp's cache by reading depth real tokens")
    ap.add_argument("--llamacpp-worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.llamacpp_worker:
        print(json.dumps(llamacpp_worker(*json.loads(a.llamacpp_worker))))
        return
    depths = [int(d) for d in a.depths.split(",")]
    pairs = [tuple(p.split("/")) for p in a.pairs.split(",")]
    path = shape_file(a.shape, a.type)
    policy = ThreadPolicy(a.threads)
    m = Transformer(GGUFFile(path), ctx=max(depths) + max(a.pp, a.tg) + 16, threads=policy)
    m.wait_for_tiles()
    rng = np.random.default_rng(0)
    rows = []
    for depth in depths:
        seqs = {}
        for tk, tv in pairs:
            s = m.new_sequence(ctx=depth + max(a.pp, a.tg) + 16, type_k=tk, type_v=tv)
            s.fill_random(depth, rng) if depth else None
            m.forward([1], s)                     # kernels compiled, pages touched
            seqs[f"{tk}/{tv}"] = s
        tg = {n: [] for n in seqs}
        pp = {n: [] for n in seqs}
        for _ in range(a.rounds):
            for n, s in seqs.items():
                s.truncate(depth)
                t0 = time.perf_counter()
                tok = 1
                for _ in range(a.tg):
                    tok = int(np.argmax(m.forward([tok], s)))
                tg[n].append(a.tg / (time.perf_counter() - t0))
                if a.pp:
                    s.truncate(depth)
                    t0 = time.perf_counter()
                    m.forward(rng.integers(0, 1000, a.pp), s)
                    pp[n].append(a.pp / (time.perf_counter() - t0))
        base = pairs[0][0] + "/" + pairs[0][1]
        row = {"depth": depth, "threads": policy.current,
               "tg_tps": {n: float(np.median(v)) for n, v in tg.items()},
               "pp_tps": {n: float(np.median(v)) for n, v in pp.items() if v}}
        row["tg_vs_first"] = {n: row["tg_tps"][n] / row["tg_tps"][base] for n in seqs}
        if a.pp:
            row["pp_vs_first"] = {n: row["pp_tps"][n] / row["pp_tps"][base] for n in seqs}
        rows.append(row)
        print(f"depth {depth}: decode " + ", ".join(
            f"{n} {row['tg_tps'][n]:.2f} t/s ({row['tg_vs_first'][n]:.2f}x)" for n in seqs)
            + ("" if not a.pp else "; prefill " + ", ".join(
                f"{n} {row['pp_tps'][n]:.1f} t/s ({row['pp_vs_first'][n]:.2f}x)" for n in seqs)),
            flush=True)
        del seqs
    del m
    lc = llamacpp_rows(path, depths, pairs, a.pp, a.tg, a.threads or os.cpu_count(),
                       a.llamacpp_read) if a.llamacpp else []
    if a.json:
        Path(a.json).write_text(json.dumps({
            "machine": cpu_name(), "cores": os.cpu_count(), "file": path.name,
            "load_average": os.getloadavg(), "tg": a.tg, "pp": a.pp, "rounds": a.rounds,
            "rows": rows, "llamacpp": lc}, indent=1))


if __name__ == "__main__":
    main()
