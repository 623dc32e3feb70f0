"""Hostile requests to `edgellama serve` (issue 30, "The server"): wrong JSON types
anywhere in a request, DNS rebinding and cross-site requests, form-style bodies, and
stopping the server while requests wait or stream. The contract: a 4xx with one clear
OpenAI-shaped message naming what was wrong, no 5xx, no traceback in the log, no hang.

Most cases drive the ASGI app in this process (tests/server_asgi.py); the rest run the
real command and use the `openai` client, as tests/server/test_server.py does.
"""
from __future__ import annotations

import http.client
import json
import signal
import threading
import time

import numpy as np
import openai
import pytest

from edgellama.tokenizer import Tokenizer
from server_asgi import ServerUnderTest, tiny_chat_model
from test_server import KEY, MSG, Served, models  # noqa: F401 - the fixture, shared

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    s = ServerUnderTest(tiny_chat_model(tmp_path_factory.mktemp("hostile")))
    yield s
    s.close()


def assert_clean(app: ServerUnderTest):
    """Nothing the app raised (uvicorn would print its traceback), nothing logged."""
    problems = [f"{r.levelname} {r.name}: {r.getMessage()}" for r in app.log.records]
    app.log.records.clear()
    assert not problems, problems


def refused(r, status: int, param: str | None, code: str | None = None) -> dict:
    assert r.raised is None, repr(r.raised)
    assert r.status == status, (r.status, r.body[:300])
    assert r.headers["content-type"] == "application/json"
    err = r.error()
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert isinstance(err["message"], str) and 0 < len(err["message"]) < 400, err
    assert "Traceback" not in err["message"]
    if code is not None:
        assert err["code"] == code, err
    return err


# -- 1. wrong JSON types, every field -----------------------------------------------------------

M = [{"role": "user", "content": "hi"}]
WRONG_TYPES = [
    # messages and what is inside them
    ({"messages": {"role": "user", "content": "hi"}}, "messages"),
    ({"messages": None}, "messages"),
    ({"messages": 7}, "messages"),
    ({"messages": [None]}, "messages[0]"),
    ({"messages": [[{"role": "user"}]]}, "messages[0]"),
    ({"messages": [{"role": {"name": "user"}, "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": ["user"], "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": ["user", "system"], "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": 1, "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": None, "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role"),
    ({"messages": M + [{"role": {}, "content": "x"}]}, "messages[1].role"),
    ({"messages": [{"role": "user", "content": 3.5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": {"text": "hi"}}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [["text"]]}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": ["text"], "text": "hi"}]}]},
     "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": {"t": 1}}]}]},
     "messages[0].content"),
    ({"messages": [{"role": "user", "content": "hi", "name": {"first": "a"}}]},
     "messages[0].name"),
    ({"messages": [{"role": "user", "content": "hi", "name": 5}]}, "messages[0].name"),
    # numbers
    ({"messages": M, "max_tokens": "10"}, "max_tokens"),
    ({"messages": M, "max_tokens": True}, "max_tokens"),
    ({"messages": M, "max_tokens": 2.0}, "max_tokens"),
    ({"messages": M, "max_tokens": -5}, "max_tokens"),
    ({"messages": M, "max_tokens": [5]}, "max_tokens"),
    ({"messages": M, "max_tokens": 10**40}, "max_tokens"),
    ({"messages": M, "max_completion_tokens": 256}, "max_completion_tokens"),
    ({"messages": M, "max_completion_tokens": {"n": 1}}, "max_completion_tokens"),
    ({"messages": M, "temperature": "0.5"}, "temperature"),
    ({"messages": M, "temperature": [0.5]}, "temperature"),
    ({"messages": M, "temperature": False}, "temperature"),
    ({"messages": M, "temperature": -0.1}, "temperature"),
    ({"messages": M, "top_p": "1"}, "top_p"),
    ({"messages": M, "top_p": 1.5}, "top_p"),
    ({"messages": M, "top_k": 2.5}, "top_k"),
    ({"messages": M, "top_k": -1}, "top_k"),
    ({"messages": M, "min_p": {}}, "min_p"),
    ({"messages": M, "min_p": -1e-9}, "min_p"),
    ({"messages": M, "repeat_penalty": 0}, "repeat_penalty"),
    ({"messages": M, "repeat_penalty": "1.1"}, "repeat_penalty"),
    ({"messages": M, "n": "1"}, "n"),
    ({"messages": M, "n": 1.0}, "n"),
    ({"messages": M, "n": 0}, "n"),
    ({"messages": M, "seed": "42"}, "seed"),
    ({"messages": M, "seed": True}, "seed"),
    ({"messages": M, "seed": [1]}, "seed"),
    # strings, flags, objects
    ({"messages": M, "stop": {"s": "x"}}, "stop"),
    ({"messages": M, "stop": [1, 2]}, "stop"),
    ({"messages": M, "stop": [["x"]]}, "stop"),
    ({"messages": M, "stop": True}, "stop"),
    ({"messages": M, "stream": 1}, "stream"),
    ({"messages": M, "stream": "true"}, "stream"),
    ({"messages": M, "stream": {}}, "stream"),
    ({"messages": M, "stream_options": ["include_usage"]}, "stream_options"),
    ({"messages": M, "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage"),
    ({"messages": M, "model": {"id": "tiny-chat"}}, "model"),
    ({"messages": M, "model": ["tiny-chat"]}, "model"),
    ({"messages": M, "user": {"id": 1}}, "user"),
    ({"messages": M, "logit_bias": {"5": 100}}, "logit_bias"),
    ({"messages": M, "logit_bias": [[5, 100]]}, "logit_bias"),
    ({"messages": M, "logit_bias": "5:100"}, "logit_bias"),
    ({"messages": M, "response_format": {"type": {"t": "json_object"}}}, "response_format"),
    ({"messages": M, "response_format": "json"}, "response_format"),
    ({"messages": M, "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"messages": M, "presence_penalty": "0"}, "presence_penalty"),
    ({"messages": M, "frequency_penalty": [0]}, "frequency_penalty"),
    ({"messages": M, "logprobs": 1}, "logprobs"),
    ({"messages": M, "top_logprobs": "0"}, "top_logprobs"),
]


@pytest.mark.parametrize("body,param", WRONG_TYPES, ids=[f"{i}-{p}" for i, (_, p) in
                                                          enumerate(WRONG_TYPES)])
def test_wrong_types_are_400_naming_the_field(app, body, param):
    r = app.request("POST", CHAT, body)
    refused(r, 400, param)
    assert_clean(app)


@pytest.mark.parametrize("body,param", [
    ({"prompt": {"text": "hi"}}, "prompt"),
    ({"prompt": [["hi"]]}, "prompt"),
    ({"prompt": [1, 2, 3]}, "prompt"),
    ({"prompt": None}, "prompt"),
    ({"prompt": "hi", "max_tokens": "3"}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 300}, "max_tokens"),
    ({"prompt": "hi", "echo": {"on": True}}, "echo"),
    ({"prompt": "hi", "suffix": 5}, "suffix"),
    ({"prompt": "hi", "best_of": "1"}, "best_of"),
    ({"prompt": "hi", "stop": {"s": 1}}, "stop"),
])
def test_completions_wrong_types_are_400(app, body, param):
    refused(app.request("POST", COMPLETIONS, body), 400, param)
    assert_clean(app)


def test_the_message_shows_the_value_cut_short(app):
    err = refused(app.request("POST", CHAT, {"messages": M, "max_tokens": 10**1000}), 400,
                  "max_tokens")
    assert "..." in err["message"] and len(err["message"]) < 200
    err = refused(app.request("POST", CHAT, {"messages": [{"role": "x" * 100_000,
                                                           "content": "hi"}]}),
                  400, "messages[0].role")
    assert len(err["message"]) < 200


@pytest.mark.parametrize("body", [
    b"", b"null", b"true", b"3", b'"messages"', b"[]", b"{", b"{}}", b"{'messages': []}",
    b'{"messages": Infinity}', b'{"messages": -Infinity}', b"\x00\x01\x02",
    b"\xef\xbb\xbf{}",                    # a byte-order mark
    b'{"messages": "\xc3\x28"}',           # invalid UTF-8 inside a string
    b"\xfe\xff\x00{",
    b'{"a":' * 50_000 + b"1" + b"}" * 50_000,      # deeply nested objects
    b'{"messages": [' + b"[" * 200_000 + b"]" * 200_000 + b"]}",
    b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1' + b"0" * 5000 + b"}",
])
def test_malformed_bodies_are_400(app, body):
    r = app.request("POST", CHAT, body, {"content-type": "application/json"})
    assert r.raised is None and r.status == 400, (r.status, r.body[:200])
    assert r.error()["message"] and r.error()["type"] == "invalid_request_error"
    assert_clean(app)


def test_a_huge_body_is_413_without_being_kept(app):
    big = b'{"prompt": "' + b"a" * (9 << 20) + b'"}'
    r = app.request("POST", COMPLETIONS, big, {"content-type": "application/json"})
    assert r.status == 413 and r.error()["code"] == "request_too_large"
    r = app.request("POST", COMPLETIONS, b"{}", {"content-type": "application/json",
                                                  "content-length": str(1 << 40)})
    assert r.status == 413
    assert_clean(app)


def test_extreme_but_accepted_values_answer(app):
    """Values inside the accepted ranges, at their ends: an answer (or a 400 if the
    command line's ranges say so), never a 500."""
    for extra in [{"temperature": 2}, {"temperature": 1e-300}, {"temperature": 5e-324},
                  {"top_p": 5e-324}, {"top_p": 1}, {"min_p": 1}, {"min_p": 0},
                  {"top_k": 10**30}, {"top_k": 0}, {"seed": 2**64 + 5}, {"seed": -(10**30)},
                  {"repeat_penalty": 100}, {"max_tokens": 1}, {"stop": ["x" * 500] * 16}]:
        r = app.request("POST", CHAT, {"messages": M, "max_tokens": 4, "temperature": 1,
                                       **extra})
        assert r.raised is None and r.status in (200, 400), (extra, r.status, r.body[:300])
    assert_clean(app)


def test_extreme_repeat_penalty_answers(app):
    for rp in (1e-300, 5e-324, 1e-30):
        r = app.request("POST", CHAT, {"messages": M, "max_tokens": 4, "temperature": 1,
                                       "repeat_penalty": rp})
        assert r.raised is None and r.status == 200, (rp, r.status, r.body[:300])
    assert_clean(app)


def test_text_the_vocabulary_cannot_spell_is_400(app, monkeypatch):
    """A SentencePiece vocabulary without byte tokens cannot spell some characters: the
    request's text is refused naming its field (it was a 500, "internal server error")."""
    spm = Tokenizer.from_metadata({
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>", "a", "▁"],
        "tokenizer.ggml.token_type": np.array([2, 3, 3, 1, 1], np.int32),
        "tokenizer.ggml.scores": np.zeros(5, np.float32)})
    monkeypatch.setattr(app.llm, "tokenizer", spm)
    for path, body, param in [("/tokenize", {"content": "aé"}, "content"),
                              (COMPLETIONS, {"prompt": "aé", "max_tokens": 2}, "prompt")]:
        err = refused(app.request("POST", path, body), 400, param)
        assert "no token for 'é'" in err["message"], err
    assert_clean(app)


# -- 2. Host, Origin, Content-Type --------------------------------------------------------------

@pytest.mark.parametrize("host", ["localhost:8080", "127.0.0.1:8080", "[::1]:8080", "localhost",
                                  "LOCALHOST:1234", "localhost.:8080", "127.0.0.1:80"])
def test_loopback_hosts_are_answered(app, host):
    r = app.request("GET", "/v1/models", host=host)
    assert r.status == 200, r.body


@pytest.mark.parametrize("host", ["evil.example:8080", "evil.example", "127.0.0.1.evil.example",
                                  "localhost.evil.example:8080", "10.0.0.5:8080", "[::2]:8080",
                                  "", "local host", "localhost:80x", "[::1", "a@localhost",
                                  "localhost:8080/x", "0.0.0.0:8080"])
def test_other_hosts_are_refused(app, host):
    for method, path, body in [("GET", "/health", None), ("GET", "/v1/models", None),
                               ("POST", COMPLETIONS, {"prompt": "hi", "max_tokens": 1})]:
        r = app.request(method, path, body, host=host)
        err = refused(r, 403, "Host", "host_not_allowed")
        assert "--allowed-host" in err["message"]
    assert_clean(app)


def test_a_second_host_header_is_checked_too(app):
    r = app.request("GET", "/health", headers=[("host", "127.0.0.1:8080"),
                                               ("host", "evil.example")])
    refused(r, 403, "Host", "host_not_allowed")


def test_no_host_header_is_answered(app):   # HTTP/1.0 clients: no browser omits it
    assert app.request("GET", "/health", host=None).status == 200


@pytest.mark.parametrize("ctype", ["text/plain", "text/plain;charset=UTF-8",
                                   "application/x-www-form-urlencoded",
                                   "multipart/form-data; boundary=xyz", "TEXT/PLAIN",
                                   "application/xml", "nonsense", "", ";", "json"])
def test_form_style_bodies_are_415(app, ctype):
    body = json.dumps({"prompt": "hi", "max_tokens": 1})
    for path in (COMPLETIONS, CHAT):
        r = app.request("POST", path, body, {"content-type": ctype})
        refused(r, 415, "Content-Type", "unsupported_media_type")
    assert_clean(app)


@pytest.mark.parametrize("ctype", [None, "application/json", "application/json; charset=utf-8",
                                   "Application/JSON", "application/vnd.api+json",
                                   "text/json"])
def test_json_bodies_are_taken(app, ctype):
    headers = {} if ctype is None else {"content-type": ctype}
    r = app.request("POST", COMPLETIONS, json.dumps({"prompt": "hi", "max_tokens": 2}), headers)
    assert r.status == 200, r.body


@pytest.mark.parametrize("origin", ["http://evil.example", "https://evil.example:8080",
                                    "null", "http://localhost:3000", "http://127.0.0.1:9999",
                                    "file://", "garbage", ""])
def test_cross_origin_requests_are_refused(app, origin):
    for ctype in ("text/plain", "application/json", "application/x-www-form-urlencoded"):
        r = app.request("POST", COMPLETIONS, json.dumps({"prompt": "hi", "max_tokens": 1}),
                        {"content-type": ctype, "origin": origin})
        err = refused(r, 403, "Origin", "origin_not_allowed")
        assert "--cors" in err["message"]
        assert "access-control-allow-origin" not in r.headers
    r = app.request("OPTIONS", COMPLETIONS, headers={
        "origin": origin, "access-control-request-method": "POST"})
    refused(r, 403, "Origin", "origin_not_allowed")
    r = app.request("GET", "/v1/models", headers={"origin": origin})
    refused(r, 403, "Origin", "origin_not_allowed")
    assert app.server.engine.status()["running"] == 0
    assert_clean(app)


def test_same_origin_requests_are_answered(app):
    r = app.request("POST", COMPLETIONS, {"prompt": "hi", "max_tokens": 2},
                    {"content-type": "application/json", "origin": "http://127.0.0.1:8080"})
    assert r.status == 200 and "access-control-allow-origin" not in r.headers
    r = app.request("GET", "/v1/models", headers={"origin": "http://localhost:8080"},
                    host="localhost:8080")
    assert r.status == 200


@pytest.fixture(scope="module")
def cors_app(tmp_path_factory):
    s = ServerUnderTest(tiny_chat_model(tmp_path_factory.mktemp("cors")),
                        {"cors": ["http://localhost:3000", "HTTPS://App.Example:443/"],
                         "allowed_hosts": ["localhost", "127.0.0.1", "llm.lan"],
                         "api_key": KEY})
    yield s
    s.close()


def test_cors_origins_get_headers_and_preflights(cors_app):
    auth = {"authorization": f"Bearer {KEY}"}
    for origin in ("http://localhost:3000", "https://app.example"):
        r = cors_app.request("OPTIONS", CHAT, headers={
            "origin": origin, "access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type, x-stainless-os"})
        assert r.status == 204, r.body
        assert r.headers["access-control-allow-origin"] == origin
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "authorization" in r.headers["access-control-allow-headers"]
        assert "Origin" in r.headers["vary"]
        r = cors_app.request("POST", CHAT, {"messages": M, "max_tokens": 2},
                             {"content-type": "application/json", "origin": origin, **auth})
        assert r.status == 200 and r.headers["access-control-allow-origin"] == origin
        # errors carry the header too, so the page can read them
        r = cors_app.request("POST", CHAT, {"messages": 5},
                             {"content-type": "application/json", "origin": origin, **auth})
        assert r.status == 400 and r.headers["access-control-allow-origin"] == origin
        r = cors_app.request("GET", "/v1/models", headers={"origin": origin})   # no key
        assert r.status == 401 and r.headers["access-control-allow-origin"] == origin
        # a form-style POST from an allowed origin is still not JSON
        r = cors_app.request("POST", CHAT, json.dumps({"messages": M}),
                             {"content-type": "text/plain", "origin": origin, **auth})
        assert r.status == 415
    for origin in ("http://localhost:3001", "http://app.example", "https://evil.example"):
        r = cors_app.request("POST", CHAT, {"messages": M, "max_tokens": 2},
                             {"content-type": "application/json", "origin": origin, **auth})
        refused(r, 403, "Origin", "origin_not_allowed")
    # --allowed-host names are answered; others still are not
    assert cors_app.request("GET", "/health", host="llm.lan:8080").status == 200
    refused(cors_app.request("GET", "/health", host="[::1]:8080"), 403, "Host")
    assert_clean(cors_app)


def test_cors_star_and_any_host(tmp_path):
    s = ServerUnderTest(tiny_chat_model(tmp_path), {"cors": ["*"], "allowed_hosts": ["*"]})
    try:
        r = s.request("GET", "/v1/models", headers={"origin": "https://anything.example"},
                      host="whatever.example")
        assert r.status == 200 and r.headers["access-control-allow-origin"] == "*"
    finally:
        s.close()


def test_any_ip_host_when_bound_to_every_interface(tmp_path):
    s = ServerUnderTest(tiny_chat_model(tmp_path), {"any_ip_host": True,
                                                     "allowed_hosts": ["localhost", "mybox"]})
    try:
        for host in ("192.168.1.20:8080", "[fe80::1]:8080", "mybox:8080", "localhost"):
            assert s.request("GET", "/health", host=host).status == 200, host
        refused(s.request("GET", "/health", host="evil.example:8080"), 403, "Host")
    finally:
        s.close()


def test_bad_cors_values_are_refused_by_the_command(tmp_path):
    from click.testing import CliRunner

    from edgellama.cli.main import main
    model = tiny_chat_model(tmp_path)
    for args in (["--cors", "localhost:3000"], ["--cors", "http://x/path"],
                 ["--allowed-host", "a b"], ["--allowed-host", "x:y"]):
        r = CliRunner().invoke(main, ["serve", "-m", str(model), "--port", "0", *args])
        assert r.exit_code == 2, (args, r.output)
        assert f"Invalid value for '{args[0]}'" in r.output, (args, r.output)


# -- 3. shutting down in-process: the engine ends what waits and runs -----------------------

def test_engine_shutdown_answers_503_to_what_waits(app):
    """A request submitted after shutdown is told 503 shutting_down (the app is then
    closed; this runs last among the tests using `app`)."""
    app.server.engine.shutdown()
    r = app.request("POST", COMPLETIONS, {"prompt": "hi", "max_tokens": 2})
    err = r.error()
    assert r.status == 503 and err["code"] == "shutting_down"
    assert app.request("GET", "/health").status == 200
    assert_clean(app)


# -- the real command ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def live(models):   # noqa: F811
    d, tiny, _ = models
    s = Served(tiny, "--allowed-host", "llm.lan", "--cors", "http://localhost:3000",
               log=d / "hostile.log")
    yield s
    s.stop()
    assert "Traceback" not in s.text()


def test_openai_client_against_the_guarded_server(live):
    for base in (live.url, f"http://localhost:{live.port}/v1"):
        c = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=60)
        r = c.chat.completions.create(model="tiny-chat", messages=MSG, max_tokens=3,
                                      temperature=0)
        assert r.choices[0].message.content is not None
        chunks = list(c.completions.create(model="tiny-chat", prompt="hi", max_tokens=3,
                                           stream=True))
        assert chunks[-1].choices[0].finish_reason == "length"
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="tiny-chat",
                                      messages=[{"role": {"x": 1}, "content": "hi"}])
        assert e.value.param == "messages[0].role"
    assert "answering Host localhost, 127.0.0.1, [::1], llm.lan" in live.text()


def test_rebinding_and_cross_site_against_the_real_server(live):
    body = json.dumps({"prompt": "hi", "max_tokens": 2})
    status, _, raw = live.raw("POST", "/v1/completions", body,
                              {"Host": f"evil.example:{live.port}"})
    assert status == 403 and json.loads(raw)["error"]["code"] == "host_not_allowed"
    status, _, raw = live.raw("POST", "/v1/completions", body,
                              {"Origin": "http://evil.example", "Content-Type": "text/plain"})
    assert status == 403 and json.loads(raw)["error"]["code"] == "origin_not_allowed"
    status, _, raw = live.raw("POST", "/v1/completions", body, {"Content-Type": "text/plain"})
    assert status == 415
    status, _, _ = live.raw("GET", "/health", headers={"Host": f"llm.lan:{live.port}"})
    assert status == 200
    status, headers, _ = live.raw("OPTIONS", "/v1/chat/completions", headers={
        "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type"})
    assert status == 204 and headers["access-control-allow-origin"] == "http://localhost:3000"
    status, headers, _ = live.raw("POST", "/v1/completions", body, {
        "Origin": "http://localhost:3000", "Content-Type": "application/json"})
    assert status == 200 and headers["access-control-allow-origin"] == "http://localhost:3000"
    assert live.health()["queue"]["running"] == 0


def _start_stream(served, body: dict) -> tuple[http.client.HTTPConnection,
                                                http.client.HTTPResponse]:
    conn = http.client.HTTPConnection(served.host, served.port, timeout=60)
    conn.request("POST", body.pop("path"), body=json.dumps(body),
                 headers={"Content-Type": "application/json"})
    return conn, conn.getresponse()


def test_stopping_the_server_while_requests_wait_and_stream(models, tmp_path):  # noqa: F811
    """SIGINT with one request generating (streamed, ~15 s to go), one streamed and one
    not streamed waiting: the waiting one gets 503 shutting_down, both streams end with
    that error and [DONE], the process exits at once, and the log has no traceback."""
    _, _, slow = models
    s = Served(slow, "--parallel", "1", "--queue", "4", log=tmp_path / "stop.log")   # one runs
    try:
        long = {"prompt": "hello the", "max_tokens": 4000, "temperature": 0}
        conn1, running = _start_stream(s, {"path": "/v1/completions", **long, "stream": True})
        assert running.status == 200
        first = running.readline()              # it is generating
        assert first.startswith(b"data: ")
        conn2, waiting_stream = _start_stream(s, {"path": "/v1/chat/completions",
                                                  "messages": MSG, "max_tokens": 4000,
                                                  "temperature": 0, "stream": True})
        assert waiting_stream.status == 200
        answer = {}

        def plain():
            status, _, raw = s.raw("POST", "/v1/completions", {**long, "prompt": "on the"})
            answer["status"], answer["body"] = status, raw
        t = threading.Thread(target=plain)
        t.start()
        s.wait_health(lambda h: h["queue"]["waiting"] == 2)
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGINT)
        t.join(20)
        assert not t.is_alive()
        assert answer["status"] == 503, answer
        assert json.loads(answer["body"])["error"]["code"] == "shutting_down"
        for response in (running, waiting_stream):
            events = [e for e in response.read().decode().split("\n\n") if e]
            assert events[-1] == "data: [DONE]", events[-3:]
            assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == \
                "shutting_down"
        s.proc.wait(20)
        assert time.monotonic() - t0 < 5
        assert s.proc.returncode in (0, 130)   # 130: ended by SIGINT, as a shell reports it
        conn1.close()
        conn2.close()
    finally:
        s.stop()
    log = s.text()
    assert "Traceback" not in log and "ERROR" not in log, log
    assert "timeout graceful shutdown exceeded" not in log
