"""Converter and runtime together: SmolLM2's GGUF -> HF checkpoint (bf16) -> our
converter -> our runtime gives the same greedy text as the original file."""
import pytest

import edgellama
from edgellama.sampling import SamplingParams
from hf_fixtures import gguf_to_hf_checkpoint
from edgellama.quant.convert import convert

GREEDY = SamplingParams(temperature=0)


def _greedy(path, n=30):
    llm = edgellama.load(path, ctx=256)
    # asked for a sentence: the bare question is a knife edge for this model (test_model.py)
    chat = llm.chat.encode_messages(
        [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}])
    raw = llm.tokenizer.encode("The capital of France is")
    return [llm.tokenizer.decode(list(llm.generate(ids, max_tokens=n, sampling=GREEDY)))
            for ids in (chat, raw)]


@pytest.fixture(scope="module")
def smol_hf(smollm2_gguf, tmp_path_factory):
    return gguf_to_hf_checkpoint(smollm2_gguf, tmp_path_factory.mktemp("smolhf"))


@pytest.fixture(scope="module")
def original_text(smollm2_gguf):
    return _greedy(smollm2_gguf)


def test_converted_q4_1_gives_the_same_greedy_text(smol_hf, original_text, tmp_path):
    out = tmp_path / "smol-q4_1.gguf"
    convert(smol_hf, out, qtype="q4_1")   # the original's mix: Q4_1 with a Q8_0 embedding
    assert _greedy(out) == original_text
    assert "Paris" in original_text[0]


def test_converted_q8_0_agrees_on_the_answer(smol_hf, original_text, tmp_path):
    out = tmp_path / "smol-q8_0.gguf"
    convert(smol_hf, out, qtype="q8_0")   # different weights (8-bit), same model
    chat, raw = _greedy(out)
    assert chat == original_text[0]
    # greedy continuations of different weights part ways after the answer (where depends
    # on the CPU's f32 rounding): the answer itself must be the same
    assert raw.startswith(" Paris.") and original_text[1].startswith(" Paris.")
