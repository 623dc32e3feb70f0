"""`edgellama chat`: an interactive terminal chat with streaming replies."""
from __future__ import annotations

import sys

import click

from edgellama import jit
from edgellama.chat_session import ChatSession
from edgellama.default_model import cache_dir
from edgellama.errors import EdgeError
from edgellama.jit import warm_up

from .main import main
from .options import Output, load, model_options, one_line, sampling_from, sampling_options

HELP = """commands:
  /system TEXT   set the system prompt (starts a new conversation)
  /reset         forget the conversation
  /stats         speed of the last reply and context used
  /help          this text
  /exit          quit (or Ctrl-D); Ctrl-C stops a reply"""


def _readline_setup():
    """Line editing and a persistent history, where the platform has readline."""
    try:
        import readline
    except ImportError:
        return None
    path = cache_dir() / "chat_history"
    try:
        readline.read_history_file(path)
    except OSError:
        pass
    readline.set_history_length(1000)
    return readline, path


def _clean(text: str) -> str:
    """Typed input as plain text: undecodable bytes replaced, control characters dropped."""
    text = text.encode("utf-8", "replace").decode("utf-8")   # lone surrogates from bad bytes
    return "".join(c for c in text if c in "\t\n" or (ord(c) >= 32 and ord(c) != 127)).strip()


@main.command()
@model_options
@sampling_options
@click.option("-n", "--max-tokens", type=click.IntRange(min=1), default=1024, show_default=True,
              help="Most tokens per reply.")
@click.option("-s", "--system", default=None, help="System prompt.")
def chat(model, ctx, threads, max_tokens, system, **sampling):
    """Chat with a model in the terminal."""
    llm = load(model, ctx, threads)
    session = ChatSession(llm, sampling_from(llm.default_sampling(), sampling),
                          max_tokens=max_tokens, system=system)
    compile_s = warm_up(llm, announce=lambda: click.echo(
        "Compiling kernels (10-30 s)..." if jit.cache_note else
        "Compiling kernels (first run only, 10-30 s)...", err=True))
    kv = llm.model.cache
    name = llm.gguf.get("general.name")
    click.echo(f"{one_line(name) if isinstance(name, str) and name else llm.path.name} | "
               f"{llm.model.type_summary()} | "
               f"ctx {llm.ctx} | weights {llm.model.weight_bytes / 2**20:.0f} MiB + "
               f"KV {kv.nbytes / 2**20:.0f} MiB | loaded in {llm.load_seconds:.1f} s"
               + (f" (+{compile_s:.0f} s compile)" if compile_s > 1 else "")
               + " | /help for commands", err=True)
    out = Output(sys.stdout)
    rl = _readline_setup()
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            click.echo("", err=True)
            break
        except KeyboardInterrupt:
            click.echo("\n(Ctrl-D or /exit to quit)", err=True)
            continue
        text = _clean(line)
        if not text:
            continue
        if text.startswith("/"):
            cmd, _, arg = text.partition(" ")
            if cmd in ("/exit", "/quit"):
                break
            if cmd == "/reset":
                session.reset()
                click.echo("(conversation cleared)", err=True)
            elif cmd == "/system":
                session.system = arg.strip() or None
                session.reset()
                click.echo("(system prompt set; conversation cleared)" if arg.strip()
                           else "(system prompt removed; conversation cleared)", err=True)
            elif cmd == "/stats":
                s = llm.stats
                click.echo(f"prompt: {s.prompt_tokens} tokens at {s.prompt_tps:.1f} tok/s | "
                           f"reply: {s.gen_tokens} tokens at {s.gen_tps:.1f} tok/s | "
                           f"context: {session.context_used()}/{llm.ctx} tokens", err=True)
            elif cmd == "/help":
                click.echo(HELP, err=True)
            else:
                click.echo(f"unknown command {cmd}; /help lists them", err=True)
            continue
        try:
            for piece in session.send(text):
                out.write(piece)
            out.write("\n")
            if llm.stats.stop_reason == "length":
                click.echo(f"(reply cut at --max-tokens {max_tokens})", err=True)
            elif llm.stats.stop_reason == "context full":
                click.echo("(reply cut: the context is full; the next message drops old turns)",
                           err=True)
        except KeyboardInterrupt:
            out.write("\n")
            click.echo("(reply stopped)", err=True)
        except EdgeError as e:
            click.echo(f"error: {one_line(str(e))}", err=True)
        for note in session.notices:
            click.echo(f"({note})", err=True)
        session.notices.clear()
    if rl:
        try:
            rl[0].write_history_file(rl[1])
        except OSError:
            pass
