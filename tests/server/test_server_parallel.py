"""`serve --parallel`: slots, continuous batching, prefix reuse per slot, cancellation.

The engine (edgellama/server/engine.py, Engine) is driven directly with Jobs in an event loop of
this test, its model's decode wrapped to record every step's batch: which slots were
decoded together. The model is test_server's tiny F32 chat model: with F32 weights every
Linear's several-row decode is a matvec per row, so a reply decoded beside others is
exactly the reply decoded alone (the quantized formats' batched decode, within their
rounding of the single one, is tests/model/test_sequences.py's). The real command with the
official openai client: 8 concurrent clients.
"""
from __future__ import annotations

import asyncio
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import edgellama
from edgellama.errors import EdgeError
from edgellama.sampling import SamplingParams
from edgellama.server import engine as srv
from edgellama.server.engine import Engine, choose_parallel
from edgellama.server.job import Job
from edgellama.server.params import ApiError, Params
from server_asgi import tiny_chat_model
from tiny_gguf import TINY_VOCAB, write_tiny_gguf
from test_server import Served, models, streamed  # noqa: F401 - the fixture, shared

PROMPTS = ["hello there", "once upon a time", "the end of", "on and on and", "zebra",
           "in the", "tell me a story", "pick"]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return edgellama.load(str(tiny_chat_model(tmp_path_factory.mktemp("parallel"))),
                          ctx=256, threads=1)


class Recorder:
    """Wraps the model's decode: the slot indexes of every step, in order, the tokens
    each fed (1, or more with proposals: speculative decoding), and each slot's logits
    row of its first token."""

    def __init__(self, engine: Engine):
        self.steps: list[tuple[int, ...]] = []
        self.counts: list[tuple[int, ...]] = []
        self.logits: dict[int, list[np.ndarray]] = {s.index: [] for s in engine.slots}
        model, decode = engine.llm.model, engine.llm.model.decode
        index = {id(s.seq): s.index for s in engine.slots}

        def recorded(seqs, tokens, scratch=None, counts=None):
            self.steps.append(tuple(index[id(s)] for s in seqs))
            self.counts.append(tuple(counts or [1] * len(seqs)))
            out = decode(seqs, tokens, scratch, counts)
            for s, r in zip(self.steps[-1], np.cumsum((0,) + self.counts[-1][:-1])):
                self.logits[s].append(out[r].copy())
            return out
        model.decode = recorded
        self.undo = lambda: vars(model).pop("decode")


def params(max_tokens: int, stops: list[str] | None = None) -> Params:
    return Params(False, False, max_tokens, SamplingParams(temperature=0), stops or [])


async def collect(job: Job) -> tuple[str, tuple]:
    """The job's text and its last event."""
    parts = []
    while True:
        event = await job.events.get()
        if event[0] != "text":
            return "".join(parts), event
        parts.append(event[1])


def encode(llm, prompt: str) -> list[int]:
    return llm.chat.encode_messages([{"role": "user", "content": prompt}])


def run(llm, work, parallel: int = 4, capacity: int = 16, drafter=None):
    """work(engine) -> coroutine, run in a new event loop against a new engine whose
    decode steps are recorded; returns (its result, the recorder, the engine)."""
    async def main():
        engine = Engine(llm, capacity, parallel, drafter)
        rec = Recorder(engine)
        try:
            return await asyncio.wait_for(work(engine), 120), rec, engine
        finally:
            engine.close()
            rec.undo()
    return asyncio.run(main())


def alone(llm, prompt: str, n: int) -> str:
    async def work(engine):
        job = Job(encode(llm, prompt), n, params(n))
        engine.submit(job)
        return await collect(job)
    (text, event), rec, _ = run(llm, work, parallel=1)
    assert event[:2] == ("done", "length") and set(rec.steps) == {(0,)}
    return text


def test_together_equals_alone_and_decodes_in_one_pass(llm):
    lengths = [40, 25, 33, 40]
    want = [alone(llm, p, n) for p, n in zip(PROMPTS, lengths)]

    async def work(engine):
        jobs = [Job(encode(llm, p), n, params(n)) for p, n in zip(PROMPTS, lengths)]
        for job in jobs:
            engine.submit(job)
        return await asyncio.gather(*map(collect, jobs)), jobs
    (results, jobs), rec, engine = run(llm, work)
    assert [text for text, _ in results] == want
    assert [e[2]["completion_tokens"] for _, e in results] == lengths
    # four slots, each job in its own; all four decoded in the same steps
    assert sorted(j.slot.index for j in jobs) == [0, 1, 2, 3]
    assert max(map(len, rec.steps)) == 4
    # fairness: one token a step for each job; every step decodes every job whose prompt
    # is read, so none waits while another runs ahead
    for job, n in zip(jobs, lengths):
        assert sum(job.slot.index in s for s in rec.steps) == n
    assert engine.status() == {"running": 0, "waiting": 0, "capacity": 16}


def test_quantized_together_within_rounding_of_alone(tmp_path):
    """Q4_K matrices (Q6_K embedding), whose several-token decode is one int8 GEMM pass:
    each reply decoded beside three others has the logits of the reply alone within the
    f32 order of a tile's sums (test_sequences' bound), and so the same greedy tokens
    wherever alone's best token leads the next by more than twice that."""
    q = edgellama.load(str(write_tiny_gguf(
        tmp_path / "q4k-chat.gguf", "Q4_K", dim=256, ffn=512, vocab=TINY_VOCAB, ctx=256,
        tokenizer=True, tied=False, embed_type="Q6_K", seed=4)), ctx=256, threads=1)
    n = 24

    def replies(prompts, parallel):
        async def work(engine):
            jobs = [Job(encode(q, p), n, params(n)) for p in prompts]
            for job in jobs:
                engine.submit(job)
            await asyncio.gather(*map(collect, jobs))
            return [j.slot.index for j in jobs]
        slots, rec, _ = run(q, work, parallel=parallel)
        assert max(map(len, rec.steps)) == len(prompts)
        return [np.stack(rec.logits[s]) for s in slots]   # a row a step: greedy = argmax
    together = replies(PROMPTS[:4], 4)
    compared = []
    for p, got in zip(PROMPTS[:4], together):
        [want] = replies([p], 1)
        tol = 1e-5 * np.abs(want).max()
        steps = 0
        for k in range(min(len(want), len(got))):   # to the first near-tie: there rounding
            np.testing.assert_allclose(got[k], want[k], rtol=0, atol=tol)   # may pick either
            top2 = np.sort(want[k])[-2:]
            if top2[1] - top2[0] <= 2 * tol:
                break
            assert np.argmax(got[k]) == np.argmax(want[k])
            steps += 1
        compared.append(steps)
    assert min(compared) >= 8, compared   # the prompts leave a margin for most steps


def test_requests_join_and_leave_between_steps(llm):
    """Two short jobs and a long one; a fourth arrives after a short one ended and joins the
    long one's steps; a fifth waits for a slot (parallel 3) and takes the first one freed."""
    specs = [("hello there", 6), ("zebra", 230), ("the end of", 10)]
    late = [("on and on and", 12), ("tell me a story", 8)]
    want = [alone(llm, p, n) for p, n in specs + late]

    async def work(engine):
        jobs = [Job(encode(llm, p), n, params(n)) for p, n in specs]
        for job in jobs:
            engine.submit(job)
        first = await collect(jobs[0])
        extra = [Job(encode(llm, p), n, params(n)) for p, n in late]
        for job in extra:
            engine.submit(job)
        rest = await asyncio.gather(*map(collect, jobs[1:] + extra))
        return [first, *rest], jobs + extra
    (results, jobs), rec, _ = run(llm, work, parallel=3)
    assert [text for text, _ in results] == want
    long_slot, first_slot = jobs[1].slot.index, jobs[0].slot.index
    widths = [len(s) for s in rec.steps if long_slot in s]
    assert max(widths) == 3 and widths[-1] == 1   # three together, the long one alone at last
    # the job that arrived later shared steps with the long one
    late_slot = jobs[3].slot.index
    assert any(long_slot in s and late_slot in s for s in rec.steps)
    # the freed slot of the first job was taken again
    assert {jobs[3].slot.index, jobs[4].slot.index} & {first_slot, jobs[2].slot.index}


def test_cancelling_frees_the_slot_for_a_waiting_job(llm):
    async def work(engine):
        long = Job(encode(llm, "zebra"), 230, params(230))
        waiting = Job(encode(llm, "hello there"), 5, params(5))
        engine.submit(long)
        assert (await long.events.get())[0] == "text"   # it is generating
        engine.submit(waiting)
        assert engine.status() == {"running": 1, "waiting": 1, "capacity": 1}   # one slot
        engine.cancel(long)
        cancelled = await collect(long)
        done = await collect(waiting)
        return cancelled, done, long, waiting
    (cancelled, done, long, waiting), rec, engine = run(llm, work, parallel=1, capacity=1)
    assert cancelled[1] == ("cancelled",)
    assert done[1][:2] == ("done", "length") and done[0] == alone(llm, "hello there", 5)
    # the long job stopped within a few steps of the cancel, well before its 230 tokens
    assert sum(s == (0,) for s in rec.steps) < 150
    assert long.slot is waiting.slot


def test_prefix_reuse_per_slot_keeps_interleaved_conversations(llm):
    """Conversations A and B, turns interleaved: with two slots each turn reuses its own
    conversation's cache; with one slot each evicts the other."""
    a1 = [{"role": "user", "content": "hello there, how are you today"}]
    b1 = [{"role": "user", "content": "once upon a time in a land far away"}]
    a2 = a1 + [{"role": "assistant", "content": "fine"}, {"role": "user", "content": "and then"}]
    b2 = b1 + [{"role": "assistant", "content": "yes"}, {"role": "user", "content": "more"}]

    def cached(parallel: int) -> list[int]:
        async def work(engine):
            out = []
            for messages in (a1, b1, a2, b2):
                job = Job(llm.chat.encode_messages(messages), 2, params(2))
                engine.submit(job)
                out.append((await collect(job))[1][2]["prompt_tokens_details"]["cached_tokens"])
            return out
        return run(llm, work, parallel=parallel)[0]
    n_a1, n_b1 = len(llm.chat.encode_messages(a1)), len(llm.chat.encode_messages(b1))
    two, one = cached(2), cached(1)
    assert two[2] >= n_a1 and two[3] >= n_b1        # each conversation found its slot
    assert one[2] < n_a1 // 2 and one[3] < n_b1 // 2   # one slot: only the template's opening


def test_a_full_queue_is_503_and_status_counts_slots(llm):
    async def work(engine):
        jobs = [Job(encode(llm, p), 100, params(100)) for p in PROMPTS[:4]]
        # the engine's lock held: its thread neither takes nor ends a job meanwhile, so
        # no job can finish (a 100-token reply of this model takes ~30 ms) before the
        # fifth arrives; 2 for the free slots, 2 queued (--queue 2)
        with engine._cond:
            for job in jobs:
                engine.submit(job)
            with pytest.raises(ApiError) as e:
                engine.submit(Job(encode(llm, "x"), 1, params(1)))
            status = engine.status()
        slots = engine.slot_status()
        for job in jobs:
            engine.cancel(job)
        for job in jobs:
            await collect(job)
        return e.value, status, slots
    (error, status, slots), _, engine = run(llm, work, parallel=2, capacity=2)
    assert error.status == 503 and error.code == "queue_full" and "--parallel 2" in error.message
    assert status["running"] + status["waiting"] == 4 and status["capacity"] == 2
    per_slot = engine.slots[0].seq.cache.nbytes
    assert slots["parallel"] == 2 and slots["kv_cache_bytes_per_slot"] == per_slot
    assert slots["kv_cache_bytes"] == 2 * per_slot and len(slots["cached_tokens"]) == 2


def test_slot_count_from_memory(monkeypatch):
    gib = 2**30
    monkeypatch.setattr(srv, "available_memory", lambda: 10 * gib)
    assert choose_parallel(None, gib, 4096) == srv.DEFAULT_PARALLEL
    assert choose_parallel(7, gib, 4096) == 7
    monkeypatch.setattr(srv, "available_memory", lambda: 2 * gib + 5)
    assert choose_parallel(None, gib, 4096) == 2
    with pytest.raises(EdgeError, match=r"--parallel 3 needs 3072 MiB of KV cache \(1024 MiB "
                                        r"a slot at ctx 4096\), but only 2048 MiB"):
        choose_parallel(3, gib, 4096)
    monkeypatch.setattr(srv, "available_memory", lambda: gib // 2)
    assert choose_parallel(None, gib, 4096) == 1     # the model's load checked that one fits
    monkeypatch.setattr(srv, "available_memory", lambda: None)
    assert choose_parallel(None, gib, 4096) == srv.DEFAULT_PARALLEL


# -- the real command, the openai client -------------------------------------------------------

@pytest.fixture(scope="module")
def four_slots(models):   # noqa: F811
    d, _, slow = models
    s = Served(slow, "--parallel", "4", "--queue", "8", log=d / "parallel.log")
    yield s
    s.stop()


def test_eight_openai_clients_at_once(four_slots):
    """8 concurrent streaming clients on 4 slots: 4 run together, 4 wait, all are answered
    in full; /health and the start-up message show the slots and their memory."""
    s = four_slots
    log = s.text()
    assert re.search(r"4 slots of ctx 4096: KV cache up to \d+ MiB", log), log
    h = s.health()
    assert h["slots"]["parallel"] == 4
    assert h["slots"]["kv_cache_bytes"] == 4 * h["slots"]["kv_cache_bytes_per_slot"] > 0
    seen, stop = [], threading.Event()

    def watch():
        while not stop.is_set():
            seen.append(s.health()["queue"])
            time.sleep(0.02)

    def ask(i):
        c = s.client()
        pieces, chunks = streamed(c.chat.completions.create(
            model="slow-chat", messages=[{"role": "user", "content": PROMPTS[i]}],
            max_tokens=60, temperature=0, stream=True, stream_options={"include_usage": True}))
        return "".join(pieces), chunks[-1].usage.completion_tokens
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(8) as pool:
            together = list(pool.map(ask, range(8)))
    finally:
        stop.set()
        watcher.join()
    assert [n for _, n in together] == [60] * 8
    assert max(q["running"] for q in seen) == 4 and max(q["waiting"] for q in seen) >= 1
    assert together == [ask(i) for i in range(8)]   # each as it is alone
    s.wait_health(lambda h: h["queue"]["running"] == 0)
    assert "Traceback" not in s.text()


def test_a_client_leaving_frees_its_slot_for_one_waiting(four_slots):
    """4 long streams fill the 4 slots and a fifth waits; when one client leaves, the
    fifth starts generating while the other three go on."""
    s = four_slots
    c = s.client()

    def long_stream(prompt):
        return c.completions.create(model="slow-chat", prompt=prompt, max_tokens=3000,
                                    temperature=0, stream=True)
    running = [long_stream(p) for p in PROMPTS[:4]]
    for stream in running:
        next(iter(stream))                                # all four are generating
    waiting = long_stream(PROMPTS[4])                     # headers back: it waits for a slot
    h = s.wait_health(lambda h: h["queue"]["waiting"] == 1)
    assert h["queue"]["running"] == 4 and h["slots"]["busy"] == 4
    running[0].close()
    next(iter(waiting))                                   # it has a slot now
    h = s.wait_health(lambda h: h["queue"]["waiting"] == 0)
    assert h["queue"]["running"] == 4
    for stream in running[1:]:
        next(iter(stream))                                # the others still stream
    for stream in [*running[1:], waiting]:
        stream.close()
    s.wait_health(lambda h: h["queue"]["running"] == 0)
