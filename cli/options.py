"""Options and output helpers shared by the commands that run the engine."""
from __future__ import annotations

import codecs
import dataclasses
import functools
import os
import re
import stat
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

import edgellama
from edgellama.errors import EdgeError

if TYPE_CHECKING:   # numpy: not needed to parse the command line
    from edgellama.sampling import SamplingParams


# edgellama.model.ACTIVATIONS, written out: the command line parses without numpy
ACTIVATIONS = ("int8", "fine")
activations_option = click.option(
    "--activations", type=click.Choice(ACTIVATIONS), default="int8", show_default=True,
    help="How activations are rounded for the integer matrix products: int8 per block of 32 "
         "as llama.cpp does, or fine: int8 plus its rounded residual for every "
         "Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K matrix, closer to full precision and slower "
         "(README, Fidelity).")

# edgellama.kv_cache.CACHE_TYPES and DEFAULT_CACHE_TYPE, written out (as ACTIVATIONS)
CACHE_TYPES = ("f16", "q8_0", "q4_0")
DEFAULT_CACHE_TYPE = "f16"


def cache_type_options(f):
    """-ctk/--cache-type-k, -ctv/--cache-type-v (llama.cpp's names)."""
    for short, name, what in (("-ctv", "--cache-type-v", "V"), ("-ctk", "--cache-type-k", "K")):
        f = click.option(short, name, type=click.Choice(CACHE_TYPES, case_sensitive=False),
                         default=DEFAULT_CACHE_TYPE, show_default=True,
                         help=f"How the KV cache stores {what}: f16, or ggml's q8_0 / q4_0 blocks "
                              f"(about 1/2 and 1/4 of f16's memory; README, KV cache).")(f)
    return f


def model_flags(f):
    """-m/--model FILE, -hf/--hf-repo REPO[:QUANT], -c/--ctx, -t/--threads, --activations,
    -ctk/-ctv."""
    f = cache_type_options(f)
    f = activations_option(f)
    f = click.option("-t", "--threads", type=int, default=None,
                     help="Worker threads (default: automatic, the cores other "
                          "processes leave free, at most the physical cores).")(f)
    f = click.option("-c", "--ctx", type=int, default=None,
                     help="Context length in tokens (default: the model's, at most 8192).")(f)
    f = click.option("-hf", "--hf-repo", "hf_repo", metavar="REPO[:QUANT]", default=None,
                     help="A GGUF from Hugging Face, downloaded once: OWNER/REPO[:QUANT] as in "
                          "llama.cpp (default quant Q4_K_M), or a short name such as "
                          "llama3.2:1b.")(f)
    return click.option("-m", "--model", "model", type=click.Path(dir_okay=False, path_type=str),
                        default=None,
                        help="GGUF file (default: SmolLM2-135M-Instruct, fetched once).")(f)


def model_options(f):
    """[MODEL], -m, -hf, -c, -t. The command gets `model`: the path of a local GGUF
    (downloaded first for a Hugging Face reference), or None for the default model."""
    @functools.wraps(f)
    def run(*args, model_arg=None, hf_repo=None, **kwargs):
        kwargs["model"] = resolve_model(model_arg, kwargs.pop("model"), hf_repo)
        return f(*args, **kwargs)
    return model_flags(click.argument("model_arg", metavar="[MODEL]", required=False)(run))


def stdin_problem() -> str | None:
    """Why standard input has nothing to read, if it plainly has not: closed (a daemon
    started us with `0<&-`), or /dev/null. None when it may hold input."""
    if sys.stdin is None or sys.stdin.closed:        # Python found no descriptor 0
        return "standard input is closed"
    try:
        fd = sys.stdin.fileno()
    except (OSError, ValueError):                   # a stream of its own (tests): readable
        return None
    try:
        st = os.fstat(fd)
    except OSError:                                 # its descriptor was closed since
        return "standard input is closed"
    if stat.S_ISCHR(st.st_mode) and not os.isatty(fd):
        try:
            if st.st_rdev == os.stat(os.devnull).st_rdev:
                return f"standard input is {os.devnull}"
        except OSError:
            pass
    return None


def _names_file(text: str) -> bool:
    return os.path.exists(text) or text.endswith(".gguf")


def positional_is_model(text: str) -> bool:
    """A positional MODEL is a file when it exists or ends in .gguf; otherwise it is a
    Hugging Face reference when it reads as one (llama3.2:1b, OWNER/REPO[:QUANT])."""
    from edgellama import hub
    return _names_file(text) or hub.is_ref(text)


def resolve_model(positional: str | None, path: str | None, hf_repo: str | None) -> str | None:
    """The local GGUF path the user named, downloading a Hugging Face one if needed."""
    if sum(x is not None for x in (positional, path, hf_repo)) > 1:
        raise click.UsageError("name the model once: MODEL, -m FILE or -hf REPO[:QUANT]")
    from edgellama import hub
    if positional is not None and not _names_file(positional):
        if not hub.is_ref(positional):
            raise EdgeError(f"{positional}: no such file, and not a Hugging Face reference "
                            f"(OWNER/REPO[:QUANT], or one of {', '.join(hub.SHORT_NAMES)})")
        hf_repo, positional = positional, None
    if hf_repo is not None:
        return str(hub.gguf_path(hf_repo))
    return positional if positional is not None else path


def load(model, ctx, threads, activations="int8", cache_type_k=DEFAULT_CACHE_TYPE,
         cache_type_v=DEFAULT_CACHE_TYPE) -> edgellama.LLM:
    """edgellama.load, then what the file gave reason to warn about, on stderr. On a
    terminal a transient line says what is loading (repacking a big model takes seconds)."""
    if model is None:
        from edgellama.default_model import default_model_path
        model = default_model_path()
    show = sys.stderr.isatty()
    if show:
        sys.stderr.write(f"loading {for_terminal(Path(model).name)}...\r")
        sys.stderr.flush()
    try:
        llm = edgellama.load(model, ctx=ctx, threads=threads, activations=activations,
                             cache_type_k=cache_type_k, cache_type_v=cache_type_v)
    finally:
        if show:
            sys.stderr.write("\x1b[K")   # the line goes; what follows starts on it
            sys.stderr.flush()
    for warning in llm.warnings:
        click.echo(f"warning: {one_line(warning)}", err=True)
    return llm


_SAMPLING = {
    "temperature": ("--temp", "--temperature", float, "Sampling temperature; 0 = greedy."),
    "top_k": ("--top-k", None, int, "Keep the k most likely tokens; 0 = off."),
    "top_p": ("--top-p", None, float, "Nucleus sampling threshold; 1 = off."),
    "min_p": ("--min-p", None, float, "Drop tokens below min-p × p(best); 0 = off."),
    "repeat_penalty": ("--repeat-penalty", None, float, "Penalise recent tokens; 1 = off."),
    "seed": ("--seed", None, click.IntRange(min=-1),
             "Random seed for reproducible sampling; -1 = a random seed (the default)."),
}


def sampling_options(f):
    """Adds the sampling flags; each left unset keeps the model's default."""
    for name, (flag, alias, typ, help_) in reversed(_SAMPLING.items()):
        decls = [flag] + ([alias] if alias else []) + [name]
        f = click.option(*decls, type=typ, default=None, help=help_)(f)
    return f


def sampling_from(defaults: SamplingParams, kwargs: dict) -> SamplingParams:
    """The model's defaults overridden by the flags the user gave (pops them from kwargs)."""
    given = {k: v for k in _SAMPLING if (v := kwargs.pop(k)) is not None}
    if given.get("seed") == -1:   # as in llama.cpp
        given["seed"] = None
    return dataclasses.replace(defaults, **given)


# C0 controls but tab and newline, DEL, C1 controls: ESC and CSI start the sequences that
# set a terminal's title, write its clipboard (OSC 52), clear or redraw the screen.
_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _picture(m: re.Match) -> str:
    c = ord(m.group())
    if c == 0x0D:
        return ""                              # a bare carriage return could overwrite a line
    return chr(0x2400 + c) if c < 0x20 else "\u2421" if c == 0x7F else "\ufffd"


def for_terminal(text: str) -> str:
    """Text from an untrusted file, safe to show on a terminal: its control characters are
    shown as symbols (ESC as ␛) instead of obeyed."""
    return _CONTROLS.sub(_picture, text)


def one_line(text: str) -> str:
    """A message for one line of stderr: line breaks become spaces, controls symbols."""
    return for_terminal(re.sub(r"[\r\n\t]+", " ", text))


class Output:
    """Where a command streams model output: on a terminal, text with its control
    characters neutralised; anywhere else (a pipe, a file), the model's bytes exactly."""

    def __init__(self, stream):
        self.stream = stream
        self.terminal = stream.isatty()
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def write(self, data: bytes | str) -> None:
        if isinstance(data, str):   # command-line text: surrogateescape restores its bytes
            data = data.encode("utf-8", "surrogateescape")
        if self.terminal:
            self.stream.write(for_terminal(self._utf8.decode(data)))
        else:
            self.stream.flush()
            self.stream.buffer.write(data)
        self.stream.flush()

    def finish(self) -> None:
        """End the output: on a terminal, what an unfinished UTF-8 sequence held back
        (as U+FFFD) and a line break."""
        if self.terminal:
            self.stream.write(for_terminal(self._utf8.decode(b"", final=True)) + "\n")
            self.stream.flush()


def speculative_options(f):
    """--draft MODEL, --lookup, --draft-max, --draft-min: speculative decoding."""
    f = click.option("--draft-min", type=click.IntRange(min=0), default=0, show_default=True,
                     help="Fewest tokens to draft per step; 0 lets a step draft none when "
                          "drafting does not pay.")(f)
    f = click.option("--draft-max", type=click.IntRange(min=1), default=16, show_default=True,
                     help="Most tokens to draft per step (the length adapts to how many "
                          "are accepted).")(f)
    f = click.option("--lookup", is_flag=True,
                     help="Speculative decoding without a draft model: propose tokens copied "
                          "from the prompt and the reply where their last words recur "
                          "(llama.cpp's lookup decoding; for summaries, edits and code).")(f)
    return click.option("--draft", "draft", metavar="MODEL", default=None,
                        help="Speculative decoding with a smaller draft model of the same "
                             "vocabulary (a GGUF file or a Hugging Face reference): the same "
                             "replies, sooner.")(f)


def drafter_from(llm: edgellama.LLM, draft: str | None, lookup: bool, draft_min: int,
                 draft_max: int):
    """The drafter the speculative options ask for, or None."""
    if draft is not None and lookup:
        raise click.UsageError("give --draft MODEL or --lookup, not both")
    if draft_min > draft_max:
        raise EdgeError(f"--draft-min {draft_min} is more than --draft-max {draft_max}")
    if lookup:
        from edgellama.speculative import PromptLookup
        return PromptLookup(draft_min=draft_min, draft_max=draft_max)
    if draft is not None:
        return llm.load_draft(resolve_model(draft, None, None), draft_min, draft_max)
    return None


def draft_summary(stats) -> str:
    """' | drafted D, accepted A (P%)' of speculative decoding, or '' without."""
    if not stats.drafted:
        return ""
    return (f" | drafted {stats.drafted}, accepted {stats.accepted} "
            f"({100 * stats.accepted / stats.drafted:.0f}%)")
