"""`edgellama chat`: an interactive terminal chat with streaming replies."""
from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import click

from edgellama.kernels import jit
from edgellama.chat_session import ChatSession
from edgellama.default_model import cache_dir
from edgellama.errors import EdgeError
from edgellama.tool_calls import parse_tool_calls

from .chat_input import Reader, clean
from .main import main
from .options import (
    Output,
    chat_template_options,
    draft_summary,
    drafter_from,
    load,
    model_options,
    one_line,
    sampling_from,
    sampling_options,
    speculative_options,
    stdin_problem,
)
from .progress import KernelProgress

HELP = """commands:
  /system TEXT   set the system prompt (starts a new conversation)
  /reset         forget the conversation
  /stats         speed of the last reply, context used, tokens drafted and accepted
  /save NAME     keep the conversation and its cache (NAME, or a PATH with a /)
  /load NAME     go back to a saved conversation without reading it again
  /help          this text
  /exit          quit (or Ctrl-D); Ctrl-C stops a reply
input:
  Enter sends the line. For several lines, paste them (one message), or type
  \"\"\" to open a block and end its last line with \"\"\".
  A line typed while a reply streams runs after it, as if typed at the prompt;
  an unfinished one waits there."""


def _history_path(keep: bool) -> Path | None:
    return cache_dir() / "chat_history" if keep else None


def _shown(path: Path) -> str:
    home = Path.home()
    return f"~/{path.relative_to(home)}" if path.is_relative_to(home) else str(path)


@main.command()
@model_options
@sampling_options
@speculative_options
@click.option("-n", "--max-tokens", type=click.IntRange(min=1), default=1024, show_default=True,
              help="Most tokens per reply.")
@click.option("-s", "--system", default=None, help="System prompt.")
@click.option("--history/--no-history", default=True, show_default=True,
              help="Keep what you type in ~/.cache/edgellama/chat_history (Up recalls it).")
@click.option("--context-shift/--no-context-shift", default=True, show_default=True,
              help="When the context fills, the oldest turns are dropped and the rest moved "
                   "down in the cache (a context shift), not read again.")
@chat_template_options
def chat(model, ctx, threads, activations, cache_type_k, cache_type_v, max_tokens, system, history, context_shift, draft,
         lookup, draft_min, draft_max, template_kwargs, **sampling):
    """Chat with a model in the terminal.

    \b
    A reply's reasoning (Qwen 3's <think> block) is shown dimmed on a terminal and
    left out of the conversation the next turn renders; --reasoning-budget 0 turns
    thinking off where the template can."""
    if why := stdin_problem():
        raise EdgeError(f"no input: {why}, and chat reads your messages from it; run it in a "
                        f"terminal or pipe the messages in, or give one prompt with "
                        f"`edgellama generate --prompt TEXT` or `-f FILE`")
    progress = KernelProgress()
    with jit.Compiling(progress) as loading:      # loading repacks weights with kernels too
        llm = load(model, ctx, threads, activations, cache_type_k, cache_type_v)
        llm.chat.template_kwargs = template_kwargs
        drafter = drafter_from(llm, draft, lookup, draft_min, draft_max)
    session = ChatSession(llm, sampling_from(llm.default_sampling(), sampling),
                          max_tokens=max_tokens, system=system, context_shift=context_shift,
                          drafter=drafter)
    warm = jit.warm_up(llm.model, progress)
    if hasattr(drafter, "model"):
        warm_draft = jit.warm_up(drafter.model, progress)
        warm = jit.Warm(warm.seconds + warm_draft.seconds, warm.compiled + warm_draft.compiled,
                        warm.compile_seconds + warm_draft.compile_seconds)
    with jit.Compiling(progress) as shifting:
        if context_shift:
            llm.ready_context_shift()
    progress.done(loading.count + warm.compiled + shifting.count,
                  loading.seconds + warm.compile_seconds + shifting.seconds)
    kv = llm.seq.cache
    # loading the model and its kernels, whatever compiling took (reported above)
    startup = llm.load_seconds + warm.seconds - loading.seconds - warm.compile_seconds
    click.echo(f"{one_line(llm.path.stem)} | {llm.model.type_summary()} | "
               f"ctx {llm.ctx} | weights {llm.model.weight_bytes / 2**20:.0f} MiB + "
               f"KV {kv.nbytes / 2**20:.0f} MiB | loaded in {startup:.1f} s | /help for commands",
               err=True)
    reader = Reader(_history_path(history))
    if reader.history_warning:
        click.echo(f"warning: {one_line(reader.history_warning)}", err=True)
    elif reader.history and not reader.history.exists():
        click.echo(f"(what you type is kept in {_shown(reader.history)}; --no-history turns "
                   f"that off)", err=True)
    out = Output(sys.stdout)
    term_signal = signal.signal(signal.SIGTERM, _exit_on_signal)   # restore the terminal
    # Ctrl-C stops a reply even where the parent ignored SIGINT (a job a shell started with
    # &, which Python then leaves ignored): in a terminal the keys are the user's
    int_signal = signal.signal(signal.SIGINT, signal.default_int_handler) if reader.tty else None
    try:
        _converse(llm, session, reader, out, max_tokens)
    finally:
        signal.signal(signal.SIGTERM, term_signal)
        if int_signal is not None:
            signal.signal(signal.SIGINT, int_signal)
        reader.save_history(lambda msg: click.echo(f"({msg})", err=True))


def _exit_on_signal(signum, frame):
    raise SystemExit(128 + signum)


def _converse(llm, session, reader, out, max_tokens):
    heard = False
    while True:
        try:
            text = clean(reader.read())
            heard = True
        except EOFError:
            click.echo("", err=True)
            if not heard and not reader.tty:      # an empty pipe or file
                raise EdgeError("no input: standard input ended before any message; pipe the "
                                "messages in, run chat in a terminal, or give one prompt with "
                                "`edgellama generate --prompt TEXT` or `-f FILE`") from None
            return
        except KeyboardInterrupt:
            click.echo("\n(Ctrl-D or /exit to quit)", err=True)
            continue
        if not text:
            continue
        if text.startswith("/"):
            if _command(text, llm, session, reader) == "exit":
                return
            continue
        try:
            with reader.replying():
                _show_reply(session, text, out)
            out.write("\n")
            # the server's parser: a model told of tools (say by /system) may answer a call
            for call in parse_tool_calls(session.messages[-1]["content"]) or []:
                click.echo(f"(a tool call: {call.name}({json.dumps(call.arguments)}); chat runs "
                           f"no tools: send the result as your next message)", err=True)
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
        for note in session.notices + reader.notes:
            click.echo(f"({note})", err=True)
        session.notices.clear()
        reader.notes.clear()


DIM, PLAIN = "\x1b[2m", "\x1b[0m"


def _show_reply(session, text, out):
    """Stream the reply. On a terminal its reasoning (a <think> block) is shown dimmed,
    without the tags, and a blank line before the answer; anywhere else, the model's
    text exactly."""
    if not out.terminal:
        for piece in session.send(text):
            out.write(piece)
        return
    dim = thought = False
    try:
        for reasoning, content in session.send_parts(text):
            if reasoning:
                if not dim:
                    out.stream.write(DIM)
                    dim = thought = True
                out.write(reasoning)
            if content:
                if dim:
                    out.stream.write(PLAIN)
                    dim = False
                if thought:
                    out.write("\n\n")
                    thought = False
                out.write(content)
    finally:
        if dim:
            out.stream.write(PLAIN)
            out.stream.flush()


def _command(text, llm, session, reader) -> str | None:
    cmd, _, arg = text.partition(" ")
    if cmd in ("/exit", "/quit", "/bye"):
        return "exit"
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
                   f"context: {session.context_used()}/{llm.ctx} tokens{draft_summary(s)}",
                   err=True)
    elif cmd in ("/save", "/load"):
        if not arg.strip():
            click.echo(f"{cmd} NAME (kept in edgellama's cache, `edgellama list` shows them) "
                       f"or {cmd} PATH (with a /)", err=True)
            return None
        from edgellama.prompt_cache import resolve
        try:
            path = resolve(arg.strip())
            if cmd == "/save":
                session.save(path)
                click.echo(f"(saved {session.context_used()} tokens to {_shown(path)})", err=True)
            else:
                n = session.load(path)
                click.echo(f"(loaded {n} tokens from {_shown(path)}: {len(session.messages)} "
                           f"message(s)" + (", a system prompt" if session.system else "") + ")",
                           err=True)
        except EdgeError as e:
            click.echo(f"error: {one_line(str(e))}", err=True)
    elif cmd == "/help":
        kept = (f"history: {_shown(reader.history)} (--no-history: none)" if reader.history
                else "history: this session only (its file cannot be read)"
                if reader.history_warning else "history: not kept (--no-history)")
        click.echo(f"{HELP}\n{kept}", err=True)
    else:
        click.echo(f"unknown command {cmd}; /help lists them", err=True)
    return None
