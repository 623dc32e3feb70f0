"""Where `generate` takes its prompt and model from: PROMPT, -p, -p -, -f FILE, piped
stdin, a positional MODEL; a 1 MB prompt goes through -f (one argument holds 128 KiB)."""
from __future__ import annotations

import os
import shutil
import subprocess

import pexpect

EXE = shutil.which("edgellama")
ENV = dict(os.environ, NUMBA_NUM_THREADS="2")
RAW = ["-n", "1", "--raw", "--temp", "0"]


def run(*args, input: bytes | None = None) -> subprocess.CompletedProcess:
    """The command with `input` piped in (else an empty, non-terminal stdin)."""
    stdin = {"input": input} if input is not None else {"stdin": subprocess.DEVNULL}
    return subprocess.run([EXE, "generate", *map(str, args)],
                          capture_output=True, env=ENV, timeout=300, **stdin)


def prompt_tokens(res) -> int:
    assert res.returncode == 0, res.stderr
    return int(res.stderr.decode().rsplit("prompt: ", 1)[1].split()[0])


def test_every_way_of_giving_the_prompt_gives_the_same_prompt(tiny_chat, tmp_path):
    (tmp_path / "p.txt").write_bytes("héllo wörld\n".encode())
    ways = [
        run(tiny_chat, "héllo wörld\n", *RAW),                          # MODEL PROMPT
        run("-m", tiny_chat, "héllo wörld\n", *RAW),                    # PROMPT alone is the prompt
        run(tiny_chat, "-p", "héllo wörld\n", *RAW),
        run(tiny_chat, "-f", tmp_path / "p.txt", *RAW),
        run(tiny_chat, "-p", "-", *RAW, input="héllo wörld\n".encode()),
        run(tiny_chat, "-f", "-", *RAW, input="héllo wörld\n".encode()),
        run(tiny_chat, *RAW, input="héllo wörld\n".encode()),          # piped, nothing else given
    ]
    for res in ways:
        assert res.stdout.startswith("héllo wörld\n".encode()), (res.stdout, res.stderr)
    assert len({prompt_tokens(r) for r in ways}) == 1


def test_a_megabyte_prompt_file_is_read_and_refused_for_its_length(tiny_chat, tmp_path):
    big = tmp_path / "big.txt"
    big.write_text("word " * 200_000)             # 1 MB
    res = run(tiny_chat, "-f", big, *RAW)
    assert res.returncode == 1 and res.stdout == b""     # refused before the prompt is echoed
    err = res.stderr.decode()
    assert err.startswith("error: the prompt is ") and "longer than the context of 64 tokens" in err
    n = int(err.split("the prompt is ")[1].split()[0])
    assert n > 190_000                            # every word was read and tokenized


def test_prompt_given_twice_or_not_at_all_is_a_usage_error(tiny_chat, tmp_path):
    res = run(tiny_chat, "hello", "-p", "hi")
    assert res.returncode == 2 and b"give the prompt once" in res.stderr
    res = run(tiny_chat, "-f", tmp_path / "missing.txt")
    assert res.returncode == 1 and b"missing.txt" in res.stderr and b"Traceback" not in res.stderr
    # a terminal on stdin and no prompt: say how to give one (no wait for typed input)
    child = pexpect.spawn(EXE, ["generate", str(tiny_chat)], env=ENV, timeout=60)
    child.expect("no prompt: give PROMPT, -p TEXT, -f FILE, or pipe it in")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 2


def test_one_positional_is_the_model_only_when_it_reads_as_one(tiny_chat):
    # a missing .gguf is a model that is not there, not a prompt
    res = run("missing.gguf", "-p", "hi")
    assert res.returncode == 1 and b"missing.gguf" in res.stderr
    # with -p given, the positional is the model, and this one names nothing
    res = run("not a model", "-p", "hi")
    assert res.returncode == 1 and b"no such file, and not a Hugging Face reference" in res.stderr
