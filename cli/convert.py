"""`edgellama convert HF_DIR|REPO -o OUT.gguf`: parse options, call quant.convert.convert, print."""
from __future__ import annotations

import os
import sys
import time

import click

from edgellama import hub
from edgellama.quant.convert import QTYPES, SINGLE_TYPES, convert

from .main import main
from .options import FilePath


class _Bar:
    """One-line progress on stderr: tensor name, bytes done / total, rate."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.last = 0.0

    def __call__(self, name: str, done: int, total: int) -> None:
        now = time.perf_counter()
        if now - self.last < 0.1 and done < total:
            return
        self.last = now
        rate = done / max(now - self.t0, 1e-9) / 1e6
        frac = done / max(total, 1)
        bar = "#" * int(frac * 30)
        sys.stderr.write(f"\r[{bar:<30}] {frac:6.1%} {done / 1e6:9.1f}/{total / 1e6:.1f} MB "
                         f"{rate:7.1f} MB/s  {name[:32]:<32}")
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\r" + " " * 110 + "\r")


@main.command("convert")
@click.argument("hf_dir", metavar="HF_DIR|REPO", type=FilePath(file_okay=False, path_type=str))
@click.option("-o", "--output", "out", required=True, type=FilePath(dir_okay=False),
              help="Output .gguf path.")
@click.option("--type", "qtype", type=click.Choice(QTYPES, case_sensitive=False), default="q8_0",
              show_default=True,
              help="Format of the 2-D weight matrices (1-D norms stay f32), or a llama.cpp K-quant "
                   "mix (q2_k ... q6_k: a type per tensor, the file llama-quantize makes).")
@click.option("--embed-type", type=click.Choice(SINGLE_TYPES, case_sensitive=False), default=None,
              help="Format of token_embd/output (default: the mix's; q8_0 for q4_0/q4_1; else --type).")
@click.option("--force", is_flag=True, help="Overwrite OUT if it exists.")
@click.option("--quiet", is_flag=True, help="No progress bar, summary or warnings.")
def convert_cmd(hf_dir, out, qtype, embed_type, force, quiet):
    """Convert a Hugging Face Llama checkpoint (a directory, or a Hub repository) to GGUF.

    A Hub repository (OWNER/NAME, when no such directory exists) is downloaded to the
    Hugging Face cache first: only its safetensors, JSON config/tokenizer files and
    tokenizer.model. Gated repositories (meta-llama/...) need HF_TOKEN.
    """
    name = None
    if not os.path.exists(hf_dir) and hub.is_repo_id(hf_dir):
        name = hf_dir.rsplit("/", 1)[1]
        hf_dir = str(hub.checkpoint_dir(hf_dir, quiet=quiet))
    bar = _Bar() if not quiet and sys.stderr.isatty() else None
    try:
        s = convert(hf_dir, out, qtype=qtype, embed_type=embed_type, force=force, progress=bar,
                    name=name)
    finally:
        if bar:
            bar.close()
    if quiet:
        return
    for w in s.warnings:
        click.echo(f"warning: {w}", err=True)
    click.echo(f"wrote {s.out_path} ({s.qtype}): {len(s.tensors)} tensors, {s.file_size / 1e6:.1f} MB, "
               f"{s.n_params / 1e6:.1f} M weights, {s.bits_per_weight:.2f} bits/weight, {s.seconds:.1f} s")
    for line in s.plan_lines():
        click.echo(f"  {line}")
