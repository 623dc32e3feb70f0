"""Tokenizer vs HF `tokenizers` (and Meta's tiktoken file) on a mixed corpus, plus API edges."""
from __future__ import annotations

import base64
import json
import re
import sys
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import tiktoken
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from edgellama.errors import EdgeError
from edgellama.gguf import GGUFFile
from edgellama.tokenizer import (CONTROL, LLAMA3_PATTERN, USER_DEFINED, StreamDecoder,
                                 Tokenizer)

sys.path.insert(0, str(Path(__file__).parents[1] / "data"))
from make_corpus import CORPUS_PATH, build_corpus  # noqa: E402

LLAMA3_STOPS = {128001, 128008, 128009}  # <|end_of_text|>, <|eom_id|>, <|eot_id|>
SMOLLM2_STOPS = {0, 2}  # <|endoftext|>, <|im_end|> (= eos)


# -- metadata and tokenizers, built once per session -----------------------------------------

@cache
def smollm2_metadata(path: Path) -> dict:
    return GGUFFile(path).metadata


@cache
def llama3_metadata(tok_dir: Path) -> dict:
    """GGUF tokenizer metadata from tokenizer.json, laid out as llama.cpp's converter does."""
    spec = json.loads((tok_dir / "tokenizer.json").read_text(encoding="utf-8"))
    added = {a["id"]: a for a in spec["added_tokens"]}
    n = max(max(spec["model"]["vocab"].values()), max(added)) + 1
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = np.full(n, 5, np.int32)  # unused unless filled below
    for text, i in spec["model"]["vocab"].items():
        tokens[i], types[i] = text, 1
    for i, a in added.items():
        tokens[i], types[i] = a["content"], CONTROL if a["special"] else USER_DEFINED
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "llama-bpe",
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": spec["model"]["merges"],
            "tokenizer.ggml.bos_token_id": 128000, "tokenizer.ggml.eos_token_id": 128009,
            "tokenizer.ggml.add_bos_token": True}


@cache
def smollm2_tokenizer(path: Path) -> Tokenizer:
    return Tokenizer.from_metadata(smollm2_metadata(path))


@cache
def llama3_tokenizer(tok_dir: Path) -> Tokenizer:
    return Tokenizer.from_metadata(llama3_metadata(tok_dir))


@pytest.fixture(scope="session")
def smol(smollm2_gguf) -> Tokenizer:
    return smollm2_tokenizer(smollm2_gguf)


@pytest.fixture(scope="session")
def llama3(llama3_tokenizer_dir) -> Tokenizer:
    return llama3_tokenizer(llama3_tokenizer_dir)


@pytest.fixture(scope="session")
def corpus() -> str:
    return CORPUS_PATH.read_bytes().decode("utf-8")  # keeps its \r\n runs


def _hf_from_metadata(meta: dict, pre_tokenizer) -> tokenizers.Tokenizer:
    """HF tokenizer over a GGUF vocabulary (SmolLM2 ships no tokenizer.json in the GGUF)."""
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    vocab = {t: i for i, t in enumerate(tokens)}  # added tokens too, as tokenizer.json lists them
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    hf = tokenizers.Tokenizer(models.BPE(vocab, merges))
    hf.pre_tokenizer = pre_tokenizer
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([tokenizers.AddedToken(tokens[i], special=True, normalized=False)
                           for i in np.flatnonzero(np.asarray(types) == CONTROL)])
    return hf


@pytest.fixture(scope="session")
def hf_smol(smollm2_gguf) -> tokenizers.Tokenizer:
    # SmolLM2's tokenizer.json: Digits(individual_digits) then ByteLevel with GPT-2's regex.
    return _hf_from_metadata(smollm2_metadata(smollm2_gguf), pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]))


@pytest.fixture(scope="session")
def hf_llama3(llama3_tokenizer_dir) -> tokenizers.Tokenizer:
    spec = json.loads((llama3_tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    # This copy predates `ignore_merges`; Meta's current tokenizer.json sets it (a word that
    # is a whole token is not re-merged), matching Meta's tiktoken reference and llama.cpp.
    spec["model"]["ignore_merges"] = True
    return tokenizers.Tokenizer.from_str(json.dumps(spec))


def _hf_ids(hf: tokenizers.Tokenizer, text: str) -> list[int]:
    return hf.encode(text, add_special_tokens=False).ids


# -- corpus equality ----------------------------------------------------------------------------

def test_corpus_file_matches_generator(corpus):
    assert corpus == build_corpus()
    assert len(corpus.encode()) > 300_000
    for marker in ("DON'T", "\t\t", "日本語", "🤖", "العربية", "עברית", "fn main", "SELECT"):
        assert marker in corpus


@pytest.mark.parametrize("name", ["llama3", "smol"])
def test_corpus_ids_match_hf(name, request, corpus):
    tok = request.getfixturevalue(name)
    hf = request.getfixturevalue(f"hf_{name}")
    assert tok.encode(corpus) == _hf_ids(hf, corpus)
    paragraphs = corpus.split("\n\n")
    assert len(paragraphs) > 1000
    mismatched = [p for p in paragraphs if tok.encode(p) != _hf_ids(hf, p)]
    assert mismatched == []


def test_llama3_matches_meta_tiktoken_file(llama3, llama3_tokenizer_dir, corpus):
    ranks = {}
    for line in (llama3_tokenizer_dir / "tokenizer.model").read_bytes().splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    meta = tiktoken.Encoding("meta", pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
                             special_tokens={})
    assert llama3.encode(corpus) == meta.encode_ordinary(corpus)


def _converter_metadata(tok) -> dict:
    """quant.hf_tokenizer's TokenizerMeta under the GGUF keys quant/convert.py writes."""
    keys = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id",
            "pad": "padding_token_id"}
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": tok.pre,
            "tokenizer.ggml.tokens": tok.tokens, "tokenizer.ggml.token_type": np.asarray(tok.token_types),
            "tokenizer.ggml.merges": tok.merges}
    meta.update({f"tokenizer.ggml.{keys[k]}": v for k, v in tok.special_ids.items()})
    meta.update({f"tokenizer.ggml.add_{k}_token": v for k, v in tok.add_special.items()})
    return meta


@pytest.mark.parametrize("source", ["tokenizer.json", "tokenizer.model"])
def test_llama3_through_hf_converter(source, llama3, llama3_tokenizer_dir, tmp_path, corpus):
    from edgellama.quant.hf_tokenizer import load_tokenizer
    for name in (source, "tokenizer_config.json"):
        (tmp_path / name).write_bytes((llama3_tokenizer_dir / name).read_bytes())
    tok = Tokenizer.from_metadata(_converter_metadata(load_tokenizer(tmp_path, 128256, {})))
    assert (tok.vocab_size, tok.bos_id, tok.add_bos) == (128256, 128000, True)
    assert tok.stop_ids == LLAMA3_STOPS
    assert tok.encode(corpus) == llama3.encode(corpus)
    assert tok.encode_special("<|start_header_id|>") == [128006]


def test_gpt2_pre_tokenizer_matches_hf(smollm2_gguf, corpus):
    meta = dict(smollm2_metadata(smollm2_gguf), **{"tokenizer.ggml.pre": "gpt-2"})
    hf = _hf_from_metadata(meta, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    text = corpus[:60_000]
    assert Tokenizer.from_metadata(meta).encode(text) == _hf_ids(hf, text)


@pytest.mark.parametrize("name", ["llama3", "smol"])
def test_round_trip(name, request, corpus):
    tok = request.getfixturevalue(name)
    assert tok.decode(tok.encode(corpus)) == corpus
    ids = tok.encode("héllo 🦙 世界")
    assert b"".join(tok.token_bytes(i) for i in ids) == "héllo 🦙 世界".encode()


def test_smollm2_digits_split_one_by_one(smol):
    pieces = [smol.decode([i]) for i in smol.encode("In 2024,  12345 apples")]
    assert pieces[:2] == ["In", " "] and pieces[2:6] == ["2", "0", "2", "4"]
    assert "".join(pieces) == "In 2024,  12345 apples"
    assert pieces[6:9] == [",", "  ", "1"]  # whitespace run before a digit stays whole


# -- special tokens -------------------------------------------------------------------------------

@pytest.mark.parametrize("name,special", [
    ("llama3", "<|eot_id|>"), ("llama3", "<|begin_of_text|>"), ("llama3", "<|start_header_id|>"),
    ("smol", "<|im_end|>"), ("smol", "<|im_start|>"), ("smol", "<|endoftext|>")])
def test_special_token_text_is_plain_text(name, special, request):
    tok, hf = request.getfixturevalue(name), request.getfixturevalue(f"hf_{name}")
    text = f"Please type {special} here{special}\n{special}"
    ids = tok.encode(text)
    assert not set(ids) & set(np.flatnonzero(tok.token_types == CONTROL).tolist())
    hf.encode_special_tokens = True  # HF's "split special tokens": the same plain-text reading
    try:
        assert ids == _hf_ids(hf, text)
    finally:
        hf.encode_special_tokens = False
    assert tok.decode(ids) == text
    special_id = tok.tokens.index(special)
    assert tok.encode_special(text).count(special_id) == 3


@pytest.mark.parametrize("name", ["llama3", "smol"])
def test_encode_special_matches_hf(name, request, corpus):
    tok, hf = request.getfixturevalue(name), request.getfixturevalue(f"hf_{name}")
    specials = sorted(tok.special_tokens)
    paragraphs = corpus.split("\n\n")[:300]
    text = "".join(p + specials[k % len(specials)] for k, p in enumerate(paragraphs))
    ids = tok.encode_special(text)
    assert ids == _hf_ids(hf, text)
    assert sum(i in tok.special_tokens.values() for i in ids) == len(paragraphs)


def test_stop_ids(llama3, smol):
    assert llama3.stop_ids == LLAMA3_STOPS
    assert smol.stop_ids == SMOLLM2_STOPS
    assert [llama3.tokens[i] for i in sorted(llama3.stop_ids)] == [
        "<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]


def test_ids_and_flags(llama3, smol):
    assert (llama3.bos_id, llama3.eos_id, llama3.add_bos, llama3.vocab_size) == (128000, 128009, True, 128257)
    assert (smol.bos_id, smol.eos_id, smol.add_bos, smol.vocab_size) == (1, 2, False, 49152)
    assert llama3.is_llama3 and not smol.is_llama3


def test_add_bos_defaults_follow_llama_cpp(llama3_tokenizer_dir, smollm2_gguf):
    l3 = {k: v for k, v in llama3_metadata(llama3_tokenizer_dir).items()
          if k != "tokenizer.ggml.add_bos_token"}
    assert Tokenizer.from_metadata(l3).add_bos is True
    sm = {k: v for k, v in smollm2_metadata(smollm2_gguf).items()
          if k != "tokenizer.ggml.add_bos_token"}
    assert Tokenizer.from_metadata(sm).add_bos is False


def test_decode_hides_control_tokens(llama3):
    ids = llama3.encode_special("<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>")
    assert llama3.decode(ids) == "user\n\nHi"
    assert llama3.decode(ids, special=True) == "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
    assert llama3.token_bytes(128009) == b"<|eot_id|>"


# -- streaming --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["llama3", "smol"])
def test_stream_decoder_holds_split_characters(name, request):
    tok = request.getfixturevalue(name)
    for text in ("🦙", "🤖👍🏽", "吾輩は猫", "👨‍👩‍👧‍👦"):
        ids = tok.encode(text)
        partial = [i for i in ids if tok.token_bytes(i).decode("utf-8", "ignore") == ""]
        assert partial, f"{text!r} should need a token holding part of a character"
        stream = StreamDecoder(tok)
        pieces = [stream.push(i) for i in ids]
        assert "".join(pieces) + stream.flush() == text
        assert all("\ufffd" not in p for p in pieces)
        assert pieces[ids.index(partial[0])] == ""


@pytest.mark.parametrize("name", ["llama3", "smol"])
def test_stream_decoder_on_corpus(name, request, corpus):
    tok = request.getfixturevalue(name)
    text = corpus[:40_000]
    stream = StreamDecoder(tok)
    pieces = [stream.push(i) for i in tok.encode(text)]
    assert "".join(pieces) + stream.flush() == text


def test_stream_decoder_prints_no_control_or_stop_tokens(llama3, smol):
    stream = StreamDecoder(llama3)
    ids = llama3.encode_special("<|start_header_id|>assistant<|end_header_id|>\n\nOK<|eot_id|>")
    assert "".join(stream.push(i) for i in ids + [128001, 128008]) == "assistant\n\nOK"
    stream = StreamDecoder(smol)
    assert "".join(stream.push(i) for i in smol.encode_special("Hi<|im_end|><|endoftext|>")) == "Hi"


def test_stream_decoder_flush_replaces_unfinished_character(llama3):
    stream = StreamDecoder(llama3)
    first = llama3.encode("🦙")[0]
    assert stream.push(first) == ""
    assert stream.flush() == "\ufffd"


# -- vocabulary layouts ---------------------------------------------------------------------------

def test_ids_out_of_merge_order_use_rank_table(smollm2_gguf, smol, corpus):
    meta = smollm2_metadata(smollm2_gguf)
    n = len(meta["tokenizer.ggml.tokens"])
    perm = np.random.default_rng(0).permutation(n)  # old id -> new id
    tokens, types = [None] * n, np.empty(n, np.int32)
    for old, new in enumerate(perm.tolist()):
        tokens[new], types[new] = meta["tokenizer.ggml.tokens"][old], meta["tokenizer.ggml.token_type"][old]
    shuffled = Tokenizer.from_metadata(dict(meta, **{
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": int(perm[1]), "tokenizer.ggml.eos_token_id": int(perm[2]),
        "tokenizer.ggml.unknown_token_id": int(perm[0]), "tokenizer.ggml.padding_token_id": int(perm[2])}))
    text = corpus[:50_000] + "a\x04b"
    assert shuffled.encode(text) == perm[smol.encode(text)].tolist()
    assert shuffled.encode_special("<|im_start|>x") == perm[smol.encode_special("<|im_start|>x")].tolist()
    assert shuffled.stop_ids == {int(perm[0]), int(perm[2])}
    assert shuffled.decode(shuffled.encode(text)) == text.replace("\x04", "")


def test_byte_without_token_is_dropped(smol):
    # SmolLM2 has no token for byte 0x04; llama.cpp and HF drop such a byte.
    ids = smol.encode("a\x04b")
    assert max(ids) < smol.vocab_size
    assert ids == smol.encode("a") + smol.encode("b")


def test_user_defined_tokens_match_in_plain_text(smollm2_gguf):
    meta = smollm2_metadata(smollm2_gguf)
    meta = dict(meta, **{"tokenizer.ggml.tokens": [*meta["tokenizer.ggml.tokens"], "<tool>"],
                         "tokenizer.ggml.token_type": np.append(meta["tokenizer.ggml.token_type"],
                                                                USER_DEFINED)})
    tok = Tokenizer.from_metadata(meta)
    assert tok.encode("a<tool>b").count(49152) == 1
    assert 1 not in tok.encode("<|im_start|>")  # control tokens still plain


# -- errors -----------------------------------------------------------------------------------------

def _smol_meta_with(smollm2_gguf, **changes) -> dict:
    return dict(smollm2_metadata(smollm2_gguf), **{f"tokenizer.ggml.{k}": v for k, v in changes.items()})


def test_unknown_pre_tokenizer_is_an_error(smollm2_gguf):
    with pytest.raises(EdgeError, match=r"'deepseek-llm'.*supported: llama-bpe, llama3, "
                                        r"llama-v3, smollm, gpt-2, qwen2"):
        Tokenizer.from_metadata(_smol_meta_with(smollm2_gguf, pre="deepseek-llm"))
    meta = {k: v for k, v in smollm2_metadata(smollm2_gguf).items() if k != "tokenizer.ggml.pre"}
    with pytest.raises(EdgeError, match="None"):
        Tokenizer.from_metadata(meta)


def test_unsupported_tokenizer_model_is_an_error(smollm2_gguf):
    with pytest.raises(EdgeError, match="'t5'"):
        Tokenizer.from_metadata(_smol_meta_with(smollm2_gguf, model="t5"))


@pytest.mark.parametrize("key", ["bos", "eos", "eot", "padding", "unknown"])
def test_special_id_outside_vocabulary_is_an_error(smollm2_gguf, key):
    with pytest.raises(EdgeError, match=re.escape(f"{key}_token_id is 49152")):
        Tokenizer.from_metadata(_smol_meta_with(smollm2_gguf, **{f"{key}_token_id": 49152}))


def test_malformed_vocabularies_are_errors(smollm2_gguf):
    meta = smollm2_metadata(smollm2_gguf)
    with pytest.raises(EdgeError, match="merges"):
        Tokenizer.from_metadata(_smol_meta_with(smollm2_gguf, merges=["Ġ t", "Ġ a x"]))
    with pytest.raises(EdgeError, match="merges"):
        Tokenizer.from_metadata(_smol_meta_with(smollm2_gguf, merges=["Ġ t", "a\nb c"]))
    with pytest.raises(EdgeError, match="not in tokenizer.ggml.tokens"):
        Tokenizer.from_metadata(_smol_meta_with(smollm2_gguf, merges=["Ġ t", "zzzq qqqz"]))
    tokens = list(meta["tokenizer.ggml.tokens"])
    tokens[100] = "has space"
    with pytest.raises(EdgeError, match="'has space' is not a byte-level"):
        Tokenizer.from_metadata(_smol_meta_with(smollm2_gguf, tokens=tokens))
    with pytest.raises(EdgeError, match="token_type has 3 entries"):
        Tokenizer.from_metadata(_smol_meta_with(smollm2_gguf, token_type=np.ones(3, np.int32)))
    with pytest.raises(EdgeError, match="add_bos_token is set"):
        Tokenizer.from_metadata({k: v for k, v in _smol_meta_with(smollm2_gguf, add_bos_token=True).items()
                                 if k != "tokenizer.ggml.bos_token_id"})


def _smol_meta_plus(smollm2_gguf, token: str, token_type: int) -> dict:
    """SmolLM2's metadata with one more token at the end (no merge refers to it)."""
    meta = smollm2_metadata(smollm2_gguf)
    types = np.append(np.array(meta["tokenizer.ggml.token_type"]), token_type)
    return _smol_meta_with(smollm2_gguf, tokens=list(meta["tokenizer.ggml.tokens"]) + [token],
                           token_type=types)


@pytest.mark.parametrize("token_type", [1, CONTROL, USER_DEFINED])
def test_empty_token_gets_llama_cpps_name(smollm2_gguf, smol, token_type):
    """An empty token is llama.cpp's [EMPTY_<id>], as in the SentencePiece vocabulary: an
    empty control token in tiktoken's special-token regex matched everywhere and
    encode_special never returned."""
    tok = Tokenizer.from_metadata(_smol_meta_plus(smollm2_gguf, "", token_type))
    assert tok.tokens[-1] == f"[EMPTY_{smol.vocab_size}]"
    text = "<|im_start|>user\nhello<|im_end|>"
    assert tok.encode_special(text) == smol.encode_special(text)
    assert tok.encode("hello") == smol.encode("hello")


@pytest.mark.parametrize("token_type", [1, CONTROL])
def test_duplicate_tokens_are_an_error(smollm2_gguf, token_type):
    # llama.cpp refuses such a vocabulary (its token -> id map would lose one)
    with pytest.raises(EdgeError, match="tokenizer.ggml.tokens has 1 duplicate tokens"):
        Tokenizer.from_metadata(_smol_meta_plus(smollm2_gguf, "<|im_start|>", token_type))


@pytest.mark.parametrize("count,length", [(20000, 8), (3, 100000), (2100, 128)])
def test_special_tokens_beyond_what_a_regex_takes_are_refused(smollm2_gguf, count, length):
    """Control tokens become one regex; a hostile vocabulary must not make it take seconds
    and gigabytes (or fail inside tiktoken)."""
    meta = smollm2_metadata(smollm2_gguf)
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = np.array(meta["tokenizer.ggml.token_type"])
    tokens[-count:] = [f"<{i:0{length - 2}d}>" for i in range(count)]
    types[-count:] = CONTROL
    with pytest.raises(EdgeError, match="control/user-defined tokens of .* characters in all; at most"):
        Tokenizer.from_metadata(_smol_meta_with(smollm2_gguf, tokens=tokens, token_type=types))
