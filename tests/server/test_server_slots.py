"""`serve --slot-save-path DIR` (edgellama/slot_files.py, Engine.save_slot/restore_slot/
erase_slot, Engine._prepare): POST /slots/{id}?action=save|restore|erase, hostile file
names, and the spill of evicted conversations' caches and their restore.

The ASGI app runs in this process (tests/server_asgi.py) on test_server's tiny F32 chat
model, whose replies do not depend on how its cache was filled, so a restored cache must
give exactly the reply a fresh read gives.
"""
from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

import edgellama
from edgellama import prompt_cache
from edgellama.server import engine as srv
from edgellama.slot_files import SlotFiles
from server_asgi import ServerUnderTest, tiny_chat_model
from tiny_gguf import TINY_VOCAB, write_tiny_gguf

COMPLETIONS = "/v1/completions"
A = "once upon a time " * 8
B = "the end of the story " * 8


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return tiny_chat_model(tmp_path_factory.mktemp("slots"))


def complete(app: ServerUnderTest, prompt: str, n: int = 8) -> dict:
    r = app.request("POST", COMPLETIONS, {"prompt": prompt, "max_tokens": n, "temperature": 0})
    assert r.status == 200, r.body[:300]
    return r.json()


def slot(app: ServerUnderTest, index: int, action: str, filename=None, **kw):
    body = {} if filename is None else {"filename": filename}
    return app.request("POST", f"/slots/{index}?action={action}", body, **kw)


def tree(root: Path) -> dict[str, bytes | str]:
    """Every entry under root: a file's bytes, a link's target."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            out[rel] = f"-> {os.readlink(p)}" if p.is_symlink() else \
                (p.read_bytes() if p.is_file() else "dir")
    return out


@pytest.fixture
def served(model, tmp_path):
    folder = tmp_path / "slots"
    app = ServerUnderTest(model, {"parallel": 1, "slot_save_path": str(folder)})
    yield app, folder
    app.close()


def test_save_restore_round_trip_gives_the_original_continuation(served):
    app, folder = served
    first = complete(app, A)
    n = app.request("GET", "/slots").json()[0]["n_cached"]
    r = slot(app, 0, "save", "a.prompt")
    assert r.status == 200, r.body
    saved = r.json()
    assert saved["id_slot"] == 0 and saved["filename"] == "a.prompt" and saved["n_saved"] == n
    assert saved["n_written"] == (folder / "a.prompt").stat().st_size > 0
    assert saved["timings"]["save_ms"] >= 0
    complete(app, B)                                   # the slot now holds another prompt
    assert slot(app, 0, "erase").status == 200 and app_slots(app)[0]["n_cached"] == 0
    r = slot(app, 0, "restore", "a.prompt")
    assert r.status == 200, r.body
    restored = r.json()
    assert restored["n_restored"] == n and restored["n_read"] == saved["n_written"]
    assert restored["filename"] == "a.prompt" and "restore_ms" in restored["timings"]
    again = complete(app, A)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == \
        again["usage"]["prompt_tokens"] - 1
    assert again["choices"][0]["text"] == first["choices"][0]["text"]


def app_slots(app):
    return app.request("GET", "/slots").json()


def test_erase_clears_the_slot(served):
    app, _ = served
    complete(app, A)
    n = app_slots(app)[0]["n_cached"]
    assert n > 0
    r = slot(app, 0, "erase")
    assert r.status == 200 and r.json() == {"id_slot": 0, "n_erased": n}
    assert app_slots(app) == [{"id": 0, "is_processing": False, "n_ctx": 256, "n_cached": 0}]
    again = complete(app, A)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_restore_refuses_another_models_file_a_damaged_one_and_a_missing_one(served, tmp_path):
    app, folder = served
    other_path = write_tiny_gguf(tmp_path / "other.gguf", "F32", vocab=TINY_VOCAB, ctx=256,
                                 tokenizer=True, tied=False, seed=5)
    other = ServerUnderTest(other_path, {"parallel": 1, "slot_save_path": str(folder)})
    try:
        complete(other, A)
        assert slot(other, 0, "save", "other.prompt").status == 200
    finally:
        other.close()
    complete(app, A)
    assert slot(app, 0, "save", "mine.prompt").status == 200
    before = app_slots(app)[0]["n_cached"]

    r = slot(app, 0, "restore", "other.prompt")
    assert r.status == 400 and "was saved with the model other.gguf" in r.error()["message"]
    assert str(folder) not in r.error()["message"]       # the client's name, not the path

    data = bytearray((folder / "mine.prompt").read_bytes())
    data[-100] ^= 0xFF
    (folder / "bad.prompt").write_bytes(bytes(data))
    r = slot(app, 0, "restore", "bad.prompt")
    assert r.status == 400 and "does not match its checksum" in r.error()["message"]
    (folder / "junk.prompt").write_bytes(b"hello")
    r = slot(app, 0, "restore", "junk.prompt")
    assert r.status == 400 and "not a saved prompt" in r.error()["message"]

    r = slot(app, 0, "restore", "absent.prompt")
    assert r.status == 404 and r.error()["code"] == "file_not_found"
    assert app_slots(app)[0]["n_cached"] == before          # every refusal left the slot


HOSTILE = ["", "../escape.prompt", "/tmp/escape.prompt", "sub/x.prompt", "a\\b.prompt", "..",
           ".hidden", "a\x00b.prompt", "x" * 200, "a..b", " lead", "link-out.prompt",
           123, None, ["a"], {"a": 1}]


def test_hostile_file_names_are_refused_and_touch_nothing(served, tmp_path):
    app, folder = served
    outside = tmp_path / "outside"
    outside.mkdir()
    complete(app, A)
    assert slot(app, 0, "save", "victim.prompt").status == 200
    (folder / "victim.prompt").rename(outside / "victim.prompt")   # a real saved prompt
    (outside / "escape.prompt").write_bytes(b"keep me")
    (folder / "link-out.prompt").symlink_to(outside / "victim.prompt")
    (folder / "notes.txt").write_bytes(b"not a prompt")
    (folder / "link-in.prompt").symlink_to(folder / "notes.txt")
    before_out, before_in = tree(outside), tree(folder)
    for name in HOSTILE:
        for action in ("save", "restore"):
            r = app.request("POST", f"/slots/0?action={action}", {"filename": name})
            assert r.status == 400, (name, action, r.status, r.body[:200])
            assert r.error()["param"] == "filename", r.error()
    # a save never takes the server's spill names, nor replaces what is not a saved
    # prompt, nor a link
    for name in ("spill-0123.prompt", "notes.txt", "link-in.prompt"):
        r = slot(app, 0, "save", name)
        assert r.status == 400 and r.error()["param"] == "filename", r.body
    assert tree(outside) == before_out and tree(folder) == before_in
    assert not list(folder.glob(".edgellama-prompt-*"))


def test_slot_ids_and_actions_are_checked(served):
    app, _ = served
    for path in ("/slots/1?action=erase", "/slots/-1?action=erase", "/slots/x?action=erase",
                 "/slots/%D9%A3?action=erase"):
        assert app.request("POST", path, {}).status == 400, path
    r = app.request("POST", "/slots/0?action=delete", {})
    assert r.status == 400 and r.error()["param"] == "action"
    assert app.request("POST", "/slots/0?action=save", {}).status == 400   # no filename


def test_a_busy_slot_is_refused(served, monkeypatch):
    app, folder = served
    complete(app, A)
    assert slot(app, 0, "save", "a.prompt").status == 200
    model = app.llm.model
    decode = model.decode

    def slow(*args, **kw):
        time.sleep(0.01)
        return decode(*args, **kw)
    monkeypatch.setattr(model, "decode", slow)

    async def both():
        long = asyncio.ensure_future(app._call(
            "POST", COMPLETIONS, b'{"prompt": "hello", "max_tokens": 200, "temperature": 0}',
            [(b"host", b"127.0.0.1:8080"), (b"content-type", b"application/json")], 60))
        while not app.server.engine.slot_list()[0]["is_processing"]:
            await asyncio.sleep(0.005)
        answers = [await app._call("POST", f"/slots/0?action={a}", b'{"filename": "a.prompt"}',
                                   [(b"host", b"127.0.0.1:8080")], 20)
                   for a in ("restore", "save", "erase")]
        assert app.server.engine.slot_list()[0]["is_processing"]   # still running
        return answers, await long
    answers, long = app.loop.run_until_complete(both())
    assert [r.status for r in answers] == [409, 409, 409]
    assert all(r.error()["code"] == "slot_busy" for r in answers)
    assert long.status == 200 and long.json()["usage"]["completion_tokens"] > 0


def test_without_the_option_the_actions_answer_501(model):
    app = ServerUnderTest(model, {"parallel": 1})
    try:
        r = slot(app, 0, "save", "a.prompt")
        assert r.status == 501 and "--slot-save-path" in r.error()["message"]
        assert app.request("GET", "/slots").status == 200
    finally:
        app.close()


def test_slots_need_the_api_key(model, tmp_path):
    app = ServerUnderTest(model, {"parallel": 1, "api_key": "k", "slot_save_path": str(tmp_path)})
    try:
        assert slot(app, 0, "erase").status == 401
        assert app.request("GET", "/slots").status == 401
        assert slot(app, 0, "erase", headers={"authorization": "Bearer k",
                                               "content-type": "application/json"}).status == 200
    finally:
        app.close()


# -- spill ------------------------------------------------------------------------------------

def _spilling_server(model, folder, monkeypatch) -> ServerUnderTest:
    """One slot, spilling into `folder` every evicted cache of 16 tokens or more."""
    monkeypatch.setattr(srv, "SPILL_MIN", 16)
    return ServerUnderTest(model, {"parallel": 1, "slot_save_path": str(folder),
                                   "slot_spill_max": 1 << 30})


def test_an_evicted_conversation_is_spilled_and_restored(model, tmp_path, monkeypatch):
    folder = tmp_path / "slots"
    app = _spilling_server(model, folder, monkeypatch)
    fresh = ServerUnderTest(model, {"parallel": 1})
    try:
        files = app.server.engine.files
        complete(app, A)
        assert files.spilled() == []
        complete(app, B)                            # evicts A: spilled
        [a_file] = files.spilled()
        assert (folder / a_file).is_file() and a_file.startswith("spill-")
        follow = A + "and then"                     # continues A's conversation
        got = complete(app, follow)
        assert len(files.spilled()) == 2            # B spilled in turn
        usage = got["usage"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert cached >= len(app.llm.tokenizer.encode(A)) - 2   # read from A's file
        want = complete(fresh, follow)
        assert want["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
        assert sorted(p.name for p in folder.iterdir()) == sorted(files.spilled())
    finally:
        app.close()
        fresh.close()


def test_a_damaged_spill_file_costs_only_a_read(model, tmp_path, monkeypatch):
    folder = tmp_path / "slots"
    app = _spilling_server(model, folder, monkeypatch)
    try:
        first = complete(app, A)
        complete(app, B)
        [a_file] = app.server.engine.files.spilled()
        (folder / a_file).write_bytes(b"EDGEKVC\0garbage")
        again = complete(app, A)
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert a_file not in app.server.engine.files.spilled()
        assert [r.levelname for r in app.log.records] == ["WARNING"]
        app.log.records.clear()
    finally:
        app.close()


def _filled(llm, ids: list[int]):
    seq = llm.model.new_sequence()
    llm.model.forward(ids, seq)
    return seq


def test_the_spill_bound_removes_the_oldest_and_only_spill_files(model, tmp_path):
    llm = edgellama.load(str(model), ctx=256, threads=1)
    folder = tmp_path / "slots"
    folder.mkdir()
    (folder / "mine.prompt").write_bytes(b"a user's file")
    seqs = [_filled(llm, [t] * 30) for t in (10, 11, 12, 13)]    # caches of one size
    probe = SlotFiles(tmp_path / "probe", 1 << 30)
    probe.spill(seqs[0], llm.model)
    size = probe.spilled_bytes
    files = SlotFiles(folder, spill_max=2 * size)
    names = []
    for seq in seqs:
        files.spill(seq, llm.model)
        names.append(files.spilled()[-1])
        assert files.spilled_bytes <= 2 * size
    assert files.spilled() == names[-2:]            # the oldest went first
    assert sorted(p.name for p in folder.iterdir()) == sorted(names[-2:] + ["mine.prompt"])
    assert (folder / "mine.prompt").read_bytes() == b"a user's file"
    # the best match: the spilled cache a prompt continues, not one it does not
    ids = seqs[3].tokens + [5, 6]
    assert files.best(ids) == (names[3], len(seqs[3].tokens))
    assert files.best(seqs[0].tokens) is None
    # a spill that continues a spilled cache replaces it: the same conversation, longer
    longer = _filled(llm, [13] * 30 + [20, 21])
    files.spill(longer, llm.model)
    assert names[3] not in files.spilled() and not (folder / names[3]).exists()
    names[3] = files.spilled()[-1]
    seqs[3] = longer
    # a new run adopts the earlier run's spill files under its own bound
    again = SlotFiles(folder, spill_max=(folder / names[3]).stat().st_size)
    assert again.spilled() == names[-1:] and not (folder / names[-2]).exists()
    assert prompt_cache.load(folder / names[-1], llm.model.new_sequence(), llm.model).tokens \
        == seqs[3].tokens


def test_an_action_whose_client_left_is_skipped_and_the_engine_goes_on(model):
    llm = edgellama.load(str(model), ctx=256, threads=1)
    engine = srv.Engine(llm, 4, 1)
    try:
        ran = []
        busy = engine.run(lambda: time.sleep(0.3))          # holds the engine thread
        gone = engine.run(lambda: ran.append("gone"))
        assert gone.cancel()                                  # as wrap_future does on a disconnect
        assert engine.run(lambda: ran.append("next")).result(10) is None
        assert busy.done() and ran == ["next"]
    finally:
        engine.close()
