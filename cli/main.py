"""The `edgellama` command: a click group; each command lives in its own module.

Exit codes: 0 success, 1 a problem with the user's input or environment (one line on
stderr), 2 usage errors (click). `--debug` shows tracebacks.
"""
from __future__ import annotations

import os
import signal
import sys

import click

from edgellama import jit
from edgellama.errors import EdgeError

from .options import one_line


class _Group(click.Group):
    """Turns EdgeError (and any other failure) into one line and exit 1, unless --debug."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except KeyboardInterrupt:
            click.echo("\ninterrupted", err=True)
            sys.exit(130)
        except BrokenPipeError:
            # The reader went away (`edgellama generate ... | head -1`): end quietly, with
            # the status of a program stopped by SIGPIPE. Both streams go to /dev/null, or
            # Python's final flush would complain ("Exception ignored ...").
            devnull = os.open(os.devnull, os.O_WRONLY)
            for stream in (sys.stdout, sys.stderr):
                os.dup2(devnull, stream.fileno())
            sys.exit(128 + getattr(signal, "SIGPIPE", 13))
        except Exception as e:  # noqa: BLE001 - the top level decides how errors look
            if ctx.obj and ctx.obj.get("debug"):
                raise
            if isinstance(e, EdgeError):
                message = str(e)
            elif isinstance(e, OSError):
                message = f"{e.strerror or e}: {e.filename or ''}".rstrip(": ")
            else:
                message = (f"internal error {type(e).__name__}: {e} "
                           f"(run with --debug for the traceback)")
            # messages quote the model file (template errors, names): one line, no escapes
            click.echo(f"error: {one_line(message)}", err=True)
            sys.exit(1)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show full tracebacks on errors.")
@click.pass_context
def main(ctx, debug):
    """edgellama: run quantized Llama models on a CPU."""
    ctx.ensure_object(dict)["debug"] = debug
    if jit.cache_note:
        click.echo(f"note: {jit.cache_note}", err=True)


# Each command module adds itself to `main` when imported.
from . import bench, chat, convert, generate  # noqa: E402,F401
