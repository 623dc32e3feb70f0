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
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from edgellama.errors import EdgeError
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


class _Sandbox(ImmutableSandboxedEnvironment):
    """Immutable sandbox that fails on an unsafe attribute instead of rendering it empty."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} "
                            "object is not allowed")


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
            return self._template.render(messages=[dict(m) for m in messages],
                                         add_generation_prompt=add_generation_prompt,
                                         bos_token=self._bos_text, eos_token=self._eos_text)
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
