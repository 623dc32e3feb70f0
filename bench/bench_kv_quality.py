"""What each KV cache type costs in quality: perplexity over a text with each cache type
against the same model with an f16 cache (mean KL divergence, top-1 agreement), ours
and llama.cpp's, on the same token ids.

    python bench/bench_kv_quality.py [--model GGUF] [--file bench/data/alice.txt]
                                     [--ctx 2048] [--chunks 2] [--activations fine]
                                     [--json OUT]

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


class Stats:
    """Mean KL(ref || this), top-1 agreement and this run's perplexity, summed chunk by
    chunk (a run's log-probabilities are never all kept: 49152 of them a token)."""

    def __init__(self):
        self.kl = self.agree = self.nll = 0.0
        self.n = 0

    def add(self, lp_ref: np.ndarray, lp: np.ndarray, targets: np.ndarray) -> None:
        self.kl += float((np.exp(lp_ref) * (lp_ref - lp)).sum())
        self.agree += float((lp.argmax(-1) == lp_ref.argmax(-1)).sum())
        self.nll -= float(lp[np.arange(len(targets)), targets].sum())
        self.n += len(targets)

    def result(self) -> dict:
        return {"mean_kl": self.kl / self.n, "top1": self.agree / self.n,
                "ppl": float(np.exp(self.nll / self.n))}


def _configs(pairs):
    # ours: each quantized pair, q4_0 ones also unrotated (what the rotation is worth),
    # the most telling first; f16/f16 is the reference itself
    quant = [(tk, tv) for tk, tv in pairs if (tk, tv) != ("f16", "f16")]
    for tk, tv in quant:
        yield tk, tv, True
        if tk == "q4_0":
            yield tk, tv, False
    for tk, tv in quant:
        if tk == "q8_0":
            yield tk, tv, False


def ours(path: str, chunks, pairs, targets, save=lambda stats: None,
         activations: str = "int8") -> tuple[dict, list]:
    """Each config's Stats against our f16 cache (save(results) after each); and the
    f16 run's log-probs (f32)."""
    llm = edgellama.load(path, ctx=chunks.n_ctx, activations=activations)
    m = llm.model
    refs = [log_softmax(chunk_logits(m, c)).astype(np.float32) for c in chunks]
    stats = {"f16/f16": {"mean_kl": 0.0, "top1": 1.0, "ppl": float(np.exp(np.mean(
        [-ref[np.arange(len(tg)), tg].mean() for ref, tg in zip(refs, targets)])))}}
    for tk, tv, rotate in _configs(pairs):
        name = f"{tk}/{tv}" + ("" if rotate else " unrotated")
        seq = Sequence(KVCache(m.args, chunks.n_ctx, tk, tv, rotate=rotate))
        st = Stats()
        t0 = time.perf_counter()
        for c, ref, tg in zip(chunks, refs, targets):
            st.add(ref, log_softmax(chunk_logits(m, c, seq)), tg)
        stats[name] = st.result()
        save(stats)
        print(f"ours {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    return stats, refs


def llamacpp(path: str, chunks, pairs, targets, our_refs, threads: int) -> tuple[dict, dict]:
    """Each pair's Stats against llama.cpp's f16 cache; and llama.cpp's f16 against ours."""
    import llama_cpp
    ids = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0,
           "q4_0": llama_cpp.GGML_TYPE_Q4_0}
    refs, stats = [], {}
    for tk, tv in pairs:
        t0 = time.perf_counter()
        llm = llama_cpp.Llama(model_path=path, n_ctx=chunks.n_ctx, n_batch=chunks.n_ctx,
                              n_ubatch=512, logits_all=True, type_k=ids[tk], type_v=ids[tv],
                              flash_attn=True, n_threads=threads, verbose=False)
        st = stats[f"{tk}/{tv}"] = Stats()
        for i, (c, tg) in enumerate(zip(chunks, targets)):
            first = first_scored(len(c))
            llm.reset()
            llm.eval(c[:-1].tolist())
            lp = log_softmax(np.asarray(llm.scores[first:len(c) - 1], np.float32))
            if (tk, tv) == ("f16", "f16"):
                refs.append(lp.astype(np.float32))
            st.add(refs[i], lp, tg)
        del llm
        print(f"llama.cpp {tk}/{tv}: {time.perf_counter() - t0:.1f} s", flush=True)
    cross = Stats()
    for ref, ours_lp, tg in zip(refs, our_refs, targets):
        cross.add(ref, ours_lp.astype(np.float64), tg)
    return {n: s.result() for n, s in stats.items()}, cross.result() if our_refs else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="GGUF (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--file", default=str(Path(__file__).parent / "data" / "alice.txt"))
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--chunks", type=int, default=2)
    ap.add_argument("--no-llamacpp", action="store_true")
    ap.add_argument("--no-ours", action="store_true")
    ap.add_argument("--pairs", default=",".join(f"{k}/{v}" for k, v in PAIRS))
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp's")
    ap.add_argument("--activations", choices=("int8", "fine"), default="int8",
                    help="ours: fine leaves the cache's own cost, not int8 x's rounding redrawn")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.model is None:
        from edgellama.default_model import default_model_path
        a.model = str(default_model_path())
    tok = edgellama.load(a.model, ctx=16).tokenizer
    tokens, _ = read_tokens(tok, a.file, a.ctx * a.chunks)
    chunks = make_chunks(tokens, a.ctx, a.chunks, tok.bos_id if tok.add_bos else None, a.file)
    targets = [c[first_scored(len(c)) + 1:] for c in chunks]
    result = {"model": os.path.basename(a.model), "text": os.path.basename(a.file), "ctx": a.ctx,
              "activations": a.activations,
              "chunks": len(chunks), "scored_tokens": int(sum(len(t) for t in targets)),
              "load_average": os.getloadavg(), "engines": {}}
    pairs = [tuple(p.split("/")) for p in a.pairs.split(",")]
    our_refs = []
    if not a.no_ours:
        def save(stats):     # after each config: kept should a later one not finish
            result["engines"]["edgellama"] = stats
            if a.json:
                Path(a.json).write_text(json.dumps(result, indent=1))
        result["engines"]["edgellama"], our_refs = ours(a.model, chunks, pairs, targets, save,
                                                        a.activations)
    if not a.no_llamacpp:
        result["engines"]["llama.cpp"], cross = llamacpp(a.model, chunks, pairs, targets,
                                                         our_refs, a.threads)
        if our_refs:
            result["f16_ours_vs_llamacpp"] = cross
    print(table(result))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))


def table(r: dict) -> str:
    out = [f"{r['model']} over {r['text']}: {r['chunks']} chunks of {r['ctx']}, "
           f"{r['scored_tokens']} scored tokens; each engine against its own f16 cache",
           "", "| K / V cache | engine | mean KL | top-1 agreement | perplexity |",
           "|---|---|---|---|---|"]
    names = list(dict.fromkeys(n for runs in r["engines"].values() for n in runs))
    for name in names:
        for engine, runs in r["engines"].items():
            if name in runs:
                c = runs[name]
                out.append(f"| {name} | {engine} | {c['mean_kl']:.5f} | {c['top1'] * 100:.2f}% | "
                           f"{c['ppl']:.3f} |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
