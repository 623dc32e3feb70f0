"""Chatting with Qwen 3 (a random tiny model with the real tokenizer and template):
thinking switched off by template variables, the reply's reasoning apart from its
answer in ChatSession and `edgellama chat`, and kept out of the history."""
import io

import pytest
from click.testing import CliRunner

import edgellama
from edgellama.chat_session import ChatSession
from edgellama.cli.chat import DIM, PLAIN, _show_reply
from edgellama.cli.main import main
from edgellama.cli.options import Output
from edgellama.errors import EdgeError
from edgellama.quant.convert import convert
from edgellama.sampling import SamplingParams
from test_convert_qwen3 import write_tiny_qwen3

REPLY = "<think>\nThe user greets me.\n</think>\n\nHello!"
EMPTY_THINK = "<think>\n\n</think>\n\n"


@pytest.fixture(scope="module")
def model(tmp_path_factory, qwen3_tokenizer_dir):
    d = tmp_path_factory.mktemp("qwen3chat")
    hf, _ = write_tiny_qwen3(d / "hf", qwen3_tokenizer_dir)
    convert(hf, d / "qwen3.gguf", "f32")
    return d / "qwen3.gguf"


@pytest.fixture()
def llm(model):
    return edgellama.load(model, ctx=256)


def scripted(llm, *replies):
    """llm.generate replaced: each call records its prompt and yields the next reply's
    tokens (a model that says what the test needs)."""
    prompts, queue = [], list(replies)

    def generate(ids, **kw):
        prompts.append(list(ids))
        yield from llm.tokenizer.encode(queue.pop(0))
    llm.generate = generate
    return prompts


def _parts(session, text):
    pieces = list(session.send_parts(text))
    return "".join(r for r, _ in pieces), "".join(c for _, c in pieces)


def test_reasoning_apart_and_out_of_the_history(llm):
    prompts = scripted(llm, REPLY, "Fine.")
    s = ChatSession(llm, SamplingParams(temperature=0))
    assert _parts(s, "Hi") == ("The user greets me.", "Hello!")
    assert s.messages[-1] == {"role": "assistant", "content": "Hello!"}
    assert "".join(s.send("And you?")) == "Fine."
    # the next prompt is the one the whole reply would give: Qwen 3's template drops an
    # earlier turn's reasoning itself
    whole = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": REPLY},
             {"role": "user", "content": "And you?"}]
    assert prompts[1] == llm.chat.encode_messages(whole)


def test_send_streams_the_text_as_written(llm):
    scripted(llm, REPLY)
    s = ChatSession(llm, SamplingParams(temperature=0))
    assert "".join(s.send("Hi")) == REPLY
    assert s.messages[-1]["content"] == "Hello!"


def test_enable_thinking_false_reaches_the_prompt(llm):
    prompts = scripted(llm, "Hello!", "Hello!")
    s = ChatSession(llm, SamplingParams(temperature=0))
    _parts(s, "Hi")
    s.reset()
    llm.chat.template_kwargs = {"enable_thinking": False}
    assert _parts(s, "Hi") == ("", "Hello!")
    tok = llm.tokenizer
    assert tok.decode(prompts[0][-3:], special=True) == "<|im_start|>assistant\n"
    assert tok.decode(prompts[1][-7:], special=True) == "<|im_start|>assistant\n" + EMPTY_THINK
    assert prompts[1][:len(prompts[0])] == prompts[0]


def test_a_template_that_opens_the_block(llm):
    # DeepSeek R1's and Qwen 3 Thinking-2507's templates end the prompt in <think>: the
    # reply starts inside the block
    llm.chat = type(llm.chat)(llm.tokenizer, (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"))
    scripted(llm, "Short sum.\n</think>\n\n4", "cut while thinking")
    s = ChatSession(llm, SamplingParams(temperature=0))
    assert _parts(s, "2+2?") == ("Short sum.", "4")
    assert _parts(s, "3+3?") == ("cut while thinking", "")
    assert s.messages[-1]["content"] == ""


def test_stopped_while_answering_keeps_what_was_said(llm):
    scripted(llm, REPLY + " More words follow here.")
    s = ChatSession(llm, SamplingParams(temperature=0))
    got = ""
    for _, content in s.send_parts("Hi"):
        got += content
        if "Hello" in got:
            break                                # Ctrl-C
    assert s.messages[-1]["content"].startswith("Hello")


class _Terminal(io.StringIO):
    def isatty(self):
        return True


class _Session:
    def __init__(self, parts, text):
        self.parts, self.text = parts, text

    def send_parts(self, _):
        yield from self.parts

    def send(self, _):
        yield from self.text


def test_chat_shows_reasoning_dimmed_on_a_terminal():
    screen = _Terminal()
    _show_reply(_Session([("Thinking", ""), (" hard.", ""), ("", "Hello"), ("", "!")], None),
                "Hi", Output(screen))
    assert screen.getvalue() == f"{DIM}Thinking hard.{PLAIN}\n\nHello!"
    screen = _Terminal()
    _show_reply(_Session([("", "Just this.")], None), "Hi", Output(screen))
    assert screen.getvalue() == "Just this."


def test_chat_writes_the_text_as_is_to_a_pipe():
    class _Pipe(io.TextIOWrapper):
        pass
    raw = io.BytesIO()
    pipe = _Pipe(raw, encoding="utf-8")
    _show_reply(_Session(None, ["<think>\nx\n</think>", "\n\nHello!"]), "Hi", Output(pipe))
    pipe.flush()
    assert raw.getvalue().decode() == "<think>\nx\n</think>\n\nHello!"


def _prompt_tokens(result) -> int:
    assert result.exit_code == 0, result.output
    return int(result.stderr.split("prompt: ")[1].split(" tokens")[0])


def test_generate_reasoning_budget_0_and_kwargs(model):
    # the prompt of `generate` gains the empty think block: 4 tokens (<think>, "\n\n",
    # </think>, "\n\n")
    base = ["generate", "-m", str(model), "-p", "Hi", "-n", "1", "--temp", "0", "-c", "64"]
    r = CliRunner()
    plain = _prompt_tokens(r.invoke(main, base))
    assert _prompt_tokens(r.invoke(main, base + ["--reasoning-budget", "0"])) == plain + 4
    off = ["--chat-template-kwargs", '{"enable_thinking": false}']
    assert _prompt_tokens(r.invoke(main, base + off)) == plain + 4
    on = ["--chat-template-kwargs", '{"enable_thinking": true}']
    assert _prompt_tokens(r.invoke(main, base + on)) == plain


@pytest.mark.parametrize("args, message", [
    (["--reasoning-budget", "100"], "100 is not -1 (no limit) or 0 (no thinking)"),
    (["--chat-template-kwargs", "{enable_thinking: false}"], "the value is not valid JSON"),
    (["--chat-template-kwargs", '{"tools": []}'], "may not set 'tools'"),
    (["--chat-template-kwargs", '{"enable_thinking": true}', "--reasoning-budget", "0"],
     "--reasoning-budget 0 turns thinking off, but --chat-template-kwargs sets enable_thinking to true"),
    (["--raw", "--reasoning-budget", "0"], "which --raw leaves out"),
    # a string is true to the template: "false" left thinking on, silently (llama-server
    # refuses it too)
    (["--chat-template-kwargs", '{"enable_thinking": "false"}'],
     'enable_thinking must be true or false, got "false"'),
    (["--chat-template-kwargs", '{"enable_thinking": 0}'], "enable_thinking must be true or false, got 0"),
    (["--chat-template-kwargs", '{"x": NaN}'], "the value is not valid JSON: NaN is not JSON"),
    (["--chat-template-kwargs", '{"x": [-Infinity]}'], "-Infinity is not JSON"),
])
def test_bad_options_are_usage_errors_before_loading(args, message):
    for cmd in (["generate", "-p", "Hi"], ["chat"]):
        if "--raw" in args and cmd[0] == "chat":
            continue
        r = CliRunner().invoke(main, cmd + ["-m", "/nonexistent/model.gguf"] + args)
        assert r.exit_code == 2 and message in r.output, r.output
        assert "Traceback" not in r.output


def test_load_takes_the_kwargs(model):
    llm = edgellama.load(model, ctx=64, chat_template_kwargs={"enable_thinking": False})
    assert llm.chat.render([{"role": "user", "content": "Hi"}]).endswith(EMPTY_THINK)
    with pytest.raises(EdgeError, match="chat template kwargs must be a JSON object"):
        edgellama.load("/nonexistent/model.gguf", chat_template_kwargs="[true]")
    with pytest.raises(EdgeError, match="must hold only JSON values"):
        edgellama.load("/nonexistent/model.gguf", chat_template_kwargs={"x": float("nan")})
