"""Speculative decoding, measured (edgellama/speculative.py; docs/usage.md, Speculative decoding).

1. The verification cost: Transformer.verify over T = 1 + k tokens (k = 2, 4, 8, 16
   proposals) against one decode step (T = 1), on the random-weight Llama 3.2 1B and 3B
   shapes (Q4_K, the Q4_K_M mix's main type; edgellama/benchmark.py's files), at a
   depth of 256 positions.
2. End to end on real weights: SmolLM2-135M-Instruct at Q8_0 (the target) decoding
   greedily, plain, with prompt lookup, and drafted by a Q4_0 copy of itself (llama.cpp's
   quantizer, as bench/bench_fidelity.py makes them), on a summarise-this-text, an
   edit-this-code and an open question (where lookup has little to copy). Every
   speculative reply is checked to be the plain one, token for token.
3. llama.cpp beside it: llama-cpp-python with and without LlamaPromptLookupDecoding
   (num_pred_tokens 10, its default) as draft_model, the same file and prompts.
4. The speed-up predicted for a 1B draft of 3B from (1)'s costs at published acceptance
   rates.

    python bench/bench_speculative.py [--tokens 128] [--out bench/results/speculative.json]
    python bench/bench_speculative.py --only-shapes --out bench/results/speculative_verify.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]
import edgellama  # noqa: E402
from edgellama.benchmark import SUMMARISE, shape_file  # noqa: E402
from edgellama.default_model import cache_dir  # noqa: E402
from edgellama.gguf import GGUFFile  # noqa: E402
from edgellama.model import Transformer  # noqa: E402
from edgellama.sampling import SamplingParams  # noqa: E402
from edgellama.speculative import PromptLookup  # noqa: E402
from quant_quality import cpu_name  # noqa: E402

KS = (2, 3, 4, 7, 8, 15, 16)    # k + 1 = 4, 8, 16 fill whole groups of the 4-row kernel
GREEDY = SamplingParams(temperature=0.0)

CODE = '''def total_price(items):
    total = 0
    for item in items:
        total = total + item["price"] * item["quantity"]
    return total


def average_price(items):
    if len(items) == 0:
        return 0
    return total_price(items) / len(items)
'''
PROMPTS = {
    "summarise": SUMMARISE,
    "edit code": f"Rename the function total_price to order_total everywhere in this code "
                 f"and print the whole code:\n\n{CODE}",
    "open question": "Write a short story about a lighthouse keeper who finds a map.",
}


def verify_costs(shape: str, repeats: int) -> dict:
    model = Transformer(GGUFFile(shape_file(shape, "Q4_K", quiet=True)), ctx=1024)
    model.wait_for_tiles()
    rng = np.random.default_rng(0)
    seq = model.new_sequence()
    # the sizes interleaved, the fastest run of each: the machine is shared, and the
    # minimum is the run least slowed by others
    sizes = (1,) + tuple(k + 1 for k in KS)
    runs = {T: [] for T in sizes}
    for r in range(repeats + 1):            # the first round warms caches and threads
        for T in sizes:
            seq.fill_random(256, rng)
            t0 = time.perf_counter()
            model.verify(rng.integers(0, 1000, T), seq)
            if r:
                runs[T].append(time.perf_counter() - t0)
    times = {T: min(v) for T, v in runs.items()}
    return {"shape": shape, "type": "Q4_K", "depth": 256,
            "step_seconds": times[1],
            "verify": {k: {"seconds": times[k + 1], "x_step": times[k + 1] / times[1]} for k in KS}}


def smollm2_files() -> dict[str, Path]:
    from bench_fidelity import files, quiet_llama_cpp
    quiet_llama_cpp()
    f = files(cache_dir() / "bench" / "fidelity", ["q8_0", "q4_0"])
    return {"target": f["Q8_0"], "draft": f["Q4_0"]}


def ours(paths: dict[str, Path], tokens: int, rounds: int) -> dict:
    """Each way `rounds` times, interleaved (the machine is shared: its load drifts),
    the best speed of each."""
    from edgellama.kernels import jit
    llm = edgellama.load(paths["target"], ctx=2048)
    draft = llm.load_draft(paths["draft"])
    jit.warm_up(llm.model)
    jit.warm_up(draft.model)
    out = {}
    for name, text in PROMPTS.items():
        ids = llm.chat.encode_messages([{"role": "user", "content": text}])
        row, plain = {}, None
        for _ in range(rounds):
            for how, drafter in [("plain", None), ("lookup", PromptLookup()), ("draft Q4_0", draft)]:
                llm.reset()
                if drafter is not None:
                    drafter.length = None          # each run measures afresh
                got = list(llm.generate(ids, max_tokens=tokens, sampling=GREEDY, drafter=drafter))
                s = llm.stats
                if plain is None:
                    plain = got
                elif got != plain:
                    raise SystemExit(f"{how} on {name!r}: the tokens differ from plain decoding")
                if how not in row or s.gen_tps > row[how]["tok_s"]:
                    row[how] = {"tokens": s.gen_tokens, "tok_s": s.gen_tps,
                                "drafted": s.drafted, "accepted": s.accepted}
        for how in ("lookup", "draft Q4_0"):
            row[how]["x_plain"] = row[how]["tok_s"] / row["plain"]["tok_s"]
        out[name] = row
    return out


def llama_cpp_lookup(path: Path, tokens: int) -> dict | None:
    try:
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        return None
    out = {}
    for how, draft in [("plain", None), ("lookup", LlamaPromptLookupDecoding(num_pred_tokens=10))]:
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=2048, n_threads=2, verbose=False,
                              draft_model=draft)
        for name, text in PROMPTS.items():
            msgs = [{"role": "user", "content": text}]
            llm.create_chat_completion(msgs, max_tokens=4, temperature=0.0)    # warm
            t0 = time.perf_counter()
            r = llm.create_chat_completion(msgs, max_tokens=tokens, temperature=0.0)
            n = r["usage"]["completion_tokens"]
            # includes the prompt's prefill: reported beside ours as a ratio only
            out.setdefault(name, {})[how] = {"tokens": n, "seconds": time.perf_counter() - t0}
            print(f"llama.cpp {how} {name}: {out[name][how]}", file=sys.stderr, flush=True)
        del llm
    for row in out.values():
        row["lookup"]["x_plain"] = (row["lookup"]["tokens"] / row["lookup"]["seconds"]) / \
                                   (row["plain"]["tokens"] / row["plain"]["seconds"])
    return out


def predicted_1b_for_3b(costs: dict) -> dict:
    """Speed-up of 3B decoding with a 1B draft: E(k) one-step costs per step of
    v3(k+1) + k·c1, E(k) = (1 - a^(k+1)) / (1 - a), the best k of KS."""
    c3, c1 = costs["llama-3.2-3b"]["step_seconds"], costs["llama-3.2-1b"]["step_seconds"]
    out = {}
    for a in (0.6, 0.7, 0.8):
        best = max(((1 - a ** (k + 1)) / (1 - a) * c3 /
                    (costs["llama-3.2-3b"]["verify"][k]["seconds"] + k * c1), k) for k in KS)
        out[str(a)] = {"speedup": best[0], "k": best[1]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2, help="runs of each way, best kept")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "speculative.json")
    ap.add_argument("--skip-shapes", action="store_true", help="no 1B/3B verification costs")
    ap.add_argument("--only-shapes", action="store_true", help="only the 1B/3B verification costs")
    a = ap.parse_args()
    result = {"cpu": cpu_name(), "date": time.strftime("%Y-%m-%d"), "tokens": a.tokens}
    if not a.skip_shapes:
        costs = {s: verify_costs(s, a.repeats) for s in ("llama-3.2-1b", "llama-3.2-3b")}
        result["verify_cost"] = costs
        result["predicted_1b_drafting_3b"] = predicted_1b_for_3b(costs)
        print(json.dumps(costs, indent=1), flush=True)
    if not a.only_shapes:
        paths = smollm2_files()
        result["smollm2_q8_0"] = ours(paths, a.tokens, a.rounds)
        print(json.dumps(result["smollm2_q8_0"], indent=1), flush=True)
        result["llama_cpp_q8_0"] = llama_cpp_lookup(paths["target"], a.tokens)
    tmp = a.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(a.out)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
