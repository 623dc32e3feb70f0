"""The HTTP side: create_app builds the Starlette app (routes, error handlers, the
guard's middleware, the engine's lifespan); Server holds the endpoints' handlers
(/v1/chat/completions, /v1/completions, /v1/models, /health, /slots), which check a
request (params.py), tokenize it, hand a Job to the Engine (engine.py) and turn its
events into a JSON reply or a stream of server-sent events. The checks of each field
live in params.py, generation in engine.py, Host/Origin/API-key checks in guard.py.

Tool calls are read from the reply as it is generated (edgellama/tool_calls.py) and
streamed as OpenAI streams them: a reply that starts like a call is held back until its
function's name is read, then the call is announced and its arguments follow as they are
generated.
"""
from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import logging
import secrets
import time
from collections.abc import Iterable
from typing import Any

import numpy as np
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..constrain import Constraint
from ..errors import EdgeError
from ..llm import LLM
from ..reasoning import ReasoningSplitter, opens_reasoning
from ..slot_files import SlotFiles
from ..speculative import Drafter
from ..tool_calls import ToolCallStream
from .anthropic import anthropic_routes
from .engine import DEFAULT_QUEUE, Engine
from .guard import LOOPBACK_HOSTS, _Guard, _RequireKey
from .job import Job
from .metrics import METRICS_TYPE, Metrics
from .params import (REASONING_FORMATS, ApiError, Params, _bad, _clean, _detokenize_body,
                     _messages, _params, _read_json, _show, _tokenize_body)

log = logging.getLogger("edgellama.server")

try:   # /props' build_info: llama-server gives its build number and commit
    _BUILD = f"edgellama-{importlib.metadata.version('edgellama')}"
except importlib.metadata.PackageNotFoundError:   # run from a source tree, not installed
    _BUILD = "edgellama"
_PROMPT_TAIL = 8    # prompt tokens enough to see whether it ends in an open <think>


async def _tokenize(encode, text: Any, param: str, refusal: str = "") -> list[int]:
    """encode(text) off the event loop. An EdgeError (a template refusing the messages,
    text a SentencePiece vocabulary without byte tokens cannot spell) is a 400 naming
    `param`, its message after `refusal`. The tokenizer's own failures (tiktoken's regex
    engine panics on some very long inputs: a PanicException, which is not an Exception)
    become one log line and a clean 500, not a traceback and a dropped connection."""
    try:
        return await run_in_threadpool(encode, text)
    except EdgeError as e:
        raise _bad(f"{refusal}{e}", param) from None
    except (asyncio.CancelledError, KeyboardInterrupt, SystemExit):
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
                 drafter: Drafter | None = None, files: SlotFiles | None = None,
                 metrics: bool = False, reasoning_format: str = "deepseek"):
        if reasoning_format not in REASONING_FORMATS:
            raise EdgeError(f"reasoning format must be one of {', '.join(REASONING_FORMATS)}, "
                            f"got {reasoning_format!r}")
        self.llm, self.model_id = llm, model_id
        self.engine = Engine(llm, queue_size, parallel, drafter, files)
        self.metrics = Metrics(self.engine, llm.ctx) if metrics else None
        self.reasoning_format = reasoning_format
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
        _, several_calls = await self._template_tool_support()
        params = _params(body, self.defaults, chat=True, several_calls=several_calls)
        ids = await self._chat_prompt(messages, params)
        return await self._run(request, ids, params, "messages", chat=True)

    async def _chat_prompt(self, messages: list[dict], params: Params) -> list[int]:
        """The prompt ids of checked messages (params.py's shape) and the request's
        tools, rendered with the chat template (also for /v1/messages: anthropic.py)."""
        shows_tools, several_calls = await self._template_tool_support()
        if not several_calls:
            messages = _one_call_per_message(messages)
        tools = params.tools if params.tool_choice != "none" else None
        if tools is not None and not shows_tools:
            raise _bad("this model's chat template has no tool calling (it does not show the "
                       "model a tool list); send the request without tools", "tools",
                       "tools_not_supported")
        return await _tokenize(lambda m: self.llm.chat.encode_messages(
            m, tools=tools, chat_template_kwargs=params.template_kwargs), messages, "messages",
            "cannot render these messages with the model's chat template: ")

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
        ids = await _tokenize(encode, _clean(prompt), "prompt")
        return await self._run(request, ids, params, "prompt", chat=False)

    async def _submit(self, request: Request, ids: list[int], params: Params,
                      param: str) -> tuple[Job, asyncio.Task]:
        """Queue the request's Job; the task that cancels it if the client goes away."""
        max_tokens = self._fit(ids, params, param)
        job = Job(ids, max_tokens, params, await self._constraint(params))
        self.engine.submit(job)
        return job, asyncio.create_task(_until_disconnect(request, self.engine, job))

    async def _run(self, request: Request, ids: list[int], params: Params, param: str, chat: bool):
        job, watcher = await self._submit(request, ids, params, param)
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
        splitter = self._reasoning(ids, params) if chat else None
        thought = {}
        if splitter is not None:
            (r1, c1), (r2, c2) = splitter.push(text), splitter.finish()
            text, thought = c1 + c2, ({"reasoning_content": r1 + r2} if r1 + r2 else {})
        calls = self._tool_calls(text, params) if chat else None
        if calls:
            choice.update(message={"role": "assistant", "content": None, **thought,
                                   "tool_calls": [c.openai() for c in calls]},
                          finish_reason="tool_calls")
        else:
            choice.update({"message": {"role": "assistant", "content": text, **thought}}
                          if chat else {"text": text})
        return JSONResponse({**head, "choices": [choice], "usage": usage})

    def _reasoning(self, ids: list[int], params: Params) -> ReasoningSplitter | None:
        """A reader of a chat reply's <think> block (reasoning format deepseek: the
        request's, else --reasoning-format), told whether the prompt `ids` leaves one
        open; None (format none): all is content."""
        if (params.reasoning_format or self.reasoning_format) == "none":
            return None
        tail = self.llm.tokenizer.decode(ids[-_PROMPT_TAIL:], special=True)
        return ReasoningSplitter(opens_reasoning(tail))

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
        # With tools offered, the reply's content is read as calls while it can be one:
        # held back until a call's name is read (then streamed as tool_calls deltas, the
        # first with the role) or until it cannot be a call (then sent as content, and the
        # rest streams as it comes). Its reasoning (a <think> block) streams as
        # reasoning_content deltas, apart.
        reader = _call_reader(params) if chat else None
        splitter = self._reasoning(job.ids, params) if chat else None
        held, held_logprobs = "", []
        waiting: list = []   # logprobs of text the splitter holds back

        def content(text: str, logprobs: list) -> Iterable[str]:
            nonlocal reader, held, held_logprobs
            if reader is None:
                yield chunk(text, logprobs=logprobs)
                return
            for delta in reader.push(text):
                yield chunk(None, delta={"tool_calls": [delta]})
            if not reader.announced:
                held += text
                held_logprobs += logprobs
            if reader.is_text:
                reader = None
                yield chunk(held, logprobs=held_logprobs)

        def split(pieces: tuple[str, str], logprobs: list) -> Iterable[str]:
            nonlocal waiting
            (reasoning, text), logprobs = pieces, waiting + logprobs
            waiting = []
            if reasoning:
                yield chunk(None, delta={"reasoning_content": reasoning},
                            logprobs=[] if text else logprobs)
            if text:
                yield from content(text, logprobs)
            elif not reasoning:
                waiting = logprobs
        try:
            if chat and reader is None:
                yield chunk("")   # OpenAI's first chunk: the role
            while True:
                event = await job.events.get()
                if event[0] == "text":
                    if splitter is None:
                        for out in content(event[1], event[2]):
                            yield out
                    else:
                        for out in split(splitter.push(event[1]), event[2]):
                            yield out
                elif event[0] == "done":
                    finish = event[1]
                    if splitter is not None:
                        for out in split(splitter.finish(), []):
                            yield out
                        if waiting and reader is None:   # the logprobs of trailing space
                            yield chunk(None, logprobs=waiting)
                        elif waiting:
                            held_logprobs += waiting
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

    async def tokenize(self, request: Request):
        """llama-server's POST /tokenize: {"content", "add_special", "parse_special",
        "with_pieces"} -> {"tokens": [id, ...]}, or [{"id", "piece"}, ...] with pieces (a
        piece is its text, or its bytes as a list where they are not UTF-8). No slot: the
        tokenizer runs off the event loop, beside the engine."""
        content, add_special, parse_special, with_pieces = _tokenize_body(
            await _read_json(request))
        tok = self.llm.tokenizer

        def encode(text: str) -> list[int]:
            ids = tok.encode_special(text) if parse_special else tok.encode(text)
            return [tok.bos_id] + ids if add_special and tok.add_bos else ids
        ids = await _tokenize(encode, content, "content")
        if not with_pieces:
            return JSONResponse({"tokens": ids})
        pieces = []
        for i in ids:
            b = tok.token_bytes(i)
            try:
                piece: str | list[int] = b.decode("utf-8")
            except UnicodeDecodeError:
                piece = list(b)
            pieces.append({"id": i, "piece": piece})
        return JSONResponse({"tokens": pieces})

    async def detokenize(self, request: Request):
        """llama-server's POST /detokenize: {"tokens": [id, ...]} -> {"content": text},
        special tokens as their text, bytes that are not UTF-8 as U+FFFD."""
        ids = _detokenize_body(await _read_json(request), self.llm.tokenizer.vocab_size)
        text = await run_in_threadpool(self.llm.tokenizer.decode, ids, True)
        return JSONResponse({"content": text})

    async def props(self, request: Request):
        """llama-server's GET /props: the generation defaults, slots, chat template and
        special tokens. model_path is the file's name only: a client learns which model
        is served, not where the server keeps it."""
        llm, tok, d = self.llm, self.llm.tokenizer, self.defaults
        shows_tools, several_calls = await self._template_tool_support()
        drafter = self.engine.slots[0].drafter
        settings = {
            "n_predict": -1, "seed": -1 if d.seed is None else d.seed,
            "temperature": d.temperature, "top_k": d.top_k, "top_p": d.top_p,
            "min_p": d.min_p, "repeat_last_n": d.repeat_last_n,
            "repeat_penalty": d.repeat_penalty, "presence_penalty": 0.0,
            "frequency_penalty": 0.0, "stop": [], "max_tokens": -1, "stream": False,
            "n_probs": 0, "reasoning_format": self.reasoning_format,
            "samplers": ["penalties", "top_k", "top_p", "min_p", "temperature"],
            "speculative.n_max": drafter.draft_max if drafter else 0,
            "speculative.n_min": drafter.draft_min if drafter else 0,
        }

        def text(i: int | None) -> str:
            return "" if i is None else tok.token_bytes(i).decode("utf-8", "replace")
        return JSONResponse({
            "default_generation_settings": {"id": 0, "n_ctx": llm.ctx, "params": settings},
            "total_slots": self.engine.parallel,
            "model_alias": self.model_id,
            "model_path": llm.path.name,
            "modalities": {"vision": False, "audio": False},
            "endpoint_slots": True, "endpoint_props": False,
            "endpoint_metrics": self.metrics is not None,
            "chat_template": llm.chat.source,
            "chat_template_caps": {"supports_tools": shows_tools,
                                   "supports_parallel_tool_calls": several_calls},
            "bos_token": text(tok.bos_id), "eos_token": text(tok.eos_id),
            "build_info": _BUILD,
        })

    async def prometheus(self, request: Request):
        """llama-server's GET /metrics (serve --metrics): Prometheus' text format
        (metrics.py); 501 without --metrics, as llama-server answers."""
        if self.metrics is None:
            raise ApiError(501, "this server does not serve metrics: start it with --metrics",
                           code="not_supported", kind="not_supported_error")
        return Response(self.metrics.text(), media_type=METRICS_TYPE,
                        headers={"Process-Start-Time-Unix": str(self.metrics.started)})

    async def health(self, request: Request):
        # kv_cache_tokens: what the slots' caches hold for the next requests to reuse (and
        # how far the running ones got); slots: each one's, and their memory
        slots = self.engine.slot_status()
        return JSONResponse({"status": "ok", "model": self.model_id, "ctx": self.llm.ctx,
                             "kv_cache_tokens": sum(slots["cached_tokens"]),
                             "queue": self.engine.status(), "slots": slots})


def create_app(llm: LLM, *, model_id: str | None = None, api_key: str | None = None,
               queue_size: int = DEFAULT_QUEUE, allowed_hosts: Iterable[str] = LOOPBACK_HOSTS,
               any_ip_host: bool = False, cors: Iterable[str] = (),
               parallel: int | None = None, drafter: Drafter | None = None,
               slot_save_path: str | None = None, slot_spill_max: int = 0,
               metrics: bool = False, reasoning_format: str = "deepseek") -> Starlette:
    """The ASGI app serving `llm`; its id is the file name without .gguf unless given.
    The engine thread starts now and stops when the app's lifespan ends. `parallel`
    requests run at once (None: choose_parallel's default from memory). `drafter`
    (llm.load_draft(path) or speculative.PromptLookup()): speculative decoding, where
    it pays (Engine). `slot_save_path`: a folder for POST /slots/{id} (save, restore,
    erase a slot's cache) and, if `slot_spill_max` (bytes) > 0, evicted conversations'
    caches (SlotFiles). `metrics`: serve GET /metrics (Prometheus). `reasoning_format`
    "deepseek": a chat reply's <think> block is its reasoning_content, apart from its
    content; "none": all of it is content.

    Only requests whose Host names one of `allowed_hosts` ("*": any; `any_ip_host`: any
    IP address too) are answered, and requests from web pages only from the same origin
    or one of the `cors` origins ("*": any); see _Guard. normalize_origin checks `cors`."""
    files = None if slot_save_path is None else SlotFiles(slot_save_path, slot_spill_max)
    server = Server(llm, model_id or llm.path.stem, queue_size, parallel, drafter, files,
                    metrics, reasoning_format)
    guard = Middleware(_Guard, hosts=list(allowed_hosts), any_ip=any_ip_host, cors=list(cors))

    async def api_error(request: Request, exc: ApiError):
        return exc.response_for(request.url.path)

    async def http_error(request: Request, exc: HTTPException):
        return ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                        code="not_found" if exc.status_code == 404 else None
                        ).response_for(request.url.path)

    async def client_gone(request: Request, exc: ClientDisconnect):
        return Response(status_code=400)   # left while sending its body: nobody reads this

    async def internal_error(request: Request, exc: Exception):
        return ApiError(500, "internal server error; the server log has the details"
                        ).response_for(request.url.path)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await run_in_threadpool(server.engine.close)

    app = Starlette(routes=[
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
        *anthropic_routes(server),   # /v1/messages: Anthropic's API
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/models/{name:path}", server.model, methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/slots", server.slots, methods=["GET"]),
        Route("/slots/{id}", server.slot_action, methods=["POST"]),
        Route("/tokenize", server.tokenize, methods=["POST"]),
        Route("/detokenize", server.detokenize, methods=["POST"]),
        Route("/props", server.props, methods=["GET"]),
        Route("/metrics", server.prometheus, methods=["GET"]),
    ], exception_handlers={ApiError: api_error, HTTPException: http_error,
                           ClientDisconnect: client_gone, Exception: internal_error},
        lifespan=lifespan,
        middleware=[guard] + ([Middleware(_RequireKey, key=api_key)] if api_key else []))
    app.state.server = server
    return app
