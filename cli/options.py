"""Options shared by the commands that run the engine."""
from __future__ import annotations

import dataclasses

import click

from edgellama.sampling import SamplingParams


def model_options(f):
    """-m/--model, -c/--ctx, -t/--threads: which model and how to run it."""
    f = click.option("-t", "--threads", type=int, default=None,
                     help="Worker threads (default: physical cores).")(f)
    f = click.option("-c", "--ctx", type=int, default=None,
                     help="Context length in tokens (default: the model's, at most 8192).")(f)
    return click.option("-m", "--model", "model", type=click.Path(dir_okay=False, path_type=str),
                        default=None,
                        help="GGUF file (default: SmolLM2-135M-Instruct, fetched once).")(f)


_SAMPLING = {
    "temperature": ("--temp", "--temperature", float, "Sampling temperature; 0 = greedy."),
    "top_k": ("--top-k", None, int, "Keep the k most likely tokens; 0 = off."),
    "top_p": ("--top-p", None, float, "Nucleus sampling threshold; 1 = off."),
    "min_p": ("--min-p", None, float, "Drop tokens below min-p × p(best); 0 = off."),
    "repeat_penalty": ("--repeat-penalty", None, float, "Penalise recent tokens; 1 = off."),
    "seed": ("--seed", None, int, "Random seed for reproducible sampling."),
}


def sampling_options(f):
    """Adds the sampling flags; each left unset keeps the model's default."""
    for name, (flag, alias, typ, help_) in reversed(_SAMPLING.items()):
        decls = [flag] + ([alias] if alias else []) + [name]
        f = click.option(*decls, type=typ, default=None, help=help_)(f)
    return f


def sampling_from(defaults: SamplingParams, kwargs: dict) -> SamplingParams:
    """The model's defaults overridden by the flags the user gave (pops them from kwargs)."""
    given = {k: kwargs.pop(k) for k in _SAMPLING}
    return dataclasses.replace(defaults, **{k: v for k, v in given.items() if v is not None})
