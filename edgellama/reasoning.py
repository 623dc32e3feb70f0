"""A reply's reasoning apart from its answer, as llama-server's `--reasoning-format
deepseek` (its default) reads it: a `<think>...</think>` block at the start of the reply
(after space) is the reasoning, stripped of the space around it; what follows, from its
first non-space character, is the content. Without such a block the whole reply is
content; a reply cut before `</think>` is all reasoning. A block after more than
MAX_LEADING_SPACE characters of space does not count: no model opens its reasoning that
late, and a stream would hold back a reply of nothing but space (a degenerate model's)
to the end.

    splitter = ReasoningSplitter(opens_reasoning(prompt_text))
    for piece in pieces:                      # decoded text, split anywhere
        reasoning, content = splitter.push(piece)
    reasoning, content = splitter.finish()
    reasoning, content = split_reasoning(text, opened)   # a whole reply at once

A template may open the block itself (the prompt ends in `<think>`, as DeepSeek R1's and
Qwen 3 Thinking-2507's do): the reply then starts inside it, and `opened` says so. Qwen 3
with enable_thinking false fills an empty, closed block into the prompt: the reply is
content. The tool-call reader (tool_calls.py) skips the same block: it reads the content
part alone or the whole reply to the same calls.
"""
from __future__ import annotations

import re

OPEN, CLOSE = "<think>", "</think>"

_OPEN_AT_END = re.compile(re.escape(OPEN) + r"\s*\Z")
MAX_LEADING_SPACE = 64   # characters of space a reply may start with before its <think>


def opens_reasoning(prompt: str) -> bool:
    """Whether a rendered prompt leaves a <think> block open for the reply (llama.cpp's
    "thinking forced open"): it ends in <think> and space."""
    return _OPEN_AT_END.search(prompt) is not None


def _partial_at_end(text: str, tag: str) -> int:
    """The length of the longest end of `text` that a continuation could make `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplitter:
    """Reads a reply's text as it streams; each push returns the (reasoning, content)
    text that the pieces so far settle. Text that could still be part of a tag, or the
    space at the end of the reasoning, is held until the next piece or finish()."""

    def __init__(self, opened: bool = False):
        self._state = "reasoning" if opened else "start"
        self._held = ""              # text not yet given out
        self._started = False        # reasoning: its first non-space character was seen

    @property
    def in_reasoning(self) -> bool:
        """Whether the text so far ends inside the think block."""
        return self._state == "reasoning"

    def push(self, text: str) -> tuple[str, str]:
        self._held += text
        reasoning, content = [], []
        while self._held:
            held = self._held
            if self._state == "start":
                body = held.lstrip()
                if len(held) - len(body) > MAX_LEADING_SPACE:
                    self._state = "content"
                    continue
                if body.startswith(OPEN):
                    self._held, self._state = body[len(OPEN):], "reasoning"
                    continue
                if OPEN.startswith(body):        # space, or the tag's start: wait
                    break
                self._state = "content"
            elif self._state == "reasoning":
                if not self._started:
                    held = self._held = held.lstrip()
                    if not held:
                        break
                    self._started = True
                end = held.find(CLOSE)
                if end >= 0:
                    reasoning.append(held[:end].rstrip())
                    self._held, self._state = held[end + len(CLOSE):], "after"
                    continue
                keep = _partial_at_end(held, CLOSE)
                body = held[:len(held) - keep]
                settled = body.rstrip()          # space before </think> is stripped
                reasoning.append(settled)
                self._held = held[len(settled):]
                break
            elif self._state == "after":
                body = held.lstrip()
                self._held = body
                if not body:
                    break
                self._state = "content"
            else:
                content.append(held)
                self._held = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """The end of the reply: what was held. An unclosed block's text is reasoning (its
        trailing space stripped); text that only began like <think> is content."""
        held, self._held = self._held, ""
        if self._state == "reasoning":
            return held.rstrip(), ""
        if self._state in ("start", "content"):
            return "", held
        return "", ""


def split_reasoning(text: str, opened: bool = False) -> tuple[str, str]:
    """(reasoning, content) of a whole reply; `opened`: the prompt left <think> open."""
    s = ReasoningSplitter(opened)
    r1, c1 = s.push(text)
    r2, c2 = s.finish()
    return r1 + r2, c1 + c2
