"""`edgellama bench` on a tiny model: the report's arithmetic and shape, not its speed."""
import json
from functools import partial

from click.testing import CliRunner

import edgellama.benchmark as B
from edgellama.cli.main import main
from edgellama.membw import measure_read_bandwidth
from tiny_gguf import write_tiny_gguf


def test_bench_json_report(tmp_path, monkeypatch):
    # a small buffer keeps the bandwidth probe quick; the figures are still measured
    monkeypatch.setattr(B, "measure_read_bandwidth", partial(measure_read_bandwidth, nbytes=64 << 20))
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "Q4_0", ctx=256)
    res = CliRunner().invoke(main, ["bench", "-m", str(path), "--ctx", "64", "-p", "16", "-n", "4",
                                    "-r", "2", "--json"])
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


def test_bench_table(tmp_path, monkeypatch):
    monkeypatch.setattr(B, "measure_read_bandwidth", partial(measure_read_bandwidth, nbytes=64 << 20))
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "Q8_0", ctx=256)
    res = CliRunner().invoke(main, ["bench", "-m", str(path), "--ctx", "64", "-p", "16", "-n", "4",
                                    "-r", "1", "--depth", "10"])
    assert res.exit_code == 0, res.output
    for text in ("| model", "pp16", "tg4", "tg4 @ d10", "KV cache", "of ceiling", "fits in 8.0 GiB"):
        assert text in res.stdout, text


def test_bench_refuses_both_model_and_shape(tmp_path):
    res = CliRunner().invoke(main, ["bench", "-m", str(write_tiny_gguf(tmp_path / "t.gguf")),
                                    "--shape", "llama-3.2-1b"])
    assert res.exit_code == 2 and "either -m or --shape" in res.output
