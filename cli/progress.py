"""Progress on stderr while the user waits: kernels compiling, benchmark steps."""
from __future__ import annotations

import sys
import threading
import time

import click

from edgellama.kernels import jit


class StatusLine:
    """One line of progress on stderr, rewritten in place on a terminal; elsewhere (a
    log, a pipe) nothing, so logs hold results only."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.shown = False

    def update(self, msg: str) -> None:
        if self.tty:
            click.echo(f"\r\033[K{msg}", file=self.stream, nl=False)
            self.shown = True

    def clear(self) -> None:
        if self.shown:
            click.echo("\r\033[K", file=self.stream, nl=False)
            self.shown = False


class KernelProgress:
    """The `show` callback of jit.warm_up / jit.Compiling. On a terminal one line,
    "Compiling kernels (once; cached for later runs): 5/13 attention, 12 s", whose seconds keep
    counting while a kernel compiles; elsewhere one line when compiling starts.
    `done(count, seconds)` ends it with what was compiled."""

    def __init__(self, stream=None):
        self.line = StatusLine(stream)
        self.t0: float | None = None
        self.step = ""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    def __call__(self, n: int, total: int | None, name: str) -> None:
        # not "first run only": a later run compiles what it is the first to use (another
        # cache type, a draft model's formats)
        what = ("Compiling kernels (no kernel cache: every run)" if jit.cache_note
                else "Compiling kernels (once; cached for later runs)")
        if self.t0 is None:
            self.t0 = time.perf_counter()
            if self.line.tty:
                self._ticker = threading.Thread(target=self._tick, daemon=True)
                self._ticker.start()
            else:
                click.echo(f"{what}...", file=self.line.stream)
        name = name.lstrip("_")      # a private kernel's name, as a user reads it
        self.step = f"{what}: {n}/{total} {name}" if total else f"{what}: {name}"
        self._draw()

    def _draw(self) -> None:
        with self._lock:
            if not self._stop.is_set():
                self.line.update(f"{self.step}, {time.perf_counter() - self.t0:.0f} s")

    def _tick(self) -> None:
        while not self._stop.wait(1.0):
            self._draw()

    def done(self, count: int, seconds: float) -> None:
        """After the last kernel: the line cleared, and one line of summary if any compiled."""
        with self._lock:
            self._stop.set()
        if self._ticker:
            self._ticker.join()
        self.line.clear()
        if count:
            where = "" if jit.cache_note else "; cached for next time"
            click.echo(f"Compiled {count} kernels in {seconds:.0f} s{where}", file=self.line.stream)
