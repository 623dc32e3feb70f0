"""Hostile input, round three (issue 30), the Hugging Face side: `list` and `rm` never
delete what is not ours (links lose the link, never the target; one repository never takes
a mirror sharing its commit), dangling links neither crash nor hide the rest, repository
references the hub would refuse are answered in our words before anything is asked, and
a Hugging Face or edgellama cache variable naming a file is an error naming the variable.

The caches are built by hand in the layout huggingface_hub keeps (models--O--N/blobs,
refs/main, snapshots/<commit>/<file> -> ../../blobs/<hash>); `list` and `rm` do not import
Numba, so each run takes well under a second."""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from edgellama.errors import EdgeError

from test_hub import FakeHub

EXE = shutil.which("edgellama")
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def run(env, *args, input=None) -> subprocess.CompletedProcess:
    return subprocess.run([EXE, *map(str, args)], capture_output=True, text=True, env=env,
                          input=input, timeout=600)


def error_line(res) -> str:
    """The one `error:` line (a `note:` about the kernel cache may come before it)."""
    assert res.returncode == 1, (res.stdout, res.stderr)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip() and not ln.startswith("note: ")]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert "Traceback" not in res.stderr and "internal error" not in res.stderr, res.stderr
    return lines[0]


@pytest.fixture
def env(tmp_path) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items()
         if not k.startswith(("HF_", "HUGGINGFACE_", "EDGELLAMA_", "XDG_"))}
    e.update(HF_HUB_CACHE=str(tmp_path / "hub"), EDGELLAMA_CACHE=str(tmp_path / "own"),
             HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1", NUMBA_NUM_THREADS="2")
    return e


def add_repo(hub: Path, repo: str, files: dict[str, bytes | Path], commit: str = COMMIT) -> Path:
    """A repository in huggingface_hub's cache layout. A Path value makes the snapshot
    entry a link to that path (a file the user keeps elsewhere), as a user might."""
    d = hub / ("models--" + repo.replace("/", "--"))
    (d / "refs").mkdir(parents=True, exist_ok=True)
    (d / "refs" / "main").write_text(commit)
    snap = d / "snapshots" / commit
    for name, data in files.items():
        entry = snap / name
        entry.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(data, Path):
            entry.symlink_to(data)
            continue
        blob = d / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(exist_ok=True)
        blob.write_bytes(data)
        entry.symlink_to(os.path.relpath(blob, entry.parent))
    return d


def names(env) -> list[str]:
    res = run(env, "list")
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    return [ln.split()[0] for ln in res.stdout.splitlines()[1:]]


# -- links: the link goes, never its target ------------------------------------------------

@pytest.mark.parametrize("others", [0, 1], ids=["only-model", "one-of-two"])
def test_rm_of_a_linked_hub_file_removes_the_link_not_the_target(env, tmp_path, others):
    mine = tmp_path / "my-models" / "Mine-Q4_0.gguf"
    mine.parent.mkdir()
    mine.write_bytes(b"GGUF the user's own file" * 100)
    files: dict = {"Mine-Q4_0.gguf": mine, "README.md": b"# readme\n"}
    if others:
        files["Mine-Q8_0.gguf"] = b"GGUF q8" * 10
    repo = add_repo(tmp_path / "hub", "tester/Linked-GGUF", files)
    assert "tester/Linked-GGUF:Q4_0" in names(env)
    res = run(env, "rm", "-y", "tester/Linked-GGUF:Q4_0")
    assert res.returncode == 0 and "removed tester/Linked-GGUF:Q4_0" in res.stderr, res.stderr
    assert mine.read_bytes() == b"GGUF the user's own file" * 100       # untouched
    assert "tester/Linked-GGUF:Q4_0" not in names(env)
    if others:            # the repository's other model is still there, with its blob
        assert names(env) == ["tester/Linked-GGUF:Q8_0"]
        assert (repo / "snapshots" / COMMIT / "Mine-Q8_0.gguf").read_bytes() == b"GGUF q8" * 10
    else:
        assert not repo.exists()


def test_rm_of_a_hub_repository_whose_folder_is_a_link_removes_the_link(env, tmp_path):
    elsewhere = add_repo(tmp_path / "elsewhere", "tester/Away-GGUF", {"Away-Q8_0.gguf": b"GGUF away"})
    (tmp_path / "hub").mkdir()
    link = tmp_path / "hub" / "models--tester--Away-GGUF"
    link.symlink_to(elsewhere)
    assert names(env) == ["tester/Away-GGUF"]
    assert run(env, "rm", "-y", "tester/Away-GGUF").returncode == 0
    assert not link.is_symlink() and (elsewhere / "snapshots" / COMMIT / "Away-Q8_0.gguf").exists()


def test_rm_of_a_linked_model_in_our_own_cache_keeps_the_target(env, tmp_path):
    mine = tmp_path / "mine.gguf"
    mine.write_bytes(b"GGUF mine")
    (tmp_path / "own").mkdir()
    (tmp_path / "own" / "mine.gguf").symlink_to(mine)
    assert names(env) == ["mine.gguf"]
    assert run(env, "rm", "-y", "mine.gguf").returncode == 0
    assert mine.read_bytes() == b"GGUF mine" and not (tmp_path / "own" / "mine.gguf").is_symlink()


# -- mirrors: removal by repository, never by commit hash -------------------------------------

@pytest.mark.parametrize("which", ["checkpoint", "gguf"])
def test_rm_of_one_repository_keeps_a_mirror_sharing_its_commit(env, tmp_path, which):
    """Either repository, under several hash seeds: huggingface_hub's delete_revisions takes
    the first repository (in set order) holding the commit, which may be the mirror."""
    if which == "gguf":
        files = {"M-Q8_0.gguf": b"GGUF same bytes", "README.md": b"same\n"}
        repos, tag = ("alice/M-GGUF", "bob/M-GGUF"), ":Q8_0"
    else:
        files = {"model.safetensors": b"weights", "config.json": b"{}"}
        repos, tag = ("alice/M", "bob/M"), ""
    for seed in range(6):
        shutil.rmtree(tmp_path / "hub", ignore_errors=True)
        dirs = [add_repo(tmp_path / "hub", r, files) for r in repos]
        if seed == 0:
            assert names(env) == [r + tag for r in repos]
        gone, kept = (0, 1) if seed % 2 else (1, 0)
        before = sorted(str(p.relative_to(dirs[kept])) for p in dirs[kept].rglob("*"))
        res = run({**env, "PYTHONHASHSEED": str(seed)}, "rm", "-y", repos[gone] + tag)
        assert res.returncode == 0, res.stderr
        assert not dirs[gone].exists(), seed
        assert sorted(str(p.relative_to(dirs[kept])) for p in dirs[kept].rglob("*")) == before, seed
    assert names(env) == [repos[kept] + tag]


# -- dangling links ---------------------------------------------------------------------------

def test_dangling_links_are_listed_as_missing_and_rm_removes_them(env, tmp_path):
    gone = tmp_path / "moved-away.gguf"
    add_repo(tmp_path / "hub", "tester/Gone-GGUF", {"Gone-Q4_0.gguf": gone})
    add_repo(tmp_path / "hub", "tester/Here-GGUF", {"Here-Q8_0.gguf": b"GGUF here"})
    (tmp_path / "own").mkdir()
    (tmp_path / "own" / "old.gguf").symlink_to(tmp_path / "nowhere.gguf")
    (tmp_path / "own" / "loop.gguf").symlink_to(tmp_path / "own" / "loop.gguf")   # a loop
    res = run(env, "list")
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    rows = {ln.split()[0]: ln for ln in res.stdout.splitlines()[1:]}
    assert set(rows) == {"tester/Gone-GGUF:Q4_0", "tester/Here-GGUF:Q8_0", "old.gguf", "loop.gguf"}
    for n in ("tester/Gone-GGUF:Q4_0", "old.gguf", "loop.gguf"):
        assert "missing" in rows[n], rows[n]
    assert "missing" not in rows["tester/Here-GGUF:Q8_0"]
    res = run(env, "rm", "-y", "tester/Gone-GGUF:Q4_0", "old.gguf", "loop.gguf")
    assert res.returncode == 0, res.stderr
    assert names(env) == ["tester/Here-GGUF:Q8_0"]
    assert not (tmp_path / "own" / "old.gguf").is_symlink()


# -- references the hub refuses ---------------------------------------------------------------

BAD_REFS = {
    "dots": ("owner/na..me", "'--' and '..'"),
    "dashes": ("owner/na--me", "'--' and '..'"),
    "non-ascii": ("owner/mödel", "ASCII"),
    "too-long": ("owner/" + "a" * 97, "96 characters"),
    "leading-dot": ("owner/.hidden", "start or end"),
    "trailing-dash": ("owner/name-", "start or end"),
    "git": ("owner/name.git", ".git"),
}


@pytest.fixture
def fake():
    f = FakeHub()
    yield f
    f.close()


def test_every_reference_the_hub_refuses_says_why():
    from edgellama import hub
    for ref, needle in BAD_REFS.values():
        with pytest.raises(EdgeError, match="not a valid Hugging Face repository name: .*" + re.escape(needle)):
            hub.check_repo_id(ref)


# Four commands, each a process, per reference: every rule's answer is checked in-process
# above, so two references go through the commands by default, the rest under -m slow.
@pytest.mark.parametrize("case", [c if c in ("dots", "non-ascii") else pytest.param(c, marks=pytest.mark.slow)
                                  for c in sorted(BAD_REFS)])
def test_references_the_hub_refuses_are_answered_before_asking_it(env, fake, tmp_path, case):
    ref, needle = BAD_REFS[case]
    env = {**env, "HF_ENDPOINT": fake.url}
    del env["HF_HUB_OFFLINE"]
    for args in (["generate", ref, "-p", "hi"], ["generate", "-hf", ref + ":Q4_0", "-p", "hi"],
                 ["chat", ref], ["convert", ref, "-o", tmp_path / "out.gguf"]):
        line = error_line(run(env, *args))
        assert "not a valid Hugging Face repository name" in line and needle in line, (args, line)
    assert fake.requests == []                              # nothing asked, nothing downloaded
    assert not (tmp_path / "hub").exists() and not (tmp_path / "out.gguf").exists()


def test_valid_references_still_pass_the_check():
    from edgellama import hub
    for ref in ("bartowski/Llama-3.2-1B-Instruct-GGUF", "a/b", "Org_1/x.y-z_2", "o/" + "a" * 96):
        hub.check_repo_id(ref)


# -- environment: cache variables naming files ------------------------------------------------

@pytest.mark.parametrize("variable", ["HF_HUB_CACHE", "HF_HOME"])
def test_a_hugging_face_cache_variable_naming_a_file_is_an_error_naming_it(env, tmp_path, variable):
    f = tmp_path / "a-file"
    f.write_text("the user's file")
    env = {k: v for k, v in env.items() if k != "HF_HUB_CACHE"}
    env[variable] = str(f)
    for args in (["list"], ["rm", "-y", "x/y:Q4_0"], ["generate", "-hf", "tester/Tiny-GGUF", "-p", "hi"],
                 ["convert", "tester/Tiny", "-o", tmp_path / "o.gguf"]):
        line = error_line(run(env, *args))
        assert variable in line and ("not a directory" in line or "cannot be created" in line), line
    assert f.read_text() == "the user's file"


def test_edgellama_cache_naming_a_file_is_an_error_naming_it(env, tmp_path):
    f = tmp_path / "a-file"
    f.write_text("the user's file")
    env = {**env, "EDGELLAMA_CACHE": str(f)}
    line = error_line(run(env, "generate", "-p", "hi", "-n", "1"))      # the default model
    assert f"EDGELLAMA_CACHE={f}" in line and "not a directory" in line, line
    env["EDGELLAMA_CACHE"] = str(f / "below")
    line = error_line(run(env, "generate", "-p", "hi", "-n", "1"))
    assert "EDGELLAMA_CACHE" in line and "cannot be created" in line, line
    assert f.read_text() == "the user's file"
