"""`edgellama list` accounts for everything in edgellama's cache folder (issue 35, class 9):
each file we keep (models, bench's random-weight models, tiles, saved prompts, compiled
kernels, the chat history, leftovers of killed runs) listed with its size and removable
by that name with `rm`; anything else counted, never removed."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner

import edgellama.tile_cache  # noqa: F401  (numba, and its kernel cache, set up before the
from edgellama import hub     # tests point EDGELLAMA_CACHE elsewhere: `list` imports it)
from edgellama.cli.main import main


def _write(p: Path, n: int) -> Path:
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(b"x" * n)
    return p


@pytest.fixture
def own(tmp_path, monkeypatch):
    d = tmp_path / "own"
    monkeypatch.setenv("EDGELLAMA_CACHE", str(d))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    ours = {
        "model.gguf": _write(d / "model.gguf", 1000),
        "bench/llama-3.2-1b-random-q4_0.gguf": _write(d / "bench/llama-3.2-1b-random-q4_0.gguf", 3000),
        "bench/llama-3.2-3b-random-q8_0.tmp": _write(d / "bench/llama-3.2-3b-random-q8_0.tmp", 700),
        "chat_history": _write(d / "chat_history", 50),
        "prompts/.edgellama-prompt-abc.tmp": _write(d / "prompts/.edgellama-prompt-abc.tmp", 40),
        "tiles/.edgellama-tiles-x.tmp": _write(d / "tiles/.edgellama-tiles-x.tmp", 60),
        "tiles/0123456789abcdef0123.tiles": _write(d / "tiles/0123456789abcdef0123.tiles", 80),
    }
    kernels = [_write(d / "numba/0123456789abcdef/edgellama_ab/kernels.f-10.py311.nbi", 300),
               _write(d / "numba/0123456789abcdef/edgellama_ab/kernels.f-10.py311.1.nbc", 4000)]
    theirs = [_write(d / "notes.txt", 11), _write(d / "bench/my-results.csv", 22),
              _write(d / "prompts/readme.md", 33),
              _write(d / "numba/0123456789abcdef/keep-me.txt", 44)]
    return d, ours, kernels, theirs


def _on_disk(d: Path) -> int:
    return sum(os.lstat(Path(top) / f).st_size for top, _, files in os.walk(d) for f in files)


def test_list_shows_every_file_of_ours_and_its_total_matches_the_disk(own):
    d, ours, kernels, theirs = own
    listed = {m.name: m for m in hub.cached_models()}
    for name, p in ours.items():
        assert listed[name].size == p.stat().st_size, name
    assert listed["kernels/0123456789abcdef"].size == sum(p.stat().st_size for p in kernels)
    assert set(listed) == set(ours) | {"kernels/0123456789abcdef"}
    others, other_bytes = hub.unlisted_files(list(listed.values()))
    assert others == len(theirs) and other_bytes == sum(p.stat().st_size for p in theirs)
    assert sum(m.size for m in listed.values()) + other_bytes == _on_disk(d)
    res = CliRunner().invoke(main, ["list"])
    assert res.exit_code == 0, res.output
    for name in listed:
        assert name in res.stdout
    assert f"also holds {len(theirs)} file(s) of 110 B not made by edgellama" in res.stderr


def test_rm_removes_each_by_name_and_leaves_what_is_not_ours(own):
    d, ours, kernels, theirs = own
    names = [m.name for m in hub.cached_models()]
    res = CliRunner().invoke(main, ["rm", "-y", *names])
    assert res.exit_code == 0, res.output
    assert not any(p.exists() for p in [*ours.values(), *kernels])
    assert all(p.read_bytes() for p in theirs)                   # the user's files stay
    assert hub.cached_models() == []
    assert _on_disk(d) == sum(p.stat().st_size for p in theirs)
    res = CliRunner().invoke(main, ["list"])
    assert res.stdout.startswith(f"no models yet; {d} also holds 4 file(s)")


def test_links_in_the_cache_are_never_followed(own, tmp_path):
    d, *_ = own
    elsewhere = tmp_path / "elsewhere"
    kept = _write(elsewhere / "abcdefabcdefabcd" / "x.nbi", 5)
    (d / "numba" / "fedcbafedcbafedc").symlink_to(elsewhere / "abcdefabcdefabcd")
    (d / "bench" / "llama-3.2-3b-random-q4_0.gguf").symlink_to(kept)
    names = {m.name for m in hub.cached_models()}
    assert "kernels/fedcbafedcbafedc" not in names
    assert "bench/llama-3.2-3b-random-q4_0.gguf" not in names
    CliRunner().invoke(main, ["rm", "-y", *names])
    assert kept.exists()


def test_counting_files_not_ours_stops_at_a_bound(own, monkeypatch):
    # EDGELLAMA_CACHE may name a big folder of the user's: list does not walk all of it
    monkeypatch.setattr(hub, "MAX_UNLISTED", 2)
    res = CliRunner().invoke(main, ["list"])
    assert res.exit_code == 0 and "also holds at least 2 file(s)" in res.stderr, res.output
