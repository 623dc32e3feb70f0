"""Byte-level BPE tokenizer built from GGUF `tokenizer.ggml.*` metadata, run by tiktoken.

(SentencePiece vocabularies, tokenizer.ggml.model "llama", are edgellama/spm.py's;
`Tokenizer.from_metadata` picks by the model.)

A gpt2-type vocabulary becomes a `tiktoken.Encoding`: the 256 byte tokens plus every
merge result, ranked in merge order (tiktoken merges the adjacent pair whose
concatenation has the lowest rank, which is BPE when ranks follow the merge order).
Token ids are used as ranks directly when they already follow that order; otherwise
a rank -> id table translates tiktoken's output.

Plain `encode` never produces control tokens, whatever the text says; only
`encode_special` (for rendered chat templates) recognises them.
"""
from __future__ import annotations

import codecs
import re
import unicodedata
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import regex
import tiktoken

from edgellama.bytelevel import byte_to_unicode, token_bytes
from edgellama.errors import EdgeError

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# HF Digits(individual_digits=True) then ByteLevel's GPT-2 regex, as one regex: every
# digit is its own piece and acts as a piece boundary, so a whitespace run before a
# digit is kept whole ("end of piece" for `\s+(?!\S)`) instead of lending its last
# space to the next word.
SMOLLM_PATTERN = (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
                  r"|\s+(?![^\s\p{N}])|\s+")
# Qwen 2 / 2.5 / 3: Llama 3's regex with single digits
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# tokenizer.ggml.pre -> (regex, llama.cpp's default for add_bos_token)
PRE_TOKENIZERS = {
    "llama-bpe": (LLAMA3_PATTERN, True),
    "llama3": (LLAMA3_PATTERN, True),
    "llama-v3": (LLAMA3_PATTERN, True),
    "smollm": (SMOLLM_PATTERN, False),
    "gpt-2": (GPT2_PATTERN, False),
    "qwen2": (QWEN2_PATTERN, False),
}
# Pre-tokenizers whose tokenizer.json normalizes text to NFC first (Qwen's does; the ids
# then equal HF's for text in any normal form)
NFC_PRE = frozenset({"qwen2"})

# Texts longer than this many characters are cut into pieces before tiktoken sees them:
# its regex engine (fancy-regex) panics with a stack overflow on a whitespace run of
# about a million characters (tiktoken issues #15, #245), whatever the pattern.
LONG_TEXT_CHARS = 1 << 15

# A safe cut: after a letter that is followed by an ASCII non-letter. Under every
# pattern above, a piece holding a letter ends with its letter run (`\p{L}+`, or a
# contraction `'s`... whose letters a non-letter cannot continue), and no alternative
# reads past a letter except `\p{L}+`, which stops at the non-letter either way; with
# no lookbehind or anchors, the text after the cut splits as it would on its own. So
# the pieces of text[:cut] and text[cut:] are exactly those of the text. The letter is
# also checked with str.isalpha (Python's older Unicode tables): a letter in every
# Unicode version the regex engines involved (tiktoken's, HF's, `regex`) may use.
_CUT = regex.compile(r"\p{L}(?=[\x00-\x40\x5b-\x60\x7b-\x7f])")
# encode_stream: characters held back at most while waiting for a place to cut.
MAX_HELD_CHARS = 1 << 24
_SURROGATE = re.compile("[\ud800-\udfff]")

# Texts of end-of-turn / end-of-text tokens across the vocabularies we run.
STOP_TOKEN_TEXTS = ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|im_end|>", "<|endoftext|>")

# tokenizer.ggml.<key>_token_id keys ("seperator" is llama.cpp's spelling).
_SPECIAL_ID_KEYS = ("bos", "eos", "eot", "eom", "unknown", "padding", "seperator")


_MISSING = object()
_KIND = {str: "a string", int: "an integer", bool: "a bool", list: "an array of strings",
         np.ndarray: "an array of integers"}


def _meta(meta: Mapping[str, Any], key: str, kind: type, default: Any = _MISSING) -> Any:
    """meta[key], checked to be of `kind` (str, int, bool, list of str, integer ndarray)."""
    if key not in meta:
        if default is _MISSING:
            raise EdgeError(f"metadata key {key!r} is missing")
        return default
    v = meta[key]
    if kind is int:
        ok = isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))
        v = int(v) if ok else v
    elif kind is bool:
        ok = isinstance(v, (bool, np.bool_))
        v = bool(v) if ok else v
    elif kind is list:
        v = list(v) if isinstance(v, (list, tuple)) else v
        ok = isinstance(v, list) and all(isinstance(x, str) for x in v)
    elif kind is np.ndarray:
        v = np.asarray(v) if isinstance(v, (list, tuple, np.ndarray)) else v
        ok = isinstance(v, np.ndarray) and v.ndim == 1 and (v.dtype.kind in "iu" or v.size == 0)
        if ok and v.size and (v.min() < 0 or v.max() > BYTE):
            raise EdgeError(f"metadata {key} holds values outside 0..{BYTE}")
    else:
        ok = isinstance(v, kind)
    if not ok:
        got = type(v).__name__ if not isinstance(v, np.ndarray) else f"an array of {v.dtype}"
        raise EdgeError(f"metadata {key} must be {_KIND[kind]}, got {got}")
    return v


def vocab_tokens(meta: Mapping[str, Any]) -> list[str]:
    """tokenizer.ggml.tokens, checked as llama.cpp loads every vocabulary: not empty, no
    token twice (a text -> id map would lose one), an empty token named [EMPTY_<id>] (an
    empty special token would match everywhere: tiktoken's regex of them never ends)."""
    tokens = _meta(meta, "tokenizer.ggml.tokens", list)
    if not tokens:
        raise EdgeError("tokenizer.ggml.tokens is empty")
    if "" in tokens:
        tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    twice = len(tokens) - len(set(tokens))
    if twice:
        raise EdgeError(f"tokenizer.ggml.tokens has {twice} duplicate tokens")
    return tokens


class TokenTable:
    """Decoding, shared by both tokenizers (Tokenizer, spm.SentencePieceTokenizer): a
    subclass sets vocab_size, stop_ids, _bytes (each token's bytes) and _shown (the bytes
    a user sees: none for control tokens)."""

    vocab_size: int
    stop_ids: frozenset[int]
    _bytes: list[bytes]
    _shown: list[bytes]

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes of one token (special tokens give their text)."""
        return self._bytes[token_id]

    def decode(self, ids: Iterable[int], special: bool = False) -> str:
        """Text of `ids`; control tokens are left out unless `special`."""
        return self.decode_bytes(ids, special).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: Iterable[int], special: bool = False) -> bytes:
        table = self._bytes if special else self._shown
        ids = list(ids)
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            raise IndexError(f"token id out of range 0..{self.vocab_size - 1}")
        return b"".join([table[i] for i in ids])

    def shown_bytes(self, token_id: int) -> bytes:
        """Bytes a user sees for one token: nothing for control and stop tokens."""
        return b"" if token_id in self.stop_ids else self._shown[token_id]


class Tokenizer(TokenTable):
    """Encode/decode for one GGUF vocabulary. Build with `from_metadata`."""

    def __init__(self, tokens: list[str], token_types: np.ndarray, merges: list[str], pre: str,
                 special_ids: Mapping[str, int], add_bos: bool | None, chat_template: str | None):
        self.vocab_size = len(tokens)
        self.chat_template = chat_template
        self.tokens = tokens
        self.token_types = token_types
        self._check_special_ids(special_ids)
        self.bos_id = special_ids.get("bos")
        self.eos_id = special_ids.get("eos")
        pattern, default_add_bos = PRE_TOKENIZERS[pre]
        self._nfc = pre in NFC_PRE
        self.add_bos = default_add_bos if add_bos is None else add_bos
        if self.add_bos and self.bos_id is None:
            raise EdgeError("tokenizer.ggml.add_bos_token is set but the file has no bos_token_id")

        self._bytes = _token_bytes_table(tokens, token_types)
        # What a user sees: control/unknown/unused tokens print nothing (as llama.cpp prints
        # with special=false); normal and user-defined tokens print their bytes.
        shown = (token_types == NORMAL) | (token_types == USER_DEFINED) | (token_types == BYTE)
        self._shown = [b if s else b"" for b, s in zip(self._bytes, shown.tolist())]

        # Text -> id of every token that encode_special recognises.
        self.special_tokens = {tokens[i]: i for i in
                               np.flatnonzero(np.isin(token_types, (CONTROL, USER_DEFINED))).tolist()}
        _check_special_tokens(self.special_tokens)
        # Byte-level tokens by text: what bytes and merges refer to.
        level = np.flatnonzero((token_types == NORMAL) | (token_types == BYTE)).tolist()
        by_text = dict(zip([tokens[i] for i in level], level))
        named = {t: self.special_tokens.get(t, by_text.get(t)) for t in STOP_TOKEN_TEXTS}
        self.stop_ids = frozenset(
            {i for i in named.values() if i is not None}
            | {special_ids[k] for k in ("eos", "eot", "eom") if k in special_ids})
        self._encoding, self._rank_to_id = self._build_encoding(pattern, merges, by_text)
        self._pattern = regex.compile(pattern)   # the same pre-tokenizer, for long texts
        self.long_text_chars = LONG_TEXT_CHARS
        self._user_defined = {tokens[i] for i in np.flatnonzero(token_types == USER_DEFINED)}

    @property
    def is_llama3(self) -> bool:
        """Llama 3 vocabulary (has the header tokens of its turn format)."""
        return "<|start_header_id|>" in self.special_tokens

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Build from a GGUF metadata mapping (see edgellama.gguf.GGUFFile.metadata); a
        "llama" (SentencePiece) vocabulary gives an edgellama.spm.SentencePieceTokenizer,
        which has the same interface.

        Every value is type-checked first: the file is untrusted, and a wrong type
        (a string where an id belongs, an int array for the token list) is an EdgeError.
        """
        model = _meta(meta, "tokenizer.ggml.model", str, None)
        if model == "llama":   # SentencePiece (Gemma, Llama 2): its own module
            from edgellama.spm import SentencePieceTokenizer
            return SentencePieceTokenizer.from_metadata(meta)
        if model != "gpt2":
            raise EdgeError(f"unsupported tokenizer model {model!r}: supported are byte-level "
                            "BPE ('gpt2': Llama 3, SmolLM2, Qwen) and SentencePiece ('llama': "
                            "Gemma)")
        pre = _meta(meta, "tokenizer.ggml.pre", str, None)
        if pre not in PRE_TOKENIZERS:
            raise EdgeError(f"unsupported pre-tokenizer {pre!r} (tokenizer.ggml.pre); "
                            f"supported: {', '.join(PRE_TOKENIZERS)}")
        tokens = vocab_tokens(meta)
        types = _meta(meta, "tokenizer.ggml.token_type", np.ndarray, None)
        types = np.full(len(tokens), NORMAL, np.int32) if types is None else types.astype(np.int32)
        if len(types) != len(tokens):
            raise EdgeError(f"tokenizer.ggml.token_type has {len(types)} entries "
                            f"for {len(tokens)} tokens")
        special_ids = {k: _meta(meta, f"tokenizer.ggml.{k}_token_id", int) for k in _SPECIAL_ID_KEYS
                       if f"tokenizer.ggml.{k}_token_id" in meta}
        return cls(tokens, types, _meta(meta, "tokenizer.ggml.merges", list, []), pre, special_ids,
                   _meta(meta, "tokenizer.ggml.add_bos_token", bool, None),
                   _meta(meta, "tokenizer.chat_template", str, None))

    def _check_special_ids(self, special_ids: Mapping[str, int]) -> None:
        for name, tid in special_ids.items():
            if not 0 <= tid < self.vocab_size:
                raise EdgeError(f"tokenizer.ggml.{name}_token_id is {tid}, outside the "
                                f"vocabulary of {self.vocab_size} tokens")

    def _build_encoding(self, pattern: str, merges: list[str], by_text: dict[str, int]
                        ) -> tuple[tiktoken.Encoding, np.ndarray | None]:
        b2u = byte_to_unicode()
        byte_ids = [by_text.get(b2u[b]) for b in range(256)]
        merged_ids = _merge_result_ids(merges, by_text)
        special_ids = np.fromiter(self.special_tokens.values(), np.int64, len(self.special_tokens))
        if merged_ids.size < 2 or bool(np.all(np.diff(merged_ids) > 0)):
            # Ids already follow merge order: they are the ranks. A byte with no token
            # (SmolLM2 lacks a few never-seen bytes) still needs a rank or tiktoken panics:
            # it gets one past the vocabulary and is dropped from the output, as llama.cpp
            # and HF drop a byte that has no token.
            spare = iter(range(self.vocab_size, self.vocab_size + 256))
            byte_ranks = [next(spare) if i is None else i for i in byte_ids]
            merged_ranks, special_ranks, rank_to_id = merged_ids, special_ids, None
        else:
            # Ranks: bytes 0..255, merge results in merge order, then specials; a table
            # maps them back to ids (-1 for a byte with no token: dropped).
            byte_ranks = list(range(256))
            merged_ranks = np.arange(256, 256 + merged_ids.size)
            special_ranks = np.arange(special_ids.size) + 256 + merged_ids.size
            rank_to_id = np.concatenate([np.array([-1 if i is None else i for i in byte_ids]),
                                         merged_ids, special_ids])
        mergeable = {bytes([b]): r for b, r in enumerate(byte_ranks)}
        mergeable.update(zip([self._bytes[i] for i in merged_ids.tolist()], merged_ranks.tolist()))
        specials = dict(zip(self.special_tokens, special_ranks.tolist()))
        try:
            enc = tiktoken.Encoding(name="gguf", pat_str=pattern, mergeable_ranks=mergeable,
                                    special_tokens=specials)
        except ValueError as e:   # its regex of the special tokens would not compile
            raise EdgeError(f"the tokenizer cannot be built from this vocabulary: {e}") from None
        return enc, rank_to_id

    # -- encoding -------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of plain text: control-token strings in it stay plain text."""
        if self._nfc:
            text = unicodedata.normalize("NFC", text)
        if len(text) > self.long_text_chars:
            return self._to_ids(self._encode_long(text, self._user_defined))
        if self._user_defined:
            # User-defined (non-control) added tokens always match, as in llama.cpp and HF.
            ranks = self._encoding.encode(text, allowed_special=self._user_defined,
                                          disallowed_special=())
        else:
            ranks = self._encoding.encode_ordinary(text)
        return self._to_ids(ranks)

    def encode_special(self, text: str) -> list[int]:
        """Token ids with every control/user-defined token string recognised.

        Only for text whose special-token strings are trusted (rendered chat templates).
        """
        if self._nfc:
            text = unicodedata.normalize("NFC", text)
        if len(text) > self.long_text_chars:
            return self._to_ids(self._encode_long(text, self.special_tokens))
        return self._to_ids(self._encoding.encode(text, allowed_special="all"))

    def encode_stream(self, texts: Iterable[str], max_held: int = MAX_HELD_CHARS
                      ) -> Iterator[list[int]]:
        """Ids of "".join(texts) (as `encode` gives them), in order, in parts: each part is
        yielded as soon as no later text can change it, so a caller may stop early, and
        memory holds one text plus what follows the last safe cut (see _CUT; never inside
        a user-defined token). More than `max_held` characters without such a cut (a huge
        run of whitespace, digits or punctuation) is an EdgeError."""
        tail = ""
        # a cut is taken only where every user-defined token that could span it is in view
        reach = max(map(len, self._user_defined), default=1)
        for text in texts:
            start, tail = max(0, len(tail) - reach), tail + text
            cuts = [m.end() for m in _CUT.finditer(tail, start, len(tail) - reach + 2)
                    if tail[m.start()].isalpha()]
            cut = next((c for c in reversed(cuts) if not self._inside_user_token(tail, c)), None)
            if cut is not None:
                yield self.encode(tail[:cut])
                tail = tail[cut:]
            elif len(tail) > max_held:
                raise EdgeError(f"the text has more than {max_held} characters in a row with no "
                                f"place to split it (no letter followed by a space, digit or "
                                f"punctuation): a run of whitespace, digits or symbols that "
                                f"long cannot be read in parts")
        yield self.encode(tail)

    def _inside_user_token(self, text: str, cut: int) -> bool:
        """Whether an occurrence of a user-defined token spans position `cut`."""
        return any(text.startswith(t, i) for t in self._user_defined
                   for i in range(max(0, cut - len(t) + 1), cut))

    def _encode_long(self, text: str, allowed: Iterable[str]) -> list[int]:
        """Ranks of a text of any length: the special tokens in `allowed` are found first
        (leftmost, longest), and the plain text between them is encoded in safe pieces."""
        if _SURROGATE.search(text):   # as tiktoken does: a lone surrogate becomes U+FFFD
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        allowed = sorted(allowed)
        if not allowed:
            return self._encode_plain(text, 0, len(text))
        ranks: list[int] = []
        pos = 0
        specials = self._encoding._special_tokens
        for m in regex.finditer(r"\L<specials>", text, specials=allowed):
            ranks += self._encode_plain(text, pos, m.start())
            ranks.append(specials[m.group()])
            pos = m.end()
        return ranks + self._encode_plain(text, pos, len(text))

    def _encode_plain(self, text: str, pos: int, end: int) -> list[int]:
        """Ranks of text[pos:end] (no special tokens), for any length.

        tiktoken encodes it in parts of at most `long_text_chars`, cut where a letter
        ends (see _CUT). Where no letter ends in half that length (a long run of
        whitespace, digits, punctuation or one long word), the pieces come from the
        same pattern run by the `regex` module, which has no such limit, and each is
        BPE-encoded alone; any piece boundary is a place tiktoken can resume from.
        """
        ranks: list[int] = []
        limit = self.long_text_chars
        core = self._encoding._core_bpe
        while pos < end:
            if end - pos <= limit:
                ranks += core.encode_ordinary(text[pos:end])
                break
            lo, hi = pos + limit // 2, pos + limit
            cut = next((m.end() for m in _CUT.finditer(text, lo, hi + 1)
                        if text[m.start()].isalpha()), None)
            if cut is not None:
                ranks += core.encode_ordinary(text[pos:cut])
                pos = cut
                continue
            for piece in self._pattern.finditer(text, pos, end):
                ranks += core.encode_single_piece(piece.group().encode("utf-8"))
                pos = piece.end()
                if pos >= lo:
                    break
            else:   # nothing more the pattern matches (tiktoken drops such text too)
                break
        return ranks

    def _to_ids(self, ranks: list[int]) -> list[int]:
        if self._rank_to_id is not None:
            ids = self._rank_to_id[np.asarray(ranks, dtype=np.int64)]
            return ids[ids >= 0].tolist()
        if ranks and max(ranks) >= self.vocab_size:
            return [r for r in ranks if r < self.vocab_size]
        return ranks


class StreamDecoder:
    """Turns generated ids into printable text, holding back incomplete UTF-8 sequences."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._utf8.decode(self._tokenizer.shown_bytes(token_id))

    def flush(self) -> str:
        """Whatever is held back (an unfinished sequence becomes U+FFFD)."""
        return self._utf8.decode(b"", final=True)


# Control and user-defined tokens become one regex (tiktoken's, and the chat prompt's).
# Real vocabularies have a few hundred to a few thousand, of a few dozen characters.
MAX_SPECIAL_TOKENS = 1 << 14
MAX_SPECIAL_CHARS = 1 << 18


def _check_special_tokens(special: Mapping[str, int]) -> None:
    chars = sum(map(len, special))
    if len(special) > MAX_SPECIAL_TOKENS or chars > MAX_SPECIAL_CHARS:
        raise EdgeError(f"the vocabulary has {len(special)} control/user-defined tokens of "
                        f"{chars} characters in all; at most {MAX_SPECIAL_TOKENS} tokens and "
                        f"{MAX_SPECIAL_CHARS} characters are supported")


def _merge_result_ids(merges: list[str], by_text: dict[str, int]) -> np.ndarray:
    """Ids of the distinct merge results in order of first appearance (= BPE rank order)."""
    # Byte-level tokens contain neither space nor newline, so one join/replace/split over
    # all merges turns every "left right" into its result at C speed.
    joined = "\n".join(merges)
    pieces = joined.replace(" ", "").split("\n") if merges else []
    if joined.count(" ") != len(merges) or len(pieces) != len(merges):
        raise EdgeError("tokenizer.ggml.merges: every merge must be two tokens separated "
                        "by one space")
    results = dict.fromkeys(pieces)
    try:
        return np.fromiter(map(by_text.__getitem__, results), dtype=np.int64, count=len(results))
    except KeyError as exc:
        raise EdgeError(f"tokenizer.ggml.merges produces {exc.args[0]!r}, which is not in "
                        "tokenizer.ggml.tokens") from None


def _token_bytes_table(tokens: list[str], types: np.ndarray) -> list[bytes]:
    """Bytes of every token: byte-level decoding for normal tokens, UTF-8 text otherwise."""
    byte_level = (types == NORMAL) | (types == BYTE)
    level_idx = np.flatnonzero(byte_level).tolist()
    level = [tokens[i] for i in level_idx]
    # One translate + latin-1 encode over all normal tokens at once: each byte-level char
    # is one byte, so token lengths give the slice offsets. Chars outside the alphabet
    # map to U+FFFF, which latin-1 refuses.
    table = {ord(c): chr(b) for b, c in byte_to_unicode().items()}
    table.update({c: "\uffff" for c in range(256) if c not in table})
    try:
        blob = "".join(level).translate(table).encode("latin-1")
    except UnicodeEncodeError:
        bad = next(t for t in level if token_bytes(t) is None)
        raise EdgeError(f"normal token {bad!r} is not a byte-level (GPT-2 alphabet) string") from None
    bounds = [0, *np.cumsum(list(map(len, level))).tolist()]
    out: list[bytes] = [b""] * len(tokens)
    for i, start, end in zip(level_idx, bounds, bounds[1:]):
        out[i] = blob[start:end]
    for i in np.flatnonzero(~byte_level).tolist():
        out[i] = tokens[i].encode("utf-8")
    return out
