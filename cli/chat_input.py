"""What `edgellama chat` reads from the user: one message per Enter, multi-line messages
as ollama takes them (a block opened by a line starting with \"\"\" and closed by a line
ending with \"\"\"), a pasted block as one message (bracketed paste), and keys typed
while a reply streams neither echoed into it nor lost: a line finished with Enter runs at
the next prompt as if typed there, an unfinished one waits there."""
from __future__ import annotations

import os
import re
import select
import stat
import sys
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

try:
    import termios
except ImportError:          # not a POSIX terminal: no modes to switch
    termios = None

PROMPT, MORE = ">>> ", "... "
QUOTES = '"""'
PASTE_ON, PASTE_OFF = "\x1b[?2004h", "\x1b[?2004l"
PASTE_START, PASTE_END = "\x1b[200~", "\x1b[201~"
MAX_HISTORY_BYTES = 16 << 20    # 1000 lines of chat; far more is not a history of ours
_ESCAPES = re.compile(r"\x1b(\[[0-9;?]*[ -/]*[@-~]|O.|.)?")   # CSI, SS3, other ESC pairs
_PASTED = re.compile(re.escape(PASTE_START) + ".*?(?:" + re.escape(PASTE_END) + "|$)", re.S)


def clean(text: str) -> str:
    """Typed input as plain text: undecodable bytes replaced, escape sequences (arrow
    keys, paste markers) and other control characters dropped, ends stripped."""
    text = text.encode("utf-8", "replace").decode("utf-8")   # lone surrogates from bad bytes
    text = _ESCAPES.sub("", text.replace("\r\n", "\n").replace("\r", "\n"))
    return "".join(c for c in text if c in "\t\n" or (ord(c) >= 32 and ord(c) != 127)).strip()


def typed_lines(text: str) -> tuple[list[str], str]:
    """Keys typed ahead, as (the lines finished with Enter, the unfinished rest). Enter is
    CR or LF (a terminal's ICRNL makes CR LF); a bracketed paste keeps its line breaks,
    as at the prompt, where a pasted block is one message."""
    lines, current, at = [], "", 0
    for paste in [*_PASTED.finditer(text), None]:
        typed = text[at:paste.start() if paste else len(text)]
        parts = typed.replace("\r\n", "\n").replace("\r", "\n").split("\n")
        current += parts[0]
        for part in parts[1:]:
            lines.append(current)
            current = part
        if paste:
            current += paste.group()
            at = paste.end()
    return lines, current


class Assembler:
    """Turns what each read returned (a typed line, or a pasted block with its line
    breaks; without readline, with its paste markers) into messages: `feed` returns
    the finished message, or None while a \"\"\" block is open."""

    def __init__(self):
        self.block: list[str] | None = None

    @property
    def open(self) -> bool:
        return self.block is not None

    def feed(self, chunk: str) -> str | None:
        chunk = chunk.replace(PASTE_START, "").replace(PASTE_END, "")
        if self.block is None:
            if not chunk.startswith(QUOTES):
                return chunk
            self.block, chunk = [], chunk[len(QUOTES):]
            if chunk.rstrip().endswith(QUOTES) and chunk.strip() != "":   # \"\"\"one line\"\"\"
                return self._close(chunk)
            self.block.append(chunk)
            return None
        if chunk.rstrip().endswith(QUOTES):
            return self._close(chunk)
        self.block.append(chunk)
        return None

    def _close(self, last: str) -> str:
        self.block.append(last.rstrip()[:-len(QUOTES)])
        text, self.block = "\n".join(self.block), None
        return text

    def discard(self) -> None:
        self.block = None


def unreadable_history(path: Path) -> str | None:
    """Why the history file at `path` must not be read nor replaced (it is not a regular
    file, cannot be read, is not UTF-8 text, is a dangling link); None if it is fine to
    use or does not exist yet."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "a link to nothing" if os.path.islink(path) else None
    except OSError as e:
        return e.strerror or str(e)
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_HISTORY_BYTES + 1)
    except OSError as e:
        return e.strerror or str(e)
    if len(data) > MAX_HISTORY_BYTES:
        return f"larger than {MAX_HISTORY_BYTES >> 20} MiB"
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return "not UTF-8 text"
    return None


def _gnu_readline():
    try:
        import readline
    except ImportError:
        return None
    return None if "libedit" in (readline.__doc__ or "") else readline


class Reader:
    """Reads messages from the terminal (or a pipe). With GNU readline: line editing,
    history in `history` (None: none kept), and bracketed paste, which readline turns
    on for each prompt and off after it (Ctrl-C included), so a pasted block arrives
    as one string. Without readline on a terminal, this class turns bracketed paste on
    and off around each prompt and joins the lines between the markers itself."""

    def __init__(self, history: Path | None):
        self.fd = sys.stdin.fileno()
        self.tty = sys.stdin.isatty() and sys.stdout.isatty()
        self.readline = _gnu_readline() if self.tty else None
        self.history = history if self.readline else None   # only readline keeps one
        self.assembler = Assembler()
        self.queued: list[str] = []     # lines typed ahead with their Enter, to run in turn
        self.typed_ahead = ""           # an unfinished line typed ahead, for the next prompt
        self.notes: list[str] = []      # things to tell the user after a reply
        self.history_warning: str | None = None   # why the history file is left alone
        if self.readline:
            self.readline.parse_and_bind("set enable-bracketed-paste on")
            self.readline.set_history_length(1000)
            self.readline.set_pre_input_hook(self._insert_typed_ahead)
            if self.history:
                why = unreadable_history(self.history)
                if why is None and os.path.lexists(self.history):
                    try:
                        self.readline.read_history_file(self.history)
                    except OSError as e:
                        why = e.strerror or str(e)
                if why is not None:    # never overwritten: it may hold what we cannot read
                    self.history_warning = (
                        f"the chat history {self.history} cannot be read ({why}); it is left as "
                        f"it is, and this session's history is kept in memory only")
                    self.history = None

    def read(self) -> str:
        """The next message (may be empty; may contain line breaks). Raises EOFError at
        the end of input, KeyboardInterrupt on Ctrl-C (an open block is discarded)."""
        while True:
            try:
                chunk = self._read_chunk(MORE if self.assembler.open else PROMPT)
            except (EOFError, KeyboardInterrupt):
                self.assembler.discard()
                raise
            message = self.assembler.feed(chunk)
            if message is not None:
                return message

    def _read_chunk(self, prompt: str) -> str:
        while self.queued:
            line = clean(self.queued.pop(0))
            if not line and not self.assembler.open:
                continue                # an Enter alone: at the prompt it would do nothing
            sys.stdout.write(f"{prompt}{line}\n")     # shown as if typed at this prompt
            sys.stdout.flush()
            if self.readline and line:
                self.readline.add_history(line)
            return line
        if self.readline or not self.tty:
            return input(prompt)
        sys.stdout.write(PASTE_ON)
        sys.stdout.flush()
        try:
            line = input(prompt)
            if PASTE_START in line:
                lines = [line]
                while PASTE_END not in lines[-1]:
                    lines.append(input())
                line = "\n".join(lines)
            return line
        finally:
            sys.stdout.write(PASTE_OFF)
            sys.stdout.flush()

    def _insert_typed_ahead(self):
        if self.typed_ahead:
            self.readline.insert_text(self.typed_ahead)
            self.readline.redisplay()
            self.typed_ahead = ""

    @contextmanager
    def replying(self) -> None:
        """While a reply streams: keys typed are not echoed (they would land in the
        reply) and not line-buffered; Ctrl-C still interrupts. Afterwards what was
        typed is waiting, editable, at the next prompt (with readline), or dropped
        with a note. The terminal's settings are restored however the reply ends."""
        if not self.tty or termios is None:
            yield
            return
        saved = termios.tcgetattr(self.fd)
        quiet = termios.tcgetattr(self.fd)
        quiet[3] &= ~(termios.ECHO | termios.ICANON)
        quiet[6][termios.VMIN], quiet[6][termios.VTIME] = 1, 0
        termios.tcsetattr(self.fd, termios.TCSANOW, quiet)
        try:
            yield
        finally:
            typed = self._pending()
            termios.tcsetattr(self.fd, termios.TCSANOW, saved)
            self._keep(typed)

    def _pending(self) -> bytes:
        data = b""
        while select.select([self.fd], [], [], 0)[0]:
            chunk = os.read(self.fd, 4096)
            if not chunk:
                break
            data += chunk
        return data

    def _keep(self, typed: bytes) -> None:
        """Lines finished with Enter run in turn at the next prompts; the unfinished rest
        (continuing one left from an earlier reply) waits, editable, at the prompt after
        them with readline; without, it is dropped with a note."""
        lines, rest = typed_lines(self.typed_ahead + typed.decode("utf-8", "replace"))
        self.queued += lines
        rest = " ".join(clean(rest).split("\n")).strip()
        self.typed_ahead = rest if self.readline else ""
        if rest and not self.readline:
            self.notes.append(f"dropped {len(rest)} characters typed during the reply")

    def save_history(self, note: Callable[[str], None]) -> None:
        if self.readline and self.history:
            try:
                self.history.parent.mkdir(parents=True, exist_ok=True)
                self.readline.write_history_file(self.history)
            except OSError as e:
                note(f"could not save the chat history to {self.history}: {e.strerror or e}")
