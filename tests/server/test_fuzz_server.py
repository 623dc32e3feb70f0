"""Fuzzing the server's request handling: random and mutated JSON bodies, headers, paths
and methods against the ASGI app (tests/server_asgi.py, a tiny F32 chat model).

Each case is built from a seeded generator (deterministic; a failure names its case
number and request). Every answer must be:
- never a 5xx, never an exception out of the app (uvicorn would log its traceback), and
  nothing logged at WARNING or above;
- for a 4xx, a JSON body {"error": {"message", "type", "param", "code"}} with a message;
- within CASE_SECONDS;
- and the guards hold: a foreign Host is always 403, a request from a foreign origin is
  never answered 2xx, a non-JSON Content-Type never reaches the model.

A second server (issue 35) takes tools and holds slots and a drafter, and its cases add
what the first never sends: random tool lists whose parameter schemas nest, refer and
contradict (with every tool_choice), random response_format and json_schema schemas,
GBNF grammars, llama.cpp's speculative options and POST /slots/{id} actions with hostile
file names. There, moreover, a 200 reply under a schema that ends "stop" must parse as
JSON, and no file may appear outside the slot folder.

The quick runs (1500 and 600 cases, seconds) are part of the suite; `-m slow` runs
80 000 and 20 000.
"""
from __future__ import annotations

import json
import random
import time

import pytest

from edgellama.slot_files import _NAME
from edgellama.speculative import PromptLookup
from server_asgi import HOST, ServerUnderTest, tiny_chat_model
from test_chat_template import LLAMA32_TEMPLATE
from tiny_gguf import TINY_VOCAB, write_tiny_gguf

SEED = 20250130
CASE_SECONDS = 5.0
ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/models/tiny-chat",
          "/health"]
FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature",
          "top_p", "top_k", "min_p", "repeat_penalty", "seed", "stop", "n", "stream",
          "stream_options", "logprobs", "top_logprobs", "response_format", "tools",
          "tool_choice", "logit_bias", "presence_penalty", "frequency_penalty", "user",
          "echo", "suffix", "best_of", "audio", "prediction", "functions", "metadata",
          "store", "parallel_tool_calls", "service_tier", "x-unknown", "", "json_schema",
          "grammar", "speculative.n_max", "speculative.n_min", "speculative.p_min",
          "n_probs", "id_slot"]
GOOD_HOSTS = [HOST, "localhost:8080", "localhost", "[::1]:8080", "127.0.0.1", "LocalHost:1"]
BAD_HOSTS = ["evil.example:8080", "evil.example", "127.0.0.1.nip.io:8080", "", " ", "[::1",
             "localhost:99999999", "a@127.0.0.1", "0.0.0.0:8080", "10.1.2.3", "\u00e9vil:80",
             "localhost:8080, evil.example"]
ORIGINS = ["http://evil.example", "null", "https://127.0.0.1:8080", "http://localhost:3000",
           "", "*", "http://127.0.0.1:8080x", "javascript:alert(1)"]
SAME_ORIGINS = ["http://127.0.0.1:8080", "https://localhost:8080"]
JSON_TYPES = ["application/json", "application/json; charset=utf-8", "APPLICATION/JSON",
              "application/problem+json", "text/json"]
OTHER_TYPES = ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
               "multipart/form-data; boundary=----x", "application/octet-stream", "text/html",
               ";", "", "application/jsonx", "json"]
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "TRACE", "CONNECT",
           "PROPFIND", "get", "P0ST"]


def _number(rng: random.Random):
    return rng.choice([0, 1, -1, 2, 7, 64, 255, 256, 300, 2**31, 2**63, 2**64 + 1, -(2**63),
                       10**30, 0.0, -0.0, 0.5, 1.0, 1.5, 2.0, 2.0000001, 99.9, 100, 100.5,
                       1e-300, 5e-324, 1e-9, 1e308, -1e308, rng.random() * 3,
                       rng.randint(-5, 300)])


def _string(rng: random.Random) -> str:
    return rng.choice(["", "x", "user", "system", "assistant", "developer", "tool", "function",
                       "text", "image_url", "tiny-chat", "tiny-chat.gguf", "gpt-4o", "\x00",
                       "\ud800", "\u2603 snow", "<|im_end|>", "<|im_start|>assistant\n",
                       "{{ raise_exception('x') }}", "{% for %}", "\n" * 50, " " * 3000,
                       "a" * rng.randint(1, 2000), "true", "null", "1e5",
                       "".join(chr(rng.randint(1, 0x2FFFF)) for _ in range(rng.randint(1, 30)))])


def value(rng: random.Random, depth: int = 0):
    """A random JSON value, nested at most 3 deep."""
    kind = rng.randint(0, 9 if depth < 3 else 5)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind in (2, 3):
        return _number(rng)
    if kind in (4, 5):
        return _string(rng)
    if kind in (6, 7):
        return [value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(["role", "content", "type", "text", "name", "include_usage",
                        "image_url", "tool_calls", _string(rng)]): value(rng, depth + 1)
            for _ in range(rng.randint(0, 4))}


def message(rng: random.Random):
    if rng.random() < 0.15:
        return value(rng)
    m = {"role": rng.choice(["user", "system", "assistant", "developer"]) if rng.random() < 0.6
         else value(rng),
         "content": rng.choice(["hi", "hello there", ""]) if rng.random() < 0.6 else value(rng)}
    if rng.random() < 0.3:
        m[rng.choice(["name", "tool_calls", "function_call", "extra"])] = value(rng)
    if rng.random() < 0.2:
        m["content"] = [{"type": "text", "text": "hi"} if rng.random() < 0.5 else value(rng)
                        for _ in range(rng.randint(0, 3))]
    if rng.random() < 0.1:
        del m[rng.choice(list(m))]
    return m




def body_of(rng: random.Random, route: str):
    chat = route == "/v1/chat/completions" or (route == "/v1/completions" and rng.random() < .1)
    body: dict = ({"messages": [message(rng) for _ in range(rng.randint(1, 3))]} if chat
                  else {"prompt": rng.choice(["hello the", "once upon", ["hi"]])})
    body["max_tokens"] = rng.choice([1, 2, 4, 8, 8, 16])
    for field in rng.sample(FIELDS, rng.randint(0, 4)):
        body[field] = value(rng)
    if rng.random() < 0.2:
        body.pop(rng.choice(list(body)))
    if rng.random() < 0.15:
        body = value(rng)   # not an object at all, sometimes
    return body


def mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randint(0, 6)
        i = rng.randint(0, len(b)) if b else 0
        if op == 0 and b:
            b[min(i, len(b) - 1)] = rng.randint(0, 255)
        elif op == 1:
            del b[i:]
        elif op == 2:
            b[i:i] = rng.choice([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00", b"\\", b'"', b"{",
                                 b"[", b"]", b"}", b",", b":", b"NaN", b"Infinity", b"-",
                                 b"1e999999", b"\\ud800", b"\\u0000", b"\xef\xbb\xbf"])
        elif op == 3 and b:
            j = rng.randint(i, len(b))
            b[i:i] = b[i:j] * rng.randint(1, 3)
        elif op == 4:
            depth = rng.choice([10, 1000, 100_000])
            b[i:i] = b"[" * depth + b"]" * depth
        elif op == 5:
            b[i:i] = b'"' + b"a" * rng.choice([10, 70_000, 600_000]) + b'"'
        else:
            b = bytearray(rng.randbytes(rng.randint(0, 64)))
    return bytes(b)


NAMES = ["get_weather", "f", "g-2", "x" * 64, "has space", "", "\u00e9t\u00e9", "f"]
KEYWORDS = ["type", "properties", "required", "additionalProperties", "items", "enum",
            "const", "anyOf", "allOf", "oneOf", "minLength", "maxLength", "pattern", "format",
            "minimum", "maximum", "exclusiveMinimum", "multipleOf", "minItems", "maxItems",
            "$ref", "$defs", "prefixItems", "not", "propertyNames", "default"]
TYPES = ["object", "array", "string", "integer", "number", "boolean", "null"]


def schema(rng: random.Random, depth: int = 0):
    """A random JSON schema: mostly well formed, at times contradictory, self-referring,
    out of range, nested past every bound, or not a schema at all."""
    roll = rng.random()
    if roll < 0.05:
        return value(rng)
    if roll < 0.08:   # nested past the bounds (a schema's 100 levels, a body's 128)
        s = {"type": "integer"}
        for _ in range(rng.choice([40, 60, 200])):
            s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
        return s
    kind = rng.choice(TYPES + [TYPES[:3]])
    out: dict = {"type": kind}
    for key in rng.sample(KEYWORDS, rng.randint(0, 4 if depth < 3 else 1)):
        if key in ("properties", "$defs"):
            out[key] = {rng.choice(["a", "b", "city", "type", "$ref", ""]): schema(rng, depth + 1)
                        for _ in range(rng.randint(0, 3))}
        elif key in ("items", "additionalProperties", "not", "propertyNames"):
            out[key] = schema(rng, depth + 1) if rng.random() < 0.8 else rng.random() < 0.5
        elif key in ("anyOf", "allOf", "oneOf", "prefixItems"):
            out[key] = [schema(rng, depth + 1) for _ in range(rng.randint(0, 3))]
        elif key == "required":
            out[key] = rng.choice([["a"], ["a", "b"], [], "a", [1]])
        elif key == "$ref":
            out[key] = rng.choice(["#", "#/$defs/a", "#/$defs/nope", "http://x/y", "#/properties"])
        elif key in ("enum", "const", "default"):
            out[key] = value(rng) if key != "enum" else [value(rng) for _ in range(3)]
        elif key == "pattern":
            out[key] = rng.choice(["^[a-z]{1,5}$", "[a-", "(a|b)*c", "^\\d+$", "(" * 300])
        elif key == "format":
            out[key] = rng.choice(["date", "email", "uuid", "nope"])
        else:
            out[key] = _number(rng)
    return out


def tools_of(rng: random.Random) -> list:
    tools = []
    for _ in range(rng.choice([0, 1, 1, 2, 3, 200])):
        f = {"name": rng.choice(NAMES), "parameters": schema(rng)}
        if rng.random() < 0.3:
            f["description"] = _string(rng)[:50]
        tools.append({"type": "function", "function": f} if rng.random() < 0.9 else value(rng))
    return tools


FILENAMES = ["a.prompt", "b", "x" * 128, "x" * 129, "", "..", "../a", "/etc/passwd", ".hidden",
             "spill-0.prompt", "a\x00b", "sub/a", "\u2603", "a..b", "ok-name_1.x"]


def slot_case(rng: random.Random):
    """A POST /slots/{id}?action=... path and its body."""
    sid = rng.choice(["0", "1", "1", "3", "99", "-1", "x", "1" * 50, "%31", ""])
    action = rng.choice(["save", "save", "restore", "restore", "erase", "", "delete",
                         "save&action=erase", None])
    path = f"/slots/{sid}" + ("" if action is None else f"?action={action}")
    body = {"filename": rng.choice(FILENAMES) if rng.random() < 0.85 else value(rng)}
    if rng.random() < 0.1:
        body = value(rng)
    return path, body


def rich_body(rng: random.Random, route: str):
    """body_of's body with tools, schemas, grammars and draft options added at random."""
    body = body_of(rng, route) if rng.random() < 0.2 else (
        {"messages": [{"role": "user", "content": "hi"}]} if route == ROUTES[0]
        else {"prompt": "on and on and on and"})
    if not isinstance(body, dict):
        return body
    if rng.random() < 0.5:
        body["temperature"] = rng.choice([0, 0.7, 1.5])
    roll = rng.random()
    if roll < 0.35 and route == ROUTES[0]:
        body["tools"] = tools_of(rng)
        body["tool_choice"] = rng.choice(["none", "auto", "required", "required",
                                          {"type": "function", "function": {
                                              "name": rng.choice(NAMES)}}, value(rng)])
    elif roll < 0.6:
        fmt = rng.choice(["json_schema", "json_object", "field"])
        if fmt == "field":
            body["json_schema"] = schema(rng)
        else:
            body["response_format"] = {"type": fmt, "json_schema": {
                "name": "x", "strict": rng.random() < 0.5, "schema": schema(rng)}}
    elif roll < 0.7:
        body["grammar"] = rng.choice(['root ::= "yes" | "no"', 'root ::= [0-9]+',
                                      'root ::= "[" [a-z]* ("," [a-z]*)* "]"', "root ::= x",
                                      "root ::= " + "(" * 150 + '"a"' + ")" * 150,
                                      _string(rng)])
    for name in rng.sample(["speculative.n_max", "speculative.n_min", "speculative.p_min"],
                           rng.randint(0, 2)):
        body[name] = _number(rng) if rng.random() < 0.8 else value(rng)
    body["max_tokens"] = rng.choice([1, 4, 16, 40, 80])
    return body


def rich_case(rng: random.Random):
    """case() for the server with tools, slots and a drafter: a quarter slot actions,
    the rest requests with rich_body, all from a good host without an origin."""
    if rng.random() < 0.25:
        path, body = slot_case(rng)
        return "POST", path, [(b"content-type", b"application/json")], \
            json.dumps(body).encode("utf-8", "surrogatepass"), HOST, None, "application/json"
    route = rng.choice(ROUTES[:2] + ROUTES[:1])
    data = json.dumps(rich_body(rng, route)).encode("utf-8", "surrogatepass")
    if rng.random() < 0.1:
        data = mutate(rng, data)
    return "POST", route, [(b"content-type", b"application/json")], data, HOST, None, \
        "application/json"


def case(rng: random.Random):
    """method, path, headers (list of byte pairs), body, host or None, and what the guards
    must do with it."""
    route = rng.choice(ROUTES + ROUTES[:2] * 2)
    method = "POST" if route in ROUTES[:2] else "GET"
    if rng.random() < 0.1:
        method = rng.choice(METHODS)
    path = route
    if rng.random() < 0.1:
        path = rng.choice([
            "/", "/v1", "/v1/", "/v1//chat/completions", "/v1/models/" + _string(rng)[:300],
            "/v1/models/%ff%00", "/v1/chat/completions/", "/v1/chat/completions?x=1&x=%zz",
            "/../etc/passwd", "/health?verbose", "/" + "a" * 10_000, "/v1/completions\x00",
            "/V1/MODELS", "//health", "/v1/models/..%2f..%2fx", "/\u2603"])
    body = b""
    if method not in ("GET", "HEAD") or rng.random() < 0.05:
        data = json.dumps(body_of(rng, route), ensure_ascii=rng.random() < 0.5).encode(
            "utf-8", "surrogatepass")
        body = mutate(rng, data) if rng.random() < 0.3 else data
    headers: list[tuple[bytes, bytes]] = []
    host: str | None = rng.choice(GOOD_HOSTS)
    if rng.random() < 0.12:
        host = rng.choice(BAD_HOSTS)
    elif rng.random() < 0.03:
        host = None
    ctype = rng.choice(JSON_TYPES) if body else None
    if rng.random() < 0.15:
        ctype = rng.choice(OTHER_TYPES + [None])
    if ctype is not None:
        headers.append((b"content-type", ctype.encode()))
    origin = None
    if rng.random() < 0.15:
        origin = rng.choice(ORIGINS + SAME_ORIGINS)
        headers.append((b"origin", origin.encode()))
    if rng.random() < 0.05:
        headers.append((b"access-control-request-method", b"POST"))
    if rng.random() < 0.1:
        headers.append(rng.choice([
            (b"content-length", rng.choice([b"-1", b"abc", b"99999999999999", b"0", b"1e3"])),
            (b"authorization", rng.choice([b"Bearer", b"Bearer x", b"Basic \xff", b""])),
            (b"transfer-encoding", b"chunked"), (b"accept", b"*/*"),
            (rng.randbytes(5).hex().encode(), rng.randbytes(8)),
            (b"x-forwarded-host", b"evil.example"), (b"host", b"evil.example")]))
    return method, path, headers, body, host, origin, ctype


def check(s: ServerUnderTest, i: int, c) -> int:
    method, path, headers, body, host, origin, ctype = c
    r = s.request(method, path, body, headers, host=host, timeout=CASE_SECONDS * 4)
    where = f"case {i}: {method} {path[:80]!r} host={host!r} headers={headers!r} " \
            f"body={body[:300]!r}"
    assert r.raised is None, f"{where}: the app raised {r.raised!r}"
    assert 100 <= r.status < 500, f"{where}: status {r.status} {r.body[:300]!r}"
    assert r.seconds < CASE_SECONDS, f"{where}: took {r.seconds:.1f} s"
    logged = [f"{x.levelname} {x.name}: {x.getMessage()}" for x in s.log.records]
    assert not logged, f"{where}: logged {logged}"
    if r.status >= 400:
        assert r.headers.get("content-type") == "application/json", f"{where}: {r.headers}"
        err = r.error()
        assert isinstance(err["message"], str) and err["message"], where
        assert isinstance(err["type"], str) and "Traceback" not in err["message"], where
    hosts = [v for k, v in headers if k == b"host"] + ([host.encode()] if host is not None
                                                       else [])
    bad_host = any(h.decode("latin-1") not in GOOD_HOSTS for h in hosts)
    if bad_host:
        assert r.status == 403 and r.error()["code"] == "host_not_allowed", where
    # same origin: the page's host[:port] is the Host (the scheme may differ behind a
    # TLS proxy; the server itself serves no page, so only it can be that origin)
    foreign = origin is not None and origin.partition("://")[2].lower() != (host or "").lower()
    if foreign and not bad_host:
        assert r.status == 403 and r.error()["code"] == "origin_not_allowed", where
    if r.status < 300 and method == "POST":
        assert ctype is None or ctype in JSON_TYPES, where
        assert not foreign, where
    if r.status == 200 and path in ROUTES[:2] and \
            r.headers.get("content-type") == "application/json":   # not a stream
        _check_structured(json.loads(body), r.json(), where)
    return r.status


def _check_structured(body: dict, reply: dict, where: str) -> None:
    """A reply under a JSON schema (or json_object) that ended on its own parses."""
    fmt = body.get("response_format")
    schema_asked = body.get("json_schema") is not None or (
        isinstance(fmt, dict) and fmt.get("type") in ("json_schema", "json_object"))
    choice = reply["choices"][0]
    if schema_asked and choice["finish_reason"] == "stop" and not body.get("stop"):
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        json.loads(text)   # raises, naming the case, if it does not parse


def run(s: ServerUnderTest, cases: int, seed: int = SEED, make=case) -> dict[int, int]:
    rng = random.Random(seed)
    statuses: dict[int, int] = {}
    for i in range(cases):
        status = check(s, i, make(rng))
        statuses[status] = statuses.get(status, 0) + 1
    deadline = time.monotonic() + CASE_SECONDS   # nothing left running or waiting (the
    while s.server.engine.status()["running"] and time.monotonic() < deadline:   # engine
        time.sleep(0.01)                          # is idle just after its last event)
    h = s.request("GET", "/health").json()
    assert h["queue"] == {"running": 0, "waiting": 0, "capacity": 16}, h
    return statuses


@pytest.fixture(scope="module")
def rich(tmp_path_factory):
    """The tiny model with Llama 3.2's template (it shows tools), a slot folder and
    prompt lookup."""
    d = tmp_path_factory.mktemp("fuzz-rich")
    path = write_tiny_gguf(d / "tiny-tools.gguf", "F32", vocab=TINY_VOCAB, ctx=4096,
                           tokenizer=True, tied=False, seed=4, chat_template=LLAMA32_TEMPLATE)
    s = ServerUnderTest(path, {"slot_save_path": str(d / "slots"), "parallel": 2,
                               "drafter": PromptLookup()}, ctx=4096)
    r = s.request("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}, timeout=600)
    assert r.status == 200, r.body[:300]
    yield s, d
    s.close()


def _rich_run(rich, cases: int, seed: int) -> dict[int, int]:
    s, d = rich
    statuses = run(s, cases, seed, rich_case)
    # slot files only inside the folder, under names a client may give
    assert sorted(p.name for p in d.iterdir()) == ["slots", "tiny-tools.gguf"]
    assert all(_NAME.fullmatch(p.name) and p.is_file() for p in (d / "slots").iterdir())
    return statuses


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    s = ServerUnderTest(tiny_chat_model(tmp_path_factory.mktemp("fuzz")))
    # kernels compiled before the clock runs: a cold kernel cache (a fresh clone) takes
    # longer than a case may
    for extra in ({}, {"temperature": 1, "repeat_penalty": 1e-300, "top_k": 3, "min_p": 0.1}):
        r = s.request("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                       "max_tokens": 2, **extra}, timeout=600)
        assert r.status == 200, r.body[:300]
    yield s
    s.close()


def test_fuzz_requests(app):
    statuses = run(app, 1500)
    # the mix reaches everything: answers, refusals of every kind
    assert statuses.get(200, 0) > 200 and statuses.get(400, 0) > 200, statuses
    assert {403, 404, 405, 415} <= set(statuses), statuses


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_fuzz_requests_long(app, seed):
    run(app, 20_000, SEED + 1 + seed)


def test_fuzz_tools_schemas_slots_and_draft_options(rich):
    statuses = _rich_run(rich, 600, SEED)
    assert statuses.get(200, 0) > 80 and statuses.get(400, 0) > 200, statuses
    assert 404 in statuses, statuses   # a restore of a file never saved


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_fuzz_tools_schemas_slots_and_draft_options_long(rich, seed):
    _rich_run(rich, 5_000, SEED + 11 + seed)
