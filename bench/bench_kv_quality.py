"""What each KV cache type costs in quality: perplexity over a text with each cache type
against the same model with an f16 cache (mean KL divergence, top-1 agreement), ours
and llama.cpp's, on the same token ids.

    python bench/bench_kv_quality.py [--model GGUF] [--file bench/data/alice.txt]
                                     [--ctx 2048] [--chunks 4] [--json OUT]

Chunks as `edgellama perplexity` makes them (the first half of each is context, the rest
is scored). Ours: each type pair, and the quantized ones also without the Hadamard
rotation (to show what it is worth). llama.cpp (llama-cpp-python, flash attention on:
it quantizes V only with it) with the same types, each compared with its own f16 run.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

import edgellama
from edgellama.kv_cache import KVCache
from edgellama.perplexity import chunk_logits, first_scored, log_softmax, make_chunks, read_tokens
from edgellama.sequence import Sequence

PAIRS = [("f16", "f16"), ("q8_0", "q8_0"), ("q8_0", "q4_0"), ("q4_0", "q4_0"), ("q4_0", "f16")]


def compare(lp_ref: np.ndarray, lp: np.ndarray, targets: np.ndarray) -> dict:
    """Mean KL(ref || this), top-1 agreement, and this run's perplexity."""
    kl = (np.exp(lp_ref) * (lp_ref - lp)).sum(-1)
    nll = -lp[np.arange(len(targets)), targets]
    return {"mean_kl": float(kl.mean()), "top1": float((lp.argmax(-1) == lp_ref.argmax(-1)).mean()),
            "ppl": float(np.exp(nll.mean()))}


def ours(path: str, chunks, pairs) -> dict:
    llm = edgellama.load(path, ctx=chunks.n_ctx)
    m = llm.model
    runs = {}
    for tk, tv in pairs:
        for rotate in ((True, False) if (tk, tv) != ("f16", "f16") else (True,)):
            seq = Sequence(KVCache(m.args, chunks.n_ctx, tk, tv, rotate=rotate))
            t0 = time.perf_counter()
            lps = [log_softmax(chunk_logits(m, c, seq)) for c in chunks]
            name = f"{tk}/{tv}" + ("" if rotate or (tk, tv) == ("f16", "f16") else " unrotated")
            runs[name] = np.concatenate(lps)
            print(f"ours {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    return runs


def llamacpp(path: str, chunks, pairs) -> dict:
    import llama_cpp
    ids = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0,
           "q4_0": llama_cpp.GGML_TYPE_Q4_0}
    runs = {}
    for tk, tv in pairs:
        t0 = time.perf_counter()
        llm = llama_cpp.Llama(model_path=path, n_ctx=chunks.n_ctx, n_batch=chunks.n_ctx,
                              n_ubatch=512, logits_all=True, type_k=ids[tk], type_v=ids[tv],
                              flash_attn=True, n_threads=os.cpu_count(), verbose=False)
        lps = []
        for c in chunks:
            first = first_scored(len(c))
            llm.reset()
            llm.eval(c[:-1].tolist())
            lps.append(log_softmax(np.asarray(llm.scores[first:len(c) - 1], np.float32)))
        runs[f"{tk}/{tv}"] = np.concatenate(lps)
        del llm
        print(f"llama.cpp {tk}/{tv}: {time.perf_counter() - t0:.1f} s", flush=True)
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="GGUF (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--file", default=str(Path(__file__).parent / "data" / "alice.txt"))
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--no-llamacpp", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.model is None:
        from edgellama.default_model import default_model_path
        a.model = str(default_model_path())
    tok = edgellama.load(a.model, ctx=16).tokenizer
    tokens, _ = read_tokens(tok, a.file, a.ctx * a.chunks)
    chunks = make_chunks(tokens, a.ctx, a.chunks, tok.bos_id if tok.add_bos else None, a.file)
    targets = np.concatenate([c[first_scored(len(c)) + 1:] for c in chunks])
    result = {"model": os.path.basename(a.model), "text": os.path.basename(a.file), "ctx": a.ctx,
              "chunks": len(chunks), "scored_tokens": int(len(targets)), "engines": {}}
    engines = {"edgellama": ours(a.model, chunks, PAIRS)}
    if not a.no_llamacpp:
        engines["llama.cpp"] = llamacpp(a.model, chunks, [p for p in PAIRS])
    for engine, runs in engines.items():
        ref = runs["f16/f16"]
        result["engines"][engine] = {name: compare(ref, lp, targets) for name, lp in runs.items()}
    if "llama.cpp" in engines:   # the two engines' f16 caches, for scale
        result["f16_ours_vs_llamacpp"] = compare(engines["llama.cpp"]["f16/f16"],
                                                 engines["edgellama"]["f16/f16"], targets)
    print(table(result))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))


def table(r: dict) -> str:
    out = [f"{r['model']} over {r['text']}: {r['chunks']} chunks of {r['ctx']}, "
           f"{r['scored_tokens']} scored tokens; each engine against its own f16 cache",
           "", "| K / V cache | engine | mean KL | top-1 agreement | perplexity |",
           "|---|---|---|---|---|"]
    names = list(r["engines"]["edgellama"])
    for name in names:
        for engine, runs in r["engines"].items():
            if name in runs:
                c = runs[name]
                out.append(f"| {name} | {engine} | {c['mean_kl']:.5f} | {c['top1'] * 100:.2f}% | "
                           f"{c['ppl']:.3f} |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
