"""`edgellama serve`'s application: the OpenAI HTTP API over one loaded model.

    app = create_app(llm, api_key=None, queue_size=16)   # a Starlette (ASGI) app

One model, one KV cache, one engine thread: requests are validated and tokenized on
arrival (so a bad one fails at once, without queueing), then wait in a bounded queue
and run one at a time. A full queue answers 503. The engine is not thread-safe, so only
its thread runs the model; the event loop parses requests and passes text on, so it
answers /health and refuses bad requests while a reply is being generated.

Prefix reuse: LLM.generate keeps the cache of the previous request and recomputes only
from the first token that differs, so a client that re-sends its conversation pays
only for what is new; `usage.prompt_tokens_details.cached_tokens` says how much was
reused. Interleaved conversations from several clients evict each other's prefix.

Stop strings are matched on the decoded text across token boundaries. Text that could
be the start of a stop string is held back until it is known not to be one, so no part
of a stop string is ever sent, streamed or not.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .errors import EdgeError
from .llm import LLM
from .sampling import SamplingParams
from .tokenizer import StreamDecoder

log = logging.getLogger("edgellama.server")

DEFAULT_QUEUE = 16
MAX_BODY = 8 << 20          # bytes of a request body: a 128k-token context is ~0.5 MB of text
MAX_STOPS = 16              # stop strings per request (OpenAI allows 4)
MAX_STOP_CHARS = 500        # characters of one stop string
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# Parameters whose non-default values would change the answer in ways we do not
# implement: refused rather than silently ignored. Everything else unknown is ignored.
UNSUPPORTED = {
    "logprobs": (False,), "top_logprobs": (0,), "tools": ([],), "functions": ([],),
    "tool_choice": ("none", "auto"), "logit_bias": ({},), "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0), "echo": (False,), "suffix": ("",), "best_of": (1,),
    "audio": (), "prediction": (), "response_format": ({"type": "text"},),
}


class ApiError(Exception):
    """An error answer in OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, kind: str | None = None):
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


def _number(body: dict, name: str, lo: float, hi: float, lo_open: bool = False) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _bad(f"{name} must be a number", name)
    if v > hi or v < lo or (lo_open and v == lo):
        raise _bad(f"{name} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v}", name)
    return float(v)


def _integer(body: dict, name: str, lo: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(f"{name} must be an integer", name)
    if lo is not None and v < lo:
        raise _bad(f"{name} must be at least {lo}, got {v}", name)
    return v


def _flag(body: dict, name: str) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _bad(f"{name} must be true or false", name)
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
        if role not in ROLES:
            raise _bad(f"role must be one of {', '.join(ROLES)}; got {role!r}"
                       + (" (tool calling is not supported)" if role in ("tool", "function") else ""),
                       f"messages[{i}].role")
        if m.get("tool_calls") or m.get("function_call"):
            raise _bad("tool calls are not supported", f"messages[{i}]")
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""
        out.append({"role": ROLES[role], "content": _message_text(content, i)})
    return out


@dataclass
class Params:
    """What one request asks of the engine, validated."""
    stream: bool
    include_usage: bool
    max_tokens: int | None
    sampling: SamplingParams
    stops: list[str]


def _params(body: dict, defaults: SamplingParams, chat: bool) -> Params:
    for name, harmless in UNSUPPORTED.items():
        v = body.get(name)
        if v is not None and not any(type(v) is type(h) and v == h for h in harmless):
            raise _bad(f"{name} is not supported by this server", name)
    n = _integer(body, "n")
    if n not in (None, 1):
        raise _bad("only n=1 is supported", "n")
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad("stream_options must be an object", "stream_options")
    include_usage = _flag(options or {}, "include_usage")
    max_tokens = _integer(body, "max_completion_tokens", 1) if chat else None
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1)
    given = {k: v for k, v in {
        "temperature": _number(body, "temperature", 0, 2),
        "top_p": _number(body, "top_p", 0, 1, lo_open=True),
        # llama.cpp's server extensions, same names
        "top_k": _integer(body, "top_k", 0),
        "min_p": _number(body, "min_p", 0, 1),
        "repeat_penalty": _number(body, "repeat_penalty", 0, 100, lo_open=True),
    }.items() if v is not None}
    seed = _integer(body, "seed")
    if seed is not None:
        given["seed"] = seed % 2**64   # OpenAI takes any int64; NumPy wants one >= 0
    return Params(stream, include_usage, max_tokens, replace(defaults, **given), _stops(body))


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
    ("text", str), ("done", finish_reason, usage), ("error", ApiError), ("cancelled",)."""

    def __init__(self, ids: list[int], max_tokens: int, params: Params):
        self.ids, self.max_tokens, self.params = ids, max_tokens, params
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self._loop = asyncio.get_running_loop()

    def emit(self, *event: Any) -> None:
        with contextlib.suppress(RuntimeError):   # the loop is closed: the server has stopped
            self._loop.call_soon_threadsafe(self.events.put_nowait, event)


class Engine:
    """The one thread that runs the model, and the bounded queue in front of it."""

    def __init__(self, llm: LLM, capacity: int = DEFAULT_QUEUE):
        self.llm, self.capacity = llm, capacity
        self._cond = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._running: Job | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._work, name="edgellama-engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._closed:
                raise ApiError(503, "the server is shutting down", code="shutting_down")
            if len(self._waiting) >= self.capacity:
                raise ApiError(503, f"the server is busy: one request is running and "
                                    f"{len(self._waiting)} are waiting, the most it queues "
                                    f"(--queue {self.capacity}); retry later", code="queue_full")
            self._waiting.append(job)
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """Stop a job: dropped if still waiting, else stopped before its next token."""
        job.cancelled.set()
        with self._cond:
            if job in self._waiting:
                self._waiting.remove(job)
                job.emit("cancelled")

    def status(self) -> dict:
        with self._cond:
            return {"running": int(self._running is not None), "waiting": len(self._waiting),
                    "capacity": self.capacity}

    def close(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._closed = True
            for job in list(self._waiting) + ([self._running] if self._running else []):
                job.cancelled.set()
            for job in self._waiting:
                job.emit("cancelled")
            self._waiting.clear()
            self._cond.notify_all()
        self._thread.join(timeout)

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                job = self._running = self._waiting.popleft()
            try:
                self._generate(job)
            except EdgeError as e:   # the model, not the request (that was checked)
                job.emit("error", ApiError(500, str(e)))
            except Exception:  # noqa: BLE001 - one request fails, the server stays up
                log.exception("generation failed")
                job.emit("error", ApiError(500, "internal error while generating; "
                                                "the server log has the details"))
            finally:
                with self._cond:
                    self._running = None

    def _read_prompt(self, job: Job) -> int | None:
        """Bring the KV cache to hold the prompt but its last batch, one batch at a time,
        so that a client leaving during a long prompt stops it (LLM.generate reads the
        prompt in one call; the batches are the ones its forward pass would make, so the
        numbers are the same). Returns the prompt tokens reused from the cache, or None
        if the client left."""
        llm, ids = self.llm, job.ids
        reused = 0
        for a, b in zip(llm.cached, ids):
            if a != b:
                break
            reused += 1
        reused = min(reused, len(ids) - 1)   # as LLM.generate: the last token is recomputed
        for end in range(reused + llm.model.batch, len(ids), llm.model.batch):
            if job.cancelled.is_set():
                return None
            llm.logits(ids[:end])
        return None if job.cancelled.is_set() else reused

    def _generate(self, job: Job) -> None:
        reused = self._read_prompt(job)
        if reused is None:
            job.emit("cancelled")
            return
        llm, p = self.llm, job.params
        decoder, matcher = StreamDecoder(llm.tokenizer), StopMatcher(p.stops)
        tokens = llm.generate(job.ids, max_tokens=job.max_tokens, sampling=p.sampling)
        count, finish = 0, None
        try:
            for tok in tokens:
                if job.cancelled.is_set():   # the client left: no further token
                    break
                count += 1
                text, hit = matcher.push(decoder.push(tok))
                if text:
                    job.emit("text", text)
                if hit:
                    finish = "stop"
                    break
        finally:
            tokens.close()   # LLM.generate keeps the cache consistent when closed early
        if job.cancelled.is_set():
            job.emit("cancelled")
            return
        if finish is None:
            text, hit = matcher.push(decoder.flush())
            text += "" if hit else matcher.flush()
            if text:
                job.emit("text", text)
            finish = "stop" if hit or llm.stats.stop_reason == "stop" else "length"
        prompt = len(job.ids)
        job.emit("done", finish, {
            "prompt_tokens": prompt, "completion_tokens": count, "total_tokens": prompt + count,
            "prompt_tokens_details": {"cached_tokens": reused}})


# -- the HTTP side ------------------------------------------------------------------------------

async def _read_json(request: Request) -> dict:
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
    return body


async def _until_disconnect(request: Request, engine: Engine, job: Job) -> None:
    """Cancel the job when the client goes away (waiting or generating)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    engine.cancel(job)


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


class Server:
    def __init__(self, llm: LLM, model_id: str, queue_size: int):
        self.llm, self.model_id = llm, model_id
        self.engine = Engine(llm, queue_size)
        self.defaults = llm.default_sampling()
        self.created = int(time.time())

    def _check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is None:
            return   # curl users often leave it out: there is only one model
        if not isinstance(model, str):
            raise _bad("model must be a string", "model")
        if model not in (self.model_id, self.llm.path.name):
            raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                                f"{self.model_id!r}", "model", "model_not_found")

    def _fit(self, ids: list[int], max_tokens: int | None, param: str) -> int:
        """max_tokens for this prompt: as asked, or all the room the context leaves."""
        n, ctx = len(ids), self.llm.ctx
        if n == 0:
            raise _bad("the prompt is empty", param)
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
        params = _params(body, self.defaults, chat=True)
        try:
            ids = await run_in_threadpool(self.llm.chat.encode_messages, messages)
        except EdgeError as e:   # the template refused these messages
            raise _bad(f"cannot render these messages with the model's chat template: {e}",
                       "messages") from None
        return await self._run(request, ids, params, "messages", chat=True)

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
        ids = await run_in_threadpool(encode, _clean(prompt))
        return await self._run(request, ids, params, "prompt", chat=False)

    async def _run(self, request: Request, ids: list[int], params: Params, param: str, chat: bool):
        job = Job(ids, self._fit(ids, params.max_tokens, param), params)
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
            parts = []
            while True:
                event = await job.events.get()
                if event[0] == "text":
                    parts.append(event[1])
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
        choice = {"index": 0, "logprobs": None, "finish_reason": finish}
        choice.update({"message": {"role": "assistant", "content": text}} if chat
                      else {"text": text})
        return JSONResponse({**head, "choices": [choice], "usage": usage})

    async def _stream(self, job: Job, watcher: asyncio.Task, head: dict, chat: bool):
        head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
        extra = {"usage": None} if job.params.include_usage else {}

        def chunk(text: str | None, finish: str | None = None) -> str:
            if chat:
                delta = {} if text is None else {"content": text}
                if text == "" and finish is None:
                    delta["role"] = "assistant"
                choice = {"index": 0, "delta": delta}
            else:
                choice = {"index": 0, "text": text or ""}
            choice.update({"logprobs": None, "finish_reason": finish})
            return _sse({**head, "choices": [choice], **extra})
        try:
            if chat:
                yield chunk("")   # OpenAI's first chunk: the role
            while True:
                event = await job.events.get()
                if event[0] == "text":
                    yield chunk(event[1])
                elif event[0] == "done":
                    yield chunk(None, event[1])
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

    async def health(self, request: Request):
        # kv_cache_tokens: what the next request can reuse (and how far the last one got)
        return JSONResponse({"status": "ok", "model": self.model_id, "ctx": self.llm.ctx,
                             "kv_cache_tokens": len(self.llm.cached),
                             "queue": self.engine.status()})


class _RequireKey:
    """ASGI middleware: /v1/... needs `Authorization: Bearer KEY` (/health does not)."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not secrets.compare_digest(token.strip(), self.key):
                error = ApiError(401, "a valid API key is needed: send the header "
                                      "'Authorization: Bearer KEY'", code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(llm: LLM, *, model_id: str | None = None, api_key: str | None = None,
               queue_size: int = DEFAULT_QUEUE) -> Starlette:
    """The ASGI app serving `llm`; its id is the file name without .gguf unless given.
    The engine thread starts now and stops when the app's lifespan ends."""
    server = Server(llm, model_id or llm.path.stem, queue_size)

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
    ], exception_handlers={ApiError: api_error, HTTPException: http_error,
                           ClientDisconnect: client_gone, Exception: internal_error},
        lifespan=lifespan,
        middleware=[Middleware(_RequireKey, key=api_key)] if api_key else [])
    app.state.server = server
    return app
