"""Models from the Hugging Face Hub (-hf REPO[:QUANT], short names, convert REPO, list, rm).

The hub is not reachable from CI, so FakeHub serves the few routes huggingface_hub 2.x uses
(GET /api/models/R/tree/REV and /api/models/R/revision/REV, HEAD and GET /R/resolve/REV/F)
on a local port, and the real library does the downloading: HF_ENDPOINT points it there,
HF_HOME keeps its cache in a temporary directory."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from edgellama import hub
from edgellama.errors import EdgeError
from hf_fixtures import write_tiny_llama
from tiny_gguf import TINY_VOCAB, write_tiny_gguf

EXE = shutil.which("edgellama")
COMMIT = "0123456789abcdef0123456789abcdef01234567"
TOKEN = "hf_testtoken"


class FakeHub:
    """repos: repo id -> {path in repo: bytes}; gated repos answer 401 to file requests
    without `Authorization: Bearer TOKEN`, as the hub does. Every request is recorded."""

    def __init__(self):
        self.repos: dict[str, dict[str, bytes]] = {}
        self.gated: set[str] = set()
        self.requests: list[tuple[str, str]] = []
        hub_ = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_HEAD(self):
                hub_.handle(self, head=True)

            def do_GET(self):
                hub_.handle(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()

    def handle(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        path = h.path.split("?", 1)[0]
        self.requests.append((h.command, path))
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/(tree|revision)/([^/]+))?", path):
            repo, kind = m[1], m[2]
            if repo not in self.repos:
                return self.send(h, 404, b'{"error":"Repository not found"}', head,
                                 {"X-Error-Code": "RepoNotFound"})
            files = self.repos[repo]
            if kind == "tree":
                body = [{"type": "file", "oid": hashlib.sha1(data).hexdigest(), "size": len(data),
                         "path": name} for name, data in sorted(files.items())]
            else:
                body = {"id": repo, "sha": COMMIT, "siblings": [{"rfilename": n} for n in sorted(files)]}
            return self.send(h, 200, json.dumps(body).encode(), head,
                             {"Content-Type": "application/json"})
        if m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
            repo, name = m[1], m[3]
            if repo not in self.repos:
                return self.send(h, 404, b"", head, {"X-Error-Code": "RepoNotFound"})
            if repo in self.gated and h.headers.get("Authorization") != f"Bearer {TOKEN}":
                return self.send(h, 401, b"", head, {
                    "X-Error-Code": "GatedRepo",
                    "X-Error-Message": f"Access to model {repo} is restricted."})
            data = self.repos[repo].get(name)
            if data is None:
                return self.send(h, 404, b"", head, {"X-Error-Code": "EntryNotFound",
                                                     "X-Repo-Commit": COMMIT})
            headers = {"X-Repo-Commit": COMMIT, "Accept-Ranges": "bytes",
                       "ETag": f'"{hashlib.sha256(data).hexdigest()}"'}
            status = 200
            if rng := re.fullmatch(r"bytes=(\d+)-", h.headers.get("Range", "")):
                data, status = data[int(rng[1]):], 206
            return self.send(h, status, data, head, headers)
        self.send(h, 404, b"", head)

    @staticmethod
    def send(h, status: int, body: bytes, head: bool, headers: dict | None = None) -> None:
        h.send_response(status)
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if not head:
            h.wfile.write(body)

    def downloads(self) -> list[str]:
        return [p for method, p in self.requests if method == "GET" and "/resolve/" in p]


@pytest.fixture(scope="module")
def gguf_bytes(tmp_path_factory) -> dict[str, bytes]:
    d = tmp_path_factory.mktemp("ggufs")
    out = {}
    for qtype in ("Q8_0", "Q4_0"):
        p = write_tiny_gguf(d / f"{qtype}.gguf", qtype, dim=32, layers=1, heads=2, kv_heads=1,
                            ffn=32, vocab=TINY_VOCAB, ctx=64, tokenizer=True)
        out[qtype] = p.read_bytes()
    return out


@pytest.fixture
def fake(gguf_bytes):
    f = FakeHub()
    f.repos["tester/Tiny-GGUF"] = {
        "README.md": b"# tiny\n",
        "Tiny-Q4_0.gguf": gguf_bytes["Q4_0"],
        "Tiny-Q8_0.gguf": gguf_bytes["Q8_0"],
        "mmproj-Tiny-Q4_0.gguf": b"not a model",
    }
    yield f
    f.close()


@pytest.fixture
def env(fake, tmp_path) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    e.update(HF_ENDPOINT=fake.url, HF_HOME=str(tmp_path / "hf"), HF_HUB_DISABLE_TELEMETRY="1",
             NUMBA_NUM_THREADS="2")
    return e


def run(env, *args, input=None) -> subprocess.CompletedProcess:
    return subprocess.run([EXE, *map(str, args)], capture_output=True, text=True, env=env,
                          input=input, timeout=600)


def error_line(res) -> str:
    assert res.returncode == 1, (res.stdout, res.stderr)
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    return lines[0]


# -- choosing the file: llama.cpp's rule ----------------------------------------------------

BARTOWSKI = ["README.md", "Llama-3.2-1B-Instruct-IQ3_M.gguf", "Llama-3.2-1B-Instruct-Q3_K_L.gguf",
             "Llama-3.2-1B-Instruct-Q4_0.gguf", "Llama-3.2-1B-Instruct-Q4_K_M.gguf",
             "Llama-3.2-1B-Instruct-Q4_K_S.gguf", "Llama-3.2-1B-Instruct-Q8_0.gguf",
             "Llama-3.2-1B-Instruct-f16.gguf", "Llama-3.2-1B-Instruct.imatrix"]


@pytest.mark.parametrize("quant, expected", [
    ("Q4_K_M", "Llama-3.2-1B-Instruct-Q4_K_M.gguf"),
    ("q4_k_s", "Llama-3.2-1B-Instruct-Q4_K_S.gguf"),     # any case
    ("Q4_0", "Llama-3.2-1B-Instruct-Q4_0.gguf"),
    ("F16", "Llama-3.2-1B-Instruct-f16.gguf"),
    (None, "Llama-3.2-1B-Instruct-Q4_K_M.gguf"),          # the default
])
def test_pick_file_follows_llama_cpp(quant, expected):
    assert hub.pick_file("r/x", BARTOWSKI, quant) == expected


def test_pick_file_defaults_fall_back_to_q8_0_then_the_first_model():
    files = ["a-mmproj-f16.gguf", "m-F16.gguf", "m-Q8_0.gguf"]
    assert hub.pick_file("r/x", files, None) == "m-Q8_0.gguf"
    assert hub.pick_file("r/x", ["mmproj-m-f16.gguf", "m-F16.gguf", "m-Q6_K.gguf"], None) == "m-F16.gguf"


def test_pick_file_without_the_quant_lists_what_there_is():
    with pytest.raises(EdgeError, match=r"r/x has no GGUF file for quant Q5_K_M; available: IQ3_M, "
                                        r"Q3_K_L, Q4_0, Q4_K_M, Q4_K_S, Q8_0, F16$"):
        hub.pick_file("r/x", BARTOWSKI, "Q5_K_M")


def test_pick_file_refuses_split_models_and_checkpoints():
    files = [f"m-Q8_0-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    with pytest.raises(EdgeError, match="m-Q8_0-00001-of-00003.gguf is split in 3 parts.*--merge"):
        hub.pick_file("r/x", files, "Q8_0")
    with pytest.raises(EdgeError, match=r"no GGUF model file; .*edgellama convert r/x -o OUT.gguf"):
        hub.pick_file("r/x", ["config.json", "model.safetensors"], None)


def test_references_and_short_names():
    assert hub.parse_ref("llama3.2:1b") == ("bartowski/Llama-3.2-1B-Instruct-GGUF", "Q4_K_M")
    assert hub.parse_ref("LLAMA3.2:3B") == ("bartowski/Llama-3.2-3B-Instruct-GGUF", "Q4_K_M")
    assert hub.parse_ref("owner/repo.x-GGUF:q5_k_m") == ("owner/repo.x-GGUF", "q5_k_m")
    assert hub.parse_ref("owner/repo") == ("owner/repo", None)
    for not_ref in ("hello world", "a/b/c", "tell me a story", "model.gguf", "/abs/path"):
        assert hub.parse_ref(not_ref) is None, not_ref
    assert hub.is_repo_id("owner/repo") and not hub.is_repo_id("owner/repo:Q4_0")


# -- downloading through the real huggingface_hub ---------------------------------------------

def test_hf_quant_downloads_that_file_then_runs_from_the_cache(fake, env, tmp_path):
    res = run(env, "generate", "-hf", "tester/Tiny-GGUF:q4_0", "-p", "hello", "-n", "3")
    assert res.returncode == 0, res.stderr
    assert fake.downloads() == ["/tester/Tiny-GGUF/resolve/main/Tiny-Q4_0.gguf"]
    blobs = list((tmp_path / "hf" / "hub" / "models--tester--Tiny-GGUF" / "blobs").iterdir())
    assert [b.read_bytes() == fake.repos["tester/Tiny-GGUF"]["Tiny-Q4_0.gguf"] for b in blobs] == [True]

    fake.requests.clear()        # second run: the cache, and no request at all
    res = run(env, "generate", "tester/Tiny-GGUF:Q4_0", "hello", "-n", "3")   # positional
    assert res.returncode == 0, res.stderr
    assert fake.requests == []
    assert "prompt:" in res.stderr


def test_offline_picks_among_cached_files(fake, env):
    assert run(env, "generate", "-hf", "tester/Tiny-GGUF:Q8_0", "-p", "hi", "-n", "2").returncode == 0
    fake.close()                 # the hub is gone: a reference without quant uses the cache
    res = run(env, "generate", "-hf", "tester/Tiny-GGUF", "-p", "hi", "-n", "2")
    assert res.returncode == 0, res.stderr
    res = run({**env, "HF_HUB_OFFLINE": "1"}, "generate", "-hf", "tester/Tiny-GGUF", "-p", "hi", "-n", "2")
    assert res.returncode == 0, res.stderr
    res = run(env, "generate", "-hf", "tester/Tiny-GGUF:Q4_0", "-p", "hi", "-n", "2")
    assert error_line(res) == (f"error: cannot reach Hugging Face ({fake.url}), and its cache "
                               f"holds no Q4_0 file of tester/Tiny-GGUF (cached: Q8_0)")
    res = run(env, "generate", "-hf", "tester/Other-GGUF", "-p", "hi")
    assert "error: cannot reach Hugging Face" in error_line(res) and "not in the cache" in res.stderr
    assert "Retrying" not in res.stderr       # one attempt, not half a minute of back-off


def test_missing_quant_lists_the_available_ones(fake, env):
    res = run(env, "generate", "-hf", "tester/Tiny-GGUF:Q5_K_M", "-p", "hi")
    assert error_line(res) == ("error: tester/Tiny-GGUF has no GGUF file for quant Q5_K_M; "
                               "available: Q4_0, Q8_0")
    assert fake.downloads() == []


def test_unknown_repo_and_gated_repo_say_what_to_do(fake, env):
    line = error_line(run(env, "chat", "-hf", "nobody/Nothing-GGUF"))
    assert "nobody/Nothing-GGUF: no such model on Hugging Face" in line and "HF_TOKEN" in line
    fake.repos["meta/Gated-GGUF"] = dict(fake.repos["tester/Tiny-GGUF"])
    fake.gated.add("meta/Gated-GGUF")
    line = error_line(run(env, "generate", "-hf", "meta/Gated-GGUF:Q8_0", "-p", "hi"))
    assert "meta/Gated-GGUF is gated" in line and "set HF_TOKEN" in line
    line = error_line(run({**env, "HF_TOKEN": "hf_wrong"}, "generate", "-hf", "meta/Gated-GGUF:Q8_0",
                          "-p", "hi"))
    assert "the current HF_TOKEN has no access" in line
    res = run({**env, "HF_TOKEN": TOKEN}, "generate", "-hf", "meta/Gated-GGUF:Q8_0", "-p", "hi", "-n", "2")
    assert res.returncode == 0, res.stderr


def test_model_named_twice_or_unknown_is_refused(env, tmp_path):
    res = run(env, "generate", "-m", tmp_path / "a.gguf", "-hf", "tester/Tiny-GGUF", "-p", "hi")
    assert res.returncode == 2 and "name the model once" in res.stderr
    line = error_line(run(env, "chat", "no-such-model"))
    assert "no-such-model: no such file, and not a Hugging Face reference" in line


def test_convert_from_a_repo_id_fetches_only_what_it_reads(fake, env, tmp_path, llama3_tokenizer_dir):
    ckpt = write_tiny_llama(tmp_path / "ckpt", tokenizer_dir=llama3_tokenizer_dir, layers=1)
    files = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    fake.repos["tester/Tiny-Llama"] = files | {"original/consolidated.00.pth": b"x" * 1000,
                                               "README.md": b"# hi\n"}
    out = tmp_path / "tiny.gguf"
    res = run(env, "convert", "tester/Tiny-Llama", "-o", out, "--type", "q8_0")
    assert res.returncode == 0, res.stderr
    fetched = sorted(p.rsplit("/", 1)[1] for p in fake.downloads())
    assert fetched == sorted(files) and "tokenizer.json" in fetched
    import edgellama
    llm = edgellama.load(out)
    from edgellama.gguf import GGUFFile
    assert GGUFFile(out).get("general.name") == "Tiny-Llama"
    assert llm.tokenizer.encode("hello")
    listed = run(env, "list").stdout.splitlines()
    assert listed[1].split()[::3] == ["tester/Tiny-Llama", "checkpoint"], listed
    assert run(env, "rm", "-y", "tester/Tiny-Llama").returncode == 0
    assert not (tmp_path / "hf" / "hub" / "models--tester--Tiny-Llama").exists()
    line = error_line(run(env, "convert", "tester/Nothing", "-o", tmp_path / "x.gguf"))
    assert "tester/Nothing: no such model on Hugging Face" in line
    fake.repos["meta/Gated-Llama"] = files
    fake.gated.add("meta/Gated-Llama")
    line = error_line(run(env, "convert", "meta/Gated-Llama", "-o", tmp_path / "x.gguf"))
    assert "meta/Gated-Llama is gated" in line and "HF_TOKEN" in line
    assert not (tmp_path / "x.gguf").exists()


# -- list and rm -------------------------------------------------------------------------------

def test_list_shows_cached_models_and_rm_removes_one(fake, env, tmp_path, gguf_bytes):
    import numba
    env = {**env, "EDGELLAMA_CACHE": str(tmp_path / "own"), "NUMBA_CACHE_DIR": numba.config.CACHE_DIR}
    (tmp_path / "own").mkdir()
    (tmp_path / "own" / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(gguf_bytes["Q8_0"])
    res = run(env, "list")
    assert res.returncode == 0 and res.stdout.splitlines()[1:] == [
        f"SmolLM2-135M-Instruct.Q4_1.gguf  {len(gguf_bytes['Q8_0']) / 1e3:>6.1f} kB  gguf (default model)"]
    assert str(tmp_path / "hf" / "hub") in res.stderr and str(tmp_path / "own") in res.stderr
    for quant in ("Q4_0", "Q8_0"):
        assert run(env, "generate", "-hf", f"tester/Tiny-GGUF:{quant}", "-p", "hi", "-n", "1").returncode == 0
    names = [ln.split()[0] for ln in run(env, "list").stdout.splitlines()[1:]]
    assert names == ["tester/Tiny-GGUF:Q4_0", "tester/Tiny-GGUF:Q8_0", "SmolLM2-135M-Instruct.Q4_1.gguf"]

    line = error_line(run(env, "rm", "-y", "tester/Tiny-GGUF:Q5_K_M"))
    assert "no model named tester/Tiny-GGUF:Q5_K_M in the caches" in line
    res = run(env, "rm", "tester/Tiny-GGUF:Q4_0", input="n\n")
    assert res.returncode == 1 and "remove tester/Tiny-GGUF:Q4_0 (" in res.stderr
    res = run(env, "rm", "tester/Tiny-GGUF:Q4_0", input="y\n")
    assert res.returncode == 0 and "removed tester/Tiny-GGUF:Q4_0" in res.stderr
    names = [ln.split()[0] for ln in run(env, "list").stdout.splitlines()[1:]]
    assert names == ["tester/Tiny-GGUF:Q8_0", "SmolLM2-135M-Instruct.Q4_1.gguf"]
    repo = tmp_path / "hf" / "hub" / "models--tester--Tiny-GGUF"
    assert len(list((repo / "blobs").iterdir())) == 1      # the Q4_0 blob went with it

    assert run(env, "rm", "-y", "tester/Tiny-GGUF:Q8_0", "SmolLM2-135M-Instruct.Q4_1.gguf").returncode == 0
    assert not repo.exists() and not (tmp_path / "own" / "SmolLM2-135M-Instruct.Q4_1.gguf").exists()
    assert run(env, "list").stdout.startswith("no models yet.")


def test_on_a_terminal_the_download_shows_a_bar_and_rm_asks(fake, env):
    import pexpect
    child = pexpect.spawn(EXE, ["generate", "-hf", "tester/Tiny-GGUF:Q8_0", "-p", "hi", "-n", "1"],
                          env=env, timeout=120, encoding="utf-8")
    child.expect(r"Tiny-Q8_0\.gguf: 100%")          # huggingface_hub's progress bar
    child.expect("prompt: ")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    child = pexpect.spawn(EXE, ["rm", "tester/Tiny-GGUF:Q8_0"], env=env, timeout=60, encoding="utf-8")
    child.expect(r"remove tester/Tiny-GGUF:Q8_0 \(\d+\.\d kB\)\? \[y/N\]")
    child.sendline("y")
    child.expect("removed tester/Tiny-GGUF:Q8_0")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
