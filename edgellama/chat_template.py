"""Chat prompts: the GGUF's Jinja chat template rendered as HF transformers does, then tokenized.

Templates come from downloaded files, so they run in Jinja's immutable sandbox, and any
reach for Python internals is an error rather than a silently empty string.

Special tokens in the prompt must come from the template only: a user who types
`<|eot_id|>` must not end their turn. Before rendering, special-token strings inside
message contents are swapped for private markers; after rendering, the text is split at
the template's own special tokens and the markers are put back as plain text.

Rendering is stable for KV-cache reuse: rendering messages[:k] with the generation prompt,
followed by the reply, is a prefix of rendering the conversation with that reply (tested
for the Llama 3.2 and SmolLM2 templates). Two things can break the prefix at the reply:
Llama 3 templates `trim` message contents (a reply ending in whitespace re-renders
without it), and templates that print a date (Llama 3.1/3.2 "Today Date") would change
at midnight, so `strftime_now` returns the time the ChatFormat was created.
"""
from __future__ import annotations

import json
import re
import secrets
import sys
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from edgellama.errors import EdgeError
from edgellama.machine import resident_memory
from edgellama.tokenizer import Tokenizer

# Used when the file has no tokenizer.chat_template (DESIGN.md §3 turn format).
LLAMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


# Limits on what a template may build: a chat prompt is a few hundred KB at most, so a
# template asking for more is broken or hostile ('a' * 10**10, doubling a string in a loop,
# nested loops over range(99999)...). Each ends in an EdgeError, in bounded time and memory.
MAX_TEXT = 16 << 20          # characters (or items) of any one value the template builds
MAX_OUTPUT = 16 << 20        # characters of rendered output
MAX_INT_ARG = 1 << 20        # a width/count argument above this is refused before the call
MAX_STEPS = 1_000_000        # template source lines executed per render (CPU bound)
MAX_SECONDS = 5.0            # CPU seconds per render
MAX_MEMORY = 1 << 30         # growth of resident memory during a render (Linux)


class TemplateLimitError(SecurityError):
    """A chat template exceeded one of the limits above."""


def _size(x: Any) -> int:
    return len(x) if isinstance(x, (str, bytes, list, tuple, dict)) else 0


def _check_size(x: Any, what: str) -> Any:
    if _size(x) > MAX_TEXT:
        raise TemplateLimitError(f"{what} builds a value of {_size(x)} items (limit {MAX_TEXT})")
    return x


def _check_args(args: Sequence[Any], kwargs: Mapping[str, Any], what: str) -> None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and abs(a) > MAX_INT_ARG:
            raise TemplateLimitError(f"{what} called with {a} (limit {MAX_INT_ARG})")


_HUGE_FIELD = re.compile(r"[%{][^%{}]*?\d{7,}")   # '%9999999s', '{:>9999999}'


def _check_format(fmt: Any, what: str) -> None:
    if isinstance(fmt, str) and _HUGE_FIELD.search(fmt):
        raise TemplateLimitError(f"{what} asks for a field width of millions of characters")


class _BoundedCodeGenerator(CodeGenerator):
    """`a ~ b` goes through environment.concat_checked, so string building is bounded too."""

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.concat_checked((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _Sandbox(ImmutableSandboxedEnvironment):
    """Immutable sandbox that fails on an unsafe attribute instead of rendering it empty,
    and bounds the size of what operators, calls and filters build."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} "
                            "object is not allowed")

    def call_binop(self, context: Any, op: str, left: Any, right: Any) -> Any:
        if op == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 \
                and right * abs(left).bit_length() > 1 << 16:
            raise TemplateLimitError(f"{left} ** {right} is too large")
        if op == "*":
            seq, n = (left, right) if _size(left) or isinstance(left, (str, list, tuple)) else (right, left)
            if isinstance(n, int) and _size(seq) * max(n, 0) > MAX_TEXT:
                raise TemplateLimitError(f"repeating a value of {_size(seq)} items {n} times "
                                         f"exceeds the limit of {MAX_TEXT}")
        if op == "+" and _size(left) + _size(right) > MAX_TEXT:
            raise TemplateLimitError(f"joining values of {_size(left)} and {_size(right)} items "
                                     f"exceeds the limit of {MAX_TEXT}")
        if op == "%":
            _check_format(left, "the % operator")
        return _check_size(self.binop_table[op](left, right), f"the {op} operator")

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        what = getattr(__obj, "__name__", type(__obj).__name__)
        _check_args(args, kwargs, what)
        # the object a method is bound to (jinja wraps str.format, keeping __wrapped__)
        base = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)
        if what in ("format", "format_map"):
            _check_format(base, what)
        if isinstance(base, str) and what in ("replace", "join", "expandtabs"):
            _check_grow(base, what, args)
        return _check_size(super().call(__context, __obj, *args, **kwargs), what)

    @staticmethod
    def concat_checked(parts: Sequence[Any]) -> str:
        strs = [str(p) for p in parts]
        if sum(map(len, strs)) > MAX_TEXT:
            raise TemplateLimitError(f"the ~ operator builds more than {MAX_TEXT} characters")
        return "".join(strs)


def _check_grow(base: str, what: str, args: Sequence[Any]) -> None:
    """Refuse str.replace / str.join / str.expandtabs calls whose result would be huge."""
    if what == "replace" and len(args) >= 2 and all(isinstance(a, str) for a in args[:2]):
        est = len(base) + (base.count(args[0]) if args[0] else len(base) + 1) * len(args[1])
    elif what == "join" and args and isinstance(args[0], (list, tuple)):
        est = len(base) * len(args[0]) + sum(_size(x) for x in args[0])
    elif what == "expandtabs":
        est = len(base) * (1 + (args[0] if args and isinstance(args[0], int) else 8))
    else:
        return
    if est > MAX_TEXT:
        raise TemplateLimitError(f"{what} would build {est} characters (limit {MAX_TEXT})")


def _bounded_filter(name: str, f: Any) -> Any:
    skip = 1 if hasattr(f, "jinja_pass_arg") else 0   # context / eval context / environment

    def filt(*args: Any, **kwargs: Any) -> Any:
        value, params = (args[skip], args[skip + 1:]) if len(args) > skip else (None, ())
        _check_args(params, kwargs, f"filter {name}")
        if name == "format":
            _check_format(value, "filter format")
        elif name == "replace" and isinstance(value, str):
            _check_grow(value, "replace", params)
        return _check_size(f(*args, **kwargs), f"filter {name}")
    if skip:
        filt.jinja_pass_arg = f.jinja_pass_arg
    return filt


class _Budget:
    """A trace function that stops a render after MAX_STEPS template lines or when the
    process grew by MAX_MEMORY: loops and recursion in a template cannot run away."""

    def __init__(self):
        self.steps = 0
        self.rss0 = resident_memory()
        self.t0 = time.process_time()

    def __call__(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "call":
            return self._line if frame.f_code.co_filename == "<template>" else None
        return None

    def _line(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "line":
            self.steps += 1
            if self.steps > MAX_STEPS:
                raise TemplateLimitError(f"it ran for more than {MAX_STEPS} steps")
            if self.steps % 256 == 0:
                if self.rss0 is not None and (resident_memory() or 0) - self.rss0 > MAX_MEMORY:
                    raise TemplateLimitError(f"it used more than {MAX_MEMORY >> 20} MiB of memory")
                if time.process_time() - self.t0 > MAX_SECONDS:
                    raise TemplateLimitError(f"it ran for more than {MAX_SECONDS:.0f} CPU seconds")
        return self._line


def _render_bounded(template: jinja2.Template, **variables: Any) -> str:
    """template.render under the step/memory budget, with the output size bounded."""
    budget, old = _Budget(), sys.gettrace()
    parts, n = [], 0
    sys.settrace(budget)
    try:
        for piece in template.generate(**variables):
            n += len(piece)
            if n > MAX_OUTPUT:
                raise TemplateLimitError(f"its output exceeds {MAX_OUTPUT} characters")
            parts.append(piece)
    finally:
        sys.settrace(old)
    return "".join(parts)


class _GenerationTag(Extension):
    """HF's `{% generation %}...{% endgeneration %}`: marks assistant text; renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # HF's override: Jinja's own tojson HTML-escapes, which chat templates do not want.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def compile_template(source: str, now: datetime) -> jinja2.Template:
    """Compile a chat template in HF's environment; `strftime_now` always formats `now`."""
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = now.strftime
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise EdgeError(f"chat template has a syntax error on line {exc.lineno}: {exc.message}") from None


class ChatFormat:
    """Turns a conversation into prompt token ids for one tokenizer and template."""

    def __init__(self, tokenizer: Tokenizer, template: str | None, now: datetime | None = None):
        self.tokenizer = tokenizer
        if template is not None and not isinstance(template, str):
            raise EdgeError(f"tokenizer.chat_template must be a string, got {type(template).__name__}")
        self.is_fallback = not template
        if template:
            self.source = template
        else:
            self.source = LLAMA3_TEMPLATE if tokenizer.is_llama3 else CHATML_TEMPLATE
        self._template = compile_template(self.source, now or datetime.now())
        self._bos_text = "" if tokenizer.bos_id is None else tokenizer.tokens[tokenizer.bos_id]
        self._eos_text = "" if tokenizer.eos_id is None else tokenizer.tokens[tokenizer.eos_id]
        by_length = sorted(tokenizer.special_tokens, key=len, reverse=True)
        self._special_re = re.compile("(" + "|".join(map(re.escape, by_length)) + ")") if by_length else None

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
        """The template's text for `messages` (dicts with "role" and "content")."""
        try:
            return _render_bounded(self._template, messages=[dict(m) for m in messages],
                                   add_generation_prompt=add_generation_prompt,
                                   bos_token=self._bos_text, eos_token=self._eos_text)
        except TemplateLimitError as exc:
            raise EdgeError(f"chat template stopped: {exc}; the file's template is broken "
                            f"or hostile") from None
        except SecurityError as exc:
            raise EdgeError(f"chat template refused: {exc}") from None
        except Exception as exc:  # a broken template in the file, not a bug here
            raise EdgeError(f"chat template failed: {type(exc).__name__}: {exc}") from None

    def encode_messages(self, messages: Sequence[Mapping[str, Any]],
                        add_generation_prompt: bool = True) -> list[int]:
        """Prompt ids: template special tokens recognised, message text always plain; one BOS."""
        tok = self.tokenizer
        marker = f"\ue000{secrets.token_hex(8)}:"
        literals: list[str] = []

        def hide(match: re.Match) -> str:
            literals.append(match.group(0))
            return f"{marker}{len(literals) - 1}\ue001"

        if self._special_re is not None:
            messages = [dict(m, content=self._special_re.sub(hide, m["content"]))
                        if isinstance(m.get("content"), str) else m for m in messages]
        text = self.render(messages, add_generation_prompt)
        restore = re.compile(re.escape(marker) + r"(\d+)\ue001")
        ids: list[int] = []
        parts = self._special_re.split(text) if self._special_re is not None else [text]
        for k, part in enumerate(parts):
            if k % 2:
                ids.append(tok.special_tokens[part])
            elif part:
                ids += tok.encode(restore.sub(lambda m: literals[int(m.group(1))], part))
        if tok.add_bos and ids[:1] != [tok.bos_id]:
            ids.insert(0, tok.bos_id)
        return ids
