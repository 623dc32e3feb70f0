"""Fuzzing the whole load path with mutated GGUF files.

A tiny valid llama GGUF with tokenizer metadata and a chat template is mutated a few
thousand ways (seeded, deterministic): bit flips and byte overwrites in the header,
truncation at every section boundary, huge counts/lengths/dims/offsets, swapped type
ids, and structural edits (keys dropped, duplicated or retyped, tensor offsets shuffled,
NaN/inf weights, hostile, random and mutated chat templates...). Every file goes through `edgellama.load`, a 2-token forward,
sampling, a chat prompt and a short generation; each must either work or raise
EdgeError. Anything else is a bug in edgellama, reported with its traceback.

The loop runs in a child process with a capped address space (RLIMIT_AS), a per-case
alarm, and a per-case time limit, so a hang or a huge allocation is a failure, not a
stuck test run. Files that once found bugs live in tests/data/fuzz_seeds/ and are run
first.

    python tests/gguf/test_fuzz_gguf.py OUT_DIR [--save-failures]   # the child, by hand
"""
from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

TESTS = Path(__file__).parents[1]     # the shared helpers and data
SEEDS = TESTS / "data" / "fuzz_seeds"
SEED = 20240611
MEM_LIMIT = 4 << 30          # address space of the child (numba + numpy need ~1.5 GB)
CASE_SECONDS = 2.0           # slowest acceptable case
ALARM_SECONDS = 20           # a case still running after this is a hang

# -- a small structural model of a GGUF file ---------------------------------------
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
_FMT = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f",
        BOOL: "<B", U64: "<Q", I64: "<q", F64: "<d"}


@dataclass
class KV:
    key: str
    vtype: int
    value: object            # scalar, str, or (etype, list) for arrays


@dataclass
class TI:
    name: str
    dims: list[int]
    ttype: int
    offset: int


@dataclass
class Doc:
    version: int
    kvs: list[KV]
    tis: list[TI]
    data: bytes
    alignment: int = 32
    n_tensors: int | None = None     # override the header counts
    n_kv: int | None = None


@dataclass
class Layout:
    """Where each primitive of the serialized header lives: (offset, size, fmt, label)."""
    prims: list[tuple[int, int, str, str]] = field(default_factory=list)
    boundaries: list[int] = field(default_factory=list)   # section starts
    data_start: int = 0
    tensor_starts: list[int] = field(default_factory=list)


class _Out:
    def __init__(self):
        self.buf = bytearray()
        self.lay = Layout()

    def put(self, fmt: str, v, label: str):
        raw = struct.pack(fmt, v)
        self.lay.prims.append((len(self.buf), len(raw), fmt, label))
        self.buf += raw

    def string(self, s: str | bytes, label: str):
        b = s.encode("utf-8", "surrogatepass") if isinstance(s, str) else s
        self.put("<Q", len(b), f"len({label})")
        self.buf += b


def serialize(doc: Doc) -> tuple[bytes, Layout]:
    o = _Out()
    o.buf += b"GGUF"
    o.put("<I", doc.version, "version")
    o.put("<Q", len(doc.tis) if doc.n_tensors is None else doc.n_tensors, "n_tensors")
    o.put("<Q", len(doc.kvs) if doc.n_kv is None else doc.n_kv, "n_kv")
    for kv in doc.kvs:
        o.lay.boundaries.append(len(o.buf))
        o.string(kv.key, "key")
        o.put("<I", kv.vtype, f"vtype {kv.key}")
        if kv.vtype == ARR:
            etype, items = kv.value
            o.put("<I", etype, f"etype {kv.key}")
            o.put("<Q", len(items), f"count {kv.key}")
            for i, it in enumerate(items):
                if etype == STR:
                    o.string(it, f"{kv.key}[{i}]")
                else:
                    o.buf += struct.pack(_FMT[etype], it)
        elif kv.vtype == STR:
            o.string(kv.value, kv.key)
        else:
            o.put(_FMT[kv.vtype], kv.value, f"value {kv.key}")
    for t in doc.tis:
        o.lay.boundaries.append(len(o.buf))
        o.string(t.name, "tensor name")
        o.put("<I", len(t.dims), f"n_dims {t.name}")
        for d in t.dims:
            o.put("<Q", d, f"dim {t.name}")
        o.put("<I", t.ttype, f"type {t.name}")
        o.put("<Q", t.offset, f"offset {t.name}")
    o.lay.boundaries.append(len(o.buf))
    o.buf += b"\0" * (-len(o.buf) % doc.alignment)
    o.lay.data_start = len(o.buf)
    o.lay.tensor_starts = [o.lay.data_start + t.offset for t in doc.tis]
    o.buf += doc.data
    return bytes(o.buf), o.lay


def parse(raw: bytes) -> Doc:
    """Parse a trusted, valid GGUF (the base file) into a Doc."""
    pos = 0

    def take(fmt):
        nonlocal pos
        (v,) = struct.unpack_from(fmt, raw, pos)
        pos += struct.calcsize(fmt)
        return v

    def string():
        nonlocal pos
        n = take("<Q")
        pos += n
        return raw[pos - n:pos].decode()

    assert raw[:4] == b"GGUF"
    pos = 4
    version, n_t, n_kv = take("<I"), take("<Q"), take("<Q")
    kvs = []
    for _ in range(n_kv):
        key, vt = string(), take("<I")
        if vt == ARR:
            et, n = take("<I"), take("<Q")
            kvs.append(KV(key, vt, (et, [string() if et == STR else take(_FMT[et]) for _ in range(n)])))
        else:
            kvs.append(KV(key, vt, string() if vt == STR else take(_FMT[vt])))
    tis = []
    for _ in range(n_t):
        name, nd = string(), take("<I")
        dims = [take("<Q") for _ in range(nd)]
        tis.append(TI(name, dims, take("<I"), take("<Q")))
    start = -(-pos // 32) * 32
    return Doc(version, kvs, tis, raw[start:])


# -- random chat templates -----------------------------------------------------------
_LEAVES = ["messages", "messages[0]", "messages[0]['content']", "messages[-1].role", "'ab'", "'%s'",
           "'{}'", "[1, 2, 3]", "{'a': [1, 'b']}", "none", "true", "ns.v", "bos_token",
           "add_generation_prompt", "range(3)"]
_NUMBERS = ["0", "1", "-1", "2", "3", "messages|length"]
_HUGE = ["99999", "10**6", "10**9", "2**62"]
_FILTERS = ["indent({n})", "center({n})", "wordwrap({n})", "join({e})", "tojson(indent={n})", "tojson",
            "sum(start={e})", "list", "string", "length", "first", "last", "reverse", "sort",
            "unique", "batch({n})", "slice({n})", "replace('a', {e})", "format({e})", "trim",
            "upper", "truncate({n})", "map('string')", "select", "dictsort", "items", "int",
            "float", "abs", "round", "default({e})", "attr('role')", "pprint", "wordcount",
            "striptags", "urlize", "title", "xmlattr", "filesizeformat", "random", "min", "max"]
_OPERATORS = ["+", "-", "*", "/", "//", "%", "**", "~", "in", "==", "<", "and", "or"]


def random_templates(n: int, seed: int) -> list[str]:
    """Random, mostly well-formed chat templates: loops, conditions, macros and every
    jinja filter and operator, with arguments from tiny to huge."""
    rng = random.Random(seed)

    def num() -> str:
        return rng.choice(_HUGE if rng.random() < 0.15 else _NUMBERS)

    def expr(depth: int = 0) -> str:
        if depth > 3 or rng.random() < 0.3:
            return rng.choice(_LEAVES + _NUMBERS)
        kind = rng.randrange(5)
        if kind == 0:
            return f"({expr(depth + 1)} {rng.choice(_OPERATORS)} {expr(depth + 1)})"
        if kind == 1:
            f = rng.choice(_FILTERS).format(n=num(), e=expr(depth + 1))
            return f"({expr(depth + 1)} | {f})"
        if kind == 2:
            return f"{expr(depth + 1)}[{num()}]"
        if kind == 3:
            return f"('%*s' % ({num()}, {expr(depth + 1)}))"
        return f"[{expr(depth + 1)}] * {num()}"

    def block(depth: int = 0) -> str:
        kind = rng.randrange(6) if depth < 3 else 0
        if kind <= 1:
            return "{{ " + expr() + " }}"
        if kind == 2:
            return f"{{% for x in {expr()} %}}{block(depth + 1)}{{% endfor %}}"
        if kind == 3:
            return f"{{% if {expr()} %}}{block(depth + 1)}{{% else %}}{block(depth + 1)}{{% endif %}}"
        if kind == 4:
            return f"{{% set ns.v = {expr()} %}}{block(depth + 1)}"
        return f"{{% macro f(a) %}}{block(depth + 1)}{{{{ f(a) }}}}{{% endmacro %}}{{{{ f(1) }}}}"

    return ["{% set ns = namespace(v=1) %}" + "".join(block() for _ in range(rng.randint(1, 4)))
            for _ in range(n)]


def mutated_templates(source: str, n: int, seed: int):
    """Random edits of a real template: deleted, repeated and swapped pieces, and
    pieces of template syntax dropped in."""
    rng = random.Random(seed)
    bits = ["{{", "}}", "{%", "%}", "(", ")", "[", "]", "|", "~", "*", "**", "%", " 999999999 ",
            "range(99999)", "|tojson(indent=99999)", "|indent(99999)", "|center(99999)",
            "|wordwrap(1)", "|sum(start=[])", "messages", "loop", "for m in messages",
            "endfor", "if", "endif", "macro f()", "f()", "endmacro", "'", '"', "\\", "\x00", "\x1b"]
    for _ in range(n):
        s = source
        for _ in range(rng.randint(1, 2)):
            i, j = sorted(rng.randrange(len(s) + 1) for _ in range(2))
            op = rng.randrange(4)
            if op == 0:
                s = s[:i] + s[j:]
            elif op == 1:
                s = s[:j] + s[i:j] * rng.randint(2, 50) + s[j:]
            elif op == 2:
                s = s[:i] + rng.choice(bits) + s[i:]
            else:
                k = rng.randrange(len(s) + 1)
                s = s[:i] + s[k:] + s[i:k]
        yield s


# -- mutations ---------------------------------------------------------------------
def base_file(tmp: Path) -> bytes:
    sys.path.insert(0, str(TESTS))
    from tiny_gguf import TINY_VOCAB, write_tiny_gguf
    p = write_tiny_gguf(tmp / "base.gguf", "Q4_1", dim=32, layers=1, heads=2, kv_heads=1, ffn=32,
                        vocab=TINY_VOCAB, ctx=64, tied=False, embed_type="Q8_0", tokenizer=True)
    return p.read_bytes()


def _kv(doc: Doc, key: str) -> KV:
    return next(kv for kv in doc.kvs if kv.key == key)


def _set(doc: Doc, key: str, vtype: int, value) -> Doc:
    d = replace(doc, kvs=[replace(kv) for kv in doc.kvs])
    for kv in d.kvs:
        if kv.key == key:
            kv.vtype, kv.value = vtype, value
            return d
    d.kvs.append(KV(key, vtype, value))
    return d


def _drop(doc: Doc, key: str) -> Doc:
    return replace(doc, kvs=[kv for kv in doc.kvs if kv.key != key])


def _tensor_data(doc: Doc, name: str, fn) -> Doc:
    """Rewrite one tensor's bytes in place with fn(bytearray)."""
    data = bytearray(doc.data)
    tis = sorted(doc.tis, key=lambda t: t.offset)
    for t, nxt in zip(tis, tis[1:] + [None]):
        if t.name == name:
            end = nxt.offset if nxt else len(data)
            chunk = bytearray(data[t.offset:end])
            fn(chunk, t)
            data[t.offset:end] = chunk
    return replace(doc, data=bytes(data))


def semantic_cases(doc: Doc) -> list[tuple[str, Doc]]:
    cases: list[tuple[str, Doc]] = []
    add = cases.append
    vocab = len(_kv(doc, "tokenizer.ggml.tokens").value[1])
    for kv in doc.kvs:
        add((f"drop {kv.key}", _drop(doc, kv.key)))
        add((f"duplicate {kv.key}", replace(doc, kvs=doc.kvs + [kv])))
        for vt, v in ((STR, "12"), (F32, float("nan")), (I32, -1), (U64, 1 << 63), (U32, 0),
                      (BOOL, 1), (ARR, (U32, [1, 2])), (ARR, (STR, ["a"])), (F64, 1e308)):
            if (vt, v) != (kv.vtype, kv.value):
                add((f"{kv.key} as {vt}:{str(v)[:20]}", _set(doc, kv.key, vt, v)))
    for key in ("llama.block_count", "llama.embedding_length", "llama.feed_forward_length",
                "llama.attention.head_count", "llama.attention.head_count_kv", "llama.context_length",
                "llama.vocab_size", "llama.rope.dimension_count"):
        for v in (0, 1, 3, 7, 64, 1 << 31, (1 << 32) - 1):
            add((f"{key}={v}", _set(doc, key, U32, v)))
        for v in (1 << 40, (1 << 63) - 1):
            add((f"{key}={v}", _set(doc, key, U64, v)))
    for key in ("llama.attention.layer_norm_rms_epsilon", "llama.rope.freq_base"):
        for v in (0.0, -1.0, float("nan"), float("inf"), 1e-45, 1e30):
            add((f"{key}={v}", _set(doc, key, F32, v)))
    for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                "tokenizer.ggml.padding_token_id", "tokenizer.ggml.eot_token_id"):
        for v in (vocab, vocab + 1, (1 << 32) - 1):
            add((f"{key}={v}", _set(doc, key, U32, v)))
        add((f"{key}=-1", _set(doc, key, I32, -1)))
        add((f"{key}=str", _set(doc, key, STR, "1")))
    add(("general.alignment=0", _set(doc, "general.alignment", U32, 0)))
    add(("general.alignment=3", _set(doc, "general.alignment", U32, 3)))
    add(("general.alignment=64", _set(doc, "general.alignment", U32, 64)))
    add(("general.alignment=2^31", _set(doc, "general.alignment", U32, 1 << 31)))
    add(("general.architecture=gpt2", _set(doc, "general.architecture", STR, "gpt2")))
    add(("general.architecture=''", _set(doc, "general.architecture", STR, "")))
    add(("tokenizer.ggml.model=llama", _set(doc, "tokenizer.ggml.model", STR, "llama")))
    add(("tokenizer.ggml.pre=?", _set(doc, "tokenizer.ggml.pre", STR, "qwen2")))
    add(("tokenizer.ggml.pre=llama-bpe", _set(doc, "tokenizer.ggml.pre", STR, "llama-bpe")))
    add(("add_bos_token without bos", _set(_drop(doc, "tokenizer.ggml.bos_token_id"),
                                           "tokenizer.ggml.add_bos_token", BOOL, 1)))
    add(("add_bos_token=true", _set(doc, "tokenizer.ggml.add_bos_token", BOOL, 1)))
    toks = _kv(doc, "tokenizer.ggml.tokens").value[1]
    types = _kv(doc, "tokenizer.ggml.token_type").value[1]
    merges = _kv(doc, "tokenizer.ggml.merges").value[1]
    add(("tokens: one fewer", _set(doc, "tokenizer.ggml.tokens", ARR, (STR, toks[:-1]))))
    add(("tokens: one more", _set(doc, "tokenizer.ggml.tokens", ARR, (STR, toks + ["x"]))))
    add(("tokens: empty", _set(doc, "tokenizer.ggml.tokens", ARR, (STR, []))))
    add(("tokens: duplicates", _set(doc, "tokenizer.ggml.tokens", ARR, (STR, toks[:128] * 2 + toks[256:]))))
    add(("tokens: byte token replaced", _set(doc, "tokenizer.ggml.tokens", ARR, (STR, ["zz"] + toks[1:]))))
    add(("tokens: non-alphabet", _set(doc, "tokenizer.ggml.tokens", ARR, (STR, ["\u4e2d"] + toks[1:]))))
    add(("tokens: as u32", _set(doc, "tokenizer.ggml.tokens", ARR, (U32, list(range(len(toks)))))))
    add(("tokens: 100000 more", _set(_set(doc, "tokenizer.ggml.tokens", ARR, (STR, toks + ["x"] * 100000)),
                                     "tokenizer.ggml.token_type", ARR, (I32, types + [1] * 100000))))
    add(("specials: 300k characters", _set(doc, "tokenizer.ggml.tokens", ARR,
                                           (STR, toks[:-3] + ["<|" + c * 100000 + "|>" for c in "xyz"]))))
    add(("tokens: all the same special", _set(doc, "tokenizer.ggml.token_type", ARR, (I32, [3] * len(types)))))
    add(("token_type: short", _set(doc, "tokenizer.ggml.token_type", ARR, (I32, types[:-1]))))
    add(("token_type: as str", _set(doc, "tokenizer.ggml.token_type", ARR, (STR, ["1"] * len(types)))))
    add(("token_type: as f32", _set(doc, "tokenizer.ggml.token_type", ARR, (F32, [1.5] * len(types)))))
    add(("token_type: as u64 huge", _set(doc, "tokenizer.ggml.token_type", ARR, (U64, [1 << 63] * len(types)))))
    for bad in (0, 2, 4, 5, 6, 7, 99, -1):
        add((f"token_type: all {bad}", _set(doc, "tokenizer.ggml.token_type", ARR, (I32, [bad] * len(types)))))
        add((f"token_type: specials {bad}", _set(doc, "tokenizer.ggml.token_type", ARR,
                                                 (I32, types[:256] + [bad] * (len(types) - 256)))))
    add(("merges: as u32", _set(doc, "tokenizer.ggml.merges", ARR, (U32, [1, 2]))))
    for bad in (["a b c"], ["ab"], ["q z"], ["Ġ t", "Ġ t"], [""], [" "], ["h e"] * 3, ["<|im_end|> a"],
                merges[::-1], ["Ġt he", "Ġ t"]):
        add((f"merges: {bad[:2]}", _set(doc, "tokenizer.ggml.merges", ARR, (STR, bad))))
    tmpl = "tokenizer.chat_template"
    for t in ("", "{% for", "{{ raise_exception('no') }}", "{{ messages.__class__ }}",
              "{{ ''.__class__.__mro__[1].__subclasses__() }}", "{{ cycler.__init__.__globals__ }}",
              "{% for i in range(10**9) %}x{% endfor %}", "{{ 'a' * 10**10 }}", "{{ 10 ** 10 ** 10 }}",
              "{{ [1] * 10**10 }}", "{{ undefined_thing.attr }}", "{{ messages[5]['content'] }}",
              "{% for m in messages %}{{ m.content|center(10**10) }}{% endfor %}",
              "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
              "{% endfor %}{{ ns.s|length }}",
              "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
              "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
              # work inside one filter or operator call
              "{{ ('x\n' * 100000) | indent(1000000) }}", "{{ ('x' * 1000000) | wordwrap(1) }}",
              "{{ ([[1] * 1000] * 1000) | tojson(indent=1000000) }}",
              "{{ ([[1]] * 16000000) | sum(start=[]) }}", "{{ '%*d' % (10**9, 1) }}",
              "{{ [[[1] * 1000] * 1000] * 1000 }}", "{{ (['x' * 10**6] * 1000) | join('y' * 10**6) }}",
              "{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", "x" * (10 << 20)):
        add((f"template {t[:40]!r}", _set(doc, tmpl, STR, t)))
    for i, t in enumerate(random_templates(60, SEED)):
        add((f"random template {i}: {t[:60]!r}", _set(doc, tmpl, STR, t)))
    for i, t in enumerate(mutated_templates(_kv(doc, tmpl).value, 40, SEED)):
        add((f"mutated template {i}: {t[:60]!r}", _set(doc, tmpl, STR, t)))
    add(("template: array", _set(doc, tmpl, ARR, (STR, ["x"]))))
    add(("template: u32", _set(doc, tmpl, U32, 1)))
    add(("sampling temp nan", _set(doc, "general.sampling.temp", F32, float("nan"))))
    add(("sampling top_k str", _set(doc, "general.sampling.top_k", STR, "40")))
    add(("sampling top_p 2", _set(doc, "general.sampling.top_p", F32, 2.0)))
    add(("sampling top_k huge", _set(doc, "general.sampling.top_k", U64, 1 << 63)))

    # tensors
    tis = doc.tis
    offs = [t.offset for t in tis]
    rng = random.Random(SEED)
    for k in range(12):
        sh = offs[:]
        rng.shuffle(sh)
        add((f"tensor offsets shuffled {k}", replace(doc, tis=[replace(t, offset=o) for t, o in zip(tis, sh)])))
    for i in range(len(tis)):
        t = tis[i]
        others = tis[:i] + tis[i + 1:]
        add((f"drop tensor {t.name}", replace(doc, tis=others)))
        add((f"duplicate tensor {t.name}", replace(doc, tis=tis + [t])))
        add((f"rename tensor {t.name}", replace(doc, tis=others[:i] + [replace(t, name=t.name + "x")] + others[i:])))
        for j in (0, len(tis) - 1, (i + 1) % len(tis)):
            if j != i:
                add((f"tensor {t.name} offset = {tis[j].name}'s",
                     replace(doc, tis=[replace(x, offset=tis[j].offset) if x is t else x for x in tis])))
        for tt in (0, 1, 2, 3, 6, 8, 10, 12, 14, 24, 30, 39, 1000):
            if tt != t.ttype:
                add((f"tensor {t.name} type {tt}", replace(doc, tis=[replace(x, ttype=tt) if x is t else x for x in tis])))
        for dims in (t.dims[::-1], [t.dims[0]], t.dims + [1], t.dims + [2], [0] + t.dims[1:],
                     [t.dims[0] * 2] + t.dims[1:], [t.dims[0]] + [1 << 40] * (len(t.dims) - 1),
                     [1 << 62, 4], [1] * 5, []):
            if dims != t.dims:
                add((f"tensor {t.name} dims {dims}", replace(doc, tis=[replace(x, dims=list(dims)) if x is t else x for x in tis])))
    # swap type ids between tensors
    for k in range(10):
        i, j = rng.sample(range(len(tis)), 2)
        new = [replace(t) for t in tis]
        new[i].ttype, new[j].ttype = tis[j].ttype, tis[i].ttype
        add((f"swap types {tis[i].name} {tis[j].name}", replace(doc, tis=new)))
    add(("tensor count +1", replace(doc, n_tensors=len(tis) + 1)))
    add(("tensor count -1", replace(doc, n_tensors=len(tis) - 1)))
    add(("kv count +1", replace(doc, n_kv=len(doc.kvs) + 1)))
    add(("kv count -1", replace(doc, n_kv=len(doc.kvs) - 1)))
    add(("version 1", replace(doc, version=1)))
    add(("version 2", replace(doc, version=2)))
    add(("version 4", replace(doc, version=4)))
    add(("no tensors", replace(doc, tis=[], data=b"")))
    add(("no metadata", replace(doc, kvs=[])))

    # NaN / inf weights (must not crash; logits may be garbage)
    import numpy as np

    def fill(value, dtype):
        def fn(chunk, t):
            a = np.frombuffer(chunk, dtype)
            a = np.full(a.shape, value, dtype)
            chunk[:len(a.tobytes())] = a.tobytes()
        return fn

    def q_scales(value, block):
        def fn(chunk, t):
            for o in range(0, len(chunk) - block + 1, block):
                chunk[o:o + 2] = np.float16(value).tobytes()
        return fn

    for name in ("output_norm.weight", "blk.0.attn_norm.weight", "blk.0.ffn_norm.weight"):
        for v in (float("nan"), float("inf"), 0.0, 1e38):
            add((f"{name} all {v}", _tensor_data(doc, name, fill(v, np.float32))))
    for name, block in (("token_embd.weight", 34), ("output.weight", 34), ("blk.0.attn_q.weight", 20),
                        ("blk.0.ffn_down.weight", 20)):
        for v in (float("nan"), float("inf"), -float("inf"), 65504.0):
            add((f"{name} scales {v}", _tensor_data(doc, name, q_scales(v, block))))
    add(("rope_freqs nan", _tensor_data(doc, "rope_freqs.weight", fill(float("nan"), np.float32))))
    add(("rope_freqs 0", _tensor_data(doc, "rope_freqs.weight", fill(0.0, np.float32))))
    add(("rope_freqs 1e-30", _tensor_data(doc, "rope_freqs.weight", fill(1e-30, np.float32))))
    return cases


def byte_cases(raw: bytes, lay: Layout, n_flip: int, n_over: int) -> list[tuple[str, bytes]]:
    rng = random.Random(SEED + 1)
    size, hdr = len(raw), lay.data_start
    cases: list[tuple[str, bytes]] = []
    for k in range(n_flip):
        b = bytearray(raw)
        bits = [rng.randrange(hdr * 8) for _ in range(rng.choice((1, 1, 2, 3, 4)))]
        for bit in bits:
            b[bit // 8] ^= 1 << (bit % 8)
        cases.append((f"bitflip {bits}", bytes(b)))
    for k in range(n_over):
        b = bytearray(raw)
        where = []
        for _ in range(rng.choice((1, 2, 4, 8))):
            pos = rng.randrange(hdr)
            b[pos] = rng.choice((0, 0xFF, 0x7F, 0x80, rng.randrange(256)))
            where.append(pos)
        cases.append((f"overwrite {where}", bytes(b)))
    # a few flips in the tensor data too (garbage weights must still run)
    for k in range(40):
        b = bytearray(raw)
        for _ in range(8):
            pos = rng.randrange(hdr, size)
            b[pos] = rng.randrange(256)
        cases.append((f"data overwrite {k}", bytes(b)))
    # truncation at every section boundary and primitive, and one byte either side
    cuts = set(lay.boundaries) | {lay.data_start, size - 1, 0, 3, 4, 8, 16, 23, 24}
    cuts |= set(lay.tensor_starts)
    prim_starts = [p[0] for p in lay.prims]
    cuts |= set(prim_starts[:: max(1, len(prim_starts) // 150)])
    for c in sorted(cuts):
        for d in (-1, 0, 1):
            if 0 <= c + d < size:
                cases.append((f"truncate at {c + d}", raw[:c + d]))
    # every u64 / u32 primitive set to extreme values
    big = [0, 1, 2, 1 << 63, (1 << 64) - 1, 1 << 40, 1 << 32, (1 << 31) + 1, size + 1, size, size - 1]
    u32s = list(range(0, 14)) + [24, 30, 31, 0x7FFFFFFF, 0xFFFFFFFF]
    for off, n, fmt, label in lay.prims:
        is_array_item = "[" in label
        if is_array_item and rng.random() > 0.05:
            continue
        orig = struct.unpack_from(fmt, raw, off)[0]
        if fmt == "<Q":
            values = big + [orig + 1, max(orig - 1, 0), orig * 2]
        elif fmt == "<I":
            values = u32s if ("type" in label or "n_dims" in label) else [0, 1, 2, 0xFFFFFFFF, orig + 1, 1 << 31]
        else:
            continue
        for v in dict.fromkeys(values):
            if v != orig and v < (1 << (8 * n)):
                b = bytearray(raw)
                struct.pack_into(fmt, b, off, v)
                cases.append((f"{label} = {v}", bytes(b)))
    return cases


# -- the child: run every case -----------------------------------------------------
def run_one(path: Path) -> str:
    import numpy as np

    import edgellama
    from edgellama.errors import EdgeError
    from edgellama.sampling import Sampler, SamplingParams
    try:
        llm = edgellama.load(path, ctx=32, threads=1)
    except EdgeError:
        return "refused"
    try:
        V = llm.model.args.vocab_size
        logits = llm.model.forward([0, min(1, V - 1)], llm.seq)
        for temp in (0.0, 0.8):
            tok = Sampler(SamplingParams(temperature=temp, seed=0))(logits, [0, 1])
            llm.tokenizer.decode([tok])
        llm.reset()
        # a text past the tokenizer's long-text limit: cut, whole-piece BPE of a long
        # whitespace run, special tokens found across cuts, all on a mutated vocabulary
        long_text = "hi " + " " * 20_000 + "ab1.'s" * 2500 + "<|im_end|>\n"
        llm.tokenizer.encode(long_text)
        llm.tokenizer.encode_special(long_text)
        ids = llm.chat.encode_messages([{"role": "user", "content": "hello the world"}])
        out = list(llm.generate(ids, max_tokens=3, sampling=SamplingParams(temperature=0.8, seed=1)))
        llm.tokenizer.decode(out)
        np.asarray(out)
    except EdgeError:
        return "loaded, then refused"
    return "ok"


def child(out_dir: Path, save_failures: bool) -> None:
    import resource
    import signal
    import traceback
    resource.setrlimit(resource.RLIMIT_AS, (MEM_LIMIT, MEM_LIMIT))

    def on_alarm(signum, frame):
        raise TimeoutError(f"case still running after {ALARM_SECONDS} s")
    signal.signal(signal.SIGALRM, on_alarm)

    raw = base_file(out_dir)
    doc = parse(raw)
    raw2, lay = serialize(doc)
    assert raw2 == raw, "the test's GGUF serializer does not round-trip the base file"
    cases: list[tuple[str, bytes]] = [(f"seed {p.name}", p.read_bytes()) for p in sorted(SEEDS.glob("*.gguf"))]
    cases.append(("base file", raw))
    cases += [(name, serialize(d)[0]) for name, d in semantic_cases(doc)]
    cases += byte_cases(raw, lay, n_flip=700, n_over=350)

    import edgellama  # noqa: F401  (import time is not a case's time)
    from edgellama import chat_template
    chat_template.LIMIT_SECONDS = 0.5   # a hostile template's case stays under CASE_SECONDS
    results = {"cases": len(cases), "outcomes": {}, "failures": [], "slow": []}
    path = out_dir / "case.gguf"
    t_all = time.perf_counter()
    for i, (name, data) in enumerate(cases):
        if path.exists():
            path.unlink()
        path.write_bytes(data)
        t0 = time.perf_counter()
        signal.alarm(ALARM_SECONDS)
        try:
            outcome = run_one(path)
        except BaseException as e:  # noqa: BLE001 - every non-EdgeError is a finding
            if isinstance(e, KeyboardInterrupt):
                raise
            outcome = "BUG"
            results["failures"].append({"case": name, "error": f"{type(e).__name__}: {e}"[:300],
                                        "traceback": traceback.format_exc()[-2500:]})
            if save_failures:
                (out_dir / f"fail_{i:04d}.gguf").write_bytes(data)
        finally:
            signal.alarm(0)
        dt = time.perf_counter() - t0
        if dt > CASE_SECONDS and outcome != "BUG":
            # the first use of a weight type may JIT-compile (or load) kernels: time it again
            t0 = time.perf_counter()
            signal.alarm(ALARM_SECONDS)
            try:
                run_one(path)
            except Exception:  # noqa: BLE001 - the first run already classified it
                pass
            finally:
                signal.alarm(0)
            dt = time.perf_counter() - t0
            if dt > CASE_SECONDS:
                results["slow"].append({"case": name, "seconds": round(dt, 2)})
        results["outcomes"][outcome] = results["outcomes"].get(outcome, 0) + 1
    results["seconds"] = round(time.perf_counter() - t_all, 1)
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))


# -- the test ----------------------------------------------------------------------
def test_fuzz_load(tmp_path):
    env = dict(os.environ, NUMBA_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, __file__, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=600)
    res_path = tmp_path / "results.json"
    assert proc.returncode == 0 and res_path.exists(), proc.stderr[-3000:]
    res = json.loads(res_path.read_text())
    print(f"fuzz: {res['cases']} cases in {res['seconds']} s: {res['outcomes']}")
    report = "\n\n".join(f"{f['case']}: {f['error']}\n{f['traceback']}" for f in res["failures"][:5])
    kinds = sorted({f["error"].split(":")[0] + " @ " + f["traceback"].strip().splitlines()[-3].strip()
                    for f in res["failures"]})
    assert not res["failures"], (f"{len(res['failures'])} of {res['cases']} mutated files raised "
                                 f"something other than EdgeError:\n" + "\n".join(kinds) + "\n\n" + report)
    assert not res["slow"], f"cases slower than {CASE_SECONDS} s: {res['slow'][:10]}"
    assert res["cases"] >= 2000
    assert res["outcomes"].get("ok", 0) > 50     # the mutations do not all break the file
    assert res["outcomes"].get("refused", 0) > 1000


def test_seed_corpus_is_small():
    seeds = sorted(SEEDS.glob("*.gguf"))
    assert seeds, "tests/data/fuzz_seeds/ holds the files that once found bugs"
    assert all(p.stat().st_size < 64 << 10 for p in seeds)


if __name__ == "__main__":
    child(Path(sys.argv[1]), "--save-failures" in sys.argv)
