"""A load's hub ids fetched by the node itself before the model's worker starts: from the
`[sources.*]` table the id names (`NAME:org/name`; a bare `org/name` from [node]
default_source), with that source's endpoint, token, cache and offline flag. The worker is
handed local paths: tokens never leave the node's process (nor reach a command line), and the
download's progress is the node's to log and to show in `/health`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

from helexa.config import Config
from helexa.engine import EngineArgs
from helexa.engine.loader.load import BUNDLED_MODEL_ID
from helexa.node.discovery import device_stats
from helexa.node.loading import LoadError
from helexa.node.repo_check import repo_checker
from helexa.sources.fetch import Progress, SourceError, fetch, fetch_tokenizer
from helexa.sources.hub import split_ref

log = logging.getLogger(__name__)

# a source error's kind -> (status, Retry-After): a hub that cannot be reached is temporary
_STATUS = {"source_unreachable": (503, 30.0)}


class Downloads:
    """The downloads in flight, by model id: their latest progress (`/health`)."""

    def __init__(self) -> None:
        self.current: dict[str, Progress] = {}

    def report(self, model_id: str, progress: Progress) -> None:
        """From the download's thread: kept for `/health`, and logged (at most every
        fetch.EVERY_S, and only for a download slower than fetch.QUIET_S)."""
        self.current[model_id] = progress
        log.info("%s", progress.line())

    def to_list(self) -> list[dict]:
        return [{"model_id": m, **p.to_dict()} for m, p in list(self.current.items())]


async def fetch_refs(
    cfg: Config, model_id: str, args: EngineArgs, downloads: Downloads
) -> tuple[EngineArgs, str | None]:
    """`args` with its model (and draft model) fetched where they name hub repositories, as
    local paths, and, for a GGUF file of a hub repository, its base repository's tokenizer
    beside it where one is reachable (`tokenizer`, with its label for /models, else None);
    LoadError (422, or 503 for an unreachable hub) when a fetch fails."""
    model = await _fetched(cfg, model_id, args.model, args, downloads)
    draft = args.speculative_model
    if draft:
        draft = await _fetched(cfg, model_id, draft, None, downloads)
    if model == args.model and draft == args.speculative_model:
        return args, None
    kw: dict = {"speculative_model": draft}
    label = None
    if model != args.model:  # the revision and the GGUF quant chose the files fetched
        kw |= {"model": model, "revision": None, "gguf_quant": None}
        base = await asyncio.to_thread(base_tokenizer, cfg, args.model, Path(model))
        if base is not None:
            label, kw["tokenizer"] = base[0], str(base[1])
    return dataclasses.replace(args, **kw), label


def base_tokenizer(cfg: Config, ref: str, path: Path) -> tuple[str, Path] | None:
    """For a GGUF file fetched from a hub repository: its base repository's tokenizer
    directory and that repository's id, the first reachable of the one the file's metadata
    names (`general.base_model.0.repo_url`) and the repository's own id without `-GGUF`
    (what the seeds used); None where neither has a tokenizer.json."""
    hub = split_ref(ref, cfg.node.default_source)
    if hub is None or path.suffix != ".gguf" or (source := cfg.hubs.get(hub.source)) is None:
        return None
    candidates = []
    with contextlib.suppress(Exception):  # a file whose metadata does not read: no hint
        import gguf

        field = gguf.GGUFReader(path).fields.get("general.base_model.0.repo_url")
        if field is not None:
            url = urlsplit(str(field.contents()))
            if re.fullmatch(r"/?[^/\s]+/[^/\s]+/?", url.path):
                candidates.append(url.path.strip("/"))
    stripped = re.sub(r"-gguf$", "", hub.repo_id, flags=re.IGNORECASE)
    if stripped != hub.repo_id:
        candidates.append(stripped)
    for repo in dict.fromkeys(candidates):
        if repo == hub.repo_id:
            continue
        found = fetch_tokenizer(source, repo)
        if found is not None:
            log.info("%s: the tokenizer and chat template of %s:%s", ref, source.name, repo)
            return f"{source.name}:{repo}", found
    return None


async def _fetched(
    cfg: Config, model_id: str, ref: str | None, args: EngineArgs | None, downloads: Downloads
) -> str | None:
    """`fetch_ref` on a thread, its progress kept in `downloads` while it runs."""
    try:
        return await asyncio.to_thread(
            fetch_ref, cfg, model_id, ref, args, lambda p: downloads.report(model_id, p)
        )
    finally:
        downloads.current.pop(model_id, None)


def fetch_ref(
    cfg: Config,
    model_id: str,
    ref: str | None,
    args: EngineArgs | None = None,
    progress: Callable[[Progress], None] | None = None,
) -> str | None:
    """The local path of `ref` where it names a hub repository (fetched now from the
    source it names, once node/repo_check.py found nothing in its file list and config to
    refuse: `args` are the load's; None for a draft model, whose own are the target's),
    else `ref`; LoadError when the check or the fetch fails (`helexa chat` too)."""
    if not ref or ref == BUNDLED_MODEL_ID:
        return ref
    if ":" not in ref and Path(ref).expanduser().exists():  # a local directory or file
        return ref
    hub = split_ref(ref, cfg.node.default_source)
    if hub is None:
        return ref  # the worker says what is wrong with it
    source = cfg.hubs.get(hub.source)
    if source is None:
        known = ", ".join(sorted(cfg.hubs)) or "none"
        raise LoadError(
            "model_not_found",
            model_id,
            f"unknown model source {hub.source!r} in {ref!r}; this node's sources: {known}",
            f"add a [sources.{hub.source}] table with its endpoint, or use one of: {known}",
        )
    log.info("fetching %s from %s (%s)", hub.repo_id, source.name, source.endpoint)
    revision = args.revision if args is not None else None
    quant = args.gguf_quant if args is not None else None
    check = None
    if args is not None:
        check = repo_checker(model_id, args, lambda: _device_total_mb(args))
    try:
        path = fetch(
            source, hub.repo_id, revision=revision, gguf_quant=quant, progress=progress,
            check=check,
        )  # fmt: skip
    except SourceError as e:
        status, retry = _STATUS.get(e.kind, (422, None))
        raise LoadError(
            e.kind, model_id, e.message, e.suggestion, status=status, retry_after=retry
        ) from None
    return str(path)


def _device_total_mb(args: EngineArgs) -> list[int]:
    """The total memory of each device the load would use: its GPUs (`devices`, else the
    first `tensor_parallel`), or the host's RAM on a CPU node."""
    stats = device_stats()
    gpus = [d for d in stats if d.get("kind") == "cuda"]
    if gpus and args.device != "cpu":
        wanted = set(args.devices or range(args.tensor_parallel))
        stats = [d for d in gpus if d.get("index") in wanted]
    return [int(d["memory_total_mb"]) for d in stats if d.get("memory_total_mb")]
