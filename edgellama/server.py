"""`edgellama serve`'s application: the OpenAI HTTP API over one loaded model.

    app = create_app(llm, api_key=None, queue_size=16, parallel=None,   # a Starlette (ASGI) app
                     drafter=None)

One model, `parallel` slots (each a Sequence: its own KV cache), one engine thread:
requests are validated and tokenized on arrival (so a bad one fails at once, without
queueing), then take a free slot or wait in a bounded queue; a full queue answers 503.
The engine decodes one token for every running request in one pass over the weights
(continuous batching, see Engine), and reads new prompts a chunk at a time between those
steps. The model is not thread-safe, so only the engine's thread runs it; the event loop
parses requests and passes text on, so it answers /health and refuses bad requests while
replies are being generated.

Prefix reuse: a slot keeps its cache after a request, and a new request goes to the free
slot whose cache its prompt continues (else the least recently used), which recomputes
only from the first token that differs; so a client that re-sends its conversation pays
only for what is new, even while other conversations come and go. `usage.prompt_tokens_details.
cached_tokens` says how much was reused.

Slot files (create_app(slot_save_path=DIR), `serve --slot-save-path`): llama.cpp's POST
/slots/{id}?action=save|restore|erase writes a slot's cache to DIR/filename or reads one
back (prompt_cache's format, names checked by slot_files.SlotFiles), on the engine thread
between steps (Engine.run); and an evicted conversation's cache is spilled to DIR and
restored when the conversation comes back (Engine._prepare). The folder failing under
the running server (removed, replaced by a file, unwritable, full) is the server's
storage, not the client's request: a save answers 507, a restore 503, logged once.

Hostile input (tests/server/test_server_hostile.py, tests/server/test_fuzz_server.py): every field's JSON
type and range is checked, a wrong one answered 400 naming it; bodies must be JSON (415);
Host and Origin headers are checked against DNS rebinding and cross-site requests
(_Guard: 403); stopping the server ends waiting and running requests with 503
(Engine.shutdown). No request gets a 500 or a traceback in the log. Every walk over
what a client sends is bounded: a body's fields nest at most MAX_BODY_DEPTH levels (and
schemas, tools' parameters and calls' arguments constrain.MAX_DEPTH).

Structured output: response_format / json_schema / grammar and a forced tool_choice become
a grammar (edgellama/constrain.py) compiled on arrival (a bad one is a 400 before
queueing); sample_token(job, logits, history) is the one per-token step (penalties, the
job's grammar mask, its sampler, logprobs). Tool calls are read from the reply as it is
generated (edgellama/tool_calls.py) and streamed as OpenAI streams them: a reply that
starts like a call is held back until its function's name is read, then the call is
announced and its arguments follow as they are generated.

Speculative decoding (create_app(drafter=...), `serve --draft/--lookup`): a slot may
check proposed tokens in the engine's step, where speculative.plan_step says they raise
the step's expected tokens per second (Engine); usage then counts them in OpenAI's
completion_tokens_details.

Stop strings are matched on the decoded text across token boundaries. Text that could
be the start of a stop string is held back until it is known not to be one, so no part
of a stop string is ever sent, streamed or not.
"""
from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import math
import re
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from . import prompt_cache
from .errors import EdgeError
from .constrain import (MAX_DEPTH, Constraint, GrammarError, gbnf_grammar,
                        json_object_grammar, json_schema_grammar, nests_deeper, sample)
from .llm import LLM
from .machine import available_memory
from .sampling import Sampler, SamplingParams, log_probs
from .scratch import Scratch
from .sequence import Sequence
from .slot_files import SPILL_MIN, BadFileName, NoSuchFile, SlotFiles, StorageError
from .speculative import (DraftLength, DraftModel, Drafter, PassCost, plan_step,
                          rejection_test)
from .tokenizer import StreamDecoder
from .tool_calls import ToolCallStream, tool_call_schema

log = logging.getLogger("edgellama.server")

DEFAULT_QUEUE = 16
DEFAULT_PARALLEL = 4        # slots unless --parallel says (fewer if memory is short): the
                            # batched decode kernels multiply tokens in groups of four, so
                            # up to four sequences share one pass's work (bench_batch_decode)
PREFILL_CHUNK = 64          # prompt tokens read per step while other requests decode: a
                            # decode step costs what a few prompt tokens do, so a long prompt
                            # is read nearly as fast as alone, and the others stall one chunk
MAX_BODY = 8 << 20          # bytes of a request body: a 128k-token context is ~0.5 MB of text
MAX_BODY_DEPTH = 128        # levels of nesting of a body: every walk over it stays shallow
                            # (a schema's own limit, MAX_DEPTH, is below it)
MAX_STOPS = 16              # stop strings per request (OpenAI allows 4)
MAX_STOP_CHARS = 500        # characters of one stop string
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
         "tool": "tool"}
MAX_TOOLS = 128             # OpenAI's limit on functions per request
MAX_TOP_LOGPROBS = 20       # OpenAI's limit (chat; completions' `logprobs` allows 5)
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")   # OpenAI's function names
# Parameters whose non-default values would change the answer in ways we do not
# implement: refused rather than silently ignored. Everything else unknown is ignored.
UNSUPPORTED = {
    "functions": ([],), "function_call": ("none", "auto"),
    "logit_bias": ({},), "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0), "echo": (False,), "suffix": ("",), "best_of": (1,),
    "audio": (), "prediction": (),
}


class ApiError(Exception):
    """An error answer in OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, kind: str | None = None):
        message, param = _clean(message), param and _clean(param)   # may quote a client's text
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or ("server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


# -- request validation -------------------------------------------------------------------------

def _bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


def _clean(text: str) -> str:
    """JSON can carry lone surrogates ("\\ud800"), which no tokenizer takes: U+FFFD instead."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


def _show(v: Any) -> str:
    """A client's value for an error message: its JSON, cut short (a 4000-digit number or a
    megabyte of text must not come back in full)."""
    try:
        text = json.dumps(v, ensure_ascii=False)
    except (TypeError, ValueError):   # an int past Python's digit limit, say
        text = f"a {type(v).__name__}"
    return text if len(text) <= 60 else text[:57] + "..."


def _number(body: dict, name: str, lo: float, hi: float, lo_open: bool = False) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _bad(f"{name} must be a number, got {_show(v)}", name)
    if v > hi or v < lo or (lo_open and v == lo):
        raise _bad(f"{name} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], "
                   f"got {_show(v)}", name)
    return float(v)


def _integer(body: dict, name: str, lo: int | None = None, param: str | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(f"{param or name} must be an integer, got {_show(v)}", param or name)
    if lo is not None and v < lo:
        raise _bad(f"{param or name} must be at least {lo}, got {_show(v)}", param or name)
    return v


def _flag(body: dict, name: str, param: str | None = None) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _bad(f"{param or name} must be true or false, got {_show(v)}", param or name)
    return v


def _string(body: dict, name: str) -> str | None:
    v = body.get(name)
    if v is not None and not isinstance(v, str):
        raise _bad(f"{name} must be a string, got {_show(v)}", name)
    return v


def _stops(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _bad("stop must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOPS:
        raise _bad(f"stop takes at most {MAX_STOPS} strings, got {len(stops)}", "stop")
    if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise _bad(f"each stop string must have 1 to {MAX_STOP_CHARS} characters", "stop")
    return [_clean(s) for s in stops]


def _message_text(content: Any, i: int) -> str:
    """A message's content: a string, or a list of text parts (OpenAI's newer form)."""
    param = f"messages[{i}].content"
    if isinstance(content, str):
        return _clean(content)
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise _bad("only text content parts are supported", param)
            if not isinstance(part.get("text"), str):
                raise _bad("a text content part needs a string 'text'", param)
            parts.append(_clean(part["text"]))
        return "".join(parts)
    raise _bad("content must be a string or a list of text parts", param)


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _bad("each message must be an object with role and content", f"messages[{i}]")
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise _bad(f"role must be one of {', '.join(ROLES)}; got {_show(role)}",
                       f"messages[{i}].role")
        if m.get("function_call"):
            raise _bad("function_call (OpenAI's old form) is not supported; use tool_calls",
                       f"messages[{i}]")
        if m.get("name") is not None and not isinstance(m["name"], str):
            raise _bad("name must be a string", f"messages[{i}].name")
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""
        message = {"role": ROLES[role], "content": _message_text(content, i)}
        if role == "assistant" and m.get("tool_calls"):
            message["tool_calls"] = _message_tool_calls(m["tool_calls"], i)
        if role == "tool":
            call_id = m.get("tool_call_id")
            if call_id is not None and not isinstance(call_id, str):
                raise _bad("tool_call_id must be a string", f"messages[{i}].tool_call_id")
            message["tool_call_id"] = call_id or ""
        out.append(message)
    return out


def _message_tool_calls(calls: Any, i: int) -> list[dict]:
    """An assistant message's tool_calls as templates read them: arguments as an object
    (Llama 3.2's template writes `arguments | tojson`)."""
    param = f"messages[{i}].tool_calls"
    if not isinstance(calls, list) or len(calls) > MAX_TOOLS:
        raise _bad(f"tool_calls must be a list of at most {MAX_TOOLS} calls", param)
    out = []
    for call in calls:
        f = call.get("function") if isinstance(call, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) \
                or not isinstance(f.get("arguments", ""), str):
            raise _bad("each tool call needs a function with a string name and arguments "
                       "(JSON text)", param)
        if not isinstance(call.get("id", ""), str):
            raise _bad("a tool call's id must be a string", param)
        try:
            args = json.loads(f.get("arguments") or "{}")
        except (ValueError, RecursionError):
            raise _bad("a tool call's arguments must be JSON text", param) from None
        if nests_deeper(args, MAX_DEPTH):
            raise _bad(f"a tool call's arguments nest more than {MAX_DEPTH} levels deep", param)
        out.append({"id": call.get("id", ""), "type": "function",
                    "function": {"name": _clean(f["name"]), "arguments": args}})
    return out


def _tools(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise _bad("tools must be a list of {type: function, function: {...}} objects", "tools")
    if len(tools) > MAX_TOOLS:
        raise _bad(f"tools takes at most {MAX_TOOLS} functions, got {len(tools)}", "tools")
    out, names = [], set()
    for k, t in enumerate(tools):
        param = f"tools[{k}]"
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(f, dict):
            raise _bad("each tool must be {\"type\": \"function\", \"function\": {...}}", param)
        name = f.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise _bad("a function name must be 1 to 64 letters, digits, _ or -, got "
                       f"{_show(name)}", f"{param}.function.name")
        if name in names:
            raise _bad(f"two tools are named {name!r}", f"{param}.function.name")
        names.add(name)
        if f.get("description") is not None and not isinstance(f["description"], str):
            raise _bad("description must be a string", f"{param}.function.description")
        if f.get("parameters") is not None and not isinstance(f["parameters"], dict):
            raise _bad("parameters must be a JSON schema object", f"{param}.function.parameters")
        if nests_deeper(f.get("parameters"), MAX_DEPTH):
            raise _bad(f"parameters nests more than {MAX_DEPTH} levels deep",
                       f"{param}.function.parameters")
        function = {"name": name, "description": _clean(f.get("description") or ""),
                    "parameters": f.get("parameters") or {"type": "object", "properties": {}}}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(body: dict, tools: list[dict] | None) -> str:
    """"none", "auto", "required", or the name of the one function to call."""
    v = body.get("tool_choice")
    if v is None:
        return "auto" if tools else "none"
    if isinstance(v, str) and v in ("none", "auto", "required"):
        choice = v
    elif isinstance(v, dict) and v.get("type") == "function" and isinstance(v.get("function"), dict) \
            and isinstance(v["function"].get("name"), str):
        choice = v["function"]["name"]
        if not tools or choice not in {t["function"]["name"] for t in tools}:
            raise _bad(f"tool_choice names {_show(choice)}, which is not in tools", "tool_choice")
    else:
        raise _bad('tool_choice must be "none", "auto", "required" or {"type": "function", '
                   '"function": {"name": ...}}', "tool_choice")
    if choice != "none" and not tools:
        raise _bad(f"tool_choice {_show(v)} needs tools", "tool_choice")
    return choice


def _grammar(body: dict) -> tuple[str | None, str | None]:
    """(grammar, the parameter it came from) from response_format, or llama.cpp's
    `json_schema` (a schema) and `grammar` (GBNF) fields; at most one of them."""
    given = [k for k in ("response_format", "json_schema", "grammar") if body.get(k) is not None]
    if len(given) > 1:
        raise _bad(f"give at most one of {', '.join(given)}", given[1])
    try:
        if body.get("grammar") is not None:
            if not isinstance(body["grammar"], str):
                raise _bad("grammar must be a string (a GBNF grammar)", "grammar")
            return gbnf_grammar(body["grammar"]), "grammar"
        if body.get("json_schema") is not None:
            return json_schema_grammar(body["json_schema"]), "json_schema"
        fmt = body.get("response_format")
        if fmt is None:
            return None, None
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "text":
            return None, None
        if kind == "json_object":   # llama.cpp also takes a schema here
            schema = fmt.get("schema")
            return (json_object_grammar() if schema is None else json_schema_grammar(schema),
                    "response_format")
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict):
                raise _bad("response_format.json_schema must be an object with a schema",
                           "response_format.json_schema")
            schema = spec.get("schema")
            return (json_object_grammar() if schema is None else json_schema_grammar(schema),
                    "response_format")
        raise _bad('response_format.type must be "text", "json_object" or "json_schema", '
                   f"got {_show(kind)}", "response_format")
    except EdgeError as e:
        raise _bad(str(e), given[0]) from None


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many top alternatives to report per token, or None for no logprobs."""
    if chat:
        if not _flag(body, "logprobs"):
            if body.get("top_logprobs") not in (None, 0):
                raise _bad("top_logprobs needs logprobs: true", "top_logprobs")
            return None
        top = _integer(body, "top_logprobs", 0)
        param = "top_logprobs"
    else:   # completions: logprobs is the number of alternatives
        top = _integer(body, "logprobs", 0)
        param = "logprobs"
        if top is None:
            return None
    if top is not None and top > MAX_TOP_LOGPROBS:
        raise _bad(f"{param} must be at most {MAX_TOP_LOGPROBS}, got {top}", param)
    return top or 0


@dataclass
class Params:
    """What one request asks of the engine, validated."""
    stream: bool
    include_usage: bool
    max_tokens: int | None
    sampling: SamplingParams
    stops: list[str]
    max_tokens_param: str = "max_tokens"   # the name the client gave it under
    top_logprobs: int | None = None        # None: no logprobs; else alternatives per token
    grammar: str | None = None             # the reply must be a sentence of it
    grammar_param: str | None = None
    tools: list[dict] | None = None        # validated OpenAI tool list, as the template gets it
    tool_choice: str = "none"              # none, auto, required, or one function's name
    parallel_tool_calls: bool = True       # False: at most one call per reply
    draft_max: int | None = None           # speculative.n_max: proposals a step, at most


def _params(body: dict, defaults: SamplingParams, chat: bool,
            several_calls: bool = False) -> Params:
    """`several_calls`: the chat template can show several tool calls in one message, so
    a forced call may be a list of them (when parallel_tool_calls allows)."""
    for name, harmless in UNSUPPORTED.items():
        v = body.get(name)
        if v is not None and not any(type(v) is type(h) and v == h for h in harmless):
            raise _bad(f"{name} is not supported by this server (got {_show(v)})", name)
    n = _integer(body, "n")
    if n not in (None, 1):
        raise _bad("only n=1 is supported", "n")
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad(f"stream_options must be an object, got {_show(options)}", "stream_options")
    include_usage = _flag(options or {}, "include_usage", "stream_options.include_usage")
    _string(body, "user")   # ignored, but OpenAI's type
    max_param = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = _integer(body, max_param, 1)
    given = {k: v for k, v in {
        "temperature": _number(body, "temperature", 0, 2),
        "top_p": _number(body, "top_p", 0, 1, lo_open=True),
        # llama.cpp's server extensions, same names
        "top_k": _integer(body, "top_k", 0),
        "min_p": _number(body, "min_p", 0, 1),
        "repeat_penalty": _number(body, "repeat_penalty", 0, 100, lo_open=True),
    }.items() if v is not None}
    # llama.cpp's speculative options: n_max caps this reply's proposals a step (the
    # server's --draft-max and the context cap it in turn; 0: none); n_min and p_min
    # are checked and leave the choice to the engine, which drafts only where it pays
    draft_max = _integer(body, "speculative.n_max", 0)
    _integer(body, "speculative.n_min", 0)
    _number(body, "speculative.p_min", 0, 1)
    seed = _integer(body, "seed")
    if seed is not None:
        given["seed"] = seed % 2**64   # OpenAI takes any int64; NumPy wants one >= 0
    for name, v in given.items():   # the command line's ranges (SamplingParams), should
        try:                        # they ever be narrower than the ones above
            replace(defaults, **{name: v})
        except EdgeError as e:
            raise _bad(f"{name}: {e}", name) from None
    sampling = replace(defaults, **given)
    grammar, grammar_param = _grammar(body)
    tools = _tools(body) if chat else None
    choice = _tool_choice(body, tools) if chat else "none"
    parallel = body.get("parallel_tool_calls") is None or _flag(body, "parallel_tool_calls")
    if choice not in ("none", "auto"):
        if grammar is not None:
            raise _bad(f"tool_choice {choice!r} forces a tool call; it cannot be combined "
                       f"with {grammar_param}", "tool_choice")
        try:   # required and named calls are enforced by a grammar, not hoped for
            grammar = json_schema_grammar(tool_call_schema(
                tools, None if choice == "required" else choice, several_calls and parallel))
        except EdgeError as e:
            raise _bad(f"cannot constrain a call to these tools: {e}", "tools") from None
        grammar_param = "tools"
    return Params(stream, include_usage, max_tokens, sampling, _stops(body), max_param,
                  _logprobs(body, chat), grammar, grammar_param, tools, choice, parallel,
                  draft_max)


# -- the engine ---------------------------------------------------------------------------------

class StopMatcher:
    """Finds stop strings in streamed text; holds back any tail that could begin one."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Text safe to send now, and whether a stop string was reached (the text before
        it is what is returned; the rest of the reply is dropped)."""
        p = self.pending + text
        hits = [i for s in self.stops if (i := p.find(s)) >= 0]
        if hits:
            self.pending = ""
            return p[:min(hits)], True
        keep = 0
        for s in self.stops:   # the longest tail of p that is a prefix of some stop string
            i = p.find(s[0], max(0, len(p) - len(s) + 1))
            while i >= 0 and len(p) - i > keep:
                if s.startswith(p[i:]):
                    keep = len(p) - i
                    break
                i = p.find(s[0], i + 1)
        self.pending = p[len(p) - keep:]
        return p[:len(p) - keep], False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class Job:
    """One request's generation; the engine thread reports to the event loop as events:
    ("text", str, logprobs), ("done", finish_reason, usage), ("error", ApiError),
    ("cancelled",). logprobs: the entries (OpenAI's chat shape) of the tokens the text
    completes, [] unless asked for.

    Its per-token state is here, so one function (sample_token) picks its next token
    whatever else the engine decodes in the same step: the sampler (its own random
    stream), the grammar position, the logprobs recorded."""

    def __init__(self, ids: list[int], max_tokens: int, params: Params,
                 constraint: Constraint | None = None):
        self.ids, self.max_tokens, self.params = ids, max_tokens, params
        self.sampler = Sampler(params.sampling)
        self.constraint = constraint
        self.logprobs: list[tuple[int, float, list[tuple[int, float]]]] = []
        self._logprobs_sent = 0
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self._loop = asyncio.get_running_loop()
        # generation state, touched by the engine thread only
        self.history = list(ids)       # what the repetition penalty looks back on
        self.slot: Slot | None = None
        self.reused = 0                # prompt tokens the slot's cache already held
        self.count = 0                 # tokens generated
        self.next_token = ids[-1]      # fed to the next decode step: the prompt's last,
                                       # then each sampled one
        self.decoder: StreamDecoder | None = None
        self.matcher = StopMatcher(params.stops)
        self.drafted = self.accepted = 0   # speculative decoding: tokens proposed, kept
        self.draft_started = False     # the slot's drafter has read the prompt

    @property
    def may_draft(self) -> bool:
        """Whether proposals can be checked for this reply: at temperature 0 any reply
        (each check is sample_token's own choice, grammar and logprobs included); with
        sampling not under a grammar (rejection sampling knows no mask); not when the
        request asked for none (speculative.n_max 0)."""
        return (self.constraint is None or self.params.sampling.temperature == 0) \
            and self.params.draft_max != 0

    @property
    def reading(self) -> bool:
        """Still reading its prompt: the cache lacks more than the last prompt token
        (which the first decode step feeds)."""
        return self.slot.seq.pos < len(self.ids) - 1

    def emit(self, *event: Any) -> None:
        with contextlib.suppress(RuntimeError):   # the loop is closed: the server has stopped
            self._loop.call_soon_threadsafe(self.events.put_nowait, event)

    def take_logprobs(self, upto: int, tokenizer) -> list[dict]:
        """The logprob entries of tokens [sent, upto) in OpenAI's chat shape."""
        out = [_logprob_entry(tokenizer, tok, lp, top)
               for tok, lp, top in self.logprobs[self._logprobs_sent:upto]]
        self._logprobs_sent = max(self._logprobs_sent, upto)
        return out


def sample_token(job: Job, logits: np.ndarray, history: list[int]) -> int:
    """The next token of `job` from its next-token logits (V,): the repetition penalty,
    the job's grammar mask (-inf on what the grammar forbids), its sampler; records the
    token's logprobs if asked (from these adjusted logits, before temperature: see
    sampling.log_probs) and advances the grammar past the token."""
    tok, adjusted = sample(job.sampler, logits, history, job.constraint,
                           job.max_tokens - job.count)
    _record_logprobs(job, tok, adjusted)
    return tok


def _record_logprobs(job: Job, tok: int, adjusted: np.ndarray) -> None:
    top = job.params.top_logprobs
    if top is not None:
        lp = log_probs(adjusted)
        best = np.argsort(-lp, kind="stable")[:top] if top else []
        job.logprobs.append((tok, float(lp[tok]), [(int(i), float(lp[i])) for i in best
                                                   if np.isfinite(lp[i])]))


def _logprob_entry(tokenizer, tok: int, lp: float, top: list[tuple[int, float]]) -> dict:
    def one(i: int, v: float) -> dict:
        b = tokenizer.token_bytes(i)
        # a probability that underflows to 0 gives -inf, which is not JSON: OpenAI's floor
        return {"token": b.decode("utf-8", "replace"), "logprob": max(v, -9999.0),
                "bytes": list(b)}
    return {**one(tok, lp), "top_logprobs": [one(i, v) for i, v in top]}


@dataclass(eq=False)
class Slot:
    """One sequence of the engine. Its KV cache outlives the requests it serves: the next
    request that shares a prefix with the tokens it holds reads only the rest."""
    index: int
    seq: Sequence
    job: Job | None = None
    last_used: int = 0    # admission count when it last took a job
    drafter: Drafter | None = None       # speculative decoding: its own (a draft model's
    length: DraftLength | None = None    # KV cache), with its acceptance measured
    off_steps: int = 0    # steps since it last drafted or probed


def shared_prefix(cached: list[int], ids: list[int]) -> int:
    """How many leading tokens `cached` and `ids` have in common."""
    n = 0
    for a, b in zip(cached, ids):
        if a != b:
            break
        n += 1
    return n


def _reusable(cached: list[int], ids: list[int]) -> int:
    """The tokens a prompt would reuse of a slot's cache, counted only where the prompt
    continues what the slot holds (keeps at least half of it): a chat template's opening
    alone saves little, and taking that slot would evict another conversation."""
    n = shared_prefix(cached, ids)
    return n if 2 * n >= len(cached) else 0


def choose_parallel(asked: int | None, slot_bytes: int, ctx: int) -> int:
    """The number of slots: `asked`, refused if the available memory cannot hold that many
    full KV caches; by default DEFAULT_PARALLEL, fewer if memory holds fewer (at least
    one: loading the model checked that one fits). A cache's pages are mapped as its
    positions are written, so this is the most the slots can come to take, never an
    out-of-memory kill halfway through a reply."""
    avail = available_memory()
    fits = None if avail is None else avail // slot_bytes
    if asked is None:
        return DEFAULT_PARALLEL if fits is None else max(1, min(DEFAULT_PARALLEL, fits))
    if asked < 1:
        raise EdgeError(f"--parallel must be at least 1, got {asked}")
    if fits is not None and asked > fits:
        raise EdgeError(f"--parallel {asked} needs {asked * slot_bytes / 2**20:.0f} MiB of KV "
                        f"cache ({slot_bytes / 2**20:.0f} MiB a slot at ctx {ctx}), but only "
                        f"{avail / 2**20:.0f} MiB of memory is available; use a smaller "
                        f"--parallel or --ctx")
    return asked


class Engine:
    """The one thread that runs the model, its `parallel` slots and the bounded queue in
    front of them.

    Continuous batching: each step reads one chunk of the prompt of the earliest admitted
    request still reading (PREFILL_CHUNK tokens while others decode, so they are not
    stalled long; the model's batch when none does), then decodes one token for every
    request whose prompt is read, all of them in one pass over the weights
    (Transformer.decode). Requests join (a free slot) and leave (done, cancelled) between
    steps, so none waits for another to finish, and each decoding request gets one token
    a step. A request goes to the free slot whose cache its prompt continues furthest
    (_reusable), else to the least recently used one, so interleaved conversations keep
    their caches. All slots share one Scratch: one pass runs at a time.

    Speculative decoding (`drafter`: a draft model or prompt lookup, one copy a slot): in
    a step, a slot may also feed proposed tokens, checked in the same pass as the other
    slots' tokens (Transformer.decode's counts); plan_step picks, from the measured pass
    costs and each slot's acceptance, the proposals that raise the step's expected tokens
    per second, so with several slots decoding only a high acceptance drafts. A slot
    that is not drafting probes every probe_interval steps: one proposal, compared with the
    token its plain step chooses (what its check would accept at temperature 0), which
    adds no row to the pass."""

    def __init__(self, llm: LLM, capacity: int = DEFAULT_QUEUE, parallel: int | None = None,
                 drafter: Drafter | None = None, files: SlotFiles | None = None):
        self.llm, self.capacity, self.files = llm, capacity, files
        model = llm.model
        self.scratch = Scratch()
        first = model.new_sequence(scratch=self.scratch)
        draft_bytes = drafter.seq.cache.nbytes if isinstance(drafter, DraftModel) else 0
        self.parallel = choose_parallel(parallel, first.cache.nbytes + draft_bytes, llm.ctx)
        self.slots = [Slot(0, first)] + [Slot(i, model.new_sequence(scratch=self.scratch))
                                         for i in range(1, self.parallel)]
        self.costs = PassCost(model.one_pass_verify) if drafter else None
        if drafter:
            for slot in self.slots:
                slot.drafter = drafter if slot.index == 0 else drafter.copy()
                slot.length = DraftLength(*drafter.bounded(llm.ctx), costs=self.costs)
        self._stop_ids = llm.tokenizer.stop_ids
        self._cond = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._active: list[Job] = []     # in admission order
        self._calls: list[tuple[Future, Callable]] = []   # run() between steps
        self._admitted = 0
        self._closed = False
        self._storage_problem: str | None = None   # the slot files' failure last logged
        self._thread = threading.Thread(target=self._work, name="edgellama-engine", daemon=True)
        self._thread.start()

    @property
    def kv_cache_bytes(self) -> int:
        """The slots' KV caches at full context: the most they take."""
        return sum(s.seq.cache.nbytes for s in self.slots)

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._closed:
                raise ApiError(503, "the server is shutting down", code="shutting_down")
            # a job that finds a free slot waits only until the engine thread takes it
            free = self.parallel - len(self._active)
            if len(self._waiting) >= self.capacity + free:
                raise ApiError(503, f"the server is busy: {len(self._active)} requests are "
                                    f"running (--parallel {self.parallel}) and "
                                    f"{len(self._waiting)} are waiting, the most it queues "
                                    f"(--queue {self.capacity}); retry later", code="queue_full")
            self._waiting.append(job)
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """Stop a job: dropped if still waiting, else stopped before its next step."""
        job.cancelled.set()
        with self._cond:
            if job in self._waiting:
                self._waiting.remove(job)
                job.emit("cancelled")

    def status(self) -> dict:
        with self._cond:
            return {"running": len(self._active), "waiting": len(self._waiting),
                    "capacity": self.capacity}

    def slot_status(self) -> dict:
        """The slots for /health: how many, which are busy, the tokens each cache holds,
        and their KV cache memory."""
        with self._cond:
            return {"parallel": self.parallel,
                    "busy": sum(s.job is not None for s in self.slots),
                    "cached_tokens": [len(s.seq.tokens) for s in self.slots],
                    "kv_cache_bytes_per_slot": self.slots[0].seq.cache.nbytes,
                    "kv_cache_bytes": self.kv_cache_bytes}

    def slot_list(self) -> list[dict]:
        """GET /slots (llama.cpp's names): each slot's id, whether it is busy, its
        context and the tokens its cache holds."""
        with self._cond:
            return [{"id": s.index, "is_processing": s.job is not None, "n_ctx": s.seq.ctx,
                     "n_cached": s.seq.pos} for s in self.slots]

    def shutdown(self) -> None:
        """Take no more requests, and end the waiting and running ones now: each is told
        503 shutting_down (the running ones stop before the next step). Returns at once;
        safe to call more than once, from any thread."""
        with self._cond:
            self._closed = True
            jobs = list(self._waiting) + self._active
            self._waiting.clear()
            calls, self._calls = self._calls, []
            self._cond.notify_all()
        for future, _ in calls:
            if future.set_running_or_notify_cancel():   # not cancelled: its client waits
                future.set_exception(ApiError(503, "the server is shutting down",
                                              code="shutting_down"))
        for job in jobs:
            job.cancelled.set()
            job.emit("error", ApiError(503, "the server is shutting down; the request was "
                                            "not finished", code="shutting_down"))

    def close(self, timeout: float = 5.0) -> None:
        """shutdown(), then wait (at most `timeout` s) for the engine thread to end."""
        self.shutdown()
        self._thread.join(timeout)

    def run(self, fn: Callable[[], Any]) -> Future:
        """fn() on the engine thread between steps (where no pass uses a slot's cache and
        no request is admitted), its result or exception in the future."""
        future: Future = Future()
        with self._cond:
            if self._closed:
                raise ApiError(503, "the server is shutting down", code="shutting_down")
            self._calls.append((future, fn))
            self._cond.notify()
        return future

    def _work(self) -> None:
        while True:
            with self._cond:
                while not (self._waiting or self._active or self._calls or self._closed):
                    self._cond.wait()
                if self._closed:
                    return
                calls, self._calls = self._calls, []
            for future, fn in calls:   # outside the lock: file work must not block submit()
                if not future.set_running_or_notify_cancel():   # its client left
                    continue
                try:
                    future.set_result(fn())
                except Exception as e:  # noqa: BLE001 - that request fails, the server stays up
                    if not isinstance(e, ApiError):
                        log.exception("a slot action failed")
                        e = ApiError(500, "internal error; the server log has the details")
                    future.set_exception(e)
            with self._cond:
                admitted = self._admit()
                jobs = list(self._active)
            for job in admitted:
                self._prepare(job)
            for job in jobs:
                if job.cancelled.is_set():   # the client left: its slot is free now
                    self._release(job, "cancelled")
            jobs = [j for j in jobs if not j.cancelled.is_set()]
            reading = [j for j in jobs if j.reading]
            ready = [j for j in jobs if not j.reading]
            if reading:
                self._guarded(reading[:1], self._read_prompt, reading[0], bool(ready))
            if ready:
                self._guarded(ready, self._decode, ready)

    def _admit(self) -> list[Job]:
        """Waiting jobs into free slots, first come first served (holding the lock); the
        jobs admitted, for _prepare."""
        free = [s for s in self.slots if s.job is None]
        admitted = []
        while self._waiting and free:
            job = self._waiting.popleft()
            slot = max(free, key=lambda s: (_reusable(s.seq.tokens, job.ids), -s.last_used))
            free.remove(slot)
            self._admitted += 1
            slot.job, slot.last_used, job.slot = job, self._admitted, slot
            job.decoder = StreamDecoder(self.llm.tokenizer)
            self._active.append(job)
            admitted.append(job)
        return admitted

    def _prepare(self, job: Job) -> None:
        """The job's slot cut to what its prompt reuses. With --slot-save-path, a
        conversation of at least SPILL_MIN tokens that the job evicts is spilled to a file
        first, and a spilled one the prompt continues further than the slot's cache is
        restored into the slot (SlotFiles). A failed spill or restore costs only time: it
        is logged, and the prompt is read."""
        seq, files = job.slot.seq, self.files
        if files is not None and files.spill_max > 0:
            keep = _reusable(seq.tokens, job.ids)
            spilled = files.best(job.ids)
            restore = spilled is not None and spilled[1] > keep
            if (restore or not keep) and seq.pos >= SPILL_MIN:
                try:
                    files.spill(seq, self.llm.model)
                except EdgeError as e:
                    self._log_storage(f"a conversation was not spilled: {e}")
            if restore:
                try:
                    files.restore(spilled[0], seq, self.llm.model)
                except EdgeError as e:
                    log.warning("slot %d: spilled cache not restored: %s", job.slot.index, e)
        job.reused = seq.reuse_prefix(job.ids)

    # -- POST /slots/{id}: on the engine thread (run()), so no request is admitted to the
    # slot, and no pass reads its cache, while its file is written or read
    def _idle_slot(self, index: int) -> Slot:
        slot = self.slots[index]
        if slot.job is not None:
            raise ApiError(409, f"slot {index} is busy with a request; retry when it is done",
                           code="slot_busy")
        return slot

    def save_slot(self, index: int, filename: Any) -> dict:
        slot = self._idle_slot(index)
        path = self._slot_file(filename, saving=True)
        n = slot.seq.pos
        if n == 0:
            raise _bad(f"slot {index} holds no cache to save", code="slot_empty")
        t0 = time.perf_counter()
        try:
            prompt_cache.save(path, slot.seq, self.llm.model)
            written = path.stat().st_size
        except (EdgeError, OSError) as e:
            raise self._file_failed(e, path, filename, saving=True) from None
        self._storage_problem = None
        return {"id_slot": index, "filename": filename, "n_saved": n, "n_written": written,
                "timings": {"save_ms": (time.perf_counter() - t0) * 1e3}}

    def restore_slot(self, index: int, filename: Any) -> dict:
        slot = self._idle_slot(index)
        path = self._slot_file(filename, saving=False)
        t0 = time.perf_counter()
        try:
            read = path.stat().st_size
            prompt_cache.load(path, slot.seq, self.llm.model)
        except (EdgeError, OSError) as e:
            raise self._file_failed(e, path, filename, saving=False) from None
        self._storage_problem = None
        return {"id_slot": index, "filename": filename, "n_restored": slot.seq.pos,
                "n_read": read, "timings": {"restore_ms": (time.perf_counter() - t0) * 1e3}}

    def _slot_file(self, filename: Any, saving: bool):
        try:
            return self.files.path(filename, saving)
        except NoSuchFile as e:
            raise ApiError(404, str(e), "filename", "file_not_found") from None
        except BadFileName as e:
            raise _bad(str(e), "filename", "invalid_filename") from None
        except StorageError as e:
            raise self._storage_failed(e, filename, saving) from None

    def _file_failed(self, e: Exception, path, filename: str, saving: bool) -> ApiError:
        """What a failed save or restore answers. The server's storage failing (the
        folder gone or replaced, unwritable, a full disk, a read error) is not the
        client's doing: 507 for a save (RFC 4918: the server cannot store what the
        request needs), 503 for a restore. A file that is not a usable saved prompt
        (damaged, another model's) is the client's: 400."""
        cause = e if isinstance(e, OSError) else e.__context__
        if isinstance(cause, FileNotFoundError) and not saving:
            return ApiError(404, _local(e, path, filename), "filename", "file_not_found")
        try:
            self.files.check(writing=saving)
        except StorageError as broken:
            return self._storage_failed(broken, filename, saving)
        if isinstance(cause, OSError):
            return self._storage_failed(e, filename, saving, path)
        return _bad(_local(e, path, filename), "filename",
                    "save_failed" if saving else "restore_failed")

    def _log_storage(self, detail: str) -> None:
        """One line for a failure of the slot files' storage, the first time (not again
        until a save or restore succeeds, or another problem comes)."""
        if detail != self._storage_problem:
            self._storage_problem = detail
            log.error("slot files: %s", detail)

    def _storage_failed(self, e: Exception, filename: str, saving: bool,
                        path=None) -> ApiError:
        """The answer to a save or restore that the server's storage failed."""
        self._log_storage(str(e) if isinstance(e, EdgeError) else f"{path}: {e.strerror or e}")
        where = _local(e, path, filename).replace(str(self.files.folder), "the slot folder")
        action = "save to" if saving else "restore from"
        return ApiError(507 if saving else 503, f"cannot {action} {filename}: the server's "
                        f"storage failed: {where}", "filename", "storage_failed")

    def erase_slot(self, index: int) -> dict:
        slot = self._idle_slot(index)
        n = slot.seq.pos
        slot.seq.reset()
        return {"id_slot": index, "n_erased": n}

    def _guarded(self, jobs: list[Job], step, *args) -> None:
        """Run one step for `jobs`; if it fails, they fail (500) and the server goes on."""
        try:
            step(*args)
        except Exception as e:  # noqa: BLE001 - those requests fail, the server stays up
            if isinstance(e, EdgeError):   # the model, not the request (that was checked)
                error = ApiError(500, str(e))
            else:
                log.exception("generation failed")
                error = ApiError(500, "internal error while generating; the server log "
                                      "has the details")
            for job in jobs:
                job.emit("error", error)
                self._release(job, None)

    def _read_prompt(self, job: Job, others_decoding: bool) -> None:
        """One chunk of the job's prompt into its slot's cache. A client that leaves
        stops the reading between chunks; what was read stays for the next request."""
        seq = job.slot.seq
        chunk = PREFILL_CHUNK if others_decoding else self.llm.model.batch
        end = min(len(job.ids) - 1, seq.pos + chunk)
        self.llm.model.forward(job.ids[seq.pos:end], seq)

    def _decode(self, jobs: list[Job]) -> None:
        """One token for each job, all in one pass over the weights; with a drafter, a
        job may also check proposals in that pass, and take each one accepted."""
        drafts = self._drafts(jobs) if self.costs else [([], None, None)] * len(jobs)
        counts = [1 + len(d) for d, _, _ in drafts]
        t0 = time.perf_counter()
        logits = self.llm.model.decode(
            [j.slot.seq for j in jobs],
            [t for j, (d, _, _) in zip(jobs, drafts) for t in [j.next_token, *d]],
            self.scratch, counts)
        if self.costs:
            self.costs.observe(sum(counts), time.perf_counter() - t0)
        start = 0
        for job, (d, q, probe), n in zip(jobs, drafts, counts):
            rows, start = logits[start:start + n], start + n
            try:
                self._take(job, rows, d, q, probe)
            except GrammarError as e:   # its grammar gave up mid-reply: this request
                # fails, not the others of the step
                job.emit("error", ApiError(400, str(e), job.params.grammar_param,
                                           "invalid_grammar"))
                self._release(job, None)

    def _drafts(self, jobs: list[Job]) -> list[tuple[list[int], np.ndarray | None, int | None]]:
        """Each job's proposals for this step (plan_step's lengths), the distributions
        they were drawn from (None: a point mass), and a probe (a proposal to compare
        with the plain step's token, not fed) or None."""
        lengths = [j.slot.length if j.may_draft else None for j in jobs]
        room = [min(j.max_tokens - j.count, j.slot.seq.ctx - j.slot.seq.pos) - 1 for j in jobs]
        room = [r if j.params.draft_max is None else min(r, j.params.draft_max)
                for j, r in zip(jobs, room)]
        out = []
        for job, L, k in zip(jobs, lengths, plan_step(lengths, room, self.costs)):
            slot = job.slot
            slot.off_steps = 0 if k else slot.off_steps + 1
            probe = L is not None and not k and slot.off_steps % L.probe_interval == 0
            if not (k or probe):
                out.append(([], None, None))
                continue
            if not job.draft_started:   # a draft model reads the prompt: not a draft's cost
                slot.drafter.start(job.history)
                job.draft_started = True
            if probe:   # not timed: a draft model catches up on the steps since the last
                d, _ = slot.drafter.propose(job.history, 1, job.sampler)
                out.append(([], None, d[0] if d else None))
                continue
            t0 = time.perf_counter()
            d, q = slot.drafter.propose(job.history, k, job.sampler)
            L.observe_draft(len(d), time.perf_counter() - t0)
            out.append((d, q, None))
        return out

    def _take(self, job: Job, rows: np.ndarray, drafts: list[int], q: np.ndarray | None,
              probe: int | None) -> None:
        """The job's tokens from its rows of the step: each row's token as plain decoding
        would choose it (at temperature 0, sample_token's own choice; with sampling, a
        proposal passes speculative.rejection_test), as long as the proposals fed after
        it are the tokens chosen; the cache is cut back to the last one kept."""
        seq, slot = job.slot.seq, job.slot
        base = seq.pos - len(rows)      # where next_token went
        accepted = 0
        job.drafted += len(drafts)      # counted before a token ends the reply (usage)
        for i, row in enumerate(rows):
            d = drafts[i] if i < len(drafts) else None
            if d is not None and job.params.sampling.temperature > 0:
                ok, tok = rejection_test(job.sampler, row, job.history, d,
                                         None if q is None else q[i])
                tok = d if ok else tok
                if job.params.top_logprobs is not None:
                    _record_logprobs(job, tok, job.sampler.adjusted(row, job.history))
            else:
                tok = sample_token(job, row, job.history)
                ok = tok == d
            accepted += ok
            job.accepted += ok
            self._advance(job, tok, base + 1 + i)
            if not ok or slot.job is not job:   # rejected, or the reply ended
                break
        seq.truncate(base + 1 + accepted)   # the rows after the last token kept
        if drafts:
            slot.length.observe_acceptance(len(drafts), accepted)
        elif probe is not None:
            slot.length.observe_acceptance(1, int(tok == probe))

    def _advance(self, job: Job, tok: int, cached: int) -> None:
        """Take the sampled token (`cached`: the positions its slot's cache holds before
        it): stream its text, or end the reply."""
        if tok in self._stop_ids:
            self._finish(job, "stop")
            return
        job.count += 1
        job.history.append(tok)
        text, hit = job.matcher.push(job.decoder.push(tok))
        if text:
            job.emit("text", text, job.take_logprobs(job.count, self.llm.tokenizer))
        if hit:
            self._finish(job, "stop", flush=False)
        elif job.constraint is not None and job.constraint.finished:
            self._finish(job, "stop")   # its end: no step for the stop token, whatever the budget
        elif job.count >= job.max_tokens or cached >= job.slot.seq.ctx:
            self._finish(job, "length")
        else:
            job.next_token = tok

    def _finish(self, job: Job, finish: str, flush: bool = True) -> None:
        if flush:   # text held back by the decoder (a partial character) or the matcher
            text, hit = job.matcher.push(job.decoder.flush())
            text += "" if hit else job.matcher.flush()
            rest = job.take_logprobs(job.count, self.llm.tokenizer)
            if text or rest:
                job.emit("text", text, rest)
            finish = "stop" if hit else finish
        prompt = len(job.ids)
        usage = {"prompt_tokens": prompt, "completion_tokens": job.count,
                 "total_tokens": prompt + job.count,
                 "prompt_tokens_details": {"cached_tokens": job.reused}}
        if self.costs:   # speculative decoding: proposals kept and not (OpenAI's names)
            usage["completion_tokens_details"] = {
                "accepted_prediction_tokens": job.accepted,
                "rejected_prediction_tokens": job.drafted - job.accepted}
        self._release(job, None)   # first: a client that has its reply finds the slot free
        job.emit("done", finish, usage)

    def _release(self, job: Job, event: str | None) -> None:
        """Free the job's slot (its cache stays, for prefix reuse); tell the client `event`."""
        if event:
            job.emit(event)
        with self._cond:
            if job in self._active:
                self._active.remove(job)
                job.slot.job = None


def _local(e: Exception, path, filename: str) -> str:
    """An error about a slot file, naming it as the client did (not the server's folder)."""
    text = str(e) if isinstance(e, EdgeError) else f"{path}: {e.strerror or e}"
    return text if path is None else text.replace(str(path), filename)


# -- the HTTP side ------------------------------------------------------------------------------

def _check_json_type(headers: Headers) -> None:
    """A body must be sent as JSON (or with no Content-Type at all). The types a web page
    may send cross-site without asking first (text/plain, form encodings: a "simple"
    request, which no CORS preflight guards) are refused, as is anything else."""
    given = headers.get("content-type")
    media = (given or "").partition(";")[0].strip().lower()
    if given is not None and media != "application/json" and not media.endswith("/json") \
            and not media.endswith("+json"):
        raise ApiError(415, f"the request body must be JSON sent with 'Content-Type: "
                            f"application/json', not {_show(given)}", "Content-Type",
                       "unsupported_media_type")


async def _read_json(request: Request) -> dict:
    _check_json_type(request.headers)
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > MAX_BODY:
        raise ApiError(413, f"the request body is over {MAX_BODY >> 20} MiB",
                       code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY:
            raise ApiError(413, f"the request body is over {MAX_BODY >> 20} MiB",
                           code="request_too_large")
        chunks.append(chunk)

    def no_constants(name: str):
        raise ValueError(f"{name} is not JSON")
    try:
        body = json.loads(b"".join(chunks), parse_constant=no_constants)
    except (ValueError, RecursionError) as e:
        raise _bad(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    for name, v in body.items():
        if nests_deeper(v, MAX_BODY_DEPTH - 1):
            raise _bad(f"{_show(name)} nests more than {MAX_BODY_DEPTH} levels deep (with the "
                       f"body around it)", name)
    return body


async def _tokenize(encode, text: Any) -> list[int]:
    """encode(text) off the event loop. The tokenizer's own failures (tiktoken's regex
    engine panics on some very long inputs: a PanicException, which is not an Exception)
    become one log line and a clean 500, not a traceback and a dropped connection."""
    try:
        return await run_in_threadpool(encode, text)
    except (EdgeError, asyncio.CancelledError, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001
        log.error("tokenizing a request failed: %s: %s", type(e).__name__,
                  str(e).splitlines()[0][:200] if str(e) else "")
        raise ApiError(500, "the tokenizer failed on this request's text; the server log "
                            "has the details", code="tokenizer_error") from None


async def _until_disconnect(request: Request, engine: Engine, job: Job) -> None:
    """Cancel the job when the client goes away (waiting or generating)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    engine.cancel(job)


def _completion_logprobs(entries: list[dict]) -> dict:
    """Chat logprob entries in the completions endpoint's (legacy) shape."""
    tokens = [e["token"] for e in entries]
    offsets = np.cumsum([0] + [len(t) for t in tokens[:-1]]).tolist() if tokens else []
    tops = []
    for e in entries:   # a dict by text: tokens that share one (pieces of a UTF-8
        top = {}        # character all read U+FFFD) keep the likeliest
        for t in e["top_logprobs"]:
            top.setdefault(t["token"], t["logprob"])
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": tops, "text_offset": offsets}


def _call_reader(params: Params) -> ToolCallStream | None:
    """A reader of the reply's tool calls, if tools were offered."""
    if params.tool_choice == "none" or not params.tools:
        return None
    return ToolCallStream({t["function"]["name"] for t in params.tools},
                          params.parallel_tool_calls)


def _one_call_per_message(messages: list[dict]) -> list[dict]:
    """Assistant messages holding several tool calls as consecutive messages of one call
    each, for a template that shows one call per message (Llama 3.x's refuses more): a
    client sends parallel calls back as they were answered."""
    out = []
    for m in messages:
        calls = m.get("tool_calls") or []
        out += [m] if len(calls) < 2 else [
            {**m, "content": m["content"] if i == 0 else "", "tool_calls": [call]}
            for i, call in enumerate(calls)]
    return out


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


class Server:
    def __init__(self, llm: LLM, model_id: str, queue_size: int, parallel: int | None = None,
                 drafter: Drafter | None = None, files: SlotFiles | None = None):
        self.llm, self.model_id = llm, model_id
        self.engine = Engine(llm, queue_size, parallel, drafter, files)
        self.defaults = llm.default_sampling()
        self.created = int(time.time())
        # the chat template shows tools, and several calls in one message (asked once)
        self._template_tools: tuple[bool, bool] | None = None

    def _check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is None:
            return   # curl users often leave it out: there is only one model
        if not isinstance(model, str):
            raise _bad("model must be a string", "model")
        if model not in (self.model_id, self.llm.path.name):
            raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                                f"{self.model_id!r}", "model", "model_not_found")

    def _fit(self, ids: list[int], params: Params, param: str) -> int:
        """max_tokens for this prompt: as asked, or all the room the context leaves."""
        n, ctx, max_tokens = len(ids), self.llm.ctx, params.max_tokens
        if n == 0:
            raise _bad("the prompt is empty", param)
        if max_tokens is not None and max_tokens >= ctx:
            raise _bad(f"{params.max_tokens_param} must be less than this model's context "
                       f"length ({ctx} tokens), got {_show(max_tokens)}",
                       params.max_tokens_param, "context_length_exceeded")
        if max_tokens is None:
            if n < ctx:
                return ctx - n
            max_tokens = 1
        if n + max_tokens > ctx:
            raise _bad(f"this model's maximum context length is {ctx} tokens; you requested "
                       f"{n + max_tokens} tokens ({n} in the {param}, {max_tokens} in the "
                       f"completion); shorten the {param} or lower max_tokens", param,
                       "context_length_exceeded")
        return max_tokens

    async def chat_completions(self, request: Request):
        body = await _read_json(request)
        self._check_model(body)
        messages = _messages(body)
        shows_tools, several_calls = await self._template_tool_support()
        params = _params(body, self.defaults, chat=True, several_calls=several_calls)
        if not several_calls:
            messages = _one_call_per_message(messages)
        tools = params.tools if params.tool_choice != "none" else None
        if tools is not None and not shows_tools:
            raise _bad("this model's chat template has no tool calling (it does not show the "
                       "model a tool list); send the request without tools", "tools",
                       "tools_not_supported")
        try:
            ids = await _tokenize(lambda m: self.llm.chat.encode_messages(m, tools=tools),
                                  messages)
        except EdgeError as e:   # the template refused these messages
            raise _bad(f"cannot render these messages with the model's chat template: {e}",
                       "messages") from None
        return await self._run(request, ids, params, "messages", chat=True)

    async def _template_tool_support(self) -> tuple[bool, bool]:
        if self._template_tools is None:
            chat = self.llm.chat
            self._template_tools = await run_in_threadpool(
                lambda: (chat.supports_tools(), chat.supports_parallel_tool_calls()))
        return self._template_tools

    async def _constraint(self, params: Params) -> Constraint | None:
        """The request's grammar compiled against the vocabulary (off the event loop:
        llguidance bounds the work, which can still take a fraction of a second)."""
        if params.grammar is None:
            return None
        try:
            return await run_in_threadpool(Constraint, self.llm.tokenizer, params.grammar)
        except EdgeError as e:
            raise _bad(str(e), params.grammar_param, "invalid_grammar") from None

    async def completions(self, request: Request):
        body = await _read_json(request)
        self._check_model(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise _bad("prompt must be a string (one prompt per request)", "prompt")
        params = _params(body, self.defaults, chat=False)
        tok = self.llm.tokenizer

        def encode(text: str) -> list[int]:
            ids = tok.encode(text)
            return [tok.bos_id] + ids if tok.add_bos and tok.bos_id is not None else ids
        ids = await _tokenize(encode, _clean(prompt))
        return await self._run(request, ids, params, "prompt", chat=False)

    async def _run(self, request: Request, ids: list[int], params: Params, param: str, chat: bool):
        max_tokens = self._fit(ids, params, param)
        job = Job(ids, max_tokens, params, await self._constraint(params))
        self.engine.submit(job)
        watcher = asyncio.create_task(_until_disconnect(request, self.engine, job))
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}"
        head = {"id": ident, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": self.model_id}
        if params.stream:
            return StreamingResponse(self._stream(job, watcher, head, chat),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            parts, logprobs = [], []
            while True:
                event = await job.events.get()
                if event[0] == "text":
                    parts.append(event[1])
                    logprobs += event[2]
                elif event[0] == "done":
                    break
                elif event[0] == "error":
                    raise event[1]
                else:
                    raise ApiError(503, "the request was cancelled", code="cancelled")
        finally:
            watcher.cancel()
            self.engine.cancel(job)
        text, (_, finish, usage) = "".join(parts), event
        shown = None if params.top_logprobs is None else \
            {"content": logprobs} if chat else _completion_logprobs(logprobs)
        choice = {"index": 0, "logprobs": shown, "finish_reason": finish}
        calls = self._tool_calls(text, params) if chat else None
        if calls:
            choice.update(message={"role": "assistant", "content": None,
                                   "tool_calls": [c.openai() for c in calls]},
                          finish_reason="tool_calls")
        else:
            choice.update({"message": {"role": "assistant", "content": text}} if chat
                          else {"text": text})
        return JSONResponse({**head, "choices": [choice], "usage": usage})

    def _tool_calls(self, text: str, params: Params):
        """The reply's tool calls, if tools were offered and the reply is only calls."""
        reader = _call_reader(params)
        if reader is None:
            return None
        reader.push(text)
        return reader.finish()

    async def _stream(self, job: Job, watcher: asyncio.Task, head: dict, chat: bool):
        head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
        extra = {"usage": None} if job.params.include_usage else {}

        params = job.params
        role_sent = False

        def chunk(text: str | None, finish: str | None = None, logprobs: list | None = None,
                  delta: dict | None = None) -> str:
            nonlocal role_sent
            if chat:
                delta = delta or ({} if text is None else {"content": text})
                if not role_sent:   # OpenAI's first delta: the role (content null for calls)
                    role_sent = True
                    delta = {"role": "assistant", "content": None, **delta}
                choice = {"index": 0, "delta": delta}
            else:
                choice = {"index": 0, "text": text or ""}
            shown = None if params.top_logprobs is None else \
                {"content": logprobs or []} if chat else _completion_logprobs(logprobs or [])
            choice.update({"logprobs": shown, "finish_reason": finish})
            return _sse({**head, "choices": [choice], **extra})
        # With tools offered, the reply is read as calls while it can be one: held back
        # until a call's name is read (then streamed as tool_calls deltas, the first with
        # the role) or until it cannot be a call (then sent as content, and the rest
        # streams as it comes).
        reader = _call_reader(params) if chat else None
        held, held_logprobs = "", []
        try:
            if chat and reader is None:
                yield chunk("")   # OpenAI's first chunk: the role
            while True:
                event = await job.events.get()
                if event[0] == "text":
                    if reader is not None:
                        for delta in reader.push(event[1]):
                            yield chunk(None, delta={"tool_calls": [delta]})
                        if not reader.announced:
                            held += event[1]
                            held_logprobs += event[2]
                        if reader.is_text:
                            reader = None
                            yield chunk(held, logprobs=held_logprobs)
                        continue
                    yield chunk(event[1], logprobs=event[2])
                elif event[0] == "done":
                    finish = event[1]
                    if reader is not None and reader.finish():
                        finish = "tool_calls"
                    elif reader is not None and reader.is_text and (held or held_logprobs):
                        yield chunk(held, logprobs=held_logprobs)
                    yield chunk(None, finish)
                    if job.params.include_usage:
                        yield _sse({**head, "choices": [], "usage": event[2]})
                    break
                elif event[0] == "error":
                    yield _sse(event[1].body())
                    break
                else:
                    return   # cancelled: nobody is listening
            yield "data: [DONE]\n\n"
        finally:
            watcher.cancel()
            self.engine.cancel(job)

    async def models(self, request: Request):
        return JSONResponse({"object": "list", "data": [self._model()]})

    async def model(self, request: Request):
        if request.path_params["name"] not in (self.model_id, self.llm.path.name):
            raise ApiError(404, f"the model {request.path_params['name']!r} does not exist; "
                                f"this server serves {self.model_id!r}", "model",
                           "model_not_found")
        return JSONResponse(self._model())

    def _model(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": self.created,
                "owned_by": "edgellama"}

    async def slots(self, request: Request):
        """llama.cpp's GET /slots: each slot, whether it is busy and the tokens it holds."""
        return JSONResponse(self.engine.slot_list())

    async def slot_action(self, request: Request):
        """llama.cpp's POST /slots/{id}?action=save|restore|erase, body {"filename": ...}
        for save and restore: a slot's cache to or from a file of --slot-save-path."""
        engine = self.engine
        if engine.files is None:
            raise ApiError(501, "saving and restoring slots is off: start the server with "
                                "--slot-save-path DIR", code="not_supported",
                           kind="not_supported_error")
        given = request.path_params["id"]
        if not (given.isascii() and given.isdigit() and len(given) <= 9
                and int(given) < engine.parallel):
            raise _bad(f"no slot {_show(given)}: slots are 0 to {engine.parallel - 1}", "id_slot")
        index, action = int(given), request.query_params.get("action")
        if action == "erase":
            call = lambda: engine.erase_slot(index)  # noqa: E731
        elif action in ("save", "restore"):
            filename = (await _read_json(request)).get("filename")
            method = engine.save_slot if action == "save" else engine.restore_slot
            call = lambda: method(index, filename)  # noqa: E731
        else:
            raise _bad(f"action must be save, restore or erase, got {_show(action)}", "action")
        return JSONResponse(await asyncio.wrap_future(engine.run(call)))

    async def health(self, request: Request):
        # kv_cache_tokens: what the slots' caches hold for the next requests to reuse (and
        # how far the running ones got); slots: each one's, and their memory
        slots = self.engine.slot_status()
        return JSONResponse({"status": "ok", "model": self.model_id, "ctx": self.llm.ctx,
                             "kv_cache_tokens": sum(slots["cached_tokens"]),
                             "queue": self.engine.status(), "slots": slots})


LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


def host_name(value: str) -> str | None:
    """The name in a Host header value ("name", "name:port", "[v6]:port"), lowercased,
    without brackets, port or a final dot; None if it is not a valid Host value."""
    v = value.strip().lower()
    if v.startswith("["):
        name, sep, rest = v[1:].partition("]")
        if not sep:
            return None
        try:
            ipaddress.IPv6Address(name)
        except ValueError:
            return None
    else:
        name, colon, port = v.partition(":")
        rest = colon + port
    if rest and not (rest[0] == ":" and rest[1:].isdigit() and len(rest) <= 6):
        return None
    name = name[:-1] if name.endswith(".") else name
    if not name or any(c in name for c in " /\\@?#%\t"):
        return None
    return name


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def normalize_origin(value: str) -> str:
    """An origin as browsers send it, "scheme://host[:port]" lowercased; "*" and "null"
    as they are. ValueError if `value` is not one (a path, a missing scheme, ...)."""
    v = value.strip().lower().rstrip("/")
    if v in ("*", "null"):
        return v
    scheme, sep, netloc = v.partition("://")
    if not sep or scheme not in ("http", "https") or host_name(netloc) is None:
        raise ValueError(f"{value!r} is not an origin: give scheme://host[:port], e.g. "
                         f"http://localhost:3000 (or * for any)")
    return f"{scheme}://{netloc.removesuffix({'http': ':80', 'https': ':443'}[scheme])}"


class _Guard:
    """ASGI middleware against DNS rebinding and cross-site requests (the class of Ollama's
    CVE-2024-28224), outside everything else:

    - Host: a page on evil.example whose name is re-pointed at 127.0.0.1 reaches this
      server with `Host: evil.example`, so only the names in `hosts` are answered (any IP
      literal too when `any_ip`: an address cannot be rebound). The port is not compared:
      an attacker controls the name, not the port, and ssh tunnels change the port.
    - Origin: browsers send it on cross-origin requests (and on every POST). Same-origin
      requests (Origin names the Host) and the origins in `cors` pass; any other is
      refused with 403, so no page elsewhere can start a generation, form-style or not.
      Allowed cross-origin requests get CORS headers, and preflights (OPTIONS) an answer.
    Clients that are not browsers (the openai package, curl) send no Origin."""

    def __init__(self, app, hosts: Iterable[str], any_ip: bool = False,
                 cors: Iterable[str] = ()):
        self.app, self.any_ip = app, any_ip
        self.hosts = {h.strip().lower().strip("[]").rstrip(".") for h in hosts}
        self.cors = {normalize_origin(o) for o in cors}

    def _host_ok(self, value: str) -> bool:
        if "*" in self.hosts:
            return True
        name = host_name(value)
        return name is not None and (name in self.hosts or (self.any_ip and _is_ip(name)))

    def _allowed_hosts(self) -> str:
        names = sorted(f"[{h}]" if ":" in h else h for h in self.hosts)
        return ", ".join(names) + (" and any IP address" if self.any_ip else "")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        for host in headers.getlist("host"):
            if not self._host_ok(host):
                await ApiError(403, f"this server does not answer to the Host {_show(host)} "
                                    f"(only to {self._allowed_hosts()}): a web page may be "
                                    f"trying to reach it through DNS rebinding. If you use "
                                    f"that name yourself, start the server with "
                                    f"--allowed-host NAME", "Host", "host_not_allowed"
                               ).response()(scope, receive, send)
                return
        origin = headers.get("origin")
        allow = None
        if origin is not None:
            try:
                given = normalize_origin(origin)
            except ValueError:
                given = origin
            host = headers.get("host", "").strip().lower()
            same = bool(host) and given.partition("://")[2] == host
            if "*" in self.cors:
                allow = "*"
            elif given in self.cors:
                allow = origin
            elif not same:
                await ApiError(403, f"cross-origin requests from {_show(origin)} are refused; "
                                    f"to let pages there use this server, start it with "
                                    f"--cors {_show(origin)}", "Origin", "origin_not_allowed"
                               ).response()(scope, receive, send)
                return
        if scope["method"] == "OPTIONS" and origin is not None \
                and "access-control-request-method" in headers:
            vary = {"Vary": "Origin"}
            if allow:
                vary.update({
                    "Access-Control-Allow-Origin": allow,
                    "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                    "Access-Control-Allow-Headers":
                        headers.get("access-control-request-headers", "")[:2000],
                    "Access-Control-Max-Age": "600"})
            await Response(status_code=204, headers=vary)(scope, receive, send)
            return
        if allow is None:
            await self.app(scope, receive, send)
            return

        async def send_with_cors(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [
                    *message.get("headers", []),
                    (b"access-control-allow-origin", allow.encode("latin-1", "replace")),
                    (b"vary", b"Origin")]}
            await send(message)
        await self.app(scope, receive, send_with_cors)


class _RequireKey:
    """ASGI middleware: /v1/... and /slots need `Authorization: Bearer KEY` (/health does
    not)."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith(("/v1", "/slots")):
            given = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not secrets.compare_digest(token.strip(), self.key):
                error = ApiError(401, "a valid API key is needed: send the header "
                                      "'Authorization: Bearer KEY'", code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(llm: LLM, *, model_id: str | None = None, api_key: str | None = None,
               queue_size: int = DEFAULT_QUEUE, allowed_hosts: Iterable[str] = LOOPBACK_HOSTS,
               any_ip_host: bool = False, cors: Iterable[str] = (),
               parallel: int | None = None, drafter: Drafter | None = None,
               slot_save_path: str | None = None, slot_spill_max: int = 0) -> Starlette:
    """The ASGI app serving `llm`; its id is the file name without .gguf unless given.
    The engine thread starts now and stops when the app's lifespan ends. `parallel`
    requests run at once (None: choose_parallel's default from memory). `drafter`
    (llm.load_draft(path) or speculative.PromptLookup()): speculative decoding, where
    it pays (Engine). `slot_save_path`: a folder for POST /slots/{id} (save, restore,
    erase a slot's cache) and, if `slot_spill_max` (bytes) > 0, evicted conversations'
    caches (SlotFiles).

    Only requests whose Host names one of `allowed_hosts` ("*": any; `any_ip_host`: any
    IP address too) are answered, and requests from web pages only from the same origin
    or one of the `cors` origins ("*": any); see _Guard. normalize_origin checks `cors`."""
    files = None if slot_save_path is None else SlotFiles(slot_save_path, slot_spill_max)
    server = Server(llm, model_id or llm.path.stem, queue_size, parallel, drafter, files)
    guard = Middleware(_Guard, hosts=list(allowed_hosts), any_ip=any_ip_host, cors=list(cors))

    async def api_error(request: Request, exc: ApiError):
        return exc.response()

    async def http_error(request: Request, exc: HTTPException):
        return ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                        code="not_found" if exc.status_code == 404 else None).response()

    async def client_gone(request: Request, exc: ClientDisconnect):
        return Response(status_code=400)   # left while sending its body: nobody reads this

    async def internal_error(request: Request, exc: Exception):
        return ApiError(500, "internal server error; the server log has the details").response()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await run_in_threadpool(server.engine.close)

    app = Starlette(routes=[
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/models/{name:path}", server.model, methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/slots", server.slots, methods=["GET"]),
        Route("/slots/{id}", server.slot_action, methods=["POST"]),
    ], exception_handlers={ApiError: api_error, HTTPException: http_error,
                           ClientDisconnect: client_gone, Exception: internal_error},
        lifespan=lifespan,
        middleware=[guard] + ([Middleware(_RequireKey, key=api_key)] if api_key else []))
    app.state.server = server
    return app
