"""`edgellama generate`: one completion, streamed to stdout."""
from __future__ import annotations

import sys

import click

from .main import main
from .options import Output, load, model_options, sampling_from, sampling_options


@main.command()
@model_options
@sampling_options
@click.option("-p", "--prompt", required=True, help="The prompt text.")
@click.option("-n", "--max-tokens", type=click.IntRange(min=1), default=256, show_default=True,
              help="Most tokens to generate.")
@click.option("--raw", is_flag=True, help="Use the prompt as is, without the chat template.")
@click.option("--system", default=None, help="System prompt (chat template only).")
def generate(model, ctx, threads, prompt, max_tokens, raw, system, **sampling):
    """Complete PROMPT with the model and print the reply as it is generated."""
    llm = load(model, ctx, threads)
    params = sampling_from(llm.default_sampling(), sampling)
    if raw:
        ids = llm.tokenizer.encode(prompt)
        if llm.tokenizer.add_bos:
            ids = [llm.tokenizer.bos_id] + ids
    else:
        messages = ([{"role": "system", "content": system}] if system else []) + \
                   [{"role": "user", "content": prompt}]
        ids = llm.chat.encode_messages(messages)
    out = Output(sys.stdout)
    if raw:
        out.write(prompt)
    for tok in llm.generate(ids, max_tokens=max_tokens, sampling=params):
        out.write(llm.tokenizer.shown_bytes(tok))
    out.finish()
    s = llm.stats
    click.echo(f"prompt: {s.prompt_tokens} tokens, {s.prompt_tps:.1f} tok/s | "
               f"generation: {s.gen_tokens} tokens, {s.gen_tps:.1f} tok/s ({s.stop_reason})",
               err=True)
