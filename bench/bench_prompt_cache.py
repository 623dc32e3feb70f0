"""A saved long prompt beside reading it again, and a reply after a context shift beside
an ordinary one.

    python bench/bench_prompt_cache.py [--shape llama-3.2-1b] [--type q4_k] [--tokens 8192]
                                       [--question 24] [--chunk 512] [--json OUT]

Random weights with the real shapes (edgellama.benchmark's shape files; q4_k: Q4_K
matrices and a Q6_K output, the types of a Q4_K_M file). Speed ignores the values, so
the document's K/V are synthetic (Sequence.fill_random) under random token ids.

1. Saved prompt: this process saves a cache of --tokens positions (prompt_cache.save);
   fresh processes (`python -c`, kernels cached, the file in the page cache as after a
   first run) each load the model, load the file and read a --question-token question
   after it to its first token. Timed inside the process from its first line, so the
   total includes Python's and edgellama's imports; the file's load also in CPU time
   (this process's, page faults included), which other processes' load inflates less.
2. Reading the document again instead: prefill of --chunk tokens at depth 0, at the
   middle and at the end of the document, measured here; the whole document's time is
   their trapezoid sum over its chunks (attention grows linearly with depth), as a
   full read takes minutes on this shared machine.
3. Context shift: a full context; a chat's next message (--question tokens) read after
   dropping the oldest tenth by a shift (Sequence.shift, then the message) beside the
   same message read at the same depth without one; and what re-reading the kept part
   instead would cost (from 2).
4. What a shift does to the logits, on real weights (SmolLM2, shift_quality()).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))   # this checkout's edgellama

import numpy as np  # noqa: E402

FRESH = r"""
import time
t_start = time.perf_counter()
import json, sys
import numpy as np
from edgellama import prompt_cache
from edgellama.gguf import GGUFFile
from edgellama.model import Transformer
path, prompt, ctx, question = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
model = Transformer(GGUFFile(path), ctx)
seq = model.new_sequence()
t_model, c_model = time.perf_counter(), time.process_time()
saved = prompt_cache.load(prompt, seq, model)
t_prompt, c_prompt = time.perf_counter(), time.process_time()
ids = saved.tokens + question
reused = seq.reuse_prefix(ids)
tok = int(np.argmax(model.forward(ids[reused:], seq)))
t_first, c_first = time.perf_counter(), time.process_time()
print(json.dumps({"model_load_s": t_model - t_start, "prompt_load_s": t_prompt - t_model,
                  "prompt_load_cpu_s": c_prompt - c_model,
                  "question_to_first_token_s": t_first - t_prompt,
                  "question_cpu_s": c_first - c_prompt,
                  "from_process_start_s": t_first - t_start,
                  "from_prompt_load_s": t_first - t_model,
                  "question_tokens_read": len(ids) - reused}))
"""


def _prefill_seconds(model, depth: int, n: int, rng) -> float:
    """Seconds to read n tokens after `depth` synthetic ones."""
    seq = model.new_sequence()
    if depth:
        seq.fill_random(depth, rng)
    ids = rng.integers(1000, 100000, n)
    t0 = time.perf_counter()
    model.forward(ids, seq)
    return time.perf_counter() - t0


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def shift_quality() -> dict:
    """SmolLM2 (real weights) over a text: A (32 tokens, kept) + B (256, dropped) + C (512,
    moved by the shift), then D (128) read after the shift, against A + C + D read afresh:
    top-1 agreement and KL(fresh || shifted) over D's positions; beside the same numbers
    for A + B + C + D with nothing dropped (how far the dropped text's influence alone
    moves them)."""
    import edgellama
    from edgellama.default_model import default_model_path
    llm = edgellama.load(default_model_path(quiet=True), ctx=2048)
    text = open(os.path.join(os.path.dirname(__file__), "data", "alice.txt")).read()[:20000]
    ids = llm.tokenizer.encode(text)
    A, B, C, D = ids[:32], ids[32:288], ids[288:800], ids[800:928]
    m = llm.model
    seq = m.new_sequence()
    m.forward(A + B + C, seq)
    seq.shift(len(A), len(B), m.inv_freq)
    shifted = m.forward(D, seq, all_logits=True)
    fresh = m.forward(A + C + D, m.new_sequence(), all_logits=True)[-len(D):]
    kept_all = m.forward(A + B + C + D, m.new_sequence(), all_logits=True)[-len(D):]
    p = _log_softmax(fresh)

    def against_fresh(x):
        q = _log_softmax(x)
        return {"top1_agreement": float(np.mean(x.argmax(-1) == fresh.argmax(-1))),
                "kl_mean": float((np.exp(p) * (p - q)).sum(-1).mean())}
    return {"model": "SmolLM2-135M-Instruct Q4_1", "tokens": [len(A), len(B), len(C), len(D)],
            "shifted": against_fresh(shifted), "nothing_dropped": against_fresh(kept_all)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--type", default="q4_k")
    ap.add_argument("--tokens", type=int, default=8192, help="the document's length")
    ap.add_argument("--question", type=int, default=24, help="tokens of a new question")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk measured for the re-read")
    ap.add_argument("--fresh", type=int, default=2, help="fresh processes that load the file")
    ap.add_argument("--reps", type=int, default=3, help="shift and reply repetitions")
    ap.add_argument("--json")
    a = ap.parse_args()

    from edgellama import prompt_cache
    from edgellama.benchmark import shape_file
    from edgellama.gguf import GGUFFile
    from edgellama.machine import cpu_name
    from edgellama.model import Transformer
    from edgellama.kernels.amx import kernels_name

    path = shape_file(a.shape, a.type)
    ctx = a.tokens + 256
    model = Transformer(GGUFFile(path), ctx)
    model.wait_for_tiles()
    rng = np.random.default_rng(0)
    vocab = model.args.vocab_size
    doc = rng.integers(0, vocab, a.tokens).tolist()
    question = rng.integers(0, vocab, a.question).tolist()
    res = {"machine": cpu_name(), "cores": os.cpu_count(), "kernels": kernels_name(),
           "file": str(path), "threads": model.threads.current, "ctx": ctx, "document_tokens": a.tokens,
           "question_tokens": a.question, "load_average_at_start": os.getloadavg()[0]}

    # 1. a saved document, loaded by fresh processes
    with tempfile.TemporaryDirectory(dir=os.path.dirname(path)) as tmp:
        prompt = os.path.join(tmp, "doc.prompt")
        seq = model.new_sequence()
        seq.fill_random(a.tokens, rng)
        seq.tokens = list(doc)
        t0 = time.perf_counter()
        prompt_cache.save(prompt, seq, model)
        res["save_s"] = time.perf_counter() - t0
        res["file_bytes"] = os.path.getsize(prompt)
        runs = []
        for _ in range(a.fresh):
            out = subprocess.run([sys.executable, "-c", FRESH, str(path), prompt, str(ctx),
                                  json.dumps(question)], capture_output=True, text=True,
                                 env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path[:1] + [
                                     os.environ.get("PYTHONPATH", "")])))
            if out.returncode:
                raise SystemExit(out.stderr)
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        res["fresh_runs"] = runs
    del seq

    # 2. reading the document again: chunks at three depths, trapezoid sum
    _prefill_seconds(model, 0, 16, rng)                       # kernels loaded
    depths = [0, (a.tokens - a.chunk) // 2, a.tokens - a.chunk]
    chunk_s = [_prefill_seconds(model, d, a.chunk, rng) for d in depths]
    n_chunks = a.tokens / a.chunk
    reread = n_chunks * (chunk_s[0] + chunk_s[2]) / 2
    res["reread"] = {"chunk": a.chunk, "depths": depths, "chunk_s": chunk_s,
                     "middle_vs_linear": chunk_s[1] / ((chunk_s[0] + chunk_s[2]) / 2),
                     "estimated_document_s": reread,
                     "estimated_document_plus_question_s": reread + chunk_s[2] * a.question / a.chunk}

    # 3. a full context: a message after a shift, beside one at the same depth without
    full = ctx - a.question - 1
    keep, drop = 64, full // 10
    warm = model.new_sequence(64)
    warm.fill_random(32, rng)
    warm.shift(1, 1, model.inv_freq)                          # its kernel loaded
    shift_s, after_shift_s, normal_s = [], [], []
    for _ in range(a.reps):
        seq = model.new_sequence()
        seq.fill_random(full, rng)
        t0 = time.perf_counter()
        seq.shift(keep, drop, model.inv_freq)
        t1 = time.perf_counter()
        model.forward(question, seq)
        t2 = time.perf_counter()
        shift_s.append(t1 - t0)
        after_shift_s.append(t2 - t0)
        seq = model.new_sequence()
        seq.fill_random(full - drop, rng)
        t0 = time.perf_counter()
        model.forward(question, seq)
        normal_s.append(time.perf_counter() - t0)
    med = statistics.median
    kept = full - drop - keep
    res["shift"] = {"depth": full, "keep": keep, "drop": drop, "reps": a.reps,
                    "shift_s": med(shift_s), "message_after_shift_s": med(after_shift_s),
                    "message_without_shift_s": med(normal_s),
                    "reread_kept_instead_s": kept / a.chunk * (chunk_s[0] + chunk_s[2]) / 2}
    res["shift_quality"] = q = shift_quality()
    res["load_average_at_end"] = os.getloadavg()[0]

    best = min(runs, key=lambda r: r["from_prompt_load_s"])
    print(f"{path.name} on {res['machine']} ({res['cores']} cores), {res['kernels']} kernels, "
          f"{res['threads']} threads, load average {res['load_average_at_start']:.1f}")
    print(f"saved prompt: {a.tokens} tokens, {res['file_bytes'] / 2**20:.0f} MiB, saved in "
          f"{res['save_s']:.2f} s")
    for r in runs:
        print(f"  fresh process: model {r['model_load_s']:.2f} s, prompt file "
              f"{r['prompt_load_s']:.2f} s ({r['prompt_load_cpu_s']:.2f} s of CPU), question to first token "
              f"{r['question_to_first_token_s']:.2f} s; first token {r['from_prompt_load_s']:.2f} s "
              f"after the model loaded, {r['from_process_start_s']:.2f} s after the process started")
    print(f"reading the document again: {reread:.1f} s estimated ({a.chunk}-token chunks: "
          + ", ".join(f"{s:.2f} s at {d}" for s, d in zip(chunk_s, depths)) + ")")
    print(f"  first token: {best['from_prompt_load_s']:.2f} s from the file vs "
          f"{res['reread']['estimated_document_plus_question_s']:.1f} s re-reading "
          f"({res['reread']['estimated_document_plus_question_s'] / best['from_prompt_load_s']:.0f}x)")
    s = res["shift"]
    print(f"context shift at depth {full} (drop {drop}): shift {s['shift_s']:.2f} s; a "
          f"{a.question}-token message after it {s['message_after_shift_s']:.2f} s, without "
          f"{s['message_without_shift_s']:.2f} s; re-reading the kept {kept} tokens instead "
          f"~{s['reread_kept_instead_s']:.0f} s")
    print(f"after a shift ({q['model']}, kept/dropped/moved/read {q['tokens']}): top-1 agrees with "
          f"a fresh read of the shorter text at {q['shifted']['top1_agreement']:.0%} of positions, "
          f"KL {q['shifted']['kl_mean']:.4f}; with nothing dropped "
          f"{q['nothing_dropped']['top1_agreement']:.0%}, KL {q['nothing_dropped']['kl_mean']:.4f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
