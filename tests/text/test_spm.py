"""SentencePiece tokenizer (edgellama/spm.py) against llama.cpp (llama-cpp-python, vocab only)
on llama.cpp's own Gemma 3 GGUF: the same ids and text, on the byte-level tests' corpus, their
long runs of every character class, special-token texts and hostile input."""
from __future__ import annotations

import ctypes
import importlib.util
import random
import time

import numpy as np
import pytest
from test_tokenizer import corpus  # noqa: F401
from test_tokenizer_long import CONTEXTS, RUNS, _framed

from edgellama.errors import EdgeError
from edgellama.gguf import GGUFFile
from edgellama.spm import SentencePieceTokenizer
from edgellama.tokenizer import BYTE, CONTROL, USER_DEFINED, StreamDecoder, Tokenizer

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                reason="llama-cpp-python (the oracle) is not installed")

GEMMA_STOPS = {1, 106}   # <eos>, <end_of_turn>
END_S = 212              # "</s>"


@pytest.fixture(scope="session")
def gemma_meta(gemma_q4_k_m_gguf) -> dict:
    return GGUFFile(gemma_q4_k_m_gguf).metadata


@pytest.fixture(scope="session")
def gemma(gemma_meta) -> SentencePieceTokenizer:
    return Tokenizer.from_metadata(gemma_meta)


def _oracle(path):
    import llama_cpp
    return llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)


@pytest.fixture(scope="session")
def oracle(gemma_q4_k_m_gguf):
    return _oracle(gemma_q4_k_m_gguf)


@pytest.fixture(scope="session")
def prefixed_path(gemma_q4_k_m_gguf, tmp_path_factory):
    """Gemma's metadata (no tensors: llama.cpp reads the vocabulary only) with
    add_space_prefix = true, as Llama 2's SentencePiece files have it."""
    import gguf
    reader = gguf.GGUFReader(str(gemma_q4_k_m_gguf))
    path = tmp_path_factory.mktemp("spm") / "gemma-space-prefix.gguf"
    writer = gguf.GGUFWriter(str(path), reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = field.types[0]
        value = True if name == "tokenizer.ggml.add_space_prefix" else field.contents()
        writer.add_key_value(name, value, vtype,
                             field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


def _llama_ids(oracle, text: str, bos: bool = False, special: bool = False) -> list[int]:
    return oracle.tokenize(text.encode("utf-8"), add_bos=bos, special=special)


def _ours(tok, text: str, bos: bool = False, special: bool = False) -> list[int]:
    ids = tok.encode_special(text) if special else tok.encode(text)
    return [tok.bos_id] + ids if bos and tok.add_bos else ids


def _llama_text(oracle, ids: list[int], special: bool = False) -> bytes:
    """llama.cpp's detokenize (not llama-cpp-python's: its 32-byte piece buffer cuts
    Gemma's longest tokens)."""
    import llama_cpp
    n = 64 * len(ids) + 64
    buf = ctypes.create_string_buffer(n)
    arr = (llama_cpp.llama_token * len(ids))(*ids)
    got = llama_cpp.llama_detokenize(oracle._model.vocab, arr, len(ids), buf, n, False, special)
    assert got >= 0
    return buf.raw[:got]


# -- the vocabulary -------------------------------------------------------------------------------

def test_llama_model_gives_the_sentencepiece_tokenizer(gemma, oracle):
    import llama_cpp
    assert isinstance(gemma, SentencePieceTokenizer)
    assert (gemma.vocab_size, gemma.bos_id, gemma.eos_id, gemma.add_bos, gemma.add_space_prefix) == (
        262144, 2, 1, True, False)
    assert not gemma.is_llama3
    vocab = oracle._model.vocab
    eog = {i for i in range(gemma.vocab_size) if llama_cpp.llama_vocab_is_eog(vocab, i)}
    assert gemma.stop_ids == GEMMA_STOPS
    assert eog == GEMMA_STOPS | {END_S}   # see test_end_s_stays_a_user_defined_token


def test_loads_fast(gemma_meta):
    t0 = time.perf_counter()
    Tokenizer.from_metadata(gemma_meta)
    assert time.perf_counter() - t0 < 3.0   # measured 0.14 s for the 262,144 tokens


def test_every_token_prints_as_in_llama_cpp(gemma, oracle):
    import llama_cpp
    vocab, buf = oracle._model.vocab, ctypes.create_string_buffer(256)

    def piece(i: int, special: bool) -> bytes:
        n = llama_cpp.llama_token_to_piece(vocab, i, buf, 256, 0, special)
        return buf.raw[:n]

    ids = [i for i in range(gemma.vocab_size) if i != END_S]
    assert [gemma.token_bytes(i) for i in ids] == [piece(i, True) for i in ids]
    assert [gemma.decode_bytes([i]) for i in ids] == [piece(i, False) for i in ids]


def test_end_s_stays_a_user_defined_token(gemma, oracle):
    """The one deliberate difference: llama.cpp's list of end-of-generation texts has
    "</s>" (for PaddleOCR), so it makes Gemma's user-defined "</s>" (HTML's strikethrough
    end tag) a control token that stops generation and is no token in plain text. Here it
    is what the file and Gemma's own tokenizer say: text, as "<s>" is."""
    assert gemma.tokens[END_S] == "</s>" and gemma.token_types[END_S] == USER_DEFINED
    assert gemma.encode("a</s>b") == [236746, END_S, 236763]
    assert gemma.decode([END_S]) == "</s>" and END_S not in gemma.stop_ids
    assert END_S not in _llama_ids(oracle, "a</s>b")


# -- ids equal llama.cpp's --------------------------------------------------------------------------

@pytest.mark.parametrize("bos,special", [(False, False), (True, False), (False, True), (True, True)])
def test_corpus_ids_match_llama_cpp(gemma, oracle, corpus, bos, special):
    assert _ours(gemma, corpus, bos, special) == _llama_ids(oracle, corpus, bos, special)
    paragraphs = sorted(set(corpus.split("\n\n")))
    assert len(paragraphs) > 1000
    bad = [p for p in paragraphs
           if _ours(gemma, p, bos, special) != _llama_ids(oracle, p, bos, special)]
    assert bad == []


@pytest.mark.parametrize("n", [1, 7, 100, 1000])
def test_runs_of_every_character_class_match_llama_cpp(gemma, oracle, n):
    bad = [cls for cls, unit in RUNS.items()
           if gemma.encode(t := _framed(unit, n)) != _llama_ids(oracle, t)]
    assert bad == []


# Gemma's control tokens, user-defined ones (tags, runs of spaces, tabs and newlines), a byte
# token's text, and text that merely looks like them
SPECIAL_TEXTS = ["<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "<pad>", "<unk>", "<mask>",
                 "<unused17>", "[multimodal]", "<start_of_image>", "<b>", "</td>", "<s>",
                 "<0x41>", "<0x0A>", "  ", "\t\t\t", "\n\n", " " * 40, "<start_of_turn",
                 "<<b>>", "<su<sub>b>", "▁", "▁▁Hello"]


@pytest.mark.parametrize("special", SPECIAL_TEXTS)
def test_special_token_texts_match_llama_cpp(gemma, oracle, special):
    text = f"Please type {special} here{special}\n{special}x {special}"
    for parse in (False, True):
        assert _ours(gemma, text, True, parse) == _llama_ids(oracle, text, True, parse)
    plain = gemma.encode(text)
    assert not set(plain) & set(np.flatnonzero(gemma.token_types == CONTROL).tolist())
    assert gemma.decode(plain) == text.replace("▁", " ")


def test_control_tokens_only_in_encode_special(gemma):
    turn = "<start_of_turn>user\nHi<end_of_turn>\n"
    assert gemma.encode_special(turn)[:1] == [105] and 106 in gemma.encode_special(turn)
    assert 105 not in gemma.encode(turn) and 106 not in gemma.encode(turn)
    # user-defined tokens are tokens in plain text too (llama.cpp and HF agree)
    assert gemma.encode("a<b>c").count(gemma.special_tokens["<b>"]) == 1
    assert gemma.token_types[gemma.special_tokens["<b>"]] == USER_DEFINED


def test_space_prefix_matches_llama_cpp(prefixed_path, corpus):
    """add_space_prefix (Gemma's is false): a space before the text and after each
    special token, and none in the decoded text."""
    tok, oracle = Tokenizer.from_metadata(GGUFFile(prefixed_path).metadata), _oracle(prefixed_path)
    assert tok.add_space_prefix
    texts = [corpus[:20_000], "Hello", " Hello", "", "<start_of_turn>user\nHi<end_of_turn>x",
             "a<b>b  c\n\nd"] + sorted(set(corpus.split("\n\n")))[:200]
    for text in texts:
        for bos, special in ((False, False), (True, True)):
            ids = _ours(tok, text, bos, special)
            assert ids == _llama_ids(oracle, text, bos, special), text
    ids = tok.encode("Hello world")
    assert tok.decode(ids) == "Hello world" == _llama_text(oracle, ids).decode()


# -- decoding -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("special", [False, True])
def test_decode_matches_llama_cpp(gemma, oracle, corpus, special):
    text = corpus[:60_000] + "<start_of_turn>user\n🦙 <unused3>  𒀀\x00<0x41><end_of_turn>"
    ids = [gemma.bos_id] + gemma.encode_special(text)
    assert gemma.decode_bytes(ids, special) == _llama_text(oracle, ids, special)
    assert gemma.decode(gemma.encode(corpus)) == corpus


STREAM_TEXTS = ["🦙", "🤖👍🏽", "吾輩は猫", "👨‍👩‍👧‍👦", "ᚠꙮ𝔘𓀀 runes", "\U0001FAE8 and \U000E0041"]


def test_stream_decoder_holds_split_characters(gemma):
    split = 0
    for text in STREAM_TEXTS:
        ids = gemma.encode(text)
        stream = StreamDecoder(gemma)
        pieces = [stream.push(i) for i in ids]
        assert "".join(pieces) + stream.flush() == text
        assert all("\ufffd" not in p for p in pieces)
        for k, i in enumerate(ids):   # a byte token that starts a character prints nothing
            if gemma.token_types[i] == BYTE and gemma.token_bytes(i)[0] >= 0xC0:
                assert pieces[k] == ""
                split += 1
    assert split, "some text should need byte fallback"


def test_stream_decoder_on_corpus_and_stop_tokens(gemma, corpus):
    text = corpus[:40_000]
    stream = StreamDecoder(gemma)
    assert "".join(stream.push(i) for i in gemma.encode(text)) + stream.flush() == text
    stream = StreamDecoder(gemma)
    ids = gemma.encode_special("<start_of_turn>model\nOK<end_of_turn><eos>")
    assert "".join(stream.push(i) for i in ids) == "model\nOK"
    stream = StreamDecoder(gemma)
    assert stream.push(gemma.encode("𓀀")[0]) == "" and stream.flush() == "\ufffd"


# -- long and hostile input ----------------------------------------------------------------------------

def test_100k_character_span_matches_llama_cpp_in_reasonable_time(gemma, oracle, corpus):
    """SentencePiece has no pre-tokenizer: a paragraph of 100k characters is one span
    of heap merges (a quadratic loop would take minutes)."""
    text = " ".join(corpus.split())[:100_000]
    assert "\n" not in text
    t0 = time.perf_counter()
    ids = gemma.encode(text)
    seconds = time.perf_counter() - t0
    assert ids == _llama_ids(oracle, text)
    assert seconds < 10.0   # measured 0.23 s (llama.cpp: 0.19 s)


RUN_UNITS = ["a", " ", "\n", "🦙", "\x00", "x ", "中", "<0x41>", "\t "]


@pytest.mark.parametrize("unit", RUN_UNITS)
def test_runs_of_one_unit_match_llama_cpp(gemma, oracle, unit):
    # 10k characters: llama.cpp's own special-token split is quadratic in the number of
    # pieces (100k of "\t " takes it 146 s; us 0.08 s)
    text = unit * (10_000 // len(unit))
    assert gemma.encode(text) == _llama_ids(oracle, text)


@pytest.mark.parametrize("unit", RUN_UNITS)
def test_long_runs_in_reasonable_time(gemma, unit):
    text = "Hi." + unit * (300_000 // len(unit)) + " word"
    t0 = time.perf_counter()
    ids = gemma.encode(text)
    assert time.perf_counter() - t0 < 30.0   # measured at most 1.9 s ("a": one span)
    assert gemma.decode(ids) == text


def test_lone_surrogates_and_invalid_utf8_become_replacement_characters(gemma, oracle):
    text = "ok \ud83e end \udfff"
    assert gemma.encode(text) == _llama_ids(oracle, "ok \ufffd end \ufffd")
    # a prompt file with invalid UTF-8, read with surrogateescape: each bad byte is U+FFFD
    raw = b"caf\xe9 \xff\xfe na\xc3\xafve \xe2\x82"
    assert gemma.encode(raw.decode("utf-8", "surrogateescape")) == _llama_ids(
        oracle, "caf\ufffd \ufffd\ufffd na\u00efve \ufffd\ufffd")


def test_nul_and_control_characters(gemma, oracle):
    text = "a\x00b\x01\x1b[0m\x7f\u200b\ufeff end"
    assert gemma.encode(text) == _llama_ids(oracle, text)
    assert gemma.decode(gemma.encode(text)) == text


# -- encode_stream -----------------------------------------------------------------------------------

def test_encode_stream_equals_encode(gemma, corpus):
    rng = random.Random(0)
    text = corpus[:80_000] + "\n" * 50 + "tail  \n\t\n" + " " * 40 + "\nend"
    cuts = sorted(rng.sample(range(len(text)), 300))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    parts = list(gemma.encode_stream(pieces))
    assert sum(parts, []) == gemma.encode(text)
    assert len(parts) > 100   # yielded as it goes, not all at the end


def test_encode_stream_keeps_the_space_prefix_rule(prefixed_path, corpus):
    tok = Tokenizer.from_metadata(GGUFFile(prefixed_path).metadata)
    text = corpus[:30_000] + "\n<b>\nx"
    pieces = [text[i:i + 997] for i in range(0, len(text), 997)]
    assert sum(tok.encode_stream(pieces), []) == tok.encode(text)


def test_encode_stream_refuses_a_huge_run_with_no_place_to_cut(gemma):
    with pytest.raises(EdgeError, match="more than 1000 characters in a row"):
        list(gemma.encode_stream(["word " * 300], max_held=1000))


# -- malformed vocabularies ----------------------------------------------------------------------------

def _with(meta: dict, **changes) -> dict:
    return dict(meta, **{f"tokenizer.ggml.{k}": v for k, v in changes.items()})


def test_malformed_vocabularies_are_errors(gemma_meta):
    n = len(gemma_meta["tokenizer.ggml.tokens"])
    scores = np.asarray(gemma_meta["tokenizer.ggml.scores"])
    cases = [
        (dict(scores=scores[:-1]), f"scores has {n - 1} entries for {n} tokens"),
        (dict(scores=np.where(np.arange(n) == 9, np.nan, scores)), "NaN or infinite"),
        (dict(scores=["1"] * n), "scores must be an array of numbers"),
        (dict(token_type=np.ones(3, np.int32)), "token_type has 3 entries"),
        (dict(bos_token_id=n), f"bos_token_id is {n}, outside"),
        (dict(eos_token_id="1"), "eos_token_id must be an integer"),
        (dict(add_space_prefix=1), "add_space_prefix must be a bool"),
    ]
    for changes, message in cases:
        with pytest.raises(EdgeError, match=message):
            Tokenizer.from_metadata(_with(gemma_meta, **changes))
    tokens = list(gemma_meta["tokenizer.ggml.tokens"])
    with pytest.raises(EdgeError, match="1 duplicate tokens"):
        Tokenizer.from_metadata(_with(gemma_meta, tokens=tokens[:-1] + [tokens[500]]))
    bad_byte = tokens[:238] + ["<0xZZ>"] + tokens[239:]
    with pytest.raises(EdgeError, match="byte token 238 is '<0xZZ>'"):
        Tokenizer.from_metadata(_with(gemma_meta, tokens=bad_byte))


def test_character_with_no_token_and_no_byte_token_is_an_error():
    tok = Tokenizer.from_metadata({
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>", "a", "▁"],
        "tokenizer.ggml.token_type": np.array([2, 3, 3, 1, 1], np.int32),
        "tokenizer.ggml.scores": np.zeros(5, np.float32)})
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.add_space_prefix) == (1, 2, True, True)
    assert tok.encode("a a") == [4, 3, 4, 3]
    with pytest.raises(EdgeError, match="no token for 'é' and no byte token <0xC3>"):
        tok.encode("é")
