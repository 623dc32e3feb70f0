"""Saved prompts: a sequence's KV cache and token ids in a file, so that a later run
starts from them instead of reading the prompt again (generate --prompt-cache, chat's
/save and /load, LLM.save_prompt and LLM.load_prompt).

    b"EDGEKVC\\0" | u32 format version | u32 header length | header (UTF-8 JSON) |
    zeros | arrays, each at a multiple of 4096 bytes, C order, little-endian, in turn

The header says what the file was made with and where its arrays are:

    {"model": {"name": "Llama-3.2-1B-Instruct-Q4_K_M.gguf", "fingerprint": sha256 hex},
     "cache": the KV cache's layout(), its capacity and the positions axis of each
              array's shape left out (they depend on the context, not on the cache type),
     "activations": "int8", "ctx": 8192, "n_tokens": n,
     "arrays": {"tokens": {"dtype": "<i4", "shape": [n], "offset": 4096, "crc32": "hex"},
                "k": {...}, "v": {...}},      # the cache's state(n), as layout() declares
     "chat": {"system": str or null, "messages": [{"role", "content"}, ...],  (optional)
              "date": the chat template's time (ISO), kept so the prompt stays the same},
     "sha256": the digest of the rest of the header}

The model is named by its content (fingerprint(): its metadata, tensor table and some of
every tensor's bytes), not by its file name. A file is loaded only into a run of the same
model, cache types and activations mode, and a context that holds its tokens; any other
is refused with what differs. Everything is checked before use, as the GGUF reader does:
magic, version, lengths, every array's dtype and shape against the running cache's
layout, offsets inside the file, checksums, token ids in the vocabulary. A damaged file
is one line of error, never a crash or a wrong cache. Files are written to a temporary
file in the same folder and renamed into place; nothing is ever pickled.

Names without a slash are saved prompts in cache_dir()/prompts/NAME.prompt, listed and
removed by `edgellama list` / `edgellama rm` (saved_prompts()).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import re
import stat
import struct
import tempfile
import time
import weakref
import zlib
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .default_model import cache_dir
from .errors import EdgeError
from .gguf import GGUFFile

if TYPE_CHECKING:
    from .model import Transformer
    from .sequence import Sequence

MAGIC = b"EDGEKVC\0"
VERSION = 1
_HEAD = struct.Struct("<8sII")       # magic, format version, header length
ALIGN = 4096                         # array offsets: whole pages, so a map of them is too
MAX_HEADER = 16 << 20                # a chat of 128K tokens is well under 1 MiB of JSON
SUFFIX = ".prompt"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
_TMP_PREFIX = ".edgellama-prompt-"
_ROLES = ("user", "assistant")


# -- the model's identity -----------------------------------------------------------
_WINDOWS, _WINDOW = 32, 4096          # evenly spaced samples of the tensor data
_fingerprints: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def fingerprint(g: GGUFFile) -> str:
    """SHA-256 of a model file's content as far as it decides a KV cache: everything
    before the tensor data (metadata, tokenizer, tensor names, shapes and types), and 32
    windows of 4 KiB evenly spread over the tensor data. Another quantization, fine-tune
    or conversion changes them; a copy or rename does not. 32 page reads, not the file
    (a model started from its tile cache may have none of it in memory)."""
    if (known := _fingerprints.get(g)) is not None:
        return known
    h = hashlib.sha256(b"edgellama model fingerprint 1\0")
    h.update(g.read_bytes(0, g.data_offset))
    span = max(g.file_size - g.data_offset - _WINDOW, 0)
    for i in range(_WINDOWS):
        h.update(g.read_bytes(g.data_offset + span * i // (_WINDOWS - 1), _WINDOW))
    _fingerprints[g] = digest = h.hexdigest()
    return digest


def _per_position(layout: dict) -> dict:
    """A cache's layout() without what depends on its context: the capacity, and each
    array's extent along its positions axis. Two caches with equal ones can exchange
    state(n) for any n both hold."""
    out = {k: v for k, v in layout.items() if k not in ("capacity", "arrays")}
    out["arrays"] = {name: dict(a, shape=[d if i != a["axis"] else None
                                          for i, d in enumerate(a["shape"])])
                     for name, a in layout["arrays"].items()}
    return out


def _identity(model: Transformer, seq: Sequence) -> dict:
    return {"model": {"name": model.gguf.path.name, "fingerprint": fingerprint(model.gguf)},
            "cache": _per_position(seq.cache.layout()), "activations": model.activations}


def _expected_arrays(layout: dict, n: int) -> dict[str, tuple[str, list[int]]]:
    """name -> (dtype, shape) of each array a file of n tokens holds, for this layout."""
    want = {"tokens": ("<i4", [n])}
    for name, a in layout["arrays"].items():
        shape = list(a["shape"])
        shape[a["axis"]] = -(-n // a["per_index"])
        want[name] = (a["dtype"], shape)
    return want


# -- names --------------------------------------------------------------------------
def prompts_dir() -> Path:
    return cache_dir() / "prompts"


def resolve(name_or_path: str) -> Path:
    """The file a saved prompt's NAME or PATH means: with a slash (or a leading ~), the
    path; otherwise prompts_dir()/NAME.prompt."""
    if "/" in name_or_path or os.sep in name_or_path or name_or_path.startswith("~"):
        return Path(name_or_path).expanduser()
    name = name_or_path.removesuffix(SUFFIX)
    if not _NAME.fullmatch(name):
        raise EdgeError(f"{name_or_path[:120]!r} is not a saved prompt's name: letters, digits, "
                        f"'.', '_' and '-', at most 100, not starting with '.' or '-'; for a "
                        f"file elsewhere give a path with a /, e.g. ./{name_or_path[:40]}")
    return prompts_dir() / (name + SUFFIX)


# -- writing ------------------------------------------------------------------------
def save(path: str | Path, seq: Sequence, model: Transformer, chat: dict | None = None) -> Path:
    """Write the sequence's tokens and KV cache (and `chat`, a conversation to restore
    with them) to path, atomically: a temporary file in its folder, renamed into place.
    A named prompt's folder is created; another path's folder must exist."""
    path = Path(path)
    n = seq.pos
    if n == 0:
        raise EdgeError("nothing to save: no prompt has been read yet")
    tokens = np.asarray(seq.tokens, np.int64)
    if tokens.min() < 0 or tokens.max() >= model.args.vocab_size:
        raise ValueError("the sequence holds token ids outside the vocabulary")
    ident = _identity(model, seq)
    layout = seq.cache.layout()
    arrays = {"tokens": tokens.astype("<i4"), **seq.cache.state(n)}
    want = _expected_arrays(layout, n)
    for name, a in arrays.items():          # what load() will demand
        assert [a.dtype.str, list(a.shape)] == list(want[name]), name
    header = dict(ident, ctx=seq.ctx, n_tokens=n, arrays={})
    if chat is not None:
        header["chat"] = _checked_chat(chat)
    # offsets depend on the header's length and it on them: settle both (crc32 and sha256
    # are fixed-width, so the final header has the length of this one)
    start = ALIGN
    while True:
        off = start
        for name, a in arrays.items():
            header["arrays"][name] = {"dtype": a.dtype.str, "shape": list(a.shape),
                                      "offset": off, "crc32": "0" * 8}
            off = -(-(off + a.nbytes) // ALIGN) * ALIGN
        blob = _encode(header)
        if _HEAD.size + len(blob) <= start:
            break
        start = -(-(_HEAD.size + len(blob)) // ALIGN) * ALIGN
    check_target(path)
    named = path.parent == prompts_dir()
    try:
        if named:
            path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_TMP_PREFIX, suffix=".tmp")
    except OSError as e:
        raise EdgeError(f"cannot save the prompt in {path.parent}: {e.strerror or e}") from None
    try:
        with open(fd, "wb") as f:
            for name, a in arrays.items():
                entry = header["arrays"][name]
                f.seek(entry["offset"])
                crc = 0
                for part in (a if a.ndim > 1 else [a]):    # a layer at a time: no big copy
                    part = np.ascontiguousarray(part)
                    crc = zlib.crc32(part, crc)
                    f.write(part)
                entry["crc32"] = f"{crc:08x}"
            final = _encode(header)
            assert len(final) == len(blob)
            f.seek(0)
            f.write(_HEAD.pack(MAGIC, VERSION, len(final)) + final)
        check_target(path)          # nothing of the user's put there while it was written
        os.replace(tmp, path)
        if named:
            _remove_stale_temporaries(path.parent)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise EdgeError(f"cannot save the prompt to {path}: {e.strerror or e}") from None
        raise
    return path


def _remove_stale_temporaries(folder: Path) -> None:
    """Temporary files of saves that were killed (ours by their prefix, and an hour old,
    so not another process's save in progress)."""
    for p in folder.glob(f"{_TMP_PREFIX}*.tmp"):
        with contextlib.suppress(OSError):
            if p.lstat().st_mtime < time.time() - 3600 and p.is_file() and not p.is_symlink():
                p.unlink()


def is_saved_prompt(path: str | Path) -> bool:
    """Whether path is a regular file (not a link) that starts as a saved prompt: the
    only kind of file a save may replace. Read without following a link or waiting on
    a FIFO."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return False
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode) and os.read(fd, len(MAGIC)) == MAGIC
    except OSError:
        return False
    finally:
        os.close(fd)


def check_target(path: Path) -> None:
    """EdgeError unless a prompt can be saved to path without losing anything of the
    user's: nothing there yet, or a saved prompt, which the save replaces. A link (to
    anything), a folder, a FIFO, a device or any other file is never replaced nor
    followed. Checked before the work of reading the prompt, and again before the
    saved file takes its place."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise EdgeError(f"{path}: cannot save the prompt there: {e.strerror or e}") from None
    if st is not None:
        what = ("is a link" if stat.S_ISLNK(st.st_mode) else
                "is a directory" if stat.S_ISDIR(st.st_mode) else
                "is not a regular file" if not stat.S_ISREG(st.st_mode) else
                None if is_saved_prompt(path) else "exists and is not a saved prompt")
        if what:
            raise EdgeError(f"{path} {what}; a save replaces only a saved prompt, so it is "
                            f"left as it is: give another name, or remove it first")
    if path.parent != prompts_dir() and not path.parent.is_dir():
        raise EdgeError(f"cannot save the prompt to {path}: the folder {path.parent} does not exist")


def _encode(header: dict) -> bytes:
    content = {k: v for k, v in header.items() if k != "sha256"}
    return json.dumps(dict(content, sha256=_digest(content)), sort_keys=True).encode()


def _digest(content: dict) -> str:
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


# -- reading ------------------------------------------------------------------------
class _Damaged(Exception):
    """Not a saved prompt as this version writes them: the reason, for one line."""


@dataclass
class SavedPrompt:
    path: Path
    tokens: list[int]
    chat: dict | None                                # {"system", "messages"} if recorded
    header: dict = field(repr=False)


def _open_regular(path: Path):
    """An open binary file, if path is a regular file (a FIFO or device would block or
    never end)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise EdgeError(f"{path}: no such saved prompt") from None
    except OSError as e:
        raise EdgeError(f"{path}: cannot read: {e.strerror or e}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise EdgeError(f"{path}: cannot read: not a regular file, so not a saved prompt")
    return open(fd, "rb")


def _read_header(f, size: int) -> dict:
    """The header of an open file of `size` bytes, checked for form and checksum."""
    head = f.read(_HEAD.size)
    if len(head) < _HEAD.size or head[:len(MAGIC)] != MAGIC:
        raise _Damaged("not a saved prompt (it does not start as one)")
    _, version, n = _HEAD.unpack(head)
    if version != VERSION:
        raise _Damaged(f"saved by another version of edgellama (format {version}, this one "
                       f"reads {VERSION})")
    if n > MAX_HEADER or _HEAD.size + n > size:
        raise _Damaged("its header runs past the end of the file (truncated?)")
    try:
        header = json.loads(f.read(n).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise _Damaged("its header is not valid JSON") from None
    if not isinstance(header, dict) or header.get("sha256") != _digest(
            {k: v for k, v in header.items() if k != "sha256"}):
        raise _Damaged("its header does not match its checksum")
    _check_form(header)
    return header


def _is(v, kind) -> bool:
    return type(v) is kind        # not bool for int, nor int for float


def _check_form(h: dict) -> None:
    """What a header must hold, of the right kinds (not yet: whether it fits this run)."""
    model, arrays = h.get("model"), h.get("arrays")
    if not (isinstance(model, dict) and _is(model.get("name"), str)
            and _is(model.get("fingerprint"), str) and isinstance(h.get("cache"), dict)
            and _is(h.get("activations"), str) and _is(h.get("ctx"), int)
            and _is(h.get("n_tokens"), int) and 0 < h["n_tokens"] <= h["ctx"] < 1 << 31
            and isinstance(arrays, dict) and arrays
            and all(isinstance(a, dict) for a in arrays.values())):
        raise _Damaged("its header lacks a field or has one of the wrong kind")
    if "chat" in h:
        try:
            _checked_chat(h["chat"])
        except ValueError:
            raise _Damaged("its conversation is not a list of user and assistant messages") from None


def _checked_chat(chat) -> dict:
    if not (isinstance(chat, dict) and set(chat) == {"system", "messages", "date"}
            and (chat["system"] is None or _is(chat["system"], str))
            and isinstance(chat["messages"], list)
            and all(isinstance(m, dict) and set(m) == {"role", "content"}
                    and m["role"] in _ROLES and _is(m["content"], str) for m in chat["messages"])
            and _is(chat["date"], str) and len(chat["date"]) < 64):
        raise ValueError("a chat is {'system': str or None, 'messages': [{'role', 'content'}], "
                         "'date': the chat template's ISO time}")
    datetime.fromisoformat(chat["date"])          # ValueError if not a time
    return {"system": chat["system"], "messages": [dict(m) for m in chat["messages"]],
            "date": chat["date"]}


def saved_chat(path: Path) -> dict | None:
    """The conversation a saved prompt records, if any, from its header alone (for the
    chat template's date before the prompt is rendered); EdgeError if it is damaged."""
    with _open_regular(path) as f:
        try:
            return _read_header(f, os.fstat(f.fileno()).st_size).get("chat")
        except _Damaged as e:
            raise EdgeError(f"{path}: {e}; save it again") from None
        except OSError as e:        # /proc/self/mem, a failing disk
            raise EdgeError(f"{path}: cannot read: {e.strerror or e}") from None


def _refuse_other_run(path: Path, h: dict, ident: dict, ctx: int) -> None:
    """EdgeError saying what differs between the file's run and this one, if anything."""
    mine, theirs = ident["model"], h["model"]
    if theirs.get("fingerprint") != mine["fingerprint"]:
        same = " (a file of that name with other content)" if theirs["name"] == mine["name"] else ""
        raise EdgeError(f"{path} was saved with the model {_printable(theirs['name'])}{same}, not "
                        f"{mine['name']}; load it with that model, or read the prompt again "
                        f"with this one (a new save replaces the file)")
    if h["cache"] != ident["cache"]:
        want, got = ident["cache"], h["cache"]
        keys = [k for k in sorted(set(want) | set(got), key=str) if want.get(k) != got.get(k)]
        what = ", ".join(f"{k} {_short(got.get(k))} (this run: {_short(want.get(k))})"
                         for k in keys if k != "arrays") or "its arrays differ from this run's"
        raise EdgeError(f"{path} holds a KV cache of another kind: {what}; load it with the "
                        f"cache settings it was saved with, or read the prompt again")
    if h["activations"] != ident["activations"]:
        raise EdgeError(f"{path} was saved with --activations {_printable(h['activations'])}, this run "
                        f"uses {ident['activations']}; use the same, or read the prompt again")
    if h["n_tokens"] > ctx:
        raise EdgeError(f"{path} holds {h['n_tokens']} tokens, more than this context of {ctx}; "
                        f"use --ctx {h['n_tokens']} or more")


def _short(v) -> str:
    return json.dumps(v)[:40]


def _printable(text: str, most: int = 80) -> str:
    """A string from a file, safe for one line of output."""
    return "".join(c if c.isprintable() else "?" for c in text[:most])


def _map_arrays(mm, h: dict, layout: dict, size: int, start: int) -> dict[str, np.ndarray]:
    """The file's arrays as views of the map, after checking each against what this
    cache's layout says a file of n tokens holds, and its checksum."""
    want = _expected_arrays(layout, h["n_tokens"])
    if set(h["arrays"]) != set(want):
        raise _Damaged(f"it holds arrays {sorted(h['arrays'])[:6]}, not {sorted(want)}")
    if not all(_is(e.get("offset"), int) for e in h["arrays"].values()):
        raise _Damaged("an array's offset is not a number")
    out, end = {}, start
    for name, entry in sorted(h["arrays"].items(), key=lambda e: e[1]["offset"]):
        dtype, shape = want[name]
        off = entry["offset"]
        if entry.get("dtype") != dtype or entry.get("shape") != shape:
            raise _Damaged(f"its array {name} is not {dtype} {shape}")
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if not (off % ALIGN == 0 and end <= off and off + nbytes <= size):
            raise _Damaged(f"its array {name} lies outside the file or over another (truncated?)")
        if not _is(entry.get("crc32"), str) or \
                entry["crc32"] != f"{zlib.crc32(memoryview(mm)[off:off + nbytes]):08x}":
            raise _Damaged(f"its array {name} does not match its checksum")
        end = off + nbytes
        out[name] = np.frombuffer(mm, dtype, int(np.prod(shape)), off).reshape(shape)
    if -(-end // ALIGN) * ALIGN < size:
        raise _Damaged("it holds more bytes than its arrays")
    return out


def load(path: str | Path, seq: Sequence, model: Transformer) -> SavedPrompt:
    """Read a saved prompt into seq (its KV cache and tokens), after checking the file
    and that it was made by this model and cache kind; EdgeError otherwise, with seq
    unchanged."""
    path = Path(path)
    ident = _identity(model, seq)
    with _open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        try:
            h = _read_header(f, size)
            _refuse_other_run(path, h, ident, seq.ctx)
            start = -(-f.tell() // ALIGN) * ALIGN          # where the arrays may begin
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except _Damaged as e:
            raise EdgeError(f"{path}: {e}; save it again") from None
        except OSError as e:
            raise EdgeError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        arrays = _map_arrays(mm, h, seq.cache.layout(), size, start)
        tokens = arrays.pop("tokens")
        if tokens.min() < 0 or tokens.max() >= model.args.vocab_size:
            raise _Damaged(f"it holds token ids outside this model's vocabulary of "
                           f"{model.args.vocab_size}")
        seq.reset()
        seq.cache.load_state(arrays, h["n_tokens"])
        seq.tokens = tokens.tolist()
    except _Damaged as e:
        raise EdgeError(f"{path}: {e}; save it again") from None
    finally:
        arrays = tokens = None          # views of the map: gone before it closes
        with contextlib.suppress(BufferError):
            mm.close()
    return SavedPrompt(path, list(seq.tokens), h.get("chat"), h)


# -- the folder of named prompts ----------------------------------------------------
def saved_prompts() -> list[tuple[str, Path, str]]:
    """(name, file, what it is) of each saved prompt in prompts_dir(), by name: ours by
    their magic (anything else there is not listed, so never removed), and links, as
    links (removing one removes the link only)."""
    folder = prompts_dir()
    if folder.is_symlink() or not folder.is_dir():
        return []
    found = []
    for p in sorted(folder.iterdir()):
        if not p.name.endswith(SUFFIX) or p.name.startswith("."):
            continue
        name = p.name.removesuffix(SUFFIX)
        if p.is_symlink():
            found.append((name, p, "saved prompt (a link)"))
            continue
        with contextlib.suppress(OSError, EdgeError):
            with _open_regular(p) as f:
                size = os.fstat(f.fileno()).st_size
                try:
                    h = _read_header(f, size)
                    what = f"saved prompt: {h['n_tokens']} tokens of {_printable(h['model']['name'])}"
                except _Damaged as e:
                    if f.seek(0) or f.read(len(MAGIC)) != MAGIC:
                        continue             # not ours
                    what = f"saved prompt, unreadable: {e}"
            found.append((name, p, what))
    return found
