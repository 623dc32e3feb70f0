"""A multi-turn conversation over one LLM: keeps the messages, fits them into the
context (dropping the oldest turns, never the system prompt) and streams replies.

The conversation is re-rendered with the chat template every turn; LLM.generate
reuses the cached prefix, so each turn prefills only what is new (from a reply's
<think> block on, which the history does not keep). When turns are dropped, the turns
kept move down in the cache by a context shift (Sequence.shift) instead of being read
again. save() and load() keep a conversation and its cache in a
file (prompt_cache.py).
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from .errors import EdgeError
from .llm import LLM
from .reasoning import ReasoningSplitter, opens_reasoning
from .sampling import SamplingParams
from .speculative import Drafter
from .tokenizer import StreamDecoder

_PROMPT_TAIL = 8    # prompt tokens enough to see whether it ends in an open <think>


@dataclass
class ChatSession:
    llm: LLM
    sampling: SamplingParams
    max_tokens: int = 1024
    system: str | None = None
    messages: list[dict] = field(default_factory=list)   # user/assistant turns only
    notices: list[str] = field(default_factory=list)     # things the UI should tell the user
    context_shift: bool = True      # dropped turns: shift the cache, not read it again
    drafter: Drafter | None = None  # speculative decoding (LLM.generate)

    def __post_init__(self):
        # The smallest turn (the system prompt and an empty message) must leave room for a
        # reply, or every message would be refused; the advice leaves 64 tokens for one.
        need = len(self._render([{"role": "user", "content": ""}]))
        if need > self._limit(self.llm.ctx):
            enough, largest = need + 64, self.llm.model.args.train_ctx
            while self._limit(enough) < need + 64:
                enough += 1
            if need > self._limit(largest):
                what = f"even the model's largest context, {largest} tokens, leaves no room for a reply"
            elif enough < largest:
                what = f"use --ctx {enough} or more"
            else:
                what = f"use --ctx {largest}, the model's largest"
            raise EdgeError(f"a context of {self.llm.ctx} tokens is too small for this model's chat "
                            f"template: an empty message "
                            f"{'with the system prompt ' if self.system else ''}already takes "
                            f"{need} tokens; {what}")

    def _render(self, messages: list[dict]) -> list[int]:
        sys_msg = [{"role": "system", "content": self.system}] if self.system else []
        return self.llm.chat.encode_messages(sys_msg + messages)

    def reply_budget(self, ctx: int | None = None) -> int:
        """Tokens kept free for the reply: the max, but at most a quarter of the context."""
        return max(1, min(self.max_tokens, (self.llm.ctx if ctx is None else ctx) // 4))

    def _limit(self, ctx: int) -> int:
        """The most prompt tokens a context of `ctx` takes."""
        return ctx - self.reply_budget(ctx)

    def _fit(self) -> tuple[list[int], bool]:
        """Token ids of the conversation with a generation prompt, dropping the oldest
        turns until they leave room for a reply; and whether any were dropped."""
        limit = self._limit(self.llm.ctx)
        ids = self._render(self.messages)
        dropped = 0
        while len(ids) > limit and len(self.messages) > 1:
            # drop the oldest user turn and the assistant reply that followed it
            cut = 2 if len(self.messages) > 2 and self.messages[1]["role"] == "assistant" else 1
            del self.messages[:cut]
            dropped += cut
            ids = self._render(self.messages)
        if len(ids) > limit:
            self.messages.pop()
            raise EdgeError(f"this message is {len(ids)} tokens with the system prompt, more than "
                            f"the {limit} the context of {self.llm.ctx} allows; shorten it or "
                            f"use a larger --ctx")
        if dropped:
            how = "; the rest moved down by a context shift" if self.context_shift else ""
            self.notices.append(f"context full: dropped the {dropped} oldest message(s) "
                                f"to make room (the system prompt is kept{how})")
        return ids, dropped > 0

    def send(self, text: str) -> Iterator[str]:
        """Add a user message and stream the reply's text as the model writes it, a
        <think> block included. If the consumer stops early (Ctrl-C), what was generated
        so far is kept as the assistant's reply (its content: see send_parts)."""
        for piece, _, _ in self._reply(text):
            if piece:
                yield piece

    def send_parts(self, text: str) -> Iterator[tuple[str, str]]:
        """send, the reply streamed as (reasoning, content) pieces (reasoning.py: the
        <think> block at its start, and the answer)."""
        for _, reasoning, content in self._reply(text):
            if reasoning or content:
                yield reasoning, content

    def _reply(self, text: str) -> Iterator[tuple[str, str, str]]:
        """(text, reasoning, content) pieces of the reply. The history keeps its content
        only: templates drop an earlier reply's reasoning (Qwen 3's does), and kept it
        would only take context."""
        self.messages.append({"role": "user", "content": text})
        ids, dropped = self._fit()
        tok = self.llm.tokenizer
        split = ReasoningSplitter(opens_reasoning(tok.decode(ids[-_PROMPT_TAIL:], special=True)))
        out = StreamDecoder(tok)
        content: list[str] = []
        try:
            for t in self.llm.generate(ids, max_tokens=self.max_tokens, sampling=self.sampling,
                                       shifted=dropped and self.context_shift,
                                       drafter=self.drafter):
                piece = out.push(t)
                if piece:
                    r, c = split.push(piece)
                    content.append(c)
                    yield piece, r, c
            piece = out.flush()
            r, c = split.push(piece)
            r2, c2 = split.finish()
            content.append(c + c2)
            yield piece, r + r2, c + c2
        finally:
            content.append(split.finish()[1])       # stopped early: what was held
            self.messages.append({"role": "assistant", "content": "".join(content)})

    def reset(self):
        self.messages.clear()
        self.llm.reset()

    def save(self, path: str | Path) -> Path:
        """The conversation (system prompt, messages) and its cache, to a file."""
        return self.llm.save_prompt(path, {"system": self.system, "messages": self.messages,
                                           "date": self.llm.chat.date})

    def load(self, path: str | Path) -> int:
        """A saved conversation and its cache (a saved prompt without a conversation,
        from `generate --prompt-cache`, say, leaves this one's messages and brings its
        cache: the next message reuses what it shares with it). Returns its tokens."""
        saved = self.llm.load_prompt(path)
        if saved.chat is not None:
            self.system, self.messages[:] = saved.chat["system"], saved.chat["messages"]
            self.llm.chat.date = saved.chat["date"]     # its template date: the same prompt
        return len(saved.tokens)

    def context_used(self) -> int:
        return len(self.llm.cached)
