"""Client structures nested without end (issue 35, class 4): a tool whose parameter schema
nests 300 levels deep once got a 500 and a RecursionError traceback with tool_choice
"required" (the schema walk recursed once per level). Every walk over what a client
sends is bounded (a body nests at most MAX_BODY_DEPTH levels, a schema, a tool's
parameters or a call's arguments MAX_DEPTH, a GBNF grammar MAX_DEPTH parentheses and
MAX_GBNF_RULES rules) or iterative, on every path: each such request is a 400 naming the
field, in bounded time, nothing logged, and the server goes on serving. So is a schema
whose multipleOf would take the grammar engine without end (found by the fuzzer).
"""
from __future__ import annotations

import json
import sys
import time

import pytest

from edgellama.constrain import MAX_DEPTH, MAX_GBNF_RULES, _gbnf_depth, gbnf_grammar
from edgellama.errors import EdgeError
from edgellama.server.params import MAX_BODY_DEPTH
from edgellama.tool_calls import tool_call_schema
from server_asgi import ServerUnderTest
from test_chat_template import LLAMA32_TEMPLATE
from tiny_gguf import TINY_VOCAB, write_tiny_gguf

CHAT = "/v1/chat/completions"
M = [{"role": "user", "content": "x"}]


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """The tiny model with Llama 3.2's template, which shows tools to the model."""
    path = write_tiny_gguf(tmp_path_factory.mktemp("nesting") / "tiny-tools.gguf", "F32",
                           vocab=TINY_VOCAB, ctx=4096, tokenizer=True, tied=False, seed=4,
                           chat_template=LLAMA32_TEMPLATE)
    s = ServerUnderTest(path, ctx=4096)
    # kernels compiled before the clock runs (a cold cache takes longer than a case may)
    r = s.request("POST", CHAT, {"messages": M, "max_tokens": 2}, timeout=600)
    assert r.status == 200, r.body[:300]
    yield s
    s.close()


def deep_object(levels: int) -> dict:
    """A schema of `levels` objects one inside the other: 2 JSON levels each."""
    s: dict = {"type": "integer"}
    for _ in range(levels):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
    return s


def deep_list(levels: int):
    v: list = [1]
    for _ in range(levels - 1):
        v = [v]
    return v


def tool(parameters: dict) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


def refused(app: ServerUnderTest, body: dict | str, param: str | None) -> dict:
    t0 = time.monotonic()
    r = app.request("POST", CHAT, body, {"content-type": "application/json"}, timeout=60)
    assert r.raised is None, repr(r.raised)
    assert r.status == 400, (r.status, r.body[:300])
    error = r.error()
    assert error["param"] == param and "\n" not in error["message"], error
    assert time.monotonic() - t0 < 10
    logged = [x.getMessage() for x in app.log.records]
    app.log.records.clear()
    assert not logged, logged
    ok = app.request("POST", CHAT, {"messages": M, "max_tokens": 2})
    assert ok.status == 200, ok.body[:300]   # the server goes on serving
    return error


@pytest.mark.parametrize("choice", ["required", "auto", "none",
                                    {"type": "function", "function": {"name": "f"}}])
@pytest.mark.parametrize("levels", [55, 300])
def test_a_deep_tool_schema_is_a_400_whatever_the_tool_choice(app, choice, levels):
    # 55 objects: 111 levels of schema, within the body's bound; 300: the issue's case
    error = refused(app, {"messages": M, "tools": [tool(deep_object(levels))],
                          "tool_choice": choice},
                    "tools[0].function.parameters" if levels == 55 else "tools")
    assert "levels deep" in error["message"]


def test_a_tool_schema_within_the_bound_still_forces_a_call(app):
    r = app.request("POST", CHAT, {"messages": M, "tools": [tool(deep_object(5))],
                                   "tool_choice": "required", "max_tokens": 100,
                                   "temperature": 0})
    assert r.status == 200, r.body[:300]
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    args = json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"])
    for _ in range(5):
        args = args["a"]
    assert isinstance(args, int)


@pytest.mark.parametrize("name, body, param", [
    ("json_schema", {"json_schema": deep_object(55)}, "json_schema"),
    ("response_format", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": deep_object(55)}}}, "response_format"),
    ("json_object schema", {"response_format": {"type": "json_object",
                                                "schema": deep_object(55)}}, "response_format"),
    ("grammar parentheses", {"grammar": "root ::= " + "(" * 101 + '"a"' + ")" * 101},
     "grammar"),
    ("grammar of 10,000 parentheses", {"grammar": "root ::= " + "(" * 10_000 + '"a"'
                                       + ")" * 10_000}, "grammar"),
    ("grammar rules", {"grammar": "\n".join(f'r{i} ::= r{i + 1} "x"' for i in range(4000))
                       + '\nr4000 ::= "y"\nroot ::= r0'}, "grammar"),
    ("call arguments", {"messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "a", "type": "function", "function": {
            "name": "f", "arguments": json.dumps(deep_list(MAX_DEPTH + 1))}}]}, *M]},
     "messages[0].tool_calls"),
    ("call id", {"messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"id": deep_list(50), "type": "function", "function": {"name": "f"}}]}, *M]},
     "messages[0].tool_calls"),
    # the grammar engine's automaton for a multipleOf grows with it: 2^31 never ended
    ("coarse multipleOf", {"json_schema": {"type": "integer", "multipleOf": 2**31}},
     "json_schema"),
    ("coarse multipleOf in a forced call", {"tools": [tool({
        "type": "object", "properties": {"n": {"type": "number", "multipleOf": 999_983}}})],
        "tool_choice": "required"}, "tools"),
])
def test_deep_structures_on_every_path_are_a_400(app, name, body, param):
    refused(app, {"messages": M, **body}, param)


@pytest.mark.parametrize("field", ["logit_bias", "stop", "metadata", "messages", "tools",
                                   "stream_options", "x-unknown"])
def test_a_body_nested_past_the_bound_is_a_400_whatever_the_field(app, field):
    deep = deep_list(MAX_BODY_DEPTH)    # one more level under the body itself
    error = refused(app, {"messages": M, field: deep}, field)
    assert f"more than {MAX_BODY_DEPTH} levels" in error["message"]


def test_a_body_at_the_bound_is_read(app):
    body = {"messages": M, "max_tokens": 2, "metadata": deep_list(MAX_BODY_DEPTH - 1)}
    assert app.request("POST", CHAT, body).status == 200


def test_a_deep_body_of_a_million_brackets_is_a_400(app):
    text = '{"messages": [{"role": "user", "content": "x"}], "x": ' + "[" * 10**6 \
        + "]" * 10**6 + "}"
    refused(app, text, None)   # past what JSON parsing takes


def test_tool_call_schema_copies_a_schema_deeper_than_the_stack():
    depth = sys.getrecursionlimit() * 2
    schema = {"$ref": "#/$defs/leaf", "$defs": {"leaf": {"type": "integer"}}}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    out = tool_call_schema([tool(schema)])
    inner = out["$defs"]["tool_f"]
    for _ in range(depth):
        inner = inner["items"]
    assert inner["$ref"] == "#/$defs/tool_f/$defs/leaf"   # references rebased at the bottom
    assert schema["items"]["type"] == "array"   # the client's schema is not changed


def test_gbnf_parentheses_are_counted_outside_literals_classes_and_comments():
    assert _gbnf_depth('root ::= "((((" [(((\\]] # (((((\n ( "a" ( [a-z] ) )') == 2
    many = "(" * MAX_DEPTH
    assert gbnf_grammar(f'root ::= "{many}" [{many}] # {many}\n')
    with pytest.raises(EdgeError, match="levels of parentheses"):
        gbnf_grammar("root ::= " + "(" * (MAX_DEPTH + 1) + '"a"' + ")" * (MAX_DEPTH + 1))
    chain = "\n".join(f'r{i} ::= r{i + 1} "x"' for i in range(MAX_GBNF_RULES - 2))
    t0 = time.monotonic()
    assert gbnf_grammar(chain + f'\nr{MAX_GBNF_RULES - 2} ::= "y"\nroot ::= r0')
    assert time.monotonic() - t0 < 2   # the most rules accepted convert quickly
