"""The command line given bad input: exit 0 on success, 1 with one `error:` line on stderr
(no traceback) for a problem with the user's input or environment, 2 for usage errors;
`--debug` shows the traceback. Hostile model files and environments (issue 12): special
files, oversized vocabularies, bad sampling defaults, escape sequences in model output,
closed pipes, unwritable caches. Plus convert's "never a partial file" promise under a
full disk and Ctrl-C. (Converter input validation already covered in test_convert.py is
not repeated here.)"""
from __future__ import annotations

import errno
import os
import pty
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

import edgellama.quant.convert as qconvert
from edgellama.cli.main import main
from edgellama.errors import EdgeError
from edgellama.sampling import SamplingParams
from hf_fixtures import write_tiny_llama
from tiny_gguf import TINY_VOCAB, write_tiny_gguf

EXE = shutil.which("edgellama")
ENV = dict(os.environ, NUMBA_NUM_THREADS="2")


def run(*args, stdin: bytes | None = None, timeout=240) -> subprocess.CompletedProcess:
    assert EXE, "the edgellama command is not on PATH: pip install -e . first"
    return subprocess.run([EXE, *map(str, args)], input=stdin, capture_output=True,
                          timeout=timeout, env=ENV)


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_user_error(res, *needles):
    """Exit 1, one `error:` line on stderr naming the problem, no traceback."""
    code = getattr(res, "returncode", None)
    code = res.exit_code if code is None else code
    err = res.stderr.decode(errors="replace") if isinstance(res.stderr, bytes) else res.stderr
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 1, (code, err)
    assert lines and lines[-1].startswith("error: "), err
    assert "Traceback" not in err and "internal error" not in err, err
    for n in needles:
        assert n in lines[-1], (n, lines[-1])


# -- model files -------------------------------------------------------------------
def test_missing_model_file_through_the_real_cli(tmp_path):
    res = run("generate", "-m", tmp_path / "nope.gguf", "-p", "hi")
    assert_user_error(res, "nope.gguf", "no such file")
    res = run("--debug", "generate", "-m", tmp_path / "nope.gguf", "-p", "hi")
    assert res.returncode == 1 and b"Traceback" in res.stderr and b"EdgeError" in res.stderr


def test_non_gguf_file_through_the_real_cli(tmp_path):
    bad = tmp_path / "notes.gguf"
    bad.write_bytes(b"hello, this is not a model file at all\n" * 4)
    assert_user_error(run("generate", "-m", bad, "-p", "hi"), "notes.gguf", "not a GGUF file")


def test_directory_given_as_model(tmp_path):
    # click's Path(dir_okay=False) rejects it as a usage error; the API says it clearly too
    res = invoke("generate", "-m", tmp_path, "-p", "hi")
    assert res.exit_code == 2 and "is a directory" in res.stderr
    import edgellama
    with pytest.raises(EdgeError, match="is a directory"):
        edgellama.load(tmp_path)


def test_path_through_a_file(tiny_chat):
    res = invoke("generate", "-m", tiny_chat / "x.gguf", "-p", "hi")
    assert_user_error(res, "x.gguf", "cannot read: Not a directory")


def test_unreadable_model(tmp_path, tiny_chat, monkeypatch):
    p = tmp_path / "locked.gguf"
    shutil.copy(tiny_chat, p)
    p.chmod(0)
    if os.geteuid() == 0:
        # root reads a chmod 000 file anyway: make the open fail the way it does for a user
        real_open = os.open

        def no_read(path, *a, **k):
            if str(path) == str(p):
                raise PermissionError(13, "Permission denied", str(path))
            return real_open(path, *a, **k)
        monkeypatch.setattr(os, "open", no_read)
    assert_user_error(invoke("generate", "-m", p, "-p", "hi"), "locked.gguf", "permission denied")


def test_truncated_model(tmp_path, tiny_chat):
    p = tmp_path / "half.gguf"
    p.write_bytes(tiny_chat.read_bytes()[: tiny_chat.stat().st_size // 2])
    assert_user_error(invoke("generate", "-m", p, "-p", "hi"), "half.gguf", "truncated")


@pytest.mark.parametrize("metadata, needle", [
    (dict(softcap=float("nan")), "final_logit_softcapping nan"),
    (dict(softcap=float("inf")), "final_logit_softcapping inf"),
    (dict(theta=float("inf")), "rope base inf"),
    (dict(theta_swa=float("inf")), "rope.freq_base_swa inf"),
])
def test_non_finite_gemma3_metadata_is_refused_at_load(tmp_path, metadata, needle):
    # a NaN or infinite softcap made every logit NaN: the run failed at its first token,
    # blaming "corrupt weights"; an infinite rope base ran on with meaningless positions
    p = write_tiny_gguf(tmp_path / "g.gguf", "F32", arch="gemma3", vocab=TINY_VOCAB,
                        tokenizer=True, rope_scaling=False, **metadata)
    assert_user_error(invoke("generate", "-m", p, "-p", "hi", "-n", 2), "g.gguf", needle)


# -- engine options ----------------------------------------------------------------
def test_context_larger_than_the_model(tiny_chat):
    assert_user_error(invoke("generate", "-m", tiny_chat, "-p", "hi", "--ctx", 65), "--ctx 65", "64 tokens")


def test_context_larger_than_memory(tiny_chat, monkeypatch):
    import edgellama.model
    monkeypatch.setattr(edgellama.model, "available_memory", lambda: 1 << 10)
    assert_user_error(invoke("generate", "-m", tiny_chat, "-p", "hi", "--ctx", 64),
                      "context of 64 tokens needs", "MiB of KV cache", "smaller --ctx")


@pytest.mark.parametrize("flag, value, needle", [("--threads", "0", "not in the range x>=1"),
                                                ("--threads", "100000", "more than the"),
                                                ("--ctx", "0", "not in the range x>=1"),
                                                ("--ctx", "-5", "not in the range x>=1")])
def test_counts_out_of_range_are_usage_errors(tiny_chat, flag, value, needle):
    # out of range on any model: refused as the command line is read (exit 2, as docs/usage.md says)
    res = invoke("generate", "-m", tiny_chat, "-p", "hi", flag, value)
    assert res.exit_code == 2 and needle in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_threads_not_a_number_is_a_usage_error(tiny_chat):
    res = invoke("generate", "-m", tiny_chat, "-p", "hi", "--threads", "many")
    assert res.exit_code == 2 and "Traceback" not in res.output


@pytest.mark.parametrize("flag, value, needle", [
    ("--temp", "-1", "temperature must be >= 0"),
    ("--temp", "nan", "temperature must be a finite number"),
    ("--temp", "inf", "temperature must be a finite number"),
    ("--top-p", "0", "top-p must be in (0, 1]"),
    ("--top-p", "1.5", "top-p must be in (0, 1]"),
    ("--min-p", "2", "min-p must be in [0, 1]"),
    ("--repeat-penalty", "0", "repeat penalty must be > 0"),
    ("--top-k", "-3", "top-k must be >= 0"),
])
def test_invalid_sampling_values(tiny_chat, flag, value, needle):
    # out of range on any model: a usage error, before anything loads
    res = invoke("generate", "-m", tiny_chat, "-p", "hi", flag, value)
    assert res.exit_code == 2 and needle in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_prompt_longer_than_the_context(tiny_chat):
    assert_user_error(invoke("generate", "-m", tiny_chat, "-p", "hello the world " * 40, "--ctx", 32),
                      "longer than the context of 32 tokens")
    long = "hello the world " * 40
    assert_user_error(invoke("generate", "-m", tiny_chat, "-p", long, "--ctx", 32, "--raw"),
                      "longer than the context of 32 tokens")


def test_empty_prompt(tiny_chat):
    # with the chat template an empty message still makes a prompt: it answers
    res = invoke("generate", "-m", tiny_chat, "-p", "", "--temp", "0", "-n", "2")
    assert res.exit_code == 0, res.output
    # raw, there is nothing to continue from
    assert_user_error(invoke("generate", "-m", tiny_chat, "-p", "", "--raw", "-n", "2"),
                      "the prompt is empty")


def test_generate_works(tiny_chat):
    res = invoke("generate", "-m", tiny_chat, "-p", "hello", "--temp", "0", "-n", "3")
    assert res.exit_code == 0, res.output
    assert "generation:" in res.stderr


def test_hostile_chat_template_through_the_cli(tmp_path):
    """A template reaching for Python internals, or for unbounded memory/CPU, ends in one
    error line in bounded time, and nothing runs."""
    marker = tmp_path / "pwned"
    templates = {
        "internals": "{{ cycler.__init__.__globals__.os.system('touch " + str(marker) + "') }}",
        "subclasses": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "memory": "{{ 'a' * 10**10 }}",
        "doubling": "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                    "{% endfor %}{{ ns.s }}",
        "range": "{% for i in range(10**9) %}x{% endfor %}",
        "cpu": "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
    }
    needles = {"internals": "chat template refused", "subclasses": "chat template refused",
               "memory": "chat template stopped", "doubling": "chat template stopped",
               "range": "chat template stopped", "cpu": "it ran for more than"}
    for name, t in templates.items():
        p = write_tiny_gguf(tmp_path / f"{name}.gguf", "Q8_0", dim=32, layers=1, heads=2, kv_heads=1,
                            ffn=32, vocab=TINY_VOCAB, ctx=64, tokenizer=True, chat_template=t)
        res = invoke("generate", "-m", p, "-p", "hi", "-n", "1")
        assert_user_error(res, needles[name])
    assert not marker.exists()
    # and through the installed command, as a user runs it
    assert_user_error(run("generate", "-m", tmp_path / "internals.gguf", "-p", "hi"), "chat template refused")
    assert not marker.exists()


def test_chat_with_garbage_bytes_on_stdin(tiny_chat):
    res = run("chat", "-m", tiny_chat, "--temp", "0", "-n", "4",
              stdin=b"\xff\xfe hello \x1b[31m\n\x00\x07\n/stats\n\xc3\x28 the \x9b end\n")
    assert res.returncode == 0, res.stderr
    assert b"Traceback" not in res.stderr and b"error" not in res.stderr, res.stderr
    assert b"context: " in res.stderr          # /stats after the first reply


# -- convert -----------------------------------------------------------------------
@pytest.fixture()
def hf(tmp_path, llama3_tokenizer_dir):
    return write_tiny_llama(tmp_path / "hf", tokenizer_dir=llama3_tokenizer_dir, hidden=32, heads=2,
                            kv_heads=1, layers=1, ffn=64, vocab=128256)


def test_convert_missing_dir(tmp_path):
    assert_user_error(run("convert", tmp_path / "nope", "-o", tmp_path / "m.gguf"), "nope", "not a directory")


def test_convert_dir_without_config(tmp_path):
    (tmp_path / "empty").mkdir()
    assert_user_error(invoke("convert", tmp_path / "empty", "-o", tmp_path / "m.gguf"),
                      "config.json", "missing")


@pytest.mark.parametrize("name", ["consolidated.00.pth", "model.pt", "last.ckpt"])
def test_convert_refuses_pickle_checkpoints(hf, tmp_path, name):
    (hf / "model.safetensors").unlink()
    (hf / name).write_bytes(b"\x80\x04\x95")    # never opened
    out = tmp_path / "m.gguf"
    assert_user_error(invoke("convert", hf, "-o", out), name, "pickle", "arbitrary code", ".safetensors")
    assert not out.exists()


def _corrupt_header(hf, header: bytes):
    st = hf / "model.safetensors"
    st.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 64)


@pytest.mark.parametrize("header, needle", [
    (b"\xff\xfe not json", "invalid safetensors header"),
    (b"[1, 2, 3]", "not a JSON object"),
    (b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [-8, 8]}}', "invalid data_offsets"),
    (b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16], "x": 1}}', "invalid safetensors header entry"),
    (b'{"w": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}}', "invalid shape"),
    (b'{"w": {"dtype": "F32", "shape": [1024], "data_offsets": [0, 4096]}}', "truncated"),
])
def test_convert_bad_safetensors_headers(hf, tmp_path, header, needle):
    _corrupt_header(hf, header)
    assert_user_error(invoke("convert", hf, "-o", tmp_path / "m.gguf"), "model.safetensors", needle)
    assert not (tmp_path / "m.gguf").exists()


class _FullDisk:
    """A file object that accepts `room` bytes, then fails like a full disk."""

    def __init__(self, f, room):
        self.f, self.room = f, room

    def write(self, b):
        if self.room < len(b):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.f.name)
        self.room -= len(b)
        return self.f.write(b)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def test_convert_disk_full_leaves_no_partial_file(hf, tmp_path, monkeypatch):
    monkeypatch.setattr(qconvert, "open", lambda p, mode="r": _FullDisk(open(p, mode), 200_000),
                        raising=False)
    out = tmp_path / "out"
    out.mkdir()
    res = invoke("convert", hf, "-o", out / "m.gguf", "--quiet")
    assert_user_error(res, "No space left on device")
    assert list(out.iterdir()) == []
    # an existing output (with --force) is left as it was
    (out / "m.gguf").write_bytes(b"my old model")
    with pytest.raises(OSError) as e:
        qconvert.convert(hf, out / "m.gguf", force=True)
    assert e.value.errno == errno.ENOSPC
    assert (out / "m.gguf").read_bytes() == b"my old model"
    assert [p.name for p in out.iterdir()] == ["m.gguf"]


def test_convert_ctrl_c_keeps_existing_output(hf, tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "m.gguf").write_bytes(b"my old model")

    def stop(name, done, total):
        if done > total // 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        qconvert.convert(hf, out / "m.gguf", force=True, progress=stop)
    assert (out / "m.gguf").read_bytes() == b"my old model"
    assert [p.name for p in out.iterdir()] == ["m.gguf"]

    # through the CLI: exit 130, "interrupted", no traceback, nothing left behind
    real = qconvert.convert
    monkeypatch.setattr("edgellama.cli.convert.convert", lambda *a, **k: real(*a, **{**k, "progress": stop}))
    res = invoke("convert", hf, "-o", out / "m.gguf", "--force", "--quiet")
    assert res.exit_code == 130 and "interrupted" in res.stderr and "Traceback" not in res.stderr
    assert (out / "m.gguf").read_bytes() == b"my old model"
    assert [p.name for p in out.iterdir()] == ["m.gguf"]


# -- hostile input, the runtime's half (issue 12) -----------------------------------
def _tiny_with(tiny_chat: Path, path: Path, **keys) -> Path:
    """The tiny model with metadata keys set: key=(gguf value type, value)."""
    from test_fuzz_gguf import _set, parse, serialize
    doc = parse(tiny_chat.read_bytes())
    for key, (vtype, value) in keys.items():
        doc = _set(doc, key.replace("__", "."), vtype, value)
    path.write_bytes(serialize(doc)[0])
    return path


def test_fifo_or_device_as_model_is_refused_at_once(tmp_path):
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    t0 = time.perf_counter()
    res = run("generate", "-m", fifo, "-p", "hi", timeout=120)   # used to block in open()
    assert_user_error(res, "model.gguf", "is a FIFO (named pipe), not a regular file")
    assert time.perf_counter() - t0 < 60
    assert_user_error(invoke("generate", "-m", "/dev/zero", "-p", "hi"), "/dev/zero",
                      "is a character device, not a regular file")


def test_token_array_larger_than_the_embedding_is_refused_first(tiny_chat, tmp_path, monkeypatch):
    from test_fuzz_gguf import ARR, I32, STR, _kv, parse
    import edgellama.tokenizer
    doc = parse(tiny_chat.read_bytes())
    tokens, types = _kv(doc, "tokenizer.ggml.tokens").value[1], _kv(doc, "tokenizer.ggml.token_type").value[1]
    n = 300_000
    p = _tiny_with(tiny_chat, tmp_path / "vocab.gguf",
                   tokenizer__ggml__tokens=(ARR, (STR, tokens + [f"t{i}" for i in range(n)])),
                   tokenizer__ggml__token_type=(ARR, (I32, types + [1] * n)))

    def never(meta):
        raise AssertionError("the tokenizer was built")
    monkeypatch.setattr(edgellama.tokenizer.Tokenizer, "from_metadata", never)
    t0 = time.perf_counter()
    assert_user_error(invoke("generate", "-m", p, "-p", "hi"),
                      f"the tokenizer has {len(tokens) + n} tokens", f"token_embd.weight) has {len(tokens)}")
    assert time.perf_counter() - t0 < 5


def test_bad_sampling_defaults_in_the_file_are_ignored_with_a_warning(tiny_chat, tmp_path):
    from test_fuzz_gguf import F32, STR
    p = _tiny_with(tiny_chat, tmp_path / "sampling.gguf", general__sampling__temp=(F32, float("nan")),
                   general__sampling__top_p=(F32, 2.0), general__sampling__top_k=(STR, "40"))
    res = invoke("generate", "-m", p, "-p", "hello", "-n", "4")
    assert res.exit_code == 0, res.output
    warnings = [ln for ln in res.stderr.splitlines() if ln.startswith("warning: ")]
    assert warnings == ["warning: ignoring the file's general.sampling.temp = nan: temperature must "
                        "be a finite number",
                        "warning: ignoring the file's general.sampling.top_k: it is not a number (str)",
                        "warning: ignoring the file's general.sampling.top_p = 2: top-p must be in (0, 1]"]
    # the command line overrides the file, valid or not: greedy here, greedy there
    greedy = invoke("generate", "-m", tiny_chat, "-p", "hello", "-n", "8", "--temp", "0")
    assert invoke("generate", "-m", p, "-p", "hello", "-n", "8", "--temp", "0").stdout == greedy.stdout
    q = _tiny_with(tiny_chat, tmp_path / "greedy.gguf", general__sampling__temp=(F32, 0.0))
    assert invoke("generate", "-m", q, "-p", "hello", "-n", "8").stdout == greedy.stdout
    hot = invoke("generate", "-m", q, "-p", "hello", "-n", "8", "--temp", "5", "--top-k", "0",
                 "--top-p", "1", "--min-p", "0", "--seed", "1")
    assert hot.exit_code == 0 and hot.stdout != greedy.stdout


def test_seed_minus_one_is_a_random_seed(tiny_chat):
    res = invoke("generate", "-m", tiny_chat, "-p", "hello", "-n", "3", "--seed", "-1")
    assert res.exit_code == 0, res.output
    res = invoke("generate", "-m", tiny_chat, "-p", "hello", "--seed", "-2")
    assert res.exit_code == 2 and "'--seed': -2 is not in the range x>=-1" in res.stderr
    with pytest.raises(EdgeError, match="seed must be >= 0"):
        SamplingParams(seed=-1)


def test_chat_context_too_small_for_the_template(tiny_chat):
    res = CliRunner().invoke(main, ["chat", "-m", str(tiny_chat), "--ctx", "2"], input="hello\n")
    assert_user_error(res, "a context of 2 tokens is too small for this model's chat template",
                      "an empty message already takes", "use --ctx")
    assert "Compiling" not in res.stderr
    res = CliRunner().invoke(main, ["chat", "-m", str(tiny_chat), "--ctx", "20", "-s", "be brief " * 20],
                             input="hello\n")
    assert_user_error(res, "an empty message with the system prompt already takes",
                      "leaves no room for a reply")


def test_bench_context_that_cannot_fit_is_refused_before_generating(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGELLAMA_CACHE", str(tmp_path))
    assert_user_error(invoke("bench", "--ctx", 10**9), "context of 1000000000 tokens needs", "MiB of KV cache",
                      "use a smaller --ctx")
    res = invoke("bench", "--ctx", 64, "-p", 512)
    assert res.exit_code == 2 and "-p 512 does not fit --ctx 64" in res.stderr
    assert not (tmp_path / "bench").exists()


def test_closed_pipe_ends_quietly(tiny_chat):
    proc = subprocess.Popen([EXE, "generate", "-m", str(tiny_chat), "-p", "hello", "--raw", "-n", "60",
                             "--temp", "2", "--top-k", "0", "--ctx", "64"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)
    proc.stdout.read(1)             # `| head -c 1`
    proc.stdout.close()
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 128 + signal.SIGPIPE, err
    assert err == b"", err          # no "Exception ignored", no "error: Broken pipe"


def _escaping_generation(tiny_chat, n: int = 60) -> tuple[bytes, list[str]]:
    """A `generate --raw -p hello` command whose output holds an ESC, and that output's
    bytes (found with the API: the first seed that makes one)."""
    import edgellama
    from edgellama.cli.options import sampling_from
    llm = edgellama.load(tiny_chat, threads=1)
    ids = llm.tokenizer.encode("hello")
    for seed in range(100):
        flags = {"temperature": 3.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.5,
                 "seed": seed}
        toks = llm.generate(ids, max_tokens=n, sampling=sampling_from(llm.default_sampling(), flags))
        out = b"hello" + b"".join(llm.tokenizer.shown_bytes(t) for t in toks)
        if b"\x1b" in out:
            return out, ["generate", "-m", str(tiny_chat), "-p", "hello", "--raw", "-n", str(n),
                         "--temp", "3", "--top-k", "0", "--top-p", "1", "--min-p", "0",
                         "--repeat-penalty", "1.5", "--seed", str(seed)]
    raise AssertionError("no seed makes the tiny model write an escape character")


def test_raw_output_to_a_pipe_is_byte_exact(tiny_chat):
    expected, cli = _escaping_generation(tiny_chat)
    res = run(*cli)
    assert res.returncode == 0, res.stderr
    assert res.stdout == expected


def test_terminal_output_neutralises_control_characters(tiny_chat):
    expected, cli = _escaping_generation(tiny_chat)
    master, slave = pty.openpty()
    proc = subprocess.Popen([EXE, *cli], stdout=slave, stderr=subprocess.PIPE, env=ENV)
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 1 << 16)
        except OSError:             # EIO: the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert proc.wait(timeout=240) == 0, proc.stderr.read()
    # colorama (loaded by Numba) resets the terminal's colours at exit: not model output
    text = out.decode().removesuffix("\x1b[0m")
    assert not [c for c in text if ord(c) < 32 and c not in "\t\r\n" or 0x7F <= ord(c) <= 0x9F], text
    assert text.replace("\r\n", "\n").startswith("hello") and "\u241b" in text   # ESC shown as ␛
    assert len(text.replace("\r\n", "\n")) == len(expected.decode("utf-8", "replace").replace("\r", "")) + 1


def test_error_text_from_the_file_is_one_harmless_line(tmp_path):
    t = "{{ raise_exception('\\x1b]0;owned\\x07\\x1b[2J\\nsecond line') }}"
    p = write_tiny_gguf(tmp_path / "t.gguf", "Q8_0", dim=32, layers=1, heads=2, kv_heads=1, ffn=32,
                        vocab=TINY_VOCAB, ctx=64, tokenizer=True, chat_template=t)
    res = invoke("generate", "-m", p, "-p", "hi")
    assert_user_error(res, "\u241b]0;owned\u2407\u241b[2J second line")
    assert "\x1b" not in res.stderr and len(res.stderr.splitlines()) == 1


def _python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**ENV, **env})


def test_compiled_kernels_live_in_the_user_cache(tmp_path):
    res = _python("import edgellama.kernels.rows as k; print(k.rmsnorm._cache._cache_path)",
                  EDGELLAMA_CACHE=str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert Path(res.stdout.strip()).is_relative_to(tmp_path / "numba")


def test_kernel_cache_is_keyed_by_the_kernel_sources(tmp_path):
    # numba/<digest of fp.py, simd.py, kernels.py, formats/...>: a change to an intrinsic
    # must not reuse kernels compiled against the old one; other versions' kernels go
    # once unused for jit.UNUSED_SECONDS (another install may still use them)
    from edgellama.kernels import jit
    code = ("import edgellama.kernels.jit as j, edgellama.kernels.rows as k; "
            "print(j.kernel_cache_dir()); print(k.rmsnorm._cache._cache_path)")
    stale = tmp_path / "numba" / "0123456789abcdef"
    stale.mkdir(parents=True)
    long_ago = time.time() - jit.UNUSED_SECONDS - 60
    os.utime(stale, (long_ago, long_ago))
    in_use = tmp_path / "numba" / "fedcba9876543210"
    in_use.mkdir()
    res = _python(code, EDGELLAMA_CACHE=str(tmp_path))
    assert res.returncode == 0, res.stderr
    digest_dir, kernel_path = (Path(line) for line in res.stdout.split())
    assert digest_dir.parent == tmp_path / "numba" and len(digest_dir.name) == 16
    assert kernel_path.is_relative_to(digest_dir)
    assert not stale.exists() and in_use.is_dir()


def test_kernel_cache_changes_with_an_intrinsic(monkeypatch):
    from edgellama.kernels import jit
    before = jit.kernel_cache_dir()
    assert jit.kernel_cache_dir() == before                 # stable
    read = Path.read_bytes
    for name in ("simd.py", "fp.py", "records.py"):              # intrinsics, and a kernel file
        monkeypatch.setattr(Path, "read_bytes",
                            lambda self, n=name: read(self) + (b"#" if self.name == n else b""))
        assert jit.kernel_cache_dir() != before, name


def test_unwritable_cache_and_home_still_run(tiny_chat, tmp_path):
    """Read-only home (and install): kernels compile in memory, with one note."""
    home = tmp_path / "home"
    home.write_text("not a directory: nothing can be created under it, not even by root")
    env = {k: v for k, v in ENV.items() if k not in ("EDGELLAMA_CACHE", "XDG_CACHE_HOME")}
    env["HOME"] = str(home)
    res = subprocess.run([sys.executable, "-c", "import edgellama.kernels.rows as k; "
                          "print(type(k.rmsnorm._cache).__name__)"],
                         capture_output=True, text=True, timeout=600, env=env)
    assert res.stdout.strip() == "NullCache", res.stderr     # nothing written beside the sources
    res = subprocess.run([EXE, "generate", "-m", str(tiny_chat), "-p", "hello", "-n", "3"],
                         capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr
    notes = [ln for ln in res.stderr.splitlines() if ln.startswith("note: ")]
    assert len(notes) == 1 and "kernels compile in memory" in notes[0], res.stderr
    assert "Traceback" not in res.stderr and "error" not in res.stderr
