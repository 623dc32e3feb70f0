"""edgellama/reasoning.py: a reply's <think> block apart from its answer, streamed in
pieces split anywhere, against a plain whole-text twin; on Qwen 3's real tokens; and in
agreement with the tool-call reader, which skips the same block."""
import random
import re

import pytest

from edgellama.reasoning import (MAX_LEADING_SPACE, ReasoningSplitter, opens_reasoning,
                                 split_reasoning)
from edgellama.tokenizer import StreamDecoder, Tokenizer
from edgellama.tool_calls import parse_tool_calls
from test_qwen3_text import qwen3_metadata


def twin(text: str, opened: bool) -> tuple[str, str]:
    """llama-server's deepseek reasoning format on a whole reply, plainly."""
    if not opened:
        m = re.match(r"\s*<think>", text)
        if m is None or m.end() - len("<think>") > MAX_LEADING_SPACE:
            return "", text
        text = text[m.end():]
    reasoning, closed, rest = text.partition("</think>")
    return reasoning.strip(), rest.lstrip() if closed else ""


CASES = [
    # (reply, prompt left <think> open, reasoning, content)
    ("<think>\nThe user greets me.\n</think>\n\nHello!", False, "The user greets me.", "Hello!"),
    ("Hello! No block here.", False, "", "Hello! No block here."),
    ("  \n<think>a</think>b", False, "a", "b"),
    ("<think>\n\n</think>\n\nDirect.", False, "", "Direct."),          # an empty block
    ("<think>\nstill thinking when cut", False, "still thinking when cut", ""),
    ("I think <think>x</think> late", False, "", "I think <think>x</think> late"),
    ("weighing it\n</think>\n\nAnswer.", True, "weighing it", "Answer."),  # opened by the prompt
    ("cut inside the opened block  ", True, "cut inside the opened block", ""),
    ("<thin", False, "", "<thin"),                                    # only began like the tag
    ("<think>a </thi", False, "a </thi", ""),                         # cut inside </think>
    ("<think>x < y and </thinker> too</think>ok", False, "x < y and </thinker> too", "ok"),
    ("", False, "", ""),
    ("", True, "", ""),
    (" " * 64 + "<think>a</think>b", False, "a", "b"),
    ("\n" * 65 + "<think>a</think>b", False, "", "\n" * 65 + "<think>a</think>b"),
]


@pytest.mark.parametrize("text, opened, reasoning, content", CASES)
def test_whole_replies(text, opened, reasoning, content):
    assert twin(text, opened) == (reasoning, content)
    assert split_reasoning(text, opened) == (reasoning, content)


def _stream(pieces, opened):
    s = ReasoningSplitter(opened)
    out = [s.push(p) for p in pieces] + [s.finish()]
    return "".join(r for r, _ in out), "".join(c for _, c in out)


@pytest.mark.parametrize("text, opened, reasoning, content", CASES)
def test_every_split_in_two_and_three_and_by_character(text, opened, reasoning, content):
    n = len(text)
    assert _stream(list(text), opened) == (reasoning, content)
    for i in range(n + 1):
        for j in range(i, n + 1):
            assert _stream([text[:i], text[i:j], text[j:]], opened) == (reasoning, content), (i, j)


FRAGMENTS = ["<think>", "</think>", "<", "</", "think", ">", " ", "\n", "\n\n", "a", "b c",
             "<think", "/think>", "</thin", "\t", "é", "<tool_call>", " " * 30]


def test_random_replies_equal_the_twin():
    rng = random.Random(7)
    for _ in range(3000):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randrange(12)))
        opened = rng.random() < 0.3
        cuts = sorted(rng.randrange(len(text) + 1) for _ in range(rng.randrange(5)))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        assert _stream(pieces, opened) == twin(text, opened), (pieces, opened)


def test_nothing_is_given_out_twice_or_early():
    # what push gives out is final: the reasoning does not show the space before
    # </think>, nor a "<" that turned out to start it
    s = ReasoningSplitter()
    assert s.push("<thi") == ("", "") and not s.in_reasoning
    assert s.push("nk>\nStep one. ") == ("Step one.", "") and s.in_reasoning
    assert s.push("<") == ("", "")
    assert s.push("/think>") == ("", "") and not s.in_reasoning
    assert s.push("\n\n") == ("", "")
    assert s.push("Four.") == ("", "Four.")
    assert s.finish() == ("", "")


def test_a_reply_of_space_is_not_held_back():
    # a degenerate model's newlines stream as content once they pass MAX_LEADING_SPACE
    s = ReasoningSplitter()
    assert [s.push("\n") for _ in range(MAX_LEADING_SPACE)] == [("", "")] * MAX_LEADING_SPACE
    assert s.push("\n") == ("", "\n" * (MAX_LEADING_SPACE + 1))
    assert s.push("\n") == ("", "\n")


@pytest.fixture(scope="module")
def qwen(qwen3_tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_metadata(qwen3_metadata(qwen3_tokenizer_dir))


def test_qwen3_tokens_one_at_a_time(qwen):
    # <think> and </think> are single tokens of Qwen 3 (user-defined): streamed as the
    # decoder gives them out, token by token
    text = "<think>\nOkay, 2+2 is 4.\n</think>\n\nIt is 4. 汉字 🙂"
    ids = qwen.encode(text)
    assert qwen.special_tokens["<think>"] in ids and qwen.special_tokens["</think>"] in ids
    dec, pieces = StreamDecoder(qwen), []
    for t in ids:
        pieces.append(dec.push(t))
    pieces.append(dec.flush())
    assert _stream(pieces, False) == ("Okay, 2+2 is 4.", "It is 4. 汉字 🙂")


def test_opens_reasoning():
    assert opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")   # closed
    assert not opens_reasoning("<|im_start|>assistant\n")


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.mark.parametrize("reply", [
    f"<think>\nParis: call the tool.\n</think>\n\n{CALL}",
    f"\n<think></think>{CALL}",
    CALL,
    "<think>\nNo tool needed.\n</think>\n\nIt is sunny.",
    "<think>\ncut before the calls",
])
def test_the_tool_call_reader_skips_the_same_block(reply):
    # the server may read calls from the whole reply or from its content: the same calls
    reasoning, content = split_reasoning(reply)
    assert parse_tool_calls(reply, ["get_weather"]) == parse_tool_calls(content, ["get_weather"])
    assert CALL not in reasoning


def test_calls_after_a_block_the_prompt_opened_are_read_from_the_content():
    # the reply starts inside <think>: the whole text is not calls, its content is; the
    # server reads calls from the content (as llama-server does)
    reply = f"Paris: call the tool.\n</think>\n\n{CALL}"
    reasoning, content = split_reasoning(reply, opened=True)
    assert reasoning == "Paris: call the tool." and content == CALL
    assert parse_tool_calls(reply, ["get_weather"]) is None
    calls = parse_tool_calls(content, ["get_weather"])
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Paris"})]
