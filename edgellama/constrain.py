"""Grammar-constrained decoding: replies that always parse (JSON, a JSON schema, a grammar).

    grammar = json_schema_grammar(schema)          # or json_object_grammar(), gbnf_grammar(text)
    constraint = Constraint(tokenizer, grammar)   # EdgeError if it cannot be compiled
    constraint.mask(logits)                       # -inf on every token the grammar forbids
    constraint.advance(token)                     # after sampling from the masked logits

The grammar engine is llguidance (MIT, one Rust extension, no dependencies): of the
libraries measured on the 128K Llama 3 vocabulary (bench/bench_constraint.py, docs/server.md)
it is the fastest per token, compiles a schema in milliseconds (outlines-core builds a
whole-vocabulary index per schema: seconds), and bounds its own work per grammar and per
token (LLParserLimits), which is what lets a server take grammars from strangers.
xgrammar needs PyTorch.

Replies end within their budget: a JSON schema's numbers, strings and arrays get default
bounds where it sets none (bounded_schema), and with a token budget a reply steers to a
short valid end when the budget runs short (Constraint; constraint.mask(logits, left)).
Client schemas and grammars are checked before anything walks them: nesting (MAX_DEPTH),
GBNF rules (MAX_GBNF_RULES), a multipleOf the engine would take without end (MAX_STEP).

llguidance is given every token's exact bytes (edgellama.tokenizer's table), so a
byte-level BPE token that spans grammar symbols (`{"`, `":`, `},{`) is allowed exactly
when its bytes continue a valid output; control tokens are marked special, so they are
never allowed inside the grammar, and the stop tokens are its end of text: once the
output is complete, only a stop token can follow.
"""
from __future__ import annotations

import json
import math
import re
import threading
from typing import Any

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import gbnf_to_lark

from .errors import EdgeError
from .schema_copy import copy_schema
from .sampling import Sampler
from .tokenizer import BYTE, NORMAL, USER_DEFINED, Tokenizer

# Compact JSON with single spaces after ':' and ',': how models write JSON, and no
# freedom to emit whitespace forever (a flexible-whitespace grammar lets a small model
# pad with newlines until max_tokens).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_GRAMMAR_CHARS = 1 << 20   # a request's schema or grammar, as text
# Levels of nesting of a schema (objects and lists) and of a GBNF grammar (parentheses):
# deeper ones are refused before anything walks them (llguidance's own JSON reader stops
# at 128 levels, and the GBNF converter recurses once per level).
MAX_DEPTH = 100
# Rules of a GBNF grammar: the converter's work grows with their square (a chain of 4,000
# rules takes seconds); llama.cpp's own grammars have a few dozen.
MAX_GBNF_RULES = 500
_GBNF_RULE = re.compile(r"^[ \t]*[A-Za-z0-9_-]+[ \t]*::=", re.MULTILINE)
# llguidance's own bounds on a grammar's size and on the work of one mask (its defaults
# are in LLParserLimits' docstring); a hostile grammar fails to compile or stops, it
# does not hang the server.
LIMITS = dict(max_grammar_size=200_000, max_lexer_states=50_000, initial_lexer_fuel=1_000_000,
              step_lexer_fuel=200_000, step_max_items=50_000)

# A reply steers to its shortest end once its token budget is within CLOSE_MARGIN tokens
# of that end's length (a token taken freely may lengthen the end a little); the end is
# looked for only while the budget is within CLOSE_WINDOW tokens of the longest end seen
# (or of 64), and up to CLOSE_MAX bytes.
CLOSE_MARGIN = 4
CLOSE_WINDOW = 64
CLOSE_MAX = 512
_CLOSE_RETRY = 16     # tokens before looking again for an end that was not found
# The bytes tried first at each step of the search for a short end: outside a string
# the closers, a separator, then the shortest values; inside one, its end.
_OUTSIDE = b'}],"0ntf-123456789[{ :' + bytes(range(ord("a"), ord("z") + 1))
_INSIDE = b'"a0 '

_tokenizers: dict[int, tuple[Tokenizer, llguidance.LLTokenizer]] = {}
_tokenizers_lock = threading.Lock()
_tables: dict[int, tuple[Tokenizer, np.ndarray, dict[bytes, list[int]]]] = {}


class GrammarError(EdgeError):
    """The grammar failed while generating (a step over its limits, a rule that never
    ends): the request's grammar is at fault, not the server."""


class _Vocabulary(llguidance.TokenizerWrapper):
    """What llguidance.LLTokenizer reads from a tokenizer: token bytes, special ids, EOS."""

    def __init__(self, tokenizer: Tokenizer):   # noqa: super().__init__ wraps HF tokenizers
        self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        # control, unknown and unused tokens: never text a grammar can match
        text = np.isin(tokenizer.token_types, (NORMAL, BYTE, USER_DEFINED))
        self.special_token_ids = np.flatnonzero(~text).tolist()
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self.is_tokenizer_wrapper = True
        self._gtokenizer, self._accepts_bytes = tokenizer.encode, False


def grammar_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """llguidance's view of `tokenizer`, built once per tokenizer (it takes ~0.3 s)."""
    with _tokenizers_lock:
        hit = _tokenizers.get(id(tokenizer))
        if hit is None or hit[0] is not tokenizer:
            hit = (tokenizer, llguidance.LLTokenizer(_Vocabulary(tokenizer),
                                                     eos_token=sorted(tokenizer.stop_ids)))
            _tokenizers[id(tokenizer)] = hit
        return hit[1]


def _token_tables(tokenizer: Tokenizer) -> tuple[np.ndarray, dict[bytes, list[int]]]:
    """The text token of each single byte (-1 where none is), and the text tokens of
    each byte string: what steering toward a reply's end needs. Built once per
    tokenizer."""
    with _tokenizers_lock:
        hit = _tables.get(id(tokenizer))
        if hit is None or hit[0] is not tokenizer:
            single = np.full(256, -1, np.int64)
            by_bytes: dict[bytes, list[int]] = {}
            text = np.isin(tokenizer.token_types, (NORMAL, BYTE, USER_DEFINED))
            for i in np.flatnonzero(text).tolist():
                b = tokenizer.token_bytes(i)
                if b:
                    by_bytes.setdefault(b, []).append(i)
                    if len(b) == 1 and single[b[0]] < 0:
                        single[b[0]] = i
            hit = (tokenizer, single, by_bytes)
            _tables[id(tokenizer)] = hit
        return hit[1], hit[2]


def _in_string(state: tuple[bool, bool], data: bytes) -> tuple[bool, bool]:
    """(inside a JSON string, after its backslash) once `data` follows `state`."""
    inside, escaped = state
    for c in data:
        if escaped:
            escaped = False
        elif inside and c == 0x5C:
            escaped = True
        elif c == 0x22:
            inside = not inside
    return inside, escaped


def _checked_size(text: str, what: str) -> str:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise EdgeError(f"the {what} is {len(text)} characters long; at most "
                        f"{MAX_GRAMMAR_CHARS} are accepted")
    return text


def nests_deeper(value: Any, limit: int) -> bool:
    """Whether `value` (dicts, lists and scalars, as json.loads gives) nests its dicts and
    lists more than `limit` levels deep; found a level at a time, without recursion."""
    level = [value] if isinstance(value, (dict, list)) else []
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            return True
        level = [c for v in level for c in (v.values() if isinstance(v, dict) else v)
                 if isinstance(c, (dict, list))]
    return False


# Bounds a schema's numbers, strings and arrays get where it sets none, so that a reply
# ends well within its budget (a small model otherwise writes digits until max_tokens):
# integers of at most 16 digits (llama.cpp's json-schema-to-grammar bounds them so),
# numbers below 10^16 in magnitude with at most 10 decimals and no exponent, strings of
# at most 2048 characters, arrays of at most 256 items.
INTEGER_BOUND = 10**16 - 1
NUMBER_BOUND = 1e16
NUMBER_STEP = 1e-10     # llguidance takes no finer multipleOf
STRING_BOUND = 2048
ARRAY_BOUND = 256


def _number_or_none(v: Any) -> float | None:
    return None if isinstance(v, bool) or not isinstance(v, (int, float)) else v


# llguidance builds a multipleOf's automaton with about as many states as the integer
# part of the step (past its trailing zeros): 65,537 takes a second, 999,983 25 s, and
# 2^31 does not end; a step past this is refused.
MAX_STEP = 10_000


def _check_step(schema: dict) -> None:
    step = _number_or_none(schema.get("multipleOf"))
    if step is None or not math.isfinite(step) or step <= 0:
        return   # llguidance's own message names it
    whole = int(step)
    while whole and whole % 10 == 0:
        whole //= 10
    if whole > MAX_STEP:
        raise EdgeError(f"multipleOf {step:g} is too coarse for the grammar engine: its "
                        f"integer part, past trailing zeros, must be at most {MAX_STEP}")


def _bound(schema: dict) -> None:
    """Add the default bounds to one schema object, in place, where it sets none and
    they leave some value valid."""
    kind = schema.get("type")   # a map of properties may have one named "type"
    kinds = {k for k in (kind if isinstance(kind, list) else [kind]) if isinstance(k, str)}
    lo = _number_or_none(schema.get("minimum", schema.get("exclusiveMinimum")))
    hi = _number_or_none(schema.get("maximum", schema.get("exclusiveMaximum")))
    open_lo = "minimum" not in schema and "exclusiveMinimum" not in schema
    open_hi = "maximum" not in schema and "exclusiveMaximum" not in schema
    if kinds & {"integer", "number"}:
        whole = "number" not in kinds
        if open_hi and (lo is None or lo < INTEGER_BOUND):
            schema["maximum" if whole else "exclusiveMaximum"] = \
                INTEGER_BOUND if whole else NUMBER_BOUND
        if open_lo and (hi is None or hi > -INTEGER_BOUND):
            schema["minimum" if whole else "exclusiveMinimum"] = \
                -INTEGER_BOUND if whole else -NUMBER_BOUND
        if not whole and "multipleOf" not in schema and (lo is None or hi is None
                                                          or hi - lo > 2 * NUMBER_STEP):
            schema["multipleOf"] = NUMBER_STEP
    if "string" in kinds and "maxLength" not in schema and not \
            {"pattern", "format", "enum", "const"} & schema.keys():
        least = _number_or_none(schema.get("minLength")) or 0
        if least <= STRING_BOUND:
            schema["maxLength"] = STRING_BOUND
    if "array" in kinds and "maxItems" not in schema:
        least = _number_or_none(schema.get("minItems")) or 0
        if least <= ARRAY_BOUND:
            schema["maxItems"] = ARRAY_BOUND


def bounded_schema(schema: Any) -> Any:
    """A copy of `schema` with the default bounds (_bound) on every schema in it, made
    without recursion; EdgeError for a multipleOf the engine cannot take (_check_step)."""
    def visit(copy: dict) -> None:
        _check_step(copy)
        if "type" in copy:
            _bound(copy)
    return copy_schema(schema, visit)


def json_schema_grammar(schema: Any) -> str:
    """The grammar of JSON texts valid under `schema` (a JSON schema as a dict), with
    the default bounds (bounded_schema) where it sets none."""
    if not isinstance(schema, dict):
        raise EdgeError("a JSON schema must be an object")
    if nests_deeper(schema, MAX_DEPTH):
        raise EdgeError(f"the JSON schema nests more than {MAX_DEPTH} levels deep")
    try:
        text = json.dumps(bounded_schema(schema))
    except (TypeError, ValueError) as e:   # from Python: a set, a cycle
        raise EdgeError(f"a JSON schema must be JSON: {e}") from None
    _checked_size(text, "JSON schema")
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
    except ValueError as e:
        raise EdgeError(f"cannot use this JSON schema: {e}") from None


def json_object_grammar() -> str:
    """The grammar of any JSON object (OpenAI's response_format json_object)."""
    return json_schema_grammar({"type": "object"})


def gbnf_grammar(text: str) -> str:
    """A llama.cpp GBNF grammar (`root ::= ...`) as llguidance's Lark grammar."""
    _checked_size(text, "grammar")
    if _gbnf_depth(text) > MAX_DEPTH:
        raise EdgeError(f"the grammar nests more than {MAX_DEPTH} levels of parentheses")
    rules = len(_GBNF_RULE.findall(text))
    if rules > MAX_GBNF_RULES:
        raise EdgeError(f"the grammar has {rules} rules; at most {MAX_GBNF_RULES} are accepted")
    try:
        lark = gbnf_to_lark(text)
    except RecursionError:
        raise EdgeError("the grammar nests too deeply") from None
    except Exception as e:  # noqa: BLE001 - the converter's parse errors have no common base
        raise EdgeError(f"cannot read this GBNF grammar: {str(e).splitlines()[0][:300]}") from None
    return llguidance.grammar_from("lark", lark)


def _gbnf_depth(text: str) -> int:
    """The deepest nesting of parentheses in a GBNF grammar, outside its string literals,
    character classes and comments."""
    depth = deepest = 0
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in "\"[":   # a literal or a class: skip to its end, past escapes
            end = '"' if c == '"' else "]"
            i += 1
            while i < n and text[i] != end:
                i += 2 if text[i] == "\\" else 1
        elif c == "#":
            while i < n and text[i] != "\n":
                i += 1
        elif c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth -= 1
        i += 1
    return deepest


def sample(sampler: Sampler, logits: np.ndarray, history: list[int],
           constraint: Constraint | None = None, left: int | None = None
           ) -> tuple[int, np.ndarray]:
    """One token: the sampler's penalties, the constraint's mask, the sampler's draw, the
    constraint moved past the token. `left`: the tokens the reply may still take, this
    one included (the constraint steers to its end when they run short). Returns the
    token and the logits it was drawn from."""
    adjusted = sampler.adjusted(logits, history)
    if constraint is not None:
        constraint.mask(adjusted, left)
    tok = sampler.pick(adjusted)
    if constraint is not None and not constraint.leaves_an_end(tok, left):
        # drawn freely, the token would open more than the budget can close: steer now
        adjusted = sampler.adjusted(logits, history)
        constraint.mask(adjusted, left, steer=True)
        tok = sampler.pick(adjusted)
    if constraint is not None:
        constraint.advance(tok)
    return tok, adjusted


class Constraint:
    """One reply's position in a grammar: which tokens may come next.

    With a token budget (mask's `left`), a reply steers to its end before the budget
    runs out: the shortest way to end it found from here (closing() below: the bytes
    the grammar forces, else the first allowed of a few closing bytes, a string's end
    inside one) is followed once the budget is within CLOSE_MARGIN tokens of the tokens
    it takes, only tokens whose bytes begin it allowed, and only a stop token once the
    output is complete. Near that point a token drawn freely is checked first: one that
    would leave an end the margin no longer holds (a new key cut inside a UTF-8
    character takes several byte tokens to close) is drawn again, steered. So a JSON
    reply closes, and parses, where the budget can hold its end; one whose budget cannot
    is not steered (it ends cut, "length")."""

    def __init__(self, tokenizer: Tokenizer, grammar: str):
        self.tokenizer = tokenizer
        self._string = (False, False)      # the output's JSON string state (_in_string)
        self._end: bytes | None = None     # a way to end from here, while steering
        self._longest_end: int | None = None   # the longest end found: look for one
                                               # within CLOSE_WINDOW tokens of it
        self._retry_at: int | None = None  # no end was found: look again at this budget
        self._near = False                 # this step found an end, not yet steered to
        _token_tables(tokenizer)           # built here, off the server's engine thread
        lltok = grammar_tokenizer(tokenizer)
        self.vocab_size = lltok.vocab_size
        self.matcher = llguidance.LLMatcher(lltok, grammar, log_level=0,
                                            limits=llguidance.LLParserLimits(**LIMITS))
        self._bits = np.zeros((self.vocab_size + 31) // 32, dtype=np.int32)
        self._check("cannot compile this grammar")
        allowed = self.allowed()
        self._check("cannot compile this grammar")
        if not allowed.any():
            raise EdgeError("the grammar matches nothing: no reply could satisfy it")

    def _check(self, what: str, error_type: type[EdgeError] = EdgeError) -> None:
        if self.matcher.is_error():
            error = self.matcher.get_error()
            if "NoExtensionBias" in error:   # llguidance's name for a rule that never ends
                raise error_type("the grammar matches nothing: one of its rules can never "
                                 "finish (every expansion refers to itself)")
            raise error_type(f"{what}: {error.splitlines()[0][:300]}")

    def allowed(self) -> np.ndarray:
        """(vocab_size,) bool: the tokens that may come next."""
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        return np.unpackbits(self._bits.view(np.uint8), bitorder="little")[:self.vocab_size].view(bool)

    def mask(self, logits: np.ndarray, left: int | None = None, steer: bool = False) -> None:
        """Set the logits (V,) of forbidden tokens to -inf, in place (V may exceed the
        tokenizer's vocabulary: the padding rows are forbidden too). `left`: the tokens
        the reply may still take, this one included (None: no bound). `steer`: follow
        an end found now even though the margin would still allow a free token."""
        allowed = self.allowed()
        self._check("the grammar failed while generating", GrammarError)
        self._near = False
        end = None if left is None else self._steer(left, steer)
        if end is not None:
            steered = allowed & self._beginning(end)
            if steered.any():   # else the grammar asks for a token the end does not begin
                allowed = steered
        logits[self.vocab_size:] = -np.inf
        np.putmask(logits[:self.vocab_size], ~allowed, -np.inf)

    def advance(self, token: int) -> None:
        """Move past `token`, which mask() allowed."""
        if not self.matcher.consume_token(token):
            self._check("the grammar failed while generating (it may match only endless "
                        "text)", GrammarError)
            raise GrammarError(f"the grammar refused the sampled token {token}")
        data = self.tokenizer.token_bytes(token)
        self._string = _in_string(self._string, data)
        # the rest of the end being followed, if the token began it
        self._end = self._end[len(data):] if self._end and self._end.startswith(data) \
            else None

    def leaves_an_end(self, token: int, left: int | None) -> bool:
        """Whether, after `token` drawn freely where mask() found an end it did not yet
        steer to, an end is still found that leaves the margin: its tokens plus
        CLOSE_MARGIN fewer than `left` (the budget this token included)."""
        if left is None or not self._near:
            return True
        end = self.closing(after=token)
        return end is not None and self._tokens_for(end) + CLOSE_MARGIN < left

    def _steer(self, left: int, force: bool = False) -> bytes | None:
        """The end to steer to now (b"": only a stop token), or None to sample freely
        (never where `force`, if an end that fits is found)."""
        if self._end is None:
            if (self._longest_end is not None and left > self._longest_end + CLOSE_WINDOW) \
                    or (self._retry_at is not None and left > self._retry_at):
                return None
            end = self.closing()
            if end is None:   # longer than the search goes: look again only near the end
                self._longest_end = CLOSE_MAX
                self._retry_at = left - _CLOSE_RETRY
                return None
            self._longest_end = max(self._longest_end or 0, len(end))
            need = self._tokens_for(end)
            if need > left:   # too late to end it: the reply is cut by its budget either way
                self._retry_at = left - _CLOSE_RETRY
                return None
            self._retry_at = None
            if need + CLOSE_MARGIN < left and not force:
                self._near = True
                return None
            self._end = end
        return self._end

    def _tokens_for(self, end: bytes) -> int:
        """The fewest text tokens that spell `end` (tokens of at most 32 bytes)."""
        _, by_bytes = _token_tables(self.tokenizer)
        fewest = [0] + [len(end) + 1] * len(end)
        for i in range(len(end)):
            for j in range(i + 1, min(len(end), i + 32) + 1):
                if fewest[i] + 1 < fewest[j] and end[i:j] in by_bytes:
                    fewest[j] = fewest[i] + 1
        return fewest[-1]

    def _beginning(self, end: bytes) -> np.ndarray:
        """(vocab_size,) bool: the tokens whose bytes begin `end`; the stop tokens if it
        is empty."""
        out = np.zeros(self.vocab_size, bool)
        if not end:
            out[[t for t in self.tokenizer.stop_ids if t < self.vocab_size]] = True
            return out
        _, by_bytes = _token_tables(self.tokenizer)
        for k in range(1, len(end) + 1):
            out[by_bytes.get(end[:k], [])] = True
        return out

    def closing(self, after: int | None = None) -> bytes | None:
        """A short way to complete the output from here (b"" if it is complete), as
        bytes, or None if none was found within CLOSE_MAX bytes; from after the token
        `after` if given (which the grammar must allow here). Greedy: the bytes the
        grammar forces, else the first allowed of _INSIDE inside a JSON string and of
        _OUTSIDE out of one (a closer before a separator before the shortest values),
        else the lowest allowed byte."""
        single, _ = _token_tables(self.tokenizer)
        m = self.matcher.deep_copy()
        state, out = self._string, bytearray()
        if after is not None:
            if not m.consume_token(after):
                return None
            state = _in_string(state, self.tokenizer.token_bytes(after))
        while not m.is_accepting():
            step = m.compute_ff_bytes()
            if not step:
                tried = _INSIDE if state[0] else _OUTSIDE
                step = next((bytes([b]) for b in (*tried, *range(256))
                             if single[b] >= 0 and m.validate_tokens([int(single[b])])), b"")
            if not step or len(out) + len(step) > CLOSE_MAX or \
                    not all(single[b] >= 0 and m.consume_token(int(single[b])) for b in step):
                return None
            state = _in_string(state, step)
            out += step
        return bytes(out)

    @property
    def complete(self) -> bool:
        """The output so far is a whole sentence of the grammar."""
        return self.matcher.is_accepting()

    @property
    def finished(self) -> bool:
        """The output is complete and nothing can follow it but a stop token."""
        return self.matcher.is_stopped() and not self.matcher.is_error()
