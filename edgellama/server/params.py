"""What a client sends, checked, before anything is queued: the request body (JSON, at
most MAX_BODY bytes and MAX_BODY_DEPTH levels), each field's JSON type and range (a
wrong one is a 400 naming it: ApiError), and the result, Params, which is what the
engine is asked. Nothing here runs the model or answers HTTP (app.py does, with these).

Structured output: response_format / json_schema / grammar and a forced tool_choice become
a grammar (edgellama/constrain.py) here; app.py compiles it on arrival, so a bad one is a
400 before queueing.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from typing import Any

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse

from ..chat_template import template_kwargs
from ..constrain import (MAX_DEPTH, gbnf_grammar, json_object_grammar, json_schema_grammar,
                         nests_deeper)
from ..errors import EdgeError
from ..sampling import SamplingParams
from ..tool_calls import tool_call_schema

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
MAX_TOKENIZE_CHARS = 1 << 21   # /tokenize's content: four times a 128k-token context's text
MAX_DETOKENIZE = 1 << 20       # /detokenize's tokens: eight 128k-token contexts
ANTHROPIC_PATH = "/v1/messages"   # Anthropic's API (anthropic.py): its errors in its shape
# Anthropic's error types by status (its API's list; 503 is its 529's "overloaded")
ANTHROPIC_ERRORS = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                    429: "rate_limit_error", 503: "overloaded_error"}
# Parameters whose non-default values would change the answer in ways we do not
# implement: refused rather than silently ignored. Everything else unknown is ignored.
REASONING_FORMATS = ("none", "deepseek")   # llama-server's reasoning formats, the ones we do

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

    def anthropic_body(self) -> dict:
        """Anthropic's shape (/v1/messages): {"type": "error", "error": {type, message}},
        the type named by the status as Anthropic names it."""
        kind = ANTHROPIC_ERRORS.get(self.status, "api_error" if self.status >= 500
                                    else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def anthropic_response(self) -> JSONResponse:
        return JSONResponse(self.anthropic_body(), status_code=self.status)

    def response_for(self, path: str) -> JSONResponse:
        """The answer to a request for `path`: in Anthropic's shape under its API."""
        return self.anthropic_response() if path.startswith(ANTHROPIC_PATH) else self.response()


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


def _chat_template_kwargs(body: dict) -> dict | None:
    """A request's chat_template_kwargs (llama-server's field: extra template variables,
    e.g. {"enable_thinking": false}), checked as --chat-template-kwargs is."""
    v = body.get("chat_template_kwargs")
    if v is None:
        return None
    if not isinstance(v, dict):
        raise _bad(f"chat_template_kwargs must be an object of template variables, as "
                   f'{{"enable_thinking": false}}, got {_show(v)}', "chat_template_kwargs")
    try:
        return template_kwargs(v, "chat_template_kwargs")
    except EdgeError as e:
        raise _bad(str(e), "chat_template_kwargs") from None


def _tokenize_body(body: dict) -> tuple[str, bool, bool, bool]:
    """POST /tokenize's fields (llama-server's): (content, add_special, parse_special,
    with_pieces); parse_special defaults to true as there, the others to false."""
    content = body.get("content", "")
    if not isinstance(content, str):
        raise _bad(f"content must be a string, got {_show(content)}", "content")
    if len(content) > MAX_TOKENIZE_CHARS:
        raise _bad(f"content has {len(content)} characters, more than the "
                   f"{MAX_TOKENIZE_CHARS} allowed", "content")
    parse_special = body.get("parse_special") is None or _flag(body, "parse_special")
    return (_clean(content), _flag(body, "add_special"), parse_special,
            _flag(body, "with_pieces"))


def _detokenize_body(body: dict, vocab_size: int) -> list[int]:
    """POST /detokenize's tokens: ids of this vocabulary, at most MAX_DETOKENIZE."""
    tokens = body.get("tokens", [])
    if not isinstance(tokens, list):
        raise _bad(f"tokens must be a list of token ids, got {_show(tokens)}", "tokens")
    if len(tokens) > MAX_DETOKENIZE:
        raise _bad(f"tokens has {len(tokens)} ids, more than the {MAX_DETOKENIZE} allowed",
                   "tokens")
    for i, t in enumerate(tokens):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise _bad(f"tokens[{i}] must be a token id from 0 to {vocab_size - 1}, got "
                       f"{_show(t)}", "tokens")
    return tokens


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
    template_kwargs: dict | None = None    # chat_template_kwargs: over the server's own
    reasoning_format: str | None = None    # over the server's --reasoning-format


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
                  draft_max, _chat_template_kwargs(body) if chat else None,
                  _reasoning_format(body) if chat else None)


def _reasoning_format(body: dict) -> str | None:
    """A chat request's reasoning_format (llama-server's field), one we do."""
    v = body.get("reasoning_format")
    if v is not None and v not in REASONING_FORMATS:
        raise _bad(f"reasoning_format must be {' or '.join(REASONING_FORMATS)}, got {_show(v)}",
                   "reasoning_format")
    return v


# -- the request body ---------------------------------------------------------------------------

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
