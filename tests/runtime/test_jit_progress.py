"""Warm-up: the kernels the forward pass needs are found without running them (for every
weight type), those the cache lacks are compiled in helper processes where there are
cores for them, each is then loaded (or compiled) in turn with its number shown, and the
forward pass then compiles nothing more."""
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edgellama.cli.progress import KernelProgress
from numba.core.dispatcher import Dispatcher
from tiny_gguf import write_tiny_gguf

import edgellama
from edgellama.kernels import jit
from edgellama.kernels import rows as K


def test_dry_run_finds_the_kernels_and_warm_up_leaves_nothing_to_compile(tmp_path):
    llm = edgellama.load(write_tiny_gguf(tmp_path / "t.gguf", "Q4_1", ctx=256, vocab=512, tokenizer=True), ctx=64)
    with jit.Compiling() as watch:
        calls = jit.kernels_called(llm.model)
    assert watch.count == 0                       # nothing compiled or ran
    assert isinstance(K.rmsnorm, Dispatcher)      # the kernels are back in their modules
    names = [d.py_func.__name__ for d, _ in calls]
    # attention: its work items' loop and the item it calls by address (kernels/items.py)
    assert {"rmsnorm", "rope", "_attention_items", "_attention_item", "swiglu", "matvec"} <= set(names)
    # and a long prefill's own kernels: its rows in parallel, its K/V stores in parallel
    assert {"rmsnorm_rows", "rope_rows", "swiglu_rows", "add_rows", "store_f16_k"} <= set(names)
    assert len(calls) == len(set(calls))
    shown = []
    warm = jit.warm_up(llm.model, lambda n, total, name: shown.append((n, total, name)))
    assert all(total == len(calls) for _, total, _ in shown)     # compiles, if any, numbered
    steps = [n for n, _, _ in shown]          # in turn, or as helper processes take them
    assert steps == sorted(steps) and set(steps) <= set(range(1, len(calls) + 1))
    # compiles shown, and the listed kernels another compiled as its callee counted too
    assert bool(shown) == bool(warm.compiled) and warm.compiled <= len(calls)
    assert warm.seconds >= warm.compile_seconds
    assert all(sig in d.overloads for d, sig in calls)
    assert llm.seq.pos == 0
    with jit.Compiling() as watch:
        llm.model.forward([1, 2, 3], llm.seq)
        llm.model.forward(list(range(5, 5 + K.PARALLEL_ROWS)), llm.seq)
        llm.model.forward([4], llm.seq)
    assert watch.count == 0


def test_a_model_compiles_the_product_kernels_of_its_own_types_alone(tmp_path):
    # the products' kernels are made per type (a constant of their code), held in dicts:
    # the dry run finds them there, puts them back, and lists only the file's type
    from edgellama.formats import iq4, q4_k, q6_k, records
    from edgellama.kernels.simd import KIND_Q4_1
    per_type = [records.MATVEC_BLOCKS, records.MATMUL_BLOCKS, q4_k.MATVEC_K, q4_k.MATMUL_K,
                q6_k.MATVEC_K16, q6_k.MATMUL_K16, {"xs": iq4.matvec_xs}, {"xs": iq4.matmul_xs}]
    every = {d: kind for kernels in per_type for kind, d in kernels.items()}
    assert all(isinstance(d, Dispatcher) for d in every) and len(every) == 2 * (6 + 2 + 3 + 1)
    llm = edgellama.load(write_tiny_gguf(tmp_path / "t.gguf", "Q4_1", ctx=256, vocab=512, tokenizer=True), ctx=64)
    with jit.Compiling() as watch:
        calls = jit.kernels_called(llm.model)
    assert watch.count == 0
    assert {every[d] for d, _ in calls if d in every} == {KIND_Q4_1}
    assert {d.py_func.__name__ for d, _ in calls if d in every} == {"matvec", "matmul"}
    assert {d for kernels in per_type for d in kernels.values()} == set(every)   # put back


def test_the_dry_run_reaches_every_threshold_of_a_long_prefill():
    from edgellama import kv_cache
    from edgellama.formats import records
    assert jit.DRY_RUN_ROWS >= max(K.PARALLEL_ROWS, kv_cache._PARALLEL_STORE, records.AMX_MIN_ROWS)


def test_a_listed_kernel_compiled_as_another_ones_callee_counts_once():
    # on an empty cache warm_up's steps ran 1/19 .. 19/19 and then said "Compiled 16
    # kernels": prep_q8_x and the K/V head stores compile inside their callers' compiles
    from types import SimpleNamespace as NS
    import numba

    class Kernel:                                 # what the listener reads of a Dispatcher
        def __init__(self, name):
            self.py_func = NS(__module__="edgellama.x", __name__=name)
    caller, callee = Kernel("caller"), Kernel("callee")
    sig = (numba.int64,)
    watch = jit.Compiling()
    watch.listed = {(caller, sig), (callee, sig)}
    event = lambda d, args: NS(data={"dispatcher": d, "args": args})
    watch.on_start(event(caller, sig))
    watch.on_start(event(callee, sig))            # compiled inside the caller's compile
    watch.on_start(event(callee, (numba.float64,)))   # a signature not listed: not one of them
    for d in (callee, callee, caller):
        watch.on_end(event(d, sig))
    assert watch.count == 2 and watch._depth == 0


def test_kernel_progress_off_a_terminal_is_two_lines():
    err = io.StringIO()
    p = KernelProgress(err)
    p(1, 3, "rope")
    p(2, 3, "attention")
    p.done(3, 12.4)
    assert err.getvalue() == ("Compiling kernels (once; cached for later runs)...\n"
                              "Compiled 3 kernels in 12 s; cached for next time\n")
    quiet = io.StringIO()
    KernelProgress(quiet).done(0, 0.0)            # all from the cache: nothing said
    assert quiet.getvalue() == ""


def test_kernel_progress_names_kernels_without_a_leading_underscore():
    p = KernelProgress(io.StringIO())
    p(2, 21, "_attention_item")
    assert p.step.endswith(": 2/21 attention_item")
    p.done(21, 1.0)


def test_warm_up_without_the_dry_run_still_compiles_both_paths(tmp_path, monkeypatch):
    llm = edgellama.load(write_tiny_gguf(tmp_path / "t.gguf", "Q8_0", ctx=256, vocab=512,
                                         tokenizer=True), ctx=64)

    def fails(model):
        raise TypeError("a kernel called with keywords")
    monkeypatch.setattr(jit, "kernels_called", fails)
    shown = []
    jit.warm_up(llm.model, lambda n, total, name: shown.append(total))
    assert set(shown) <= {None}                   # numbered without a total, if any compiled
    assert llm.seq.pos == 0
    with jit.Compiling() as watch:
        llm.model.forward([1, 2, 3], llm.seq)
        llm.model.forward(list(range(5, 5 + K.PARALLEL_ROWS)), llm.seq)
        llm.model.forward([4], llm.seq)
    assert watch.count == 0


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "IQ4_XS",
                                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16"])
def test_the_dry_run_runs_for_every_weight_type(tmp_path, qtype):
    # no Python between the kernels may use what a kernel returns (the recorders return
    # nothing): a Q5_K, Q6_K or Q3_K prefill's values tile once asked a kernel for its
    # size, and warm-up fell back to running every path without a total
    llm = edgellama.load(write_tiny_gguf(tmp_path / "t.gguf", qtype, dim=256, ffn=256, ctx=256,
                                         vocab=512, tokenizer=True), ctx=64)
    names = {d.py_func.__name__ for d, _ in jit.kernels_called(llm.model)}   # raised, before
    assert {"_attention_items", "_attention_item"} <= names


# Run in a fresh process with an empty kernel cache: the helper processes compile a few
# small kernels of a tiny model, and this process then finds every one of them cached.
HELPERS = """
import json, sys
import edgellama
from edgellama.kernels import jit
llm = edgellama.load(sys.argv[1], ctx=64)
todo = [(d, s) for d, s in jit.kernels_called(llm.model)
        if d.py_func.__name__ in ("rmsnorm", "rope", "swiglu", "add_inplace")]
missing = sum(not jit._cached(d, s) for d, s in todo)
shown = []
compiled, seconds = jit.compile_in_processes(todo, lambda n, total, name: shown.append((n, total, name)), len(todo))
with jit.Compiling() as watch:
    for d, s in todo:
        d.compile(s)
print(json.dumps({"todo": len(todo), "missing": missing, "compiled": compiled,
                  "here": watch.count, "shown": shown}))
"""


def test_helper_processes_fill_the_kernel_cache_this_process_loads(tmp_path):
    path = write_tiny_gguf(tmp_path / "t.gguf", "Q8_0", ctx=256, vocab=512, tokenizer=True)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["EDGELLAMA_CACHE"] = str(tmp_path / "cache")
    res = subprocess.run([sys.executable, "-c", HELPERS, str(path)], capture_output=True,
                         text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.splitlines()[-1])
    n = out["todo"]
    assert n == out["missing"] >= 4                 # rope: a signature for each path
    if len(os.sched_getaffinity(0)) < 2:          # one core: nothing to gain, none started
        assert out["compiled"] == 0 and out["here"] == n
        return
    assert out["compiled"] == n and out["here"] == 0
    assert max(k for k, _, _ in out["shown"]) == n and {t for _, t, _ in out["shown"]} == {n}


def test_a_helper_that_dies_leaves_its_kernels_to_this_process(monkeypatch):
    # helpers that exit at once (here: not Python at all) compile nothing, and the call
    # returns rather than waiting on them; warm_up's own pass then compiles the kernels
    monkeypatch.setattr(jit, "_cached", lambda d, s: False)
    monkeypatch.setattr(jit.sys, "executable", "/bin/false")
    monkeypatch.setattr(jit.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    popen, started = subprocess.Popen, []
    monkeypatch.setattr(subprocess, "Popen",
                        lambda *a, **k: started.append((k, popen(*a, **k))) or started[-1][1])
    assert jit.compile_in_processes(_some_kernels())[0] == 0
    assert len(started) == 2                        # two groups: two helpers were tried
    # each imports this copy of the package, wherever it came from
    root = Path(edgellama.__file__).resolve().parent.parent
    assert all(Path(k["env"]["PYTHONPATH"].split(os.pathsep)[0]) == root for k, _ in started)
    # and leaves no pipe open behind it (an unclosed one warns when it is collected)
    assert all(p.stdin.closed and p.stdout.closed and p.returncode is not None for _, p in started)


def _some_kernels():
    import numpy as np
    import numba
    x = numba.typeof(np.ones((2, 8), np.float32))
    w = numba.typeof(np.ones(8, np.float32))
    return [(K.rmsnorm_rows, (x, w, numba.float32, x)), (K.swiglu_rows, (x, x, x))]


def test_one_thread_asked_for_starts_no_helper(monkeypatch):
    # `-t 1` (the model's thread count, which warm_up passes) keeps the compile on one core
    monkeypatch.setattr(jit, "_cached", lambda d, s: False)
    monkeypatch.setattr(jit.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    started = []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: started.append(a))
    assert jit.compile_in_processes(_some_kernels(), cores=1) == (0, 0.0) and started == []


def test_ctrl_c_while_helpers_compile_stops_them_at_once(monkeypatch, tmp_path):
    # helpers that would take a minute (here: a script that sleeps, whatever it is sent):
    # Ctrl-C in the parent (raised by the progress callback) ends the call at once, with
    # every helper killed, not waited for
    import time
    sleeper = tmp_path / "helper"
    sleeper.write_text("#!/bin/sh\nsleep 60\n")
    sleeper.chmod(0o755)
    monkeypatch.setattr(jit, "_cached", lambda d, s: False)
    monkeypatch.setattr(jit.sys, "executable", str(sleeper))
    monkeypatch.setattr(jit.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    popen, procs = subprocess.Popen, []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: procs.append(popen(*a, **k)) or procs[-1])

    def interrupt(n, total, name):
        raise KeyboardInterrupt
    t0 = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        jit.compile_in_processes(_some_kernels(), interrupt)
    assert time.perf_counter() - t0 < 30 and len(procs) == 2
    assert all(p.poll() is not None for p in procs)
