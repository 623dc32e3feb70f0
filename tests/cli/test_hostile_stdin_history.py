"""Hostile input, round three (issue 30): standard input that is closed (a daemon's
`0<&-`), /dev/null or an empty pipe gives `chat` and `generate` one error saying there is
no input and how to give a prompt; a chat history file that cannot be read (not UTF-8, a
folder, a FIFO, a dangling link, no permission) is left exactly as it is, with one warning,
and the session's history is kept in memory only."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pexpect
import pytest

from edgellama.cli import chat_input
from edgellama.kernels.jit import kernel_cache_dir

EXE = shutil.which("edgellama")
ENV = dict(os.environ, NUMBA_NUM_THREADS="2")


def run(args, stdin: str, env=None) -> subprocess.CompletedProcess:
    """stdin: "null" (/dev/null), "closed" (fd 0 closed, as `0<&-`), or the text piped in."""
    redirect = {"null": " </dev/null", "closed": " 0<&-"}.get(stdin, "")
    cmd = " ".join(f"'{a}'" for a in [EXE, *map(str, args)]) + redirect
    return subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, timeout=300,
                          input=None if redirect else stdin, env=env or ENV)


def error_line(res) -> str:
    assert res.returncode == 1, (res.stdout, res.stderr)
    assert "Traceback" not in res.stderr and "internal error" not in res.stderr, res.stderr
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1, res.stderr
    return errors[0]


@pytest.mark.parametrize("stdin", ["null", "closed"])
def test_generate_without_a_prompt_and_no_input_says_how_to_give_one(tiny_chat, stdin):
    line = error_line(run(["generate", "-m", tiny_chat], stdin))
    assert "no prompt" in line and "--prompt" in line and "-f FILE" in line, line
    assert ("closed" if stdin == "closed" else os.devnull) in line


@pytest.mark.parametrize("flag", [["-p", "-"], ["-f", "-"]])
def test_generate_asked_to_read_a_closed_input_says_so(tiny_chat, flag):
    line = error_line(run(["generate", "-m", tiny_chat, *flag], "closed"))
    assert "standard input is closed" in line and "--prompt" in line, line


def test_generate_reading_dev_null_on_purpose_still_answers_its_empty_prompt(tiny_chat):
    res = run(["generate", "-m", tiny_chat, "-p", "-", "-n", "2", "--temp", "0"], "null")
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("stdin", ["null", "closed", ""])
def test_chat_with_no_input_says_so(tiny_chat, stdin):
    line = error_line(run(["chat", "-m", tiny_chat], stdin))
    assert "no input" in line and "generate --prompt" in line and "-f FILE" in line, line


def test_chat_with_piped_messages_still_runs(tiny_chat):
    res = run(["chat", "-m", tiny_chat, "-n", "2", "--temp", "0"], "hello\n")
    assert res.returncode == 0 and "error" not in res.stderr, res.stderr


def test_rm_that_cannot_ask_refuses_and_keeps_the_file(tmp_path):
    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    env = {**ENV, "EDGELLAMA_CACHE": str(tmp_path), "HF_HUB_CACHE": str(tmp_path / "hub")}
    line = error_line(run(["rm", "a.gguf"], "closed", env))
    assert "-y" in line and (tmp_path / "a.gguf").exists()


# -- the history file ---------------------------------------------------------------------

class FakeReadline:
    """GNU readline as Reader uses it, recording what it writes."""
    __doc__ = "GNU readline"

    def __init__(self):
        self.read, self.written = [], []

    def parse_and_bind(self, s): pass
    def set_history_length(self, n): pass
    def set_pre_input_hook(self, f): pass

    def read_history_file(self, path):
        self.read.append(path)

    def write_history_file(self, path):
        self.written.append(path)


def _reader(monkeypatch, history: Path) -> tuple[chat_input.Reader, FakeReadline]:
    rl = FakeReadline()
    monkeypatch.setattr(chat_input, "_gnu_readline", lambda: rl)
    tty = types.SimpleNamespace(fileno=lambda: 0, isatty=lambda: True)
    monkeypatch.setattr(sys, "stdin", tty)
    monkeypatch.setattr(sys, "stdout", types.SimpleNamespace(isatty=lambda: True))
    return chat_input.Reader(history), rl


def _make(path: Path, kind: str) -> None:
    if kind == "not-utf8":
        path.write_bytes(b"caf\xe9 au lait\n\xff\xfe\n")
    elif kind == "directory":
        path.mkdir()
        (path / "inside").write_text("the user's")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "dangling-link":
        path.symlink_to(path.parent / "nowhere")
    elif kind == "huge":
        with open(path, "wb") as f:
            f.truncate(chat_input.MAX_HISTORY_BYTES + 1)


@pytest.mark.parametrize("kind", ["not-utf8", "directory", "fifo", "dangling-link", "huge",
                                  "permission"])
def test_an_unreadable_history_is_neither_read_nor_written(monkeypatch, tmp_path, kind):
    path = tmp_path / "chat_history"
    if kind == "permission":       # as root can read anything, the refusal is simulated
        path.write_text("old line\n")

        def denied(*a, **k):
            raise PermissionError(13, "Permission denied")
        monkeypatch.setattr(chat_input, "open", denied, raising=False)
    else:
        _make(path, kind)
    before = os.lstat(path)
    reader, rl = _reader(monkeypatch, path)
    assert reader.history is None and reader.history_warning
    assert str(path) in reader.history_warning and "memory only" in reader.history_warning
    notes = []
    reader.save_history(notes.append)
    assert rl.read == [] and rl.written == [] and notes == []
    after = os.lstat(path)
    assert (after.st_mode, after.st_size, after.st_mtime_ns) == \
        (before.st_mode, before.st_size, before.st_mtime_ns)


def test_a_readable_history_is_read_and_written(monkeypatch, tmp_path):
    path = tmp_path / "chat_history"
    path.write_text("caf\u00e9\n")
    reader, rl = _reader(monkeypatch, path)
    assert reader.history == path and reader.history_warning is None
    reader.save_history(lambda m: None)
    assert rl.read == [path] and rl.written == [path]
    fresh, rl = _reader(monkeypatch, tmp_path / "new" / "chat_history")    # not there yet
    assert fresh.history_warning is None


def test_chat_warns_once_and_leaves_a_non_utf8_history_alone(tiny_chat, tmp_path):
    history = tmp_path / "chat_history"
    old = b"\xff\xfe not UTF-8, the user's\n"
    history.write_bytes(old)
    env = dict(ENV, EDGELLAMA_CACHE=str(tmp_path), NUMBA_CACHE_DIR=str(kernel_cache_dir()))
    c = pexpect.spawn(EXE, ["chat", "-m", str(tiny_chat), "-n", "2", "--temp", "0"], env=env,
                      encoding="utf-8", timeout=180, dimensions=(50, 250))
    c.expect_exact(">>> ")
    banner = c.before
    c.sendline("/help")
    c.expect_exact(">>> ")
    assert "history: this session only" in c.before
    c.sendline("hello there")
    c.expect_exact(">>> ")
    c.sendeof()
    c.expect(pexpect.EOF)
    c.close()
    assert c.exitstatus == 0
    assert banner.count("warning:") == 1 and "cannot be read (not UTF-8 text)" in banner, banner
    assert history.read_bytes() == old
