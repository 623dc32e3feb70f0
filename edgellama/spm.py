"""SentencePiece-BPE tokenizer for GGUFs with `tokenizer.ggml.model = "llama"` (Gemma, Llama 2).

The vocabulary carries a score per token and no merge list: spaces are written as
U+2581 ("▁"), bytes with no token of their own as `<0x00>`..`<0xFF>`. Encoding follows
llama.cpp's `llm_tokenizer_spm` so that the ids are llama.cpp's:

1. Special tokens are cut out of the text first, longest token first, every occurrence
   left to right (`tokenizer_st_partition`). User-defined tokens always are (Gemma's runs
   of spaces, newlines and tabs, its HTML tags); control tokens only in `encode_special`.
2. Each remaining piece of text gets a leading space if `add_space_prefix` and it starts
   the text or follows a special token; spaces become "▁".
3. The piece is split into characters, and the adjacent pair whose concatenation is the
   highest-scoring token is merged (ties: the leftmost), again and again, from a heap:
   O(n log n) for a piece of n characters, however long (SentencePiece has no
   pre-tokenizer: a 100 KB paragraph is one piece).
4. A symbol that is a token is emitted; a character that is not becomes its UTF-8 bytes'
   `<0xXX>` tokens (byte fallback).

Decoding: "▁" becomes a space, byte tokens give their byte, control tokens their text
only when asked for; the StreamDecoder of edgellama.tokenizer holds back half characters.
"""
from __future__ import annotations

import heapq
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from edgellama.errors import EdgeError
from edgellama.tokenizer import (BYTE, CONTROL, MAX_HELD_CHARS, NORMAL, STOP_TOKEN_TEXTS, UNKNOWN,
                                 USER_DEFINED, TokenTable, _check_special_tokens, _meta,
                                 vocab_tokens)

SPACE = "\u2581"
# End-of-turn tokens llama.cpp stops at by their text (its special_eog_ids list), beyond
# those the byte-level vocabularies use: Gemma's <end_of_turn>, Phi-3's <|end|>.
SPM_STOP_TOKEN_TEXTS = (*STOP_TOKEN_TEXTS, "<end_of_turn>", "<|end|>", "<EOT>")
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SURROGATE = re.compile("[\ud800-\udfff]")
# tokenizer.ggml.<key>_token_id keys, and llama.cpp's defaults for a "llama" vocabulary.
_SPECIAL_ID_KEYS = ("bos", "eos", "eot", "eom", "unknown", "padding", "seperator")
_DEFAULT_IDS = {"bos": 1, "eos": 2, "unknown": 0}


class SentencePieceTokenizer(TokenTable):
    """Encode/decode for a "llama" (SentencePiece) GGUF vocabulary; the same interface as
    edgellama.tokenizer.Tokenizer. Build with `from_metadata`."""

    is_llama3 = False

    def __init__(self, tokens: list[str], token_types: np.ndarray, scores: np.ndarray,
                 special_ids: Mapping[str, int], add_bos: bool, add_space_prefix: bool,
                 chat_template: str | None):
        self.vocab_size = len(tokens)
        self.chat_template = chat_template
        self.tokens = tokens
        self.token_types = token_types
        self.bos_id = special_ids.get("bos")
        self.eos_id = special_ids.get("eos")
        self.add_bos = add_bos
        self.add_space_prefix = add_space_prefix
        if add_bos and self.bos_id is None:
            raise EdgeError("tokenizer.ggml.add_bos_token is set but the file has no bos_token_id")

        # Every token takes part in merges, whatever its type (as in llama.cpp).
        self._vocab = dict(zip(tokens, range(len(tokens))))   # tokens are distinct: vocab_tokens
        self._scores = scores.astype(np.float64).tolist()
        self._max_len = max(map(len, tokens))
        self._bytes = _token_bytes_table(tokens, token_types)
        self._byte_ids = _byte_token_ids(self._vocab)
        shown = (token_types == NORMAL) | (token_types == USER_DEFINED) | (token_types == BYTE)
        self._shown = [b if s else b"" for b, s in zip(self._bytes, shown.tolist())]

        # Control, user-defined and unknown tokens are cut out of text (llama.cpp's
        # cache_special_tokens); plain `encode` cuts the user-defined ones only.
        special = np.flatnonzero(np.isin(token_types, (CONTROL, USER_DEFINED, UNKNOWN))).tolist()
        self.special_tokens = {tokens[i]: i for i in special}
        _check_special_tokens(self.special_tokens)
        by_length = sorted(self.special_tokens.items(), key=lambda kv: -len(kv[0]))
        self._all_special = by_length
        self._user_defined = [(t, i) for t, i in by_length if token_types[i] == USER_DEFINED]

        named = {self._vocab.get(t) for t in SPM_STOP_TOKEN_TEXTS}
        self.stop_ids = frozenset(
            {i for i in named if i is not None}
            | {special_ids[k] for k in ("eos", "eot", "eom") if k in special_ids})
        self._stream_pairs: frozenset[str] | None = None

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> SentencePieceTokenizer:
        """Build from GGUF metadata; every value is type-checked (the file is untrusted)."""
        tokens = vocab_tokens(meta)
        n = len(tokens)
        types = _meta(meta, "tokenizer.ggml.token_type", np.ndarray, None)
        types = np.full(n, NORMAL, np.int32) if types is None else types.astype(np.int32)
        if len(types) != n:
            raise EdgeError(f"tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")
        scores = meta.get("tokenizer.ggml.scores")
        if scores is None:
            scores = np.zeros(n, np.float32)
        else:
            scores = np.asarray(scores) if isinstance(scores, (list, tuple, np.ndarray)) else None
            if scores is None or scores.ndim != 1 or scores.dtype.kind not in "iuf":
                raise EdgeError("metadata tokenizer.ggml.scores must be an array of numbers")
            if len(scores) != n:
                raise EdgeError(f"tokenizer.ggml.scores has {len(scores)} entries for {n} tokens")
            if not np.all(np.isfinite(scores)):
                raise EdgeError("tokenizer.ggml.scores holds NaN or infinite values")
        special_ids = {k: v for k, v in _DEFAULT_IDS.items() if v < n}
        for k in _SPECIAL_ID_KEYS:
            key = f"tokenizer.ggml.{k}_token_id"
            if key in meta:
                special_ids[k] = _meta(meta, key, int)
                if not 0 <= special_ids[k] < n:
                    raise EdgeError(f"{key} is {special_ids[k]}, outside the vocabulary of "
                                    f"{n} tokens")
        return cls(tokens, types, scores, special_ids,
                   _meta(meta, "tokenizer.ggml.add_bos_token", bool, True),
                   _meta(meta, "tokenizer.ggml.add_space_prefix", bool, True),
                   _meta(meta, "tokenizer.chat_template", str, None))

    # -- encoding -------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of plain text: control-token strings in it stay plain text;
        user-defined tokens are tokens wherever they appear (as in llama.cpp)."""
        return self._encode(text, self._user_defined, self.add_space_prefix)[0]

    def encode_special(self, text: str) -> list[int]:
        """Token ids with every control/user-defined token string recognised.

        Only for text whose special-token strings are trusted (rendered chat templates).
        """
        return self._encode(text, self._all_special, self.add_space_prefix)[0]

    def _encode(self, text: str, specials: list[tuple[str, int]], prefix: bool
                ) -> tuple[list[int], bool]:
        """Ids of `text`, and whether it ended in a special token. `prefix`: whether its
        first piece gets the leading space of add_space_prefix (it starts the text)."""
        if _SURROGATE.search(text):   # no UTF-8 for a lone surrogate: U+FFFD, as tiktoken does
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        ids: list[int] = []
        after_special = prefix
        for part in _partition(text, specials):
            if isinstance(part, int):
                ids.append(part)
                after_special = True
                continue
            if self.add_space_prefix and after_special:
                part = " " + part
            self._merge(part.replace(" ", SPACE), ids)
            after_special = False
        return ids, after_special

    def _merge(self, text: str, out: list[int]) -> None:
        """Append the ids of one piece (spaces already "▁"): highest-scoring adjacent pair
        first, ties to the leftmost, as llama.cpp's llm_tokenizer_spm."""
        n = len(text)
        if n == 0:
            return
        vocab, scores, max_len = self._vocab, self._scores, self._max_len
        # Symbol i covers text[i:i + size[i]]; a symbol merged into its left neighbour has
        # size 0, so a symbol's right neighbour is i + size[i] and prev[] links leftwards.
        size = [1] * n
        prev = list(range(-1, n - 1))
        heap = []
        for i in range(n - 1):
            tid = vocab.get(text[i:i + 2])
            if tid is not None:
                heap.append((-scores[tid], i, 2))
        heapq.heapify(heap)
        pop, push = heapq.heappop, heapq.heappush
        while heap:
            _, left, length = pop(heap)
            a = size[left]
            right = left + a
            # stale: either symbol has changed since the pair was pushed (sizes only grow)
            if a == 0 or right >= n or a + size[right] != length:
                continue
            size[left], size[right] = length, 0
            after = left + length
            if after < n:
                prev[after] = left
                pair = length + size[after]
                if pair <= max_len and (tid := vocab.get(text[left:left + pair])) is not None:
                    push(heap, (-scores[tid], left, pair))
            before = prev[left]
            if before >= 0:
                pair = size[before] + length
                if pair <= max_len and (tid := vocab.get(text[before:before + pair])) is not None:
                    push(heap, (-scores[tid], before, pair))
        i = 0
        while i < n:
            piece = text[i:i + size[i]]
            tid = vocab.get(piece)
            if tid is not None:
                out.append(tid)
            else:   # only a single character is ever not a token: byte fallback
                for b in piece.encode("utf-8"):
                    if self._byte_ids[b] < 0:
                        raise EdgeError(f"the vocabulary has no token for {piece!r} and no byte "
                                        f"token <0x{b:02X}> to spell it with")
                    out.append(self._byte_ids[b])
            i += size[i]

    def encode_stream(self, texts: Iterable[str], max_held: int = MAX_HELD_CHARS
                      ) -> Iterator[list[int]]:
        """Ids of "".join(texts) (as `encode` gives them), in order, in parts: each part is
        yielded as soon as no later text can change it. A part ends after a newline that
        no token joins to the next character (llama.cpp could never merge across it) and
        that no user-defined token spans. More than `max_held` characters without such a
        place is an EdgeError."""
        pairs = self._newline_pairs()
        reach = max((len(t) for t, _ in self._user_defined), default=1)
        tail, prefix = "", self.add_space_prefix
        for text in texts:
            start, tail = max(0, len(tail) - reach), tail + text
            cut, k = None, tail.rfind("\n", start, len(tail) - reach)
            while k >= 0 and cut is None:
                if (tail[k:k + 2].replace(" ", SPACE) not in pairs
                        and not self._inside_user_token(tail, k + 1)):
                    cut = k + 1
                k = tail.rfind("\n", start, k)
            if cut is not None:
                ids, prefix = self._encode(tail[:cut], self._user_defined, prefix)
                yield ids
                tail = tail[cut:]
            elif len(tail) > max_held:
                raise EdgeError(f"the text has more than {max_held} characters in a row with no "
                                f"place to split it (a newline the vocabulary never joins to the "
                                f"next character): text that long cannot be read in parts")
        yield self._encode(tail, self._user_defined, prefix)[0]

    def _newline_pairs(self) -> frozenset[str]:
        """Two-character strings starting with a newline that some token contains."""
        if self._stream_pairs is None:
            self._stream_pairs = frozenset(
                t[i:i + 2] for t in self.tokens if "\n" in t
                for i in range(len(t) - 1) if t[i] == "\n")
        return self._stream_pairs

    def _inside_user_token(self, text: str, cut: int) -> bool:
        """Whether an occurrence of a user-defined token spans position `cut`."""
        return any(text.startswith(t, i) for t, _ in self._user_defined
                   for i in range(max(0, cut - len(t) + 1), cut))

    # -- decoding -------------------------------------------------------------------------

    def decode_bytes(self, ids: Iterable[int], special: bool = False) -> bytes:
        ids = list(ids)
        out = super().decode_bytes(ids, special)
        # the space add_space_prefix put before the text (llama.cpp's detokenize drops it)
        table = self._bytes if special else self._shown
        if self.add_space_prefix and ids and table[ids[0]][:1] == b" ":
            out = out[1:]
        return out


def _partition(text: str, specials: list[tuple[str, int]]) -> list[str | int]:
    """`text` as plain-text pieces and special-token ids, as llama.cpp's
    tokenizer_st_partition cuts it: each token in turn, longest first, takes every
    occurrence (left to right, not overlapping) in the pieces still plain text."""
    parts: list[str | int] = [text] if text else []
    for token, tid in specials:
        if token not in text:
            continue
        cut: list[str | int] = []
        for part in parts:
            if isinstance(part, int) or token not in part:
                cut.append(part)
                continue
            for k, piece in enumerate(part.split(token)):
                if k:
                    cut.append(tid)
                if piece:
                    cut.append(piece)
        parts = cut
    return parts


def _byte_token_ids(vocab: Mapping[str, int]) -> list[int]:
    """Id of each byte's `<0xXX>` token; else, as llama.cpp, a token that is that
    character (ASCII only); -1 where neither exists."""
    ids = []
    for b in range(256):
        tid = vocab.get(f"<0x{b:02X}>")
        if tid is None and b < 0x80:
            tid = vocab.get(chr(b))
        ids.append(-1 if tid is None else tid)
    return ids


def _token_bytes_table(tokens: list[str], types: np.ndarray) -> list[bytes]:
    """Bytes of every token: normal tokens with "▁" as a space, byte tokens their byte,
    the others (control, user-defined, unknown) their text; unused tokens nothing (as
    llama.cpp prints them)."""
    sep = "\x00"
    joined = sep.join(tokens)
    if joined.count(sep) == len(tokens) - 1:   # one replace/encode/split at C speed
        out = joined.replace(SPACE, " ").encode("utf-8").split(sep.encode())
    else:
        out = [t.replace(SPACE, " ").encode("utf-8") for t in tokens]
    for i in np.flatnonzero(types != NORMAL).tolist():
        t = int(types[i])
        if t == BYTE:
            m = _BYTE_TOKEN.fullmatch(tokens[i])
            if m is None:
                raise EdgeError(f"byte token {i} is {tokens[i]!r}, not of the form <0xXX>")
            out[i] = bytes([int(m.group(1), 16)])
        elif t in (CONTROL, USER_DEFINED, UNKNOWN):
            out[i] = tokens[i].encode("utf-8")
        else:
            out[i] = b""
    return out
