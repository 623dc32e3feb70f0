"""Sixteen threads give the bits one thread gives: a small model's prompt and reply
logits, in a process with 16 Numba threads (on a small machine they share its cores: the
same work split, claimed and merged as on a 16-core desktop), for weight types of each
kernel family and each cache type. Work is split by thread count in the prefill
products, claimed tile by tile in the decode products and split by depth in attention;
none of it may change a result."""
import json
import os
import subprocess
import sys

from tiny_gguf import write_tiny_gguf

THREADS = 16
CASES = [("Q4_0", "f16"), ("Q4_K", "q8_0"), ("Q6_K", "q4_0"), ("Q8_0", "f16"), ("F16", "q8_0")]
CHILD = r"""
import json, sys
import numpy as np
import numba
from edgellama.gguf import GGUFFile
from edgellama.model import Transformer
from edgellama.machine import ThreadPolicy
assert numba.config.NUMBA_NUM_THREADS == %d
for path, type_k in json.loads(sys.argv[1]):
    runs = []
    for threads in (1, %d):
        m = Transformer(GGUFFile(path), 2048, threads=ThreadPolicy(threads), cache_type_k=type_k,
                        cache_type_v=type_k)
        seq = m.new_sequence()
        rng = np.random.default_rng(3)
        prompt = rng.integers(0, m.args.vocab_size, 1100)   # past 1024: a reply's attention splits
        logits = [m.forward(prompt, seq, all_logits=True)[-4:].copy()]
        for t in rng.integers(0, m.args.vocab_size, 3):
            logits.append(m.decode([seq], [int(t)])[0].copy())
        assert numba.get_num_threads() == threads
        runs.append(np.concatenate([np.atleast_2d(x) for x in logits]))
    print(json.dumps([path, bool(np.array_equal(runs[0], runs[1])),
                      float(np.abs(runs[0] - runs[1]).max()), bool(np.isfinite(runs[0]).all())]))
""" % (THREADS, THREADS)


def test_sixteen_threads_give_one_threads_bits(tmp_path):
    files = []
    for qtype, type_k in CASES:
        # dims of several tiles a matrix, so 16 threads each get some
        path = write_tiny_gguf(tmp_path / f"{qtype}.gguf", qtype, dim=256, layers=2, heads=8,
                               kv_heads=2, ffn=768, vocab=2048, ctx=2048)
        files.append((str(path), type_k))
    env = dict(os.environ, NUMBA_NUM_THREADS=str(THREADS))
    res = subprocess.run([sys.executable, "-c", CHILD, json.dumps(files)], env=env,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    results = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("[")]
    assert len(results) == len(CASES)
    for (qtype, type_k), (_, same, diff, finite) in zip(CASES, results):
        assert finite, qtype
        assert same, f"{qtype} weights, {type_k} cache: 16 threads differ from 1 by up to {diff}"
