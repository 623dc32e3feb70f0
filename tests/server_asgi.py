"""The server's ASGI app in this process, driven with raw ASGI messages: any method, path,
header bytes and body (no HTTP client normalises them first), a time limit on every
request, and what the app raised or logged collected for the test to check.

    app = ServerUnderTest(tiny_model_path)
    r = app.request("POST", "/v1/completions", {"prompt": "hi"})   # r.status, r.json()
    app.close()

    with served_over_http(app.app) as origin:     # "http://127.0.0.1:PORT", for real clients
        ...
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import edgellama
from edgellama.server import create_app
from tiny_gguf import TINY_VOCAB, write_tiny_gguf

HOST = "127.0.0.1:8080"


@contextlib.contextmanager
def served_over_http(app) -> Iterator[str]:
    """`app` served by uvicorn on a free loopback port for the with block; its origin."""
    import uvicorn
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start in 30 s"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)


def tiny_chat_model(directory: Path) -> Path:
    """The small F32 chat model of tests/server/test_server.py (~0.3 ms a token)."""
    return write_tiny_gguf(directory / "tiny-chat.gguf", "F32", vocab=TINY_VOCAB, ctx=256,
                           tokenizer=True, tied=False, seed=4)


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes
    seconds: float
    raised: BaseException | None = None

    def json(self):
        return json.loads(self.body)

    def error(self) -> dict:
        return self.json()["error"]


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@dataclass
class ServerUnderTest:
    model: Path
    kwargs: dict = field(default_factory=dict)
    ctx: int = 256

    def __post_init__(self):
        self.llm = edgellama.load(str(self.model), ctx=self.ctx, threads=1)
        self.app = create_app(self.llm, **self.kwargs)
        self.server = self.app.state.server
        self.loop = asyncio.new_event_loop()
        self.log = _Records()
        for name in ("edgellama", "uvicorn", "starlette"):
            logging.getLogger(name).addHandler(self.log)

    def close(self):
        for name in ("edgellama", "uvicorn", "starlette"):
            logging.getLogger(name).removeHandler(self.log)
        self.server.engine.close()
        self.loop.close()

    def request(self, method: str, path: str, body: bytes | str | dict | list | None = None,
                headers: list[tuple[bytes | str, bytes | str]] | dict | None = None, *,
                host: str | None = HOST, timeout: float = 20.0) -> Reply:
        """One request. A dict or list body is sent as JSON with its Content-Type unless
        `headers` names one; `host=None` sends no Host header."""
        if isinstance(body, (dict, list)):
            body = json.dumps(body)
            headers = headers if headers is not None else {"content-type": "application/json"}
        if isinstance(body, str):
            body = body.encode("utf-8", "surrogatepass")
        pairs = list(headers.items()) if isinstance(headers, dict) else list(headers or [])
        raw = [(k if isinstance(k, bytes) else k.encode("latin-1"),
                v if isinstance(v, bytes) else v.encode("utf-8", "surrogatepass"))
               for k, v in pairs]
        raw = [(k.lower(), v) for k, v in raw]
        if host is not None and not any(k == b"host" for k, _ in raw):
            raw.insert(0, (b"host", host.encode()))
        return self.loop.run_until_complete(
            self._call(method, path, body or b"", raw, timeout))

    async def _call(self, method, path, body, headers, timeout) -> Reply:
        raw_path = path.encode("utf-8", "surrogatepass")
        path_only, _, query = raw_path.partition(b"?")
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": method, "scheme": "http",
                 "path": path_only.decode("utf-8", "replace"), "raw_path": path_only,
                 "query_string": query, "root_path": "", "headers": headers,
                 "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8080)}
        chunks = [body[i:i + 65536] for i in range(0, len(body), 65536)] or [b""]
        done = asyncio.Event()
        status, out_headers, parts = None, {}, []

        async def receive():
            if chunks:
                chunk = chunks.pop(0)
                return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}
            await done.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            nonlocal status, out_headers
            if message["type"] == "http.response.start":
                assert status is None, "two response starts"
                status = message["status"]
                out_headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                               for k, v in message.get("headers", [])}
            elif message["type"] == "http.response.body":
                assert status is not None and not done.is_set()
                parts.append(message.get("body", b""))
                if not message.get("more_body", False):
                    done.set()

        t0 = time.monotonic()
        raised = None
        try:
            await asyncio.wait_for(self.app(scope, receive, send), timeout)
        except asyncio.TimeoutError as e:
            raised = e
        except BaseException as e:  # noqa: BLE001 - what uvicorn would log as a traceback
            raised = e
        return Reply(status if status is not None else 0, out_headers, b"".join(parts),
                     time.monotonic() - t0, raised)
