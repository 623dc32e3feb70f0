"""Options and output helpers shared by the commands that run the engine."""
from __future__ import annotations

import codecs
import dataclasses
import functools
import json
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
         "(docs/usage.md, Fidelity).")

# edgellama.kv_cache.CACHE_TYPES and DEFAULT_CACHE_TYPE, written out (as ACTIVATIONS)
CACHE_TYPES = ("f16", "q8_0", "q4_0")
DEFAULT_CACHE_TYPE = "f16"


def cache_type_options(f):
    """-ctk/--cache-type-k, -ctv/--cache-type-v (llama.cpp's names)."""
    for short, name, what in (("-ctv", "--cache-type-v", "V"), ("-ctk", "--cache-type-k", "K")):
        f = click.option(short, name, type=click.Choice(CACHE_TYPES, case_sensitive=False),
                         default=DEFAULT_CACHE_TYPE, show_default=True,
                         help=f"How the KV cache stores {what}: f16, or ggml's q8_0 / q4_0 blocks "
                              f"(about 1/2 and 1/4 of f16's memory; docs/usage.md, KV cache types).")(f)
    return f


def _blank(value) -> bool:
    return isinstance(value, str) and not value.strip()


def _refuse_blank(kind: click.ParamType, what: str, value, param, ctx) -> None:
    # '' would name the current folder (os.path.join, Path('')): never what was meant
    if _blank(value):
        kind.fail(f"{'an empty' if not value else 'a blank'} {what} names nothing; give a "
                  f"file name (./NAME for one in this folder)", param, ctx)


class FilePath(click.Path):
    """click.Path, refusing an empty or blank value (a usage error)."""

    def convert(self, value, param, ctx):
        _refuse_blank(self, "path", value, param, ctx)
        if not self.file_okay and isinstance(value, str) and os.path.lexists(value) \
                and not os.path.isdir(value):     # click lets a FIFO or a dangling link by
            self.fail(f"{value!r} is not a directory", param, ctx)
        return super().convert(value, param, ctx)


class FileName(click.types.StringParamType):
    """A file name or reference as text (a NAME, a PATH, a Hugging Face reference), not
    empty nor blank."""
    name = "text"

    def convert(self, value, param, ctx):
        _refuse_blank(self, "name", value, param, ctx)
        return super().convert(value, param, ctx)


FILE_NAME = FileName()


class Threads(click.IntRange):
    """--threads: at least 1, at most the threads Numba started with (known once numba is
    imported, as it is before any command that runs kernels parses its options)."""

    def __init__(self):
        super().__init__(min=1)

    def convert(self, value, param, ctx):
        n = super().convert(value, param, ctx)
        numba = sys.modules.get("numba")
        if numba is not None and n > numba.config.NUMBA_NUM_THREADS:
            self.fail(f"{n} is more than the {numba.config.NUMBA_NUM_THREADS} threads Numba "
                      f"started with (set NUMBA_NUM_THREADS to raise it)", param, ctx)
        return n


def threads_option(f):
    return click.option("-t", "--threads", type=Threads(), default=None,
                        help="Worker threads (default: automatic, the cores other "
                             "processes leave free, at most the physical cores).")(f)


def model_flags(f):
    """-m/--model FILE, -hf/--hf-repo REPO[:QUANT], -c/--ctx, -t/--threads, --activations,
    -ctk/-ctv."""
    f = cache_type_options(f)
    f = activations_option(f)
    f = threads_option(f)
    f = click.option("-c", "--ctx", type=click.IntRange(min=1), default=None,
                     help="Context length in tokens (default: the model's, at most 8192).")(f)
    f = click.option("-hf", "--hf-repo", "hf_repo", metavar="REPO[:QUANT]", type=FILE_NAME,
                     default=None,
                     help="A GGUF from Hugging Face, downloaded once: OWNER/REPO[:QUANT] as in "
                          "llama.cpp (default quant Q4_K_M), or a short name such as "
                          "llama3.2:1b.")(f)
    return click.option("-m", "--model", "model", type=FilePath(dir_okay=False, path_type=str),
                        default=None,
                        help="GGUF file (default: SmolLM2-135M-Instruct, fetched once).")(f)


def model_options(f):
    """[MODEL], -m, -hf, -c, -t. The command gets `model`: the path of a local GGUF
    (downloaded first for a Hugging Face reference), or None for the default model."""
    @functools.wraps(f)
    def run(*args, model_arg=None, hf_repo=None, **kwargs):
        kwargs["model"] = resolve_model(model_arg, kwargs.pop("model"), hf_repo)
        return f(*args, **kwargs)
    return model_flags(click.argument("model_arg", metavar="[MODEL]", type=FILE_NAME,
                                      required=False)(run))


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


def _check_sampling(ctx, param, value):
    """A sampling value out of its range (on any model) is a usage error: the one range
    check of every sampling value, sampling.sampling_problem."""
    if value is None or (param.name == "seed" and value == -1):
        return value
    from edgellama.sampling import SamplingParams, sampling_problem
    if problem := sampling_problem({**vars(SamplingParams()), param.name: value}):
        raise click.BadParameter(problem, ctx, param)
    return value


def sampling_options(f):
    """Adds the sampling flags; each left unset keeps the model's default."""
    for name, (flag, alias, typ, help_) in reversed(_SAMPLING.items()):
        decls = [flag] + ([alias] if alias else []) + [name]
        f = click.option(*decls, type=typ, default=None, callback=_check_sampling,
                         help=help_)(f)
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
    """--draft MODEL, --lookup, --draft-max, --draft-min: speculative decoding. Options
    that contradict each other are usage errors, refused before anything loads."""
    @functools.wraps(f)
    def run(*args, **kwargs):
        if kwargs["draft"] is not None and kwargs["lookup"]:
            raise click.UsageError("give --draft MODEL or --lookup, not both")
        if kwargs["draft_min"] > kwargs["draft_max"]:
            raise click.UsageError(f"--draft-min {kwargs['draft_min']} is more than "
                                   f"--draft-max {kwargs['draft_max']}")
        return f(*args, **kwargs)
    g = click.option("--draft-min", type=click.IntRange(min=0), default=0, show_default=True,
                     help="Fewest tokens to draft per step; 0 lets a step draft none when "
                          "drafting does not pay.")(run)
    g = click.option("--draft-max", type=click.IntRange(min=1), default=16, show_default=True,
                     help="Most tokens to draft per step (the length adapts to how many "
                          "are accepted; at most 256, and fewer than the context).")(g)
    g = click.option("--lookup", is_flag=True,
                     help="Speculative decoding without a draft model: propose tokens copied "
                          "from the prompt and the reply where their last words recur "
                          "(llama.cpp's lookup decoding; for summaries, edits and code).")(g)
    return click.option("--draft", "draft", metavar="MODEL", type=FILE_NAME, default=None,
                        help="Speculative decoding with a smaller draft model of the same "
                             "vocabulary (a GGUF file or a Hugging Face reference): the same "
                             "replies, sooner.")(g)


def drafter_from(llm: edgellama.LLM, draft: str | None, lookup: bool, draft_min: int,
                 draft_max: int):
    """The drafter the speculative options ask for, or None. Draft lengths a step cannot
    check (speculative.draft_limit: the context, MAX_DRAFT) are lowered, with a note."""
    if draft is None and not lookup:
        return None
    from edgellama.speculative import MAX_DRAFT, PromptLookup, draft_limit
    limit = draft_limit(llm.ctx)
    for flag, value in (("--draft-max", draft_max), ("--draft-min", draft_min)):
        if value > limit:
            why = (f"at most {MAX_DRAFT}" if limit == MAX_DRAFT else
                   f"a step checks at most {limit} drafted tokens in a context of {llm.ctx}")
            click.echo(f"note: {flag} {value} lowered to {limit} ({why})", err=True)
    draft_min, draft_max = min(draft_min, limit), min(draft_max, limit)
    if lookup:
        return PromptLookup(draft_min=draft_min, draft_max=draft_max)
    return llm.load_draft(resolve_model(draft, None, None), draft_min, draft_max)


def draft_summary(stats) -> str:
    """' | drafted D, accepted A (P%)' of speculative decoding, or '' without."""
    if not stats.drafted:
        return ""
    return (f" | drafted {stats.drafted}, accepted {stats.accepted} "
            f"({100 * stats.accepted / stats.drafted:.0f}%)")


def _check_template_kwargs(ctx, param, value):
    """--chat-template-kwargs: a bounded JSON object (chat_template.template_kwargs),
    refused as a usage error before the model loads."""
    if value is None:
        return None
    from edgellama.chat_template import template_kwargs
    try:
        return template_kwargs(value, "the value")
    except EdgeError as e:
        raise click.BadParameter(str(e), ctx, param) from None


def chat_template_options(f):
    """--chat-template-kwargs JSON and --reasoning-budget N (llama.cpp's names); the
    command gets `template_kwargs`, the variables they ask for (template_kwargs_from)."""
    @functools.wraps(f)
    def run(*args, **kwargs):
        kwargs["template_kwargs"] = template_kwargs_from(kwargs.pop("chat_template_kwargs"),
                                                         kwargs.pop("reasoning_budget"))
        return f(*args, **kwargs)
    g = click.option("--reasoning-budget", type=int, metavar="N", default=-1, show_default=True,
                     callback=_check_budget,
                     help="-1: the model thinks as it likes; 0: no thinking (the template's "
                          "enable_thinking set false: Qwen 3 answers directly).")(run)
    return click.option("--chat-template-kwargs", "chat_template_kwargs", metavar="JSON",
                        default=None, callback=_check_template_kwargs,
                        help="Extra variables for the chat template, a JSON object, e.g. "
                             "'{\"enable_thinking\": false}'.")(g)


def _check_budget(ctx, param, value):
    if value not in (-1, 0):    # as llama.cpp: no budget in between yet
        raise click.BadParameter(f"{value} is not -1 (no limit) or 0 (no thinking); only "
                                 f"those are supported", ctx, param)
    return value


def template_kwargs_from(given: dict | None, reasoning_budget: int) -> dict:
    """The template variables of --chat-template-kwargs and --reasoning-budget together;
    a budget of 0 sets enable_thinking false, and contradicting it is a usage error."""
    out = dict(given or {})
    if reasoning_budget == 0:
        if out.get("enable_thinking", False) is not False:
            raise click.UsageError("--reasoning-budget 0 turns thinking off, but "
                                   "--chat-template-kwargs sets enable_thinking to "
                                   f"{json.dumps(out['enable_thinking'])}; give one of them")
        out["enable_thinking"] = False
    return out
