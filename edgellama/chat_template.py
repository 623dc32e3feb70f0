"""Chat prompts: the GGUF's Jinja chat template rendered as HF transformers does, then tokenized.

Templates come from downloaded files, so they are compiled and rendered in a separate
process, the renderer, and never in ours:

- jinja2's immutable sandbox there makes any reach for Python internals an error;
- hard limits hold for any template, including work done inside one filter or operator
  call in C (`indent`, `tojson(indent=...)`, `sum(start=...)`, the repr of a list nested
  a thousand times in itself...): LIMIT_SECONDS of wall time per compile or render,
  MAX_MEMORY resident (polled from here on Linux, macOS and Windows; on Linux also an
  address-space rlimit in the renderer, so one huge allocation fails at once), and the
  renderer cannot write to files. A request over a limit kills the renderer, and the next
  one starts a fresh renderer: a hostile template costs one error, never a hang.

Patching filters one by one cannot bound a single C call, and no trace hook sees inside
one; a process boundary can. One renderer serves the whole process: starting it costs
Python plus jinja2 (once, overlapping the model load); a render costs one pipe round trip
on top of the template itself ("template renderer",
bench/results/design_measurements.json). The template
is compiled once, when the ChatFormat is made (so a broken one fails at load), and kept
compiled in the renderer.

Special tokens in the prompt must come from the template only: a user who types
`<|eot_id|>` must not end their turn. Before rendering, control-token strings inside
message contents are swapped for private markers; after rendering, the text is split at
the template's own special tokens and the markers are put back as plain text.
User-defined tokens (Qwen's <think>, <tool_call>) are tokens wherever they appear, as
plain encoding reads them (llama.cpp and HF do the same).

Rendering is stable for KV-cache reuse: rendering messages[:k] with the generation prompt,
followed by the reply, is a prefix of rendering the conversation with that reply (tested
for the Llama 3.2 and SmolLM2 templates). Two things can break the prefix at the reply:
Llama 3 templates `trim` message contents (a reply ending in whitespace re-renders
without it), and templates that print a date (Llama 3.1/3.2 "Today Date") would change
at midnight, so `strftime_now` returns the time the ChatFormat was created.

Extra variables (llama.cpp's --chat-template-kwargs, as Qwen 3's enable_thinking) come
beside the messages: a bounded JSON object (template_kwargs()), the format's own
(ChatFormat.template_kwargs) under a render's; control-token text in them is hidden as
in messages.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import queue
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from edgellama.errors import EdgeError
from edgellama.machine import resident_memory

if TYPE_CHECKING:   # the renderer imports this module: it stays free of NumPy and Numba
    from edgellama.tokenizer import Tokenizer

# Used when the file has no tokenizer.chat_template (builtin_template picks): Llama 3's
# turn format.
LLAMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
# Used when a file with Gemma's turn tokens has none (llama.cpp's Gemma 3 GGUFs carry no
# template): Google's Gemma 3 instruction-tuned template, as in the HF tokenizer_config.json
# of the gemma-3-*-it models. No system role: a system message is folded into the first user
# turn; "assistant" is "model"; the reply ends at <end_of_turn>.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\\n'}}\n"
    "{%- endif -%}\n")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

# Real chat templates are 1-30 KB, render in milliseconds to a few hundred KB, and need
# a few MB. A template asking for far more is broken or hostile.
MAX_SOURCE = 1 << 20          # characters of template source (checked before compiling)
MAX_OUTPUT = 16 << 20         # characters of rendered text
MAX_MEMORY = 512 << 20        # resident bytes of the renderer
LIMIT_SECONDS = 2.0           # wall time of one compile or render
START_SECONDS = 60.0          # starting the renderer (slow disks, busy machines)
_INTERPRETER_SPACE = 512 << 20   # address space of Python itself, over MAX_MEMORY
_MAX_FRAME = 6 * MAX_OUTPUT + (1 << 16)   # a reply: the text JSON-escaped (\u0001: 6 bytes)
_POLL_SECONDS = 0.02
# Extra template variables (llama.cpp's --chat-template-kwargs: enable_thinking...) are a
# few flags; these bounds leave room for far more and keep a client's JSON small.
MAX_KWARGS_CHARS = 1 << 16    # characters of their JSON
MAX_KWARGS_DEPTH = 16         # nesting of lists and objects
# The variables the renderer sets itself: an extra one may not replace them.
RESERVED_VARIABLES = ("messages", "add_generation_prompt", "tools", "bos_token", "eos_token")


def _stopped(why: str) -> str:
    return f"chat template stopped: {why}; the file's template is broken or hostile"


def _one_line(text: str, limit: int = 300) -> str:
    """A message from the template, fit for one line of an error."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


def _not_json(name: str):
    """json.loads' hook for NaN and Infinity, which Python reads and JSON has not."""
    raise ValueError(f"{name} is not JSON")


def template_kwargs(value: str | Mapping[str, Any] | None,
                    what: str = "chat template kwargs") -> dict[str, Any]:
    """Extra chat template variables, checked: a JSON object (its text, or a dict of JSON
    values) of at most MAX_KWARGS_CHARS characters and MAX_KWARGS_DEPTH levels, naming
    no variable the renderer sets. A copy; an EdgeError of one line, naming `what`,
    says what is wrong."""
    if value is None:
        return {}
    if isinstance(value, str):
        text = value
    else:
        if not isinstance(value, Mapping):
            raise EdgeError(f"{what} must be a JSON object of variable names and values, "
                            f"got {type(value).__name__}")
        try:
            text = json.dumps(value, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError, RecursionError) as exc:
            raise EdgeError(f"{what} must hold only JSON values (strings, numbers, true, "
                            f"false, null, lists, objects): {_one_line(str(exc), 120)}") from None
    if len(text) > MAX_KWARGS_CHARS:
        raise EdgeError(f"{what} is {len(text)} characters of JSON, more than the "
                        f"{MAX_KWARGS_CHARS} allowed")
    too_deep = EdgeError(f"{what} nests more than {MAX_KWARGS_DEPTH} levels deep")
    try:
        parsed = json.loads(text, parse_constant=_not_json)
    except RecursionError:
        raise too_deep from None
    except ValueError as exc:
        raise EdgeError(f"{what} is not valid JSON: {_one_line(str(exc), 120)}; give an "
                        """object, as '{"enable_thinking": false}'""") from None
    if not isinstance(parsed, dict):
        raise EdgeError(f"{what} must be a JSON object, as "
                        f"""'{{"enable_thinking": false}}', not {_one_line(text, 60)}""")
    stack = [(parsed, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > MAX_KWARGS_DEPTH:
            raise too_deep
        if isinstance(v, (dict, list)):
            stack += [(x, depth + 1) for x in (v.values() if isinstance(v, dict) else v)]
    taken = [k for k in parsed if k in RESERVED_VARIABLES]
    if taken:
        raise EdgeError(f"{what} may not set {taken[0]!r}: edgellama sets it from the "
                        f"conversation")
    # templates test it with `is false`: any other value, "false" included, leaves
    # thinking on (llama-server refuses a string too)
    thinking = parsed.get("enable_thinking", False)
    if not isinstance(thinking, bool):
        raise EdgeError(f"{what}: enable_thinking must be true or false, got "
                        f"{_one_line(json.dumps(thinking, ensure_ascii=False), 60)}")
    return parsed


# -- the renderer process -----------------------------------------------------------------------

class _Sandbox(ImmutableSandboxedEnvironment):
    """Immutable sandbox that fails on an unsafe attribute instead of rendering it empty."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} "
                            "object is not allowed")


class _GenerationTag(Extension):
    """HF's `{% generation %}...{% endgeneration %}`: marks assistant text; renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # HF's override: Jinja's own tojson HTML-escapes, which chat templates do not want.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def compile_template(source: str, now: datetime) -> jinja2.Template:
    """Compile a chat template in HF's environment; `strftime_now` always formats `now`.
    Runs in the renderer process only: compiling is as unbounded as rendering."""
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = now.strftime
    return env.from_string(source)


def _render(template: jinja2.Template, variables: Mapping[str, Any]) -> str:
    parts, n = [], 0
    for piece in template.generate(**variables):
        n += len(piece)
        if n > MAX_OUTPUT:
            raise OverflowError(f"its output exceeds {MAX_OUTPUT} characters")
        parts.append(piece)
    return "".join(parts)


def _handle(request: Mapping[str, Any], compiled: dict[tuple[str, str], jinja2.Template]) -> dict:
    """One request: compile (cached) and, when it has variables, render."""
    key = (request["source"], request["now"])
    try:
        template = compiled.get(key)
        if template is None:
            template = compile_template(request["source"], datetime.fromisoformat(request["now"]))
            if len(compiled) >= 8:
                del compiled[next(iter(compiled))]
            compiled[key] = template
        if request["vars"] is None:
            return {"text": ""}
        return {"text": _render(template, request["vars"])}
    except jinja2.TemplateSyntaxError as exc:
        error = f"chat template has a syntax error on line {exc.lineno}: {_one_line(exc.message or '')}"
    except SecurityError as exc:
        error = f"chat template refused: {_one_line(str(exc))}"
    except MemoryError:
        error = _stopped(f"it used more than {MAX_MEMORY >> 20} MiB of memory")
    except RecursionError:
        error = _stopped("it nests or recurses too deeply")
    except OverflowError as exc:
        error = _stopped(_one_line(str(exc)))
    except Exception as exc:  # noqa: BLE001 - a broken template in the file, not a bug here
        error = f"chat template failed: {type(exc).__name__}: {_one_line(str(exc))}"
    return {"error": error}


def _limit_resources(address_space: int) -> None:
    """Hard limits on this process: memory (where the OS enforces RLIMIT_AS), no byte
    written to any file, no core dumps."""
    try:
        import resource
    except ImportError:   # Windows: the parent's polling is the memory bound
        return
    for what, value in ((resource.RLIMIT_AS, address_space), (resource.RLIMIT_FSIZE, 0),
                        (resource.RLIMIT_CORE, 0)):
        hard = resource.getrlimit(what)[1]
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        try:
            resource.setrlimit(what, (value, value))
        except (ValueError, OSError):   # macOS refuses RLIMIT_AS: polling bounds memory there
            pass


def _serve(address_space: int) -> None:
    """The renderer's main loop: a reply on stdout for each request on stdin, until EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C stops a reply, not the renderer
    requests, replies = sys.stdin.buffer, os.fdopen(os.dup(1), "wb")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)   # nothing else can write into the replies
    _limit_resources(address_space)
    compiled: dict[tuple[str, str], jinja2.Template] = {}
    _send(replies, {"ready": True})
    while (request := _receive(requests, limit=None)) is not None:
        _send(replies, _handle(request, compiled))


def _send(pipe: BinaryIO, message: Mapping[str, Any]) -> None:
    body = json.dumps(message, ensure_ascii=False).encode("utf-8", "surrogatepass")
    pipe.write(len(body).to_bytes(8, "little") + body)
    pipe.flush()


def _receive(pipe: BinaryIO, limit: int | None) -> dict | None:
    """The next message, or None at end of file (or a frame over `limit` bytes)."""
    head = pipe.read(8)
    if len(head) < 8:
        return None
    n = int.from_bytes(head, "little")
    if limit is not None and n > limit:
        return None
    body = pipe.read(n)
    return json.loads(body.decode("utf-8", "surrogatepass")) if len(body) == n else None


# -- our side -----------------------------------------------------------------------------------

# Started without the package's __init__, which loads Numba (seconds); `-c` puts the
# working directory first on sys.path, where a stray jinja2.py must not be imported.
_BOOT = ("import sys, types\n"
         "if sys.path and sys.path[0] == '': del sys.path[0]\n"
         "pkg = types.ModuleType('edgellama'); pkg.__path__ = [{package!r}]\n"
         "sys.modules['edgellama'] = pkg\n"
         "from edgellama.chat_template import _serve; _serve({address_space})\n")


class _Renderer:
    """The renderer process: started on first use, and again after it was stopped."""

    def __init__(self):
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._ready = False
        self._replies: queue.SimpleQueue = queue.SimpleQueue()

    def start(self) -> None:
        """Start the renderer without waiting for it."""
        with self._lock:
            if self._proc is None:
                self._start()

    def request(self, message: Mapping[str, Any]) -> dict:
        """Send one request; its reply, within the limits."""
        try:
            body = json.dumps(message, ensure_ascii=False).encode("utf-8", "surrogatepass")
        except (TypeError, ValueError) as exc:
            raise EdgeError(f"chat messages must hold only strings, numbers, lists and "
                            f"dicts: {exc}") from None
        with self._lock:
            try:
                reply = self._exchange(len(body).to_bytes(8, "little") + body)
            except BaseException:
                # an error or Ctrl-C mid-request: a late reply must not answer the next one
                self._stop()
                raise
        if isinstance(reply, str):
            raise EdgeError(_stopped(reply))
        return reply

    def _exchange(self, frame: bytes) -> dict | str:
        for _ in range(2):
            if self._proc is None:
                self._start()
            if not self._ready:
                ready = self._wait(START_SECONDS)
                if not isinstance(ready, dict):
                    raise EdgeError(f"cannot start the chat template renderer ({sys.executable} "
                                    f"with jinja2): {ready}")
                self._ready = True
            try:
                self._proc.stdin.write(frame)
                self._proc.stdin.flush()
            except OSError:   # it died while idle (killed from outside): start another
                self._stop()
                continue
            return self._wait(LIMIT_SECONDS)
        raise EdgeError("the chat template renderer exits as soon as it starts")

    def _start(self) -> None:
        boot = _BOOT.format(package=str(Path(__file__).parent),
                            address_space=MAX_MEMORY + _INTERPRETER_SPACE)
        try:
            self._proc = subprocess.Popen([sys.executable, "-B", "-c", boot], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        except OSError as exc:
            raise EdgeError(f"cannot start the chat template renderer ({sys.executable}): "
                            f"{exc.strerror or exc}") from None
        self._ready = False
        self._replies = queue.SimpleQueue()
        threading.Thread(target=_read_replies, args=(self._proc.stdout, self._replies),
                         daemon=True).start()

    def _wait(self, seconds: float) -> dict | str:
        """The next reply; or, with the renderer stopped, what went wrong."""
        deadline = time.monotonic() + seconds
        while True:
            try:
                reply = self._replies.get(timeout=_POLL_SECONDS)
            except queue.Empty:
                if time.monotonic() > deadline:
                    self._stop()
                    return f"it ran for more than {seconds:g} s"
                rss = resident_memory(self._proc.pid)
                if rss is not None and rss > MAX_MEMORY:
                    self._stop()
                    return f"it used more than {MAX_MEMORY >> 20} MiB of memory"
                continue
            if reply is None:
                return f"the renderer exited (status {self._stop()})"
            return reply

    def _stop(self) -> int | None:
        """Kill the renderer, if there is one; its exit status."""
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        proc.kill()
        code = proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            with contextlib.suppress(OSError):
                pipe.close()
        return code

    def close(self) -> None:
        with self._lock:
            self._stop()

    def forget(self) -> None:
        """In a forked child: the renderer is the parent's; the child starts its own."""
        self._lock = threading.Lock()
        self._proc = None


def _read_replies(pipe: BinaryIO, replies: queue.SimpleQueue) -> None:
    while True:
        try:
            reply = _receive(pipe, limit=_MAX_FRAME)
        except (OSError, ValueError):
            reply = None
        replies.put(reply)
        if reply is None:
            return


_renderer = _Renderer()
atexit.register(_renderer.close)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_renderer.forget)


def start_renderer() -> None:
    """Start the renderer in the background: load() calls this first, so that Python and
    jinja2 start while the model loads."""
    _renderer.start()


def builtin_template(tokenizer: Tokenizer) -> str:
    """The template for a file without one, by the turn tokens its vocabulary has."""
    if tokenizer.is_llama3:
        return LLAMA3_TEMPLATE
    if {"<start_of_turn>", "<end_of_turn>"} <= tokenizer.special_tokens.keys():
        return GEMMA3_TEMPLATE
    return CHATML_TEMPLATE


class ChatFormat:
    """Turns a conversation into prompt token ids for one tokenizer and template."""

    def __init__(self, tokenizer: Tokenizer, template: str | None, now: datetime | None = None):
        self.tokenizer = tokenizer
        if template is not None and not isinstance(template, str):
            raise EdgeError(f"tokenizer.chat_template must be a string, got {type(template).__name__}")
        self.is_fallback = not template
        if template:
            self.source = template
        else:
            self.source = builtin_template(tokenizer)
        if len(self.source) > MAX_SOURCE:
            raise EdgeError(f"the chat template is {len(self.source)} characters long, more than "
                            f"the {MAX_SOURCE} allowed; the file's template is broken or hostile")
        self._now = (now or datetime.now()).isoformat()
        self._bos_text = "" if tokenizer.bos_id is None else tokenizer.tokens[tokenizer.bos_id]
        self._eos_text = "" if tokenizer.eos_id is None else tokenizer.tokens[tokenizer.eos_id]
        from edgellama.tokenizer import CONTROL   # here: the renderer never makes a ChatFormat
        by_length = sorted(tokenizer.special_tokens, key=len, reverse=True)
        self._special_re = re.compile("(" + "|".join(map(re.escape, by_length)) + ")") if by_length else None
        # Only control tokens are hidden from the template: user-defined ones (Qwen's
        # <think>, <tool_call>) are tokens in any text, and templates read them in past
        # turns (Qwen 3's drops an earlier reply's <think> block)
        control = [t for t in by_length
                   if tokenizer.token_types[tokenizer.special_tokens[t]] == CONTROL]
        self._control_re = (re.compile("(" + "|".join(map(re.escape, control)) + ")")
                            if control else None)
        self._kwargs: dict[str, Any] = {}
        self._run(None)   # compile now: a broken template fails at load, not at the first message

    @property
    def date(self) -> str:
        """The time strftime_now formats (ISO 8601), fixed when the format was made; a
        saved conversation keeps its own (prompt_cache.py), so that its prompt, and the
        cache of it, stay the same on another day."""
        return self._now

    @date.setter
    def date(self, value: str) -> None:
        self._now = datetime.fromisoformat(value).isoformat()   # ValueError if not a time

    @property
    def template_kwargs(self) -> dict[str, Any]:
        """Extra variables every render passes the template (llama.cpp's
        --chat-template-kwargs; Qwen 3 reads enable_thinking); set it to a dict or JSON
        text, checked by template_kwargs(). A render's own kwargs override these."""
        return dict(self._kwargs)

    @template_kwargs.setter
    def template_kwargs(self, value: str | Mapping[str, Any] | None) -> None:
        self._kwargs = template_kwargs(value)

    def _run(self, variables: Mapping[str, Any] | None) -> str:
        reply = _renderer.request({"source": self.source, "now": self._now, "vars": variables})
        if "error" in reply:
            raise EdgeError(reply["error"])
        return reply["text"]

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None,
               chat_template_kwargs: str | Mapping[str, Any] | None = None) -> str:
        """The template's text for `messages` (dicts with "role" and "content"); `tools`
        (OpenAI's function list) is passed as the template's `tools` variable;
        `chat_template_kwargs`, extra variables (checked by template_kwargs()), over the
        format's own template_kwargs."""
        return self._render_with(messages, add_generation_prompt, tools,
                                 self._kwargs | template_kwargs(chat_template_kwargs))

    def _render_with(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
                     tools: Sequence[Mapping[str, Any]] | None, extra: dict[str, Any]) -> str:
        """render, the extra variables checked."""
        variables = extra | {"messages": [dict(m) for m in messages],
                             "add_generation_prompt": bool(add_generation_prompt),
                             "bos_token": self._bos_text, "eos_token": self._eos_text}
        if tools is not None:
            variables["tools"] = [dict(t) for t in tools]
        return self._run(variables)

    def supports_tools(self) -> bool:
        """Whether the template shows a tool list to the model (renders a probe tool's
        name), as llama.cpp's server decides; a template that ignores `tools` would let
        the model answer without knowing them."""
        probe = "edgellama_probe_tool_7f3a"
        tool = {"type": "function", "function": {"name": probe, "description": "probe",
                                                 "parameters": {"type": "object", "properties": {}}}}
        try:
            return probe in self.render([{"role": "user", "content": "hi"}], tools=[tool])
        except EdgeError:
            return False

    def supports_parallel_tool_calls(self) -> bool:
        """Whether the template renders an assistant message holding two tool calls (Llama
        3.x's refuses: "This model only supports single tool-calls at once!")."""
        names = ("edgellama_probe_call_a", "edgellama_probe_call_b")
        calls = [{"id": str(i), "type": "function", "function": {"name": n, "arguments": {}}}
                 for i, n in enumerate(names)]
        messages = [{"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "", "tool_calls": calls}]
        try:
            text = self.render(messages)
        except EdgeError:
            return False
        return all(n in text for n in names)

    def encode_messages(self, messages: Sequence[Mapping[str, Any]],
                        add_generation_prompt: bool = True,
                        tools: Sequence[Mapping[str, Any]] | None = None,
                        chat_template_kwargs: str | Mapping[str, Any] | None = None) -> list[int]:
        """Prompt ids: control tokens from the template only, message text read as plain
        text (user-defined tokens in it are tokens); one BOS. chat_template_kwargs: as
        render's."""
        tok = self.tokenizer
        marker = f"\ue000{secrets.token_hex(8)}:"
        literals: list[str] = []

        def hide(match: re.Match) -> str:
            literals.append(match.group(0))
            return f"{marker}{len(literals) - 1}\ue001"

        def hide_all(v: Any) -> Any:
            """Every string in v, keys too: tool schemas and call arguments are the
            client's text as much as message content is."""
            if isinstance(v, str):
                return self._control_re.sub(hide, v)
            if isinstance(v, Mapping):
                return {hide_all(k): hide_all(x) for k, x in v.items()}
            if isinstance(v, (list, tuple)):
                return [hide_all(x) for x in v]
            return v

        extra = self._kwargs | template_kwargs(chat_template_kwargs)
        if self._control_re is not None:
            try:
                messages = [hide_all(dict(m)) for m in messages]
                tools = None if tools is None else hide_all(list(tools))
                extra = hide_all(extra)     # a client's text too, as messages are
            except RecursionError:
                raise EdgeError("the messages or tools nest too deeply") from None
        text = self._render_with(messages, add_generation_prompt, tools, extra)
        restore = re.compile(re.escape(marker) + r"(\d+)\ue001")
        ids: list[int] = []
        parts = self._special_re.split(text) if self._special_re is not None else [text]
        for k, part in enumerate(parts):
            if k % 2:
                ids.append(tok.special_tokens[part])
            elif part:
                ids += tok.encode(restore.sub(lambda m: literals[int(m.group(1))], part))
        if tok.add_bos and ids[:1] != [tok.bos_id]:
            ids.insert(0, tok.bos_id)
        return ids
