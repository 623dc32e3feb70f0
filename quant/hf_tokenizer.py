"""HF tokenizer files -> GGUF `tokenizer.*` metadata, as llama.cpp's converter writes it.

Sources: tokenizer.json (a byte-level BPE), or when it is absent a tiktoken-format
tokenizer.model (base64 token + rank per line) with the added tokens taken from
tokenizer_config.json. Rules followed (llama.cpp convert_hf_to_gguf.py + gguf-py
SpecialVocab):
- ids missing from the vocab become "[PAD{i}]" of type UNUSED (5), up to vocab_size;
- added tokens are stored raw; CONTROL (3) when marked special or when they look
  special ("<|...|>"), otherwise USER_DEFINED (4); the rest NORMAL (1);
- added tokens with id >= vocab_size are dropped (with a warning);
- bos/eos/unk/pad ids from tokenizer_config.json's *_token looked up among the added
  tokens, then config.json's *_token_id, then (eos only) generation_config.json;
- add_bos_token from tokenizer_config.json, else from a TemplateProcessing post
  processor that starts with the bos token.
"""
from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field
from pathlib import Path

from edgellama.bytelevel import bytes_to_token
from edgellama.errors import EdgeError
from edgellama.tokenizer import QWEN2_PATTERN

from .hf import _show, load_json

NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5

LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass
class TokenizerMeta:
    pre: str
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    special_ids: dict[str, int]           # "bos"/"eos"/"unk"/"pad" -> id
    add_special: dict[str, bool]          # "bos"/"eos" -> add it when encoding
    chat_template: str | None
    warnings: list[str] = field(default_factory=list)
    source: Path | None = None            # the file the vocabulary came from


def _detect_pre(pre_tok, path: Path) -> str:
    """Name of the pre-tokenizer llama.cpp knows this tokenizer.json by."""
    def obj(v, key):
        if not isinstance(v, dict):
            raise EdgeError(f"{path}: '{key}' must be an object, got {_show(v)}")
        return v

    pre_tok = {} if pre_tok is None else obj(pre_tok, "pre_tokenizer")
    if pre_tok.get("type") == "Sequence":
        parts = pre_tok.get("pretokenizers", [])
        if not isinstance(parts, list):
            raise EdgeError(f"{path}: 'pre_tokenizer.pretokenizers' must be a list, got {_show(parts)}")
        parts = [obj(p, f"pre_tokenizer.pretokenizers[{i}]") for i, p in enumerate(parts)]
    else:
        parts = [pre_tok] if pre_tok else []
    seq = [(p.get("type"), p) for p in parts]
    types = [t for t, _ in seq]
    if types == ["Split", "ByteLevel"]:
        split, bl = seq[0][1], seq[1][1]
        pattern = split.get("pattern")
        if (isinstance(pattern, dict) and pattern.get("Regex") == LLAMA3_REGEX
                and split.get("behavior") == "Isolated" and split.get("invert") is False
                and bl.get("use_regex", True) is False):
            return "llama-bpe"
        if (isinstance(pattern, dict) and pattern.get("Regex") == QWEN2_PATTERN
                and split.get("behavior") == "Isolated" and split.get("invert") is False
                and bl.get("use_regex", True) is False):
            return "qwen2"
    if types == ["Digits", "ByteLevel"]:
        if seq[0][1].get("individual_digits") is True and seq[1][1].get("use_regex", True) is True:
            return "smollm"
    raise EdgeError(f"{path}: unknown pre-tokenizer {_show(types or None)} (supported: the Llama 3 "
                    f"regex split ('llama-bpe'), Qwen's ('qwen2') and SmolLM2's digits + "
                    f"byte-level ('smollm'))")


def _looks_special(text: str) -> bool:
    return (text.startswith("<|") and text.endswith("|>")) or (text.startswith("<｜") and text.endswith("｜>"))


def tiktoken_ranks(path: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    try:
        with open(path, "rb") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    tok, rank = line.split()
                    ranks[base64.b64decode(tok, validate=True)] = int(rank)
                except (ValueError, binascii.Error):
                    raise EdgeError(f"{path}: line {n} is not 'base64-token rank' (only the "
                                    f"tiktoken format is supported, not SentencePiece)") from None
    except OSError as e:                # /proc/self/mem, a failing disk
        raise EdgeError(f"{path}: cannot read: {e.strerror or e}") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise EdgeError(f"{path}: ranks are not 0..{len(ranks) - 1} without gaps")
    return ranks


def merges_from_ranks(ranks: dict[bytes, int]) -> list[str]:
    """BPE merges implied by tiktoken ranks, in the order Hugging Face writes them into
    tokenizer.json: for each token by rank, every split into two in-vocabulary pieces,
    ordered by the pieces' ranks. (Taking only the split that BPE over lower ranks ends
    in gives one merge per token; tokenizer.json lists all of them.)"""
    out: list[str] = []
    for tok, _ in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(tok) < 2:
            continue
        local = [(ranks[tok[:i]], ranks[tok[i:]], i) for i in range(1, len(tok))
                 if tok[:i] in ranks and tok[i:] in ranks]
        local.sort()
        out.extend(f"{bytes_to_token(tok[:i])} {bytes_to_token(tok[i:])}" for _, _, i in local)
    return out


def _merges_from_json(merges, path: Path) -> list[str]:
    if not isinstance(merges, list):
        raise EdgeError(f"{path}: 'model.merges' must be a list, got {_show(merges)}")
    if not merges:
        raise EdgeError(f"{path}: model.merges is empty")
    if all(isinstance(m, str) for m in merges):
        return list(merges)
    if all(isinstance(m, list) and len(m) == 2 and all(isinstance(p, str) for p in m) for m in merges):
        # newer format: [left, right]; spaces inside a piece are written as U+0120 (llama.cpp)
        return [" ".join(p.replace(" ", "\u0120") for p in pair) for pair in merges]
    bad = next(m for m in merges if not isinstance(m, (str, list)) or isinstance(m, list) and (
        len(m) != 2 or not all(isinstance(p, str) for p in m)) or type(m) is not type(merges[0]))
    raise EdgeError(f"{path}: 'model.merges' must be all strings \"a b\" or all pairs [\"a\", \"b\"]; "
                    f"found {_show(bad)}")


def _added_from_config(cfg: dict, path: Path) -> list[dict]:
    dec = cfg.get("added_tokens_decoder")
    if not isinstance(dec, dict) or not dec:
        raise EdgeError(f"{path}: needs 'added_tokens_decoder' (the special tokens) when there is "
                        f"no tokenizer.json")
    out = []
    for k, v in dec.items():
        if not k.isdigit() or not isinstance(v, dict):
            raise EdgeError(f"{path}: 'added_tokens_decoder' entry {_show(k)} must be a token id "
                            f"mapping to an object, got {_show(v)}")
        out.append({**v, "id": int(k)})
    return out


def _vocab(vocab, vocab_size: int, path: Path) -> dict[int, str]:
    if not isinstance(vocab, dict):
        raise EdgeError(f"{path}: 'model.vocab' must be an object of token -> id, got {_show(vocab)}")
    out: dict[int, str] = {}
    for t, i in vocab.items():
        if not isinstance(i, int) or isinstance(i, bool) or i < 0:
            raise EdgeError(f"{path}: 'model.vocab' id of token {_show(t)} must be a non-negative "
                            f"integer, got {_show(i)}")
        if i >= vocab_size:
            raise EdgeError(f"{path}: token id {i} is beyond the model's vocab_size {vocab_size}")
        if i in out:
            raise EdgeError(f"{path}: 'model.vocab' gives id {i} to both {_show(out[i])} and {_show(t)}")
        out[i] = t
    return out


def _special_id(v, path: Path, key: str):
    """An int or list of ints (HF's *_token_id), or None; anything else is an error."""
    ok = (v is None or isinstance(v, int) and not isinstance(v, bool)
          or isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v))
    if not ok:
        raise EdgeError(f"{path}: '{key}' must be a token id or a list of them, got {_show(v)}")
    return v


def load_tokenizer(hf_dir: Path, vocab_size: int, config: dict) -> TokenizerMeta:
    tj_path, tm_path = hf_dir / "tokenizer.json", hf_dir / "tokenizer.model"
    tc_path = hf_dir / "tokenizer_config.json"
    tcfg = load_json(tc_path, "tokenizer config") if tc_path.exists() else {}
    warnings: list[str] = []
    post = None
    if tj_path.exists():
        tj = load_json(tj_path, "tokenizer")
        model = tj.get("model")
        if not isinstance(model, dict):
            raise EdgeError(f"{tj_path}: 'model' must be an object, got {_show(model)}")
        if model.get("type") != "BPE":
            raise EdgeError(f"{tj_path}: only byte-level BPE tokenizers are supported "
                            f"(model.type is {_show(model.get('type'))})")
        pre = _detect_pre(tj.get("pre_tokenizer"), tj_path)
        vocab = _vocab(model.get("vocab"), vocab_size, tj_path)
        merges = _merges_from_json(model.get("merges"), tj_path)
        added = tj.get("added_tokens") or []
        if not isinstance(added, list):
            raise EdgeError(f"{tj_path}: 'added_tokens' must be a list, got {_show(added)}")
        post = tj.get("post_processor")
        src = tj_path
    elif tm_path.is_file():
        ranks = tiktoken_ranks(tm_path)
        pre = "llama-bpe"      # the tiktoken format is what Meta ships for Llama 3
        vocab = {r: bytes_to_token(b) for b, r in ranks.items()}
        merges = merges_from_ranks(ranks)
        added = _added_from_config(tcfg, tc_path)
        src = tm_path
    else:
        raise EdgeError(f"{hf_dir}: missing tokenizer (need tokenizer.json or a tiktoken tokenizer.model)")

    big = [i for i in vocab if i >= vocab_size]
    if big:
        raise EdgeError(f"{src}: token id {max(big)} is beyond the model's vocab_size {vocab_size}")
    if not isinstance(tcfg.get("chat_template", ""), (str, list)):
        raise EdgeError(f"{tc_path}: 'chat_template' must be a string, got {_show(tcfg['chat_template'])}")
    added_by_id: dict[int, dict] = {}
    for a in added:
        if (not isinstance(a, dict) or not isinstance(a.get("id"), int) or isinstance(a["id"], bool)
                or a["id"] < 0 or not isinstance(a.get("content"), str)):
            raise EdgeError(f"{src}: malformed added token {_show(a)} (needs a non-negative integer "
                            f"'id' and a string 'content')")
        if a["id"] >= vocab_size:
            warnings.append(f"{src.name}: added token {a['content']!r} (id {a['id']}) is beyond "
                            f"vocab_size {vocab_size}; dropped")
            continue
        added_by_id[a["id"]] = a

    tokens, types = [], []
    for i in range(vocab_size):
        if i in added_by_id:
            a = added_by_id[i]
            tokens.append(a["content"])
            types.append(CONTROL if a.get("special") or _looks_special(a["content"]) else USER_DEFINED)
        elif i in vocab:
            tokens.append(vocab[i])
            types.append(NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)

    by_content = {}
    for a in added:
        by_content.setdefault(a["content"], a["id"])
    special: dict[str, int] = {}
    for typ in ("bos", "eos", "unk", "pad"):
        entry = tcfg.get(f"{typ}_token")
        content = entry.get("content") if isinstance(entry, dict) else entry
        if content is not None and not isinstance(content, str):
            raise EdgeError(f"{tc_path}: '{typ}_token' must be a string or an object with a string "
                            f"'content', got {_show(entry)}")
        tid = by_content.get(content) if isinstance(content, str) else None
        if tid is None:
            tid = _special_id(config.get(f"{typ}_token_id"), hf_dir / "config.json", f"{typ}_token_id")
        if typ == "eos" and not isinstance(tid, int):
            gen_path = hf_dir / "generation_config.json"
            gen = _special_id(load_json(gen_path, "generation config").get("eos_token_id"), gen_path,
                              "eos_token_id") if gen_path.exists() else None
            if isinstance(gen, list):
                # several end ids (Instruct): the end-of-turn token is the one chat stops at
                gen = next((g for g in gen if isinstance(g, int) and g < vocab_size
                            and tokens[g] == "<|eot_id|>"), gen[0] if gen else None)
            tid = gen
        if isinstance(tid, int) and not isinstance(tid, bool):
            if not 0 <= tid < vocab_size:
                raise EdgeError(f"{tc_path.name}: {typ} token id {tid} is outside the vocab (size {vocab_size})")
            special[typ] = tid

    add_special: dict[str, bool] = {}
    for typ in ("bos", "eos"):
        v = tcfg.get(f"add_{typ}_token")
        if isinstance(v, bool):
            add_special[typ] = v
        elif v is not None:
            raise EdgeError(f"{tc_path}: 'add_{typ}_token' must be true or false, got {_show(v)}")
    if "bos" not in add_special and isinstance(post, dict):
        procs = post.get("processors", [post])
        for proc in procs if isinstance(procs, list) else []:
            single = proc.get("single") if isinstance(proc, dict) and proc.get("type") == "TemplateProcessing" else None
            head = single[0] if isinstance(single, list) and len(single) > 1 else None
            spec = head.get("SpecialToken") if isinstance(head, dict) else None
            first = spec.get("id") if isinstance(spec, dict) else None
            if isinstance(first, str) and "bos" in special:
                add_special["bos"] = first == tokens[special["bos"]]

    tmpl = tcfg.get("chat_template")
    if tmpl is None and (hf_dir / "chat_template.jinja").is_file():
        try:
            tmpl = (hf_dir / "chat_template.jinja").read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise EdgeError(f"{hf_dir / 'chat_template.jinja'}: cannot read as UTF-8 text ({e})") from None
    if tmpl is not None and not isinstance(tmpl, str):
        warnings.append(f"{tc_path.name}: chat_template is not a single string; not written")
        tmpl = None
    return TokenizerMeta(pre, tokens, types, merges, special, add_special, tmpl, warnings, src)
