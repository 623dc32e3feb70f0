"""The server's own storage failing under `serve --slot-save-path DIR` (issue 35, class 5):
the folder replaced by a file, removed, made unwritable, or the disk full while the
server runs. A save then answers 507 (the server cannot store what the request needs),
a restore 503, each a JSON error naming the problem (not the server's paths), the
failure logged once in one line without a traceback, and the slot keeps its cache and
goes on serving; once the folder is back, saves and restores work again. A client's
bad file stays a 4xx.
"""
from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest

from edgellama import slot_files
from edgellama.errors import EdgeError
from edgellama.server import engine as srv
from server_asgi import ServerUnderTest, tiny_chat_model
from test_server_slots import A, B, _spilling_server, complete, slot


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    path = tiny_chat_model(tmp_path_factory.mktemp("storage"))
    # kernels compiled before the clock runs (a cold cache takes longer than a request may)
    app = ServerUnderTest(path)
    try:
        r = app.request("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2},
                        timeout=600)
        assert r.status == 200, r.body[:300]
    finally:
        app.close()
    return path


@pytest.fixture
def served(model, tmp_path):
    folder = tmp_path / "slots"
    app = ServerUnderTest(model, {"parallel": 1, "slot_save_path": str(folder)})
    yield app, folder
    app.close()


def storage_error(r, status: int, folder: Path, says: str) -> dict:
    assert r.raised is None and r.status == status, (r.status, r.body[:300])
    error = r.error()
    assert error["type"] == "server_error" and error["code"] == "storage_failed", error
    assert error["param"] == "filename" and says in error["message"], error
    assert "\n" not in error["message"] and str(folder) not in error["message"], error
    return error


def logged(app: ServerUnderTest) -> list[str]:
    """The lines logged since the last call: each one line, without a traceback."""
    records, app.log.records[:] = list(app.log.records), []
    for r in records:
        assert r.exc_info is None and "\n" not in r.getMessage(), r.getMessage()
    return [r.getMessage() for r in records]


def cached(app: ServerUnderTest) -> int:
    return app.request("GET", "/slots").json()[0]["n_cached"]


def test_folder_replaced_by_a_file(served):
    app, folder = served
    complete(app, A)
    assert slot(app, 0, "save", "a.prompt").status == 200
    kept = cached(app)
    shutil.rmtree(folder)
    folder.write_bytes(b"the user's file")
    for _ in range(2):
        storage_error(slot(app, 0, "save", "b.prompt"), 507, folder, "not a folder any more")
        storage_error(slot(app, 0, "restore", "a.prompt"), 503, folder, "not a folder any more")
    lines = logged(app)
    assert len(lines) == 1 and str(folder) in lines[0], lines   # once, for the operator
    assert folder.read_bytes() == b"the user's file"           # nothing of it replaced
    # the slot kept its cache and serves: the same prompt reuses it
    assert cached(app) == kept
    again = complete(app, A)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    # the folder back: saving and restoring work again
    folder.unlink()
    folder.mkdir()
    assert slot(app, 0, "save", "b.prompt").status == 200
    complete(app, B)
    r = slot(app, 0, "restore", "b.prompt")
    assert r.status == 200 and cached(app) == r.json()["n_restored"]
    assert logged(app) == []


def test_folder_removed(served):
    app, folder = served
    complete(app, A)
    shutil.rmtree(folder)
    storage_error(slot(app, 0, "save", "a.prompt"), 507, folder, "cannot be reached")
    storage_error(slot(app, 0, "restore", "a.prompt"), 503, folder, "cannot be reached")
    assert len(logged(app)) == 1
    assert not folder.exists()        # a save does not make it again behind the operator
    assert complete(app, A)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_folder_made_unwritable(served, monkeypatch):
    app, folder = served
    complete(app, A)
    assert slot(app, 0, "save", "a.prompt").status == 200
    folder.chmod(0o500)
    if os.geteuid() == 0:   # root writes into any folder: its access check answers as
        real = os.access    # a read-only mount's would
        monkeypatch.setattr(slot_files.os, "access", lambda p, mode: real(p, mode) and not (
            Path(p) == app.server.engine.files.folder and mode & os.W_OK))
    try:
        storage_error(slot(app, 0, "save", "b.prompt"), 507, folder, "cannot be written")
        assert slot(app, 0, "restore", "a.prompt").status == 200   # reading still works
    finally:
        folder.chmod(0o700)
    assert len(logged(app)) == 1


def test_folder_made_unreadable(served, monkeypatch):
    app, folder = served
    complete(app, A)
    assert slot(app, 0, "save", "a.prompt").status == 200
    folder.chmod(0o300)
    if os.geteuid() == 0:   # root reads any folder: answer as a failing mount would
        real = os.access
        monkeypatch.setattr(slot_files.os, "access", lambda p, mode: real(p, mode) and not (
            Path(p) == app.server.engine.files.folder and mode & os.R_OK))
    try:
        storage_error(slot(app, 0, "restore", "a.prompt"), 503, folder, "cannot be read")
    finally:
        folder.chmod(0o700)
    assert len(logged(app)) == 1


def test_a_failing_look_at_the_file_is_the_storage(served, monkeypatch):
    app, folder = served
    complete(app, A)

    def denied(self):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(slot_files.Path, "exists", denied)
    storage_error(slot(app, 0, "restore", "a.prompt"), 503, folder, "Permission denied")
    assert len(logged(app)) == 1


def _failing(err: int):
    """prompt_cache.save/load as they fail on a full disk or a read error: the OSError
    turned into their one-line EdgeError."""
    def fail(path, *args):
        try:
            raise OSError(err, os.strerror(err))
        except OSError as e:
            raise EdgeError(f"cannot write {path}: {e.strerror}") from None
    return fail


def test_disk_full_and_read_errors(served, monkeypatch):
    app, folder = served
    complete(app, A)
    assert slot(app, 0, "save", "a.prompt").status == 200
    kept = cached(app)
    monkeypatch.setattr(srv.prompt_cache, "save", _failing(errno.ENOSPC))
    monkeypatch.setattr(srv.prompt_cache, "load", _failing(errno.EIO))
    error = storage_error(slot(app, 0, "save", "a.prompt"), 507, folder,
                          "No space left on device")
    assert "a.prompt" in error["message"]                     # the client's name for it
    storage_error(slot(app, 0, "save", "a.prompt"), 507, folder, "No space left on device")
    storage_error(slot(app, 0, "restore", "a.prompt"), 503, folder, "Input/output error")
    assert len(logged(app)) == 2                               # each problem once
    assert cached(app) == kept
    monkeypatch.undo()
    assert slot(app, 0, "save", "a.prompt").status == 200


def test_a_bad_file_of_the_client_stays_a_400(served):
    app, folder = served
    complete(app, A)
    (folder / "junk.prompt").write_bytes(b"hello")
    r = slot(app, 0, "restore", "junk.prompt")
    assert r.status == 400 and r.error()["code"] == "restore_failed"
    assert logged(app) == []


def test_spills_into_a_broken_folder_log_once_and_answer(model, tmp_path, monkeypatch):
    folder = tmp_path / "slots"
    app = _spilling_server(model, folder, monkeypatch)
    try:
        complete(app, A)
        shutil.rmtree(folder)
        folder.write_bytes(b"")
        for prompt in (B, A, B):          # each evicts the other: a spill that fails
            assert complete(app, prompt)["choices"][0]["finish_reason"] == "length"
        lines = logged(app)
        assert len(lines) == 1 and "not spilled" in lines[0], lines
    finally:
        app.close()
