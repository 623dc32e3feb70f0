"""The `edgellama` command: a click group; each command lives in its own module.

Exit codes: 0 success, 1 a problem with the user's input or environment (one line on
stderr), 2 usage errors (click). `--debug` shows tracebacks.
"""
from __future__ import annotations

import sys

import click

from edgellama.errors import EdgeError


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
        except Exception as e:  # noqa: BLE001 - the top level decides how errors look
            if ctx.obj and ctx.obj.get("debug"):
                raise
            if isinstance(e, EdgeError):
                click.echo(f"error: {e}", err=True)
            elif isinstance(e, OSError):
                click.echo(f"error: {e.strerror or e}: {e.filename or ''}".rstrip(": "), err=True)
            else:
                click.echo(f"error: internal error {type(e).__name__}: {e} "
                           f"(run with --debug for the traceback)", err=True)
            sys.exit(1)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show full tracebacks on errors.")
@click.pass_context
def main(ctx, debug):
    """edgellama: run quantized Llama models on a CPU."""
    ctx.ensure_object(dict)["debug"] = debug


# Each command module adds itself to `main` when imported.
from . import bench, chat, convert, generate  # noqa: E402,F401
