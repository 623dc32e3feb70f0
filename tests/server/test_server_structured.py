"""`serve` as the backend of other programs: replies constrained to a JSON schema or a
grammar, logprobs, tool calls; bad schemas, tool lists and grammars refused with a 400.

Most requests go to a tiny random model (tests/server_asgi.py, in this process): a random
model never writes JSON by chance, so a reply that parses and validates is the grammar's
doing. The official `openai` client and langchain-openai talk to the same app served by
uvicorn on a free local port.
"""
from __future__ import annotations

import asyncio
import json
import re
import time

import numpy as np
import pytest

from edgellama.constrain import Constraint, gbnf_grammar, json_object_grammar, json_schema_grammar
from edgellama.errors import EdgeError
from edgellama.gguf import GGUFFile
from edgellama.perplexity import log_softmax
from edgellama.server.app import _one_call_per_message
from edgellama.server.params import _messages
from edgellama.tokenizer import Tokenizer
from edgellama.tool_calls import ToolCall, ToolCallStream, parse_tool_calls, tool_call_schema
from server_asgi import ServerUnderTest, served_over_http
from test_chat_template import LLAMA32_TEMPLATE
from tiny_gguf import TINY_VOCAB, write_tiny_gguf

jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
                   "required": ["zone"], "additionalProperties": False}}}

# Schemas whose every valid reply is short (bounded strings, numbers, arrays), so a random
# model reaches the end well within max_tokens.
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 4},
    {"enum": ["red", "green", "blue", 7, None]},
    {"type": "object", "properties": {
        "point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9,
                                                         "maximum": 9},
                                                   "y": {"type": "integer", "minimum": -9,
                                                         "maximum": 9}},
                  "required": ["x", "y"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,4}$"},
                 "maxItems": 3},
        "ok": {"type": "boolean"}},
     "required": ["point", "tags", "ok"], "additionalProperties": False},
    {"anyOf": [{"type": "string", "format": "date"}, {"type": "null"}]},
    {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
]


def _tiny_server(tmp_path_factory, name: str, chat_template: str) -> ServerUnderTest:
    path = write_tiny_gguf(tmp_path_factory.mktemp("structured") / name, "F32",
                           vocab=TINY_VOCAB, ctx=4096, tokenizer=True, tied=False, seed=4,
                           chat_template=chat_template)
    return ServerUnderTest(path, ctx=4096)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny F32 model with Llama 3.2's chat template (tool calling)."""
    app = _tiny_server(tmp_path_factory, "tiny-tools.gguf", LLAMA32_TEMPLATE)
    yield app
    app.close()


# Llama 3.2's template changed to show several calls in one assistant message, as a list
# (the original refuses them): forced calls may then be a list.
LLAMA32_SEVERAL_CALLS = LLAMA32_TEMPLATE.replace("""        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}""", """        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n[' -}}
        {%- for call in message.tool_calls %}
            {{- '{"name": "' + call.function.name + '", "parameters": ' }}
            {{- call.function.arguments | tojson + '}' + ('' if loop.last else ', ') }}
        {%- endfor %}
        {{- ']' }}""")


@pytest.fixture(scope="module")
def tiny_several(tmp_path_factory):
    """The tiny model with LLAMA32_SEVERAL_CALLS."""
    assert LLAMA32_SEVERAL_CALLS != LLAMA32_TEMPLATE
    app = _tiny_server(tmp_path_factory, "tiny-several.gguf", LLAMA32_SEVERAL_CALLS)
    yield app
    app.close()


@pytest.fixture(scope="module")
def tiny_chatml(tmp_path_factory):
    """The tiny model with a ChatML template, which shows the model no tools."""
    path = write_tiny_gguf(tmp_path_factory.mktemp("structured") / "tiny-chatml.gguf", "F32",
                           vocab=TINY_VOCAB, ctx=256, tokenizer=True, tied=False, seed=4)
    app = ServerUnderTest(path)
    yield app
    app.close()


@pytest.fixture(scope="module")
def smol_tokenizer(smollm2_gguf) -> Tokenizer:
    return Tokenizer.from_metadata(GGUFFile(smollm2_gguf).metadata)


def chat(app, content="Say something.", **kw):
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 120, **kw}
    return app.request("POST", "/v1/chat/completions", body, timeout=120)


def events(reply) -> list[dict]:
    lines = [ln[6:] for ln in reply.body.decode().split("\n") if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


# -- the grammar engine on a real vocabulary ----------------------------------------------------

def test_constraint_walks_a_valid_reply_through_tokens_that_span_symbols(smol_tokenizer):
    tok = smol_tokenizer
    c = Constraint(tok, json_schema_grammar(SCHEMAS[3]))
    text = '{"point": {"x": -3, "y": 4}, "tags": ["ab", "c"], "ok": true}'
    ids = tok.encode(text)
    spanning = [i for i in ids if len(tok.token_bytes(i)) > 1
                and set(tok.token_bytes(i)) & set(b'{}[]":,')]
    assert spanning, "the reply must have tokens that span JSON symbols"
    for i in ids:
        logits = np.zeros(tok.vocab_size + 3, np.float32)   # a padded output row too
        c.mask(logits)
        assert np.isfinite(logits[i]), tok.token_bytes(i)
        assert np.isneginf(logits[tok.vocab_size:]).all()
        c.advance(i)
    assert c.complete
    allowed = np.flatnonzero(c.allowed())
    assert set(allowed) <= set(tok.stop_ids) and allowed.size   # only the end can follow


def test_json_object_grammar_takes_any_object_and_only_objects(smol_tokenizer):
    tok = smol_tokenizer
    c = Constraint(tok, json_object_grammar())
    assert not c.allowed()[tok.encode("[")[0]] and not c.allowed()[tok.encode('"')[0]]
    for i in tok.encode('{"a": [1, {"b": null}], "c": "d\\n"}'):
        assert c.allowed()[i], tok.token_bytes(i)
        c.advance(i)
    assert c.complete


def test_constraint_forbids_what_the_schema_does_not_allow(smol_tokenizer):
    tok = smol_tokenizer
    c = Constraint(tok, json_schema_grammar(SCHEMAS[0]))
    allowed = c.allowed()
    for text in ("[", " {", "}", "hello", '{"'):
        first = tok.encode(text)[0]
        assert allowed[first] == (text == '{"'), text
    # no control token is ever allowed inside the reply
    control = [i for t, i in tok.special_tokens.items() if i not in tok.stop_ids]
    assert control and not allowed[control].any()


@pytest.mark.parametrize("make, message", [
    (lambda: json_schema_grammar({"type": "string", "minLength": 5, "maxLength": 2}),
     "Unsatisfiable"),
    (lambda: json_schema_grammar({"type": "flurb"}), "cannot compile"),
    (lambda: json_schema_grammar({"type": "string", "pattern": "(("}), "regex"),
    (lambda: gbnf_grammar('root ::= root "a"'), "matches nothing"),
    (lambda: gbnf_grammar("root ::= ("), "cannot read this GBNF grammar"),
])
def test_bad_grammars_fail_with_one_clear_message(smol_tokenizer, make, message):
    with pytest.raises(EdgeError, match=message) as e:
        Constraint(smol_tokenizer, make())
    assert "\n" not in str(e.value)


# -- tool call parsing --------------------------------------------------------------------------

def test_tool_calls_parse_json_and_pythonic_forms():
    names = {"get_weather", "get_time"}
    want = [ToolCall("get_weather", {"city": "Paris", "unit": "celsius"})]
    for text in ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
                 ' <|python_tag|>{"name": "get_weather", "arguments": {"city": "Paris", '
                 '"unit": "celsius"}}\n',
                 '{"type": "function", "name": "get_weather", "parameters": '
                 '"{\\"city\\": \\"Paris\\", \\"unit\\": \\"celsius\\"}"}',
                 '[get_weather(city="Paris", unit=\'celsius\')]',
                 # Qwen 2.5 / 3 (Hermes): tags around JSON, after Qwen 3's reasoning
                 '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
                 '"unit": "celsius"}}\n</tool_call>',
                 '<think>\nThe user wants <b>Paris</b>: </thin\n</think>\n\n<tool_call>\n'
                 '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
                 '</tool_call>\n'):
        assert parse_tool_calls(text, names) == want, text
    two = parse_tool_calls('[get_weather(city="Oslo", unit="celsius"), get_time(zone="CET")]',
                           names)
    assert [c.name for c in two] == ["get_weather", "get_time"]
    assert two[1].arguments == {"zone": "CET"}
    assert [c.name for c in parse_tool_calls(
        '{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {}}',
        names)] == ["get_time", "get_weather"]
    nested = parse_tool_calls('[get_time(zone={"a": [1, 2.5, None, True]})]', names)
    assert nested[0].arguments == {"zone": {"a": [1, 2.5, None, True]}}


@pytest.mark.parametrize("text", [
    "The weather in Paris is sunny.",
    '{"name": "delete_everything", "parameters": {}}',           # not an offered tool
    '{"name": "get_time", "parameters": {}, "extra": 1}',
    "[get_time(zone=__import__('os').system('touch /tmp/pwned'))]",   # never evaluated
    "[get_time(zone=open('/etc/passwd').read())]",
    "[get_time(*args)]", "[get_time('CET')]", "[os.system('x')]", "[]", "[1, 2]",
    '{"name": "get_time", "parameters": [1]}', "[get_time(zone={1, 2})]",
    "[" * 100_000,
    "<think>\nEasy.\n</think>\n\nIt is sunny.", "<think>\nunfinished", "<b>bold</b> text",
    '<tool_call>\n{"name": "get_time", "arguments": {}}',                    # not closed
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\nDone.',
    '<tool_call>\n{"name": "delete_everything", "arguments": {}}\n</tool_call>',
])
def test_text_that_is_not_a_call_stays_text(text):
    assert parse_tool_calls(text, {"get_weather", "get_time"}) is None


# Replies that are calls, in every form the reader takes; the JSON form's arguments are the
# model's own text (an escape, a number's spelling, its spaces), the pythonic form's are
# JSON written by the reader.
CALL_TEXTS = [
    ('{"name": "get_weather", "parameters": {"city": "Z\\u00fcrich",  "unit": "celsius"}}',
     ['{"city": "Z\\u00fcrich",  "unit": "celsius"}']),
    ('<|python_tag|>{"parameters": {"zone": "CET", "n": 1E2}, "name": "get_time"}\n',
     ['{"zone": "CET", "n": 1E2}']),
    ('{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}', ['{"zone": "UTC"}']),
    ('[get_weather(city="Oslo", unit=\'celsius\'), get_time(zone=("a", None, True))]',
     ['{"city": "Oslo", "unit": "celsius"}', '{"zone": ["a", null, true]}']),
    ('[{"name": "get_time", "parameters": {}}, {"name": "get_time", "parameters": {"zone": ""}}]',
     ['{}', '{"zone": ""}']),
    ('{"name": "get_time", "parameters": {"zone": "A"}};\n{"name": "get_time", "parameters": {}}',
     ['{"zone": "A"}', '{}']),
    ("[get_time()]", ["{}"]),
    ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
     ['{"zone": "CET"}', '{"city": "Oslo"}']),
]


def _read_in_pieces(text: str, sizes, names=("get_weather", "get_time"), parallel=True):
    """The deltas a ToolCallStream reports for `text` pushed in pieces of `sizes` (cycled),
    each with how much of the text had been pushed; and the final calls."""
    reader, deltas, at, k = ToolCallStream(set(names), parallel), [], 0, 0
    while at < len(text):
        piece = text[at:at + sizes[k % len(sizes)]]
        at, k = at + len(piece), k + 1
        deltas += [(d, at) for d in reader.push(piece)]
    return deltas, reader.finish()


@pytest.mark.parametrize("text, arguments", CALL_TEXTS)
def test_streamed_call_fragments_join_to_the_arguments(text, arguments):
    whole = parse_tool_calls(text, {"get_weather", "get_time"})
    assert [c.arguments_text for c in whole] == arguments
    assert [c.arguments for c in whole] == [json.loads(a) for a in arguments]
    for sizes in ([1], [3, 1, 7], [len(text)]):
        deltas, calls = _read_in_pieces(text, sizes)
        assert [c.arguments_text for c in calls] == arguments and calls == whole
        for i, call in enumerate(calls):
            mine = [d for d, _ in deltas if d["index"] == i]
            assert mine[0] == {"index": i, "id": call.id, "type": "function",
                               "function": {"name": call.name, "arguments": ""}}
            assert all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
                       for d in mine[1:])
            assert "".join(d["function"]["arguments"] for d in mine) == call.arguments_text
        assert len({c.id for c in calls}) == len(calls)


def test_calls_are_announced_as_soon_as_their_name_is_read():
    text = '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}'
    deltas, _ = _read_in_pieces(text, [1])
    header, *fragments = deltas
    assert header[1] == len('{"name": "get_weather",')   # the name's end is read
    # the JSON form's arguments arrive as they are generated, a character at a time
    assert len(fragments) == len('{"city": "Oslo", "unit": "celsius"}')
    text = '[get_weather(city="Oslo", unit="celsius"), get_time(zone="CET")]'
    deltas, _ = _read_in_pieces(text, [1])
    at = [(d["index"], d["function"].get("name") or d["function"]["arguments"], n)
          for d, n in deltas]
    # pythonic: each argument once its value ends; the list's second call once its "(" is read
    assert at == [(0, "get_weather", len("[get_weather(")),
                  (0, '{"city": "Oslo"', len('[get_weather(city="Oslo",')),
                  (0, ', "unit": "celsius"}', len('[get_weather(city="Oslo", unit="celsius")')),
                  (1, "get_time", len(text) - len('zone="CET")]')),
                  (1, '{"zone": "CET"}', len(text) - 1)]


def test_parallel_false_keeps_the_first_call():
    text = '[get_weather(city="Oslo", unit="celsius"), get_time(zone="CET")]'
    deltas, calls = _read_in_pieces(text, [2], parallel=False)
    assert [c.name for c in calls] == ["get_weather"] and {d["index"] for d, _ in deltas} == {0}
    assert parse_tool_calls(text, None, parallel=False) == calls


def test_text_that_is_not_a_call_is_known_early():
    for text in ("Hello there", '  "quoted"', "[1, 2]", "[get_weather city]", '{"text": 1}',
                 '{"name": "not_offered", "parameters": {}}'):
        reader = ToolCallStream({"get_weather"})
        pushed = ""
        for ch in text:
            assert reader.push(ch) == []
            pushed += ch
            if reader.is_text:
                break
        assert reader.is_text and reader.finish() is None, text
        assert len(pushed) <= len('{"name": "not_offered",'), (text, pushed)
    # a call that breaks off after it was announced: no more deltas, and not a call
    reader = ToolCallStream({"get_weather"})
    assert reader.push('{"name": "get_weather", "parameters": {"city": "Oslo"}')
    assert reader.push(' and then some') == [] and reader.finish() is None
    assert not reader.is_text   # its first deltas were sent: it does not become content


def test_forced_call_schema_allows_a_list_only_when_asked(smol_tokenizer):
    tok = smol_tokenizer
    two = ('[{"name": "get_time", "parameters": {"zone": "CET"}}, '
           '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}]')
    c = Constraint(tok, json_schema_grammar(tool_call_schema([WEATHER, TIME], several=True)))
    for i in tok.encode(two):
        assert c.allowed()[i], tok.token_bytes(i)
        c.advance(i)
    assert c.complete
    assert [x.name for x in parse_tool_calls(two, {"get_time", "get_weather"})] == \
        ["get_time", "get_weather"]
    for several, text in ((True, '{"name": "get_time", "parameters": {"zone": "CET"}}'),
                          (False, '{"name": "get_time", "parameters": {"zone": "CET"}}')):
        c = Constraint(tok, json_schema_grammar(tool_call_schema([WEATHER, TIME], several=several)))
        assert c.allowed()[tok.encode("[")[0]] == several
        for i in tok.encode(text):
            c.advance(i)
        assert c.complete


def test_tool_call_schema_forces_the_named_function():
    schema = tool_call_schema([WEATHER, TIME], "get_time")
    jsonschema.validate({"name": "get_time", "parameters": {"zone": "CET"}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "get_weather", "parameters": {"zone": "CET"}}, schema)


# -- response_format through the server ---------------------------------------------------------

@pytest.mark.parametrize("k", range(len(SCHEMAS)))
def test_json_schema_replies_parse_and_validate(tiny, k):
    schema = SCHEMAS[k]
    for seed in range(3):
        r = chat(tiny, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed,
                 response_format={"type": "json_schema",
                                  "json_schema": {"name": "x", "schema": schema, "strict": True}})
        assert r.status == 200, r.body
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)


def test_json_schema_streamed_and_on_completions(tiny):
    schema = SCHEMAS[0]
    r = chat(tiny, stream=True, temperature=0.9, seed=1,
             response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events(r))
    jsonschema.validate(json.loads(text), schema)
    for field in ({"json_schema": schema},
                  {"response_format": {"type": "json_object", "schema": schema}}):
        r = tiny.request("POST", "/v1/completions", {"prompt": "x", "max_tokens": 120,
                                                     "seed": 2, **field}, timeout=60)
        assert r.status == 200, r.body
        jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), schema)


def test_gbnf_grammar_field(tiny):
    r = chat(tiny, grammar='root ::= ("yes" | "no") " " [0-9] [0-9]?', seed=3, temperature=1.0)
    assert r.status == 200, r.body
    text = r.json()["choices"][0]["message"]["content"]
    assert text.split(" ")[0] in ("yes", "no") and text.split(" ")[1].isdigit(), text


def test_json_object_and_schemas_on_smollm2(smollm2_gguf):
    """The real model: json_object (unbounded: greedy with a repetition penalty, where
    this 135M model closes the object instead of nesting for ever) and the schemas at
    its own sampling, seeded."""
    app = ServerUnderTest(smollm2_gguf)
    try:
        r = chat(app, "Give me a JSON object describing a cat.", max_tokens=200, temperature=0,
                 repeat_penalty=1.1, response_format={"type": "json_object"})
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop"
        assert isinstance(json.loads(choice["message"]["content"]), dict)
        for schema in SCHEMAS:
            r = chat(app, "Answer in JSON.", max_tokens=120, seed=11, response_format={
                "type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
            jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), schema)
    finally:
        app.close()


# -- logprobs -----------------------------------------------------------------------------------

def test_logprobs_are_the_models_distribution(tiny):
    prompt = "the end of"
    r = tiny.request("POST", "/v1/completions", {"prompt": prompt, "max_tokens": 6,
                                                 "temperature": 0, "logprobs": 3}, timeout=60)
    assert r.status == 200, r.body
    lp = r.json()["choices"][0]["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert "".join(lp["tokens"]) == r.json()["choices"][0]["text"]
    assert len(lp["tokens"]) == r.json()["usage"]["completion_tokens"]
    # the first token's logprob is the log-softmax of the prompt's next-token logits
    llm = tiny.llm
    ids = llm.tokenizer.encode(prompt)
    expect = log_softmax(llm.logits(ids)[None].astype(np.float64))[0]
    first = int(np.argmax(expect))
    assert lp["tokens"][0] == llm.tokenizer.token_bytes(first).decode("utf-8", "replace")
    assert lp["token_logprobs"][0] == pytest.approx(expect[first], abs=1e-4)
    best3 = np.sort(expect)[::-1][:3]
    assert sorted(lp["top_logprobs"][0].values(), reverse=True) == pytest.approx(best3, abs=1e-4)
    for tok, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert v == pytest.approx(max(top.values()))   # greedy: the chosen one is the best
        assert sum(np.exp(list(top.values()))) <= 1 + 1e-6


def test_chat_logprobs_streamed_equal_unstreamed(tiny):
    kw = dict(temperature=0, max_tokens=12, logprobs=True, top_logprobs=2)
    whole = chat(tiny, **kw).json()["choices"][0]
    content = whole["logprobs"]["content"]
    # a token may hold part of a UTF-8 character: its bytes, joined, are the reply
    assert b"".join(bytes(e["bytes"]) for e in content).decode("utf-8", "replace") \
        == whole["message"]["content"]
    for e in content:
        assert set(e) == {"token", "logprob", "bytes", "top_logprobs"}
        assert bytes(e["bytes"]).decode("utf-8", "replace") == e["token"]
        assert len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["logprob"] == e["logprob"]
    streamed = [x for ev in events(chat(tiny, stream=True, **kw))
                for x in ((ev["choices"][0]["logprobs"] or {}).get("content") or [])]
    # the same tokens; logprobs equal to float rounding (the second request reuses the
    # first one's cache: prefill and decode round differently)
    assert [e["bytes"] for e in streamed] == [e["bytes"] for e in content]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in content],
                                                             abs=1e-5)
    assert chat(tiny, max_tokens=3).json()["choices"][0]["logprobs"] is None


def test_logprobs_under_a_grammar_show_only_allowed_tokens(tiny):
    r = chat(tiny, logprobs=True, top_logprobs=5, temperature=0,
             response_format={"type": "json_schema", "json_schema": {"name": "x",
                                                                     "schema": SCHEMAS[2]}})
    content = r.json()["choices"][0]["logprobs"]["content"]
    first = [t["token"] for t in content[0]["top_logprobs"]]
    # every alternative can begin one of the enum's values
    assert first and all(any(v.startswith(t) for v in ('"red"', '"green"', '"blue"', "7", "null"))
                         for t in first), first
    assert sum(np.exp([t["logprob"] for t in content[0]["top_logprobs"]])) == pytest.approx(1, abs=1e-3) \
        or len(first) == 5


@pytest.mark.parametrize("body, param", [
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": "yes"}, "logprobs"),
])
def test_bad_logprobs_requests(tiny, body, param):
    r = chat(tiny, **body)
    assert r.status == 400 and r.error()["param"] == param


# -- tool calls ---------------------------------------------------------------------------------

@pytest.mark.parametrize("choice", ["named", "required"])
def test_forced_tool_calls(tiny, choice):
    tool_choice = {"type": "function", "function": {"name": "get_weather"}} \
        if choice == "named" else "required"
    for seed in range(3):
        r = chat(tiny, "Weather in Oslo?", tools=[WEATHER, TIME], tool_choice=tool_choice,
                 temperature=1.0, seed=seed, max_tokens=150)
        assert r.status == 200, r.body
        c = r.json()["choices"][0]
        assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None
        (call,) = c["message"]["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("call_")
        f = call["function"]
        tool = {"get_weather": WEATHER, "get_time": TIME}[f["name"]]
        assert choice == "required" or f["name"] == "get_weather"
        jsonschema.validate(json.loads(f["arguments"]), tool["function"]["parameters"])


def _forcing(text: str) -> str:
    """A GBNF grammar whose only sentence is `text`: drives the random model into it."""
    return "root ::= " + json.dumps(text, ensure_ascii=False)


def _streamed_calls(evs: list[dict]) -> list[dict]:
    """The tool calls of a stream's chunks, per index: the first delta and the fragments."""
    calls = {}
    for e in evs:
        for d in e["choices"][0]["delta"].get("tool_calls") or [] if e["choices"] else []:
            if d["index"] not in calls:
                calls[d["index"]] = {"first": d, "fragments": []}
            else:
                calls[d["index"]]["fragments"].append(d["function"]["arguments"])
    return [calls[i] for i in range(len(calls))]


@pytest.mark.parametrize("k", [0, 3])   # JSON form, a pythonic list of two calls
def test_tool_calls_stream_as_they_are_generated(tiny, k):
    text, arguments = CALL_TEXTS[k]
    kw = dict(tools=[WEATHER, TIME], grammar=_forcing(text), max_tokens=200)
    whole = chat(tiny, **kw).json()["choices"][0]
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] is None
    calls = whole["message"]["tool_calls"]
    assert [c["function"]["arguments"] for c in calls] == arguments
    assert len({c["id"] for c in calls}) == len(calls)
    evs = events(chat(tiny, stream=True, **kw))
    assert evs[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert not any(e["choices"] and e["choices"][0]["delta"].get("content") for e in evs)
    streamed = _streamed_calls(evs)
    # as OpenAI's: the role comes with the first call, content null
    assert evs[0]["choices"][0]["delta"] == {"role": "assistant", "content": None,
                                             "tool_calls": [streamed[0]["first"]]}
    assert [s["first"]["function"] for s in streamed] == \
        [{"name": c["function"]["name"], "arguments": ""} for c in calls]
    assert [s["first"]["type"] for s in streamed] == ["function"] * len(calls)
    assert len({s["first"]["id"] for s in streamed}) == len(calls)
    assert ["".join(s["fragments"]) for s in streamed] == arguments
    # the arguments came as they were generated: the JSON form's token by token (the
    # tiny vocabulary's tokens are mostly single characters), the pythonic per argument
    if k == 0:
        assert len(streamed[0]["fragments"]) > len(arguments[0]) // 2
    else:
        assert [len(s["fragments"]) for s in streamed] == [2, 1]

    for stream in (False, True):   # parallel_tool_calls false: only the first
        r = chat(tiny, stream=stream, parallel_tool_calls=False, **kw)
        got = [s["first"]["function"]["name"] for s in _streamed_calls(events(r))] if stream \
            else [c["function"]["name"] for c in r.json()["choices"][0]["message"]["tool_calls"]]
        assert got == [calls[0]["function"]["name"]]


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory, qwen3_tokenizer_dir):
    """A tiny random Qwen 3 (q/k norms, NEOX RoPE) with Qwen 3's own chat template."""
    template = json.loads((qwen3_tokenizer_dir / "tokenizer_config.json").read_text())
    path = write_tiny_gguf(tmp_path_factory.mktemp("qwen3") / "q.gguf", "F32", arch="qwen3",
                           head_dim=32, rope_scaling=False, vocab=TINY_VOCAB, ctx=4096,
                           tokenizer=True, tied=False, seed=4,
                           chat_template=template["chat_template"])
    app = ServerUnderTest(path, ctx=4096)
    yield app
    app.close()


def test_qwen3_tool_calls_through_the_server(tiny_qwen3):
    # Qwen's tagged form, after a <think> block, becomes OpenAI tool calls, whole and streamed
    text = ('<think>\nA time zone.\n</think>\n\n<tool_call>\n{"name": "get_time", '
            '"arguments": {"zone": "CET"}}\n</tool_call>')
    kw = dict(tools=[WEATHER, TIME], grammar=_forcing(text), max_tokens=300)
    r = chat(tiny_qwen3, "Time in Paris?", **kw)
    assert r.status == 200, r.body
    whole = r.json()["choices"][0]
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] is None
    (call,) = whole["message"]["tool_calls"]
    assert call["function"] == {"name": "get_time", "arguments": '{"zone": "CET"}'}
    streamed = _streamed_calls(events(chat(tiny_qwen3, "Time in Paris?", stream=True, **kw)))
    assert "".join(streamed[0]["fragments"]) == '{"zone": "CET"}'
    plain = chat(tiny_qwen3, "Hi", max_tokens=5, temperature=0).json()["choices"][0]
    assert plain["message"]["content"] is not None


def test_forced_calls_are_a_list_only_if_the_template_shows_several(tiny, tiny_several):
    """tool_choice required: the first token may open a list of calls when the template
    shows several calls per message and parallel_tool_calls allows; else only "{"."""
    for app, parallel, several in ((tiny_several, True, True), (tiny_several, False, False),
                                   (tiny, True, False)):
        r = chat(app, tools=[WEATHER, TIME], tool_choice="required", max_tokens=1,
                 parallel_tool_calls=parallel, logprobs=True, top_logprobs=20, temperature=0)
        lp = r.json()["choices"][0]["logprobs"]["content"][0]
        first = [t["token"] for t in lp["top_logprobs"]]
        assert any(t.startswith("{") for t in first)
        assert any(t.startswith("[") for t in first) == several, (parallel, first)
    replies = [chat(tiny_several, tools=[WEATHER, TIME], tool_choice="required", seed=seed,
                    temperature=1.0, max_tokens=300).json()["choices"][0] for seed in range(4)]
    calls = [call for c in replies if c["finish_reason"] == "tool_calls"
             for call in c["message"]["tool_calls"]]
    assert calls
    for call in calls:
        tool = {"get_weather": WEATHER, "get_time": TIME}[call["function"]["name"]]
        jsonschema.validate(json.loads(call["function"]["arguments"]),
                            tool["function"]["parameters"])


def test_several_calls_are_accepted_back(tiny, tiny_several):
    """An assistant message with two calls: one list for a template that shows several,
    two consecutive assistant messages for Llama 3.2's, which refuses more than one."""
    messages = [
        {"role": "user", "content": "Weather and time in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}},
            {"id": "call_2", "type": "function", "function": {
                "name": "get_time", "arguments": '{"zone": "CET"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "10:00"}]
    for app in (tiny, tiny_several):
        r = app.request("POST", "/v1/chat/completions", {
            "messages": messages, "tools": [WEATHER, TIME], "max_tokens": 2}, timeout=60)
        assert r.status == 200, r.body
    with pytest.raises(EdgeError, match="single tool-calls"):
        tiny.llm.chat.render(_messages({"messages": messages}))
    split = tiny.llm.chat.render(_one_call_per_message(_messages({"messages": messages})),
                                 add_generation_prompt=False)
    assert split.count("<|start_header_id|>assistant") == 2
    assert '{"name": "get_time", "parameters": {"zone": "CET"}}' in split
    listed = tiny_several.llm.chat.render(_messages({"messages": messages}))
    assert '[{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}, ' \
           '{"name": "get_time", "parameters": {"zone": "CET"}}]' in listed


def test_forced_call_to_a_tool_with_its_own_refs(tiny):
    """Parameters as Pydantic writes nested models ($defs and $ref "#/$defs/..."): the
    forced call's schema keeps them resolvable."""
    place = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
             "required": ["city"], "additionalProperties": False}
    params = {"type": "object", "properties": {
        "home": {"$ref": "#/$defs/Place"},
        "trip": {"type": "array", "items": {"$ref": "#/$defs/Place"}, "maxItems": 2}},
        "required": ["home", "trip"], "additionalProperties": False, "$defs": {"Place": place}}
    tool = {"type": "function", "function": {"name": "plan", "parameters": params}}
    for seed, parallel in ((0, True), (1, False)):
        r = chat(tiny, tools=[tool, TIME], seed=seed, temperature=1.0, max_tokens=200,
                 tool_choice={"type": "function", "function": {"name": "plan"}},
                 parallel_tool_calls=parallel)
        assert r.status == 200, r.body
        (call,) = r.json()["choices"][0]["message"]["tool_calls"]
        jsonschema.validate(json.loads(call["function"]["arguments"]), params)


def test_streamed_tool_call_deltas(tiny):
    r = chat(tiny, tools=[WEATHER], tool_choice="required", stream=True, seed=5, max_tokens=150)
    evs = events(r)
    deltas = [e["choices"][0]["delta"] for e in evs if e["choices"]]
    calls = [d["tool_calls"] for d in deltas if d.get("tool_calls")]
    assert calls[0][0]["id"].startswith("call_") and calls[0][0]["function"]["name"] == "get_weather"
    args = "".join(c[0]["function"].get("arguments", "") for c in calls)
    jsonschema.validate(json.loads(args), WEATHER["function"]["parameters"])
    assert not any(d.get("content") for d in deltas)
    assert evs[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_tool_results_are_accepted_back(tiny):
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 3}'},
    ]
    r = tiny.request("POST", "/v1/chat/completions", {"messages": messages, "tools": [WEATHER],
                                                      "max_tokens": 4}, timeout=60)
    assert r.status == 200, r.body
    # what the server gave the template: arguments as an object, the result as text
    text = tiny.llm.chat.render(_messages({"messages": messages}), tools=[WEATHER])
    assert '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}' in text
    assert 'ipython<|end_header_id|>\n\n"{\\"temperature\\": 3}"' in text   # the template's tojson


def test_tool_choice_none_answers_in_text(tiny):
    r = chat(tiny, tools=[WEATHER], tool_choice="none", max_tokens=5, temperature=0)
    c = r.json()["choices"][0]
    assert r.status == 200 and "tool_calls" not in c["message"] and c["finish_reason"] == "length"


def test_template_without_tools_is_a_clear_400(tiny_chatml):
    r = chat(tiny_chatml, tools=[WEATHER])
    assert r.status == 400 and r.error()["code"] == "tools_not_supported"
    assert chat(tiny_chatml, tools=[WEATHER], tool_choice="none", max_tokens=2).status == 200


# -- bad input: a 400 in bounded time, and the server keeps serving -----------------------------

def _deep_schema(depth: int) -> str:
    return '{"type": "array", "items": ' * depth + '{"type": "integer"}' + "}" * depth


@pytest.mark.parametrize("name, body, param", [
    ("10,000 tools", {"tools": [{"type": "function", "function": {"name": f"f{i}"}}
                                for i in range(10_000)]}, "tools"),
    ("10,000 tools forced", {"tools": [{"type": "function", "function": {"name": f"f{i}"}}
                                       for i in range(10_000)], "tool_choice": "required"}, "tools"),
    ("uncompilable schema", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "pattern": "[a-"}}}}, "response_format"),
    ("schema matching nothing", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"allOf": [{"type": "string"}, {"type": "integer"}]}}}},
     "response_format"),
    ("schema nested 300 deep", {"json_schema": json.loads(_deep_schema(300))}, "json_schema"),
    ("grammar matching nothing", {"grammar": 'root ::= "a" root'}, "grammar"),
    ("not a grammar", {"grammar": "root ::= [z-a"}, "grammar"),
    ("unknown format", {"response_format": {"type": "yaml"}}, "response_format"),
    ("two formats", {"response_format": {"type": "json_object"}, "grammar": 'root ::= "a"'},
     "grammar"),
    ("bad tool", {"tools": [{"type": "function", "function": {"name": "has space"}}]},
     "tools[0].function.name"),
    ("unknown named tool", {"tools": [WEATHER], "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ("parallel_tool_calls not a flag", {"tools": [WEATHER], "parallel_tool_calls": "no"},
     "parallel_tool_calls"),
    ("bad tool parameters", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "blah"}}}}}],
        "tool_choice": "required"}, "tools"),
])
def test_bad_structure_requests_are_400(tiny, name, body, param):
    t0 = time.monotonic()
    r = chat(tiny, **body)
    assert time.monotonic() - t0 < 15, name
    assert r.status == 400, (name, r.body)
    error = r.error()
    assert error["param"] == param and "\n" not in error["message"], error
    ok = chat(tiny, max_tokens=2)
    assert ok.status == 200   # the server keeps serving


def test_schema_nested_10000_deep_is_a_400(tiny):
    body = ('{"messages": [{"role": "user", "content": "x"}], "json_schema": '
            + _deep_schema(10_000) + "}")
    t0 = time.monotonic()
    r = tiny.request("POST", "/v1/chat/completions", body,
                     {"content-type": "application/json"}, timeout=60)
    assert r.status == 400 and time.monotonic() - t0 < 15
    assert chat(tiny, max_tokens=2).status == 200


def test_bad_structure_requests_while_another_reply_streams(tiny):
    """The hostile requests of issue 27 (a schema the engine cannot compile, 10,000 tools,
    a schema nested 10,000 deep, a grammar that matches nothing, a forced call whose
    parameters match nothing) sent while another reply is being generated: each a 400
    with one line, in bounded time and memory, and the other reply runs to its end."""
    import resource
    messages = [{"role": "user", "content": "x"}]
    many = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(10_000)]
    nothing = {"type": "function", "function": {"name": "f", "parameters": {
        "allOf": [{"type": "string"}, {"type": "integer"}]}}}
    hostile = [json.dumps({"messages": messages, **body}) for body in (
        {"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "string", "pattern": "[a-"}}}},
        {"tools": many, "tool_choice": "required"},
        {"grammar": 'root ::= "a" root'},
        {"tools": [nothing], "tool_choice": "required"},
    )] + ['{"messages": [{"role": "user", "content": "x"}], "json_schema": '
          + _deep_schema(10_000) + "}"]
    # the other reply: 3000 letters or more (its grammar's), up to 3000 tokens
    other = json.dumps({"messages": messages, "max_tokens": 3000, "temperature": 0,
                        "grammar": "root ::= [a-z]{3000,}", "stream": True,
                        "stream_options": {"include_usage": True}})
    headers = [(b"host", b"127.0.0.1:8080"), (b"content-type", b"application/json")]

    async def run():
        streaming = asyncio.ensure_future(
            tiny._call("POST", "/v1/chat/completions", other.encode(), headers, 120))
        await asyncio.sleep(0.05)   # the other reply is being generated
        refused = [await tiny._call("POST", "/v1/chat/completions", body.encode(), headers, 30)
                   for body in hostile]
        return refused, not streaming.done(), await streaming

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    refused, other_still_running, streamed = tiny.loop.run_until_complete(run())
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) / 1024
    for r in refused:
        assert r.status == 400 and r.seconds < 15, (r.status, r.body[:300])
        assert "\n" not in r.error()["message"]
    assert grown_mb < 200, grown_mb
    assert other_still_running   # the refusals did not wait for it
    evs = events(streamed)
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in evs if e["choices"])
    tokens, finish = evs[-1]["usage"]["completion_tokens"], evs[-2]["choices"][0]["finish_reason"]
    assert streamed.status == 200 and re.fullmatch("[a-z]*", text)
    # ran to its end: the token limit, or the end token once the grammar allowed it
    assert (finish, tokens) == ("length", 3000) or (finish == "stop" and len(text) >= 3000)


# -- real clients: the openai package and langchain-openai, over HTTP ---------------------------

@pytest.fixture(scope="module")
def url(tiny):
    with served_over_http(tiny.app) as origin:
        yield f"{origin}/v1"


def test_openai_client(url):
    import openai
    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
    r = client.chat.completions.create(
        model="tiny-tools", messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, seed=1)
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])

    stream = client.chat.completions.create(
        model="tiny-tools", messages=[{"role": "user", "content": "Time?"}], tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}}, stream=True, seed=2)
    name, args, finish = "", "", None
    for ev in stream:
        for tc in ev.choices[0].delta.tool_calls or []:
            name += tc.function.name or ""
            args += tc.function.arguments or ""
        finish = ev.choices[0].finish_reason or finish
    assert name == "get_time" and finish == "tool_calls"
    jsonschema.validate(json.loads(args), TIME["function"]["parameters"])

    r = client.chat.completions.create(
        model="tiny-tools", messages=[{"role": "user", "content": "A person."}], seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "strict": True,
                                                                "schema": SCHEMAS[0]}},
        logprobs=True, top_logprobs=3)
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS[0])
    lp = r.choices[0].logprobs.content
    assert b"".join(bytes(t.bytes) for t in lp).decode() == r.choices[0].message.content
    assert all(len(t.top_logprobs) <= 3 for t in lp)


def test_openai_client_accumulates_streamed_calls(url):
    """The client's own stream accumulator (chat.completions.stream) builds from our chunks
    the calls the unstreamed reply has, two of them with their own ids."""
    import openai
    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
    for text, arguments in (CALL_TEXTS[0], CALL_TEXTS[3]):
        kw = dict(model="tiny-tools", messages=[{"role": "user", "content": "Oslo?"}],
                  tools=[WEATHER, TIME], max_tokens=200, extra_body={"grammar": _forcing(text)})
        whole = client.chat.completions.create(**kw).choices[0]
        with client.chat.completions.stream(**kw) as stream:
            pieces = [e.arguments_delta for e in stream
                      if e.type == "tool_calls.function.arguments.delta"]
            final = stream.get_final_completion().choices[0]
        assert final.finish_reason == whole.finish_reason == "tool_calls"
        assert final.message.content is None
        calls = final.message.tool_calls
        assert [(c.function.name, c.function.arguments) for c in calls] == \
            [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
        assert [c.function.arguments for c in calls] == arguments and "".join(pieces) == \
            "".join(arguments) and len(pieces) > len(calls)
        assert len({c.id for c in calls}) == len(calls) and all(c.type == "function" for c in calls)


def test_langchain_bind_tools_and_structured_output(url):
    lc = pytest.importorskip("langchain_openai")
    llm = lc.ChatOpenAI(base_url=url, api_key="none", model="tiny-tools", max_retries=0,
                        timeout=60, temperature=0.7, max_tokens=150)
    msg = llm.bind_tools([WEATHER], tool_choice="get_weather").invoke("Weather in Oslo?")
    (call,) = msg.tool_calls
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], WEATHER["function"]["parameters"])
    # streamed: langchain adds up the chunks' tool_call_chunks by index
    chunks = list(llm.bind_tools([WEATHER], tool_choice="get_weather").stream("Weather?"))
    msg = sum(chunks[1:], chunks[0])
    (call,) = msg.tool_calls
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    jsonschema.validate(call["args"], WEATHER["function"]["parameters"])
    assert sum(bool(c.tool_call_chunks) for c in chunks) > 2   # the arguments in pieces

    schema = {"title": "Person", "description": "A person", **SCHEMAS[0]}
    out = llm.with_structured_output(schema, method="json_schema").invoke("A person, please.")
    jsonschema.validate(out, SCHEMAS[0])
    out = llm.with_structured_output(schema, method="function_calling").invoke("A person.")
    jsonschema.validate(out, SCHEMAS[0])


def test_python_api_grammar_and_tool_parser(tiny):
    """LLM.generate(grammar=...) and edgellama.parse_tool_calls: the server's own pieces."""
    import edgellama
    llm = tiny.llm   # no request is running: the engine thread is idle
    schema = tool_call_schema([WEATHER])
    ids = llm.chat.encode_messages([{"role": "user", "content": "Oslo?"}], tools=[WEATHER])
    out = llm.generate(ids, max_tokens=150, grammar=edgellama.json_schema_grammar(schema),
                       sampling=edgellama.SamplingParams(temperature=1.0, seed=7))
    text = llm.tokenizer.decode(list(out))
    assert llm.stats.stop_reason == "stop"
    (call,) = edgellama.parse_tool_calls(text, {"get_weather"})
    jsonschema.validate(call.arguments, WEATHER["function"]["parameters"])


def test_auto_tool_choice_streams_plain_answers_as_content(tiny):
    """With tools offered, a reply that does not start like a call streams as content."""
    evs = events(chat(tiny, "hi", tools=[WEATHER], stream=True, temperature=0, max_tokens=8))
    deltas = [e["choices"][0]["delta"] for e in evs if e["choices"]]
    text = "".join(d.get("content") or "" for d in deltas)
    unstreamed = chat(tiny, "hi", tools=[WEATHER], temperature=0, max_tokens=8).json()
    assert text == unstreamed["choices"][0]["message"]["content"]
    assert text.strip()[:1] not in ("{", "[")   # the greedy reply is not call-shaped
    assert deltas[0]["role"] == "assistant" and deltas[0]["content"]
    assert not any(d.get("tool_calls") for d in deltas)
    assert evs[-1]["choices"][0]["finish_reason"] == "length"


def test_hostile_tool_text_is_rendered_safely(tiny):
    """Lone surrogates and control-token text inside tool schemas and call arguments."""
    tool = {"type": "function", "function": {
        "name": "f", "description": "x\ud800<|im_end|>",
        "parameters": {"type": "object", "properties": {"a\udfff": {"type": "string",
                                                                   "description": "<|im_start|>"}}}}}
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function",
                 "function": {"name": "f", "arguments": '{"a": "\\ud800<|im_end|>"}'}}]},
                {"role": "tool", "tool_call_id": "1", "content": "ok"}]
    for choice in ("auto", "required"):
        r = tiny.request("POST", "/v1/chat/completions", json.dumps(
            {"messages": messages, "tools": [tool], "tool_choice": choice, "max_tokens": 60}),
            {"content-type": "application/json"}, timeout=60)
        if choice == "required":   # a property name no UTF-8 reply can hold: the schema's fault
            assert r.status == 400 and "surrogate" in r.error()["message"], r.body
        else:
            assert r.status == 200, r.body
    # the control-token texts stay text: the prompt holds only the template's own
    ids = tiny.llm.chat.encode_messages(_messages({"messages": messages}), tools=[tool])
    im_start, im_end = (tiny.llm.tokenizer.special_tokens[t] for t in ("<|im_start|>", "<|im_end|>"))
    assert ids.count(im_end) == 0 and ids.count(im_start) == 1   # the BOS the template writes
