"""`serve --draft MODEL` / `--lookup` (edgellama/server/engine.py, Engine; speculative.plan_step):
at temperature 0 the replies are those of the server without speculation, alone and with
slots decoding together; usage counts the accepted and rejected proposals; plan_step
drafts where the measured costs say a step gains, not with several slots on a kernel
whose rows cost; a draft of another vocabulary is refused at start-up.

The target is a tiny Q8_0 model (its multi-token decode kernel gives every row the bits
of the one-token step, so a slot's proposals, checked beside other slots' tokens, change
no reply), its draft a Q4_0 copy of the same random weights (most proposals accepted).
"""
from __future__ import annotations

import asyncio
import json

import pytest

import edgellama
from edgellama.server import engine as srv
from edgellama.speculative import DraftLength, Drafter, PassCost, PromptLookup, plan_step
from server_asgi import ServerUnderTest
from test_server_parallel import Job, collect, params, run
from tiny_gguf import TINY_VOCAB, write_tiny_gguf

# lookup finds earlier copies of their last tokens in these
PROMPTS = ["on and on and on and on and", "hello hello hello there", "the end of the end of the",
           "zebra"]
N = 40


def _tiny(d, qtype, seed=0, **kw):
    kw = {"dim": 64, "ffn": 96, "vocab": TINY_VOCAB, "ctx": 256, "tokenizer": True,
          "tied": False, **kw}
    return write_tiny_gguf(d / f"{qtype}-{seed}.gguf", qtype, seed=seed, **kw)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("srvspec")
    return _tiny(d, "Q8_0"), _tiny(d, "Q4_0")


@pytest.fixture(scope="module")
def llm(files):
    return edgellama.load(str(files[0]), ctx=256, threads=1)


def _replies(llm, drafter, parallel, prompts=PROMPTS, n=N):
    async def work(engine):
        jobs = [Job(llm.tokenizer.encode(p), n, params(n)) for p in prompts]
        for job in jobs:
            engine.submit(job)
        return await asyncio.gather(*map(collect, jobs))
    results, rec, engine = run(llm, work, parallel=parallel, drafter=drafter)
    assert all(event[0] == "done" for _, event in results)
    return [(text, event[1]) for text, event in results], [event[2] for _, event in results], rec


@pytest.mark.parametrize("parallel", [1, 2])
@pytest.mark.parametrize("which", ["lookup", "draft model"])
def test_greedy_replies_equal_the_server_without_speculation(llm, files, which, parallel):
    plain, plain_usage, _ = _replies(llm, None, parallel)
    # draft_min 2: every step with a proposal checks some, whatever the costs measured
    drafter = PromptLookup(draft_min=2, draft_max=4) if which == "lookup" else \
        llm.load_draft(files[1], 2, 4)
    got, usage, rec = _replies(llm, drafter, parallel)
    assert got == plain
    assert [u["completion_tokens"] for u in usage] == \
        [u["completion_tokens"] for u in plain_usage]
    assert sum(u["completion_tokens"] for u in usage) > 2 * N
    assert all("completion_tokens_details" not in u for u in plain_usage)
    details = [u["completion_tokens_details"] for u in usage]
    accepted = sum(d["accepted_prediction_tokens"] for d in details)
    rejected = sum(d["rejected_prediction_tokens"] for d in details)
    # both outcomes checked; each step fed one token per slot plus its proposals
    assert accepted > 0 and rejected > 0
    assert sum(map(sum, rec.counts)) - sum(map(len, rec.counts)) == accepted + rejected
    if parallel == 2:   # proposals were checked in steps shared with the other slot
        assert any(len(c) == 2 and max(c) > 1 for c in rec.counts)


def test_usage_reports_the_proposals(files):
    # draft_min 1: proposals whenever lookup finds a match
    app = ServerUnderTest(files[0], {"drafter": PromptLookup(draft_min=1, draft_max=4)})
    plain = ServerUnderTest(files[0])
    try:
        body = {"prompt": PROMPTS[0], "max_tokens": N, "temperature": 0}
        r = app.request("POST", "/v1/completions", body).json()
        want = plain.request("POST", "/v1/completions", body).json()
        assert r["choices"][0]["text"] == want["choices"][0]["text"]
        details = r["usage"]["completion_tokens_details"]
        assert details["accepted_prediction_tokens"] > 0
        assert details["rejected_prediction_tokens"] >= 0
        assert "completion_tokens_details" not in want["usage"]
        streamed = app.request("POST", "/v1/completions", {
            **body, "stream": True, "stream_options": {"include_usage": True}})
        chunks = [json.loads(line[6:]) for line in streamed.body.decode().splitlines()
                  if line.startswith("data: {")]
        last = chunks[-1]
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == N
        assert last["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] > 0
        assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == r["choices"][0]["text"]
        # sampling: proposals pass speculative.rejection_test; a logprob for every token
        sampled = app.request("POST", "/v1/completions", {
            **body, "temperature": 0.9, "seed": 7, "logprobs": 2}).json()
        assert len(sampled["choices"][0]["logprobs"]["tokens"]) == \
            sampled["usage"]["completion_tokens"]
        assert sum(sampled["usage"]["completion_tokens_details"].values()) > 0
    finally:
        app.close()
        plain.close()


def _costs() -> PassCost:
    """This machine's (README): one token 10 ms, 8 tokens 3.28 times that."""
    costs = PassCost()
    costs.observe(1, 0.010)
    costs.observe(8, 0.0328)
    return costs


def _length(acceptance: float, draft_cost: float = 0.0, draft_min: int = 0) -> DraftLength:
    L = DraftLength(draft_min, 16)
    L.accepted, L.trials = 1000 * acceptance, 1000   # proposals seen: a fraction accepted
    L.draft_cost = draft_cost
    return L


def test_plan_step_drafts_only_where_the_step_gains():
    costs = _costs()
    # one slot: 3 proposals fill the 4-row group, if enough are accepted
    assert plan_step([_length(0.8)], [16], costs) == [3]
    assert plan_step([_length(0.1)], [16], costs) == [0]
    assert plan_step([_length(0.8, draft_cost=0.004)], [16], costs) == [0]   # a slow drafter
    assert plan_step([None], [16], costs) == [0]
    assert plan_step([_length(0.8)], [0], costs) == [0]     # its reply has no room left
    # four slots: another group of rows costs more than the proposals add, unless
    # nearly all are accepted
    assert plan_step([_length(0.8)] * 4, [16] * 4, costs) == [0, 0, 0, 0]
    assert plan_step([_length(0.8), None, None, None], [16] * 4, costs) == [0, 0, 0, 0]
    assert plan_step([_length(0.95), None, None, None], [16] * 4, costs) == [4, 0, 0, 0]
    # three slots: the group's fourth row costs nothing but drafting
    assert plan_step([_length(0.1), None, None], [16] * 3, costs) == [1, 0, 0]
    # draft_min is honoured regardless, capped by the room left
    ks = plan_step([_length(0.1, draft_min=2)] * 4, [16, 16, 16, 1], costs)
    assert min(ks[:3]) >= 2 and ks[3] == 1
    assert plan_step([_length(0.8)], [16], PassCost()) == [0]   # no pass measured yet


class Scripted(Drafter):
    """Proposes the reply plain decoding gives, every 5th of its tokens wrong: a drafter
    whose measured acceptance is high, not so high that every step gains from it."""

    name = "scripted"

    def __init__(self, replies: list[tuple[list[int], list[int]]]):
        super().__init__()
        self.replies = sorted(replies, key=lambda r: -len(r[0]))   # longest prompt first

    def copy(self):
        return Scripted(self.replies)

    def propose(self, history, k, sampler):
        prompt, reply = next(r for r in self.replies if history[:len(r[0])] == r[0])
        at = len(history) - len(prompt)
        return [t if (at + i) % 5 != 4 else (t + 1) % TINY_VOCAB
                for i, t in enumerate(reply[at:at + k])], None


def test_many_slots_do_not_draft(llm, monkeypatch):
    """Through the engine, the pass costs fixed at this machine's (the tiny model's
    rows cost next to nothing): while 4 slots decode none drafts; the one left decoding
    alone starts to once its probes have measured the acceptance, and the replies are
    the plain ones."""
    fixed = _costs()
    fixed.observe = lambda tokens, seconds: None
    monkeypatch.setattr(srv, "PassCost", lambda one_pass_verify: fixed)
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS[:3] + ["tell me a story"]]

    def replies(drafter):
        async def work(engine):
            jobs = [Job(p, n, params(n)) for p, n in zip(prompts, [12, 12, 12, 150])]
            for job in jobs:
                engine.submit(job)
            await asyncio.gather(*map(collect, jobs))
            return [(job.ids, job.history[len(job.ids):]) for job in jobs]
        return run(llm, work, parallel=4, drafter=drafter)[:2]
    plain, _ = replies(None)
    got, rec = replies(Scripted(plain))
    assert got == plain
    wide = [c for c in rec.counts if len(c) == 4]
    assert len(wide) >= 4 and all(c == (1, 1, 1, 1) for c in wide)
    last_wide = max(i for i, c in enumerate(rec.counts) if len(c) == 4)
    assert any(c[0] > 1 for c in rec.counts[last_wide:] if len(c) == 1)


def test_serve_refuses_a_draft_of_another_vocabulary(files, tmp_path):
    from click.testing import CliRunner

    import edgellama.cli.serve  # noqa: F401  (registers the command)
    from edgellama.cli.main import main
    other = _tiny(tmp_path, "Q4_0", seed=1, vocab=TINY_VOCAB + 16)
    r = CliRunner().invoke(main, ["serve", "-m", str(files[0]), "--port", "0", "-t", "1",
                                  "--draft", str(other)])
    assert r.exit_code == 1, r.output
    assert "does not share the vocabulary" in r.output
    assert len(r.output.strip().splitlines()) == 1 and "Traceback" not in r.output


def test_serve_command_with_lookup(files, tmp_path):
    from test_server import Served
    s = Served(files[0], "--lookup", "--draft-min", "1", log=tmp_path / "lookup.log")
    try:
        assert "speculative decoding: lookup, 1..16 tokens a step" in s.text()
        r = s.client().completions.create(model="Q8_0-0", prompt=PROMPTS[0], max_tokens=N,
                                          temperature=0)
        details = r.usage.completion_tokens_details
        assert details.accepted_prediction_tokens + details.rejected_prediction_tokens > 0
    finally:
        s.stop()
    assert "Traceback" not in s.text()
