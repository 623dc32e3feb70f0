"""`generate --ignore-eos` (llama.cpp's flag): the reply goes on past the model's end of
generation to --max-tokens, the same tokens up to where it would have stopped."""
from __future__ import annotations

import os
import shutil
import subprocess

EXE = shutil.which("edgellama")
ENV = dict(os.environ, NUMBA_NUM_THREADS="2")


def run(model, *args) -> tuple[str, str]:
    res = subprocess.run([EXE, "generate", "-m", str(model), "--temp", "0", *map(str, args)],
                         capture_output=True, env=ENV, timeout=300, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stderr
    return res.stdout.decode(), res.stderr.decode().rsplit("generation: ", 1)[1]


def test_the_reply_goes_past_the_end_of_generation(smollm2_gguf):
    ask = ["-p", "What is the capital of France? Answer in one sentence.", "-n", "60"]
    short, stats = run(smollm2_gguf, *ask)
    n = int(stats.split()[0])
    assert n < 60 and "(stop" in stats, stats            # the model ends its turn
    longer, stats = run(smollm2_gguf, *ask, "--ignore-eos")
    assert stats.startswith("60 tokens") and "(length" in stats, stats
    assert longer.startswith(short) and len(longer) > len(short)
