"""`edgellama chat` input: \"\"\" blocks, bracketed paste, typing while a reply streams,
the history file; the parsing alone, then the real command in a pseudo-terminal."""
import io
import os
import signal
import sys
import time

import pexpect
import pytest
from edgellama.cli.chat_input import Assembler, clean, typed_lines
from test_chat_cli import EXE, PROMPT, _say, _spawn

from edgellama.kernels.jit import kernel_cache_dir

PASTE = "\x1b[200~{}\x1b[201~"


def _feed(*chunks):
    a = Assembler()
    out = [a.feed(c) for c in chunks]
    return out, a.open


def test_quote_blocks_join_lines_until_one_ends_with_quotes():
    assert _feed('"""first', "second", "", 'third"""') == ([None, None, None, "first\nsecond\n\nthird"], False)
    assert _feed('"""', "only line", '"""') == ([None, None, "\nonly line\n"], False)
    assert _feed('"""one line"""') == (["one line"], False)
    assert _feed('"""still open', "  ") == ([None, None], True)
    assert _feed("plain", 'not """ a block') == (["plain", 'not """ a block'], False)


def test_a_pasted_block_is_one_message_and_a_discarded_block_is_forgotten():
    # without readline the paste markers arrive with the text (the Reader joins the lines)
    assert _feed(PASTE.format("a\nb")) == (["a\nb"], False)
    a = Assembler()
    assert a.feed('"""draft') is None
    a.discard()
    assert a.feed("next") == "next"


def test_clean_drops_escape_sequences_and_controls():
    assert clean("  hi\x1b[A\x1b[1;5Cthere\x07\r\nnext\x00  ") == "hithere\nnext"
    assert clean("\udcff ok") == "? ok"


def test_paste_and_quote_block_are_one_message_each(smollm2_gguf):
    c = _spawn(smollm2_gguf, "-n", "24", "--no-history")
    c.send(PASTE.format("Answer in one word.\rWhat is the capital of France?"))
    c.send("\r")
    c.expect_exact(PROMPT)
    assert "Paris" in c.before
    c.sendline('"""Answer in one word.')
    c.expect_exact("... ")
    reply = _say(c, 'What is the capital of Italy?"""')
    assert "Rome" in reply
    c.sendline('"""abandoned')
    c.expect_exact("... ")
    c.sendintr()                     # Ctrl-C discards the open block
    c.expect_exact(PROMPT)
    assert "abandoned" not in _say(c, "/stats")
    c.sendeof()
    c.expect(pexpect.EOF)
    c.close()
    assert c.exitstatus == 0


def test_bracketed_paste_is_on_at_the_prompt_only(smollm2_gguf):
    c = _spawn(smollm2_gguf, "-n", "8", "--no-history")
    screen = io.StringIO()
    c.logfile_read = screen
    c.sendline("Hi")
    c.expect_exact(PROMPT)
    c.sendeof()
    c.expect(pexpect.EOF)
    shown = screen.getvalue()
    on, off = "\x1b[?2004h", "\x1b[?2004l"
    # off while the reply streams, on for the next prompt, off when the chat ends
    sent = shown.index("Hi\r\n")
    assert shown.index(off, sent) < shown.index("Hello", sent) < shown.index(on, sent)
    assert shown.rindex(off) > shown.rindex(on)


def test_keys_typed_during_a_reply_are_not_echoed_and_wait_at_the_prompt(smollm2_gguf):
    c = _spawn(smollm2_gguf, "-n", "60", "--no-history")
    c.sendline("Write a long story about a dragon.")
    c.expect(r"\w+ \w+ \w+")          # the reply is streaming
    c.send("zqxj")
    c.expect_exact(PROMPT, timeout=300)
    reply = c.before
    assert "zqxj" not in reply        # not echoed into the reply
    c.expect_exact("zqxj")            # ... but waiting, editable, at the prompt
    c.send("\x15")                    # Ctrl-U: erase it
    c.sendline("/stats")
    c.expect_exact(PROMPT)
    assert "context: " in c.before
    c.sendeof()
    c.expect(pexpect.EOF)
    c.close()
    assert c.exitstatus == 0


def test_terminal_echo_comes_back_when_killed_during_a_reply(smollm2_gguf):
    # the chat runs under a shell that prints the terminal's modes after it ends
    c = pexpect.spawn("sh", ["-c", f"'{EXE}' chat -m '{smollm2_gguf}' -n 400 --no-history; "
                                   "echo status $?; stty -a"],
                      encoding="utf-8", timeout=180, dimensions=(50, 250))
    c.logfile_read = sys.stdout
    c.expect_exact(PROMPT)
    c.sendline("Write a long story about a dragon.")
    c.expect(r"\w+ \w+ \w+")          # streaming, echo off
    chat_pid = int(os.popen(f"pgrep -P {c.pid}").read().split()[0])
    os.kill(chat_pid, signal.SIGTERM)
    c.expect(r"status (\d+)")
    assert c.match.group(1) == str(128 + signal.SIGTERM)
    c.expect(pexpect.EOF)
    modes = c.before.split()
    assert "echo" in modes and "icanon" in modes and "-echo" not in modes


def test_history_file_is_announced_once_and_can_be_turned_off(smollm2_gguf, tmp_path):
    # a fresh cache directory for the history; the kernel cache stays where it is
    env = dict(os.environ, EDGELLAMA_CACHE=str(tmp_path), NUMBA_CACHE_DIR=str(kernel_cache_dir()))
    history = tmp_path / "chat_history"

    def run(*args):
        c = pexpect.spawn(EXE, ["chat", "-m", str(smollm2_gguf), "-n", "4", *args], env=env,
                          encoding="utf-8", timeout=180, dimensions=(50, 250))
        c.logfile_read = sys.stdout
        c.expect_exact(PROMPT)
        banner = c.before
        c.sendline("/help")
        c.expect_exact(PROMPT)
        help_text = c.before
        c.sendline("hello there")
        c.expect_exact(PROMPT)
        c.sendeof()
        c.expect(pexpect.EOF)
        return banner, help_text

    banner, help_text = run("--no-history")
    assert "history: not kept" in help_text and not history.exists()
    banner, help_text = run()
    assert f"kept in {history}" in banner and f"history: {history}" in help_text
    assert "hello there" in history.read_text()
    banner, _ = run()                 # said once: the file exists now
    assert "kept in" not in banner
    assert "SmolLM2-135M-Instruct" in banner   # the file's name, not its general.name


@pytest.mark.slow
def test_first_compile_shows_which_kernel_of_how_many(smollm2_gguf, tmp_path):
    # an empty kernel cache: every kernel compiles (about 15-40 s on 2 cores)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    t0 = time.time()
    c = pexpect.spawn(EXE, ["chat", "-m", str(smollm2_gguf), "--no-history"], env=env,
                      encoding="utf-8", timeout=240, dimensions=(50, 250))
    c.expect(r"Compiling kernels \(once; cached for later runs\): 1/(\d+) ")
    total = int(c.match.group(1))
    c.expect_exact(f"{total}/{total} ")
    c.expect(r"Compiled (\d+) kernels in (\d+) s; cached for next time")
    assert int(c.match.group(1)) >= total
    c.expect_exact(PROMPT)
    assert "compile" not in c.before
    c.sendeof()
    c.expect(pexpect.EOF)
    assert time.time() - t0 < 240


def test_without_readline_paste_markers_are_handled_here(smollm2_gguf):
    # Python built without readline (or with libedit): the terminal's line discipline
    # reads, and the chat turns bracketed paste on and off and joins the lines itself
    code = ("import sys; sys.modules['readline'] = None; sys.argv[0] = 'edgellama'; "
            "from edgellama.cli.main import main; main()")
    c = pexpect.spawn(sys.executable, ["-c", code, "chat", "-m", str(smollm2_gguf), "--temp", "0",
                                       "-n", "100", "--no-history"],
                      encoding="utf-8", timeout=180, dimensions=(50, 250))
    c.logfile_read = sys.stdout
    c.expect_exact("\x1b[?2004h" + PROMPT)
    c.send(PASTE.format("Answer in one word.\rWhat is the capital of France?") + "\r")
    c.expect_exact("\x1b[?2004l")
    c.expect_exact(PROMPT)
    assert "Paris" in c.before
    c.sendline("Write a long story about a dragon.")
    c.expect(r"\w+ \w+ \w+")
    c.send("zqxj")                     # typed during the reply: not echoed, and said so
    c.expect_exact("(dropped 4 characters typed during the reply)")
    assert "zqxj" not in c.before
    c.sendeof()
    c.expect(pexpect.EOF)
    c.close()
    assert c.exitstatus == 0


def test_typed_lines_end_at_enter_and_keep_a_paste_whole():
    assert typed_lines("one\rtwo\r\nthree\nfour") == (["one", "two", "three"], "four")
    assert typed_lines("/exit\r") == (["/exit"], "")
    assert typed_lines("no enter yet") == ([], "no enter yet")
    pasted = PASTE.format("a\nb")
    assert typed_lines(f"{pasted}\rnext") == ([pasted], "next")     # one message, then more
    assert typed_lines(f"x{pasted[:-6]}") == ([], f"x{pasted[:-6]}")  # a paste still arriving


def test_lines_typed_ahead_run_as_if_typed_at_the_prompt(tiny_chat):
    # everything written at once, as `script` or a fast typist does: the first line is
    # read at the prompt, the rest arrives while its reply streams
    c = _spawn(tiny_chat, "-n", "4", "--no-history", timeout=60)
    c.send("hi\r/stats\r/exit\r")
    c.expect_exact(f"{PROMPT}/stats")      # shown at its prompt, then run
    c.expect_exact("context: ")
    c.expect_exact(f"{PROMPT}/exit")
    c.expect(pexpect.EOF)                  # not waiting for another Enter
    c.close()
    assert c.exitstatus == 0


def test_an_unfinished_line_typed_ahead_waits_after_the_finished_ones(tiny_chat):
    c = _spawn(tiny_chat, "-n", "4", "--no-history", timeout=60)
    c.send("hi\r/stats\rzqxj")
    c.expect_exact("context: ")            # the finished line ran
    c.expect_exact(f"{PROMPT}zqxj")        # the unfinished one waits, editable
    c.send("\x15/exit\r")                  # Ctrl-U erases it
    c.expect(pexpect.EOF)
    c.close()
    assert c.exitstatus == 0
