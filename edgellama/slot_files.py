"""`serve --slot-save-path DIR`: the server's slots' KV caches in files of DIR, in
prompt_cache's format (the one of `generate --prompt-cache` and chat's /save).

    files = SlotFiles(DIR, spill_max=2 << 30)
    files.path("notes.prompt", saving=True)     # DIR/notes.prompt, or BadFileName
    files.spill(seq, model)                     # an evicted conversation to DIR/spill-*.prompt
    files.best(ids)                             # the spilled cache ids continue furthest

File names come from HTTP clients (POST /slots/{id}?action=save|restore), so they are
hostile: only a plain name inside DIR is taken (no separators, no '..', no leading '.',
at most MAX_NAME characters), a save never replaces anything but a saved prompt, and a
link is followed only to a file in DIR itself.

Spill: when a request evicts another conversation's cache from a slot, that cache is
written to DIR under a name of the server's own (spill-<hash of its tokens>.prompt), and
a later request that continues it is given it back from the file instead of reading its
prompt again. The spilled files take at most `spill_max` bytes, the least recently used
removed first; only the server's own spill files are ever removed.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import stat
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from . import prompt_cache
from .errors import EdgeError

if TYPE_CHECKING:
    from .model import Transformer
    from .sequence import Sequence

log = logging.getLogger("edgellama.server")

MAX_NAME = 128
SPILL_PREFIX = "spill-"
SPILL_MIN = 256          # tokens: a shorter cache is read again about as fast as restored
_NAME = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._-]{{0,{MAX_NAME - 1}}}")
_SPILL = re.compile(rf"{SPILL_PREFIX}[0-9a-f]{{32}}{re.escape(prompt_cache.SUFFIX)}")


class BadFileName(EdgeError):
    """A file name a client may not use (400)."""


class NoSuchFile(EdgeError):
    """No saved prompt of that name in the folder (404)."""


class StorageError(EdgeError):
    """The folder itself fails (removed, replaced by a file, not writable): the server's
    storage, not the client's request."""


class SlotFiles:
    def __init__(self, folder: str | Path, spill_max: int = 0):
        given = Path(folder).expanduser()
        try:
            given.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise EdgeError(f"--slot-save-path {given}: cannot create it: "
                            f"{e.strerror or e}") from None
        if not given.is_dir():
            raise EdgeError(f"--slot-save-path {given} is not a folder")
        self.folder = Path(os.path.realpath(given))
        self.spill_max = spill_max
        # spilled file name -> (its tokens, or None for one of an earlier run: counted
        # against the bound, not matched; its bytes), least recently used first
        self._spilled: OrderedDict[str, tuple[np.ndarray | None, int]] = OrderedDict()
        earlier = [p for p in self.folder.iterdir() if _SPILL.fullmatch(p.name)
                   and prompt_cache.is_saved_prompt(p)]
        for p in sorted(earlier, key=lambda p: p.stat().st_mtime):
            self._spilled[p.name] = (None, p.stat().st_size)
        self._bound()

    def check(self, writing: bool) -> None:
        """StorageError if the folder is gone, is no longer a folder, or (`writing`) can
        no longer be written: it may change under a running server."""
        try:
            st = os.stat(self.folder)
        except OSError as e:
            raise StorageError(f"{self.folder} (--slot-save-path) cannot be reached: "
                               f"{e.strerror or e}") from None
        if not stat.S_ISDIR(st.st_mode):
            raise StorageError(f"{self.folder} (--slot-save-path) is not a folder any more")
        if not os.access(self.folder, os.R_OK | os.X_OK):
            raise StorageError(f"{self.folder} (--slot-save-path) cannot be read")
        if writing and not os.access(self.folder, os.W_OK | os.X_OK):
            raise StorageError(f"{self.folder} (--slot-save-path) cannot be written")

    # -- client names ---------------------------------------------------------------
    def path(self, name, saving: bool) -> Path:
        """DIR/name for a client's file name; BadFileName if the name or what it names is
        not one a client may use, NoSuchFile if there is nothing to restore, StorageError
        if the folder fails."""
        if not isinstance(name, str) or not name:
            raise BadFileName("filename must be a non-empty string")
        shown = prompt_cache._printable(name, 60)
        if not _NAME.fullmatch(name) or ".." in name:
            raise BadFileName(f"filename {shown!r} is not a plain file name: letters, digits, "
                              f"'.', '_' and '-', at most {MAX_NAME}, starting with a letter "
                              f"or digit, no '..'")
        if saving and name.startswith(SPILL_PREFIX):
            raise BadFileName(f"filename {shown!r}: names starting with {SPILL_PREFIX!r} are "
                              f"the server's own spilled caches")
        self.check(writing=saving)
        path = self.folder / name
        try:
            if path.is_symlink():
                if saving:
                    raise BadFileName(f"{name} is a link; a save does not replace it")
                if Path(os.path.realpath(path)).parent != self.folder:
                    raise BadFileName(f"{name} is a link out of the --slot-save-path folder")
            if saving:
                if os.path.lexists(path) and not prompt_cache.is_saved_prompt(path):
                    raise BadFileName(f"{name} exists and is not a saved prompt; it is not "
                                      f"replaced")
            elif not path.exists():
                raise NoSuchFile(f"no saved prompt {name} in the --slot-save-path folder")
        except OSError as e:   # the folder changed under the checks (permissions, a race)
            raise StorageError(f"{path}: cannot look at it: {e.strerror or e}") from None
        return path

    # -- spill ----------------------------------------------------------------------
    def spill(self, seq: Sequence, model: Transformer) -> None:
        """Write seq's cache to a spill file (unless one holds these tokens), dropping
        spill files it continues (they are the same conversation, shorter), then the
        least recently used ones beyond the bound. StorageError if the folder fails."""
        self.check(writing=True)
        tokens = np.asarray(seq.tokens, np.int32)
        digest = hashlib.sha256(tokens.tobytes()).hexdigest()[:32]
        name = f"{SPILL_PREFIX}{digest}{prompt_cache.SUFFIX}"
        if name in self._spilled:
            self._spilled[name] = (tokens, self._spilled[name][1])
            self._spilled.move_to_end(name)
            return
        path = self.folder / name
        if os.path.lexists(path) and not prompt_cache.is_saved_prompt(path):
            raise EdgeError(f"{path} exists and is not a saved prompt; not spilling over it")
        try:
            size = prompt_cache.save(path, seq, model).stat().st_size
        except OSError as e:
            raise EdgeError(f"cannot spill to {path}: {e.strerror or e}") from None
        for other, (t, _) in list(self._spilled.items()):
            if t is not None and len(t) <= len(tokens) and np.array_equal(tokens[:len(t)], t):
                self._remove(other)
        self._spilled[name] = (tokens, size)
        self._bound()

    def best(self, ids: list[int]) -> tuple[str, int] | None:
        """(spill file, tokens of ids it holds) of the spilled cache that ids continue
        furthest (keeping at least half of it, as for a slot), or None."""
        want = np.asarray(ids, np.int64)
        found = None
        for name, (t, _) in self._spilled.items():
            if t is None:
                continue
            m = min(len(t), len(want))
            differ = np.flatnonzero(t[:m] != want[:m])
            n = int(differ[0]) if len(differ) else m
            if 2 * n >= len(t) and n > (found[1] if found else 0):
                found = (name, n)
        return found

    def restore(self, name: str, seq: Sequence, model: Transformer) -> None:
        """Load a spill file into seq; a file that fails (removed, damaged) is forgotten."""
        self._spilled.move_to_end(name)
        try:
            prompt_cache.load(self.folder / name, seq, model)
        except EdgeError:
            self._remove(name)
            raise

    @property
    def spilled_bytes(self) -> int:
        return sum(size for _, size in self._spilled.values())

    def spilled(self) -> list[str]:
        """The spill files, least recently used first."""
        return list(self._spilled)

    def _bound(self) -> None:
        while self._spilled and self.spilled_bytes > self.spill_max:
            self._remove(next(iter(self._spilled)))

    def _remove(self, name: str) -> None:
        self._spilled.pop(name, None)
        path = self.folder / name
        if prompt_cache.is_saved_prompt(path):        # ours, not a link or another file put there
            with contextlib.suppress(OSError):
                path.unlink()
