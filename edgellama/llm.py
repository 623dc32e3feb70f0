"""The public API: load a GGUF, tokenize, generate with KV-cache prefix reuse.

    llm = edgellama.load("model.gguf", ctx=4096)
    ids = llm.tokenizer.encode("The capital of France is")
    for tok in llm.generate(ids, max_tokens=20): ...

An LLM is a model (llm.model, read-only weights) and one conversation's state
(llm.seq, a Sequence); more sequences of the same model: llm.model.new_sequence().
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import prompt_cache
from .args import ModelArgs
from .chat_template import ChatFormat, start_renderer, template_kwargs
from .constrain import Constraint
from .errors import EdgeError
from .generation import Generation, step
from .gguf import GGUFFile
from .kv_cache import DEFAULT_CACHE_TYPE
from .machine import ThreadPolicy
from .model import DEFAULT_BATCH, Transformer
from .sampling import Sampler, SamplingParams
from .sequence import Sequence
from .speculative import DRAFT_MAX, DRAFT_MIN, Drafter, DraftModel, check_same_vocabulary
from .tokenizer import Tokenizer

DEFAULT_CTX = 8192


@dataclass
class Stats:
    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    gen_tokens: int = 0
    gen_seconds: float = 0.0
    stop_reason: str = ""
    shifts: int = 0              # context shifts while generating
    drafted: int = 0             # speculative decoding: tokens proposed and checked,
    accepted: int = 0            # and of them kept

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds else 0.0

    @property
    def gen_tps(self) -> float:
        return self.gen_tokens / self.gen_seconds if self.gen_seconds else 0.0


@dataclass
class LLM:
    path: Path
    gguf: GGUFFile
    model: Transformer
    tokenizer: Tokenizer
    chat: ChatFormat
    threads: int                 # most threads it runs (automatic: fewer while other
                                 # processes keep cores busy; see ThreadPolicy)
    load_seconds: float
    seq: Sequence | None = None  # the conversation: KV cache and its tokens
    stats: Stats = field(default_factory=Stats)
    warnings: list[str] = field(default_factory=list)  # about the file, for the user

    def __post_init__(self):
        if self.seq is None:
            self.seq = self.model.new_sequence()

    @property
    def ctx(self) -> int:
        return self.model.ctx

    @property
    def cached(self) -> list[int]:
        """The tokens whose K/V the cache holds (read-only: use seq to change them)."""
        return self.seq.tokens

    def default_sampling(self, warn: Callable[[str], None] = lambda message: None) -> SamplingParams:
        """The file's `general.sampling.*` where valid (`warn` hears about the others; load()
        puts them in `warnings`), else per-family defaults (the architecture table's, as
        Qwen 3's; Llama 3.2 Instruct ships temperature 0.6, top-p 0.9)."""
        family = self.model.args.family.sampling
        if family is not None:
            base = SamplingParams(**family)
        elif self.tokenizer.is_llama3:
            base = SamplingParams(temperature=0.6, top_p=0.9)
        else:
            base = SamplingParams()
        return base.with_defaults_from(self.gguf.metadata, warn)

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise EdgeError("the prompt is empty")
        if len(ids) > self.ctx:
            raise EdgeError(f"the prompt is {len(ids)} tokens, longer than the context of "
                            f"{self.ctx} tokens; use a larger --ctx or a shorter prompt")

    def _prefill(self, ids: list[int], shifted: bool = False) -> np.ndarray:
        """Bring the cache to hold `ids`, reusing the longest common prefix (with
        `shifted`, also cached tokens after a dropped run: Sequence.reuse_shifted);
        returns the last position's logits."""
        self._check_prompt(ids)
        n = self.seq.reuse_shifted(ids, self.model.inv_freq) if shifted else self.seq.reuse_prefix(ids)
        t0 = time.perf_counter()
        logits = self.model.forward(ids[n:], self.seq)
        self.stats = Stats(prompt_tokens=len(ids) - n, prompt_seconds=time.perf_counter() - t0)
        return logits

    def logits(self, ids: list[int]) -> np.ndarray:
        """Next-token logits (V,) after `ids` (a copy)."""
        return self._prefill(list(ids)).copy()

    def load_draft(self, path: str | Path, draft_min: int = DRAFT_MIN,
                   draft_max: int = DRAFT_MAX) -> DraftModel:
        """A draft model for speculative decoding (generate's drafter): a smaller GGUF
        with this model's vocabulary, run with the same threads and context (at most
        its own)."""
        g = GGUFFile(path)
        check_same_vocabulary(self.gguf, g)
        args = ModelArgs.from_gguf(g)
        model = Transformer(g, min(self.ctx, args.train_ctx), args=args,
                            threads=self.model.threads, activations=self.model.activations)
        return DraftModel(model, draft_min, draft_max)

    def generate(self, ids: list[int], max_tokens: int = 256,
                 sampling: SamplingParams | None = None,
                 stop_ids: set[int] | None = None, grammar: str | None = None,
                 pick: Callable[[np.ndarray, list[int]], int] | None = None, *,
                 shifted: bool = False, shift_keep: int | None = None,
                 prompt_read: Callable[[], None] | None = None,
                 drafter: Drafter | None = None) -> Iterator[int]:
        """Yield generated token ids; stops at a stop token (not yielded), after
        max_tokens, or when the context is full. Closing the iterator early (or
        Ctrl-C) keeps the sequence consistent (its tokens are those of its cache).
        grammar (edgellama.constrain: json_schema_grammar(schema), ...): the reply is a
        sentence of it. pick(logits, history) -> token replaces sampling and grammar.

        shifted: `ids` may leave out a run of the cached tokens (Sequence.reuse_shifted).
        shift_keep: when the context fills, keep its first shift_keep tokens, drop half
        of the rest (a context shift, as llama.cpp's) and go on. prompt_read: called once
        the prompt is in the cache, before the first token (to save it, say).

        drafter (load_draft, or speculative.PromptLookup()): speculative decoding, the
        same tokens at temperature 0, the same distribution otherwise; a reply that fills
        the context ends there (no shift). Under a grammar only at temperature 0.

        The tokens come from generation.step: a grammar ends the reply as soon as only
        a stop token can follow (no pass for it)."""
        sampling = sampling or self.default_sampling()
        if drafter is not None and (pick is not None or
                                    (grammar is not None and sampling.temperature > 0)):
            raise EdgeError("speculative decoding does not combine with a custom pick, nor "
                            "with a grammar when sampling (temperature > 0); leave out the "
                            "drafter")
        constraint = None if grammar is None or pick is not None \
            else Constraint(self.tokenizer, grammar)
        logits = self._prefill(list(ids), shifted)
        if prompt_read is not None:
            prompt_read()
        g = Generation(seq=self.seq, history=list(ids), sampler=Sampler(sampling),
                       max_tokens=max_tokens, constraint=constraint, pick=pick,
                       stops=self.tokenizer.stop_ids if stop_ids is None else stop_ids,
                       full="context full", shift_keep=None if drafter else shift_keep,
                       logits=logits.copy())
        t0 = time.perf_counter()
        st, costs = self.stats, None
        if drafter is not None:
            g.drafter, g.length = drafter, drafter.length_for(self.model)
            drafter.start(g.history)    # a draft model's prefill, counted as the prompt's
            g.draft_started, costs = True, g.length.costs
            t1 = time.perf_counter()
            st.prompt_seconds += t1 - t0
            t0 = t1
        try:
            while not g.done and max_tokens > 0:
                n = len(g.history)
                step([g], self.model, costs=costs, alone=True)
                if g.error is not None:
                    raise g.error
                for tok in g.history[n:]:
                    st.gen_tokens += 1
                    yield tok
            if drafter is None and g.finish_reason == "length":
                # the whole reply in the cache, as plain generate has always left it: the
                # next turn's prompt reuses it
                self.model.forward([g.history[-1]], self.seq)
        finally:
            st.gen_seconds = time.perf_counter() - t0
            st.stop_reason = g.finish_reason or "length"
            st.drafted, st.accepted, st.shifts = g.drafted, g.accepted, g.shifts

    def save_prompt(self, path: str | Path, chat: dict | None = None) -> Path:
        """Write the cache and tokens of llm.seq to path (prompt_cache.py; `chat`, a
        {"system", "messages"} conversation, is kept with them): a later run loads it with
        load_prompt instead of reading those tokens again."""
        return prompt_cache.save(path, self.seq, self.model, chat)

    def load_prompt(self, path: str | Path) -> prompt_cache.SavedPrompt:
        """Put a saved prompt in llm.seq (refused, with what differs, if another model or
        cache kind made it); the next generate or logits reuses its longest common prefix
        with the new prompt, as with any cache."""
        return prompt_cache.load(path, self.seq, self.model)

    def ready_context_shift(self) -> None:
        """Compile (or load from the cache) the context shift's kernel now, at start-up,
        not at the first shift in the middle of a conversation."""
        seq = self.model.new_sequence(min(self.ctx, 32))
        seq.fill_random(2, np.random.default_rng(0))
        seq.shift(0, 1, self.model.inv_freq)

    def reset(self):
        self.seq.reset()


def load(path: str | Path | None = None, ctx: int | None = None, threads: int | None = None,
         batch: int = DEFAULT_BATCH, activations: str = "int8",
         cache_type_k: str = DEFAULT_CACHE_TYPE, cache_type_v: str = DEFAULT_CACHE_TYPE,
         chat_template_kwargs: str | dict | None = None) -> LLM:
    """Load a GGUF of a family in the architecture table (memory-mapped, edgellama/models).
    path None = the default model (fetched once).
    activations: how x is rounded for the matrix products (model.ACTIVATIONS);
    cache_type_k, cache_type_v: how the KV cache stores K and V (kv_cache.CACHE_TYPES),
    the default of every sequence (model.new_sequence(type_k=, type_v=) for others).
    chat_template_kwargs: extra variables of every chat render (llm.chat.template_kwargs;
    {"enable_thinking": False}: Qwen 3 answers without thinking)."""
    t0 = time.perf_counter()
    extra = template_kwargs(chat_template_kwargs)   # checked before the file is read
    start_renderer()   # the chat template process starts while the file loads
    if path is None:
        from .default_model import default_model_path
        path = default_model_path()
    policy = ThreadPolicy(threads)
    g = GGUFFile(path)
    args = ModelArgs.from_gguf(g)
    model_ctx = args.train_ctx
    if ctx is None:
        ctx = min(model_ctx, DEFAULT_CTX)
    if ctx < 1:
        raise EdgeError(f"--ctx must be at least 1, got {ctx}")
    if ctx > model_ctx:
        raise EdgeError(f"--ctx {ctx} is larger than the {model_ctx} tokens this model "
                        f"supports ({g.path.name})")
    # Counted before the tokenizer is built: building one for a hostile token array takes
    # minutes and gigabytes.
    tokens, embd = g.get("tokenizer.ggml.tokens"), g.tensors.get("token_embd.weight")
    for vocab in (args.vocab_size, embd.shape[0] if embd else args.vocab_size):
        if isinstance(tokens, list) and len(tokens) != vocab:
            raise EdgeError(f"{g.path}: the tokenizer has {len(tokens)} tokens but the model's "
                            f"vocabulary (token_embd.weight) has {vocab}")
    try:
        tokenizer = Tokenizer.from_metadata(g.metadata)
        chat = ChatFormat(tokenizer, g.get("tokenizer.chat_template"))
    except EdgeError as e:
        raise EdgeError(f"{g.path}: {e}") from None
    chat.template_kwargs = extra
    model = Transformer(g, ctx, batch=batch, args=args, threads=policy, activations=activations,
                        cache_type_k=cache_type_k, cache_type_v=cache_type_v)
    llm = LLM(Path(path), g, model, tokenizer, chat, policy.max, time.perf_counter() - t0)
    llm.default_sampling(warn=llm.warnings.append)
    return llm
