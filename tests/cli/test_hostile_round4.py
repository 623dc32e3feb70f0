"""Hostile input, round four (issue 35), the command line's side: saves that would replace
what is not a saved prompt, counts that bound nothing, file errors that do not name the
file, empty paths, and the exit code of usage errors. (The server's side is in
tests/server; typed-ahead chat input in test_chat_input.py; `list` in test_cache_listing.)"""
from __future__ import annotations

import errno
import os
import stat
import subprocess
import time
from pathlib import Path

import click
import pytest

import edgellama
from edgellama import prompt_cache
from edgellama.cli.main import COMMANDS, main
from edgellama.cli.options import FileName, FilePath
from edgellama.errors import EdgeError
from test_robustness_cli import EXE, ENV, assert_user_error, invoke

PROMPT = "hello the world hello the world"


# -- 1: a save replaces nothing but a saved prompt ---------------------------------------
def _not_ours(tmp_path: Path) -> dict[str, Path]:
    """One of each thing a save must leave alone."""
    doc = tmp_path / "notes.txt"
    doc.write_text("the user's notes\n")
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "inside").write_text("kept")
    link = tmp_path / "link.prompt"
    link.symlink_to(doc)
    dangling = tmp_path / "dangling.prompt"
    dangling.symlink_to(tmp_path / "nothing-there")
    return {"document": doc, "fifo": fifo, "folder": folder, "link": link, "dangling link": dangling}


def _state(p: Path):
    st = os.lstat(p)
    if stat.S_ISLNK(st.st_mode):
        return "link", os.readlink(p)
    if stat.S_ISREG(st.st_mode):
        return "file", p.read_bytes()
    if stat.S_ISDIR(st.st_mode):
        return "dir", sorted(q.name for q in p.iterdir())
    return stat.S_IFMT(st.st_mode), None


def test_a_save_refuses_everything_but_a_saved_prompt(tiny_chat, tmp_path):
    llm = edgellama.load(tiny_chat)
    llm.logits(llm.tokenizer.encode(PROMPT))
    victims = _not_ours(tmp_path)
    before = {k: _state(p) for k, p in victims.items()}
    for kind, p in victims.items():
        with pytest.raises(EdgeError, match="a save replaces only a saved prompt") as e:
            llm.save_prompt(p)
        assert str(p) in str(e.value) and "\n" not in str(e.value), kind
    assert {k: _state(p) for k, p in victims.items()} == before
    assert not (tmp_path / "nothing-there").exists()         # a link is never followed
    # absent: made; ours: replaced; no temporary left behind
    ours = tmp_path / "ours.prompt"
    llm.save_prompt(ours)
    first = ours.read_bytes()
    llm.logits(llm.tokenizer.encode(" again"))
    llm.save_prompt(ours)
    assert ours.read_bytes() != first and prompt_cache.is_saved_prompt(ours)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [p.name for p in victims.values()] + ["ours.prompt"])


def test_a_file_put_in_the_way_while_saving_is_not_replaced(tiny_chat, tmp_path, monkeypatch):
    llm = edgellama.load(tiny_chat)
    llm.logits(llm.tokenizer.encode(PROMPT))
    target = tmp_path / "late.prompt"
    # the check before the rename sees the newcomer (the rename itself would replace it)
    real_check = prompt_cache.check_target
    calls = []

    def check(path):
        calls.append(path)
        if len(calls) == 2:
            target.write_text("written by someone else meanwhile")
        return real_check(path)
    monkeypatch.setattr(prompt_cache, "check_target", check)
    with pytest.raises(EdgeError, match="not a saved prompt"):
        llm.save_prompt(target)
    assert target.read_text() == "written by someone else meanwhile"
    assert [p.name for p in tmp_path.iterdir()] == ["late.prompt"]    # no temporary left


def test_chat_save_onto_a_document_or_fifo_leaves_it(tiny_chat, tmp_path):
    victims = _not_ours(tmp_path)
    before = {k: _state(p) for k, p in victims.items()}
    lines = ["hi"] + [f"/save {p}" for p in victims.values()] + [f"/save {tmp_path}/ok.prompt",
                                                                 "/load /proc/self/mem"]
    res = subprocess.run([EXE, "chat", "-m", tiny_chat, "--no-history", "-n", "2"],
                         input="\n".join(lines).encode() + b"\n", capture_output=True,
                         timeout=120, env=ENV)
    err = res.stderr.decode()
    assert res.returncode == 0 and "Traceback" not in err, err
    for p in victims.values():
        assert f"error: {p} " in err, (p, err)
    assert {k: _state(p) for k, p in victims.items()} == before
    assert prompt_cache.is_saved_prompt(tmp_path / "ok.prompt")
    if os.path.exists("/proc/self/mem"):        # a load that fails names the file (class 3)
        assert "error: /proc/self/mem: cannot read: Input/output error" in err


@pytest.mark.parametrize("kind", ["document", "fifo", "folder", "link", "dangling link"])
def test_prompt_cache_onto_what_is_not_ours_is_refused_before_loading(tmp_path, kind):
    victims = _not_ours(tmp_path)
    p = victims[kind]
    before = _state(p)
    # the model named does not exist: the refusal comes first, before any load
    res = invoke("generate", "-m", tmp_path / "no-model.gguf", "-p", "hi", "--prompt-cache", p)
    assert_user_error(res, str(p), "a save replaces only a saved prompt")
    assert _state(p) == before


@pytest.mark.parametrize("kind", ["fifo", "folder", "link", "dangling link"])
def test_convert_force_replaces_only_a_regular_file(tmp_path, kind):
    checkpoint = tmp_path / "hf"
    checkpoint.mkdir()
    victims = _not_ours(tmp_path)
    p = victims[kind]
    before = _state(p)
    res = invoke("convert", checkpoint, "-o", p, "--force", "--quiet")
    if kind == "folder":           # click refuses a folder for -o as a usage error
        assert res.exit_code == 2 and "is a directory" in res.stderr
    else:
        assert_user_error(res, str(p), "--force replaces only a regular file")
    assert _state(p) == before


# -- 2: counts bounded by what they can mean ---------------------------------------------
def test_huge_draft_lengths_are_lowered_to_what_the_context_checks(tiny_chat):
    t0 = time.perf_counter()
    res = invoke("generate", "-m", tiny_chat, "--lookup", "--draft-max", 10**9,
                 "--draft-min", 10**6, "--ctx", 64, "-n", 16, "--temp", 0, "-p", PROMPT)
    assert res.exit_code == 0, res.output
    assert "note: --draft-max 1000000000 lowered to 63" in res.stderr
    assert "note: --draft-min 1000000 lowered to 63" in res.stderr
    assert time.perf_counter() - t0 < 30          # was past a minute


def test_drafter_bounds_its_lengths_by_the_context(tiny_chat):
    from edgellama.speculative import MAX_DRAFT, PromptLookup, draft_limit
    assert draft_limit(64) == 63 and draft_limit(1) == 1 and draft_limit(10**6) == MAX_DRAFT
    llm = edgellama.load(tiny_chat, ctx=32)
    length = PromptLookup(draft_min=10**6, draft_max=10**9).length_for(llm.model)
    assert (length.draft_min, length.draft_max) == (31, 31)
    # the API without the CLI: as fast and as many tokens as without speculation
    t0 = time.perf_counter()
    ids = llm.tokenizer.encode(PROMPT)
    out = list(llm.generate(ids, max_tokens=8, drafter=PromptLookup(draft_max=10**9),
                            sampling=edgellama.SamplingParams(temperature=0)))
    assert 0 < len(out) <= 8 and time.perf_counter() - t0 < 20


@pytest.mark.parametrize("args", [
    ["generate", "-p", "hi", "-n", "0"],
    ["generate", "-p", "hi", "-t", "0"],
    ["generate", "-p", "hi", "-t", "-4"],
    ["generate", "-p", "hi", "-t", "100000"],
    ["generate", "-p", "hi", "-c", "0"],
    ["generate", "-p", "hi", "-c", "-1"],
    ["generate", "-p", "hi", "--draft-max", "0", "--lookup"],
    ["generate", "-p", "hi", "--draft-min", "-1", "--lookup"],
    ["generate", "-p", "hi", "--draft-min", "9", "--draft-max", "3", "--lookup"],
    ["generate", "-p", "hi", "--lookup", "--draft", "x.gguf"],
    ["generate", "-p", "hi", "--seed", "-2"],
    ["generate", "-p", "hi", "--top-k", "-1"],
    ["generate", "-p", "hi", "--top-p", "0"],
    ["generate", "-p", "hi", "--min-p", "1.5"],
    ["generate", "-p", "hi", "--temp", "inf"],
    ["generate", "-p", "hi", "--repeat-penalty", "-1"],
    ["chat", "-n", "0"],
    ["chat", "-t", "0"],
    ["chat", "-c", "0"],
    ["chat", "--draft-min", "5", "--draft-max", "1", "--lookup"],
    ["serve", "--port", "65536"],
    ["serve", "--parallel", "0"],
    ["serve", "--parallel", "100000"],
    ["serve", "--queue", "-1"],
    ["serve", "--queue", str(10**30)],
    ["serve", "--slot-spill-max", "-1"],
    ["serve", "-t", "0"],
    ["serve", "-c", "0"],
    ["perplexity", "-f", "x.txt", "-c", "3"],
    ["perplexity", "-f", "x.txt", "--chunks", "0"],
    ["perplexity", "-f", "x.txt", "-t", "0"],
])
def test_counts_out_of_range_are_usage_errors_on_every_command(tiny_chat, args):
    # -m before the command's other options: the refusal comes before the model loads
    res = invoke(args[0], "-m", tiny_chat, *args[1:])
    assert res.exit_code == 2, (res.exit_code, res.output)
    assert "Error:" in res.stderr and "Traceback" not in res.output


# -- 3: every file error names the file and what went wrong ------------------------------
needs_proc = pytest.mark.skipif(not os.path.exists("/proc/self/mem"), reason="Linux /proc")


@needs_proc
@pytest.mark.parametrize("args", [
    ["generate", "-p", "hi", "--prompt-cache", "/proc/self/mem"],
    ["generate", "-f", "/proc/self/mem"],
    ["generate", "-p", "hi", "--draft", "/proc/self/mem"],
    ["perplexity", "-f", "/proc/self/mem", "-c", "16"],
])
def test_an_unreadable_file_is_named_in_the_error(tiny_chat, args):
    res = invoke(args[0], "-m", tiny_chat, *args[1:])
    assert_user_error(res, "/proc/self/mem")
    assert "error: Input/output error" not in res.stderr


@needs_proc
def test_convert_names_an_input_it_cannot_read(tmp_path):
    from hf_fixtures import write_tiny_llama
    checkpoint = write_tiny_llama(tmp_path / "hf", tokenizer=None, vocab=256)
    shard = checkpoint / "model.safetensors"
    shard.unlink()
    shard.symlink_to("/proc/self/mem")
    assert_user_error(invoke("convert", checkpoint, "-o", tmp_path / "out.gguf"),
                      f"{shard}: cannot read: Input/output error")
    shard.unlink()
    os.mkfifo(shard)                   # refused at once, not waited on
    res = invoke("convert", checkpoint, "-o", tmp_path / "out.gguf")
    assert res.exit_code == 1 and "Traceback" not in res.output
    assert not (tmp_path / "out.gguf").exists()
    # a tiktoken tokenizer file, read after the shards
    checkpoint = write_tiny_llama(tmp_path / "hf2", tokenizer=None, vocab=256)
    (checkpoint / "tokenizer.model").symlink_to("/proc/self/mem")
    assert_user_error(invoke("convert", checkpoint, "-o", tmp_path / "out.gguf"),
                      f"{checkpoint / 'tokenizer.model'}: cannot read: Input/output error")


def test_a_path_through_a_file_is_named(tiny_chat, tmp_path):
    inside = f"{tiny_chat}/x"          # ENOTDIR
    for args in (["generate", "-m", tiny_chat, "-f", inside],
                 ["generate", "-m", tiny_chat, "-p", "hi", "--prompt-cache", inside],
                 ["perplexity", "-m", tiny_chat, "-f", inside, "-c", "16"]):
        assert_user_error(invoke(*args), inside, "Not a directory")


@needs_proc
def test_loading_a_saved_prompt_that_cannot_be_read(tmp_path):
    with pytest.raises(EdgeError, match=r"^/proc/self/mem: cannot read: Input/output error$"):
        prompt_cache.saved_chat(Path("/proc/self/mem"))
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(EdgeError, match=rf"^{fifo}: cannot read: not a regular file"):
        prompt_cache.saved_chat(fifo)          # at once: a FIFO is never waited on


def test_an_os_error_no_command_worded_still_names_its_file(tiny_chat, monkeypatch):
    import edgellama.cli.generate as gen

    def fails(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error", "/the/failing/file")
    monkeypatch.setattr(gen, "load", fails)
    res = invoke("generate", "-m", tiny_chat, "-p", "hi")
    assert_user_error(res, "/the/failing/file: Input/output error")


def test_standard_input_that_cannot_be_read_is_named(tiny_chat, monkeypatch):
    import edgellama.cli.generate as gen

    def fails(stream, name):
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(gen, "_read", fails)
    res = invoke("generate", "-m", tiny_chat, "-p", "-")
    assert_user_error(res, "standard input: cannot read: Input/output error")


# -- 6: an empty or blank path is a usage error ------------------------------------------
@pytest.mark.parametrize("blank", ["", "  "])
@pytest.mark.parametrize("args", [
    ["generate", "-m", "@", "-p", "hi"],
    ["generate", "-f", "@"],
    ["generate", "-p", "hi", "--prompt-cache", "@"],
    ["generate", "-p", "hi", "--draft", "@"],
    ["generate", "-hf", "@", "-p", "hi"],
    ["chat", "@"],
    ["chat", "-m", "@"],
    ["chat", "--draft", "@"],
    ["serve", "@"],
    ["serve", "-m", "@"],
    ["serve", "--slot-save-path", "@"],
    ["perplexity", "@", "-f", "x.txt"],
    ["perplexity", "-m", "@", "-f", "x.txt"],
    ["perplexity", "-f", "@"],
    ["perplexity", "-f", "x.txt", "--ref", "@"],
    ["convert", "@", "-o", "out.gguf"],
    ["convert", "some-dir", "-o", "@"],
    ["bench", "-m", "@"],
])
def test_an_empty_path_is_a_usage_error(tmp_path, monkeypatch, args, blank):
    monkeypatch.chdir(tmp_path)
    res = invoke(*[blank if a == "@" else a for a in args])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert list(tmp_path.iterdir()) == []          # nothing made in the current folder


def test_every_path_option_refuses_an_empty_path():
    """Every click.Path of every command is a FilePath (or must exist): a new option
    cannot forget the check. Text options naming files (NAME|PATH, a model reference)
    are FileName; the list above runs each."""
    ctx = click.Context(main)
    for name in COMMANDS:
        for param in main.get_command(ctx, name).params:
            kind = param.type
            if isinstance(kind, click.Path):
                assert isinstance(kind, FilePath) or kind.exists, (name, param.name)
            if (name, param.name) == ("generate", "model_arg"):
                continue                    # PROMPT when it names no model: may be empty
            if param.name in ("model", "model_arg", "hf_repo", "draft", "prompt_cache", "ref"):
                assert isinstance(kind, (FilePath, FileName)) or getattr(kind, "exists", False), \
                    (name, param.name)


def test_a_fifo_or_file_as_slot_folder_is_a_usage_error(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    res = invoke("serve", "--slot-save-path", fifo)
    assert res.exit_code == 2 and "is not a directory" in res.stderr
