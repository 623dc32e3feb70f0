"""llama-server's operational endpoints on `edgellama serve`: GET /metrics (Prometheus,
with --metrics), POST /tokenize and /detokenize, GET /props, which paths need the API
key, and chat replies' reasoning apart from their content (--reasoning-format deepseek:
message.reasoning_content, delta.reasoning_content) with chat_template_kwargs.

The ASGI app runs in this process (tests/server_asgi.py) on test_server's tiny F32 chat
model; a GBNF grammar whose only sentence is a given text drives the random model into
Qwen 3 style replies (<think>...</think> then the answer), and the plain reasoning.py
split of the whole text is the twin both reply shapes are checked against.
"""
from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from edgellama.reasoning import split_reasoning
from edgellama.server import params as server_params
from server_asgi import HOST, ServerUnderTest, tiny_chat_model
from test_chat_template import LLAMA32_TEMPLATE
from tiny_gguf import CHATML, TINY_VOCAB, write_tiny_gguf

CHAT = "/v1/chat/completions"
THOUGHT = "<think>\nFirst the weather, then the answer.\n</think>\n\nIt is sunny in Oslo."
TURN = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
# A template that opens the think block for the reply (as DeepSeek R1's does), and one that
# reads Qwen 3's enable_thinking (false: an empty, closed block in the prompt)
OPENING = TURN + "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
QWEN3_LIKE = TURN + ("{% if add_generation_prompt %}<|im_start|>assistant\n"
                     "{% if enable_thinking is defined and enable_thinking is false %}"
                     "<think>\n\n</think>\n\n{% endif %}{% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def forcing(text: str) -> str:
    """A GBNF grammar whose only sentence is `text`."""
    return "root ::= " + json.dumps(text, ensure_ascii=False)


def metrics(app: ServerUnderTest) -> dict[str, float]:
    """/metrics read by prometheus-client's own parser: each sample's value by name."""
    r = app.request("GET", "/metrics")
    assert r.status == 200, r.body[:300]
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {s.name: s.value for f in text_string_to_metric_families(r.body.decode())
            for s in f.samples}


def chat(app: ServerUnderTest, text: str | None = None, **body):
    body = {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "temperature": 0,
            "max_tokens": 200, **body}
    if text is not None:
        body["grammar"] = forcing(text)
    return app.request("POST", CHAT, body)


def streamed(reply) -> list[dict]:
    assert reply.status == 200, reply.body[:300]
    lines = [line[6:] for line in reply.body.decode().split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def deltas(events: list[dict], key: str) -> str:
    return "".join(e["choices"][0]["delta"].get(key) or "" for e in events if e["choices"])


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return tiny_chat_model(tmp_path_factory.mktemp("endpoints"))


@pytest.fixture(scope="module")
def app(model):
    app = ServerUnderTest(model, {"parallel": 2, "metrics": True})
    # the first reply in a fresh checkout compiles the kernels: not within a request's 20 s
    assert app.request("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2},
                       timeout=600).status == 200
    yield app
    app.close()


def _templated(tmp_path_factory, name: str, template: str, **kwargs) -> ServerUnderTest:
    path = write_tiny_gguf(tmp_path_factory.mktemp("endpoints") / name, "F32",
                           vocab=TINY_VOCAB, ctx=4096, tokenizer=True, tied=False, seed=4,
                           chat_template=template)
    return ServerUnderTest(path, kwargs, ctx=4096)


@pytest.fixture(scope="module")
def plain(model):
    """The same model with --reasoning-format none and no --metrics."""
    app = ServerUnderTest(model, {"parallel": 1, "reasoning_format": "none"})
    yield app
    app.close()


# -- /tokenize and /detokenize ------------------------------------------------------------------

def test_tokenize_is_the_tokenizer(app):
    tok = app.llm.tokenizer
    text = "hello the <|im_start|> world é"
    r = app.request("POST", "/tokenize", {"content": text})
    assert r.status == 200 and r.json() == {"tokens": tok.encode_special(text)}
    assert r.json()["tokens"].count(tok.special_tokens["<|im_start|>"]) == 1
    plain = app.request("POST", "/tokenize", {"content": text, "parse_special": False}).json()
    assert plain == {"tokens": tok.encode(text)}
    assert tok.special_tokens["<|im_start|>"] not in plain["tokens"]
    special = app.request("POST", "/tokenize", {"content": text, "add_special": True}).json()
    assert special["tokens"] == ([tok.bos_id] if tok.add_bos else []) + tok.encode_special(text)
    assert app.request("POST", "/tokenize", {}).json() == {"tokens": []}


def test_tokenize_with_pieces_and_detokenize_round_trip(app):
    tok = app.llm.tokenizer
    text = "hello <|im_end|> é"
    r = app.request("POST", "/tokenize", {"content": text, "with_pieces": True})
    pieces = r.json()["tokens"]
    assert [p["id"] for p in pieces] == tok.encode_special(text)
    for p in pieces:   # text where a token is UTF-8 on its own, its bytes where not
        b = tok.token_bytes(p["id"])
        assert p["piece"] == (list(b) if isinstance(p["piece"], list) else b.decode())
    assert [p["piece"] for p in pieces[-2:]] == [[0xC3], [0xA9]]   # é: two byte tokens
    back = app.request("POST", "/detokenize", {"tokens": [p["id"] for p in pieces]})
    assert back.status == 200 and back.json() == {"content": text}
    assert app.request("POST", "/detokenize", {"tokens": [0xC3]}).json() == {"content": "\ufffd"}
    assert app.request("POST", "/detokenize", {}).json() == {"content": ""}


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"content": 5}, "content"),
    ("/tokenize", {"content": ["a", 1]}, "content"),
    ("/tokenize", {"content": "a", "add_special": "yes"}, "add_special"),
    ("/tokenize", {"content": "a", "parse_special": 1}, "parse_special"),
    ("/tokenize", {"content": "a", "with_pieces": None, "parse_special": []}, "parse_special"),
    ("/tokenize", {"content": "x" * 65}, "content"),
    ("/detokenize", {"tokens": "hello"}, "tokens"),
    ("/detokenize", {"tokens": [1, TINY_VOCAB]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": [True]}, "tokens"),
    ("/detokenize", {"tokens": [1.0]}, "tokens"),
    ("/detokenize", {"tokens": [10**40]}, "tokens"),
    ("/detokenize", {"tokens": [1] * 65}, "tokens"),
])
def test_bad_tokenize_input_is_a_400_naming_the_field(app, monkeypatch, path, body, param):
    monkeypatch.setattr(server_params, "MAX_TOKENIZE_CHARS", 64)
    monkeypatch.setattr(server_params, "MAX_DETOKENIZE", 64)
    before = len(app.log.records)
    r = app.request("POST", path, body)
    assert r.status == 400 and r.raised is None, r.body
    assert r.error()["param"] == param and r.error()["type"] == "invalid_request_error"
    assert len(app.log.records) == before            # nothing logged, no traceback
    assert app.request("POST", "/tokenize", {"content": "hello"}).status == 200
    for bad in (b"[1, 2]", b"{", b'{"content": "a"'):   # not a JSON object
        assert app.request("POST", path, bad, {"content-type": "application/json"}).status == 400
    assert app.request("POST", path, b"content=a",
                       {"content-type": "application/x-www-form-urlencoded"}).status == 415


# -- /props -------------------------------------------------------------------------------------

def test_props_has_llama_servers_fields_and_no_folder(app, model):
    p = app.request("GET", "/props").json()
    d = app.server.defaults
    settings = p["default_generation_settings"]
    assert settings["n_ctx"] == app.llm.ctx == 256
    assert {k: settings["params"][k] for k in ("temperature", "top_k", "top_p", "min_p")} == \
        {"temperature": d.temperature, "top_k": d.top_k, "top_p": d.top_p, "min_p": d.min_p}
    assert settings["params"]["reasoning_format"] == "deepseek"
    assert p["total_slots"] == 2 and p["model_alias"] == "tiny-chat"
    assert p["model_path"] == model.name and str(model.parent) not in json.dumps(p)
    assert p["chat_template"] == app.llm.chat.source == CHATML
    assert p["chat_template_caps"] == {"supports_tools": False,
                                       "supports_parallel_tool_calls": False}
    tok = app.llm.tokenizer
    assert p["eos_token"] == tok.token_bytes(tok.eos_id).decode() != ""
    assert p["endpoint_metrics"] is True and p["endpoint_slots"] is True
    assert p["modalities"] == {"vision": False, "audio": False}
    assert p["build_info"].startswith("edgellama")


# -- /metrics -----------------------------------------------------------------------------------

def test_metrics_is_off_without_the_flag(plain):
    r = plain.request("GET", "/metrics")
    assert r.status == 501 and r.error()["type"] == "not_supported_error"
    assert "--metrics" in r.error()["message"]
    assert plain.request("GET", "/props").json()["endpoint_metrics"] is False


def test_metrics_count_what_requests_did(app):
    m0 = metrics(app)
    assert m0["llamacpp:requests_processing"] == 0 and m0["edgellama:slots_total"] == 2
    prompt = "once upon a time " * 6
    usages = []
    for _ in range(2):   # the second reuses the first one's cache
        r = app.request("POST", "/v1/completions", {"prompt": prompt, "max_tokens": 7,
                                                    "temperature": 0})
        assert r.status == 200
        usages.append(r.json()["usage"])
    m1 = metrics(app)

    def moved(name):
        return m1[name] - m0[name]
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert cached > 0
    assert moved("llamacpp:prompt_tokens_total") == \
        sum(u["prompt_tokens"] for u in usages) - cached
    assert moved("llamacpp:prompt_tokens_cached_total") == cached
    assert moved("llamacpp:tokens_predicted_total") == \
        sum(u["completion_tokens"] for u in usages) > 0
    assert moved("edgellama:requests_total") == 2
    # a pass per decode step at least, and at least one reading each prompt
    assert moved("llamacpp:n_decode_total") >= sum(u["completion_tokens"] for u in usages)
    assert moved("llamacpp:prompt_seconds_total") > 0
    assert moved("llamacpp:tokens_predicted_seconds_total") > 0
    assert m1["llamacpp:predicted_tokens_seconds"] > 0 and m1["llamacpp:prompt_tokens_seconds"] > 0
    slots = app.server.engine.slot_status()
    assert m1["llamacpp:kv_cache_tokens"] == sum(slots["cached_tokens"]) > 0
    assert m1["llamacpp:kv_cache_usage_ratio"] == \
        m1["llamacpp:kv_cache_tokens"] / (slots["parallel"] * app.llm.ctx)
    assert m1["llamacpp:n_tokens_max"] >= usages[0]["total_tokens"] - 1
    # the throughput gauges cover the time since the previous scrape: none since
    m2 = metrics(app)
    assert m2["llamacpp:predicted_tokens_seconds"] == m2["llamacpp:prompt_tokens_seconds"] == 0
    assert m2["llamacpp:tokens_predicted_total"] == m1["llamacpp:tokens_predicted_total"]


def test_two_apps_in_one_process_count_apart(app, model):
    other = ServerUnderTest(model, {"parallel": 1, "metrics": True})
    try:
        before = metrics(app)["edgellama:requests_total"]
        assert other.request("POST", "/v1/completions",
                             {"prompt": "hello", "max_tokens": 3}).status == 200
        assert metrics(other)["edgellama:requests_total"] == 1
        assert metrics(app)["edgellama:requests_total"] == before
    finally:
        other.close()


def test_metrics_props_and_tokenize_take_no_slot(model):
    """With the one slot busy and the engine thread held between steps (so nothing it
    would do could answer), /metrics, /props, /tokenize and /detokenize still answer, and
    /metrics shows the running and the waiting request."""
    app = ServerUnderTest(model, {"parallel": 1, "metrics": True})
    engine = app.server.engine
    held, release = threading.Event(), threading.Event()

    def hold():   # on the engine thread, between steps: once the slot is busy, wait
        if not engine.slot_status()["busy"]:
            engine.run(hold)
            return
        held.set()
        release.wait(30)

    def call(method, path, body=None):
        data = json.dumps(body).encode() if body is not None else b""
        return app._call(method, path, data, [(b"host", HOST.encode()),
                                              (b"content-type", b"application/json")], 30)

    long = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 120,
            "grammar": forcing("x" * 120)}

    async def scenario():
        running = asyncio.create_task(call("POST", CHAT, long))
        while not engine.status()["running"]:
            await asyncio.sleep(0.002)
        engine.run(hold)
        while not held.is_set():
            await asyncio.sleep(0.002)
        waiting = asyncio.create_task(call("POST", CHAT, long))
        while not engine.status()["waiting"]:
            await asyncio.sleep(0.002)
        try:
            answers = [await asyncio.wait_for(call(*c), 5) for c in (
                ("GET", "/metrics"), ("GET", "/props"),
                ("POST", "/tokenize", {"content": "hello"}),
                ("POST", "/detokenize", {"tokens": [104, 105]}))]
        finally:
            release.set()
        return answers, await running, await waiting
    try:
        (m, props, tokens, text), first, second = app.loop.run_until_complete(scenario())
        assert [r.status for r in (m, props, tokens, text, first, second)] == [200] * 6
        values = {s.name: s.value for f in text_string_to_metric_families(m.body.decode())
                  for s in f.samples}
        assert values["llamacpp:requests_processing"] == 1
        assert values["llamacpp:requests_deferred"] == 1
        assert values["edgellama:slots_busy"] == values["edgellama:slots_total"] == 1
        assert tokens.json() == {"tokens": app.llm.tokenizer.encode("hello")}
        assert text.json() == {"content": "hi"}
        assert json.loads(first.body)["choices"][0]["message"]["content"] == "x" * 120
    finally:
        release.set()
        app.close()


# -- the API key --------------------------------------------------------------------------------

def test_every_path_but_health_needs_the_key(model):
    app = ServerUnderTest(model, {"parallel": 1, "api_key": "k", "metrics": True})
    try:
        calls = [("GET", "/metrics", None), ("GET", "/props", None),
                 ("POST", "/tokenize", {"content": "a"}), ("POST", "/detokenize", {"tokens": [1]}),
                 ("GET", "/slots", None), ("GET", "/v1/models", None),
                 ("POST", "/v1/completions", {"prompt": "a", "max_tokens": 1}),
                 ("GET", "/nowhere", None)]
        for method, path, body in calls:
            r = app.request(method, path, body)
            assert r.status == 401 and r.error()["code"] == "invalid_api_key", path
            wrong = app.request(method, path, body, {"authorization": "Bearer kk",
                                                     "content-type": "application/json"})
            assert wrong.status == 401, path
            r = app.request(method, path, body, {"authorization": "Bearer k",
                                                 "content-type": "application/json"})
            assert r.status == (404 if path == "/nowhere" else 200), (path, r.body[:200])
        assert app.request("GET", "/health").status == 200
    finally:
        app.close()


# -- reasoning_content --------------------------------------------------------------------------

def test_reasoning_apart_from_content(app, plain):
    reasoning, content = split_reasoning(THOUGHT)
    assert reasoning == "First the weather, then the answer." and content == "It is sunny in Oslo."
    message = chat(app, THOUGHT).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": content, "reasoning_content": reasoning}
    message = chat(plain, THOUGHT).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": THOUGHT}   # --reasoning-format none
    message = chat(app, "No thinking here.").json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "No thinking here."}


def test_a_requests_reasoning_format_wins(app, plain):
    # llama-server's per-request field: it was ignored, whatever it said
    message = chat(app, THOUGHT, reasoning_format="none").json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": THOUGHT}
    events = streamed(chat(app, THOUGHT, stream=True, reasoning_format="none"))
    assert deltas(events, "reasoning_content") == "" and deltas(events, "content") == THOUGHT
    message = chat(plain, THOUGHT, reasoning_format="deepseek").json()["choices"][0]["message"]
    assert message["reasoning_content"] == "First the weather, then the answer."
    for bad in ("bogus", 5, ["none"]):
        r = chat(app, THOUGHT, reasoning_format=bad)
        assert r.status == 400 and r.error()["param"] == "reasoning_format", r.body
        assert "reasoning_format must be none or deepseek" in r.error()["message"]
    assert not app.log.records


@pytest.mark.parametrize("cut", [None, 20, 8])
def test_streamed_reasoning_is_the_whole_replys(app, plain, cut):
    """Streamed deltas add up to the unstreamed reply's parts, with a reply cut inside
    the block (max_tokens) too; every token's logprob arrives once, in order."""
    extra = {} if cut is None else {"max_tokens": cut}
    whole = chat(app, THOUGHT, **extra).json()["choices"][0]
    events = streamed(chat(app, THOUGHT, stream=True, logprobs=True, **extra))
    assert deltas(events, "reasoning_content") == whole["message"].get("reasoning_content", "")
    assert deltas(events, "content") == whole["message"]["content"]
    assert events[-1]["choices"][0]["finish_reason"] == whole["finish_reason"]
    tokens = [t["token"] for e in events if e["choices"] and e["choices"][0]["logprobs"]
              for t in e["choices"][0]["logprobs"]["content"]]
    unstreamed = chat(app, THOUGHT, logprobs=True, **extra).json()["choices"][0]
    assert tokens == [t["token"] for t in unstreamed["logprobs"]["content"]]
    assert "".join(tokens) == THOUGHT if cut is None else THOUGHT.startswith("".join(tokens))
    events = streamed(chat(plain, THOUGHT, stream=True, **extra))
    assert deltas(events, "reasoning_content") == ""
    assert deltas(events, "content") == chat(plain, THOUGHT, **extra).json()["choices"][0][
        "message"]["content"]


def test_a_prompt_that_opens_the_block(tmp_path_factory):
    app = _templated(tmp_path_factory, "opening.gguf", OPENING, parallel=1)
    try:
        reply = "Think it through.\n</think>\n\nDone."
        message = chat(app, reply).json()["choices"][0]["message"]
        assert message["reasoning_content"] == "Think it through." and message["content"] == "Done."
        events = streamed(chat(app, reply, stream=True))
        assert deltas(events, "reasoning_content") == "Think it through."
        assert deltas(events, "content") == "Done."
    finally:
        app.close()


def test_chat_template_kwargs_reach_the_template(tmp_path_factory):
    app = _templated(tmp_path_factory, "qwen3-like.gguf", QWEN3_LIKE, parallel=1)
    try:
        tok = app.llm.tokenizer
        usage = [chat(app, "ok", chat_template_kwargs=kw).json()["usage"]["prompt_tokens"]
                 for kw in (None, {"enable_thinking": True}, {"enable_thinking": False})]
        assert usage[0] == usage[1]
        assert usage[2] - usage[0] == len(tok.encode("<think>\n\n</think>\n\n"))
        app.llm.chat.template_kwargs = {"enable_thinking": False}   # serve's default
        try:
            assert chat(app, "ok").json()["usage"]["prompt_tokens"] == usage[2]
            assert chat(app, "ok", chat_template_kwargs={"enable_thinking": True}
                        ).json()["usage"]["prompt_tokens"] == usage[0]   # the request wins
        finally:
            app.llm.chat.template_kwargs = None
        for bad in ("enable_thinking", ["x"], {"messages": []}, {"a": [[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]},
                    {"enable_thinking": "false"}, {"enable_thinking": None}):
            r = chat(app, "ok", chat_template_kwargs=bad)
            assert r.status == 400 and r.error()["param"] == "chat_template_kwargs", bad
        assert not app.log.records
    finally:
        app.close()


def test_tool_calls_are_read_from_the_content(tmp_path_factory):
    app = _templated(tmp_path_factory, "tools.gguf", LLAMA32_TEMPLATE, parallel=1)
    try:
        call = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
        reply = f"<think>\nThe user wants the weather.\n</think>\n\n{call}"
        choice = chat(app, reply, tools=[WEATHER]).json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        message = choice["message"]
        assert message["content"] is None
        assert message["reasoning_content"] == "The user wants the weather."
        (c,) = message["tool_calls"]
        assert c["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
        events = streamed(chat(app, reply, tools=[WEATHER], stream=True))
        assert deltas(events, "reasoning_content") == "The user wants the weather."
        assert deltas(events, "content") == ""
        calls = [d for e in events for d in e["choices"][0]["delta"].get("tool_calls") or []]
        assert calls[0]["function"]["name"] == "get_weather"
        assert "".join(d["function"].get("arguments", "") for d in calls) == '{"city": "Oslo"}'
        assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    finally:
        app.close()
