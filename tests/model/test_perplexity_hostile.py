"""`perplexity -f` of texts far larger than memory: only what the requested chunks need is
read and tokenized (and exactly as the whole text would be); without --chunks a file that
cannot fit is refused before anything is read."""
from __future__ import annotations

import random
import time
import tracemalloc

import numpy as np
import pytest
from test_perplexity import CTX, TEXT, assert_user_error, files, invoke  # noqa: F401
from test_tokenizer import corpus, llama3, smol, smollm2_metadata  # noqa: F401
from test_tokenizer_long import RUNS, _framed

from edgellama import perplexity as P
from edgellama.errors import EdgeError
from edgellama.tokenizer import USER_DEFINED, Tokenizer


def _blocks(text: str, seed: int):
    rng = random.Random(seed)
    i = 0
    while i < len(text):
        n = rng.choice([1, 2, 3, 7, 50, 1000, 30_000])
        yield text[i:i + n]
        i += n


def _streamed(tok, text, seed=0):
    return [i for part in tok.encode_stream(_blocks(text, seed)) for i in part]


@pytest.mark.parametrize("name", ["llama3", "smol"])
def test_stream_encoding_is_the_whole_texts(name, request, corpus):
    tok = request.getfixturevalue(name)
    text = corpus[:150_000]
    assert _streamed(tok, text) == tok.encode(text)
    for cls, unit in RUNS.items():
        for n in (1, 5, 300):
            t = _framed(unit, n)
            assert _streamed(tok, t, n) == tok.encode(t), (cls, n)


def test_stream_never_cuts_a_user_defined_token(smollm2_gguf):
    meta = smollm2_metadata(smollm2_gguf)
    magic = len(meta["tokenizer.ggml.tokens"])
    tok = Tokenizer.from_metadata(dict(meta, **{
        "tokenizer.ggml.tokens": [*meta["tokenizer.ggml.tokens"], "word. and word"],
        "tokenizer.ggml.token_type": np.append(meta["tokenizer.ggml.token_type"], USER_DEFINED)}))
    text = "a word. and word, b word. and words " * 500
    for seed in range(5):
        ids = _streamed(tok, text, seed)
        assert ids == tok.encode(text) and ids.count(magic) == 1000


def test_stream_refuses_an_endless_run_with_bounded_memory(smol):
    def blocks():
        while True:     # a run of symbols that never ends: nowhere to cut
            yield "." * 100_000
    with pytest.raises(EdgeError, match="more than 1000000 characters in a row"):
        for _ in smol.encode_stream(blocks(), max_held=1_000_000):
            pass


def _write_repeated(path, text: str, size: int) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(size // len(text.encode())):
            f.write(text)


def test_read_tokens_stops_at_what_the_chunks_need(smol, tmp_path, corpus):
    """A 100 MB text, 4 chunks asked for: a few blocks are read, memory stays small, and
    the tokens are the prefix of the whole text's."""
    big = tmp_path / "big.txt"
    _write_repeated(big, corpus[:200_000], 100 << 20)
    need = P.tokens_needed(512, 4)
    tracemalloc.start()
    t0 = time.perf_counter()
    tokens, whole = P.read_tokens(smol, str(big), need)
    seconds = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert not whole and need <= len(tokens) <= need + P._BLOCK   # one block past
    assert peak < 40 << 20, peak   # the file is 100 MB; its text alone would be more
    assert seconds < 10
    assert tokens.tolist() == P.tokenize(smol, corpus[:200_000] * 15)[:len(tokens)]


def test_read_tokens_whole_file_matches_tokenize(llama3, tmp_path, corpus):
    path = tmp_path / "t.txt"
    text = corpus[:100_000] + " " * 1_500_000 + "end\r\n"   # crosses 1 MB block edges
    path.write_bytes(text.encode())
    tokens, whole = P.read_tokens(llama3, str(path))
    assert whole and tokens.tolist() == P.tokenize(llama3, text)
    assert tokens.dtype == np.int32


def test_read_tokens_refuses_whole_text_too_big_for_memory(smol, tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("hello world " * 1000)
    with pytest.raises(EdgeError, match=r"pass --chunks N"):
        P.read_tokens(smol, str(path), None, available=1000)
    tokens, whole = P.read_tokens(smol, str(path), 64, available=1000)   # --chunks: fine
    assert len(tokens) == 2000 and whole     # one block held it all


def test_read_tokens_utf8_error_offset_across_blocks(smol, tmp_path):
    path = tmp_path / "t.txt"
    head = "é" * (P._BLOCK // 2 + 3)          # the 1 MB edge falls inside a 2-byte character
    path.write_bytes(head.encode() + b"ok\xff")
    with pytest.raises(EdgeError, match=rf"offset {len(head.encode()) + 2}\)"):
        P.read_tokens(smol, str(path))
    path.write_bytes(head.encode() + "ok".encode())
    assert P.read_tokens(smol, str(path))[0].tolist() == P.tokenize(smol, head + "ok")


@pytest.fixture
def sparse_file(tmp_path):
    """1 TiB (more than any test machine's memory), all but its first 20 KB a hole."""
    path = tmp_path / "huge.txt"
    with open(path, "wb") as f:
        f.write((TEXT * 7).encode())
        f.truncate(1 << 40)
    return path


def test_cli_huge_file_with_chunks_reads_only_the_start(files, sparse_file):
    t0 = time.perf_counter()
    res = invoke("-m", files["q4_0"], "-f", sparse_file, "--ctx", CTX, "--chunks", 2, "--json",
                 "-t", 1)
    assert res.exit_code == 0, res.output
    assert time.perf_counter() - t0 < 30
    import json
    out = json.loads(res.stdout)
    assert out["chunks"] == 2 and out["text_read_whole"] is False
    assert 2 * CTX <= out["text_tokens"]
    same = invoke("-m", files["q4_0"], "-f", sparse_file, "--ctx", CTX, "--chunks", 2)
    assert "tokens read (enough for --chunks)" in same.stdout


def test_cli_huge_file_without_chunks_is_refused(files, sparse_file):
    res = invoke("-m", files["q4_0"], "-f", sparse_file, "--ctx", CTX)
    assert_user_error(res, "huge.txt is 1024.0 GiB", "pass --chunks N")
