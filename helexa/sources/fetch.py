"""A hub repository onto this machine: which of its files a model needs (a checkpoint's
weights, config and tokenizer; a GGUF repository's one quantization, every part of a split
file), fetched in parallel (bounded) into the source's cache, with progress.

`list_repo` reads the repository's file list (names and sizes, and what the cache already
holds: one cheap request), `select` picks the files, `fetch` does both and downloads.
Progress is read from the cache itself (the bytes of the files being written), not from the
client library's progress bars, so it holds whatever way the library transfers: a download
that ends within `QUIET_S` reports nothing; a longer one reports at most every `EVERY_S`.
"""

from __future__ import annotations

import contextlib
import fnmatch
import itertools
import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from helexa.sources.hub import HubSource

# A tokenizer's files, as a GGUF's base repository gives them (fetch_tokenizer).
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
    "chat_template.json",
)  # fmt: skip
# Files a checkpoint directory needs besides weights (no *.bin, no original/ checkpoints).
CHECKPOINT_PATTERNS = ("*.json", "*.safetensors", "*.jinja", "*.txt", "tokenizer.model")
PARALLEL_FILES = 4  # files downloaded at once: enough to fill a link, few enough for a disk
QUIET_S = 0.5  # a download done within this reports no progress
EVERY_S = 2.0  # at most one progress report this often
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
# a GGUF quantization's name as a file or folder name carries it: Q4_K_M, IQ3_XXS, Q8_0,
# BF16, F16, MXFP4_MOE, UD-Q4_K_XL (unsloth's dynamic quants keep their prefix)
_QUANT = re.compile(
    r"(?:UD-)?(?:I?Q\d(?:_[A-Z0-9]+)*|BF16|F16|F32|MXFP4(?:_[A-Z0-9]+)*|TQ\d_\d)",
    re.IGNORECASE,
)


class SourceError(Exception):
    """A repository that cannot be fetched as asked; `kind` is the node's error kind
    (model_not_found, invalid_quant, source_unreachable, source_unauthorized) and
    `suggestion` what to do. The message never holds a token."""

    def __init__(self, kind: str, message: str, suggestion: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.suggestion = suggestion


@dataclass(frozen=True, slots=True)
class RepoFile:
    name: str
    size: int | None
    cached: bool = False


@dataclass(frozen=True, slots=True)
class Progress:
    """A download as it stands: bytes written of the bytes it fetches, the rate over the
    last report's window, and the time left at that rate (None: not yet known)."""

    repo: str
    done: int
    total: int
    rate: float
    eta_s: float | None
    files: int

    def line(self) -> str:
        eta = "?" if self.eta_s is None else f"{self.eta_s:.0f}s"
        pct = 100 * self.done / self.total if self.total else 0.0
        return (
            f"downloading {self.repo}: {_size(self.done)} of {_size(self.total)} ({pct:.0f}%), "
            f"{_size(self.rate)}/s, {self.files} files, ETA {eta}"
        )

    def to_dict(self) -> dict:
        return {
            "repo": self.repo,
            "bytes_done": self.done,
            "bytes_total": self.total,
            "bytes_per_s": round(self.rate),
            "eta_s": None if self.eta_s is None else round(self.eta_s, 1),
            "files": self.files,
        }


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


# -- what the repository holds ----------------------------------------------------------------
def list_repo(source: HubSource, repo_id: str, revision: str | None = None) -> list[RepoFile]:
    """The repository's files with their sizes and whether the cache holds each (the repo's
    info: one request); offline, what the cache holds of it. SourceError when it cannot be
    read."""
    from huggingface_hub import HfApi, try_to_load_from_cache

    if source.offline:
        return _cached_files(source, repo_id, revision)
    api = HfApi(endpoint=source.endpoint, token=source.client_token())
    info = _call(
        source, repo_id, lambda: api.model_info(repo_id, revision=revision, files_metadata=True)
    )
    files = []
    for sibling in info.siblings or []:
        hit = try_to_load_from_cache(
            repo_id, sibling.rfilename, cache_dir=source.cache_dir, revision=info.sha
        )
        files.append(RepoFile(sibling.rfilename, sibling.size, isinstance(hit, str)))
    return files


def _cached_files(source: HubSource, repo_id: str, revision: str | None) -> list[RepoFile]:
    """What the cache holds of the repository at `revision` (a branch or tag as the cache
    last saw it, or a commit), read from its snapshot folder: offline, nothing else knows."""
    repo = source.cache_dir / ("models--" + repo_id.replace("/", "--"))
    rev = revision or "main"
    commit = rev
    if not re.fullmatch(r"[0-9a-f]{40}", rev):
        try:
            commit = (repo / "refs" / rev).read_text().strip()
        except OSError:
            commit = ""
    local = repo / "snapshots" / commit if commit else None
    if local is None or not local.is_dir():
        raise SourceError(
            "model_not_found",
            f"{repo_id!r} on {source.name}: not in the cache ({source.cache_dir}), and the "
            "source is offline",
            f"download it where the hub is reachable, or set [sources.{source.name}] "
            "offline = false (and HF_HUB_OFFLINE unset)",
        )
    return [
        RepoFile(p.relative_to(local).as_posix(), p.stat().st_size, True)
        for p in sorted(local.rglob("*"))
        if p.is_file()
    ]


def gguf_quants(files: list[RepoFile]) -> dict[str, list[RepoFile]]:
    """The repository's GGUF files by quantization name (upper case), each split file's
    parts together in order. A file whose name carries no quant is listed under its stem."""
    out: dict[str, list[RepoFile]] = {}
    for f in files:
        if not f.name.lower().endswith(".gguf") or "mmproj" in f.name.lower():
            continue
        out.setdefault(quant_of(f.name), []).append(f)
    return {q: sorted(fs, key=lambda f: f.name) for q, fs in sorted(out.items())}


def quant_of(name: str) -> str:
    """The quantization a GGUF file's path names (the last match in its file name, else in
    its folders), upper case; else its stem."""
    parts = name.split("/")
    stem = _SPLIT.sub("", parts[-1])
    stem = stem[: -len(".gguf")] if stem.lower().endswith(".gguf") else stem
    for part in (stem, *reversed(parts[:-1])):
        tokens = [t for t in re.split(r"[-.]", part) if t]
        # "UD-Q4_K_XL" spans two tokens
        joined = [f"{a}-{b}" for a, b in itertools.pairwise(tokens)]
        for token in reversed([*tokens, *joined]):
            if _QUANT.fullmatch(token):
                return token.upper()
    return stem


def is_gguf_repo(files: list[RepoFile]) -> bool:
    """GGUF files and no checkpoint to load instead (no safetensors weights)."""
    names = [f.name.lower() for f in files]
    return any(n.endswith(".gguf") for n in names) and not any(
        n.endswith(".safetensors") for n in names
    )


def select(repo_id: str, files: list[RepoFile], gguf_quant: str | None) -> list[RepoFile]:
    """The files a model load needs: the asked quantization's GGUF parts (where one is asked
    for, or the repository holds only GGUF files), else the checkpoint's files. SourceError
    naming the quants there are when the asked one is absent or none is asked of a GGUF
    repository with several."""
    quants = gguf_quants(files)
    if gguf_quant is None and not is_gguf_repo(files):
        chosen = [f for f in files if _checkpoint_file(f.name)]
        if not chosen:
            raise SourceError(
                "model_not_found",
                f"{repo_id!r} holds no model files (config.json, *.safetensors or *.gguf)",
                "check the repository id",
            )
        return chosen
    if not quants:
        raise SourceError(
            "invalid_quant",
            f"{repo_id!r} has no GGUF files; quant {gguf_quant!r} names a GGUF file",
            "leave quant out to load the checkpoint, or name 'int8' / 'int4' to quantize it",
        )
    listed = ", ".join(quants)
    if gguf_quant is None:
        if len(quants) == 1:
            return next(iter(quants.values()))
        raise SourceError(
            "invalid_quant",
            f"{repo_id!r} is a GGUF repository with one file per quantization; name one: {listed}",
            f"quant = {_preferred(list(quants))!r}",
        )
    want = gguf_quant.upper().replace("-", "_")
    for name, parts in quants.items():
        if name.replace("-", "_") == want or name.removeprefix("UD-").replace("-", "_") == want:
            return parts
    raise SourceError(
        "invalid_quant",
        f"{repo_id!r} has no {gguf_quant} file; its quants: {listed}",
        f"quant = {_preferred(list(quants))!r}",
    )


def _preferred(quants: list[str]) -> str:
    """What to suggest: Q4_K_M where there is one (what most users run), else the first."""
    for q in ("Q4_K_M", "UD-Q4_K_XL", "Q4_K_S", "Q4_0", "Q4_1", "Q5_K_M", "Q6_K", "Q8_0"):
        if q in quants:
            return q
    return quants[0]


def _checkpoint_file(name: str) -> bool:
    return "/" not in name and any(fnmatch.fnmatch(name, p) for p in CHECKPOINT_PATTERNS)


# -- fetching -----------------------------------------------------------------------------------
class RepoReader:
    """What a check may read of a repository before its download: one small JSON file
    (fetched into the cache alone), or the first bytes of a large one (a GGUF's header)."""

    def __init__(
        self, source: HubSource, repo_id: str, revision: str | None, files: list[RepoFile]
    ) -> None:
        self.source, self.repo_id, self.revision, self.files = source, repo_id, revision, files

    def json(self, name: str) -> dict | None:
        """The file `name` parsed, None where the repository has none."""
        return _read_json(self.source, self.repo_id, self.revision, self.files, name)

    def head(self, name: str, size: int = 1 << 20) -> bytes | None:
        """The first `size` bytes of `name` (one ranged request; from the cache where it holds
        the file), None where they cannot be read."""
        import httpx
        from huggingface_hub import hf_hub_url, try_to_load_from_cache

        cached = try_to_load_from_cache(
            self.repo_id, name, cache_dir=self.source.cache_dir, revision=self.revision
        )
        if isinstance(cached, str):
            with open(cached, "rb") as f:
                return f.read(size)
        if self.source.offline:
            return None
        url = hf_hub_url(self.repo_id, name, revision=self.revision, endpoint=self.source.endpoint)
        headers = {"Range": f"bytes=0-{size - 1}"}
        if self.source.token:
            headers["Authorization"] = f"Bearer {self.source.token}"
        try:  # httpx drops Authorization on a redirect to another host (the hub's CDN)
            r = httpx.get(url, headers=headers, follow_redirects=True, timeout=30)
        except httpx.HTTPError:
            return None
        return r.content[:size] if r.status_code in (200, 206) else None


# what a caller checks before anything large downloads: the files chosen, and what it may
# read of the repository first (its config.json, a GGUF's header)
Check = Callable[[list[RepoFile], RepoReader], None]


def fetch(
    source: HubSource,
    repo_id: str,
    *,
    revision: str | None = None,
    gguf_quant: str | None = None,
    progress: Callable[[Progress], None] | None = None,
    check: Check | None = None,
) -> Path:
    """The local path of what a load of `repo_id` needs (its snapshot directory, or its
    selected GGUF file: a split file's first part, the rest beside it), downloaded into the
    source's cache when missing. `check` sees the chosen files (and may read the repo's
    small JSON files) first, and raises to stop before the download. SourceError when the
    repository cannot be read or has no such file."""
    from huggingface_hub import snapshot_download

    listed = list_repo(source, repo_id, revision)
    files = select(repo_id, listed, gguf_quant)
    if check is not None:
        check(files, RepoReader(source, repo_id, revision, listed))
    names = [f.name for f in files]
    missing = [f for f in files if not f.cached]
    watch = None
    if missing and progress is not None and not source.offline:
        total = sum(f.size or 0 for f in missing)
        watch = _Watch(source, repo_id, total, len(missing), progress)
        watch.start()
    try:
        local = Path(
            _call(
                source,
                repo_id,
                lambda: snapshot_download(
                    repo_id, revision=revision, cache_dir=source.cache_dir,
                    endpoint=source.endpoint, token=source.client_token(),
                    allow_patterns=names, max_workers=PARALLEL_FILES,
                    local_files_only=source.offline,
                ),
            )
        )  # fmt: skip
    finally:
        if watch is not None:
            watch.stop()
    gguf = [n for n in names if n.lower().endswith(".gguf")]
    if gguf and (gguf_quant is not None or is_gguf_repo(files)):
        return local / gguf[0]
    return local


def gguf_architecture(head: bytes) -> str | None:
    """`general.architecture` from the first bytes of a GGUF file (its header's key-value
    pairs, read until that key), None where the bytes do not reach it or are not GGUF."""
    import struct

    if head[:4] != b"GGUF":
        return None
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
    pos = 24  # magic, version (u32), tensor count (u64), key-value count (u64)

    def take(n: int) -> bytes:
        nonlocal pos
        if pos + n > len(head):
            raise EOFError
        out, pos = head[pos : pos + n], pos + n
        return out

    def string() -> bytes:
        return take(struct.unpack("<Q", take(8))[0])

    def skip(kind: int) -> None:
        if kind == 8:
            string()
        elif kind == 9:
            inner, count = struct.unpack("<IQ", take(12))
            for _ in range(count):
                skip(inner)
        else:
            take(sizes[kind])

    try:
        (count,) = struct.unpack("<Q", head[16:24])
        for _ in range(count):
            key = string()
            (kind,) = struct.unpack("<I", take(4))
            if key == b"general.architecture" and kind == 8:
                return string().decode("utf-8", "replace")
            skip(kind)
    except (EOFError, KeyError, struct.error):
        return None
    return None


def _read_json(
    source: HubSource, repo_id: str, revision: str | None, files: list[RepoFile], name: str
) -> dict | None:
    """One small JSON file of the repository (fetched into the cache alone), or None."""
    from huggingface_hub import hf_hub_download

    if name not in {f.name for f in files}:
        return None
    path = _call(
        source,
        repo_id,
        lambda: hf_hub_download(
            repo_id, name, revision=revision, cache_dir=source.cache_dir,
            endpoint=source.endpoint, token=source.client_token(),
            local_files_only=source.offline,
        ),
    )  # fmt: skip
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise SourceError("model_not_found", f"{repo_id!r}: {name} is not JSON ({e})") from None


def _call(source: HubSource, repo_id: str, fn: Callable):
    """`fn()` (a huggingface_hub call), its errors as SourceError without the token."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{repo_id!r} on {source.name} ({source.endpoint})"
    try:
        with _library_online(not source.offline):
            return fn()
    except (RepositoryNotFoundError, GatedRepoError) as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status in (401, 403) or isinstance(e, GatedRepoError):
            raise SourceError(
                "source_unauthorized",
                f"{where}: access refused ({status or 'gated'})",
                f"set a token for [sources.{source.name}] (token, or token_env naming the "
                "variable that holds it) with access to the repository",
            ) from None
        raise SourceError(
            "model_not_found", f"{where}: no such repository", "check the repository id"
        ) from None
    except RevisionNotFoundError:
        raise SourceError(
            "model_not_found", f"{where}: no such revision", "check the revision"
        ) from None
    except LocalEntryNotFoundError:
        raise SourceError(
            "model_not_found",
            f"{where}: not in the cache ({source.cache_dir}), and the source is offline or "
            "unreachable",
            f"download it where the hub is reachable, or set [sources.{source.name}] "
            "offline = false",
        ) from None
    except HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status in (401, 403):
            raise SourceError(
                "source_unauthorized",
                f"{where}: access refused ({status})",
                f"set a token for [sources.{source.name}] with access to the repository",
            ) from None
        raise SourceError(
            "source_unreachable", source.scrub(f"{where}: {e}".splitlines()[0]), None
        ) from None
    except Exception as e:  # connection refused, DNS, timeouts (the HTTP client's own), disk
        raise SourceError(
            "source_unreachable", source.scrub(f"{where}: {type(e).__name__}: {e}"), None
        ) from None


_online_lock = threading.Lock()
_online_calls = [0, False]  # calls in flight that need the network; the library's own setting


@contextlib.contextmanager
def _library_online(online: bool):
    """huggingface_hub reads HF_HUB_OFFLINE once, at import, for the whole process; here
    each source's `offline` decides (its table's key, else that variable), so a call of an
    online source runs with the library's switch off, put back after the last such call."""
    if not online:
        yield
        return
    from huggingface_hub import constants

    with _online_lock:
        if _online_calls[0] == 0:
            _online_calls[1] = constants.HF_HUB_OFFLINE
        _online_calls[0] += 1
        constants.HF_HUB_OFFLINE = False
    try:
        yield
    finally:
        with _online_lock:
            _online_calls[0] -= 1
            if _online_calls[0] == 0:
                constants.HF_HUB_OFFLINE = _online_calls[1]


class _Watch:
    """Reads a download's progress from the cache (the blobs being written, and those done
    since it began) on a thread, and reports it after QUIET_S, then at most every EVERY_S."""

    def __init__(
        self, source: HubSource, repo_id: str, total: int, files: int, report
    ) -> None:  # fmt: skip
        self.blobs = source.cache_dir / ("models--" + repo_id.replace("/", "--")) / "blobs"
        self.repo, self.total, self.files, self.report = repo_id, total, files, report
        self.before = set(self._sizes())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="helexa-download", daemon=True)

    def _sizes(self) -> dict[str, int]:
        out = {}
        with contextlib.suppress(OSError):  # no blobs yet
            for p in self.blobs.iterdir():
                with contextlib.suppress(OSError):  # renamed as we looked
                    out[p.name] = p.stat().st_size
        return out

    def done(self) -> int:
        sizes = self._sizes()
        return sum(n for name, n in sizes.items() if name not in self.before)

    def start(self) -> None:
        self.t0 = time.monotonic()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        if time.monotonic() - self.t0 >= QUIET_S:  # the last word: done
            self.report(Progress(self.repo, self.total, self.total, 0.0, 0.0, self.files))

    def _run(self) -> None:
        if self._stop.wait(QUIET_S):
            return
        last_t, last_done = self.t0, 0
        while True:
            now, done = time.monotonic(), min(self.done(), self.total)
            rate = (done - last_done) / max(now - last_t, 1e-6)
            left = self.total - done
            eta = left / rate if rate > 0 else None
            self.report(Progress(self.repo, done, self.total, rate, eta, self.files))
            last_t, last_done = now, done
            if self._stop.wait(EVERY_S):
                return


def fetch_tokenizer(source: HubSource, repo_id: str) -> Path | None:
    """The snapshot directory holding `repo_id`'s tokenizer files (a GGUF's base repository:
    its tokenizer.json and chat template), fetched alone; None where the repository has no
    tokenizer.json or cannot be read (the caller keeps the GGUF's own)."""
    from huggingface_hub import snapshot_download

    try:
        files = list_repo(source, repo_id)
        names = [f.name for f in files if f.name in TOKENIZER_FILES]
        if "tokenizer.json" not in names:
            return None
        return Path(
            _call(
                source,
                repo_id,
                lambda: snapshot_download(
                    repo_id, cache_dir=source.cache_dir, endpoint=source.endpoint,
                    token=source.client_token(), allow_patterns=names,
                    local_files_only=source.offline,
                ),
            )
        )  # fmt: skip
    except SourceError:
        return None
