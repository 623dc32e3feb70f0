"""`edgellama serve` under load: 1 streaming client, then several at once, against 127.0.0.1.

    python bench/bench_server_load.py [--shape llama-3.2-1b] [--type q4_k] [--clients 1,4]
                                      [--requests 3] [--prompt 32] [--max-tokens 48]
                                      [--rounds 1] [--threads N] [--time-limit 900]
                                      [--json OUT] [--table OUT]

One server process (`edgellama serve --parallel <most clients>`, this checkout's) on a
random-weight file with the real shapes (edgellama.benchmark's shape files, given a
synthetic byte-level tokenizer by bench_llamacpp.with_tokenizer: one token a byte of
prompt). For each client count, that many threads each send `--requests` streamed
completions one after another, each with a prompt of its own (`--prompt` random letters,
so no request reuses another's cache) and a fixed max_tokens (random weights rarely
emit the end token; it ends a request early where they do, and the counts say so).
Client i starts i/c of a single client's request time after the first, as independent
users would, rather than all in the same instant.

Per request: time to first token (from sending the request to the first streamed text)
and decode tokens/s (tokens after the first over the time from the first to the end).
Per client count: each client's median time to first token, its decode tokens/s, and the
aggregate decode tokens/s (the sum of the clients' rates: what the server delivers while
they all run); fairness is the slowest client's decode rate over the fastest's. With
--rounds R the counts run in turn R times and the table shows medians. It compares each
count with the first (one client): the targets of issue 27 are an aggregate of at least
2.5x and every client's time to first token at most 2x one client's.

Speculative decoding (`--speculative lookup` or `--speculative DRAFT.gguf`): two servers
run side by side, one plain and one with `--lookup` / `--draft DRAFT.gguf`, and each
client count runs against the plain one, then the other, in every round (the idle
server takes no CPU). Meant with `--model` (a real GGUF and its tokenizer) and
`--summarise` (each request asks, in the chat endpoint, for a summary of the same
paragraph, edgellama.benchmark.SUMMARISE, behind a line of its own so that no request
reuses another's cache): a reply that repeats its input, where lookup pays. The table
compares the aggregate decode rate and the throughput (all tokens over the wall time)
with and without, and the proposals accepted (usage.completion_tokens_details).

    python bench/bench_server_load.py --model ~/.cache/edgellama/SmolLM2-135M-Instruct.Q4_1.gguf \
        --summarise --speculative lookup --clients 1,4 --rounds 3 --max-tokens 96

Bounded: `--requests` per client, and no request starts after `--time-limit` seconds.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))   # this checkout's edgellama
from edgellama.benchmark import SUMMARISE  # noqa: E402


def start_server(path: str, parallel: int, ctx: int, threads: int | None, log: Path,
                 extra: tuple[str, ...] = ()):
    """The serve command on a free port; (process, host, port) once it listens."""
    # the command line's own entry (cli.main has no __main__ block for `python -m`)
    cmd = [sys.executable, "-c", "from edgellama.cli.main import main; main()", "serve",
           "-m", path, "--port", "0",
           "--ctx", str(ctx), "--parallel", str(parallel), "--queue", "16", *extra]
    if threads:
        cmd += ["-t", str(threads)]
    # this checkout first, then the caller's own path (none added if it has none: an empty
    # entry would put the current directory on the server's path)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    err = open(log, "wb")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env)
    deadline = time.monotonic() + 900   # a first run compiles kernels and writes tiles
    while not (m := re.search(r"on http://([\d.]+):(\d+)/v1", log.read_text(errors="replace"))):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            sys.exit(f"the server did not start:\n{log.read_text(errors='replace')}")
        time.sleep(0.2)
    return proc, m.group(1), int(m.group(2))


def stream_completion(host: str, port: int, prompt: str, max_tokens: int,
                      chat: bool = False) -> dict:
    """One streamed completion (chat: of a user message): when it was sent, when its
    first text came, when it ended, the tokens it generated and, with speculative
    decoding, the proposals accepted and rejected."""
    body = json.dumps({("messages" if chat else "prompt"):
                       [{"role": "user", "content": prompt}] if chat else prompt,
                       "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection(host, port, timeout=600)
    t0 = time.monotonic()
    first = None
    tokens = 0
    details = {}
    text = []
    try:
        conn.request("POST", "/v1/chat/completions" if chat else "/v1/completions", body=body,
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
        for line in r:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            choice = event["choices"][0] if event.get("choices") else {}
            piece = choice.get("text") or choice.get("delta", {}).get("content")
            if piece:
                text.append(piece)
                first = first or time.monotonic()
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
                details = event["usage"].get("completion_tokens_details", {})
    finally:
        conn.close()
    end = time.monotonic()
    return {"sent": t0, "first": first, "end": end, "tokens": tokens, "text": "".join(text),
            "accepted": details.get("accepted_prediction_tokens", 0),
            "rejected": details.get("rejected_prediction_tokens", 0),
            "ttft_s": (first or end) - t0,
            "decode_tok_s": (tokens - 1) / (end - first) if first and tokens > 1 else None}


def run_clients(host: str, port: int, clients: int, a, offset: float, deadline: float,
                seed: int) -> list[list[dict]]:
    """`clients` threads, each `a.requests` completions in turn; client i starts i·offset s
    after the first. Returns each client's requests."""
    results: list[list[dict]] = [[] for _ in range(clients)]
    errors: list[str] = []

    def client(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        time.sleep(i * offset)
        for n in range(a.requests):
            if time.monotonic() > deadline:
                return
            if a.summarise:
                prompt = f"Request {seed}.{i}.{n}.\n{SUMMARISE}"
            else:
                prompt = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(a.prompt))
            try:
                results[i].append(stream_completion(host, port, prompt, a.max_tokens,
                                                    chat=a.summarise))
            except Exception as e:  # noqa: BLE001 - reported, the run goes on
                errors.append(f"client {i}: {e}")
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        sys.exit("requests failed:\n" + "\n".join(errors[:5]))
    return results


def summarize(clients: int, results: list[list[dict]]) -> dict:
    per_client = []
    for reqs in results:
        rates = [r["decode_tok_s"] for r in reqs if r["decode_tok_s"]]
        per_client.append({
            "requests": len(reqs), "tokens": sum(r["tokens"] for r in reqs),
            "ttft_s": statistics.median(r["ttft_s"] for r in reqs),
            "ttft_max_s": max(r["ttft_s"] for r in reqs),
            "decode_tok_s": statistics.median(rates) if rates else 0.0})
    rates = [c["decode_tok_s"] for c in per_client]
    start = min(r["sent"] for reqs in results for r in reqs)
    end = max(r["end"] for reqs in results for r in reqs)
    return {"clients": clients, "per_client": per_client,
            "accepted": sum(r["accepted"] for reqs in results for r in reqs),
            "rejected": sum(r["rejected"] for reqs in results for r in reqs),
            "aggregate_decode_tok_s": sum(rates),
            "throughput_tok_s": sum(c["tokens"] for c in per_client) / (end - start),
            "ttft_median_s": statistics.median(c["ttft_s"] for c in per_client),
            "ttft_worst_client_s": max(c["ttft_s"] for c in per_client),
            "fairness_min_over_max": min(rates) / max(rates) if max(rates) else 0.0,
            "seconds": end - start}


def medians(runs: list[dict]) -> list[dict]:
    """Per client count, over its rounds: the medians of the aggregate decode rate and of
    the worst client's time to first token, and the least fair round."""
    out = []
    for c in dict.fromkeys(r["clients"] for r in runs):
        rs = [r for r in runs if r["clients"] == c]
        out.append({"clients": c, "rounds": len(rs),
                    "aggregate_decode_tok_s": statistics.median(
                        r["aggregate_decode_tok_s"] for r in rs),
                    "ttft_median_s": statistics.median(r["ttft_median_s"] for r in rs),
                    "ttft_worst_client_s": statistics.median(r["ttft_worst_client_s"] for r in rs),
                    "throughput_tok_s": statistics.median(r["throughput_tok_s"] for r in rs),
                    "fairness_min_over_max": min(r["fairness_min_over_max"] for r in rs),
                    "tokens": sum(c["tokens"] for r in rs for c in r["per_client"]),
                    "accepted": sum(r["accepted"] for r in rs),
                    "rejected": sum(r["rejected"] for r in rs)})
    base = out[0]
    for m in out:
        m["aggregate_vs_first"] = m["aggregate_decode_tok_s"] / base["aggregate_decode_tok_s"]
        m["ttft_worst_vs_first"] = m["ttft_worst_client_s"] / base["ttft_worst_client_s"]
    return out


def table(res: dict) -> str:
    lines = [f"{res['file']}: {res['machine']}, {res['cores']} cores, server threads "
             f"{res['threads'] or 'automatic'}, --parallel {res['parallel']}, prompt "
             f"{res['prompt_tokens']} tokens, max_tokens {res['max_tokens']}, "
             f"{res['requests_per_client']} requests a client, medians of {res['rounds']} rounds",
             f"{'clients':>7} {'agg decode tok/s':>16} {'vs 1':>6} {'TTFT median':>11} "
             f"{'worst client':>12} {'vs 1':>6} {'fairness':>8} {'tokens':>6}"]
    for m in res["summary"]:
        lines.append(
            f"{m['clients']:>7} {m['aggregate_decode_tok_s']:>16.2f} "
            f"{m['aggregate_vs_first']:>5.2f}x {m['ttft_median_s']:>10.2f}s "
            f"{m['ttft_worst_client_s']:>11.2f}s {m['ttft_worst_vs_first']:>5.2f}x "
            f"{m['fairness_min_over_max']:>8.2f} {m['tokens']:>6}")
    return "\n".join(lines)


def speculative_table(res: dict) -> str:
    """Per client count: plain against speculative, aggregate decode and throughput."""
    how = res["speculative"]
    lines = [f"{res['file']}: {res['machine']}, {res['cores']} cores, --parallel "
             f"{res['parallel']}, {'summarise prompts' if res['summarise'] else 'random prompts'}"
             f", max_tokens {res['max_tokens']}, {res['requests_per_client']} requests a "
             f"client, medians of {res['rounds']} rounds; plain vs {how}; replies that "
             f"differ: {res['replies_differing']}",
             f"{'clients':>7} {'agg decode plain':>16} {how:>10} {'ratio':>6} "
             f"{'throughput plain':>16} {how:>10} {'ratio':>6} {'accepted/drafted':>16}"]
    for p, s in zip(res["modes"]["plain"], res["modes"][how]):
        drafted = s["accepted"] + s["rejected"]
        lines.append(
            f"{p['clients']:>7} {p['aggregate_decode_tok_s']:>16.2f} "
            f"{s['aggregate_decode_tok_s']:>10.2f} "
            f"{s['aggregate_decode_tok_s'] / p['aggregate_decode_tok_s']:>5.2f}x "
            f"{p['throughput_tok_s']:>16.2f} {s['throughput_tok_s']:>10.2f} "
            f"{s['throughput_tok_s'] / p['throughput_tok_s']:>5.2f}x "
            f"{s['accepted']:>7}/{drafted:<8}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--type", default="q4_k")
    ap.add_argument("--model", help="a GGUF with its tokenizer instead of --shape's file")
    ap.add_argument("--summarise", action="store_true",
                    help="chat requests to summarise a paragraph, not random letters")
    ap.add_argument("--speculative", metavar="lookup|DRAFT.gguf",
                    help="also a server with --lookup (or --draft DRAFT.gguf), compared")
    ap.add_argument("--clients", default="1,4", help="client counts, run in this order")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the counts in turn this many times (drift hits all alike)")
    ap.add_argument("--requests", type=int, default=3, help="requests per client")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens (letters)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=None, help="server threads (default: automatic)")
    ap.add_argument("--time-limit", type=float, default=900, help="no request starts after this")
    ap.add_argument("--json")
    ap.add_argument("--table", help="print the table of a saved JSON and exit")
    a = ap.parse_args()
    if a.table:
        res = json.loads(Path(a.table).read_text())
        print(speculative_table(res) if "speculative" in res else table(res))
        return

    sys.path.insert(0, str(ROOT / "bench"))
    from bench_llamacpp import with_tokenizer

    from edgellama.benchmark import shape_file
    from edgellama.machine import cpu_name

    counts = [int(v) for v in a.clients.split(",")]
    load_at_start = os.getloadavg()[0]
    path = a.model or with_tokenizer(str(shape_file(a.shape, a.type)))
    how = None
    modes = {"plain": ()}
    if a.speculative:
        how = "lookup" if a.speculative == "lookup" else "draft"
        modes[how] = ("--lookup",) if how == "lookup" else ("--draft", a.speculative)
    logs = Path(tempfile.mkdtemp(prefix="bench_server_load_"))
    servers = {}
    deadline = time.monotonic() + a.time_limit
    try:
        for mode, extra in modes.items():
            servers[mode] = start_server(path, max(counts), a.ctx, a.threads,
                                         logs / f"serve-{mode}.log", extra)
            stream_completion(*servers[mode][1:], "warm up", 4)   # kernels loaded, pages touched
        runs = {mode: [] for mode in modes}
        single, differ = None, 0
        for i, c in enumerate(counts * a.rounds):
            offset = single / c if single else 0.0
            texts = {}
            for mode, (_, host, port) in servers.items():
                results = run_clients(host, port, c, a, offset, deadline, seed=i)
                runs[mode].append(summarize(c, results))
                texts[mode] = [r["text"] for reqs in results for r in reqs]
                if single is None:   # one client's mean request time: the stagger of the rest
                    single = statistics.mean(r["end"] - r["sent"] for r in results[0])
                print(f"{mode}, {c} client(s): {runs[mode][-1]['aggregate_decode_tok_s']:.2f} "
                      f"decode tok/s, worst client TTFT "
                      f"{runs[mode][-1]['ttft_worst_client_s']:.2f} s", flush=True)
            if len(texts) == 2:   # greedy: the speculative server's replies are the plain one's
                differ += sum(x != y for x, y in zip(*texts.values()))
    finally:
        for proc, _, _ in servers.values():
            proc.terminate()
            proc.wait(30)
        print(f"server logs: {logs}")
    res = {"machine": cpu_name(), "cores": os.cpu_count(), "file": Path(path).name,
           "threads": a.threads, "parallel": max(counts), "summarise": a.summarise,
           "prompt_tokens": None if a.summarise else a.prompt,
           "max_tokens": a.max_tokens, "requests_per_client": a.requests,
           "rounds": a.rounds, "load_average_at_start": load_at_start,
           "load_average_at_end": os.getloadavg()[0]}
    if how:
        res.update(speculative=how, draft=None if how == "lookup" else Path(a.speculative).name,
                   replies_differing=differ,
                   modes={mode: medians(r) for mode, r in runs.items()}, runs=runs)
        print(speculative_table(res))
    else:
        res.update(summary=medians(runs["plain"]), runs=runs["plain"])
        print(table(res))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
