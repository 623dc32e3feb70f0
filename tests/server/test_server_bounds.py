"""Every number a client can send the server is bounded by what it can mean (issue 35,
class 2, the server's side): the context (max_tokens, max_completion_tokens), the
vocabulary (top_k: larger means all of it; top_logprobs/logprobs: at most 20), one
reply (n, best_of), the server's draft options (llama.cpp's speculative.n_max caps a
reply's proposals a step, under --draft-max and the context; n_min and p_min are
checked), the slots (a slot id), a seed (taken modulo 2^64). A value past a bound is a
400 naming the field, or clamped where stated; either way at once, nothing logged.
"""
from __future__ import annotations

import time

import pytest

from edgellama.speculative import PromptLookup
from server_asgi import ServerUnderTest, tiny_chat_model

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
M = [{"role": "user", "content": "hi"}]
HUGE = 10**30


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    d = tmp_path_factory.mktemp("bounds")
    s = ServerUnderTest(tiny_chat_model(d), {
        "drafter": PromptLookup(draft_min=1, draft_max=4), "slot_save_path": str(d / "slots"),
        "parallel": 2})
    # kernels compiled before the clock runs (a cold cache takes longer than a case may)
    r = s.request("POST", COMPLETIONS, {"prompt": "hi", "max_tokens": 2}, timeout=600)
    assert r.status == 200, r.body[:300]
    yield s
    s.close()


def send(app, path=CHAT, **body):
    body = {**({"messages": M} if path == CHAT else {"prompt": "on and on and on and"}),
            "max_tokens": 24, **body}
    t0 = time.monotonic()
    r = app.request("POST", path, body)
    assert time.monotonic() - t0 < 10, body
    assert r.raised is None and r.status < 500, (r.status, r.body[:300])
    logged = [x.getMessage() for x in app.log.records]
    app.log.records.clear()
    assert not logged, logged
    return r


@pytest.mark.parametrize("field, value, path", [
    ("max_tokens", HUGE, CHAT), ("max_completion_tokens", HUGE, CHAT),
    ("max_tokens", 256, COMPLETIONS),                       # the whole context: no room
    ("top_logprobs", 21, CHAT), ("top_logprobs", HUGE, CHAT), ("logprobs", HUGE, COMPLETIONS),
    ("n", HUGE, CHAT), ("best_of", HUGE, COMPLETIONS), ("temperature", HUGE, CHAT),
    ("repeat_penalty", 1e308, CHAT), ("top_k", -1, CHAT), ("min_p", 2, CHAT),
    ("speculative.n_max", -1, COMPLETIONS), ("speculative.n_max", 1.5, COMPLETIONS),
    ("speculative.n_min", -HUGE, COMPLETIONS), ("speculative.p_min", 1.5, COMPLETIONS),
    ("speculative.p_min", "high", COMPLETIONS),
])
def test_past_a_bound_is_a_400_naming_the_field(app, field, value, path):
    body = {field: value, **({"logprobs": True} if field == "top_logprobs" else {})}
    r = send(app, path, **body)
    assert r.status == 400, r.body[:300]
    assert r.error()["param"] == field, r.error()


def reply(app, path=CHAT, **body) -> str:
    r = send(app, path, **body)
    assert r.status == 200, r.body[:300]
    choice = r.json()["choices"][0]
    return choice["message"]["content"] if path == CHAT else choice["text"]


def test_a_top_k_past_the_vocabulary_means_all_of_it(app):
    sampled = {"temperature": 1.0, "seed": 3, "top_p": 1.0, "min_p": 0.0}
    assert reply(app, top_k=HUGE, **sampled) == reply(app, top_k=0, **sampled)
    assert reply(app, top_k=HUGE, **sampled) != reply(app, top_k=1, **sampled)


def test_a_seed_is_taken_modulo_2_to_the_64(app):
    sampled = {"temperature": 1.0, "seed": 5}
    assert reply(app, **sampled) == reply(app, **{**sampled, "seed": 5 + 2**64 * 3})
    assert reply(app, **{**sampled, "seed": -1}) == reply(app, **{**sampled, "seed": 2**64 - 1})


def test_top_logprobs_at_the_bound(app):
    r = send(app, logprobs=True, top_logprobs=20, max_tokens=3)
    assert r.status == 200
    assert all(len(e["top_logprobs"]) == 20 for e in r.json()["choices"][0]["logprobs"]["content"])


def test_draft_options_cap_the_proposals_and_never_change_the_reply(app):
    greedy = {"temperature": 0, "max_tokens": 40}
    plain = send(app, COMPLETIONS, **greedy).json()
    assert sum(plain["usage"]["completion_tokens_details"].values()) > 0   # it drafted
    none = send(app, COMPLETIONS, **greedy, **{"speculative.n_max": 0}).json()
    assert none["usage"]["completion_tokens_details"] == {
        "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}
    t0 = time.monotonic()
    huge = send(app, COMPLETIONS, **greedy, **{"speculative.n_max": HUGE,
                                               "speculative.n_min": HUGE,
                                               "speculative.p_min": 0.0}).json()
    assert time.monotonic() - t0 < 5     # clamped to --draft-max: no billion-token draft
    assert none["choices"][0]["text"] == huge["choices"][0]["text"] == plain["choices"][0]["text"]


@pytest.mark.parametrize("slot_id", ["2", "99", "1" * 5000, "-0", "0x1", "1e3", " 1", "\u0661"])
def test_slot_ids_past_the_slots_are_400(app, slot_id):
    t0 = time.monotonic()
    r = app.request("POST", f"/slots/{slot_id}?action=erase", {})
    assert r.status == 400 and r.error()["param"] == "id_slot", r.body[:300]
    assert time.monotonic() - t0 < 2
    assert app.request("POST", "/slots/1?action=erase", {}).status == 200
