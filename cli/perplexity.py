"""`edgellama perplexity -m MODEL -f TEXT [--ref REF]`: llama-perplexity's figures."""
from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import click

from edgellama.errors import EdgeError

from .main import main
from .options import (FILE_NAME, FilePath, activations_option, cache_type_options, load,
                      one_line, resolve_model, threads_option)


def _checkpoint_type(hf_dir: Path) -> str:
    """The checkpoint's own float type when every tensor has it (the GGUF then holds the
    same values: lossless), else f32."""
    from edgellama.quant.hf import open_checkpoint
    tensors, shards = open_checkpoint(hf_dir)
    for s in shards:
        s.close()
    dtypes = {t.dtype for t in tensors.values()}
    return dtypes.pop().lower() if len(dtypes) == 1 else "f32"


def _load_reference(path: str, ctx: int, threads: int | None):
    """The reference model: a GGUF file, or a Hugging Face checkpoint directory converted
    at its own precision to a temporary GGUF. That file is deleted as soon as it is
    loaded (the memory map keeps its data), so an interrupted run leaves nothing behind.
    A quantized reference runs with fine activations: as close to its weights as we can."""
    p = Path(path)
    if not p.is_dir():
        if not p.exists():
            raise EdgeError(f"{path}: no such file or directory (--ref takes a GGUF file or "
                            f"a Hugging Face checkpoint directory)")
        return load(path, ctx, threads, "fine")
    from edgellama.quant.convert import convert
    fmt = _checkpoint_type(p)
    with tempfile.TemporaryDirectory(prefix="edgellama-ref-") as tmp:
        click.echo(f"converting {one_line(path)} to a temporary {fmt.upper()} GGUF in {tmp}",
                   err=True)
        out = Path(tmp) / "reference.gguf"
        for warning in convert(p, out, qtype=fmt).warnings:
            click.echo(f"warning: {one_line(warning)}", err=True)
        return load(out, ctx, threads)


class _Bar:
    """One line on stderr, redrawn after each chunk: chunks done, running PPL ± error
    (and mean KL with a reference), seconds per chunk."""

    def __init__(self, total: int):
        self.total, self.t0 = total, time.perf_counter()

    def __call__(self, done: int, results) -> None:
        r = results[0]
        per = (time.perf_counter() - self.t0) / done
        bar = "#" * (20 * done // self.total)
        kl = f"  KL {r.kl_mean:.5f} ± {r.kl_err:.5f}" if r.has_ref else ""
        sys.stderr.write(f"\r[{bar:<20}] {done}/{self.total} chunks  "
                         f"PPL {r.ppl:.4f} ± {r.ppl_err:.4f}{kl}  {per:.1f} s/chunk ")
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")


def _summary(model, ref, ref_name, text, n_tokens, whole, r, seconds) -> list[str]:
    lines = [f"model:     {model.path} ({model.model.type_summary()})"]
    if ref is not None:
        lines.append(f"reference: {ref_name} ({ref.model.type_summary()})")
    read = "" if whole else " read (enough for --chunks)"
    lines += [(f"text:      {text}: {n_tokens} tokens{read}; {r.chunks} chunks of {r.n_ctx}, "
               f"{r.count} tokens scored"),
              f"PPL                 {r.ppl:10.4f} ± {r.ppl_err:.4f}"]
    if r.has_ref:
        lines += [f"reference PPL       {r.ref_ppl:10.4f} ± {r.ref_ppl_err:.4f}",
                  f"PPL ratio           {r.ppl_ratio:10.4f} ± {r.ppl_ratio_err:.4f}",
                  f"mean KL divergence  {r.kl_mean:10.6f} ± {r.kl_err:.6f}",
                  f"median KL           {r.kl_percentile(50):10.6f}",
                  f"99th percentile KL  {r.kl_percentile(99):10.6f}",
                  f"maximum KL          {r.kl_max:10.6f}",
                  f"same top token      {100 * r.same_top_frac:9.2f}% ± {100 * r.same_top_err:.2f}%"]
    lines.append(f"time                {seconds:10.1f} s")
    return [one_line(s) for s in lines]


@main.command()
@click.argument("model_arg", metavar="[MODEL]", type=FILE_NAME, required=False)
@click.option("-m", "--model", "model", type=FilePath(dir_okay=False, path_type=str),
              default=None, help="GGUF file (default: SmolLM2-135M-Instruct, fetched once).")
@click.option("-hf", "--hf-repo", "hf_repo", metavar="REPO[:QUANT]", type=FILE_NAME,
              default=None,
              help="A GGUF from Hugging Face, downloaded once (as for generate).")
@click.option("-f", "--file", "text_file", required=True, type=FilePath(path_type=str),
              help="The text to score (UTF-8).")
@click.option("-c", "--ctx", type=click.IntRange(min=4), default=512, show_default=True,
              help="Tokens per chunk; the second half of each chunk is scored.")
@click.option("--chunks", type=click.IntRange(min=1), default=None,
              help="Score at most this many chunks (default: all the text holds).")
@click.option("--ref", default=None, metavar="GGUF|HF_DIR", type=FILE_NAME,
              help="Reference model, GGUF file or Hugging Face checkpoint directory: adds KL "
                   "divergence, top-token agreement and the perplexity ratio.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@threads_option
@activations_option
@cache_type_options
def perplexity(model_arg, model, hf_repo, text_file, ctx, chunks, ref, as_json, threads, activations,
               cache_type_k, cache_type_v):
    """Perplexity of a model over a text file, and its divergence from a reference."""
    from edgellama import perplexity as ppl

    f = ppl.open_text(text_file)
    model = resolve_model(model_arg, model, hf_repo)
    llm = load(model, ctx, threads, activations, cache_type_k, cache_type_v)
    # only as much of the text as the chunks asked for is read (a file may exceed memory)
    tokens, whole = ppl.read_tokens(llm.tokenizer, text_file, ppl.tokens_needed(ctx, chunks), f=f)
    bos = llm.tokenizer.bos_id if llm.tokenizer.add_bos else None
    plan = ppl.make_chunks(tokens, ctx, chunks, bos, what=text_file)
    ref_llm = _load_reference(ref, ctx, threads) if ref is not None else None
    if ref_llm is not None:
        why = ppl.same_vocabulary(llm.tokenizer, ref_llm.tokenizer)
        if why:
            raise EdgeError(f"the reference {ref} has a different vocabulary from the model "
                            f"({why}); KL divergence needs the same tokens")
    bar = _Bar(len(plan)) if sys.stderr.isatty() else None
    t0 = time.perf_counter()
    try:
        [result] = ppl.evaluate([llm.model], plan, ref_llm.model if ref_llm else None, bar)
    finally:
        if bar:
            bar.close()
    seconds = time.perf_counter() - t0
    if as_json:
        out = {"model": str(llm.path), "ref": ref, "text": text_file, "text_tokens": len(tokens),
               "text_read_whole": whole,
               **result.as_dict(), "seconds": seconds}
        click.echo(json.dumps(out))
    else:
        for line in _summary(llm, ref_llm, ref, text_file, len(tokens), whole, result,
                             seconds):
            click.echo(line)
