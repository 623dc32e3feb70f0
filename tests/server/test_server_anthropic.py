"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) as its clients use
it: the official `anthropic` package against the app served by uvicorn on a free local
port, raw ASGI requests (tests/server_asgi.py) for what the client would not send.

The tiny random F32 model of tests/server/test_server.py with Llama 3.2's chat template
(it shows tools): greedy replies are reproducible, so an Anthropic reply is checked
against the OpenAI endpoint's for the same conversation (one request path), and a forced
tool call is the grammar's doing (a random model writes no JSON by chance).
"""
from __future__ import annotations

import asyncio
import json
import random
from types import SimpleNamespace

import pytest

from edgellama.reasoning import ReasoningSplitter
from edgellama.server.anthropic import Messages, _content, _messages
from edgellama.server.params import MAX_BODY_DEPTH
from edgellama.tool_calls import ToolCallStream
from server_asgi import ServerUnderTest, served_over_http
from test_chat_template import LLAMA32_TEMPLATE
from tiny_gguf import CHATML, TINY_VOCAB, write_tiny_gguf

anthropic = pytest.importorskip("anthropic")
jsonschema = pytest.importorskip("jsonschema")

MODEL = "tiny-tools"
KEY = "test-key-123"
# The client (anthropic 2.x) has no sampling arguments any more; the API, llama-server's and
# this one still take temperature, top_p and top_k, sent here as extra fields.
GREEDY = {"temperature": 0}
USER = [{"role": "user", "content": "hi"}]
WEATHER = {"name": "get_weather", "description": "The weather in a city now",
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 12},
               "unit": {"enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"], "additionalProperties": False}}
TIME = {"name": "get_time", "description": "The time in a time zone",
        "input_schema": {"type": "object", "properties": {"zone": {"type": "string",
                                                                   "maxLength": 8}},
                         "required": ["zone"], "additionalProperties": False}}


def _model(tmp_path_factory, name: str, template: str) -> ServerUnderTest:
    path = write_tiny_gguf(tmp_path_factory.mktemp("anthropic") / name, "F32", vocab=TINY_VOCAB,
                           ctx=4096, tokenizer=True, tied=False, seed=4, chat_template=template)
    return ServerUnderTest(path, ctx=4096)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    app = _model(tmp_path_factory, f"{MODEL}.gguf", LLAMA32_TEMPLATE)
    yield app
    app.close()


@pytest.fixture(scope="module")
def client(tiny):
    """The official client against `tiny`'s app, served by uvicorn on a free port."""
    with served_over_http(tiny.app) as origin:
        yield anthropic.Anthropic(base_url=origin, api_key="none", max_retries=0, timeout=60)


def ask(client, content="hello there", **kw):
    return client.messages.create(**{"model": MODEL, "max_tokens": 24, "extra_body": GREEDY,
                                     "messages": [{"role": "user", "content": content}], **kw})


def openai_chat(app, messages, **kw) -> dict:
    r = app.request("POST", "/v1/chat/completions",
                    {"messages": messages, "temperature": 0, "max_tokens": 24, **kw}, timeout=60)
    assert r.status == 200, r.body
    return r.json()


def sse(body: bytes) -> list[tuple[str, dict]]:
    """A stream's events: (the event: line's name, the data)."""
    out = []
    for chunk in body.decode().split("\n\n"):
        if chunk.strip():
            lines = dict(line.split(": ", 1) for line in chunk.split("\n"))
            out.append((lines["event"], json.loads(lines["data"])))
    return out


# -- replies, against the OpenAI endpoint's -------------------------------------------------------

def test_plain_text_is_the_openai_endpoints_reply(client, tiny):
    r = ask(client)
    want = openai_chat(tiny, [{"role": "user", "content": "hello there"}])
    choice = want["choices"][0]
    assert r.type == "message" and r.role == "assistant" and r.model == MODEL
    assert r.id.startswith("msg_")
    assert [b.type for b in r.content] == ["text"]
    assert r.content[0].text == choice["message"]["content"] and r.content[0].text
    assert r.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[choice["finish_reason"]]
    assert r.stop_sequence is None
    assert (r.usage.input_tokens, r.usage.output_tokens) == \
        (want["usage"]["prompt_tokens"], want["usage"]["completion_tokens"])


def test_streamed_text_is_the_whole_reply(client, tiny):
    whole = ask(client, "Tell me more.", max_tokens=40)
    with client.messages.stream(model=MODEL, max_tokens=40, extra_body=GREEDY,
                                messages=[{"role": "user", "content": "Tell me more."}]) as s:
        pieces = list(s.text_stream)
        final = s.get_final_message()
    assert len(pieces) > 3 and "".join(pieces) == whole.content[0].text
    assert final.model_dump(exclude={"id"}) == whole.model_dump(exclude={"id"})
    # the wire: each event named in an event: line and in its type, in Anthropic's order
    r = tiny.request("POST", "/v1/messages", {
        "model": MODEL, "max_tokens": 40, "temperature": 0, "stream": True,
        "messages": [{"role": "user", "content": "Tell me more."}]}, timeout=60)
    assert r.status == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse(r.body)
    assert all(name == data["type"] for name, data in events)
    names = [name for name, _ in events]
    assert names[:4] == ["message_start", "ping", "content_block_start", "content_block_delta"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"] == {"input_tokens": whole.usage.input_tokens, "output_tokens": 0}
    assert events[-2][1] == {"type": "message_delta", "delta": {
        "stop_reason": whole.stop_reason, "stop_sequence": None},
        "usage": {"output_tokens": whole.usage.output_tokens}}


def test_system_prompt_string_or_blocks(client, tiny):
    system = "You answer in one word."
    messages = [{"role": "user", "content": "hello there"}]
    want = openai_chat(tiny, [{"role": "system", "content": system}, *messages])
    for given in (system, [{"type": "text", "text": "You answer"},
                           {"type": "text", "text": "in one word.", "cache_control": {
                               "type": "ephemeral"}}]):
        r = ask(client, system=given)
        if isinstance(given, list):   # blocks are a line apart
            want = openai_chat(tiny, [{"role": "system", "content": "You answer\nin one word."},
                                      *messages])
        assert r.content[0].text == want["choices"][0]["message"]["content"]
        assert r.usage.input_tokens == want["usage"]["prompt_tokens"]
        assert client.messages.count_tokens(model=MODEL, system=given,
                                            messages=messages).input_tokens == \
            want["usage"]["prompt_tokens"]
    assert ask(client).usage.input_tokens < want["usage"]["prompt_tokens"]


def test_stop_sequences(client):
    text = ask(client, "Tell me more.", max_tokens=40).content[0].text
    stop = text[12:15]
    cut = text.index(stop)
    assert cut > 0
    for stream in (False, True):
        kw = dict(model=MODEL, max_tokens=40, extra_body=GREEDY, stop_sequences=["\x00zq", stop],
                  messages=[{"role": "user", "content": "Tell me more."}])
        if stream:
            with client.messages.stream(**kw) as s:
                r = s.get_final_message()
        else:
            r = client.messages.create(**kw)
        assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", stop)
        assert r.content[0].text == text[:cut]


def test_max_tokens_stop_reason(client):
    r = ask(client, max_tokens=2)
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 2


def test_count_tokens_is_the_prompt(client, tiny):
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    n = client.messages.count_tokens(model=MODEL, messages=messages, tools=[WEATHER]).input_tokens
    tools = [{"type": "function", "function": {"name": WEATHER["name"], "description":
                                               WEATHER["description"],
                                               "parameters": WEATHER["input_schema"]}}]
    assert n == len(tiny.llm.chat.encode_messages(messages, tools=tools))
    assert n > client.messages.count_tokens(model=MODEL, messages=messages).input_tokens
    r = client.messages.create(model=MODEL, max_tokens=4, messages=messages, tools=[WEATHER])
    assert r.usage.input_tokens == n


# -- tools --------------------------------------------------------------------------------------

def test_tool_use_round_trip(client, tiny):
    """A forced call (tool_choice tool), the same streamed; then the call and its result
    sent back, which the template renders as the OpenAI endpoint's tool messages."""
    question = [{"role": "user", "content": "What is the weather in Oslo?"}]
    kw = dict(model=MODEL, max_tokens=120, extra_body=GREEDY, tools=[WEATHER, TIME],
              tool_choice={"type": "tool", "name": "get_weather"}, messages=question)
    r = client.messages.create(**kw)
    assert r.stop_reason == "tool_use" and r.stop_sequence is None
    (call,) = r.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.id
    jsonschema.validate(call.input, WEATHER["input_schema"])
    with client.messages.stream(**kw) as s:
        parts = [e.partial_json for e in s if e.type == "input_json"]
        final = s.get_final_message()
    assert final.stop_reason == "tool_use" and len(parts) > 1
    assert [(b.type, b.name, b.input) for b in final.content] == \
        [("tool_use", "get_weather", call.input)]
    assert json.loads("".join(parts)) == call.input

    messages = question + [
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                          call.model_dump(exclude={"caller"}, exclude_none=True)]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": [{"type": "text", "text": "12 degrees"}]},
                                     {"type": "text", "text": "And tomorrow?"}]}]
    assert _messages({"messages": messages}) == [
        question[0],
        {"role": "assistant", "content": "Let me look.", "tool_calls": [{
            "id": call.id, "type": "function",
            "function": {"name": "get_weather", "arguments": call.input}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "12 degrees"},
        {"role": "user", "content": "And tomorrow?"}]
    assert _messages({"messages": [{"role": "user", "content": [   # content may be left out
        {"type": "tool_result", "tool_use_id": "x", "is_error": True}]}]}) == \
        [{"role": "tool", "tool_call_id": "x", "content": ""}]
    answer = client.messages.create(model=MODEL, max_tokens=24, extra_body=GREEDY,
                                    tools=[WEATHER, TIME], messages=messages)
    want = openai_chat(tiny, [
        question[0],
        {"role": "assistant", "content": "Let me look.", "tool_calls": [{
            "id": call.id, "type": "function", "function": {
                "name": "get_weather", "arguments": json.dumps(call.input)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "12 degrees"},
        {"role": "user", "content": "And tomorrow?"}],
        tools=[{"type": "function", "function": {"name": t["name"], "description":
                                                 t["description"],
                                                 "parameters": t["input_schema"]}}
               for t in (WEATHER, TIME)])
    assert answer.usage.input_tokens == want["usage"]["prompt_tokens"]
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert [b.text for b in answer.content] == [want["choices"][0]["message"]["content"]]


def test_tool_choice_any_and_none(client):
    r = client.messages.create(model=MODEL, max_tokens=120, extra_body=GREEDY, tools=[WEATHER, TIME],
                               tool_choice={"type": "any", "disable_parallel_tool_use": True},
                               messages=[{"role": "user", "content": "Time in Oslo?"}])
    assert r.stop_reason == "tool_use" and len(r.content) == 1
    tool = {"get_weather": WEATHER, "get_time": TIME}[r.content[0].name]
    jsonschema.validate(r.content[0].input, tool["input_schema"])
    r = client.messages.create(model=MODEL, max_tokens=8, extra_body=GREEDY, tools=[WEATHER],
                               tool_choice={"type": "none"},
                               messages=[{"role": "user", "content": "hello there"}])
    assert [b.type for b in r.content] == ["text"] and r.stop_reason != "tool_use"


# -- the stream against the whole reply, on chosen texts ---------------------------------------

REPLIES = [   # (reply, the prompt opened <think>, tools offered, the blocks it makes)
    ("Hello, world.", False, False, ["text"]),
    ("<think>\nThe user greets.\n</think>\n\nHello!", False, False, ["thinking", "text"]),
    ("The user greets.\n</think>\n\nHello!", True, False, ["thinking", "text"]),
    ("cut off while reasoning", True, False, ["thinking"]),
    ('{"name": "get_time", "parameters": {"zone": "CET"}}', False, True, ["tool_use"]),
    ('<think>\nA zone.\n</think>\n\n<tool_call>\n{"name": "get_time", "arguments": '
     '{"zone": "CET"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": '
     '{"city": "Oslo", "unit": "celsius"}}\n</tool_call>', False, True,
     ["thinking", "tool_use", "tool_use"]),
    ('[get_time(zone="CET")]', False, True, ["tool_use"]),
    ("{not a call", False, True, ["text"]),
    ("Hi <think> late", False, True, ["text"]),
]


def _translate_stream(pieces: list[str], opened: bool, tools: bool) -> list[tuple[str, dict]]:
    """Messages._stream's events for a job whose reply arrives in `pieces`."""
    async def run():
        job = SimpleNamespace(ids=[1, 2, 3], events=asyncio.Queue(),
                              matcher=SimpleNamespace(hit=None))
        for p in pieces:
            job.events.put_nowait(("text", p, []))
        job.events.put_nowait(("done", "stop", {"completion_tokens": len(pieces)}))
        server = SimpleNamespace(engine=SimpleNamespace(cancel=lambda job: None))
        reader = ToolCallStream({"get_time", "get_weather"}) if tools else None
        watcher = SimpleNamespace(cancel=lambda: None)
        return [e async for e in Messages(server)._stream(
            job, watcher, {"id": "msg_1"}, ReasoningSplitter(opened), reader)]
    return sse("".join(asyncio.run(run())).encode())


@pytest.mark.parametrize("text, opened, tools, kinds", REPLIES)
def test_streamed_blocks_are_the_whole_replys(text, opened, tools, kinds):
    """The stream's blocks, as the anthropic client accumulates them, are the whole
    reply's (text cut into pieces anywhere): thinking, text, tool_use."""
    from anthropic.lib.streaming._messages import accumulate_event
    reader = ToolCallStream({"get_time", "get_weather"}) if tools else None
    whole, calls = _content(text, ReasoningSplitter(opened), reader)
    rng = random.Random(7)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(8, len(text) - 1))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        events = _translate_stream(pieces, opened, tools)
        snapshot, bufs = None, {}
        for _, data in events:
            if data["type"] != "ping":
                snapshot = accumulate_event(event=data, current_snapshot=snapshot,
                                            json_bufs=bufs)
        got = [b.model_dump(exclude_none=True) for b in snapshot.content]
        ids = {b["id"] for b in got if b["type"] == "tool_use"}
        assert len(ids) == sum(b["type"] == "tool_use" for b in got)
        strip = [{k: v for k, v in b.items() if k != "id"} for b in got]
        assert strip == [{k: v for k, v in b.items() if k != "id"} for b in whole], pieces
        assert snapshot.stop_reason == ("tool_use" if calls else "end_turn")
        indexes = [d["index"] for _, d in events if "index" in d]
        assert indexes == sorted(indexes)   # one block at a time
    assert [b["type"] for b in whole] == kinds and calls == ("tool_use" in kinds)


def test_a_call_cut_short_streams_as_an_unfinished_tool_use():
    """A reply announced as a call (its name read) that then ends (max_tokens) is text as a
    whole but was streamed as a tool_use block: its stop_reason is not tool_use (as an
    OpenAI stream's finish_reason is then not tool_calls)."""
    text = '{"name": "get_time", "parameters": {"zone": "CE'
    assert _content(text, ReasoningSplitter(), ToolCallStream({"get_time"})) == \
        ([{"type": "text", "text": text}], False)
    events = _translate_stream([text[:30], text[30:]], False, True)
    starts = [d["content_block"] for _, d in events if d["type"] == "content_block_start"]
    assert [(b["type"], b["name"]) for b in starts] == [("tool_use", "get_time")]
    assert events[-2][1]["delta"]["stop_reason"] == "end_turn"


# A thinking template: the prompt opens <think> for the reply, or (enable_thinking false, as
# Qwen 3's template) fills an empty block so the reply is the answer.
THINKING = CHATML.replace("'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n' + ("
                          "'<think>\\n\\n</think>\\n\\n' if enable_thinking is defined and "
                          "not enable_thinking else '<think>\\n')")


def test_an_opened_think_block_is_a_thinking_block(tmp_path_factory):
    """The prompt ends inside <think>: the reply (a random model never closes it) is all
    thinking, whole and streamed; with thinking disabled it is text; with the server's
    --reasoning-format none it is text too."""
    assert THINKING != CHATML
    app = _model(tmp_path_factory, "think.gguf", THINKING)
    plain = ServerUnderTest(app.model, {"reasoning_format": "none"}, ctx=4096)
    try:
        body = {"max_tokens": 20, "temperature": 0,
                "messages": [{"role": "user", "content": "hello there"}]}
        r = app.request("POST", "/v1/messages", body, timeout=60)
        assert r.status == 200, r.body
        (block,) = r.json()["content"]
        assert block["type"] == "thinking" and block["thinking"] and block["signature"] == ""
        events = sse(app.request("POST", "/v1/messages", {**body, "stream": True},
                                 timeout=60).body)
        assert "".join(d["delta"]["thinking"] for _, d in events
                       if d["type"] == "content_block_delta") == block["thinking"]
        assert [d["content_block"]["type"] for _, d in events
                if d["type"] == "content_block_start"] == ["thinking"]
        r = plain.request("POST", "/v1/messages", body, timeout=60)
        assert r.json()["content"] == [{"type": "text", "text": block["thinking"]}]

        off = {**body, "thinking": {"type": "disabled"}}
        r = app.request("POST", "/v1/messages", off, timeout=60)
        assert [b["type"] for b in r.json()["content"]] == ["text"]
        ids = app.llm.chat.encode_messages(body["messages"],
                                           chat_template_kwargs={"enable_thinking": False})
        assert r.json()["usage"]["input_tokens"] == len(ids)
        r = app.request("POST", "/v1/messages/count_tokens", {
            **off, "thinking": {"type": "enabled", "budget_tokens": 2048}})
        assert r.json()["input_tokens"] == len(app.llm.chat.encode_messages(body["messages"]))
    finally:
        plain.close()
        app.close()


def test_output_config_format_is_followed(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                               "age": {"type": "integer", "minimum": 0,
                                                       "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client.messages.create(model=MODEL, max_tokens=80, messages=USER,
                               output_config={"format": {"type": "json_schema",
                                                         "schema": schema}})
    (block,) = r.content
    jsonschema.validate(json.loads(block.text), schema)
    assert r.stop_reason == "end_turn"


# -- errors -------------------------------------------------------------------------------------

def _deep(n: int):
    v = "x"
    for _ in range(n):
        v = [v]
    return v


BAD = [
    ({"messages": USER}, "max_tokens is required"),
    ({"max_tokens": "10", "messages": USER}, "max_tokens must be an integer"),
    ({"max_tokens": 0, "messages": USER}, "max_tokens must be at least 1"),
    ({"max_tokens": True, "messages": USER}, "max_tokens must be an integer"),
    ({"max_tokens": 10**12, "messages": USER}, "less than this model's context length"),
    ({"max_tokens": 4000, "messages": [{"role": "user", "content": "hi " * 200}]},
     "maximum context length"),
    ({"max_tokens": 8, "messages": "hi"}, "messages must be a non-empty list"),
    ({"max_tokens": 8, "messages": []}, "messages must be a non-empty list"),
    ({"max_tokens": 8, "messages": [{"role": "system", "content": "x"}]},
     'role must be "user" or "assistant"'),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": 5}]},
     "content must be a string or a list"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AAAA"}}]}]}, "image blocks are not supported"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "video"}]}]},
     'got "video"'),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "text must be a string"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]}, 'got "tool_use"'),
    ({"max_tokens": 8, "messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "a", "name": "f", "input": "{}"}]}]},
     "input must be an object"),
    ({"max_tokens": 8, "messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "a", "name": "f", "input": {"a": _deep(100)}}]}]},
     "nests more than"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "a", "content": [{"type": "image"}]}]}]},
     "image blocks are not supported"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": _deep(MAX_BODY_DEPTH + 5)}]},
     "nests more than"),
    ({"max_tokens": 8, "messages": USER, "system": 5}, "system must be a string"),
    ({"max_tokens": 8, "messages": USER, "stop_sequences": "x"}, "stop_sequences must be a list"),
    ({"max_tokens": 8, "messages": USER, "stop_sequences": [""]}, "stop_sequences takes"),
    ({"max_tokens": 8, "messages": USER, "temperature": 1.5}, "temperature must be in [0, 1]"),
    ({"max_tokens": 8, "messages": USER, "temperature": "hot"}, "temperature must be a number"),
    ({"max_tokens": 8, "messages": USER, "top_p": 0}, "top_p must be in (0, 1]"),
    ({"max_tokens": 8, "messages": USER, "top_k": -1}, "top_k must be at least 0"),
    ({"max_tokens": 8, "messages": USER, "stream": "yes"}, "stream must be true or false"),
    ({"max_tokens": 8, "messages": USER, "metadata": "x"}, "metadata must be an object"),
    ({"max_tokens": 8, "messages": USER, "thinking": {"type": "on"}}, "thinking must be"),
    ({"max_tokens": 8, "messages": USER, "thinking": {"type": "enabled", "budget_tokens": "x"}},
     "thinking.budget_tokens must be an integer"),
    ({"max_tokens": 8, "messages": USER, "thinking": {"type": "enabled", "budget_tokens": -5}},
     "thinking.budget_tokens must be at least 1"),
    ({"max_tokens": 8, "messages": [{"role": "assistant", "content": [
        {"type": "thinking", "thinking": 5}]}]}, "content[0].thinking must be a string"),
    ({"max_tokens": 8, "messages": [{"role": "assistant", "content": [
        {"type": "redacted_thinking", "data": ["x"]}]}]}, "content[0].data must be a string"),
    ({"max_tokens": 8, "messages": USER, "thinking": {"type": "disabled"},
      "chat_template_kwargs": [1]}, "chat_template_kwargs must be an object"),
    ({"max_tokens": 8, "messages": USER, "output_config": {"format": {"type": "json_schema"}}},
     "output_config.format must be"),
    ({"max_tokens": 8, "messages": USER, "output_config": {"format": {
        "type": "json_schema", "schema": {"type": "string", "minLength": 5, "maxLength": 2}}}},
     "Unsatisfiable"),
    ({"max_tokens": 8, "messages": USER, "tools": {"name": "f"}}, "tools must be a list"),
    ({"max_tokens": 8, "messages": USER, "tools": [{"name": "f"}]}, "input_schema must be"),
    ({"max_tokens": 8, "messages": USER, "tools": [{"name": "f f", "input_schema": {}}]},
     "name must be 1 to 64"),
    ({"max_tokens": 8, "messages": USER, "tools": [{"type": "bash_20250124", "name": "bash"}]},
     "Anthropic's own tools"),
    ({"max_tokens": 8, "messages": USER, "tools": [WEATHER, WEATHER]}, "two tools are named"),
    ({"max_tokens": 8, "messages": USER, "tools": [WEATHER],
      "tool_choice": {"type": "tool", "name": "nope"}}, "not in tools"),
    ({"max_tokens": 8, "messages": USER, "tool_choice": {"type": "any"}}, "needs tools"),
    ({"max_tokens": 8, "messages": USER, "tools": [WEATHER], "tool_choice": "auto"},
     "tool_choice must be"),
]


# what count_tokens does not check: generation's fields, and the output schema's grammar
# (compiled when a generation is queued)
GENERATION = ("max_tokens", "context length", "stop_sequences", "temperature", "top_p", "top_k",
              "stream", "Unsatisfiable")


@pytest.mark.parametrize("body, message", BAD, ids=range(len(BAD)))
def test_bad_requests_are_anthropic_errors(tiny, body, message):
    counts = not any(name in message for name in GENERATION)
    for path in ("/v1/messages",) + (("/v1/messages/count_tokens",) if counts else ()):
        r = tiny.request("POST", path, body, timeout=60)
        assert r.status == 400, (path, r.body)
        got = r.json()
        assert set(got) == {"type", "error"} and got["type"] == "error"
        assert got["error"]["type"] == "invalid_request_error"
        assert message in got["error"]["message"], got
        assert "\n" not in got["error"]["message"]
        assert r.raised is None and not tiny.log.records


def test_body_and_model_errors_are_anthropic_errors(tiny, client):
    cases = [(tiny.request("POST", "/v1/messages", "{not json",
                           {"content-type": "application/json"}), 400, "invalid_request_error"),
             (tiny.request("POST", "/v1/messages", "{}", {"content-type": "text/plain"}), 415,
              "invalid_request_error"),
             (tiny.request("POST", "/v1/messages", [1]), 400, "invalid_request_error"),
             (tiny.request("POST", "/v1/messages", {"model": "claude-x", "max_tokens": 8,
                                                    "messages": USER}), 404, "not_found_error")]
    cases += [(tiny.request("GET", "/v1/messages"), 405, "invalid_request_error"),
              (tiny.request("POST", "/v1/messages/batches", {}), 404, "not_found_error"),
              (tiny.request("POST", "/v1/messages", {"messages": USER}, host="evil.example"),
               403, "permission_error")]
    for r, status, kind in cases:
        assert r.status == status and r.json()["type"] == "error", r.body
        assert r.json()["error"]["type"] == kind and "\n" not in r.json()["error"]["message"]
    r = tiny.request("GET", "/v1/chat/completions")   # OpenAI's paths keep OpenAI's shape
    assert r.status == 405 and r.json()["error"]["type"] == "invalid_request_error"
    assert "type" not in r.json()
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}])
    assert e.value.status_code == 400 and "image" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-x", max_tokens=8, messages=USER)
    assert ask(client, max_tokens=2).stop_reason == "max_tokens"   # still serving


def test_api_key_as_x_api_key_or_bearer(tmp_path_factory):
    path = write_tiny_gguf(tmp_path_factory.mktemp("key") / "k.gguf", "F32", vocab=TINY_VOCAB,
                           ctx=256, tokenizer=True, tied=False, seed=4)
    app = ServerUnderTest(path, {"api_key": KEY})
    try:
        body = {"messages": USER}
        count = "/v1/messages/count_tokens"
        for headers in ({"x-api-key": KEY}, {"authorization": f"Bearer {KEY}"}):
            r = app.request("POST", count, body, {"content-type": "application/json",
                                                  "anthropic-version": "2023-06-01", **headers})
            assert r.status == 200 and r.json()["input_tokens"] > 0, r.body
        for headers in ({}, {"x-api-key": "wrong"}, {"authorization": f"Basic {KEY}"}):
            r = app.request("POST", count, body, {"content-type": "application/json", **headers})
            assert r.status == 401 and r.json()["type"] == "error"
            assert r.json()["error"]["type"] == "authentication_error"
        r = app.request("POST", "/v1/chat/completions", {"messages": USER, "max_tokens": 2},
                        {"content-type": "application/json", "x-api-key": KEY})
        assert r.status == 200   # the OpenAI endpoints take it too
        r = app.request("GET", "/v1/models")
        assert r.status == 401 and r.json()["error"]["code"] == "invalid_api_key"
    finally:
        app.close()
