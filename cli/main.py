"""The `edgellama` command: a click group; each command lives in its own module.

Exit codes: 0 success, 1 a problem with the user's input or environment (one line on
stderr), 2 usage errors (click: a value out of its range on any model, an empty path,
options that contradict each other). `--debug` shows tracebacks.
"""
from __future__ import annotations

import ast
import importlib
import os
import signal
import sys
from pathlib import Path

import click

from edgellama.errors import EdgeError

from .options import one_line

# Command name -> the module in this package that defines it (with `@main.command()`).
# Modules load only when their command runs, so `edgellama --help` stays fast (numpy and
# numba are not imported; --version imports numba to name its threading layer). A new
# command is one line here.
COMMANDS = {
    "bench": "bench",
    "chat": "chat",
    "convert": "convert",
    "generate": "generate",
    "list": "models",
    "perplexity": "perplexity",
    "rm": "models",
    "serve": "serve",
}

# Commands that never run kernels: their start-up skips importing numba.
_NO_KERNELS = {"list", "rm"}


def _short_help(module: str, name: str, limit: int) -> str:
    """The first docstring line of command `name` in `module`, read from its source:
    listing the commands must not import them."""
    try:
        tree = ast.parse((Path(__file__).parent / f"{module}.py").read_text("utf-8"))
    except (OSError, SyntaxError, ValueError):
        return ""
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef):
            continue
        for d in node.decorator_list:
            if isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) \
                    and d.func.attr == "command":
                given = [a.value for a in d.args if isinstance(a, ast.Constant)]
                if (given or [node.name.replace("_", "-")])[0] == name:
                    doc = ast.get_docstring(node) or ""   # shortened as click does
                    return click.Command(name, help=doc).get_short_help_str(limit)
    return ""


class _Group(click.Group):
    """Loads each command's module on first use; turns EdgeError (and any other failure)
    into one line and exit 1, unless --debug."""

    def list_commands(self, ctx):
        return sorted({*COMMANDS, *self.commands})

    def get_command(self, ctx, name):
        if name not in self.commands and name in COMMANDS:
            importlib.import_module(f"{__package__}.{COMMANDS[name]}")   # registers on main
        return self.commands.get(name)

    def format_commands(self, ctx, formatter):
        names = self.list_commands(ctx)
        limit = formatter.width - 6 - max(map(len, names))
        rows = [(n, self.commands[n].get_short_help_str(limit) if n in self.commands
                 else _short_help(COMMANDS[n], n, limit)) for n in names]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

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
            elif isinstance(e, OSError):    # one a command did not word: PATH: reason
                message = f"{e.filename}: {e.strerror or e}" if e.filename else \
                    f"{e.strerror or e} (run with --debug for where)"
            else:
                message = (f"internal error {type(e).__name__}: {e} "
                           f"(run with --debug for the traceback)")
            # messages quote the model file (template errors, names): one line, no escapes
            click.echo(f"error: {one_line(message)}", err=True)
            sys.exit(1)


def _version(ctx, param, value):
    """--version: ours, and what the kernels run on (this imports numba)."""
    if not value or ctx.resilient_parsing:
        return
    from importlib.metadata import version

    import numba

    from edgellama import threading_layer
    from edgellama.kernels import jit   # noqa: F401  (jit sets Numba up first)
    from edgellama.kernels.amx import kernels_name
    from edgellama.machine import cpu_quota
    quota = cpu_quota()
    limit = "" if quota is None else f", cgroup CPU limit {quota:g}"
    click.echo(f"edgellama {version('edgellama')} (Numba {numba.__version__}, "
               f"{kernels_name()} kernels, threading layer {threading_layer.name()}{limit})")
    if note := threading_layer.note():
        click.echo(f"note: {note}", err=True)
    ctx.exit()


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_version,
              help="Show the version, the kernels' instruction set and threading layer, and exit.")
@click.option("--debug", is_flag=True, help="Show full tracebacks on errors.")
@click.pass_context
def main(ctx, debug):
    """edgellama: run quantized Llama models on a CPU."""
    ctx.ensure_object(dict)["debug"] = debug
    if ctx.invoked_subcommand not in _NO_KERNELS:
        from edgellama import threading_layer
        from edgellama.kernels import jit   # imports numba, which sets up the kernel cache
        if jit.cache_note:
            click.echo(f"note: {jit.cache_note}", err=True)
        if note := threading_layer.note():
            click.echo(f"note: {note}", err=True)


if __name__ == "__main__":   # python -m edgellama.cli.main
    main(prog_name="edgellama")
