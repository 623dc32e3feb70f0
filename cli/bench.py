"""`edgellama bench`: the memory and speed report."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import click

from edgellama import benchmark
from edgellama.errors import EdgeError
from edgellama.machine import available_memory
from edgellama.kv_cache import KVCache, fit_advice

from .main import main
from .options import cache_type_options, speculative_options
from .progress import StatusLine


def _refuse_unfitting(shape: str, ctx: int, n_prompt: int, type_k: str, type_v: str) -> None:
    """The checks loading would make, made on the shape alone, before anything is
    generated or allocated: the cache must fit the memory available."""
    if n_prompt + 1 > ctx:
        raise click.UsageError(f"-p {n_prompt} does not fit --ctx {ctx}")
    args = benchmark.SHAPES[shape].args()
    need, avail = KVCache.bytes_needed(args, ctx, type_k, type_v), available_memory()
    if avail is not None and need > avail:
        raise EdgeError(f"{shape}: " + fit_advice(args, ctx, type_k, type_v, avail))


MAX_REPS = 100      # repetitions past this measure nothing more, and run for hours


class GiB(click.ParamType):
    """A memory size in GiB: finite and more than 0."""
    name = "GIB"

    def convert(self, value, param, ctx):
        try:
            v = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number of GiB", param, ctx)
        if not math.isfinite(v) or v <= 0 or v > 2 ** 20:
            self.fail(f"{value} is not a memory size (GiB, more than 0)", param, ctx)
        return v


class ThreadCounts(click.ParamType):
    """-t N, or a list N,N,... as llama-bench takes it (one run per count)."""
    name = "N[,N...]"

    def convert(self, value, param, ctx):
        if isinstance(value, list):
            return value
        try:
            counts = [int(v) for v in str(value).split(",")]
        except ValueError:
            self.fail(f"{value!r} is not a thread count or a comma-separated list of them "
                      f"(e.g. 1,2,4,8)", param, ctx)
        import numba
        most = numba.config.NUMBA_NUM_THREADS
        if not all(1 <= c <= most for c in counts):
            self.fail(f"thread counts must be 1..{most} (Numba's threads; NUMBA_NUM_THREADS "
                      f"raises the limit), got {value}", param, ctx)
        return list(dict.fromkeys(counts))


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 * 0.95 else f"{n / 2**20:.0f} MiB"


def _shown(path: Path) -> str:
    home = Path.home()
    return f"~/{path.relative_to(home)}" if path.is_relative_to(home) else str(path)


def _after_run(path: Path, generated: bool, keep: bool | None) -> None:
    """Say where the random-weight file is and how big, and keep or remove it: --keep,
    --no-keep, or (neither given) ask on a terminal if this run generated it, else keep."""
    size = path.stat().st_size
    if keep is None and generated and sys.stdin.isatty() and sys.stderr.isatty():
        keep = click.confirm(f"Keep {_shown(path)} ({_size(size)}) to skip generating it next time?",
                             default=True, err=True)
    if keep is False:
        path.unlink()
        click.echo(f"Removed {_shown(path)} ({_size(size)}).", err=True)
        return
    total = sum(p.stat().st_size for p in benchmark.bench_files())
    click.echo(f"Kept {_shown(path)} ({_size(size)}; bench files in "
               f"{_shown(benchmark.bench_dir())}: {_size(total)}); `edgellama bench --clean` "
               f"removes them.", err=True)


@main.command()
@click.option("-m", "--model", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=None, help="GGUF file to measure.")
@click.option("--shape", type=click.Choice(sorted(benchmark.SHAPES)), default=None,
              help="Measure a random-weight file with these real shapes (generated, then kept "
                   "or removed as --keep says).")
@click.option("--type", "qtype", type=click.Choice([t.lower() for t in benchmark.SHAPE_TYPES]),
              default="q4_0", show_default=True, help="Weight type for --shape.")
@click.option("-c", "--ctx", type=click.IntRange(min=16), default=8192, show_default=True,
              help="Context length the KV cache is sized for.")
@click.option("--full", is_flag=True,
              help="The llama-bench style suite: repetitions, decode at depth, bandwidth "
                   "ceiling, NumPy matmul, predicted memory beside measured (minutes).")
@click.option("-p", "--n-prompt", type=click.IntRange(min=1), default=None,
              help="Prompt tokens for the prefill test [default: 128; --full 512].")
@click.option("-n", "--n-gen", type=click.IntRange(min=1), default=None,
              help="Tokens for the decode tests [default: 32; --full 128].")
@click.option("--depth", type=click.IntRange(min=0), default=None,
              help="--full: cached tokens for decode-at-depth (default: fill the context).")
@click.option("-t", "--threads", type=ThreadCounts(), default=None,
              help="Worker threads (default: automatic, as for generate), or a list such as "
                   "1,2,4,8: a row per count, decode beside the read ceiling at that count.")
@click.option("-r", "--reps", type=click.IntRange(1, MAX_REPS), default=None,
              help=f"--full: repetitions of each test, at most {MAX_REPS} [default: 3].")
@click.option("--budget", type=GiB(), default=8.0, show_default=True,
              help="Memory budget in GiB for the verdict.")
@click.option("--keep/--no-keep", default=None,
              help="Keep the generated random-weight file for next time [default: ask on a "
                   "terminal, else keep].")
@click.option("--clean", is_flag=True, help="Remove the generated bench files, and run nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print every figure as JSON.")
@cache_type_options
@speculative_options
def bench(model, shape, qtype, ctx, full, n_prompt, n_gen, depth, threads, reps, budget, keep,
          clean, as_json, cache_type_k, cache_type_v, draft, lookup, draft_min, draft_max):
    """Will a model fit in memory, and how fast will it reply? (default: a quick check of
    the Llama 3.2 3B shape at Q4_0 with random weights; --full for the llama-bench style
    suite; with --draft MODEL or --lookup, also speculative decoding's acceptance and
    speed-up on a summarise-this-text prompt)"""
    if clean:
        files, size = benchmark.remove_bench_files()
        click.echo(f"Removed {files} file(s), {_size(size)}, from {_shown(benchmark.bench_dir())}."
                   if files else f"No bench files in {_shown(benchmark.bench_dir())}.")
        return
    if model and shape:
        raise click.UsageError("give either -m or --shape, not both")
    speculating = draft is not None or lookup
    if speculating and model is None:
        raise click.UsageError(f"{'--draft' if draft else '--lookup'} needs -m MODEL (its "
                               f"tokenizer reads the prompt; --shape files have random weights)")
    sweep = threads is not None and len(threads) > 1
    if sweep and speculating:
        raise click.UsageError("--draft and --lookup measure one thread count: give -t N")
    if draft is not None:   # refused before the run, not after it
        from edgellama.gguf import GGUFFile
        from edgellama.speculative import check_same_vocabulary

        from .options import resolve_model
        draft = resolve_model(draft, None, None)
        check_same_vocabulary(GGUFFile(model), GGUFFile(draft))
    if not full and (depth is not None or reps is not None):
        raise click.UsageError(f"{'--depth' if depth is not None else '-r'} is for --full "
                               f"(the quick check runs each test once, at depth 0)")
    reps = reps or 3
    n_prompt = n_prompt or (512 if full else 128)
    n_gen = n_gen or (128 if full else 32)
    # every count bounded by the context before anything is generated or loaded
    if n_gen + 1 > ctx:
        raise click.UsageError(f"-n {n_gen} does not fit --ctx {ctx} (a reply starts after a "
                               f"prompt token)")
    if depth is not None and depth + n_gen > ctx:
        raise click.UsageError(f"--depth {depth} with -n {n_gen} does not fit --ctx {ctx}")
    status = StatusLine()

    def progress(msg):   # on a terminal; a log gets the result only
        status.update(f"[bench] {msg}")

    synthetic = model is None
    generated = False
    if synthetic:
        shape = shape or "llama-3.2-3b"
        # before generating gigabytes of weights
        _refuse_unfitting(shape, ctx, n_prompt, cache_type_k, cache_type_v)
        generated = not benchmark.shape_path(shape, qtype).is_file()
        model = benchmark.shape_file(shape, qtype, progress=progress)
        if generated:
            status.clear()
            click.echo(f"Generated {_shown(model)} ({_size(model.stat().st_size)}).", err=True)
    try:
        reports = [benchmark.run(model, ctx=ctx, n_prompt=n_prompt, n_gen=n_gen, depth=depth,
                                 threads=t, reps=reps, budget_gib=budget, synthetic=synthetic,
                                 full=full, type_k=cache_type_k, type_v=cache_type_v,
                                 progress=lambda msg, t=t: progress(
                                     f"{t} threads: {msg}" if sweep else msg), ceiling=sweep)
                   for t in (threads or [None])]
    except BaseException:
        status.clear()
        if synthetic:    # no question while failing or interrupted: kept unless --no-keep
            _after_run(model, generated, True if keep is None else keep)
        raise
    report = reports[0]
    if speculating:   # after the memory figures, which must not count a second model
        report["speculative"] = benchmark.speculative(
            model, draft, lookup, ctx=ctx, n_gen=n_gen,
            threads=threads and threads[0], draft_min=draft_min, draft_max=draft_max,
            progress=progress)
    status.clear()
    if sweep:
        click.echo(json.dumps(reports, indent=2) if as_json else benchmark.format_threads(reports))
    else:
        click.echo(json.dumps(report, indent=2) if as_json else
                   benchmark.format_report(report) if full else benchmark.format_quick(report))
    if synthetic:
        _after_run(model, generated, keep)
