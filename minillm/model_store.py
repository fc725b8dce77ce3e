"""The model store: a local directory as it is, or a hub id in the Hugging Face cache (shared with
transformers, vLLM and huggingface-cli), fetched on first use; the same from any working directory."""
from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# Only what the engine reads: weights, configs, tokenizer files and chat templates.
DOWNLOAD_PATTERNS = ["*.safetensors", "*.json", "*.jinja", "tokenizer*", "merges.txt", "vocab.txt"]
# What a tokenizer given apart from the model (vLLM's tokenizer) is read from: its files and chat templates.
TOKENIZER_PATTERNS = ["tokenizer*", "special_tokens_map.json", "added_tokens.json", "chat_template.json", "*.jinja"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")    # org/name, or a legacy bare name
# How far the "did you mean" search for a mistyped local path looks, so it stays instant.
_NEARBY_DEPTH = 3
_NEARBY_MAX_DIRS = 4000
_SKIPPED_DIRS = {"node_modules", "__pycache__", "site-packages", "blobs"}


def expand_user(path: str | os.PathLike) -> Path:
    """PATH with a leading ~ or ~user expanded; a ~user that names no user stays as written
    (Path.expanduser raised RuntimeError "Could not determine home directory.", naming nothing, and
    so did an inline chat template that starts with ~)."""
    return Path(os.path.expanduser(path))


def hf_hub_cache() -> Path:
    """The Hugging Face hub cache, by huggingface_hub's rules, read now (it reads them once, at import)."""
    env = os.environ
    explicit = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return expand_user(explicit)
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return expand_user(home) / "hub"


def check_store(download_dir: str | None = None) -> None:
    """A ValueError naming the environment variable ($HF_HUB_CACHE, $HF_HOME, ...) the Hugging Face cache
    comes from when the cache is a file or lies under one (its files would be fetched into a file);
    a download_dir is its caller's option to name."""
    if download_dir:
        return
    store = hf_hub_cache()
    existing = next((p for p in (store, *store.parents) if p.exists()), None)
    if existing is None or existing.is_dir():
        return
    name, value = _cache_variable()
    under = "" if existing == expand_user(value) else f" ({existing} is a file)"
    raise ValueError(f"{name} {value} is not a directory{under}: it holds the Hugging Face cache, where hub "
                     f"models are stored")


def _cache_variable() -> tuple[str, str]:
    """(the name, the value) of what hf_hub_cache() read the cache's place from."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        if os.environ.get(name):
            return f"${name}", os.environ[name]
    return "the default cache", "~/.cache/huggingface"


def model_store(download_dir: str | None = None) -> Path:
    """Where hub models live: download_dir (laid out as a Hugging Face cache) or the shared cache."""
    return expand_user(download_dir).resolve() if download_dir else hf_hub_cache()


def is_repo_id(model: str) -> bool:
    """Whether MODEL has the form of a Hugging Face repo id (org/name, or a bare legacy name)."""
    return bool(_REPO_ID.match(model)) and ".." not in model and "--" not in model and not model.endswith(".git")


def _looks_like_path(model: str) -> bool:
    return (model.startswith((".", "/", "~")) or model.count("/") > 1 or model.endswith("/")
            or (os.sep != "/" and os.sep in model))


# ---- resolving a name ------------------------------------------------------------------------------


def resolve_model_path(model: str, download_dir: str | None = None, revision: str | None = None) -> Path:
    """A local model directory as is; a hub id from the store (at revision: a branch, tag or commit),
    fetched into it when missing."""
    if isinstance(model, str) and not model.strip():     # expand_user("") is the current directory
        raise ValueError("model is empty: give a model directory or a Hugging Face repo id")
    if isinstance(revision, str) and not revision.strip():
        raise ValueError("revision is empty: give a branch, tag or commit, or leave it None (main)")
    path = expand_user(model)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model directory {path} has no config.json{broken_link(path / 'config.json', ' (')}"
                             f"{_holds_instead(path)}")
        if revision is not None:
            raise ValueError(f"revision {revision!r} names a version of a hub model; {model} is a local directory")
        return path
    if path.exists():
        hint = ""
        if path.suffix.lower() == ".gguf":
            hint = f"; GGUF files (llama.cpp, Ollama) are not read: {_GIVE_HF_MODEL}"
        elif path.suffix.lower() in (".safetensors", ".json", ".bin"):
            hint = f"; give the directory that holds it ({path.parent})"
        raise ValueError(f"{model} is a file, not a model directory{hint}")
    if path.is_symlink():        # a link to nothing, or a loop of links: a path here, not a hub id
        raise FileNotFoundError(f"no such directory: {model}{broken_link(path, ': ')}")
    if _looks_like_path(model) or not is_repo_id(model) or expand_user(model.split("/")[0]).is_dir():
        # A path (or its first folder exists here): the user meant a directory, not the hub.
        raise FileNotFoundError(no_such_directory(model))
    check_store(download_dir)
    cached = cached_snapshot(model, download_dir, revision)
    if cached is not None:
        return cached
    return download_model(model, download_dir, revision)


_GIVE_HF_MODEL = "give a Hugging Face model directory (config.json, tokenizer.json and safetensors weights) or a hub id"


def _holds_instead(path: Path) -> str:
    """What a directory without config.json holds in place of a Hugging Face model, and what to give
    instead: GGUF files, Mistral's own params.json, or a model's folder in a Hugging Face cache; "" otherwise."""
    try:
        ggufs = sorted(f.name for f in path.glob("*.gguf"))
    except OSError:
        return ""
    if ggufs:
        more = f" and {len(ggufs) - 1} more" if len(ggufs) > 1 else ""
        return f"; it holds GGUF files ({ggufs[0]}{more}), which minillm does not read: {_GIVE_HF_MODEL}"
    if (path / "params.json").is_file():
        return ("; it holds params.json, Mistral's own format (vLLM's --config-format mistral), which minillm does not "
                f"read: {_GIVE_HF_MODEL}")
    if path.name.startswith("models--") and (path / "snapshots").is_dir():
        repo_id = path.name[len("models--"):].replace("--", "/", 1)
        store = "" if path.parent.resolve() == hf_hub_cache().resolve() else \
            f", and {path.parent} as the download directory (--download-dir)"
        return f"; it is a model's folder in a Hugging Face cache: give the hub id {repo_id}{store}"
    return ""


def resolve_tokenizer_path(tokenizer: str | os.PathLike, download_dir: str | None = None,
                           revision: str | None = None, model_revision: str | None = None) -> Path:
    """vLLM's tokenizer: a local directory holding tokenizer.json as it is; a hub id's tokenizer files
    from the store, fetched into it when missing, at REVISION (vLLM's tokenizer_revision), else at the
    model's (MODEL_REVISION, as vLLM defaults it). A ValueError naming tokenizer when there is none."""
    name = os.fspath(tokenizer)
    path = expand_user(name)
    if path.is_dir():
        if revision is not None:
            raise ValueError(f"tokenizer_revision {revision!r} names a version of a hub tokenizer; {name} is a "
                             f"local directory")
        if not (path / "tokenizer.json").is_file():
            from minillm.tokenizer import no_tokenizer_json
            raise ValueError(f"tokenizer {no_tokenizer_json(path)}")
        return path
    if path.exists():
        raise ValueError(f"tokenizer {name} is a file, not a directory (give the directory that holds it: "
                         f"{path.parent})")
    if path.is_symlink() or _looks_like_path(name) or not is_repo_id(name) \
            or expand_user(name.split("/")[0]).is_dir():
        raise ValueError(f"tokenizer: {no_such_directory(name)}{broken_link(path, ': ')}")
    check_store(download_dir)
    revision = revision if revision is not None else model_revision
    has_tokenizer = lambda snapshot: (snapshot / "tokenizer.json").is_file()   # noqa: E731
    path = cached_snapshot(name, download_dir, revision, is_complete=has_tokenizer)
    if path is None:
        try:
            path = _fetch(name, download_dir, revision, True, TOKENIZER_PATTERNS)
        except RuntimeError as exc:
            raise ValueError(f"tokenizer: {exc}") from exc
    if not has_tokenizer(path):
        raise ValueError(f"tokenizer {name!r} was fetched into {path} but has no tokenizer.json (only fast Hugging "
                         f"Face tokenizers are supported)")
    return path


def broken_link(path: Path, lead: str) -> str:
    """LEAD and why PATH, a symbolic link, leads nowhere ("it is a symbolic link to /gone, which does
    not exist"), closed by a parenthesis when LEAD opens one; "" when PATH is no link."""
    if not path.is_symlink():
        return ""
    try:
        path.resolve(strict=True)
        why = f"it is a symbolic link to {os.readlink(path)}, which cannot be read"
    except FileNotFoundError:
        why = f"it is a symbolic link to {os.readlink(path)}, which does not exist"
    except (OSError, RuntimeError):     # ELOOP; Python before 3.13 raises RuntimeError for a loop
        why = f"it is a symbolic link in a loop of links ({path} -> {os.readlink(path)} -> ...)"
    return f"{lead}{why}{')' if lead.endswith('(') else ''}"


def no_such_directory(model: str) -> str:
    """The message for a local path that does not exist, with a near match when one is close by."""
    message = f"no such directory: {model}"
    if not is_repo_id(model) and not _looks_like_path(model):
        rule = " of the form org/name"
        if _REPO_ID.match(model):
            rule = ": those have no '--' or '..' and do not end in .git"
        message += f" (and it is not a Hugging Face repo id{rule})"
    matches = nearby_model_dirs(Path(model).name)
    if matches:
        message += f"; did you mean {' or '.join(matches[:2])}?"
    return message


def nearby_model_dirs(name: str) -> list[str]:
    """Model directories called NAME within a few levels of the working directory and its parent."""
    if not name or name in (".", ".."):
        return []
    cwd = Path.cwd()
    found: list[Path] = []
    visited = 0
    for root in (cwd, cwd.parent):
        frontier = [root]
        for _ in range(_NEARBY_DEPTH + 1):
            children = []
            for folder in frontier:
                if (folder / name / "config.json").is_file() and folder / name not in found:
                    found.append(folder / name)
                try:
                    entries = sorted(os.scandir(folder), key=lambda e: e.name)
                except OSError:
                    continue
                for entry in entries:
                    visited += 1
                    if visited > _NEARBY_MAX_DIRS:
                        return [_shown(p, cwd) for p in found]
                    # Links are followed (a shared folder is often one); the depth bounds any loop.
                    if (not entry.name.startswith(".") and entry.name not in _SKIPPED_DIRS
                            and Path(entry.path) != cwd and _is_dir(entry)):
                        children.append(Path(entry.path))
            frontier = children
    return [_shown(p, cwd) for p in found]


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()
    except OSError:   # a dangling link, or no permission
        return False


def _shown(path: Path, cwd: Path) -> str:
    """PATH as the user would type it from CWD."""
    relative = os.path.relpath(path, cwd)
    return relative if relative.startswith("..") else f"./{relative}"


def read_json_object(path: Path, missing_ok: bool = False) -> dict:
    """The JSON object in the file at path; ValueError naming the file when it is not valid JSON (or
    not UTF-8) or not an object; a missing file is {} with missing_ok, else a ValueError."""
    if not path.is_file():
        if missing_ok:
            return {}
        raise ValueError(f"model directory {path.parent} has no {path.name}")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except ValueError as exc:      # not JSON, or not UTF-8
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def index_weight_map(index: Path) -> dict[str, str]:
    """The weight_map of a model.safetensors.index.json (tensor name -> shard file); ValueError naming
    the file when it is no such index."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    except (ValueError, AttributeError) as exc:    # not JSON, not UTF-8, or not an object
        raise ValueError(f"{index} is not a safetensors index: {exc}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise ValueError(f"{index} is not a safetensors index: its weight_map must map tensor names to files")
    outside = sorted({f for f in weight_map.values() if not _inside_directory(f)})
    if outside:
        raise ValueError(f"{index} names shard {outside[0]!r}, which is not a file of the model directory: "
                         f"an index names its shards by their paths inside it")
    return weight_map


def _inside_directory(name: str) -> bool:
    """Whether a relative path names something inside its directory (read lexically: a hub snapshot's
    files are links out of it)."""
    norm = os.path.normpath(name)
    return bool(name) and not os.path.isabs(name) and norm != "." and norm != ".." \
        and not norm.startswith(".." + os.sep)


def index_weight_files(index: Path) -> set[str]:
    """The shard files a model.safetensors.index.json names; ValueError naming the file when it is no such index."""
    return set(index_weight_map(index).values())


def weights_index(path: Path) -> Path | None:
    """The model.safetensors.index.json the weights of a model directory are read through, or None.
    As transformers' from_pretrained: a model.safetensors there is the checkpoint, past an index beside it."""
    index = path / "model.safetensors.index.json"
    return index if index.is_file() and not (path / "model.safetensors").is_file() else None


def _is_complete(path: Path) -> bool:
    """Whether a model directory has its config and every weight file it names (an index that
    cannot be read names none)."""
    if not (path / "config.json").is_file():
        return False
    index = weights_index(path)
    if index is not None:
        try:
            files = index_weight_files(index)
        except ValueError:
            return False
        return bool(files) and all((path / f).is_file() for f in files)
    single = path / "model.safetensors"
    if single.exists() or single.is_symlink():      # read alone (a link to a deleted blob is no file)
        return single.is_file()
    return any(f.is_file() for f in path.glob("*.safetensors"))


def _repo_folder(repo_id: str, download_dir: str | None) -> Path:
    """The cache folder of a model repo: <store>/models--<org>--<name>."""
    return model_store(download_dir) / ("models--" + repo_id.replace("/", "--"))


def _snapshots(folder: Path) -> list[Path]:
    """A repo's snapshots in the cache, the one refs/main names first, then the newest."""
    snapshots = folder / "snapshots"
    if not snapshots.is_dir():
        return []
    found = sorted((p for p in snapshots.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime, reverse=True)
    main = _read_ref(folder / "refs" / "main")
    if main:
        found.sort(key=lambda p: p != snapshots / main)
    return found


def _read_ref(ref: Path) -> str | None:
    """The commit a ref file of the cache names, or None when there is none it can be read from
    (missing, unreadable, not UTF-8: a damaged ref is no ref)."""
    try:
        return ref.read_text(encoding="utf-8").strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def cached_snapshot(repo_id: str, download_dir: str | None = None, revision: str | None = None,
                    is_complete: Callable[[Path], bool] = _is_complete) -> Path | None:
    """The complete snapshot of REPO_ID in the store (the one REVISION names, a ref or a commit, when
    given), or None (no network); is_complete says what a snapshot needs (a model's weights by default)."""
    folder = _repo_folder(repo_id, download_dir)
    if revision is None:
        return next((s for s in _snapshots(folder) if is_complete(s)), None)
    snapshot = folder / "snapshots" / (_read_ref(folder / "refs" / revision) or revision)
    return snapshot if snapshot.parent == folder / "snapshots" and is_complete(snapshot) else None


def _is_offline() -> bool:
    # Read at call time: huggingface_hub reads HF_HUB_OFFLINE once, at import.
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def download_model(repo_id: str, download_dir: str | None = None, revision: str | None = None,
                   could_be_path: bool = True) -> Path:
    """snapshot_download the files the engine needs into the store (huggingface_hub draws the bars).
    could_be_path: the name was also tried as a local directory (the error says so first)."""
    path = _fetch(repo_id, download_dir, revision, could_be_path, DOWNLOAD_PATTERNS)
    if _is_offline() and not _is_complete(path):     # huggingface_hub hands back what the store holds
        at = "" if revision is None else f" at revision {revision!r}"
        raise RuntimeError(f"{repo_id}{at}: HF_HUB_OFFLINE is set, so nothing is fetched, and its snapshot in "
                           f"the store ({path}) cannot be run: {_runnable_note(path)}")
    if not (path / "config.json").is_file():
        raise RuntimeError(f"model {repo_id!r} was fetched into {path} but has no config.json "
                           f"(minillm runs Hugging Face safetensors checkpoints)")
    return path


def _fetch(repo_id: str, download_dir: str | None, revision: str | None, could_be_path: bool,
           patterns: list[str]) -> Path:
    """snapshot_download the files of PATTERNS into the store; with DOWNLOAD_PATTERNS, the weights
    minillm reads and no others (weights_left_out). A RuntimeError saying why nothing came."""
    from huggingface_hub import snapshot_download

    store = model_store(download_dir)
    offline = _is_offline()
    try:
        ignore = None
        if not offline:
            files = _ask_hub(repo_id, revision)
            ignore = weights_left_out(repo_id, files) if patterns is DOWNLOAD_PATTERNS else None
        path = Path(snapshot_download(repo_id, revision=revision, cache_dir=str(store),
                                      allow_patterns=patterns, ignore_patterns=ignore,
                                      local_files_only=offline))
    except NoSafetensors:
        raise
    except Exception as e:   # offline, no such repo, gated repo, network error: all end the same way
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        reason = reason if len(reason) <= 200 else reason[:197] + "..."
        if offline:          # huggingface_hub's words point at its own local_files_only argument
            reason = "HF_HUB_OFFLINE is set, so nothing is fetched, and the store holds no snapshot of it"
        elif isinstance(e, HubUnreachable):
            reason = str(e)
        nearby = nearby_model_dirs(repo_id.split("/")[-1])
        hint = f" (did you mean {' or '.join(nearby[:2])}?)" if nearby else ""
        at = "" if revision is None else f" at revision {revision!r}"
        if not could_be_path:
            raise RuntimeError(f"{repo_id} could not be fetched{at} into {store} ({type(e).__name__}: {reason})") from e
        raise RuntimeError(f"no such directory: {repo_id}{hint}; as a Hugging Face repo id it could not be "
                           f"fetched{at} into {store} ({type(e).__name__}: {reason})") from e
    return path


class HubUnreachable(ConnectionError):
    """The Hugging Face Hub did not answer: no network, a wrong HF_ENDPOINT, a proxy that holds requests."""


# Names of the exceptions of HTTP clients (httpx, requests) for a request that got no answer.
_NETWORK_ERRORS = {"TimeoutException", "NetworkError", "ConnectError", "ConnectionError", "ProxyError", "Timeout"}


class NoSafetensors(RuntimeError):
    """A repo whose weights are all in another format (pytorch_model.bin, GGUF): nothing minillm reads."""


def weights_left_out(repo_id: str, files: list[str] | None) -> list[str] | None:
    """The ignore patterns for a repo of these files (None: the Hub did not list them): the other
    weight files beside a model.safetensors, a Mistral repo's consolidated.safetensors, a second
    copy of the weights beside the Hugging Face shards that minillm never reads (vLLM leaves it out
    likewise), and the safetensors in subfolders; NoSafetensors when no weights are safetensors."""
    if files is None:
        return None
    safetensors = [f for f in files if f.endswith(".safetensors")]
    if not safetensors:
        other = [f for f in files if f.endswith((".bin", ".pt", ".pth", ".gguf", ".ckpt"))]
        if other:
            raise NoSafetensors(f"{repo_id} has no safetensors weights ({', '.join(sorted(other)[:3])}"
                                f"{', ...' if len(other) > 3 else ''}); minillm reads safetensors checkpoints: "
                                f"pick a repo that has them, or convert (transformers' "
                                f"save_pretrained(..., safe_serialization=True))")
        return None
    top = [f for f in safetensors if "/" not in f]
    # The loader reads the weights at the top of the snapshot only, as transformers without subfolder=:
    # copies in folders of their own (a quantized variant, an export) are never read.
    nested = ["*/*.safetensors"] if top and len(top) < len(safetensors) else []
    if "model.safetensors" in top:
        # transformers fetches and reads model.safetensors alone (weights_index): the shards beside it
        # would be the weights a second time. Each is left out by its own name, escaped for fnmatch.
        others = [glob.escape(f) for f in top if f != "model.safetensors"]
        return others + nested or None
    hf = [f for f in top if not f.startswith("consolidated")]
    consolidated = ["consolidated*.safetensors"] if hf and len(hf) < len(top) else []
    return consolidated + nested or None


def _ask_hub(repo_id: str, revision: str | None) -> list[str] | None:
    """The files of the Hub's record of REPO_ID (None where it lists none), asked within
    $HF_HUB_ETAG_TIMEOUT seconds (10 by default), as huggingface_hub bounds its own metadata requests;
    HubUnreachable when no answer comes. snapshot_download asks the same with no timeout, so a Hub that
    takes the connection and never answers held it forever."""
    from huggingface_hub import HfApi, constants

    timeout = _etag_timeout()
    try:
        info = HfApi().model_info(repo_id, revision=revision, timeout=timeout)
    except Exception as exc:
        cause = _network_error(exc)
        if cause is None:
            raise             # an answer (no such repo or revision, gated, ...): snapshot_download's words
        endpoint = constants.ENDPOINT
        if "timeout" in type(cause).__name__.lower():
            what = f"did not answer within {timeout:g} s ($HF_HUB_ETAG_TIMEOUT)"
        else:
            what = f"cannot be reached ({type(cause).__name__}: {' '.join(str(cause).split()) or 'no answer'})"
        raise HubUnreachable(f"the Hugging Face Hub at {endpoint} {what}; check the network and $HF_ENDPOINT, "
                             f"or set HF_HUB_OFFLINE=1 to run only models already in the store") from None
    siblings = getattr(info, "siblings", None)
    return None if siblings is None else [sibling.rfilename for sibling in siblings]


def _etag_timeout() -> float:
    """$HF_HUB_ETAG_TIMEOUT read now (huggingface_hub reads it once, at import), 10 s when unset or unreadable."""
    try:
        value = float(os.environ.get("HF_HUB_ETAG_TIMEOUT", "10"))
    except ValueError:
        return 10.0
    return value if 0 < value < float("inf") else 10.0


def _network_error(exc: BaseException) -> BaseException | None:
    """The exception in EXC's chain that says no answer came (a refused connection, a timeout, no DNS)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if _NETWORK_ERRORS & {cls.__name__ for cls in type(exc).__mro__}:
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


# ---- listing the store -----------------------------------------------------------------------------


@dataclass(frozen=True)
class StoredModel:
    """One model repo in the store."""

    repo_id: str
    path: Path               # the snapshot minillm would load
    size_bytes: int          # the files of that snapshot
    note: str                # "" when minillm can run it, else why not


def list_local_models(download_dir: str | None = None) -> list[StoredModel]:
    """Every model repo in the store (whoever downloaded it), by name; a damaged one with why."""
    store = model_store(download_dir)
    if not store.is_dir():
        return []
    return [_stored_model(folder) for folder in sorted(store.glob("models--*"))]


def _stored_model(folder: Path) -> StoredModel:
    """The model repo in the cache FOLDER, as list shows it (what huggingface_hub's scan_cache_dir
    reports as corrupted is shown with why, not left out)."""
    repo_id = folder.name[len("models--"):].replace("--", "/", 1)
    if not folder.is_dir():
        return StoredModel(repo_id, folder, 0, f"damaged: {broken_link(folder, '') or 'not a directory'}")
    try:
        snapshots = _snapshots(folder)
    except OSError as exc:
        return StoredModel(repo_id, folder, 0, f"unreadable: {exc.strerror or exc}")
    if not snapshots:       # a pull stopped before its first file was done
        return StoredModel(repo_id, folder, _files_size(folder / "blobs"), "incomplete download (no snapshot)")
    path = next((s for s in snapshots if _is_complete(s)), snapshots[0])
    return StoredModel(repo_id, path, _files_size(path), _runnable_note(path))


def _files_size(folder: Path) -> int:
    """The bytes of the files under FOLDER (links followed); what cannot be read counts nothing."""
    size = 0
    for f in folder.rglob("*"):
        try:
            size += f.stat().st_size if f.is_file() else 0
        except OSError:
            pass
    return size


def _interrupted(snapshot: Path) -> bool:
    """Whether the repo of a cache SNAPSHOT holds a blob a download left unfinished (*.incomplete)."""
    return any((snapshot.parent.parent / "blobs").glob("*.incomplete"))


def _runnable_note(path: Path) -> str:
    """Why minillm cannot run the snapshot at PATH ("" when it can)."""
    from minillm.loader import config_architecture

    if not (path / "config.json").is_file():
        if (path / "config.json").is_symlink() or _interrupted(path):
            return "incomplete download (no config.json)"
        return "no config.json"
    if not _is_complete(path):
        if any(path.glob("*.safetensors")) or _interrupted(path):
            return "incomplete download"
        return "no safetensors weights"
    if not (path / "tokenizer.json").is_file():       # the only tokenizer minillm reads
        return "incomplete download (no tokenizer.json)" if _interrupted(path) else "no tokenizer.json"
    try:
        cfg = read_json_object(path / "config.json")
    except (OSError, ValueError):      # not JSON, not UTF-8, or not an object
        return "unreadable config.json"
    try:
        config_architecture(cfg)
    except ValueError:
        names = cfg.get("architectures") or cfg.get("model_type") or "unknown"
        return f"architecture {', '.join(map(str, names)) if isinstance(names, list) else names} not supported"
    return ""
