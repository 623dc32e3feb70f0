"""The server's spill of evicted conversations (`serve --slot-save-path`): time to first
token of two long conversations taking turns in one slot, with and without it.

    python bench/bench_slot_spill.py [--model GGUF] [--tokens 1536] [--turn 64]
                                     [--turns 4] [--ctx 4096] [--json OUT]

One slot (--parallel 1), this process's Engine (edgellama/server/engine.py), real weights
(SmolLM2 by default). Conversations A and B are two parts of bench/data/alice.txt of
--tokens tokens; each turn adds the next --turn tokens of its text, and the requests
alternate A, B, A, B, ... (max_tokens 1), so each one evicts the other conversation.
Without spill every request reads its whole prompt again; with it (a temporary folder as
DIR, on this machine's disk) the evicted cache is written to a file and the next turn of
its conversation loads it and reads only the new tokens. Time to first token: from
submitting the request to its first event, the first turn of each (a plain read in both
runs) left out.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))   # this checkout's edgellama

import edgellama  # noqa: E402
from edgellama.machine import cpu_name  # noqa: E402
from edgellama.sampling import SamplingParams  # noqa: E402
from edgellama.server.engine import Engine  # noqa: E402
from edgellama.server.job import Job  # noqa: E402
from edgellama.server.params import Params  # noqa: E402
from edgellama.slot_files import SlotFiles  # noqa: E402

DEFAULT_MODEL = Path("~/.cache/edgellama/SmolLM2-135M-Instruct.Q4_1.gguf").expanduser()


def conversations(llm, tokens: int, turn: int, turns: int) -> list[tuple[str, list[int]]]:
    """(name, prompt ids) of each request, in order."""
    ids = llm.tokenizer.encode((ROOT / "bench/data/alice.txt").read_text())
    need = tokens + turn * (turns - 1)
    if 2 * need > len(ids):
        raise SystemExit(f"alice.txt has {len(ids)} tokens, fewer than two conversations of {need}")
    text = {"A": ids[:need], "B": ids[need:2 * need]}
    return [(name, text[name][:tokens + turn * k]) for k in range(turns) for name in "AB"]


async def run(llm, requests, files: SlotFiles | None) -> list[float]:
    engine = Engine(llm, 4, 1, files=files)
    out = []
    try:
        for _, ids in requests:
            job = Job(ids, 1, Params(False, False, 1, SamplingParams(temperature=0), []))
            t0 = time.perf_counter()
            engine.submit(job)
            await job.events.get()
            out.append(time.perf_counter() - t0)
            while (await job.events.get())[0] == "text":
                pass
    finally:
        engine.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--tokens", type=int, default=1536, help="each conversation's first prompt")
    ap.add_argument("--turn", type=int, default=64, help="tokens each later turn adds")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    llm = edgellama.load(str(a.model), ctx=a.ctx)
    requests = conversations(llm, a.tokens, a.turn, a.turns)
    asyncio.run(run(llm, requests[:1], None))             # kernels compiled, pages mapped
    with tempfile.TemporaryDirectory() as folder:
        files = SlotFiles(folder, spill_max=1 << 30)
        load0 = os.getloadavg()
        plain = asyncio.run(run(llm, requests, None))
        spill = asyncio.run(run(llm, requests, files))
        load1 = os.getloadavg()
        spilled = files.spilled_bytes
    later = slice(2, None)
    res = {
        "model": a.model.name, "machine": cpu_name(),
        "cores": os.cpu_count(), "ctx": a.ctx, "tokens": a.tokens, "turn": a.turn,
        "turns": a.turns, "load_average_before": load0[0], "load_average_after": load1[0],
        "ttft_plain_s": plain, "ttft_spill_s": spill,
        "median_ttft_plain_s": statistics.median(plain[later]),
        "median_ttft_spill_s": statistics.median(spill[later]),
        "spill_files_bytes_at_end": spilled,
    }
    res["speedup"] = res["median_ttft_plain_s"] / res["median_ttft_spill_s"]
    print(f"{a.model.name}: two conversations of {a.tokens}+{a.turn}/turn tokens in one slot, "
          f"{a.turns} turns each; time to first token after the first turns, median: "
          f"{res['median_ttft_plain_s'] * 1e3:.0f} ms reading again, "
          f"{res['median_ttft_spill_s'] * 1e3:.0f} ms with spill ({res['speedup']:.1f}x); "
          f"load average {load0[0]:.2f} -> {load1[0]:.2f}")
    if a.json:
        a.json.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
