"""`edgellama bench`: the memory and speed report."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from edgellama import benchmark
from edgellama.args import ModelArgs
from edgellama.errors import EdgeError
from edgellama.machine import available_memory
from edgellama.model import KVCache

from .main import main


def _refuse_unfitting(shape: str, ctx: int, n_prompt: int) -> None:
    """The checks loading would make, made on the shape alone."""
    if n_prompt + 1 > ctx:
        raise click.UsageError(f"-p {n_prompt} does not fit --ctx {ctx}")
    s = benchmark.SHAPES[shape]
    args = ModelArgs(dim=s.dim, n_layers=s.layers, n_heads=s.heads, n_kv_heads=s.kv_heads,
                     ffn_dim=s.ffn, vocab_size=s.vocab, norm_eps=1e-5, rope_theta=s.theta,
                     rope_dim=s.dim // s.heads, train_ctx=s.train_ctx, tied_output=True)
    need, avail = KVCache.bytes_needed(args, ctx), available_memory()
    if avail is not None and need > avail:
        raise EdgeError(f"--ctx {ctx} needs {need / 2**20:.0f} MiB of KV cache for {shape}, but "
                        f"only {avail / 2**20:.0f} MiB of memory is available; use a smaller --ctx")


@main.command()
@click.option("-m", "--model", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=None, help="GGUF file to measure.")
@click.option("--shape", type=click.Choice(sorted(benchmark.SHAPES)), default=None,
              help="Measure a random-weight file with these real shapes (generated once).")
@click.option("--type", "qtype", type=click.Choice([t.lower() for t in benchmark.SHAPE_TYPES]),
              default="q4_0", show_default=True, help="Weight type for --shape.")
@click.option("-c", "--ctx", type=click.IntRange(min=16), default=8192, show_default=True,
              help="Context length the KV cache is sized for.")
@click.option("-p", "--n-prompt", type=click.IntRange(min=1), default=512, show_default=True,
              help="Prompt tokens for the prefill test.")
@click.option("-n", "--n-gen", type=click.IntRange(min=1), default=128, show_default=True,
              help="Tokens for the decode tests.")
@click.option("--depth", type=click.IntRange(min=0), default=None,
              help="Cached tokens for decode-at-depth (default: fill the context).")
@click.option("-t", "--threads", type=int, default=None, help="Worker threads.")
@click.option("-r", "--reps", type=click.IntRange(min=1), default=3, show_default=True,
              help="Repetitions of each test.")
@click.option("--budget", type=float, default=8.0, show_default=True,
              help="Memory budget in GiB for the verdict.")
@click.option("--json", "as_json", is_flag=True, help="Print every figure as JSON.")
def bench(model, shape, qtype, ctx, n_prompt, n_gen, depth, threads, reps, budget, as_json):
    """Memory and speed report (default: Llama 3.2 3B shape, Q4_0, random weights)."""
    if model and shape:
        raise click.UsageError("give either -m or --shape, not both")
    synthetic = model is None
    if synthetic:
        shape = shape or "llama-3.2-3b"
        _refuse_unfitting(shape, ctx, n_prompt)   # before generating gigabytes of weights
        model = benchmark.shape_file(shape, qtype, quiet=as_json)
    tty = sys.stderr.isatty()

    def progress(msg):
        if tty:
            click.echo(f"\r\033[K[bench] {msg}", err=True, nl=False)
        elif not as_json:
            click.echo(f"[bench] {msg}", err=True)

    report = benchmark.run(model, ctx=ctx, n_prompt=n_prompt, n_gen=n_gen, depth=depth,
                           threads=threads, reps=reps, budget_gib=budget, synthetic=synthetic,
                           progress=progress)
    if tty:
        click.echo("\r\033[K", err=True, nl=False)
    click.echo(json.dumps(report, indent=2) if as_json else benchmark.format_report(report))
