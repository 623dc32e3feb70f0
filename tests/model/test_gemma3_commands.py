"""The commands on the real Gemma 3 270M Q4_K_M (llama.cpp's quantization, a base model:
no chat template in the file, so chat and serve use the built-in Gemma template):
perplexity on llama-perplexity's chunks against llama.cpp's, generate past the sliding
window with --ignore-eos, bench, a served completion against llama.cpp's greedy tokens,
and chat from piped stdin against generate."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

EXE = shutil.which("edgellama")
ENV = dict(os.environ, NUMBA_NUM_THREADS="2")
TEXT = Path(__file__).parents[2] / "bench" / "data" / "alice.txt"
LLAMA_CPP = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                               reason="llama-cpp-python not installed (pip install -e '.[oracle]')")


def run(*args, input: bytes | None = None) -> subprocess.CompletedProcess:
    stdin = {"input": input} if input is not None else {"stdin": subprocess.DEVNULL}
    res = subprocess.run([EXE, *map(str, args)], capture_output=True, env=ENV, timeout=600,
                         **stdin)
    assert res.returncode == 0, res.stderr.decode()
    return res


@pytest.mark.slow
@LLAMA_CPP
def test_perplexity_is_llama_cpps_on_the_same_chunks(gemma_q4_k_m_gguf):
    # llama-perplexity's loop on llama.cpp's logits: each chunk of 512 from an empty cache,
    # BOS first, positions 256..510 scored; ours within 1% (measured 0.3%)
    import llama_cpp

    from edgellama import perplexity as P
    out = json.loads(run("perplexity", "-m", gemma_q4_k_m_gguf, "-f", TEXT, "-c", 512,
                         "--chunks", 3, "--json").stdout)
    L = llama_cpp.Llama(model_path=str(gemma_q4_k_m_gguf), n_ctx=512, n_batch=512,
                        logits_all=True, verbose=False, n_threads=2)
    toks = L.tokenize(TEXT.read_text().encode(), add_bos=True)
    nll = []
    for chunk in P.make_chunks(toks, 512, 3, bos_id=L.token_bos()):
        L.reset()
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(L.ctx), True)   # an empty cache
        L.eval(list(chunk))
        lp = P.log_softmax(np.array(L.scores[:511], np.float32))
        nll += [-lp[j, chunk[j + 1]] for j in range(256, 511)]
    theirs = math.exp(np.mean(nll))
    assert out["tokens_scored"] == len(nll) == 3 * 255
    assert abs(out["ppl"] / theirs - 1) < 0.01, (out["ppl"], theirs)


@pytest.mark.slow
def test_generate_past_the_window_with_ignore_eos(gemma_q4_k_m_gguf):
    # 700 prompt tokens and 400 more: past the ring of 1,024 positions (window 512 + a
    # prefill run of 512), so the local layers' cache has wrapped while decoding
    prompt = TEXT.read_text()[:3000]
    res = run("generate", "-m", gemma_q4_k_m_gguf, "-p", prompt, "--raw", "--temp", "0",
              "--ctx", 1400, "-n", 400, "--ignore-eos")
    err = res.stderr.decode()
    n_prompt = int(err.rsplit("prompt: ", 1)[1].split()[0])
    assert n_prompt + 400 > 1024, err
    assert "generation: 400 tokens" in err and "(length" in err, err
    assert len(res.stdout.decode()) > len(prompt) + 400


@pytest.mark.slow
def test_bench_runs_on_the_file(gemma_q4_k_m_gguf):
    r = json.loads(run("bench", "-m", gemma_q4_k_m_gguf, "-p", 32, "-n", 4, "-t", 2,
                       "--json").stdout)
    m = r["memory"]
    # 3 global layers at ctx 8,192 and 15 local ones at their ring of 1,024: 1 KiB a
    # layer and position (1 KV head of 256, K and V in f16)
    assert m["kv_cache"] == (3 * 8192 + 15 * 1024) * 1024
    assert r["speed"]["pp_tps"] > 0 and r["speed"]["tg_tps"] > 0


@pytest.mark.slow
@LLAMA_CPP
def test_a_served_completion_is_llama_cpps_greedy_reply(gemma_q4_k_m_gguf):
    import llama_cpp
    from server_asgi import ServerUnderTest
    prompt = "The capital of France is"
    L = llama_cpp.Llama(model_path=str(gemma_q4_k_m_gguf), n_ctx=64, verbose=False, n_threads=2)
    want = []
    for t in L.generate(L.tokenize(prompt.encode(), add_bos=True), temp=0, top_k=1):
        want.append(t)
        if len(want) == 8:
            break
    want = L.detokenize(want).decode()
    app = ServerUnderTest(gemma_q4_k_m_gguf)
    try:
        r = app.request("POST", "/v1/completions", {"prompt": prompt, "max_tokens": 8,
                                                    "temperature": 0}, timeout=300)
        assert r.status == 200, r.body
        assert r.json()["choices"][0]["text"] == want
    finally:
        app.close()


@pytest.mark.slow
def test_chat_from_piped_stdin_replies_as_generate_does(gemma_q4_k_m_gguf):
    # the built-in Gemma template in both: the same greedy reply to the same message
    ask = "What is the capital of France?"
    chat = run("chat", "-m", gemma_q4_k_m_gguf, "--temp", "0", "-n", 12,
               input=(ask + "\n").encode()).stdout.decode()
    gen = run("generate", "-m", gemma_q4_k_m_gguf, "-p", ask, "--temp", "0", "-n", 12)
    reply = gen.stdout.decode().strip()
    assert reply and reply in chat, (reply, chat)
