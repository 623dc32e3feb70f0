"""Anthropic's Messages API (POST /v1/messages, POST /v1/messages/count_tokens), as
llama-server serves it, on the request path of the OpenAI endpoints: a request is
translated into the messages the chat template reads and the fields params.py checks
(the same Params, grammar for a forced tool, engine and Job), and the job's events into
Anthropic's reply or its server-sent events.

    routes = anthropic_routes(server)   # app.py's Server; errors in Anthropic's shape

Request: model, max_tokens (required), messages (content a string or text, tool_use,
tool_result and thinking blocks; image and document blocks are refused: the models read
text), system, stop_sequences, temperature (0 to 1), top_p, top_k, stream, tools (name,
description, input_schema), tool_choice (auto, any, tool, none;
disable_parallel_tool_use), output_config.format (a JSON schema the reply follows, as
response_format), thinking (disabled: the template variable enable_thinking false, as
llama-server's chat_template_kwargs, which is taken too; budget_tokens is checked, not
applied), metadata (ignored). A
tool_use block becomes an assistant message's tool call, each tool_result a "tool"
message, so any template that shows OpenAI tool calls shows them. Thinking blocks sent
back are dropped, as chat templates drop past reasoning.

Reply: the model's <think> block (reasoning.py; not with --reasoning-format none) is a
"thinking" block (its signature empty: nothing here is signed), then the content as one
text block, or its tool calls (read by tool_calls.py, as for OpenAI) as tool_use
blocks. stop_reason: tool_use, stop_sequence (stop_sequence names it), max_tokens or
end_turn.
"""
from __future__ import annotations

import json
import secrets
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from ..constrain import MAX_DEPTH, nests_deeper
from ..reasoning import ReasoningSplitter
from ..tool_calls import ToolCallStream
from .params import (MAX_STOP_CHARS, MAX_STOPS, MAX_TOOLS, TOOL_NAME, ApiError, Params, _bad,
                     _clean, _flag, _integer, _number, _params, _read_json, _show)

if TYPE_CHECKING:
    import asyncio

    from .app import Server
    from .job import Job

ROLES = ("user", "assistant")
# blocks a model that reads text cannot take: refused with a reason, not as unknown
MEDIA_BLOCKS = ("image", "document", "search_result", "container_upload")
STOP_REASONS = {"length": "max_tokens", "stop": "end_turn"}


def anthropic_routes(server: Server) -> list[Route]:
    api = Messages(server)
    return [Route("/v1/messages", api.create, methods=["POST"]),
            Route("/v1/messages/count_tokens", api.count_tokens, methods=["POST"])]


# -- the request --------------------------------------------------------------------------------

def _text_blocks(content: Any, param: str) -> str:
    """A string, or a list of text blocks (system, tool_result content): their text, a
    line apart (clients send separate paragraphs, reminders and the prompt as blocks)."""
    if isinstance(content, str):
        return _clean(content)
    if not isinstance(content, list):
        raise _bad(f"{param} must be a string or a list of text blocks, got {_show(content)}",
                   param)
    parts = []
    for k, block in enumerate(content):
        _block_type(block, f"{param}[{k}]", ("text",))
        parts.append(_text(block, f"{param}[{k}]"))
    return "\n".join(parts)


def _block_type(block: Any, param: str, allowed: tuple[str, ...]) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if kind in MEDIA_BLOCKS:
        raise _bad(f"{param}: {kind} blocks are not supported: this server's models read "
                   f"text only; send the {kind}'s text as a text block", param)
    if not isinstance(kind, str) or kind not in allowed:
        raise _bad(f"{param} must be a block of type {', '.join(allowed)}; got "
                   f"{_show(kind if isinstance(block, dict) else block)}", param)
    return kind


def _text(block: dict, param: str) -> str:
    if not isinstance(block.get("text"), str):
        raise _bad(f"{param}.text must be a string, got {_show(block.get('text'))}",
                   f"{param}.text")
    return _clean(block["text"])


def _tool_use(block: dict, param: str) -> dict:
    """A tool_use block as the call of an assistant message (arguments an object, as
    params.py gives templates them)."""
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
        raise _bad(f"{param} needs a string id and name", param)
    if not isinstance(block.get("input"), dict):
        raise _bad(f"{param}.input must be an object, got {_show(block.get('input'))}",
                   f"{param}.input")
    if nests_deeper(block["input"], MAX_DEPTH):
        raise _bad(f"{param}.input nests more than {MAX_DEPTH} levels deep", f"{param}.input")
    return {"id": _clean(block["id"]), "type": "function",
            "function": {"name": _clean(block["name"]), "arguments": block["input"]}}


def _tool_result(block: dict, param: str) -> dict:
    if not isinstance(block.get("tool_use_id"), str):
        raise _bad(f"{param}.tool_use_id must be a string", f"{param}.tool_use_id")
    _flag(block, "is_error", f"{param}.is_error")
    content = block.get("content")
    return {"role": "tool", "tool_call_id": _clean(block["tool_use_id"]),
            "content": "" if content is None else _text_blocks(content, f"{param}.content")}


# a thinking block sent back, and the field holding its text
THOUGHT_FIELDS = {"thinking": "thinking", "redacted_thinking": "data"}


def _message(m: Any, i: int) -> list[dict]:
    """One Anthropic message as the chat template's messages: a user turn's tool_result
    blocks are "tool" messages (in their order among its text), an assistant turn's
    tool_use blocks its tool_calls."""
    param = f"messages[{i}]"
    if not isinstance(m, dict):
        raise _bad(f"{param} must be an object with role and content", param)
    role = m.get("role")
    if role not in ROLES:
        raise _bad(f"{param}.role must be \"user\" or \"assistant\", got {_show(role)}",
                   f"{param}.role")
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": _clean(content)}]
    if not isinstance(content, list):
        raise _bad(f"{param}.content must be a string or a list of content blocks, got "
                   f"{_show(content)}", f"{param}.content")
    allowed = ("text", "tool_result") if role == "user" else \
        ("text", "tool_use", "thinking", "redacted_thinking")
    out: list[dict] = []
    text: list[str] = []
    calls: list[dict] = []
    for k, block in enumerate(content):
        where = f"{param}.content[{k}]"
        kind = _block_type(block, where, allowed)
        if kind == "text":
            text.append(_text(block, where))
        elif kind == "tool_use":
            calls.append(_tool_use(block, where))
        elif kind in THOUGHT_FIELDS:   # dropped, as templates drop past reasoning, but checked
            field = THOUGHT_FIELDS[kind]
            if not isinstance(block.get(field), str):
                raise _bad(f"{where}.{field} must be a string, got {_show(block.get(field))}",
                           f"{where}.{field}")
        elif kind == "tool_result":
            if text:
                out.append({"role": "user", "content": "\n".join(text)})
                text = []
            out.append(_tool_result(block, where))
    if role == "assistant":
        if len(calls) > MAX_TOOLS:
            raise _bad(f"{param} has more than {MAX_TOOLS} tool_use blocks", param)
        return [{"role": "assistant", "content": "\n".join(text),
                 **({"tool_calls": calls} if calls else {})}]
    if text or not out:
        out.append({"role": "user", "content": "\n".join(text)})
    return out


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list of {role, content} objects", "messages")
    system = body.get("system")
    out = [] if system is None else [{"role": "system",
                                      "content": _text_blocks(system, "system")}]
    for i, m in enumerate(messages):
        out += _message(m, i)
    return out


def _tools(body: dict) -> list[dict] | None:
    """Anthropic's tools as OpenAI's function list (which params.py checks further)."""
    tools = body.get("tools")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise _bad(f"tools must be a list of at most {MAX_TOOLS} tools", "tools")
    out, names = [], set()
    for k, t in enumerate(tools):
        param = f"tools[{k}]"
        if not isinstance(t, dict):
            raise _bad(f"{param} must be an object with name and input_schema", param)
        if t.get("type") not in (None, "custom"):
            raise _bad(f"{param}: {_show(t.get('type'))} is one of Anthropic's own tools, "
                       f"which this server does not run; give a custom tool (name, "
                       f"description, input_schema)", param)
        name = t.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise _bad(f"{param}.name must be 1 to 64 letters, digits, _ or -, got "
                       f"{_show(name)}", f"{param}.name")
        if name in names:
            raise _bad(f"two tools are named {name!r}", f"{param}.name")
        names.add(name)
        if t.get("description") is not None and not isinstance(t["description"], str):
            raise _bad(f"{param}.description must be a string", f"{param}.description")
        schema = t.get("input_schema")
        if not isinstance(schema, dict):
            raise _bad(f"{param}.input_schema must be a JSON schema object, got "
                       f"{_show(schema)}", f"{param}.input_schema")
        if nests_deeper(schema, MAX_DEPTH):
            raise _bad(f"{param}.input_schema nests more than {MAX_DEPTH} levels deep",
                       f"{param}.input_schema")
        out.append({"type": "function", "function": {
            "name": name, "description": t.get("description") or "", "parameters": schema}})
    return out


def _tool_choice(body: dict, tools: list[dict] | None) -> tuple[Any, bool]:
    """OpenAI's tool_choice for Anthropic's, and whether several calls may be made."""
    v = body.get("tool_choice")
    if v is None:
        return None, True
    kind = v.get("type") if isinstance(v, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise _bad('tool_choice must be {"type": "auto" | "any" | "tool" | "none"}, got '
                   f"{_show(v)}", "tool_choice")
    parallel = not _flag(v, "disable_parallel_tool_use", "tool_choice.disable_parallel_tool_use")
    if kind in ("any", "tool") and not tools:
        raise _bad(f"tool_choice {kind!r} needs tools", "tool_choice")
    if kind != "tool":
        return {"any": "required"}.get(kind, kind), parallel
    name = v.get("name")
    if not isinstance(name, str) or name not in {t["function"]["name"] for t in tools}:
        raise _bad(f"tool_choice names {_show(name)}, which is not in tools", "tool_choice.name")
    return {"type": "function", "function": {"name": name}}, parallel


def _stop_sequences(body: dict) -> list[str] | None:
    v = body.get("stop_sequences")
    if v is None or v == []:
        return None
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise _bad(f"stop_sequences must be a list of strings, got {_show(v)}", "stop_sequences")
    if len(v) > MAX_STOPS or any(not s or len(s) > MAX_STOP_CHARS for s in v):
        raise _bad(f"stop_sequences takes at most {MAX_STOPS} strings of 1 to {MAX_STOP_CHARS} "
                   f"characters", "stop_sequences")
    return v


def _template_kwargs(body: dict) -> Any:
    """chat_template_kwargs (llama-server's field) with `thinking` as enable_thinking, the
    variable Qwen 3's template reads (others ignore it)."""
    thinking = body.get("thinking")
    if thinking is None:
        return body.get("chat_template_kwargs")
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in ("enabled", "disabled", "adaptive"):
        raise _bad('thinking must be {"type": "enabled" | "disabled" | "adaptive"}, got '
                   f"{_show(thinking)}", "thinking")
    # a reply's thinking is not cut at a budget; the field is checked as Anthropic's is
    _integer(thinking, "budget_tokens", 1, "thinking.budget_tokens")
    given = body.get("chat_template_kwargs")
    if given is not None and not isinstance(given, dict):
        return given   # params.py names what is wrong with it
    return {"enable_thinking": kind != "disabled", **(given or {})}


def _output_schema(body: dict) -> dict | None:
    """output_config.format's JSON schema (Anthropic's structured output), if given; its
    other settings (effort) are not acted on."""
    config = body.get("output_config")
    if config is not None and not isinstance(config, dict):
        raise _bad(f"output_config must be an object, got {_show(config)}", "output_config")
    fmt = (config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" \
            or not isinstance(fmt.get("schema"), dict):
        raise _bad('output_config.format must be {"type": "json_schema", "schema": {...}}, '
                   f"got {_show(fmt)}", "output_config.format")
    return fmt["schema"]


def _fields(body: dict, generate: bool) -> dict:
    """The request's fields under the names params.py checks (OpenAI's); Anthropic's own
    types and ranges are checked here first, so its errors name what the client sent.
    `generate`: /v1/messages (max_tokens required), not count_tokens."""
    if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
        raise _bad(f"metadata must be an object, got {_show(body['metadata'])}", "metadata")
    tools = _tools(body)
    choice, parallel = _tool_choice(body, tools)
    fields = {"tools": tools, "tool_choice": choice, "parallel_tool_calls": parallel,
              "chat_template_kwargs": _template_kwargs(body), "json_schema": _output_schema(body)}
    if generate:
        if body.get("max_tokens") is None:
            raise _bad("max_tokens is required: the most tokens to generate", "max_tokens")
        _integer(body, "max_tokens", 1)
        _number(body, "temperature", 0, 1)   # Anthropic's range
        fields.update({k: body.get(k) for k in ("max_tokens", "temperature", "top_p", "top_k",
                                                "stream")},
                      stop=_stop_sequences(body))
    return {k: v for k, v in fields.items() if v is not None}


# -- the reply ----------------------------------------------------------------------------------

def _sse(kind: str, data: dict) -> str:
    """One server-sent event; Anthropic names it in an event: line and in its type."""
    text = json.dumps({"type": kind, **data}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {kind}\ndata: {text}\n\n"


def _stop_reason(job: Job, finish: str, calls: bool) -> tuple[str, str | None]:
    """stop_reason and stop_sequence of a finished job."""
    if calls:
        return "tool_use", None
    if finish == "stop" and job.matcher.hit is not None:
        return "stop_sequence", job.matcher.hit
    return STOP_REASONS[finish], None


def _content(text: str, reasoning: ReasoningSplitter | None,
             reader: ToolCallStream | None) -> tuple[list[dict], bool]:
    """A whole reply's content blocks (`reasoning`: the reader of its think block, None
    if there is none to read; `reader`: tools were offered), and whether they are tool
    calls."""
    thought = ""
    if reasoning is not None:
        (r1, c1), (r2, c2) = reasoning.push(text), reasoning.finish()
        thought, text = r1 + r2, c1 + c2
    content = [{"type": "thinking", "thinking": thought, "signature": ""}] if thought else []
    calls = None
    if reader is not None:
        reader.push(text)
        calls = reader.finish()
    if calls:
        content += [{"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments}
                    for c in calls]
    elif text:
        content.append({"type": "text", "text": text})
    return content, bool(calls)


class _Blocks:
    """Content blocks as stream events: a block opens when text of another kind (or a new
    tool call) arrives, and closes before the next one opens or at the end."""

    def __init__(self):
        self.index = -1
        self.open: str | None = None

    def _start(self, kind: str, block: dict) -> list[str]:
        out = self.close()
        self.index += 1
        self.open = kind
        return out + [_sse("content_block_start", {"index": self.index,
                                                   "content_block": block})]

    def _delta(self, delta: dict) -> str:
        return _sse("content_block_delta", {"index": self.index, "delta": delta})

    def thinking(self, text: str) -> list[str]:
        if not text:
            return []
        out = [] if self.open == "thinking" else \
            self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
        return out + [self._delta({"type": "thinking_delta", "thinking": text})]

    def text(self, text: str) -> list[str]:
        if not text:
            return []
        out = [] if self.open == "text" else self._start("text", {"type": "text", "text": ""})
        return out + [self._delta({"type": "text_delta", "text": text})]

    def call(self, delta: dict) -> list[str]:
        """One of ToolCallStream's (OpenAI's) deltas: a call's start or its arguments."""
        out = []
        if "id" in delta:
            out += self._start("tool_use", {"type": "tool_use", "id": delta["id"],
                                            "name": delta["function"]["name"], "input": {}})
        if delta["function"]["arguments"]:
            out.append(self._delta({"type": "input_json_delta",
                                    "partial_json": delta["function"]["arguments"]}))
        return out

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [_sse("content_block_stop", {"index": self.index})]


class Messages:
    """The endpoints' handlers. Their errors are raised as ApiError, which the app's
    handlers and guard.py answer in Anthropic's shape on these paths (response_for)."""

    def __init__(self, server: Server):
        self.server = server

    async def _request(self, request: Request, generate: bool) -> tuple[list[int], Params]:
        server = self.server
        body = await _read_json(request)
        server._check_model(body)
        messages = _messages(body)
        _, several_calls = await server._template_tool_support()
        params = _params(_fields(body, generate), server.defaults, chat=True,
                         several_calls=several_calls)
        return await server._chat_prompt(messages, params), params

    async def count_tokens(self, request: Request):
        ids, _ = await self._request(request, generate=False)
        return JSONResponse({"input_tokens": len(ids)})

    async def create(self, request: Request):
        server = self.server
        ids, params = await self._request(request, generate=True)
        reasoning = server._reasoning(ids, params)
        reader = None if params.tool_choice == "none" or not params.tools else \
            ToolCallStream({t["function"]["name"] for t in params.tools},
                           params.parallel_tool_calls)
        message = {"id": f"msg_{secrets.token_hex(12)}", "type": "message",
                   "role": "assistant", "model": server.model_id}
        job, watcher = await server._submit(request, ids, params, "messages")
        if params.stream:
            return StreamingResponse(self._stream(job, watcher, message, reasoning, reader),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            parts = []
            while True:
                event = await job.events.get()
                if event[0] == "text":
                    parts.append(event[1])
                elif event[0] == "done":
                    break
                elif event[0] == "error":
                    return event[1].anthropic_response()
                else:
                    return ApiError(503, "the request was cancelled",
                                    code="cancelled").anthropic_response()
        finally:
            watcher.cancel()
            server.engine.cancel(job)
        content, calls = _content("".join(parts), reasoning, reader)
        stop_reason, stop_sequence = _stop_reason(job, event[1], calls)
        return JSONResponse({**message, "content": content, "stop_reason": stop_reason,
                             "stop_sequence": stop_sequence,
                             "usage": {"input_tokens": event[2]["prompt_tokens"],
                                       "output_tokens": event[2]["completion_tokens"]}})

    async def _stream(self, job: Job, watcher: asyncio.Task, message: dict,
                      reasoning: ReasoningSplitter | None, reader: ToolCallStream | None):
        """Anthropic's events: message_start, ping, each block's start, deltas and stop,
        message_delta (stop_reason, usage), message_stop. With tools offered, the content
        is held back while it can still be calls, as the OpenAI stream does (app.py)."""
        blocks, held = _Blocks(), ""

        def content(text: str) -> list[str]:
            nonlocal reader, held
            if reader is None:
                return blocks.text(text)
            out = []
            for delta in reader.push(text):
                out += blocks.call(delta)
            if not reader.announced:
                held += text
            if reader.is_text:
                reader, text, held = None, held, ""
                out += blocks.text(text)
            return out
        try:
            yield _sse("message_start", {"message": {
                **message, "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": len(job.ids), "output_tokens": 0}}})
            yield _sse("ping", {})
            while True:
                event = await job.events.get()
                if event[0] == "text":
                    thought, text = reasoning.push(event[1]) if reasoning else ("", event[1])
                    for line in blocks.thinking(thought) + content(text):
                        yield line
                elif event[0] == "done":
                    thought, text = reasoning.finish() if reasoning else ("", "")
                    out = blocks.thinking(thought) + content(text)
                    calls = bool(reader is not None and reader.finish())
                    if reader is not None and not calls and reader.is_text:
                        out += blocks.text(held)
                    for line in out + blocks.close():
                        yield line
                    stop_reason, stop_sequence = _stop_reason(job, event[1], calls)
                    yield _sse("message_delta", {
                        "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                        "usage": {"output_tokens": event[2]["completion_tokens"]}})
                    yield _sse("message_stop", {})
                    break
                elif event[0] == "error":
                    yield _sse("error", {"error": event[1].anthropic_body()["error"]})
                    break
                else:
                    return   # cancelled: nobody is listening
        finally:
            watcher.cancel()
            self.server.engine.cancel(job)
