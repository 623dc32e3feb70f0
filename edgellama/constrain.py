"""Grammar-constrained decoding: replies that always parse (JSON, a JSON schema, a grammar).

    grammar = json_schema_grammar(schema)          # or json_object_grammar(), gbnf_grammar(text)
    constraint = Constraint(tokenizer, grammar)   # EdgeError if it cannot be compiled
    constraint.mask(logits)                       # -inf on every token the grammar forbids
    constraint.advance(token)                     # after sampling from the masked logits

The grammar engine is llguidance (MIT, one Rust extension, no dependencies): of the
libraries measured on the 128K Llama 3 vocabulary (bench/bench_constraint.py, the README)
it is the fastest per token, compiles a schema in milliseconds (outlines-core builds a
whole-vocabulary index per schema: seconds), and bounds its own work per grammar and per
token (LLParserLimits), which is what lets a server take grammars from strangers.
xgrammar needs PyTorch.

llguidance is given every token's exact bytes (edgellama.tokenizer's table), so a
byte-level BPE token that spans grammar symbols (`{"`, `":`, `},{`) is allowed exactly
when its bytes continue a valid output; control tokens are marked special, so they are
never allowed inside the grammar, and the stop tokens are its end of text: once the
output is complete, only a stop token can follow.
"""
from __future__ import annotations

import json
import re
import threading
from typing import Any

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import gbnf_to_lark

from .errors import EdgeError
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

_tokenizers: dict[int, tuple[Tokenizer, llguidance.LLTokenizer]] = {}
_tokenizers_lock = threading.Lock()


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


def _checked_size(text: str, what: str) -> str:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise EdgeError(f"the {what} is {len(text)} characters long; at most "
                        f"{MAX_GRAMMAR_CHARS} are accepted")
    return text


def nests_deeper(value: Any, limit: int) -> bool:
    """Whether `value` (dicts, lists and scalars, as json.loads gives) nests its dicts and
    lists more than `limit` levels deep; found without recursion."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth > limit:
                return True
            stack.extend((c, depth + 1) for c in (v.values() if isinstance(v, dict) else v))
    return False


def json_schema_grammar(schema: Any) -> str:
    """The grammar of JSON texts valid under `schema` (a JSON schema as a dict)."""
    if not isinstance(schema, dict):
        raise EdgeError("a JSON schema must be an object")
    if nests_deeper(schema, MAX_DEPTH):
        raise EdgeError(f"the JSON schema nests more than {MAX_DEPTH} levels deep")
    try:
        text = json.dumps(schema)
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
           constraint: Constraint | None = None) -> tuple[int, np.ndarray]:
    """One token: the sampler's penalties, the constraint's mask, the sampler's draw, the
    constraint moved past the token. Returns the token and the logits it was drawn from."""
    adjusted = sampler.adjusted(logits, history)
    if constraint is not None:
        constraint.mask(adjusted)
    tok = sampler.pick(adjusted)
    if constraint is not None:
        constraint.advance(tok)
    return tok, adjusted


class Constraint:
    """One reply's position in a grammar: which tokens may come next."""

    def __init__(self, tokenizer: Tokenizer, grammar: str):
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

    def mask(self, logits: np.ndarray) -> None:
        """Set the logits (V,) of forbidden tokens to -inf, in place (V may exceed the
        tokenizer's vocabulary: the padding rows are forbidden too)."""
        allowed = self.allowed()
        self._check("the grammar failed while generating", GrammarError)
        logits[self.vocab_size:] = -np.inf
        np.putmask(logits[:self.vocab_size], ~allowed, -np.inf)

    def advance(self, token: int) -> None:
        """Move past `token`, which mask() allowed."""
        if not self.matcher.consume_token(token):
            self._check("the grammar failed while generating (it may match only endless "
                        "text)", GrammarError)
            raise GrammarError(f"the grammar refused the sampled token {token}")

    @property
    def complete(self) -> bool:
        """The output so far is a whole sentence of the grammar."""
        return self.matcher.is_accepting()
