"""What each weight type costs SmolLM2-135M in quality: perplexity, KL divergence and
top-token agreement against its F32 conversion, on bench/data/alice.txt.

    python bench/quant_quality.py [--chunks 12] [--ctx 512] [--out bench/results/quant_quality.json]

The only weights we have are the published SmolLM2-135M-Instruct Q4_1 GGUF (the default
model). Its tensors are dequantized to an F32 Hugging Face checkpoint (tests/hf_fixtures.py,
as tests/convert/test_roundtrip.py does), and `edgellama convert` (quant.convert.convert, the code
behind the command) turns that checkpoint into F32 (the reference) and each type below.
So "F32" is the Q4_1 model at full precision, not the original bf16 training weights:
requantizing it to Q4_1 gives back nearly the published file, which flatters Q4_1's row.

All models are loaded at once and scored in one pass (evaluate(): per chunk the reference
runs once and every model is compared with it). JSON to --out, a markdown table on stdout.
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import edgellama  # noqa: E402
from edgellama import perplexity as ppl  # noqa: E402
from edgellama.default_model import cache_dir, default_model_path  # noqa: E402
from edgellama.quant.convert import convert  # noqa: E402
from hf_fixtures import gguf_to_hf_checkpoint  # noqa: E402

# (row label, --type, --embed-type; None = convert's default)
TYPES = [
    ("Q8_0", "q8_0", None),
    ("Q6_K", "q6_k", None),
    ("Q5_K_M", "q5_k_m", None),
    ("Q4_K_M", "q4_k_m", None),
    ("Q4_0 (Q8_0 embedding, default)", "q4_0", None),
    ("Q4_0 (Q4_0 embedding)", "q4_0", "q4_0"),
    ("Q4_1 (Q8_0 embedding, default)", "q4_1", None),
    ("Q3_K_M", "q3_k_m", None),
    ("Q2_K", "q2_k", None),
]


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines()
                    if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", default=str(ROOT / "bench/data/alice.txt"))
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=12)
    ap.add_argument("--out", default=str(ROOT / "bench/results/quant_quality.json"))
    args = ap.parse_args()

    original = default_model_path()
    text = Path(args.text).read_text("utf-8")
    with tempfile.TemporaryDirectory(prefix="quant-quality-", dir=cache_dir()) as tmp:
        tmp = Path(tmp)
        t0 = time.perf_counter()
        hf = gguf_to_hf_checkpoint(original, tmp / "hf", dtype="f32")
        rows = []
        for label, qtype, embed in [("F32 (reference)", "f32", None)] + TYPES:
            s = convert(hf, tmp / f"{len(rows)}-{qtype}.gguf", qtype=qtype, embed_type=embed)
            rows.append({"type": label, "qtype": qtype, "embed_type": embed,
                         "file": s.out_path, "file_mb": s.file_size / 1e6,
                         "bits_per_weight": s.bits_per_weight})
            print(f"converted {label}: {s.file_size / 1e6:.1f} MB, {s.bits_per_weight:.2f} bpw",
                  file=sys.stderr)
        convert_seconds = time.perf_counter() - t0

        llms = [edgellama.load(r["file"], ctx=args.ctx) for r in rows]
        ref, models = llms[0], llms[1:]
        tokens = ppl.tokenize(ref.tokenizer, text)
        bos = ref.tokenizer.bos_id if ref.tokenizer.add_bos else None
        chunks = ppl.make_chunks(tokens, args.ctx, args.chunks, bos, what=args.text)
        t0 = time.perf_counter()

        def progress(done, results):
            print(f"\rchunk {done}/{len(chunks)}, {(time.perf_counter() - t0) / done:.1f} s/chunk",
                  end="", file=sys.stderr, flush=True)

        results = ppl.evaluate([m.model for m in models], chunks, ref.model, progress)
        eval_seconds = time.perf_counter() - t0
        print(file=sys.stderr)

    for row in rows:
        row["file"] = Path(row["file"]).name
    r0 = results[0]   # every row carries the reference's own perplexity
    rows[0].update(ctx=r0.n_ctx, chunks=r0.chunks, tokens_scored=r0.count, ppl=r0.ref_ppl,
                   ppl_err=r0.ref_ppl_err)
    for row, res in zip(rows[1:], results):
        row.update(res.as_dict())
    report = {
        "model": f"SmolLM2-135M-Instruct, F32 from the published Q4_1 GGUF ({original.name})",
        "text": str(Path(args.text).relative_to(ROOT)) if Path(args.text).is_relative_to(ROOT)
        else args.text,
        "text_tokens": len(tokens), "ctx": args.ctx, "chunks": len(chunks),
        "tokens_scored": r0.count, "cpu": cpu_name(),
        "threads": ref.threads, "convert_seconds": convert_seconds,
        "eval_seconds": eval_seconds, "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))


def table(report: dict) -> str:
    lines = ["| type | file MB | bits/weight | PPL | PPL ratio | mean KL | 99% KL | same top token |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    r = report["rows"][0]
    lines.append(f"| {r['type']} | {r['file_mb']:.1f} | {r['bits_per_weight']:.2f} | "
                 f"{r['ppl']:.3f} ± {r['ppl_err']:.3f} | 1 | 0 | 0 | 100% |")
    for r in report["rows"][1:]:
        lines.append(
            f"| {r['type']} | {r['file_mb']:.1f} | {r['bits_per_weight']:.2f} | "
            f"{r['ppl']:.3f} ± {r['ppl_err']:.3f} | {r['ppl_ratio']:.4f} ± {r['ppl_ratio_err']:.4f} | "
            f"{r['kl_mean']:.5f} ± {r['kl_err']:.5f} | {r['kl_p99']:.4f} | "
            f"{100 * r['same_top']:.2f}% ± {100 * r['same_top_err']:.2f}% |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
