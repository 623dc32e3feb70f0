"""Texts of any length: long runs of every character class the pre-tokenizer patterns treat
specially give exactly Hugging Face `tokenizers`' ids, and no run crashes tiktoken's regex
engine (a million spaces used to end in a Rust panic: tiktoken issues #15, #245).

The cutting itself is checked at tiny limits (`long_text_chars`), where every cut and every
fall-back to whole pieces happens many times per text, against the unchanged short path.
"""
from __future__ import annotations

import copy
import random

import numpy as np
import pytest
from test_tokenizer import (_hf_from_metadata, _hf_ids, corpus, hf_llama3,  # noqa: F401
                            hf_smol, llama3, smol, smollm2_metadata)
from tokenizers import pre_tokenizers

from edgellama.tokenizer import LONG_TEXT_CHARS, USER_DEFINED, Tokenizer

# What the patterns treat specially, one entry per class: whitespace of every kind (with
# and without newlines), letters, digits (\p{N}: grouped in threes by Llama 3, one by one
# by SmolLM2), punctuation and symbols, apostrophes and contractions, CJK and emoji.
RUNS = {
    "spaces": " ", "tabs": "\t", "newlines": "\n", "crlf": "\r\n", "cr": "\r",
    "mixed_ws": " \t \n\r\n \t", "nbsp": "\u00a0", "ideographic_space": "\u3000",
    "thin_space": "\u2009", "vt_ff": "\x0b\x0c", "letters": "a", "word_space": "word ",
    "accents": "é", "digits": "1", "digit_space": "12 ", "other_numbers": "²½Ⅻ",
    "punct": ".", "punct_mix": "!?-_@#", "apostrophe": "'", "contraction": "'s",
    "contraction_ll": "'LL", "cjk": "中", "cjk_punct": "日本語。", "emoji": "🦙",
    "emoji_zwj": "👩\u200d💻", "marks": "e\u0301", "controls": "\x00\x1c",
}
# Each run is placed after and before every neighbour class, so every chunk boundary the
# long path may choose (and every lookahead of the pattern) meets each of them.
CONTEXTS = ("", "x", "Hi.", " ", "\n", "7", "'", "中", "🦙", "\u00a0", "word ", ".\n")


def _framed(unit: str, n: int) -> str:
    run = unit * max(1, n // len(unit))
    return "".join(c + run for c in CONTEXTS) + "end"


def _with_limit(tok: Tokenizer, limit: int) -> Tokenizer:
    small = copy.copy(tok)
    small.long_text_chars = limit
    return small


@pytest.fixture(scope="session")
def hf_gpt2(smollm2_gguf):
    return _hf_from_metadata(dict(smollm2_metadata(smollm2_gguf), **{"tokenizer.ggml.pre": "gpt-2"}),
                             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))


@pytest.fixture(scope="session")
def gpt2(smollm2_gguf) -> Tokenizer:
    return Tokenizer.from_metadata(dict(smollm2_metadata(smollm2_gguf), **{"tokenizer.ggml.pre": "gpt-2"}))


NAMES = ["llama3", "smol", "gpt2"]


@pytest.mark.parametrize("n", [10, 1000, 20_000, pytest.param(100_000, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", NAMES)
def test_long_runs_match_hf(name, n, request):
    # 20_000 > LONG_TEXT_CHARS / 2: every run is long enough for the whole-piece path
    tok, hf = request.getfixturevalue(name), request.getfixturevalue(f"hf_{name}")
    bad = [cls for cls, unit in RUNS.items()
           if tok.encode(t := _framed(unit, n)) != _hf_ids(hf, t)]
    assert bad == []


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_million_char_runs_match_hf(name, request):
    tok, hf = request.getfixturevalue(name), request.getfixturevalue(f"hf_{name}")
    bad = []
    for cls, unit in RUNS.items():
        text = "Hi." + unit * (1_000_000 // len(unit)) + " word" + unit * (1_000_000 // len(unit))
        if tok.encode(text) != _hf_ids(hf, text):
            bad.append(cls)
    assert bad == []


@pytest.mark.parametrize("name", ["llama3", "smol"])
@pytest.mark.parametrize("unit", [" ", "\u3000", pytest.param("\t", marks=pytest.mark.slow),
                                  pytest.param(" \t", marks=pytest.mark.slow)])
def test_megabyte_of_whitespace_does_not_crash(name, unit, request):
    """The reported case: about a megabyte of one whitespace run (a Rust panic before)."""
    tok, hf = request.getfixturevalue(name), request.getfixturevalue(f"hf_{name}")
    text = "padded" + unit * (1_100_000 // len(unit)) + "x"
    ids = tok.encode(text)
    assert ids == _hf_ids(hf, text)
    assert tok.decode(ids) == text
    assert tok.encode_special(text) == ids


@pytest.mark.parametrize("limit", [4, 9, 64, 1000])
@pytest.mark.parametrize("name", NAMES)
def test_cutting_changes_nothing_on_the_corpus(name, limit, request, corpus):
    """At tiny limits the long path cuts after nearly every word and falls back to whole
    pieces in every run of non-letters: the ids must be those of the uncut text."""
    tok = request.getfixturevalue(name)
    text = corpus[:200_000] if limit >= 64 else corpus[:40_000]
    small = _with_limit(tok, limit)
    assert small.encode(text) == tok._to_ids(tok._encoding.encode_ordinary(text))


@pytest.mark.parametrize("name", NAMES)
def test_cutting_changes_nothing_on_every_run(name, request):
    tok = request.getfixturevalue(name)
    small = _with_limit(tok, 6)
    for cls, unit in RUNS.items():
        for n in (1, 2, 3, 4, 5, 7, 12, 40):
            text = _framed(unit, n)
            assert small.encode(text) == tok.encode(text), (cls, n)


def test_special_tokens_in_long_text(llama3, hf_llama3):
    """encode_special on a long chat prompt: control tokens are found across the cuts;
    plain encode keeps them as text."""
    turn = "<|start_header_id|>user<|end_header_id|>\n\n{}<|eot_id|>"
    text = "<|begin_of_text|>" + "".join(turn.format(body) for body in
                                         ["hello " * 3000, " " * 70_000, "1" * 40_000, "<|eot_id|>"])
    assert len(text) > LONG_TEXT_CHARS
    want = hf_llama3.encode(text, add_special_tokens=False).ids
    assert llama3.encode_special(text) == want
    assert _with_limit(llama3, 5).encode_special(text) == want
    plain = llama3.encode(text)
    assert 128009 not in plain and llama3.decode(plain) == text


def test_user_defined_tokens_in_long_text(smollm2_gguf):
    meta = smollm2_metadata(smollm2_gguf)
    magic = len(meta["tokenizer.ggml.tokens"])       # user-defined: matched in plain text
    tok = Tokenizer.from_metadata(dict(meta, **{
        "tokenizer.ggml.tokens": [*meta["tokenizer.ggml.tokens"], "<magic word>"],
        "tokenizer.ggml.token_type": np.append(meta["tokenizer.ggml.token_type"], USER_DEFINED)}))
    text = ("say <magic word> " + " " * 50_000 + "<magic word>" + "x" * 3) * 3
    ids = tok.encode(text)
    assert ids.count(magic) == 6
    short = [i for part in text.split("<magic word>") for i in (*tok.encode(part), magic)][:-1]
    assert ids == short
    assert _with_limit(tok, 7).encode(text) == ids


def test_lone_surrogates_in_long_text(llama3):
    text = "a\ud83d" + " " * 40_000 + "\ude00b" + "c" * 40_000
    fixed = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    assert llama3.encode(text) == llama3.encode(fixed) == _with_limit(llama3, 5).encode(fixed)


@pytest.mark.parametrize("name", NAMES)
def test_random_mixtures_match_hf(name, request):
    """Seeded random texts of runs of every class, long and short, at several limits."""
    tok, hf = request.getfixturevalue(name), request.getfixturevalue(f"hf_{name}")
    rng = random.Random(30)
    units = list(RUNS.values()) + list(CONTEXTS[1:])
    for case in range(150):
        parts = [rng.choice(units) * int(rng.paretovariate(0.8)) for _ in range(rng.randint(1, 40))]
        text = "".join(parts)
        want = _hf_ids(hf, text)
        for limit in (3, 17, LONG_TEXT_CHARS):
            assert _with_limit(tok, limit).encode(text) == want, (case, limit, text[:200])
