"""Convert given hostile input (issue: hostile input, the convert half): every value of
config.json, generation_config.json, tokenizer.json and tokenizer_config.json checked for
type and range (one `error:` line naming file and key, never `internal error`), nothing
written that our own loader would refuse, the output never one of the inputs, a temp file
that cannot be hijacked, no silent replacement by a concurrent convert, stale temp files
of killed converts cleaned up, and a bounded fuzzer over the JSON files and the
safetensors header. Uses a tiny synthetic tokenizer (320 tokens) so each convert is fast."""
from __future__ import annotations

import json
import os
import random
import struct
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

import edgellama.quant.convert as qconvert
from edgellama.bytelevel import bytes_to_token
from edgellama.cli.main import main
from edgellama.errors import EdgeError
from edgellama.llm import load
from hf_fixtures import _PRE, LLAMA3_TEMPLATE, write_tiny_llama

VOCAB = 320


def write_tiny_tokenizer(d: Path) -> None:
    """A byte-level BPE tokenizer.json (256 bytes + 60 merges + 4 specials) and configs."""
    vocab = {bytes_to_token(bytes([b])): b for b in range(256)}
    merges, n = [], 256
    for a in b"etaoinshr":
        for b in b"etaoin":
            if n >= 316:
                break
            tok = bytes_to_token(bytes([a, b]))
            if tok not in vocab:
                vocab[tok] = n
                merges.append(f"{bytes_to_token(bytes([a]))} {bytes_to_token(bytes([b]))}")
                n += 1
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>"]
    added = [{"id": 316 + i, "content": c, "special": True} for i, c in enumerate(specials)]
    tj = {"version": "1.0", "added_tokens": added, "pre_tokenizer": _PRE["llama-bpe"],
          "post_processor": {"type": "TemplateProcessing",
                             "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                                        {"Sequence": {"id": "A", "type_id": 0}}]},
          "model": {"type": "BPE", "vocab": vocab, "merges": merges}}
    (d / "tokenizer.json").write_text(json.dumps(tj))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "add_bos_token": True,
         "chat_template": LLAMA3_TEMPLATE}))
    (d / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 316, "eos_token_id": [317, 318], "temperature": 0.6, "top_p": 0.9, "top_k": 40}))


def tiny_checkpoint(d: Path) -> Path:
    write_tiny_llama(d, hidden=32, heads=2, kv_heads=1, layers=1, ffn=64, vocab=VOCAB, tokenizer=None)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(bos_token_id=316, eos_token_id=318)
    (d / "config.json").write_text(json.dumps(cfg))
    write_tiny_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("pristine") / "hf")


@pytest.fixture()
def hf(pristine, tmp_path) -> Path:
    d = tmp_path / "hf"
    d.mkdir()
    for f in pristine.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    return d


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_user_error(res, *needles):
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.exit_code == 1, (res.exit_code, res.stderr, res.exception)
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert "Traceback" not in res.stderr and "internal error" not in res.stderr, res.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


def edit_json(path: Path, **changes):
    data = json.loads(path.read_text())
    for k, v in changes.items():
        if v is _DELETE:
            data.pop(k, None)
        else:
            data[k] = v
    path.write_text(json.dumps(data))


_DELETE = object()


def test_tiny_checkpoint_converts_and_loads(hf, tmp_path):
    out = tmp_path / "out" / "m.gguf"
    out.parent.mkdir()
    res = invoke("convert", hf, "-o", out, "--quiet", "--type", "f32")
    assert res.exit_code == 0, res.output
    llm = load(out, ctx=32)
    assert llm.tokenizer.decode(llm.tokenizer.encode("the cat")) == "the cat"
    assert [p.name for p in out.parent.iterdir()] == ["m.gguf"]


# -- every value checked for type and range -----------------------------------------
CONFIG = "config.json"
GEN = "generation_config.json"
TOK = "tokenizer.json"
TCFG = "tokenizer_config.json"

VALUE_CASES = {
    "ctx_2^32": (CONFIG, {"max_position_embeddings": 2 ** 32}, ["max_position_embeddings", "4294967295"]),
    "ctx_float": (CONFIG, {"max_position_embeddings": 1.5}, ["max_position_embeddings", "integer"]),
    "ctx_string": (CONFIG, {"max_position_embeddings": "8192"}, ["max_position_embeddings"]),
    "ctx_huge_int": (CONFIG, {"max_position_embeddings": 10 ** 300}, ["max_position_embeddings"]),
    "theta_1e39": (CONFIG, {"rope_theta": 1e39}, ["rope_theta", "number in"]),
    "theta_tiny": (CONFIG, {"rope_theta": 1e-50}, ["rope_theta"]),
    "theta_list": (CONFIG, {"rope_theta": [1]}, ["rope_theta"]),
    "eps_5": (CONFIG, {"rms_norm_eps": 5}, ["rms_norm_eps", "(0, 1)"]),
    "eps_0": (CONFIG, {"rms_norm_eps": 0}, ["rms_norm_eps"]),
    "eps_missing": (CONFIG, {"rms_norm_eps": _DELETE}, ["rms_norm_eps", "missing"]),
    "layers_huge": (CONFIG, {"num_hidden_layers": 2 ** 31}, ["num_hidden_layers", "layer tensors"]),
    "layers_neg": (CONFIG, {"num_hidden_layers": -1}, ["num_hidden_layers"]),
    "heads_bool": (CONFIG, {"num_attention_heads": True}, ["num_attention_heads"]),
    "head_dim_odd_mismatch": (CONFIG, {"head_dim": 8}, ["head_dim", "hidden_size"]),
    "tied_string": (CONFIG, {"tie_word_embeddings": "yes"}, ["tie_word_embeddings"]),
    "rope_scaling_list": (CONFIG, {"rope_scaling": [1, 2]}, ["rope_scaling"]),
    "rope_scaling_inf": (CONFIG, {"rope_scaling": {"rope_type": "llama3", "factor": 1e39, "low_freq_factor": 1,
                                                   "high_freq_factor": 4,
                                                   "original_max_position_embeddings": 8192}},
                         ["rope_scaling.factor"]),
    "rope_scaling_equal": (CONFIG, {"rope_scaling": {"rope_type": "llama3", "factor": 8, "low_freq_factor": 4,
                                                     "high_freq_factor": 4,
                                                     "original_max_position_embeddings": 8192}},
                           ["low_freq_factor", "high_freq_factor"]),
    "config_eos_string": (CONFIG, {"eos_token_id": "x"}, []),    # taken from tokenizer_config first
    "config_bos_dict": (CONFIG, {"bos_token_id": {"a": 1}}, []),
    "top_k_2^40": (GEN, {"top_k": 2 ** 40}, [GEN, "top_k", "2147483647"]),
    "top_k_neg": (GEN, {"top_k": -1}, [GEN, "top_k"]),
    "top_p_5": (GEN, {"top_p": 5}, [GEN, "top_p", "top-p must be in (0, 1]"]),
    "top_p_0": (GEN, {"top_p": 0}, [GEN, "top_p"]),
    "min_p_2": (GEN, {"min_p": 2}, [GEN, "min_p"]),
    "temp_1e39": (GEN, {"temperature": 1e39}, [GEN, "temperature"]),
    "temp_string": (GEN, {"temperature": "0.6"}, [GEN, "temperature"]),
    "gen_eos_string": (GEN, {"eos_token_id": "x"}, []),           # not consulted: tokenizer_config has it
    "model_list": (TOK, {"model": []}, [TOK, "'model'"]),
    "model_missing": (TOK, {"model": _DELETE}, [TOK, "'model'"]),
    "pre_tokenizer_list": (TOK, {"pre_tokenizer": []}, [TOK, "pre_tokenizer"]),
    "pre_tokenizer_seq_dict": (TOK, {"pre_tokenizer": {"type": "Sequence", "pretokenizers": {}}},
                               [TOK, "pretokenizers"]),
    "pre_tokenizer_items": (TOK, {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [1, 2]}},
                            [TOK, "pretokenizers[0]"]),
    "added_dict": (TOK, {"added_tokens": {"a": 1}}, [TOK, "added_tokens"]),
    "added_neg_id": (TOK, {"added_tokens": [{"id": -1, "content": "<|x|>"}]}, [TOK, "added token"]),
    "post_processor_junk": (TOK, {"post_processor": {"type": "TemplateProcessing", "single": [1, 2]}}, []),
    "post_processors_str": (TOK, {"post_processor": {"processors": "x"}}, []),
    "bos_token_list": (TCFG, {"bos_token": [1]}, [TCFG, "bos_token"]),
    "bos_content_int": (TCFG, {"bos_token": {"content": 5}}, [TCFG, "bos_token"]),
    "add_bos_string": (TCFG, {"add_bos_token": "true"}, [TCFG, "add_bos_token"]),
    "chat_template_int": (TCFG, {"chat_template": 5}, [TCFG, "chat_template"]),
    "tcfg_list": (TCFG, None, [TCFG, "JSON object"]),
}


def _model_edit(hf: Path, **changes):
    tj = json.loads((hf / TOK).read_text())
    tj["model"].update(changes)
    (hf / TOK).write_text(json.dumps(tj))


MODEL_CASES = {
    "merges_dict": (dict(merges={"a": "b"}), ["model.merges", "list"]),
    "merges_mixed": (dict(merges=["a b", ["a", "b"]]), ["model.merges"]),
    "merges_ints": (dict(merges=[1, 2]), ["model.merges"]),
    "merges_triples": (dict(merges=[["a", "b", "c"]]), ["model.merges"]),
    "vocab_list": (dict(vocab=["a"]), ["model.vocab"]),
    "vocab_str_id": (dict(vocab={"a": "1"}), ["model.vocab", "'a'"]),
    "vocab_float_id": (dict(vocab={"a": 1.5}), ["model.vocab"]),
    "vocab_neg_id": (dict(vocab={"a": -3}), ["model.vocab"]),
    "vocab_big_id": (dict(vocab={"a": 2 ** 40}), ["beyond the model's vocab_size"]),
    "vocab_dup_id": (dict(vocab={"a": 1, "b": 1}), ["model.vocab", "both"]),
    "type_list": (dict(type=["BPE"]), ["model.type"]),
}


def _check_case(hf, tmp_path, needles):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    res = invoke("convert", hf, "-o", out_dir / "m.gguf", "--type", "f32")
    if not needles:        # the value is not needed: success, and the file loads
        assert res.exit_code == 0, res.stderr
        load(out_dir / "m.gguf", ctx=16)
        return
    assert_user_error(res, *needles)
    assert list(out_dir.iterdir()) == []


@pytest.mark.parametrize("case", list(VALUE_CASES))
def test_json_values_checked(hf, tmp_path, case):
    fname, changes, needles = VALUE_CASES[case]
    if changes is None:
        (hf / fname).write_text("[1, 2]")
    else:
        edit_json(hf / fname, **changes)
    _check_case(hf, tmp_path, needles)


@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_tokenizer_model_shapes_checked(hf, tmp_path, case):
    changes, needles = MODEL_CASES[case]
    _model_edit(hf, **changes)
    _check_case(hf, tmp_path, [TOK, *needles])


@pytest.mark.parametrize("text, needle", [
    ('{"a": NaN}', "NaN"), ('{"a": Infinity}', "Infinity"), ('{"a": ' + "9" * 5000 + "}", "not valid JSON"),
    ("[" * 100_000 + "]" * 100_000, "not valid JSON"), ('{"a": 1', "not valid JSON"),
])
def test_unparseable_json(hf, tmp_path, text, needle):
    (hf / CONFIG).write_text(text)
    _check_case(hf, tmp_path, [CONFIG, needle])


def test_json_fifo_does_not_hang(hf, tmp_path):
    (hf / TCFG).unlink()
    os.mkfifo(hf / TCFG)
    _check_case(hf, tmp_path, [TCFG, "not a regular file"])


# -- the output file ---------------------------------------------------------------
@pytest.mark.parametrize("how", ["same", "symlink", "hardlink", "dir"])
def test_output_is_never_an_input(hf, tmp_path, how):
    victim = hf / "model.safetensors"
    before = victim.read_bytes()
    out = {"same": victim, "symlink": tmp_path / "link.gguf", "hardlink": tmp_path / "hard.gguf",
           "dir": hf}[how]
    if how == "symlink":
        out.symlink_to(victim)
    elif how == "hardlink":
        os.link(victim, out)
    if how == "dir":        # the CLI refuses a directory as a usage error; the API too
        with pytest.raises(EdgeError, match="is the input"):
            qconvert.convert(hf, out, force=True)
    else:
        res = invoke("convert", hf, "-o", out, "--force", "--quiet")
        assert_user_error(res, "is the input", "--force does not allow")
    assert victim.read_bytes() == before
    assert not [p for p in hf.iterdir() if p.name.endswith(".tmp")]


def test_temp_name_is_unpredictable_and_never_followed(hf, tmp_path, monkeypatch):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    # the old predictable name is not used
    (out_dir / f".m.gguf.{os.getpid()}.tmp").symlink_to(victim)
    qconvert.convert(hf, out_dir / "m.gguf", qtype="f32")
    assert victim.read_text() == "precious"
    # a symlink planted at the exact temp name (here predicted by fixing the random part)
    # is refused, not followed, and left alone
    monkeypatch.setattr(qconvert.secrets, "token_hex", lambda n: "ab" * n)
    planted = out_dir / f".n.gguf.edgellama-{os.getpid()}-{'ab' * 8}.tmp"
    planted.symlink_to(victim)
    with pytest.raises(FileExistsError):
        qconvert.convert(hf, out_dir / "n.gguf", qtype="f32")
    assert victim.read_text() == "precious" and planted.is_symlink()
    assert not (out_dir / "n.gguf").exists()


def test_long_output_name(hf, tmp_path):
    out = tmp_path / ("m" * 245 + ".gguf")        # 250 bytes: legal
    res = invoke("convert", hf, "-o", out, "--quiet", "--type", "f32")
    assert res.exit_code == 0, res.stderr
    assert out.read_bytes()[:4] == b"GGUF"
    assert [p.name for p in tmp_path.iterdir() if p != hf] == [out.name]


@pytest.mark.parametrize("noreplace", ["renameat2", "link"])
def test_concurrent_convert_is_not_silently_replaced(hf, tmp_path, monkeypatch, noreplace):
    if noreplace == "link":
        monkeypatch.setattr(qconvert, "_renameat2", lambda: None)
    out = tmp_path / "out" / "m.gguf"
    out.parent.mkdir()

    def other_convert_finishes(name, done, total):
        if done == total and not out.exists():
            out.write_bytes(b"the other convert's file")

    with pytest.raises(EdgeError, match="appeared while converting"):
        qconvert.convert(hf, out, qtype="f32", progress=other_convert_finishes)
    assert out.read_bytes() == b"the other convert's file"
    assert [p.name for p in out.parent.iterdir()] == ["m.gguf"]
    # --force replaces it, as asked
    qconvert.convert(hf, out, qtype="f32", force=True)
    assert out.read_bytes()[:4] == b"GGUF"


def _dead_pid() -> int:
    import subprocess
    import sys
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_temps_of_killed_converts_are_cleaned(hf, tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    dead, old = _dead_pid(), time.time() - 3600
    names = {"stale": f".m.gguf.edgellama-{dead}-{'0' * 16}.tmp",
             "fresh": f".m.gguf.edgellama-{dead}-{'1' * 16}.tmp",
             "live": f".m.gguf.edgellama-{os.getpid()}-{'2' * 16}.tmp",
             "not_ours": f".m.gguf.{dead}.tmp",
             "link": f".x.edgellama-{dead}-{'3' * 16}.tmp"}
    for kind, n in names.items():
        if kind == "link":
            (out_dir / n).symlink_to(hf / "config.json")
            continue
        (out_dir / n).write_bytes(b"x")
        if kind != "fresh":
            os.utime(out_dir / n, (old, old))
    qconvert.convert(hf, out_dir / "m.gguf", qtype="f32")
    left = {p.name for p in out_dir.iterdir()}
    assert names["stale"] not in left
    assert {names[k] for k in ("fresh", "live", "not_ours", "link")} <= left


def test_sigkilled_convert_leaves_a_temp_the_next_one_removes(hf, tmp_path):
    import signal
    import subprocess
    import sys
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    code = ("import time, edgellama.quant.convert as c\n"
            f"c.convert({str(hf)!r}, {str(out_dir / 'm.gguf')!r}, qtype='f32', "
            "progress=lambda *a: time.sleep(60))\n")
    p = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.time() + 120
        while not [q for q in out_dir.iterdir() if q.name.endswith(".tmp")]:
            assert time.time() < deadline and p.poll() is None
            time.sleep(0.1)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    (tmp,) = out_dir.iterdir()
    os.utime(tmp, (time.time() - 3600,) * 2)
    qconvert.convert(hf, out_dir / "n.gguf", qtype="f32")
    assert [q.name for q in out_dir.iterdir()] == ["n.gguf"]


# -- fuzzing the convert path --------------------------------------------------------
HOSTILE = [2 ** 32, 2 ** 40, 2 ** 63, -1, 0, 1, 0.5, 1e39, -1e39, 1e-50, float("nan"), float("inf"),
           "", "x" * 300, "<|eot_id|>", None, True, False, [], {}, [1, 2], ["a", "b"], {"a": 1},
           [[1]], {"type": "Sequence"}]
JSON_FILES = (CONFIG, GEN, TOK, TCFG)


def _paths(node, prefix=(), depth=0):
    """Key paths into a JSON document (dicts and the first items of lists), bounded."""
    if depth > 4:
        return
    if isinstance(node, dict):
        for k, v in list(node.items())[:40]:
            yield prefix + (k,)
            yield from _paths(v, prefix + (k,), depth + 1)
    elif isinstance(node, list):
        for i, v in enumerate(node[:3]):
            yield prefix + (i,)
            yield from _paths(v, prefix + (i,), depth + 1)


def _mutate(doc, rng: random.Random):
    paths = list(_paths(doc))
    if not paths or rng.random() < 0.05:
        return rng.choice([[doc], [], "x", 1, None])          # the whole document
    path = rng.choice(paths)
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    k = path[-1]
    if rng.random() < 0.2:
        del parent[k]
    elif rng.random() < 0.2 and isinstance(parent[k], (int, float)) and not isinstance(parent[k], bool):
        parent[k] = rng.choice([-1, 2, 10, 1e6]) * parent[k]
    else:
        parent[k] = rng.choice(HOSTILE)
    return doc


def _mutate_safetensors(path: Path, rng: random.Random) -> None:
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    try:
        head = json.loads(raw[8:8 + n].decode())
    except ValueError:                           # an earlier mutation broke it already
        head = None
    if head is None or rng.random() < 0.3:       # raw bytes of the header (and its length)
        for _ in range(rng.randint(1, 4)):
            raw[rng.randrange(0, 8 + n)] = rng.randrange(256)
        path.write_bytes(bytes(raw))
        return
    head = _mutate(head, rng)
    text = json.dumps(head).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(raw[8 + n:]))


FUZZ_CASES = int(os.environ.get("EDGELLAMA_FUZZ_CONVERT", "120"))


def test_fuzz_convert_inputs(pristine, tmp_path):
    """Mutated JSON files and safetensors headers: every case is a success whose file our
    loader takes without complaint, or one EdgeError; never another exception, a hang,
    or a file left behind."""
    rng = random.Random(1234)
    outcomes = {"ok": 0, "error": 0}
    for case in range(FUZZ_CASES):
        hf = tmp_path / f"hf{case}"
        hf.mkdir()
        for f in pristine.iterdir():
            (hf / f.name).write_bytes(f.read_bytes())
        what = []
        for _ in range(rng.choice([1, 1, 2, 3])):
            target = rng.choice(JSON_FILES + ("model.safetensors",))
            what.append(target)
            if target == "model.safetensors":
                _mutate_safetensors(hf / target, rng)
            else:
                doc = _mutate(json.loads((hf / target).read_text()), rng)
                (hf / target).write_text(json.dumps(doc))
        out_dir = tmp_path / f"out{case}"
        out_dir.mkdir()
        try:
            qconvert.convert(hf, out_dir / "m.gguf", qtype=rng.choice(["f32", "q8_0", "q4_k_m"]))
        except EdgeError as e:
            assert "\n" not in str(e) and str(e).strip(), (case, what, str(e))
            assert list(out_dir.iterdir()) == [], (case, what, str(e))
            outcomes["error"] += 1
        except Exception as e:            # noqa: BLE001 - exactly what the fuzzer looks for
            import traceback
            pytest.fail(f"case {case} ({what}): {type(e).__name__}: {e}\n{traceback.format_exc()}")
        else:
            assert [p.name for p in out_dir.iterdir()] == ["m.gguf"], (case, what)
            llm = load(out_dir / "m.gguf", ctx=16)
            assert not llm.warnings, (case, what, llm.warnings)
            del llm
            outcomes["ok"] += 1
        for d in (hf, out_dir):
            for f in d.iterdir():
                f.unlink()
            d.rmdir()
    assert outcomes["ok"] and outcomes["error"], outcomes        # both paths exercised
