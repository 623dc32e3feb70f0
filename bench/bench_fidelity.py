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
FTYPES = {"q4_0": 2, "q4_1": 3, "q8_0": 7, "q5_0": 8, "q5_1": 9, "q2_k": 10, "q3_k_m": 12,
          "q4_k_m": 15, "q5_k_m": 17, "q6_k": 18, "iq4_nl": 25, "iq4_xs": 30}


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
    args = ap.parse_args()
    if args.table:
        r = json.loads(Path(args.table).read_text())
        print(table(r["rows"], r["tokens"], r["text"], r["cpu"]))
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
