"""How far each engine's answers are from full precision, on the same files and text.

    python bench/bench_fidelity.py [--tokens 512] [--windows 1] [--types q4_0,q8_0,...] [--out FILE]

SmolLM2-135M (the default model, Q4_1 as published) is dequantized to an F32 GGUF (the
reference: tests/hf_fixtures.py, then `convert --type f32`), and llama.cpp's own quantizer
(`llama_model_quantize`, no importance matrix) makes every other file from it. Each file
then reads the same text, teacher-forced, in llama.cpp (llama-cpp-python, all logits) and
in edgellama — once as one prefill and once token by token (decode), in each activation
mode (model.ACTIVATIONS: int8 as llama.cpp, the default, and fine) — and each run's
logits are compared with llama.cpp's F32 run: mean KL(F32 || run) over the positions, and
how often both rank the same token first. Our own F32 run against llama.cpp's is the
first row (it should be ~0). With --windows N the text is read as N consecutive windows
of --tokens (each starting with BOS): the table shows the mean over all of them, and each
window's ratio of our int8 prefill to llama.cpp follows it (one window of 512 tokens moves
by several percent when near-ties round the other way). Needs `pip install -e ".[oracle]"`.

JSON to --out (default bench/results/fidelity.json), a markdown table on stdout
(`--table JSON` prints it again from a run's JSON).

    python bench/bench_fidelity.py --file GGUF [--tokens 512] [--out FILE]

A published file with no F32 source (Gemma 3 270M's Q4_K_M): the truth is the NumPy
forward pass of its weights dequantized exactly (tests/reference.py, float32 products),
the tokens llama.cpp's. Each run (llama.cpp; ours prefill and decode in each mode) is
scored against it, and so are two NumPy models of llama.cpp's rounding: x rounded to
Q8_0 (f16 scale, blocks of 32) before a Q8_0 or Q5_0 product and to Q8_K (f32 scale,
blocks of 256) before a K-quant one, once with the exact GELU and once with ggml's f16
GELU table as well. How far those two are from each other is the band within which
two equally exact int8 runs differ.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]

import edgellama  # noqa: E402
from edgellama.default_model import cache_dir, default_model_path  # noqa: E402
from edgellama.model import ACTIVATIONS  # noqa: E402
from edgellama.perplexity import log_softmax  # noqa: E402
from edgellama.quant.convert import convert  # noqa: E402
from hf_fixtures import gguf_to_hf_checkpoint  # noqa: E402
from quant_quality import cpu_name  # noqa: E402

# llama.cpp's file types by the names llama-quantize takes
FTYPES = {"f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7, "q5_0": 8, "q5_1": 9, "q2_k": 10,
          "q3_k_m": 12, "q4_k_m": 15, "q5_k_m": 17, "q6_k": 18, "iq4_nl": 25, "iq4_xs": 30,
          "bf16": 32}


def quiet_llama_cpp() -> None:
    """No llama.cpp log lines (the quantizer's are hundreds per file) on stderr."""
    import llama_cpp
    global _QUIET
    _QUIET = llama_cpp.llama_log_callback(lambda level, text, data: None)
    llama_cpp.llama_log_set(_QUIET, None)


def llama_quantize(src: Path, dst: Path, ftype: int) -> None:
    import llama_cpp
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = ftype
    p.nthread = 2
    tmp = dst.with_suffix(".tmp")
    if llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(p)):
        raise RuntimeError(f"llama_model_quantize failed for {dst.name}")
    tmp.replace(dst)


BASELINES = ("F32", "Q4_1 (published)")


def files(work: Path, types: list[str]) -> dict[str, Path]:
    """{label: GGUF}: the F32 reference, the published Q4_1, and llama.cpp's quantizations."""
    work.mkdir(parents=True, exist_ok=True)
    f32 = work / "smollm2-f32.gguf"
    if not f32.is_file():
        hf = gguf_to_hf_checkpoint(default_model_path(), work / "hf", dtype="f32")
        convert(hf, f32, qtype="f32")
    out = dict(zip(BASELINES, (f32, default_model_path())))
    for t in types:
        dst = work / f"smollm2-{t}.gguf"
        if not dst.is_file():
            llama_quantize(f32, dst, FTYPES[t])
        out[t.upper()] = dst
    return out


def llama_cpp_logits(path: Path, ids: list[int], threads: int) -> np.ndarray:
    import llama_cpp
    L = llama_cpp.Llama(model_path=str(path), n_ctx=len(ids) + 8, n_batch=len(ids),
                        logits_all=True, verbose=False, n_threads=threads)
    L.eval(ids)
    out = np.array(L.scores[:len(ids)], np.float32)
    L.close()
    return out


def our_logits(path: Path, ids: list[int], threads: int, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """(prefill logits, decode logits) of every position."""
    llm = edgellama.load(path, ctx=len(ids) + 8, threads=threads, activations=mode)
    m = llm.model
    prefill = np.array(m.forward(np.array(ids), m.new_sequence(), all_logits=True), np.float32)
    seq = m.new_sequence()
    decode = np.stack([np.array(m.forward(np.array(ids[i:i + 1]), seq), np.float32).reshape(-1)
                       for i in range(len(ids))])
    return prefill, decode


def compare(ref_lp: np.ndarray, logits: np.ndarray) -> dict:
    lp = log_softmax(logits)
    kl = (np.exp(ref_lp) * (ref_lp - lp)).sum(-1)
    return {"kl": float(kl.mean()), "kl_p99": float(np.percentile(kl, 99)),
            "top1": float((ref_lp.argmax(-1) == lp.argmax(-1)).mean())}


def mean_of(ms: list[dict]) -> dict:
    """The mean of compare()'s figures over windows."""
    return {k: float(np.mean([m[k] for m in ms])) for k in ms[0]}


def table(rows: list[dict], tokens: int, text: str, cpu: str) -> str:
    def cell(m):
        return f"{m['kl']:.5f} ({m['top1']:.3f})"

    def ratio(a, b):
        return f"{a['kl'] / b['kl']:.2f}×" if b["kl"] else "—"

    out = [f"Mean KL(F32 || run) over {tokens} tokens of {text}, teacher-forced; top-1 "
           f"agreement with F32 in brackets ({cpu}). Ours prefill / token-by-token decode.\n",
           "| file | llama.cpp | ours, int8 (default) | ÷ llama.cpp | ours, fine | ÷ llama.cpp |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        t, i8, fi = r["llama_cpp"], r["int8"], r["fine"]
        out.append(f"| {r['file']} | {cell(t)} | {cell(i8['prefill'])} / {cell(i8['decode'])} | "
                   f"{ratio(i8['prefill'], t)} / {ratio(i8['decode'], t)} | "
                   f"{cell(fi['prefill'])} / {cell(fi['decode'])} | "
                   f"{ratio(fi['prefill'], t)} / {ratio(fi['decode'], t)} |")
    for r in rows:
        if "windows" in r and any(w["llama_cpp"]["kl"] for w in r["windows"]):
            out.append(f"\n{r['file']}, int8 prefill ÷ llama.cpp per window: " + ", ".join(
                ratio(w["int8"]["prefill"], w["llama_cpp"]) for w in r["windows"]))
    return "\n".join(out)


def ggml_gelu_f16(g: np.ndarray) -> np.ndarray:
    """ggml's CPU GELU (GGML_GELU_FP16): gelu(x) read from a table of f16 inputs and f16
    outputs for -10 < x < 10; 0 below, x above."""
    from reference import gelu_tanh
    g = np.asarray(g, np.float32)
    table = gelu_tanh(g.astype(np.float16).astype(np.float32)).astype(np.float32)
    table = table.astype(np.float16).astype(np.float32)
    return np.where(g <= -10, 0, np.where(g >= 10, g, table)).astype(np.float32)


def int8_rounded(x: np.ndarray, block: int, f16_scale: bool) -> np.ndarray:
    # x (T, n) -> x as llama.cpp's q8_0 (block 32, f16 scale) / q8_K (256, f32) hold it
    x = np.asarray(x, np.float32)
    xb = x.reshape(x.shape[0], -1, block)
    d = np.abs(xb).max(-1, keepdims=True) / np.float32(127)
    q = np.round(xb / np.where(d > 0, d, 1))
    if f16_scale:
        d = d.astype(np.float16).astype(np.float32)
    return (q * d).reshape(x.shape)


def llama_cpp_product(types: dict[str, str]):
    """reference_forward's product(x, W, name) with x rounded as llama.cpp's CPU matrix
    products round it for the weight's type (its vec_dot_type)."""
    def product(x, W, name):
        t = types[name]
        if t in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
            x = int8_rounded(x, 32, True)
        elif t.endswith("_K"):
            x = int8_rounded(x, 256, False)
        return np.asarray(x, np.float32) @ W[name].T
    return product


def file_against_truth(path: Path, text: str, tokens: int, threads: int) -> dict:
    """--file: every run of a GGUF against the NumPy forward pass of its weights."""
    import llama_cpp
    from gguf import GGUFReader
    from reference import load_reference, reference_forward
    L = llama_cpp.Llama(model_path=str(path), n_ctx=tokens + 8, vocab_only=True, verbose=False)
    ids = L.tokenize(text.encode(), add_bos=True)[:tokens]
    if len(ids) < tokens:
        sys.exit(f"the text has {len(ids)} tokens: fewer than --tokens {tokens}")
    del L
    meta, W = load_reference(path)
    types = {t.name: t.tensor_type.name for t in GGUFReader(str(path)).tensors}
    truth = log_softmax(reference_forward(meta, W, ids))
    product = llama_cpp_product(types)
    emulated = {"NumPy, llama.cpp's int8 x": reference_forward(meta, W, ids, product),
                "NumPy, llama.cpp's int8 x and f16 GELU":
                    reference_forward(meta, W, ids, product, gelu=ggml_gelu_f16)}
    del W
    runs = {"llama.cpp": llama_cpp_logits(path, ids, threads)}
    for mode in ACTIVATIONS:
        runs[f"ours, {mode}, prefill"], runs[f"ours, {mode}, decode"] = \
            our_logits(path, ids, threads, mode)
    runs.update(emulated)
    rows = {k: compare(truth, v) for k, v in runs.items()}
    a, b = emulated.values()
    pairs = {"llama.cpp || ours, int8, prefill":
                 compare(log_softmax(runs["llama.cpp"]), runs["ours, int8, prefill"]),
             "llama.cpp || ours, int8, decode":
                 compare(log_softmax(runs["llama.cpp"]), runs["ours, int8, decode"]),
             "the two NumPy int8 models (the band)": compare(log_softmax(a), b)}
    return {"file": path.name, "vs_truth": rows, "pairs": pairs}


def file_table(r: dict) -> str:
    out = [f"{r['file']}: mean KL(truth || run) over {r['tokens']} tokens of {r['text']} "
           f"(llama.cpp's tokens), teacher-forced; truth: the NumPy float32 forward pass of "
           f"the file's weights dequantized ({r['cpu']}).\n",
           "| run | mean KL | 99% KL | same top token |", "|---|---|---|---|"]
    for name, m in r["vs_truth"].items():
        out.append(f"| {name} | {m['kl']:.5f} | {m['kl_p99']:.4f} | {m['top1']:.3f} |")
    out += ["\nBetween runs: mean KL(a || b)\n", "| a ‖ b | mean KL | same top token |",
            "|---|---|---|"]
    for name, m in r["pairs"].items():
        out.append(f"| {name.replace('||', '‖')} | {m['kl']:.5f} | {m['top1']:.3f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", default=str(ROOT / "bench/data/alice.txt"))
    ap.add_argument("--tokens", type=int, default=512, help="tokens per window")
    ap.add_argument("--windows", type=int, default=1, help="consecutive windows of the text")
    ap.add_argument("--types", default=",".join(FTYPES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-baselines", action="store_true",
                    help="rows for --types only, without our F32 and the published Q4_1")
    ap.add_argument("--out", default=str(ROOT / "bench/results/fidelity.json"))
    ap.add_argument("--table", metavar="JSON", help="print the table of an earlier run's JSON")
    ap.add_argument("--file", help="a GGUF to read against the NumPy forward pass of its weights")
    args = ap.parse_args()
    if args.table:
        r = json.loads(Path(args.table).read_text())
        print(file_table(r) if "vs_truth" in r else table(r["rows"], r["tokens"], r["text"],
                                                             r["cpu"]))
        return
    if args.file:
        quiet_llama_cpp()
        r = file_against_truth(Path(args.file), Path(args.text).read_text("utf-8"),
                               args.tokens, args.threads)
        r.update(cpu=cpu_name(), text=Path(args.text).name, tokens=args.tokens,
                 date=time.strftime("%Y-%m-%d"))
        print(file_table(r))
        Path(args.out).write_text(json.dumps(r, indent=1) + "\n")
        return

    quiet_llama_cpp()
    paths = files(cache_dir() / "bench" / "fidelity", args.types.split(","))
    tok = edgellama.load(paths["F32"], ctx=args.tokens + 8).tokenizer
    text_ids = tok.encode(Path(args.text).read_text("utf-8"))
    n = args.tokens - 1
    windows = [[tok.bos_id] + text_ids[w * n:(w + 1) * n] for w in range(args.windows)]
    if len(windows[-1]) < args.tokens:
        sys.exit(f"{args.text} has {len(text_ids)} tokens: too few for {args.windows} windows "
                 f"of {args.tokens}")
    refs = [log_softmax(llama_cpp_logits(paths["F32"], ids, args.threads)) for ids in windows]
    rows = []
    for label, path in paths.items():
        if args.no_baselines and label in BASELINES:
            continue
        t0 = time.perf_counter()
        per = []
        for ids, ref_lp in zip(windows, refs):
            w = {"llama_cpp": compare(ref_lp, llama_cpp_logits(path, ids, args.threads))}
            for mode in ACTIVATIONS:
                prefill, decode = our_logits(path, ids, args.threads, mode)
                w[mode] = {"prefill": compare(ref_lp, prefill), "decode": compare(ref_lp, decode)}
            per.append(w)
        row = {"file": label, "llama_cpp": mean_of([w["llama_cpp"] for w in per])}
        for mode in ACTIVATIONS:
            row[mode] = {p: mean_of([w[mode][p] for w in per]) for p in ("prefill", "decode")}
        if len(per) > 1:
            row["windows"] = per
        rows.append(row)
        print(f"{label}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)

    tokens = len(windows) * args.tokens
    print(table(rows, tokens, Path(args.text).name, cpu_name()))
    Path(args.out).write_text(json.dumps({"cpu": cpu_name(), "text": Path(args.text).name,
                                          "tokens": tokens, "windows": len(windows),
                                          "date": time.strftime("%Y-%m-%d"),
                                          "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
