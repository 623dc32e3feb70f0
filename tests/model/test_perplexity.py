"""`edgellama perplexity`: llama-perplexity's chunking and scoring, its error formulas, KL
divergence against a reference, checked against plain NumPy on tiny models; the command's
errors and --json."""
from __future__ import annotations

import importlib.util
import json
import math
import types
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import edgellama
from edgellama import perplexity as P
from edgellama.cli.main import main
from edgellama.errors import EdgeError
from reference import load_reference, reference_forward
from tiny_gguf import TINY_VOCAB, write_tiny_gguf

TEXT = (Path(__file__).resolve().parents[2] / "bench/data/alice.txt").read_text()[:3000]
CTX = 16


def tiny(path, qtype="F32", seed=0, **kw):
    return write_tiny_gguf(path, qtype, dim=32, layers=2, heads=2, kv_heads=1, ffn=64,
                           vocab=kw.pop("vocab", TINY_VOCAB), ctx=64, tokenizer=True, seed=seed, **kw)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("ppl")
    return {"f32": tiny(d / "f32.gguf"), "q4_0": tiny(d / "q4_0.gguf", "Q4_0"),
            "other": tiny(d / "other.gguf", seed=1),
            "bigger_vocab": tiny(d / "v.gguf", vocab=TINY_VOCAB + 8)}


def np_log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def llama_cpp_targets(tokens, n_ctx, n_chunks):
    """llama-perplexity's loop, written out: chunk i scores logits j = n_ctx/2 .. n_ctx-2,
    which predict tokens[i*n_ctx + j + 1]. Returns (chunk, position j, target) triples."""
    return [(i, j, tokens[i * n_ctx + j + 1])
            for i in range(n_chunks) for j in range(n_ctx // 2, n_ctx - 1)]


class FixedModel:
    """A fake Transformer: the same logits at every position; records its calls."""

    def __init__(self, logits):
        self.logits, self.calls = np.asarray(logits, np.float32), []

    def new_sequence(self, ctx=None):
        from edgellama.sequence import Sequence
        return Sequence(types.SimpleNamespace(ctx=ctx, length=0))

    def forward(self, tokens, seq, all_logits=False):
        self.calls.append((list(tokens), seq.pos, all_logits))
        seq._extend(np.asarray(tokens))
        return np.tile(self.logits, (len(tokens), 1)) if all_logits else self.logits


# -- chunking and scoring positions --------------------------------------------------------

def test_tokenize_puts_bos_first_only_when_the_vocabulary_adds_it():
    class Tok:
        bos_id, add_bos = 7, True

        def encode(self, text):
            return [ord(c) for c in text]

    t = Tok()
    assert P.tokenize(t, "ab") == [7, 97, 98]
    t.add_bos = False
    assert P.tokenize(t, "ab") == [97, 98]


def test_chunks_are_whole_non_overlapping_with_bos_first():
    tokens = list(range(100, 150))                       # 50 tokens: 6 chunks of 8
    chunks = P.make_chunks(tokens, 8, bos_id=1)
    assert len(chunks) == 6 and chunks.per_chunk == 3   # 8 - 1 - 8 // 2
    for i, c in enumerate(chunks):
        assert c.tolist() == [1] + tokens[i * 8 + 1:(i + 1) * 8]
    assert [c[0] for c in P.make_chunks(tokens, 8)] == [100, 108, 116, 124, 132, 140]
    assert len(P.make_chunks(tokens, 8, n_chunks=2)) == 2
    assert len(P.make_chunks(tokens, 8, n_chunks=99)) == 6


def test_text_shorter_than_two_contexts_is_refused_with_the_count_needed():
    with pytest.raises(EdgeError, match=r"is 31 tokens; .* needs at least 32"):
        P.make_chunks(list(range(31)), 16)
    assert len(P.make_chunks(list(range(32)), 16)) == 2
    with pytest.raises(EdgeError, match="at least 4"):
        P.make_chunks(list(range(100)), 3)


def test_each_chunk_runs_from_position_zero_and_scores_its_second_half():
    model = FixedModel(np.zeros(10))
    tokens = list(range(10)) * 5
    P.evaluate([model], P.make_chunks(tokens, 8, bos_id=9))
    # per chunk: the first half for the cache, then positions 4..6 with all logits
    # (position 7's logits would predict a token of the next chunk)
    assert model.calls[:2] == [([9, 1, 2, 3], 0, False), ([4, 5, 6], 4, True)]
    assert model.calls[2:4] == [([9, 9, 0, 1], 0, False), ([2, 3, 4], 4, True)]
    assert len(model.calls) == 2 * 6


def test_perplexity_of_a_known_distribution():
    rng = np.random.default_rng(0)
    V, n_ctx = 12, 8
    logits = (rng.normal(size=V) * 2).astype(np.float32)   # what a model returns
    tokens = rng.integers(0, V, 70).tolist()
    [r] = P.evaluate([FixedModel(logits)], P.make_chunks(tokens, n_ctx, bos_id=0))
    triples = llama_cpp_targets(tokens, n_ctx, 70 // n_ctx)
    nll = -np_log_softmax(logits)[[t for _, _, t in triples]]
    assert r.count == len(triples) == 8 * 3
    assert r.ppl == pytest.approx(math.exp(nll.mean()), rel=1e-12)
    # llama.cpp's ±: standard error of the mean log-likelihood, times PPL
    assert r.ppl_err == pytest.approx(r.ppl * nll.std(ddof=1) / math.sqrt(len(nll)), rel=1e-9)
    [u] = P.evaluate([FixedModel(np.zeros(V))], P.make_chunks(tokens, n_ctx))
    assert u.ppl == pytest.approx(V, rel=1e-12) and u.ppl_err == 0    # uniform: PPL = V


def test_mean_and_error_is_the_standard_error_of_the_mean():
    x = np.random.default_rng(1).normal(3, 2, 50)
    mean, err = P.mean_and_error(x.sum(), (x * x).sum(), len(x))
    assert mean == pytest.approx(x.mean())
    assert err == pytest.approx(x.std(ddof=1) / math.sqrt(len(x)))
    assert P.mean_and_error(5.0, 25.0, 1) == (5.0, 0.0)


# -- real (tiny) models against NumPy --------------------------------------------------------

def _plan(llm, n_chunks=3):
    return P.make_chunks(P.tokenize(llm.tokenizer, TEXT), CTX, n_chunks)


def test_perplexity_matches_a_numpy_forward_pass(files):
    # F32: this checks the perplexity arithmetic, not quantization (the quantized formats'
    # prefill rounds activations to int8, as llama.cpp does)
    llm = edgellama.load(files["f32"], ctx=CTX)
    plan = _plan(llm)
    [r] = P.evaluate([llm.model], plan)
    meta, W = load_reference(files["f32"])      # gguf-py + NumPy: no runtime code
    nll = []
    for i, chunk in enumerate(plan):
        lp = np_log_softmax(reference_forward(meta, W, chunk))
        nll += [-lp[j, t] for c, j, t in llama_cpp_targets(plan.tokens, CTX, len(plan)) if c == i]
    assert r.count == len(nll) == 3 * 7
    # the runtime keeps K/V in f16: logits agree to ~1e-3, so does log PPL
    assert math.log(r.ppl) == pytest.approx(np.mean(nll), abs=2e-3)


def test_identical_models_have_zero_kl_and_agree_on_every_top_token(files):
    # a fixed thread count: the automatic one could differ between the two runs
    a = edgellama.load(files["q4_0"], ctx=CTX, threads=1)
    b = edgellama.load(files["q4_0"], ctx=CTX, threads=1)
    [r] = P.evaluate([a.model], _plan(a), ref=b.model)
    assert r.kl_mean == 0 and r.kl_max == 0 and r.kl_percentile(99) == 0
    assert r.same_top == r.count and r.same_top_frac == 1
    assert r.ppl == r.ref_ppl and r.ppl_ratio == 1


def test_kl_of_two_models_matches_numpy(files):
    q = edgellama.load(files["q4_0"], ctx=CTX)
    ref = edgellama.load(files["f32"], ctx=CTX)
    other = edgellama.load(files["other"], ctx=CTX)
    plan = _plan(q, n_chunks=4)
    rq, ro = P.evaluate([q.model, other.model], plan, ref=ref.model)
    for llm, r in ((q, rq), (other, ro)):
        kl, nll, nll_ref, same = [], [], [], []
        for i, chunk in enumerate(plan):
            # logits from one full forward pass (not the runtime's half-and-half split)
            lq = llm.model.forward(chunk, llm.model.new_sequence(), all_logits=True)
            lp = ref.model.forward(chunk, ref.model.new_sequence(), all_logits=True)
            for c, j, t in llama_cpp_targets(plan.tokens, CTX, len(plan)):
                if c != i:
                    continue
                a, b = np_log_softmax(lp[j]), np_log_softmax(lq[j])
                kl.append(np.sum(np.exp(a) * (a - b)))
                nll.append(-b[t])
                nll_ref.append(-a[t])
                same.append(lq[j].argmax() == lp[j].argmax())
        kl = np.array(kl)
        assert r.count == len(kl) == 4 * 7
        assert r.kl_mean == pytest.approx(kl.mean(), rel=1e-4)
        assert r.kl_err == pytest.approx(kl.std(ddof=1) / math.sqrt(len(kl)), rel=1e-3)
        assert r.kl_max == pytest.approx(kl.max(), rel=1e-4)
        assert r.kl_percentile(99) == pytest.approx(np.percentile(kl, 99), rel=1e-4)
        assert r.same_top == sum(same)
        # the F32 reference's logits move by up to 6e-5 with the batch split (BLAS
        # blocking), so its NLLs by as much: a relative 1e-5 was within that noise
        assert r.ppl_ratio == pytest.approx(math.exp(np.mean(nll) - np.mean(nll_ref)), rel=1e-4)
        assert r.ref_ppl == pytest.approx(math.exp(np.mean(nll_ref)), rel=1e-4)
    assert 0 < rq.kl_mean < ro.kl_mean        # a quantized copy is closer than another model


def test_vocabulary_check_names_the_difference(files):
    a = edgellama.load(files["f32"], ctx=CTX).tokenizer
    assert P.same_vocabulary(a, edgellama.load(files["other"], ctx=CTX).tokenizer) is None
    assert P.same_vocabulary(a, edgellama.load(files["bigger_vocab"], ctx=CTX).tokenizer) == \
        f"{TINY_VOCAB} tokens vs {TINY_VOCAB + 8}"


# -- the command -----------------------------------------------------------------------------

def invoke(*args):
    return CliRunner().invoke(main, ["perplexity", *map(str, args)])


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("text") / "text.txt"
    p.write_text(TEXT)
    return p


def assert_user_error(res, *needles):
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.exit_code == 1, (res.exit_code, res.stderr, res.exception)
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_cli_summary(files, text_file):
    res = invoke("-m", files["q4_0"], "-f", text_file, "--ctx", CTX, "--chunks", 2)
    assert res.exit_code == 0, res.output
    assert "2 chunks of 16, 14 tokens scored" in res.stdout
    assert res.stdout.count("\nPPL ") == 1 and "KL" not in res.stdout
    positional = invoke(files["q4_0"], "-f", text_file, "--ctx", CTX, "--chunks", 2)
    assert positional.exit_code == 0 and positional.stdout.splitlines()[:3] == \
        res.stdout.splitlines()[:3]   # model, text, PPL (not the time)


def test_cli_json_with_a_reference(files, text_file):
    res = invoke("-m", files["q4_0"], "-f", text_file, "--ctx", CTX, "--chunks", 3,
                 "--ref", files["f32"], "--json", "-t", 1)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert set(out) == {"model", "ref", "text", "text_tokens", "text_read_whole", "ctx", "chunks", "tokens_scored",
                        "ppl", "ppl_err", "ref_ppl", "ref_ppl_err", "ppl_ratio", "ppl_ratio_err",
                        "kl_mean", "kl_err", "kl_median", "kl_p99", "kl_max", "same_top",
                        "same_top_err", "seconds"}
    assert (out["ctx"], out["chunks"], out["tokens_scored"]) == (CTX, 3, 21)
    assert out["ref"] == str(files["f32"]) and 0 < out["kl_mean"] <= out["kl_max"]
    assert 0 <= out["same_top"] <= 1 and out["ppl"] > 1
    plain = json.loads(invoke("-m", files["q4_0"], "-f", text_file, "--ctx", CTX,
                              "--chunks", 3, "--json", "-t", 1).stdout)
    assert "kl_mean" not in plain and plain["ppl"] == out["ppl"]


def test_cli_errors(files, text_file, tmp_path):
    m = ("-m", files["q4_0"])
    assert_user_error(invoke(*m, "-f", tmp_path / "nope.txt"), "nope.txt: no such file")
    assert_user_error(invoke(*m, "-f", tmp_path), "is a directory")
    (tmp_path / "short.txt").write_text("abcdefghij")   # no merges: 10 tokens
    assert_user_error(invoke(*m, "-f", tmp_path / "short.txt", "--ctx", CTX),
                      "short.txt is 10 tokens", "needs at least 32")
    (tmp_path / "bad.txt").write_bytes(b"abc\xff")
    assert_user_error(invoke(*m, "-f", tmp_path / "bad.txt", "--ctx", CTX),
                      "not UTF-8 text (invalid byte at offset 3)")
    assert_user_error(invoke(*m, "-f", text_file, "--ctx", 128), "--ctx 128 is larger than the 64")
    assert_user_error(invoke(*m, "-f", text_file, "--ctx", CTX, "--ref", files["bigger_vocab"]),
                      "different vocabulary", f"{TINY_VOCAB} tokens vs {TINY_VOCAB + 8}")
    assert_user_error(invoke(*m, "-f", text_file, "--ctx", CTX, "--ref", tmp_path / "none"),
                      "no such file or directory")
    assert invoke(*m, "-f", text_file, "--ctx", 2).exit_code == 2      # usage error
    assert invoke(*m, "-f", text_file, "--chunks", 0).exit_code == 2


@pytest.fixture(scope="module")
def llama3_tiny(llama3_tokenizer_dir, tmp_path_factory):
    """A tiny random HF checkpoint with the real Llama 3 tokenizer (adds BOS), and GGUFs of it."""
    from edgellama.quant.convert import convert
    from hf_fixtures import write_tiny_llama
    d = tmp_path_factory.mktemp("l3")
    hf = write_tiny_llama(d / "hf", tokenizer_dir=llama3_tokenizer_dir, hidden=32, heads=2,
                          kv_heads=1, ffn=64, layers=1)
    out = {"hf": hf, "text": d / "text.txt"}
    out["text"].write_text(TEXT)
    for t in ("f32", "bf16"):
        out[t] = convert(hf, d / f"{t}.gguf", qtype=t).out_path
    return out


def test_hf_checkpoint_reference_is_exact_and_leaves_no_file(llama3_tiny, tmp_path, monkeypatch):
    import tempfile
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)      # re-read TMPDIR
    args = ("-f", llama3_tiny["text"], "--ctx", CTX, "--chunks", 2, "--ref", llama3_tiny["hf"],
            "--json", "-t", 1)        # fixed threads: both models compute alike
    same = invoke("-m", llama3_tiny["bf16"], *args)    # the checkpoint is bf16: same weights
    assert same.exit_code == 0, same.output
    assert "temporary BF16 GGUF" in same.stderr
    out = json.loads(same.stdout)
    assert out["kl_max"] == 0 and out["same_top"] == 1 and out["ppl_ratio"] == 1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                    reason="llama-cpp-python not installed (pip install -e '.[oracle]')")
def test_tokens_and_perplexity_match_llama_cpp(llama3_tiny):
    """llama.cpp's tokens (BOS added as its tokenizer adds it) and, from its logits, the
    perplexity by llama-perplexity's rule (BOS as each chunk's first token)."""
    import llama_cpp
    path = llama3_tiny["f32"]
    llm = edgellama.load(path, ctx=CTX)
    tokens = P.tokenize(llm.tokenizer, TEXT)
    L = llama_cpp.Llama(model_path=str(path), n_ctx=CTX, n_batch=CTX, logits_all=True,
                        verbose=False, n_threads=2)
    assert L.tokenize(TEXT.encode(), add_bos=True, special=False) == tokens
    assert tokens[0] == llm.tokenizer.bos_id
    plan = P.make_chunks(tokens, CTX, 4, llm.tokenizer.bos_id)
    [r] = P.evaluate([llm.model], plan)
    nll = []
    for i in range(len(plan)):
        chunk = [llm.tokenizer.bos_id] + tokens[i * CTX + 1:(i + 1) * CTX]
        L.reset()
        L.eval(chunk)
        lp = np_log_softmax(np.array(L.scores[:CTX]))
        nll += [-lp[j, t] for c, j, t in llama_cpp_targets(tokens, CTX, len(plan)) if c == i]
    assert math.log(r.ppl) == pytest.approx(np.mean(nll), abs=1e-3)
