"""Saved prompts (prompt_cache.py): a sequence's KV cache and tokens in a file, loaded
later instead of reading the prompt again. A loaded file gives the very logits the
original sequence gives; a file of another model, cache kind or context is refused
with what differs; a damaged, truncated or hostile file is one line of error and leaves
the sequence as it was; writes are atomic; named prompts are listed and removed with
the models."""
from __future__ import annotations

import datetime
import json
import os
import random
import re
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

import edgellama
from edgellama import hub
from edgellama import chat_template
from edgellama import prompt_cache as pc
from edgellama.chat_session import ChatSession
from edgellama.cli.main import main
from edgellama.errors import EdgeError
from edgellama.sampling import SamplingParams
from test_fuzz_caches import _mutate_json
from tiny_gguf import CHATML, TINY_VOCAB, write_tiny_gguf

PROMPT = [5, 9, 17, 200, 3, 3, 90, 41, 42, 43, 120, 7, 8, 250, 11, 19, 23, 60, 61, 62]
MORE = [100, 101, 33]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("m") / "tiny.gguf", "Q8_0", vocab=TINY_VOCAB,
                           tokenizer=True)


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGELLAMA_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _llm(path, ctx=64, **kw):
    return edgellama.load(path, ctx=ctx, batch=8, **kw)


@pytest.fixture(scope="module")
def saved(model_path, tmp_path_factory):
    """A saved prompt of PROMPT, and the logits the original sequence gives for MORE."""
    llm = _llm(model_path)
    llm.logits(PROMPT)
    path = llm.save_prompt(tmp_path_factory.mktemp("p") / "p.prompt",
                           {"system": None, "messages": [{"role": "user", "content": "hi"}],
                            "date": "2026-11-24T10:00:00"})
    want = llm.model.forward(MORE, llm.seq, all_logits=True)
    return path, want


def _state(seq):
    return seq.tokens.copy(), seq.cache.k[:, :, :8].copy(), seq.cache.v[:, :, :len(seq.tokens)].copy()


def test_loaded_prompt_gives_the_original_logits(model_path, saved):
    path, want = saved
    llm = _llm(model_path)
    got = llm.load_prompt(path)
    assert got.tokens == PROMPT == llm.seq.tokens and llm.seq.cache.length == len(PROMPT)
    assert got.chat == {"system": None, "messages": [{"role": "user", "content": "hi"}],
                        "date": "2026-11-24T10:00:00"}
    # the same K/V bits, so the same logits bit for bit
    np.testing.assert_array_equal(llm.model.forward(MORE, llm.seq, all_logits=True), want)
    # and a new prompt reuses what it shares with the loaded one
    llm.load_prompt(path)
    llm.logits(PROMPT[:12] + [77, 78])
    assert llm.stats.prompt_tokens == 2


def test_a_smaller_or_larger_context_takes_a_prompt_that_fits(model_path, saved):
    path, want = saved
    for ctx in (len(PROMPT) + len(MORE), 200):
        llm = _llm(model_path, ctx=ctx)
        llm.load_prompt(path)
        np.testing.assert_array_equal(llm.model.forward(MORE, llm.seq, all_logits=True), want)
    with pytest.raises(EdgeError, match=f"holds {len(PROMPT)} tokens, more than this context of "
                                        f"16; use --ctx {len(PROMPT)} or more"):
        _llm(model_path, ctx=16).load_prompt(path)


def test_another_model_is_refused(model_path, saved, tmp_path):
    path, _ = saved
    other = write_tiny_gguf(tmp_path / "tiny.gguf", "Q8_0", vocab=TINY_VOCAB, tokenizer=True, seed=1)
    with pytest.raises(EdgeError, match=r"saved with the model tiny.gguf \(a file of that name with "
                                        r"other content\), not tiny.gguf; load it with that model"):
        _llm(other).load_prompt(path)
    # a copy under another name is the same model
    shutil.copy(model_path, tmp_path / "copy.gguf")
    assert _llm(tmp_path / "copy.gguf").load_prompt(path).tokens == PROMPT


def test_another_activations_mode_is_refused(model_path, saved):
    with pytest.raises(EdgeError, match="saved with --activations int8, this run uses fine"):
        _llm(model_path, activations="fine").load_prompt(saved[0])


def _rewrite(path, change):
    """The file with its header changed by change(header) and sealed again (a valid
    checksum), its arrays where they were."""
    data = bytearray(path.read_bytes())
    _, version, n = pc._HEAD.unpack(data[:pc._HEAD.size])
    header = json.loads(data[pc._HEAD.size:pc._HEAD.size + n])
    change(header)
    blob = pc._encode(header)
    assert pc._HEAD.size + len(blob) <= pc.ALIGN
    data[:pc.ALIGN] = (pc._HEAD.pack(pc.MAGIC, version, len(blob)) + blob).ljust(pc.ALIGN, b"\0")
    path.write_bytes(bytes(data))


def test_another_cache_type_is_refused(model_path, saved, tmp_path):
    """A q8_0 cache's file is never loaded into an f16 cache, even with arrays that fit."""
    path = tmp_path / "q8.prompt"
    shutil.copy(saved[0], path)
    _rewrite(path, lambda h: h["cache"].update(k_type="q8_0"))
    llm = _llm(model_path)
    with pytest.raises(EdgeError, match=r'another kind: k_type "q8_0" \(this run: "f16"\)'):
        llm.load_prompt(path)
    assert llm.seq.tokens == []


def _one_line_error(llm, path):
    before = _state(llm.seq)
    with pytest.raises(EdgeError) as e:
        llm.load_prompt(path)
    assert "\n" not in str(e.value) and str(path) in str(e.value)
    after = _state(llm.seq)
    assert after[0] == before[0] and all(np.array_equal(a, b) for a, b in zip(after[1:], before[1:]))
    return str(e.value)


def test_damaged_files_are_one_line_errors(model_path, saved, tmp_path):
    good = saved[0].read_bytes()
    llm = _llm(model_path)
    llm.logits([1, 2, 3])              # a sequence that must stay as it is
    path = tmp_path / "bad.prompt"
    cases = {
        "empty": b"",
        "not ours": b"GGUF" + bytes(100),
        "a newer format": pc._HEAD.pack(pc.MAGIC, 2, 10) + good[pc._HEAD.size:],
        "cut in the header": good[:100],
        "cut in the arrays": good[:len(good) - 1000],
        "a byte of K flipped": good[:pc.ALIGN * 2 + 5] + bytes([good[pc.ALIGN * 2 + 5] ^ 1])
                               + good[pc.ALIGN * 2 + 6:],
        "bytes added": good + bytes(pc.ALIGN),
        "a header byte changed": good[:40] + b"#" + good[41:],
    }
    for what, data in cases.items():
        path.write_bytes(data)
        message = _one_line_error(llm, path)
        assert "save it again" in message or "another version" in message, (what, message)
    for change in (lambda h: h["arrays"]["tokens"].update(offset=0),             # over the header
                   lambda h: h["arrays"]["k"].update(offset=h["arrays"]["v"]["offset"]),
                   lambda h: h["arrays"]["v"].update(shape=[2, 2, 999, 16]),
                   lambda h: h["arrays"]["k"].update(dtype="<f4"),
                   lambda h: h.update(n_tokens=10),                               # shapes disagree
                   lambda h: h["arrays"].pop("v"),
                   lambda h: h.update(chat={"system": 3, "messages": []})):
        shutil.copy(saved[0], path)
        _rewrite(path, change)
        _one_line_error(llm, path)


def test_token_ids_outside_the_vocabulary_are_refused(model_path, saved, tmp_path):
    path = tmp_path / "t.prompt"
    data = bytearray(saved[0].read_bytes())
    header, _ = _header_and_start(data)
    off = header["arrays"]["tokens"]["offset"]
    data[off:off + 4] = struct.pack("<i", 10 ** 6)
    path.write_bytes(bytes(data))
    _rewrite(path, lambda h: h["arrays"]["tokens"].update(
        crc32=f"{__import__('zlib').crc32(bytes(data[off:off + 4 * len(PROMPT)])):08x}"))
    assert "outside this model's vocabulary" in _one_line_error(_llm(model_path), path)


def _header_and_start(data):
    _, _, n = pc._HEAD.unpack(bytes(data[:pc._HEAD.size]))
    return json.loads(bytes(data[pc._HEAD.size:pc._HEAD.size + n])), pc._HEAD.size + n


def test_fuzzed_files_load_exactly_or_not_at_all(model_path, saved, tmp_path):
    """Seeded mutations of a good file (bytes anywhere, cut short or grown, a header
    sealed with a valid checksum but wrong inside): each is refused with one line, or
    loads the very tokens and K/V that were saved. Never another exception."""
    good = saved[0].read_bytes()
    header, _ = _header_and_start(good)
    llm = _llm(model_path)
    llm.load_prompt(saved[0])
    want = _state(llm.seq)
    path = tmp_path / "f.prompt"
    rng = random.Random(29)
    accepted = 0
    for i in range(300):
        if i % 3 == 0:
            data = bytearray(good)
            for _ in range(rng.randint(1, 8)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            path.write_bytes(bytes(data))
        elif i % 3 == 1:
            path.write_bytes(good[:rng.randrange(len(good))] if rng.random() < 0.7
                             else good + os.urandom(rng.randint(1, 9000)))
        else:
            path.write_bytes(good)
            mutated = _mutate_json(header, rng)
            try:
                _rewrite(path, lambda h: (h.clear(), h.update(mutated)))
            except AssertionError:                    # grew past the first page: skip
                continue
        llm.reset()
        try:
            llm.load_prompt(path)
        except EdgeError as e:
            assert "\n" not in str(e)
            assert llm.seq.tokens == []
            continue
        accepted += 1
        got = _state(llm.seq)
        assert got[0] == want[0] and all(np.array_equal(a, b) for a, b in zip(got[1:], want[1:]))
    assert accepted < 300


def test_a_failed_save_leaves_the_old_file(model_path, saved, tmp_path, monkeypatch):
    path = tmp_path / "keep.prompt"
    shutil.copy(saved[0], path)
    before = path.read_bytes()
    llm = _llm(model_path)
    llm.logits([4, 5, 6])
    calls = []

    def full_disk(*args):
        calls.append(1)
        if len(calls) > 2:
            raise OSError(28, "No space left on device")
        return real(*args)
    real = pc.zlib.crc32
    monkeypatch.setattr(pc.zlib, "crc32", full_disk)
    with pytest.raises(EdgeError, match="No space left on device"):
        llm.save_prompt(path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.prompt"]   # no temporary left


def test_names_and_paths(cache, tmp_path):
    assert pc.resolve("doc") == cache / "prompts" / "doc.prompt" == pc.resolve("doc.prompt")
    assert pc.resolve("./doc") == pc.Path("./doc")
    assert pc.resolve("~/x.prompt") == pc.Path.home() / "x.prompt"
    for bad in ("..", ".hidden", "-x", "a b", "x" * 101, ""):
        with pytest.raises(EdgeError, match="not a saved prompt's name"):
            pc.resolve(bad)


def test_saved_prompts_are_listed_and_removed_with_the_models(model_path, cache, tmp_path):
    llm = _llm(model_path)
    llm.logits(PROMPT)
    llm.save_prompt(pc.resolve("doc"))
    folder = cache / "prompts"
    (folder / "notes.prompt").write_text("a file of the user's, not ours")
    target = tmp_path / "elsewhere.prompt"
    llm.save_prompt(target)
    (folder / "linked.prompt").symlink_to(target)
    found = {m.name: m for m in hub.cached_models()}
    assert "prompts/notes" not in found
    assert found["prompts/doc"].kind == f"saved prompt: {len(PROMPT)} tokens of tiny.gguf"
    assert found["prompts/linked"].kind == "saved prompt (a link)"
    res = CliRunner().invoke(main, ["list"])
    assert "prompts/doc" in res.output, res.output
    res = CliRunner().invoke(main, ["rm", "-y", "prompts/doc", "prompts/linked"])
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in folder.iterdir()) == ["notes.prompt"]
    assert target.exists()                       # the link went, not what it pointed to


def test_generate_prompt_cache_reuses_the_document(model_path, cache):
    """The first run reads the prompt and saves it; a new question about the same text
    reads only what differs, and saves the new prompt."""
    doc = "hello the hello in a ll er on " * 12

    def run(question):
        res = CliRunner().invoke(main, [
            "generate", "-m", str(model_path), "--ctx", "256", "--temp", "0", "-n", "3",
            "--prompt-cache", "doc", "-p", doc + question])
        assert res.exit_code == 0, (res.output, res.stderr)
        return res.stderr
    first = run("first?")
    assert "saved the prompt's" in first and "were in it" not in first
    second = run("second one?")
    in_it, total = map(int, re.search(r"(\d+) of the prompt's (\d+) tokens were in it", second).groups())
    read = int(re.search(r"^prompt: (\d+) tokens", second, re.M)[1])
    assert in_it > 0.8 * total and read == total - in_it and "saved the prompt's" in second
    # the same prompt again: all of it in the file (the last token is read for its logits)
    third = run("second one?")
    assert f"{total} of the prompt's {total}" in third and "saved" not in third


def test_chat_session_save_and_load(tmp_path):
    """A conversation saved with its cache comes back whole in a new session, with the
    chat template's date it was started with (a template that prints today's date must
    give the same prompt on another day), and the next message reads only itself:
    every loaded token is reused."""
    dated = CHATML.replace("{% for m in messages %}", "Today {{ strftime_now('%d %b %Y') }}\n"
                           "{% for m in messages %}")
    path = write_tiny_gguf(tmp_path / "dated.gguf", "Q8_0", vocab=TINY_VOCAB, tokenizer=True,
                           chat_template=dated)
    params = SamplingParams(temperature=0)
    first = ChatSession(_llm(path, ctx=256), params, max_tokens=4, system="be brief")
    first.llm.chat.date = "2026-11-24T23:59:00"
    "".join(first.send("hello there"))
    first.save(tmp_path / "talk.prompt")
    again = ChatSession(_llm(path, ctx=256), params, max_tokens=4)     # today's date
    loaded = again.load(tmp_path / "talk.prompt")
    assert loaded == len(first.llm.cached) and again.system == "be brief"
    assert again.messages == first.messages and len(again.messages) == 2
    assert again.llm.chat.date == "2026-11-24T23:59:00"
    "".join(again.send("the end"))
    st = again.llm.stats
    assert 0 < st.prompt_tokens and again.context_used() == loaded + st.prompt_tokens + st.gen_tokens


@pytest.mark.slow
def test_chat_save_and_load_commands(model_path, cache):
    """/save and /load as typed (chat reads a terminal or a pipe, so a process of its own)."""
    cmd = [sys.executable, "-c", "import sys; from edgellama.cli.main import main; "
           "sys.argv[0] = 'edgellama'; main()", "chat", "-m", str(model_path), "--ctx", "256",
           "--temp", "0", "-n", "4", "--no-history"]
    env = dict(os.environ, EDGELLAMA_CACHE=str(cache))
    res = subprocess.run(cmd + ["-s", "be brief"], input=b"hello there\n/save talk\n",
                         capture_output=True, env=env, timeout=600)
    assert res.returncode == 0 and b"(saved " in res.stderr, res.stderr
    res = subprocess.run(cmd, input=b"/load talk\nthe end\n/stats\n/load nothing\n",
                         capture_output=True, env=env, timeout=600)
    err = res.stderr.decode()
    assert res.returncode == 0 and "2 message(s), a system prompt" in err, err
    loaded = int(re.search(r"loaded (\d+) tokens", err)[1])
    read, reply, used = map(int, re.search(r"prompt: (\d+) tokens.*reply: (\d+) tokens.*"
                                           r"context: (\d+)/", err).groups())
    assert read > 0 and used == loaded + read + reply, err   # every loaded token reused
    assert "error: " in err and "nothing.prompt: no such saved prompt" in err


def test_generate_prompt_cache_keeps_the_template_date(cache, tmp_path, monkeypatch):
    """A template that prints today's date: a prompt saved on another day is rendered
    with that day's date, so the saved tokens still match."""
    dated = CHATML.replace("{% for m in messages %}", "Today {{ strftime_now('%d %b %Y') }}\n"
                           "{% for m in messages %}")
    path = write_tiny_gguf(tmp_path / "dated.gguf", "Q8_0", vocab=TINY_VOCAB, tokenizer=True,
                           chat_template=dated)
    args = ["generate", "-m", str(path), "--ctx", "256", "--temp", "0", "-n", "2",
            "--prompt-cache", "d", "-p", "hello there, all of it"]
    class Then(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(2020, 1, 2, 3, 4, 5)
    with monkeypatch.context() as m:
        m.setattr(chat_template, "datetime", Then)             # saved on 2 Jan 2020
        assert CliRunner().invoke(main, args).exit_code == 0
    assert pc.saved_chat(pc.resolve("d"))["date"] == "2020-01-02T03:04:05"
    res = CliRunner().invoke(main, args)                       # today
    assert res.exit_code == 0, res.stderr
    n = re.search(r"(\d+) of the prompt's (\d+) tokens were in it", res.stderr).groups()
    assert n[0] == n[1], res.stderr


def test_generate_refuses_a_prompt_cache_it_cannot_write_before_reading(model_path, tmp_path):
    res = CliRunner().invoke(main, ["generate", "-m", str(model_path), "-n", "1", "--prompt-cache",
                                    str(tmp_path / "no" / "such" / "x.prompt"), "-p", "hi"])
    assert res.exit_code == 1 and "the folder" in res.stderr and "does not exist" in res.stderr
    assert not re.search(r"^prompt: ", res.stderr, re.M)   # refused before the prompt was read


def test_a_named_save_removes_temporaries_of_killed_saves_only(model_path, cache):
    folder = cache / "prompts"
    folder.mkdir(parents=True)
    stale, fresh = folder / ".edgellama-prompt-old.tmp", folder / ".edgellama-prompt-new.tmp"
    users = folder / "draft.tmp"
    for p in (stale, fresh, users):
        p.write_bytes(b"x")
    os.utime(stale, (1e9, 1e9))
    os.utime(users, (1e9, 1e9))
    llm = _llm(model_path)
    llm.logits(PROMPT)
    llm.save_prompt(pc.resolve("doc"))
    assert sorted(p.name for p in folder.iterdir()) == sorted([fresh.name, users.name, "doc.prompt"])
