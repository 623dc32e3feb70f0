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

from .hf import load_json

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


def _detect_pre(pre_tok: dict | None, path: Path) -> str:
    """Name of the pre-tokenizer llama.cpp knows this tokenizer.json by."""
    def parts(p):
        return p.get("pretokenizers", []) if p.get("type") == "Sequence" else [p]
    seq = [(p.get("type"), p) for p in parts(pre_tok or {})]
    types = [t for t, _ in seq]
    if types == ["Split", "ByteLevel"]:
        split, bl = seq[0][1], seq[1][1]
        if (split.get("pattern", {}).get("Regex") == LLAMA3_REGEX and split.get("behavior") == "Isolated"
                and not split.get("invert") and not bl.get("use_regex", True)):
            return "llama-bpe"
    if types == ["Digits", "ByteLevel"]:
        if seq[0][1].get("individual_digits") and seq[1][1].get("use_regex", True):
            return "smollm"
    raise EdgeError(f"{path}: unknown pre-tokenizer {types or None} (supported: the Llama 3 "
                    f"regex split ('llama-bpe') and SmolLM2's digits + byte-level ('smollm'))")


def _looks_special(text: str) -> bool:
    return (text.startswith("<|") and text.endswith("|>")) or (text.startswith("<｜") and text.endswith("｜>"))


def tiktoken_ranks(path: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                tok, rank = line.split()
                ranks[base64.b64decode(tok, validate=True)] = int(rank)
            except (ValueError, binascii.Error):
                raise EdgeError(f"{path}: line {n} is not 'base64-token rank' "
                                f"(only the tiktoken format is supported, not SentencePiece)") from None
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
    if not merges:
        raise EdgeError(f"{path}: model.merges is empty")
    if isinstance(merges[0], str):
        return list(merges)
    if isinstance(merges[0], list):
        # newer format: [left, right]; spaces inside a piece are written as U+0120 (llama.cpp)
        return [" ".join(p.replace(" ", "\u0120") for p in pair) for pair in merges]
    raise EdgeError(f"{path}: unknown merges format")


def _added_from_config(cfg: dict, path: Path) -> list[dict]:
    dec = cfg.get("added_tokens_decoder")
    if not isinstance(dec, dict) or not dec:
        raise EdgeError(f"{path}: needs 'added_tokens_decoder' (the special tokens) when there is "
                        f"no tokenizer.json")
    try:
        return [{"id": int(k), **v} for k, v in dec.items()]
    except (TypeError, ValueError):
        raise EdgeError(f"{path}: malformed 'added_tokens_decoder'") from None


def load_tokenizer(hf_dir: Path, vocab_size: int, config: dict) -> TokenizerMeta:
    tj_path, tm_path = hf_dir / "tokenizer.json", hf_dir / "tokenizer.model"
    tc_path = hf_dir / "tokenizer_config.json"
    tcfg = load_json(tc_path, "tokenizer config") if tc_path.is_file() else {}
    warnings: list[str] = []
    post = None
    if tj_path.is_file():
        tj = load_json(tj_path, "tokenizer")
        model = tj.get("model") or {}
        if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
            raise EdgeError(f"{tj_path}: only byte-level BPE tokenizers are supported "
                            f"(model.type is {model.get('type')!r})")
        pre = _detect_pre(tj.get("pre_tokenizer"), tj_path)
        vocab = {i: t for t, i in model["vocab"].items()}
        merges = _merges_from_json(model.get("merges"), tj_path)
        added = tj.get("added_tokens") or []
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
    added_by_id: dict[int, dict] = {}
    for a in added:
        if not isinstance(a, dict) or not isinstance(a.get("id"), int) or not isinstance(a.get("content"), str):
            raise EdgeError(f"{src}: malformed added token {a!r}")
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
        tid = by_content.get(content) if isinstance(content, str) else None
        if tid is None:
            tid = config.get(f"{typ}_token_id")
        if typ == "eos" and not isinstance(tid, int):
            gen_path = hf_dir / "generation_config.json"
            gen = load_json(gen_path, "generation config").get("eos_token_id") if gen_path.is_file() else None
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
        if isinstance(tcfg.get(f"add_{typ}_token"), bool):
            add_special[typ] = tcfg[f"add_{typ}_token"]
    if "bos" not in add_special and isinstance(post, dict):
        for proc in post.get("processors", [post]):
            single = (proc.get("single") or []) if proc.get("type") == "TemplateProcessing" else []
            first = single[0].get("SpecialToken", {}).get("id") if len(single) > 1 else None
            if first is not None and "bos" in special:
                add_special["bos"] = first == tokens[special["bos"]]

    tmpl = tcfg.get("chat_template")
    if tmpl is None and (hf_dir / "chat_template.jinja").is_file():
        tmpl = (hf_dir / "chat_template.jinja").read_text(encoding="utf-8")
    if tmpl is not None and not isinstance(tmpl, str):
        warnings.append(f"{tc_path.name}: chat_template is not a single string; not written")
        tmpl = None
    return TokenizerMeta(pre, tokens, types, merges, special, add_special, tmpl, warnings)
