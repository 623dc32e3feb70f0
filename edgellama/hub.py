"""Models from the Hugging Face Hub, through huggingface_hub (its cache, resume, HF_TOKEN,
progress bar, HF_ENDPOINT / HF_HUB_OFFLINE).

- GGUF files by llama.cpp's reference `OWNER/REPO[:QUANT]` or a short name (SHORT_NAMES).
- Checkpoints for `convert`: only the safetensors, JSON config/tokenizer files and
  tokenizer.model of a repository.

huggingface_hub is imported inside the functions: `import edgellama` never pays for it.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .errors import EdgeError

# ollama-style names for the common Llama files (bartowski's GGUFs: llama.cpp's own
# quantizations of Meta's Instruct checkpoints, not gated).
SHORT_NAMES = {
    "llama3.2:1b": "bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M",
    "llama3.2:3b": "bartowski/Llama-3.2-3B-Instruct-GGUF:Q4_K_M",
    "llama3.2": "bartowski/Llama-3.2-3B-Instruct-GGUF:Q4_K_M",
    "llama3.1:8b": "bartowski/Meta-Llama-3.1-8B-Instruct-GGUF:Q4_K_M",
}

# Without a quant tag, llama.cpp tries these, then the repository's first model file.
DEFAULT_QUANTS = ("Q4_K_M", "Q8_0")

CHECKPOINT_PATTERNS = ["*.safetensors", "*.json", "tokenizer.model"]

# Hub repository ids: OWNER/NAME, letters, digits, '-', '_', '.'.
_REF = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?::(?P<quant>[A-Za-z0-9_.-]+))?")
# GGUFs in model repositories that are not the model (llama.cpp's gguf_filename_is_model).
_NOT_MODELS = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")
_SPLIT = re.compile(r"^(.+)-([0-9]{5})-of-([0-9]{5})$", re.I)
_TAG = re.compile(r"[-.]([A-Z0-9_]+)$", re.I)


def parse_ref(text: str) -> tuple[str, str | None] | None:
    """(repo, quant or None) for a short name or OWNER/REPO[:QUANT]; None otherwise."""
    m = _REF.fullmatch(SHORT_NAMES.get(text.lower(), text))
    return (m["repo"], m["quant"]) if m else None


def is_ref(text: str) -> bool:
    return parse_ref(text) is not None


def is_repo_id(text: str) -> bool:
    """OWNER/NAME, nothing more (what `convert` downloads)."""
    m = _REF.fullmatch(text)
    return bool(m) and m["quant"] is None


def _is_model(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return path.endswith(".gguf") and not any(s in name for s in _NOT_MODELS)


def _split(path: str) -> tuple[str, str, int, int]:
    """(prefix, quant tag, shard index, shard count) of a GGUF path, as llama.cpp reads it:
    "m-Q8_0-00002-of-00003.gguf" -> ("m-Q8_0", "Q8_0", 2, 3)."""
    prefix, index, count = path.removesuffix(".gguf"), 1, 1
    if m := _SPLIT.match(prefix):
        prefix, index, count = m[1], int(m[2]), int(m[3])
    tag = _TAG.search(prefix)
    return prefix, tag[1].upper() if tag else "", index, count


def pick_file(repo: str, files: list[str], quant: str | None) -> str:
    """The GGUF file llama.cpp's `-hf REPO[:QUANT]` picks: the first model file whose path
    holds QUANT followed by '.' or '-' (any case), first shard only; without QUANT, Q4_K_M,
    then Q8_0, then the first model file. A model split in parts is refused."""
    models = [f for f in files if _is_model(f) and _split(f)[2] == 1]
    chosen = None
    for tag in [quant] if quant else DEFAULT_QUANTS:
        pattern = re.compile(re.escape(tag) + "[.-]", re.I)
        if chosen := next((f for f in models if pattern.search(f)), None):
            break
    if chosen is None and not quant and models:
        chosen = models[0]
    if chosen is None:
        if not models:
            hint = (f"; it looks like a checkpoint: `edgellama convert {repo} -o OUT.gguf`"
                    if "config.json" in files else "")
            raise EdgeError(f"{repo} has no GGUF model file{hint}")
        tags = list(dict.fromkeys(_split(f)[1] or f for f in models))
        raise EdgeError(f"{repo} has no GGUF file for quant {quant}; available: {', '.join(tags)}")
    count = _split(chosen)[3]
    if count > 1:
        raise EdgeError(f"{repo}: {chosen} is split in {count} parts, which edgellama does not read; "
                        f"pick a smaller quant, or join the parts with llama.cpp's "
                        f"`llama-gguf-split --merge`")
    return chosen


def check_repo_id(repo: str) -> None:
    """EdgeError, in our words, for a repository id that huggingface_hub's own rules
    (validate_repo_id) refuse, before anything asks the hub or touches its cache."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id
    try:
        validate_repo_id(repo)
        return
    except HFValidationError:
        pass
    parts = repo.split("/")
    if not repo.isascii():
        why = "only ASCII letters, digits, '-', '_' and '.' are allowed"
    elif "--" in repo or ".." in repo:
        why = "'--' and '..' are not allowed"
    elif any(len(part) > 96 for part in parts):
        why = "each part is at most 96 characters"
    elif any(not part or part[0] in "-." or part[-1] in "-." for part in parts):
        why = "a part cannot be empty or start or end with '-' or '.'"
    elif repo.endswith(".git"):
        why = "it cannot end in .git"
    else:
        why = "expected OWNER/NAME of letters, digits, '-', '_' and '.'"
    raise EdgeError(f"{repo[:200]} is not a valid Hugging Face repository name: {why}")


_HUB_VARIABLES = ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME")


def hub_cache(write: bool = False) -> Path:
    """The Hugging Face cache folder; EdgeError naming the variable that placed it when it
    is not a folder (or, with `write`, cannot be written)."""
    from huggingface_hub import constants
    from .default_model import check_dir
    variable = next((v for v in _HUB_VARIABLES if os.environ.get(v)), None)
    return check_dir(Path(constants.HF_HUB_CACHE), "the Hugging Face cache; HF_HUB_CACHE or "
                     "HF_HOME moves it", variable, write)


def _repo_folder(repo: str) -> Path:
    return hub_cache() / ("models--" + repo.replace("/", "--"))


def _cached_files(repo: str) -> dict[str, Path]:
    """Complete files of the cached snapshot of the repository's main branch."""
    folder = _repo_folder(repo)
    try:
        snapshot = folder / "snapshots" / (folder / "refs" / "main").read_text().strip()
        return {p.relative_to(snapshot).as_posix(): p for p in snapshot.rglob("*") if p.is_file()}
    except (OSError, ValueError):
        return {}


def _offline_errors() -> tuple[type[BaseException], ...]:
    """What huggingface_hub raises when the hub cannot be reached."""
    from huggingface_hub import errors
    kinds = [errors.OfflineModeIsEnabled, errors.LocalEntryNotFoundError]
    for client in ("httpx2", "httpx"):   # its HTTP client (httpx2 in 2.x)
        with contextlib.suppress(ImportError):
            kinds.append(importlib.import_module(client).TransportError)
    return tuple(kinds)


@contextlib.contextmanager
def _errors(repo: str):
    """huggingface_hub's failures as one-line EdgeErrors that say what to do."""
    from huggingface_hub import constants, errors
    site = constants.ENDPOINT
    try:
        yield
    except errors.GatedRepoError:
        raise EdgeError(f"{repo} is gated: accept its terms at {site}/{repo} while logged in, then "
                        f"set HF_TOKEN to an access token of that account"
                        + (" (the current HF_TOKEN has no access)" if _token() else "")) from None
    except errors.RepositoryNotFoundError:
        raise EdgeError(f"{repo}: no such model on Hugging Face ({site}); if it is private or "
                        f"gated, set HF_TOKEN to an access token that can read it") from None
    except errors.RevisionNotFoundError:
        raise EdgeError(f"{repo}: no main branch on Hugging Face") from None
    except errors.RemoteEntryNotFoundError as e:
        raise EdgeError(f"{repo}: a file is missing on Hugging Face ({e.response.url})") from None
    except _offline_errors():
        raise EdgeError(f"cannot reach Hugging Face ({site}) and {repo} is not in the cache "
                        f"({constants.HF_HUB_CACHE}); check the network") from None
    except errors.HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else "?"
        hint = "; HF_TOKEN was refused" if status == 401 and _token() else ""
        raise EdgeError(f"Hugging Face answered {status} for {repo}{hint}") from None


def _token() -> str | None:
    from huggingface_hub import get_token
    return get_token()


def gguf_path(ref: str) -> Path:
    """Local path of the GGUF a reference names, downloading it on first use. A cached file
    of the requested quant (default Q4_K_M) is used without asking the hub; otherwise the
    hub's file list decides, and offline the cached files do."""
    parsed = parse_ref(ref)
    if parsed is None:
        raise EdgeError(f"{ref!r} is not a Hugging Face reference: expected OWNER/REPO[:QUANT] "
                        f"or one of {', '.join(SHORT_NAMES)}")
    repo, quant = parsed
    check_repo_id(repo)
    from huggingface_hub import HfApi, constants, hf_hub_download
    cached = _cached_files(repo)
    with contextlib.suppress(EdgeError):
        name = pick_file(repo, list(cached), quant or DEFAULT_QUANTS[0])
        return cached[name]
    with _errors(repo):
        try:
            # model_info lists the files in one request; list_repo_files would retry for
            # half a minute when offline
            files = [s.rfilename for s in HfApi().model_info(repo).siblings or []]
        except _offline_errors():
            if not cached:
                raise
            # offline: choose among what the cache holds, as llama.cpp does
            try:
                return cached[pick_file(repo, list(cached), quant)]
            except EdgeError:
                have = ", ".join(_split(f)[1] or f for f in sorted(cached) if _is_model(f))
                raise EdgeError(f"cannot reach Hugging Face ({constants.ENDPOINT}), and its "
                                f"cache holds no {quant} file of {repo} (cached: {have})") from None
        name = pick_file(repo, files, quant)
        if name in cached:
            return cached[name]
        hub_cache(write=True)
        return Path(hf_hub_download(repo, name))


def checkpoint_dir(repo: str, quiet: bool = False) -> Path:
    """A local snapshot of a checkpoint repository: only what `convert` reads."""
    check_repo_id(repo)
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.utils import disable_progress_bars
    hub_cache(write=not constants.HF_HUB_OFFLINE)
    if quiet:
        disable_progress_bars()
    with _errors(repo):
        return Path(snapshot_download(repo, allow_patterns=CHECKPOINT_PATTERNS))


@dataclass
class CachedModel:
    """A model in one of the caches: `name` is what `edgellama rm` takes (and, for a Hub
    GGUF, what -hf takes). `size` is None when the file is gone (a dangling link)."""
    name: str
    size: int | None
    path: Path
    kind: str                       # "gguf" or "checkpoint"
    remove: Callable[[], None] = field(repr=False)


def _size(path: Path) -> int | None:
    """Size of the file a cache entry is (or links to); None if there is none."""
    try:
        st = path.stat()
    except (OSError, ValueError):
        return None
    return st.st_size if not os.path.isdir(path) else None


def _snapshot_entries(repo_dir: Path) -> dict[str, list[Path]]:
    """Path in the repository -> its entries (files or links, dangling ones too) in the
    repository's cached snapshots, in a fixed order. Links are never followed into
    folders: only what lies inside the repository's folder is listed."""
    found: dict[str, list[Path]] = {}
    snapshots = repo_dir / "snapshots"
    if snapshots.is_symlink() or not snapshots.is_dir():
        return found
    for rev in sorted(snapshots.iterdir()):
        if rev.is_symlink() or not rev.is_dir():
            continue
        for top, dirs, files in os.walk(rev):        # never descends into linked folders
            dirs.sort()
            for name in sorted(files) + [d for d in dirs if os.path.islink(os.path.join(top, d))]:
                entry = Path(top) / name
                found.setdefault(entry.relative_to(rev).as_posix(), []).append(entry)
    return {k: found[k] for k in sorted(found)}


def _unlink_entries(repo_dir: Path, entries: list[Path]) -> None:
    """Remove snapshot entries of one repository: a link goes, never what it points to,
    except a blob of this repository's own blobs/ folder that no other entry of the
    repository still uses."""
    blobs = repo_dir / "blobs"
    targets = set()
    for e in entries:
        if e.is_symlink():
            target = Path(os.path.normpath(e.parent / os.readlink(e)))
            if target.parent == blobs and not blobs.is_symlink():
                targets.add(target)
        e.unlink(missing_ok=True)
    still = {Path(os.path.normpath(e.parent / os.readlink(e)))
             for es in _snapshot_entries(repo_dir).values() for e in es if e.is_symlink()}
    for t in sorted(targets - still):
        t.unlink(missing_ok=True)                  # a real file (or link) in blobs/


def _remove_repo(repo_dir: Path) -> None:
    """Remove one repository's folder of the Hugging Face cache: what is in it (links as
    links, never their targets), not a mirror sharing its commits. A folder that is
    itself a link loses only the link."""
    if repo_dir.is_symlink():
        repo_dir.unlink()
        return
    for top, dirs, files in os.walk(repo_dir, topdown=False):
        for name in files:
            os.unlink(os.path.join(top, name))
        for name in dirs:
            path = os.path.join(top, name)
            if os.path.islink(path):
                os.unlink(path)
            else:
                os.rmdir(path)
    os.rmdir(repo_dir)


def _hub_repos() -> list[tuple[str, Path]]:
    """(repository id, folder) of the model repositories in the Hugging Face cache."""
    root = hub_cache()
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        if d.name.startswith("models--") and d.is_dir():
            found.append((d.name.removeprefix("models--").replace("--", "/"), d))
    return sorted(found, key=lambda r: (r[0].lower(), r[0]))


def cached_models() -> list[CachedModel]:
    """The GGUF files and checkpoints in the Hugging Face cache, then the GGUF files in
    edgellama's own cache (the default model among them), then the tiles kept for fast
    starts (tile_cache.py), then the saved prompts (prompt_cache.py), then the rest of
    what edgellama keeps there (_other_own_files: bench's models, compiled kernels, the
    chat history, leftovers of killed runs). Removal is by
    repository and file: never by commit hash (a mirror shares those), never through a
    link to its target."""
    from .default_model import cache_dir
    found = []
    for repo_id, repo_dir in _hub_repos():
        if repo_dir.is_symlink():      # a folder kept elsewhere: rm takes the link only
            found.append(CachedModel(repo_id, None, repo_dir, "link to a folder outside the cache",
                                     repo_dir.unlink))
            continue
        by_path = _snapshot_entries(repo_dir)
        ggufs = [p for p in by_path if _is_model(p)]
        for p in ggufs:
            name, tag = f"{repo_id}:{p}", _split(p)[1]
            with contextlib.suppress(EdgeError):   # the short form when -hf would pick this file
                if tag and pick_file(repo_id, ggufs, tag) == p:
                    name = f"{repo_id}:{tag}"
            entries = by_path[p]
            sizes = [s for e in entries if (s := _size(e)) is not None]
            whole = len(ggufs) == 1    # its only model: the repository goes with it
            found.append(CachedModel(
                name, max(sizes) if sizes else None, entries[0], "gguf",
                (lambda d=repo_dir: _remove_repo(d)) if whole else
                (lambda d=repo_dir, es=entries: _unlink_entries(d, es))))
        if not ggufs and any(p.endswith(".safetensors") for p in by_path):
            sizes = {os.path.realpath(e): _size(e) for es in by_path.values() for e in es}
            size = sum(s for s in sizes.values() if s is not None)
            found.append(CachedModel(repo_id, size, repo_dir, "checkpoint",
                                     lambda d=repo_dir: _remove_repo(d)))
    own = cache_dir()
    for p in sorted(own.glob("*.gguf")) if own.is_dir() else ():
        if p.is_symlink() or p.is_file():
            found.append(CachedModel(p.name, _size(p), p, "gguf", p.unlink))   # a link, not its target
    from .tile_cache import cached_tiles
    for p, source in cached_tiles():
        found.append(CachedModel(f"tiles/{p.name}", _size(p) or 0, p,
                                 f"start-up tiles of {Path(source['path']).name}", p.unlink))
    from .prompt_cache import saved_prompts
    for name, p, what in saved_prompts():       # a link goes as a link
        found.append(CachedModel(f"prompts/{name}", _size(p), p, what, p.unlink))
    if own.is_dir() and not own.is_symlink():
        found += _other_own_files(own, found)
    return found


# Names of what edgellama keeps in its cache besides models, tiles and saved prompts,
# written out here: `list` imports neither numba nor the modules that make them.
_BENCH_FILE = re.compile(r"[a-z0-9][a-z0-9.-]*-random-[a-z0-9_]+\.(gguf|tmp)")   # benchmark.shape_path
_KERNEL_FOLDER = re.compile(r"[0-9a-f]{16}")            # jit.kernel_cache_dir: a source digest
_KERNEL_FILE = re.compile(r".+\.(nbi|nbc)")             # Numba's index and data files
_TEMPORARY = re.compile(r"\.edgellama-(prompt|tiles)-.+\.tmp")   # a killed save's leftover


def _regular(p: Path) -> bool:
    return p.is_file() and not p.is_symlink()


def _kernel_files(folder: Path) -> list[Path]:
    """Numba's cache files under folder; links (to files or folders) never followed."""
    return [Path(top) / f for top, _, files in os.walk(folder) for f in sorted(files)
            if _KERNEL_FILE.fullmatch(f) and _regular(Path(top) / f)]


def _remove_kernels(folder: Path) -> None:
    """The kernel files under folder, then the folders left empty; nothing else."""
    for p in _kernel_files(folder):
        p.unlink(missing_ok=True)
    for top, _, _ in sorted(os.walk(folder), key=lambda w: -len(w[0])):
        with contextlib.suppress(OSError):
            os.rmdir(top)                             # only if nothing else is left in it


def _other_own_files(own: Path, listed: list[CachedModel]) -> list[CachedModel]:
    """What else edgellama keeps in its cache folder: bench's random-weight models,
    compiled kernels, the chat history, and files a killed run left (temporaries,
    unreadable tiles): each by a name `rm` takes."""
    found = []
    bench = own / "bench"
    if bench.is_dir() and not bench.is_symlink():
        for p in sorted(bench.iterdir()):
            if _BENCH_FILE.fullmatch(p.name) and _regular(p):
                kind = ("random-weight model of `edgellama bench`" if p.suffix == ".gguf"
                        else "unfinished file of an interrupted `edgellama bench`")
                found.append(CachedModel(f"bench/{p.name}", _size(p), p, kind, p.unlink))
    kernels = own / "numba"
    if kernels.is_dir() and not kernels.is_symlink():
        for d in sorted(kernels.iterdir()):
            files = _kernel_files(d) if _KERNEL_FOLDER.fullmatch(d.name) and d.is_dir() \
                and not d.is_symlink() else []
            if files:                     # an empty one is made by any run: nothing to show
                found.append(CachedModel(f"kernels/{d.name}", sum(_size(f) or 0 for f in files),
                                         d, f"compiled kernels: {len(files)} files (compiled "
                                         f"again when needed)", lambda d=d: _remove_kernels(d)))
    history = own / "chat_history"
    if _regular(history):
        found.append(CachedModel("chat_history", _size(history), history,
                                 "what you typed in `edgellama chat` (Up recalls it)",
                                 history.unlink))
    listed_paths = {m.path for m in listed}
    for folder, what in (("tiles", "start-up tiles"), ("prompts", "saved prompt")):
        d = own / folder
        if not d.is_dir() or d.is_symlink():
            continue
        for p in sorted(d.iterdir()):
            if p in listed_paths or not _regular(p):
                continue
            if _TEMPORARY.fullmatch(p.name):
                kind = f"{what}, unfinished (its run was stopped)"
            elif folder == "tiles" and p.suffix == ".tiles":
                kind = "start-up tiles, unreadable (made again when needed)"
            else:
                continue                              # not ours: never listed, never removed
            found.append(CachedModel(f"{folder}/{p.name}", _size(p), p, kind, p.unlink))
    return found


MAX_UNLISTED = 100_000     # files counted at most (EDGELLAMA_CACHE=~ must not walk a home)


def unlisted_files(listed: list[CachedModel]) -> tuple[int, int]:
    """(files, bytes) in edgellama's cache folder that `listed` does not account for:
    not made by edgellama (EDGELLAMA_CACHE may name a folder of the user's), left alone.
    Counting stops at MAX_UNLISTED files."""
    from .default_model import cache_dir
    own = cache_dir()
    if not own.is_dir() or own.is_symlink():
        return 0, 0
    claimed = set()
    for m in listed:
        claimed.update(_kernel_files(m.path) if m.name.startswith("kernels/") else [m.path])
    n = size = 0
    for top, _, files in os.walk(own):
        for f in files:
            p = Path(top) / f
            if p not in claimed:
                with contextlib.suppress(OSError):
                    size += p.lstat().st_size
                    n += 1
                if n >= MAX_UNLISTED:
                    return n, size
    return n, size
