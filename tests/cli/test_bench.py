"""`edgellama bench` on a tiny model: the report's arithmetic and shape, not its speed."""
import json
import os
import re
import sys
from functools import partial

import pexpect
import pytest
from click.testing import CliRunner
from edgellama.cli.main import main
from tiny_gguf import write_tiny_gguf

import edgellama.benchmark as B
from edgellama.kernels.jit import kernel_cache_dir
from edgellama.kernels.membw import measure_read_bandwidth

TINY = B.Shape(dim=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=256, train_ctx=256)


def test_bench_json_report(tmp_path, monkeypatch):
    # a small buffer keeps the bandwidth probe quick; the figures are still measured
    monkeypatch.setattr(B, "measure_read_bandwidth", partial(measure_read_bandwidth, nbytes=64 << 20))
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "Q4_0", ctx=256)
    res = CliRunner().invoke(main, ["bench", "-m", str(path), "--ctx", "64", "-p", "16", "-n", "4",
                                    "-r", "2", "--full", "--json"])
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout)
    m, s = r["memory"], r["speed"]
    # KV: 2 × layers 2 × kv heads 2 × head dim 16 × ctx 64 × 2 bytes
    assert m["kv_cache"] == 2 * 2 * 2 * 16 * 64 * 2 and m["kv_per_token"] == m["kv_cache"] // 64
    assert m["predicted_total"] == m["weights"] + m["kv_cache"] + m["scratch"] + m["baseline"]
    assert m["rss_peak"] >= m["rss_after_load"] > 0
    assert r["depth"] == 64 - 4                        # the context filled, room left for -n
    for key in ("pp_tps", "tg_tps", "tg_depth_tps", "read_bandwidth_gbs", "numpy_matmul_gflops"):
        assert s[key] > 0, key
    assert s["decode_bytes_per_token_at_depth"] > s["decode_bytes_per_token"]
    assert s["tg_ceiling_ratio"] == s["tg_gbs"] / s["read_bandwidth_gbs"]


def test_bench_thread_sweep(tmp_path, monkeypatch):
    # -t as a list: one run per count, each the single-run object (with its threading
    # layer and the read ceiling measured at that count); the table has a row per count
    import numba
    monkeypatch.setattr(B, "measure_read_bandwidth", partial(measure_read_bandwidth, nbytes=64 << 20))
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "Q4_0", ctx=256)
    counts = sorted({1, numba.config.NUMBA_NUM_THREADS})
    base = ["bench", "-m", str(path), "--ctx", "64", "-p", "8", "-n", "2", "-t", ",".join(map(str, counts))]
    res = CliRunner().invoke(main, base + ["--json"])
    assert res.exit_code == 0, res.output
    reports = json.loads(res.stdout)
    assert [r["threads"] for r in reports] == counts
    for r in reports:
        assert r["threading_layer"] in ("omp", "tbb", "workqueue")
        s = r["speed"]
        assert s["read_bandwidth_gbs"] > 0
        assert s["tg_ceiling_ratio"] == pytest.approx(s["tg_gbs"] / s["read_bandwidth_gbs"])
    res = CliRunner().invoke(main, base)
    assert res.exit_code == 0, res.output
    rows = [line for line in res.stdout.splitlines() if re.match(r"\|\s+\d+ \|", line)]
    assert [int(row.split("|")[1]) for row in rows] == counts
    assert f"threading layer {reports[0]['threading_layer']}" in res.stdout


@pytest.mark.parametrize("bad", ["0", "1,x", "2,,4", "100000", "-1"])
def test_bench_thread_list_refused(tmp_path, bad):
    res = CliRunner().invoke(main, ["bench", "-m", str(write_tiny_gguf(tmp_path / "t.gguf")),
                                    "-t", bad])
    assert res.exit_code == 2 and "--threads" in res.output, res.output


def test_bench_table(tmp_path, monkeypatch):
    monkeypatch.setattr(B, "measure_read_bandwidth", partial(measure_read_bandwidth, nbytes=64 << 20))
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "Q8_0", ctx=256)
    res = CliRunner().invoke(main, ["bench", "-m", str(path), "--ctx", "64", "-p", "16", "-n", "4",
                                    "-r", "1", "--depth", "10", "--full"])
    assert res.exit_code == 0, res.output
    for text in ("| model", "pp16", "tg4", "tg4 @ d10", "KV cache", "of ceiling", "fits in 8.0 GiB"):
        assert text in res.stdout, text
    assert res.stdout.strip().splitlines()[-1].startswith("At ctx 64 it fits in 8 GiB")


def test_quick_check_ends_with_one_sentence(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "Q4_0", ctx=256)
    res = CliRunner().invoke(main, ["bench", "-m", str(path), "--ctx", "64", "-p", "16", "-n", "4",
                                    "--budget", "4"])
    assert res.exit_code == 0, res.output
    *body, last = res.stdout.strip().splitlines()
    assert "memory " in body[1] and "speed " in body[2]
    m = re.fullmatch(r"At ctx 64 it fits in 4 GiB with ([\d.]+) GiB to spare; replies come at about "
                     r"([\d.]+) words/s \(([\d.]+) tokens/s\), prompts are read at (\d+) tokens/s "
                     r"\(0\.75 words per token, typical of English\)\.", last)
    assert m, last
    spare, words, tokens = float(m[1]), float(m[2]), float(m[3])
    assert 0 < spare < 4 and tokens > 0
    assert words == pytest.approx(0.75 * tokens, abs=0.1)


def test_quick_json_has_no_suite_figures(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "Q8_0", ctx=256)
    res = CliRunner().invoke(main, ["bench", "-m", str(path), "--ctx", "64", "-p", "8", "-n", "2",
                                    "--json"])
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout)
    assert r["full"] is False and r["reps"] == 1 and r["depth"] == 0
    assert r["n_prompt"] == 8 and r["n_gen"] == 2
    assert "read_bandwidth_gbs" not in r["speed"] and r["speed"]["tg_tps"] > 0
    # the whole KV cache was made resident before the peak was taken
    assert r["memory"]["rss_peak"] >= r["memory"]["rss_after_load"]


@pytest.mark.skipif(__import__("numba").config.NUMBA_NUM_THREADS < 2, reason="needs 2 Numba threads")
def test_quick_check_states_a_cgroup_cpu_limit(tmp_path, monkeypatch):
    # automatic threads under a 1.5-CPU limit on 2 cores: 2 for prompts, 1 for replies
    from edgellama import machine
    monkeypatch.setattr(machine, "cpu_quota", lambda: 1.5)
    monkeypatch.setattr(machine, "default_threads", lambda: 2)
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "Q4_0", ctx=256)
    res = CliRunner().invoke(main, ["bench", "-m", str(path), "--ctx", "64", "-p", "8", "-n", "2",
                                    "--json"])
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout)
    assert (r["cpu_quota"], r["threads"], r["threads_reply"]) == (1.5, 2, 1)
    assert "2 threads (automatic; the cgroup's CPU limit is 1.5: 1 for replies)" in \
        B.format_quick(r).splitlines()[0]


def test_a_one_token_prompt_and_reply_are_measured(tmp_path):
    # -p 1 -n 1 is the smallest run: it once stopped on an internal error (the decode step
    # it times took the prompt's second token, which a 1-token prompt does not have)
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "Q8_0", ctx=256)
    res = CliRunner().invoke(main, ["bench", "-m", str(path), "--ctx", "64", "-p", "1", "-n", "1",
                                    "--json"])
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout)
    assert r["n_prompt"] == 1 and r["speed"]["pp_tps"] > 0 and r["speed"]["tg_tps"] > 0


def test_depth_and_repetitions_need_full(tmp_path):
    path = str(write_tiny_gguf(tmp_path / "t.gguf"))
    res = CliRunner().invoke(main, ["bench", "-m", path, "--depth", "8"])
    assert res.exit_code == 2 and "--depth is for --full" in res.output
    res = CliRunner().invoke(main, ["bench", "-m", path, "-r", "2"])
    assert res.exit_code == 2 and "-r is for --full" in res.output


@pytest.fixture
def tiny_shape(tmp_path, monkeypatch):
    """`--shape llama-3.2-1b` generates a tiny file in a cache of its own."""
    monkeypatch.setenv("EDGELLAMA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(B.SHAPES, "llama-3.2-1b", TINY)
    return tmp_path / "cache" / "bench" / "llama-3.2-1b-random-q4_0.gguf"


def test_generated_file_is_named_sized_and_kept_or_removed(tiny_shape):
    args = ["bench", "--shape", "llama-3.2-1b", "--ctx", "64", "-p", "8", "-n", "2"]
    res = CliRunner().invoke(main, args + ["--no-keep"])
    assert res.exit_code == 0, res.output
    assert f"Generated {tiny_shape}" in res.stderr
    assert f"Removed {tiny_shape}" in res.stderr and not tiny_shape.exists()
    res = CliRunner().invoke(main, args)          # not a terminal: kept, and said so
    assert res.exit_code == 0, res.output
    size = tiny_shape.stat().st_size
    assert f"Kept {tiny_shape} ({size / 2**20:.0f} MiB" in res.stderr
    assert "edgellama bench --clean" in res.stderr
    res = CliRunner().invoke(main, args)          # reused: not generated again
    assert "Generated" not in res.stderr and tiny_shape.exists()
    tiny_shape.with_suffix(".tmp").write_bytes(b"x")   # an interrupted generation's leftover
    res = CliRunner().invoke(main, ["bench", "--clean"])
    assert res.exit_code == 0, res.output
    assert f"Removed 2 file(s), {(size + 1) / 2**20:.0f} MiB" in res.stdout
    assert not tiny_shape.exists() and not tiny_shape.with_suffix(".tmp").exists()
    res = CliRunner().invoke(main, ["bench", "--clean"])
    assert "No bench files" in res.stdout


def test_a_qwen3_shape_is_a_qwen3_file(tmp_path, monkeypatch):
    # --shape qwen3-*: q/k norms, key_length 2·E/H, its own vocabulary (a tiny stand-in)
    monkeypatch.setenv("EDGELLAMA_CACHE", str(tmp_path / "cache"))
    tiny = B.Shape(dim=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=256, train_ctx=256,
                   theta=1e6, arch="qwen3", head_dim=32)
    monkeypatch.setitem(B.SHAPES, "qwen3-0.6b", tiny)
    res = CliRunner().invoke(main, ["bench", "--shape", "qwen3-0.6b", "--ctx", "64", "-p", "8",
                                    "-n", "2", "--no-keep"])
    assert res.exit_code == 0, res.output
    from edgellama.args import ModelArgs
    from edgellama.gguf import GGUFFile
    a = ModelArgs.from_gguf(GGUFFile(B.shape_file("qwen3-0.6b", "Q4_0", quiet=True)))
    assert (a.family.name, a.head_dim, a.n_heads, a.dim) == ("qwen3", 32, 4, 64)
    monkeypatch.undo()      # the table's own entry: the published shapes
    assert B.SHAPES["qwen3-0.6b"] == B.Shape(dim=1024, layers=28, heads=16, kv_heads=8, ffn=3072,
                                             vocab=151936, theta=1e6, train_ctx=40960,
                                             arch="qwen3", head_dim=128)


def test_time_left_counts_down_over_the_steps():
    said = []
    clock = B._Clock(said.append, {"pp": 10.0, "tg": 20.0})
    assert clock.left("pp", 0.0) == 30.0 and clock.left("pp", 0.5) == 25.0
    clock.done("pp")
    assert clock.left("tg", 0.25) == 15.0
    clock.show("tg", "replying", 0.25)
    clock.show("tg", "replying", 0.99)
    assert said == ["replying, about 15 s left", "replying"]


def test_bench_refuses_both_model_and_shape(tmp_path):
    res = CliRunner().invoke(main, ["bench", "-m", str(write_tiny_gguf(tmp_path / "t.gguf")),
                                    "--shape", "llama-3.2-1b"])
    assert res.exit_code == 2 and "either -m or --shape" in res.output


def test_on_a_terminal_time_left_is_shown_and_a_new_file_is_offered_for_removal(tmp_path):
    code = ("import sys; import edgellama.benchmark as B; "
            f"B.SHAPES['llama-3.2-1b'] = B.{TINY!r}; "
            "from edgellama.cli.main import main; sys.argv[0] = 'edgellama'; main()")
    env = dict(os.environ, EDGELLAMA_CACHE=str(tmp_path), NUMBA_CACHE_DIR=str(kernel_cache_dir()))
    path = tmp_path / "bench" / "llama-3.2-1b-random-q4_0.gguf"

    def bench(answer):
        c = pexpect.spawn(sys.executable, ["-c", code, "bench", "--shape", "llama-3.2-1b",
                                           "--ctx", "64", "-p", "8", "-n", "16"],
                          env=env, encoding="utf-8", timeout=120, dimensions=(50, 250))
        c.expect(r"\[bench\] replying \d+/16 tokens")      # the progress line
        if answer is not None:
            c.expect_exact("to skip generating it next time? [Y/n]: ")
            c.sendline(answer)
        c.expect(pexpect.EOF)
        return c.before

    assert f"Removed {path}" in bench("n") and not path.exists()
    assert f"Kept {path}" in bench("") and path.exists()
    assert f"Kept {path}" in bench(None)                   # not new: no question


def test_bench_speculative_reports_acceptance_and_speedup(tmp_path):
    from tiny_gguf import TINY_VOCAB
    kw = {"dim": 64, "ffn": 96, "vocab": TINY_VOCAB, "ctx": 1024, "tokenizer": True}
    target = write_tiny_gguf(tmp_path / "target.gguf", "Q8_0", **kw)
    draft = write_tiny_gguf(tmp_path / "draft.gguf", "Q4_0", **kw)   # the same weights
    base = ["bench", "-m", str(target), "--ctx", "1024", "-p", "16", "-n", "24"]
    for extra, name in ((["--lookup"], "lookup"), (["--draft", str(draft)], "draft.gguf")):
        res = CliRunner().invoke(main, base + extra + ["--json"])
        assert res.exit_code == 0, res.output
        s = json.loads(res.stdout)["speculative"]
        assert s["drafter"] == name and s["same_tokens"] is True
        assert 0 < s["tokens"] <= 24 and s["prompt_tokens"] > 100
        assert s["speedup"] == s["speculative_tok_s"] / s["plain_tok_s"]
        assert 0 <= s["accepted"] <= s["drafted"]
    assert s["accepted"] > 0   # a Q4_0 copy of the target agrees with it
    res = CliRunner().invoke(main, base + ["--draft", str(draft)])
    assert res.exit_code == 0, res.output
    line = next(x for x in res.stdout.splitlines() if x.startswith("speculative "))
    assert re.search(r"tokens/s vs plain [\d.]+, [\d.]+x; drafted \d+, accepted \d+", line), line
    assert "DIFFER" not in line
    # refused in one line: no tokenizer to read the prompt with, another vocabulary
    res = CliRunner().invoke(main, ["bench", "--shape", "llama-3.2-1b", "--lookup"])
    assert res.exit_code == 2 and "--lookup needs -m MODEL" in res.output
    other = write_tiny_gguf(tmp_path / "other.gguf", "Q4_0", **{**kw, "vocab": TINY_VOCAB + 16})
    res = CliRunner().invoke(main, base + ["--draft", str(other)])
    assert res.exit_code == 1 and "does not share the vocabulary" in res.output
    assert "Traceback" not in res.output


@pytest.mark.parametrize("extra,what", [
    (["-n", "64"], "-n 64 does not fit --ctx 64"),
    (["--full", "--depth", "60", "-n", "8"], "--depth 60 with -n 8 does not fit --ctx 64"),
    (["--full", "-r", "1000000000"], "-r"),
    (["--budget", "nan"], "--budget"),
    (["--budget", "-5"], "--budget"),
    (["--budget", "inf"], "--budget"),
])
def test_bench_counts_are_bounded_before_anything_runs(tmp_path, extra, what):
    # every count and size bench takes is refused (exit 2, one line) when it cannot mean
    # anything for the context or the machine, before the model loads
    res = CliRunner().invoke(main, ["bench", "-m", str(write_tiny_gguf(tmp_path / "t.gguf")),
                                    "--ctx", "64"] + extra)
    assert res.exit_code == 2 and what in res.output, res.output
    assert "Traceback" not in res.output
