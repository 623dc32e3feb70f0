"""`edgellama list` and `edgellama rm`: the models in the Hugging Face cache, and every
file edgellama keeps in its own cache (models, tiles, saved prompts, bench's models,
compiled kernels, the chat history)."""
from __future__ import annotations

import os

import click

from edgellama import hub
from edgellama.default_model import FILE_NAME, cache_dir
from edgellama.errors import EdgeError

from .main import main


def _size(n: int | None) -> str:
    if n is None:
        return "missing"     # a link whose file is gone
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _where() -> str:
    from huggingface_hub import constants
    return (f"Hugging Face cache: {constants.HF_HUB_CACHE} (HF_HOME, HF_HUB_CACHE); "
            f"edgellama cache: {cache_dir()} (EDGELLAMA_CACHE)")


@main.command("list")
def list_cmd():
    """Models and every other file edgellama keeps in the caches, with their sizes."""
    models = hub.cached_models()
    others, other_bytes = hub.unlisted_files(models)
    # files not ours in the cache folder: counted, so the total says what is there
    at_least = "at least " if others >= hub.MAX_UNLISTED else ""
    also = (f"; {cache_dir()} also holds {at_least}{others} file(s) of {_size(other_bytes)} "
            f"not made by edgellama, left alone" if others else "")
    if not models:
        click.echo(f"no models yet{also}. {_where()}")
        return
    width = max(len(m.name) for m in models)
    click.echo(f"{'NAME':<{width}}  {'SIZE':>9}  KIND")
    for m in models:
        kind = "gguf (default model)" if m.name == FILE_NAME else m.kind
        if m.size is None and m.path.is_symlink() and not m.path.exists():
            kind += " (a link to a file that is gone; rm removes the link)"
        click.echo(f"{m.name:<{width}}  {_size(m.size):>9}  {kind}")
    click.echo(f"total {_size(sum(m.size or 0 for m in models))}{also}. {_where()}", err=True)


@main.command("rm")
@click.argument("names", nargs=-1, required=True)
@click.option("-y", "--yes", is_flag=True, help="Do not ask for confirmation.")
def rm(names, yes):
    """Remove models and other files from the caches (NAME as `edgellama list` shows it)."""
    models = {m.name: m for m in hub.cached_models()}
    unknown = [n for n in names if n not in models]
    if unknown:
        raise EdgeError(f"no model named {', '.join(unknown)} in the caches; "
                        f"`edgellama list` shows their names")
    chosen = [models[n] for n in dict.fromkeys(names)]
    if not yes:
        from .options import stdin_problem
        if (why := stdin_problem()) and "closed" in why:
            raise EdgeError(f"cannot ask before removing: {why}; add -y to remove without asking")
        what = ", ".join(f"{m.name} ({_size(m.size)})" for m in chosen)
        click.confirm(f"remove {what}?", abort=True, err=True)
    from edgellama.tile_cache import cached_tiles
    tiles_of = {}
    for p, source in cached_tiles():
        tiles_of.setdefault(source["path"], []).append(p)
    for m in chosen:
        source = os.path.realpath(m.path)
        m.remove()
        click.echo(f"removed {m.name}", err=True)
        for p in tiles_of.get(source, []):     # its start-up tiles are of no use now
            p.unlink(missing_ok=True)
