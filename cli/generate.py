"""`edgellama generate`: one completion, streamed to stdout."""
from __future__ import annotations

import sys
from pathlib import Path

import click

from edgellama.errors import EdgeError

from .main import main
from .options import (FILE_NAME, FilePath, Output, chat_template_options, draft_summary,
                      drafter_from, load, model_flags, positional_is_model, resolve_model,
                      sampling_from, sampling_options, speculative_options, stdin_problem)

# More than any context holds (8192 tokens of a few bytes each), small enough to read.
MAX_PROMPT_BYTES = 64 << 20


def _read(stream, name: str) -> str:
    data = stream.read(MAX_PROMPT_BYTES + 1)
    if len(data) > MAX_PROMPT_BYTES:
        raise EdgeError(f"{name} holds more than {MAX_PROMPT_BYTES >> 20} MiB: far more than "
                        f"any context; give a shorter prompt")
    return data.decode("utf-8", "surrogateescape")   # the bytes survive, as in an argument


def _prompt(model_arg, prompt_arg, prompt, prompt_file) -> tuple[str | None, str]:
    """(positional model or None, prompt text) from the ways a prompt can be given."""
    given = prompt is not None or prompt_file is not None
    if prompt_arg is None and model_arg is not None and not given \
            and not positional_is_model(model_arg):
        model_arg, prompt_arg = None, model_arg   # `generate "a prompt"`
    sources = [s for s in (prompt, prompt_file, prompt_arg) if s is not None]
    if len(sources) > 1:
        raise click.UsageError("give the prompt once: PROMPT, -p TEXT, -p - or -f FILE")
    # no prompt and nothing to read it from (/dev/null, or closed by a daemon); `-p -` of
    # /dev/null asks for its empty prompt, of a closed input for what is not there
    why = stdin_problem() if not sources or "-" in (prompt, prompt_file) else None
    if why and (not sources or "closed" in why):
        raise EdgeError(f"no prompt: {why}; give it with --prompt TEXT, -f FILE or as an "
                        f"argument, or pipe it in")
    if prompt_file is not None:
        try:
            with click.open_file(prompt_file, "rb") as f:
                return model_arg, _read(f, prompt_file)
        except OSError as e:
            raise EdgeError(f"{prompt_file}: cannot read: {e.strerror or e}") from None
    if prompt == "-" or not sources:
        if not sources and sys.stdin.isatty():
            raise click.UsageError("no prompt: give PROMPT, -p TEXT, -f FILE, or pipe it in")
        try:
            return model_arg, _read(sys.stdin.buffer, "stdin")
        except OSError as e:
            raise EdgeError(f"standard input: cannot read: {e.strerror or e}") from None
    return model_arg, sources[0]


@main.command()
@model_flags
@sampling_options
@speculative_options
@click.argument("model_arg", metavar="[MODEL]", required=False)
@click.argument("prompt_arg", metavar="[PROMPT]", required=False)
@click.option("-p", "--prompt", default=None, help="The prompt text; - reads it from stdin.")
@click.option("-f", "--file", "prompt_file", type=FilePath(dir_okay=False, allow_dash=True),
              default=None, help="Read the prompt from FILE (- for stdin).")
@click.option("-n", "--max-tokens", type=click.IntRange(min=1), default=256, show_default=True,
              help="Most tokens to generate.")
@click.option("--raw", is_flag=True, help="Use the prompt as is, without the chat template.")
@click.option("--system", default=None, help="System prompt (chat template only).")
@click.option("--prompt-cache", "prompt_cache", metavar="NAME|PATH", type=FILE_NAME,
              default=None,
              help="Keep the prompt's KV cache in a file: made on the first run, then its "
                   "longest common start with the prompt is not read again (a long document "
                   "asked new questions). A NAME (no slash) is kept in edgellama's cache "
                   "(`edgellama list`).")
@click.option("--context-shift/--no-context-shift", default=True, show_default=True,
              help="When the context fills, drop the older half of what follows the prompt "
                   "and go on, instead of stopping.")
@click.option("--ignore-eos", is_flag=True,
              help="Go on past the model's end-of-generation tokens, to --max-tokens or a "
                   "full context (llama.cpp's --ignore-eos: long runs, speed tests).")
@chat_template_options
def generate(model, hf_repo, ctx, threads, activations, cache_type_k, cache_type_v, model_arg, prompt_arg, prompt, prompt_file, max_tokens,
             raw, system, prompt_cache, context_shift, ignore_eos, draft, lookup, draft_min, draft_max,
             template_kwargs, **sampling):
    """Complete PROMPT with the model and print the reply as it is generated.

    \b
    The prompt: PROMPT, -p TEXT, -f FILE, or stdin (-p -, or piped with no other prompt).
    The model: MODEL, -m FILE or -hf REPO[:QUANT] (default: SmolLM2-135M-Instruct).
    With one positional, it is the MODEL if it names a file (existing, or ending in .gguf)
    or a Hugging Face reference (llama3.2:1b, OWNER/REPO[:QUANT]), or if -p or -f gives
    the prompt; otherwise it is the PROMPT (use -p for a prompt that reads as a model).
    """
    from edgellama.kernels import jit

    from .progress import KernelProgress

    if raw and template_kwargs:
        raise click.UsageError("--chat-template-kwargs and --reasoning-budget 0 are for the chat "
                               "template, which --raw leaves out; give one or the other")
    model_arg, prompt = _prompt(model_arg, prompt_arg, prompt, prompt_file)
    cache_path = None
    if prompt_cache is not None:        # refused before the model loads
        from edgellama import prompt_cache as saved
        cache_path = saved.resolve(prompt_cache)
        saved.check_target(cache_path)
    progress = KernelProgress()
    with jit.Compiling(progress) as loading:
        llm = load(resolve_model(model_arg, model, hf_repo), ctx, threads, activations,
                   cache_type_k, cache_type_v)
        llm.chat.template_kwargs = template_kwargs
        drafter = drafter_from(llm, draft, lookup, draft_min, draft_max)
    warms = [jit.warm_up(m, progress)   # so the prompt's speed is not the kernels'
             for m in [llm.model] + ([drafter.model] if hasattr(drafter, "model") else [])]
    with jit.Compiling(progress) as shifting:
        if context_shift:
            llm.ready_context_shift()
    progress.done(loading.count + sum(w.compiled for w in warms) + shifting.count,
                  loading.seconds + sum(w.compile_seconds for w in warms) + shifting.seconds)
    params = sampling_from(llm.default_sampling(), sampling)
    if cache_path is not None:
        _adopt_saved_date(llm, cache_path)
    if raw:
        ids = llm.tokenizer.encode(prompt)
        if llm.tokenizer.add_bos:
            ids = [llm.tokenizer.bos_id] + ids
    else:
        messages = ([{"role": "system", "content": system}] if system else []) + \
                   [{"role": "user", "content": prompt}]
        ids = llm.chat.encode_messages(messages)
    if len(ids) > llm.ctx:   # refused before the prompt is echoed
        raise EdgeError(f"the prompt is {len(ids)} tokens, longer than the context of "
                        f"{llm.ctx} tokens; use a larger --ctx or a shorter prompt")
    save, notes = None, []
    if cache_path is not None:
        save = _prompt_cache(llm, cache_path, ids, None if raw else {
            "system": system, "messages": [{"role": "user", "content": prompt}],
            "date": llm.chat.date}, notes)
    out = Output(sys.stdout)
    if raw:
        out.write(prompt)
    # the prompt, or the first half of the context of a longer one, stays when it fills
    keep = min(len(ids), llm.ctx // 2) if context_shift else None
    for tok in llm.generate(ids, max_tokens=max_tokens, sampling=params, shift_keep=keep,
                            prompt_read=save, drafter=drafter,
                            stop_ids=set() if ignore_eos else None):
        out.write(llm.tokenizer.shown_bytes(tok))
    out.finish()
    for note in notes:
        click.echo(note, err=True)
    s = llm.stats
    shifts = f", {s.shifts} context shift{'s' if s.shifts > 1 else ''}" if s.shifts else ""
    click.echo(f"prompt: {s.prompt_tokens} tokens, {s.prompt_tps:.1f} tok/s | "
               f"generation: {s.gen_tokens} tokens, {s.gen_tps:.1f} tok/s ({s.stop_reason}{shifts})"
               f"{draft_summary(s)}",
               err=True)


def _adopt_saved_date(llm, path: Path) -> None:
    """A saved prompt's chat template date (a template that prints today's date would
    otherwise change the prompt, before the document, on another day)."""
    from edgellama import prompt_cache
    if path.exists() and (chat := prompt_cache.saved_chat(path)) is not None:
        llm.chat.date = chat["date"]


def _prompt_cache(llm, path: Path, ids: list[int], chat: dict | None, notes: list[str]):
    """Load the saved prompt if there is one (refused if another model or cache kind
    made it); returns what saves the prompt's cache once it is read, unless the file
    holds exactly this prompt already. `notes` gets what to tell the user at the end."""
    if path.exists():
        saved = llm.load_prompt(path).tokens
        same = next((i for i, (a, b) in enumerate(zip(saved, ids)) if a != b),
                    min(len(saved), len(ids)))
        notes.append(f"(prompt cache {path}: {same} of the prompt's {len(ids)} tokens were in it)")
        if saved == ids:
            return None

    def save():
        llm.save_prompt(path, chat)
        notes.append(f"(prompt cache {path}: saved the prompt's {len(ids)} tokens)")
    return save
