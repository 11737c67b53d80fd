"""Typed configuration: one slots-dataclass per [section]; TOML, then HELEXA_* env overrides.

Read once at start-up by `load_config` and passed down; nothing deeper reads the
environment. Conversion and validation are driven by the dataclass field types: a
constraint rides in the type as `Annotated[int, Check(...)]`, so adding a key is adding a
field. Every problem found is reported at once in one `ConfigError`.
"""

import contextlib
import difflib
import os
import re
import tomllib
import types
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from functools import cache
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints
from urllib.parse import urlsplit

from helexa.protocol.wire import Price
from helexa.sources.hub import HF_ALIASES, HubSource, hf_cache_dir, resolve_source


class ConfigError(Exception):
    """Every problem in one configuration; `problems` holds them one per entry."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.problems = problems
        noun = "problem" if len(problems) == 1 else "problems"
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{source}: {len(problems)} configuration {noun}:\n{lines}")


@dataclass(frozen=True, slots=True)
class Check:
    """A constraint carried by a field's type; `expect` completes "expected …, got X"."""

    expect: str
    ok: Callable[[Any], bool]


def split_host_port(listen: str) -> tuple[str, int]:
    """'0.0.0.0:13131' → ('0.0.0.0', 13131); '[::]:80' → ('::', 80)."""
    host, _, port = listen.rpartition(":")
    return host.strip("[]"), int(port)


def _is_host_port(v: str) -> bool:
    host, sep, port = v.rpartition(":")
    return bool(sep and host and port.isdigit() and 1 <= int(port) <= 65535)


def _is_url(v: str) -> bool:
    try:
        parts = urlsplit(v)
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)


PositiveInt = Annotated[int, Check("a positive integer", lambda v: v > 0)]
NonNegativeInt = Annotated[int, Check("an integer >= 0", lambda v: v >= 0)]
PositiveFloat = Annotated[float, Check("a positive number", lambda v: v > 0)]
NonNegativeFloat = Annotated[float, Check("a number >= 0", lambda v: v >= 0)]
Fraction = Annotated[float, Check("a fraction in (0, 1]", lambda v: 0 < v <= 1)]
PowerOfTwo = Annotated[int, Check("a power of two", lambda v: v > 0 and v & (v - 1) == 0)]
HostPort = Annotated[str, Check('"host:port"', _is_host_port)]
Url = Annotated[str, Check("an http(s) URL", _is_url)]
NonEmpty = Annotated[str, Check("a non-empty string", lambda v: v.strip() != "")]
HostName = Annotated[
    str,
    Check(
        "a host name or IP address, IPv6 in brackets (no scheme, port or path)",
        lambda v: re.fullmatch(r"[A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\]", v) is not None,
    ),
]
DatabaseUrl = Annotated[str, Check("a SQLAlchemy URL", lambda v: v == "" or "://" in v)]
RetentionDays = Annotated[int, Check("days from 0 (forever) to 36500", lambda v: 0 <= v <= 36_500)]
Device = Annotated[
    str,
    Check('"auto", "cpu", "cuda" or "cuda:N"', lambda v: re.fullmatch(r"auto|cpu|cuda(:\d+)?", v)),
]
DType = Literal["auto", "float32", "bfloat16", "float16"]
KvCacheDType = Literal["auto", "float32", "float16"]
KV_CACHE_DTYPES = get_args(KvCacheDType)
DTYPES: tuple[str, ...] = get_args(DType)  # the one list: config, loads and the console
InSituQuant = Literal["int8", "int4", "fp8"]
IN_SITU_QUANTS: tuple[str, ...] = get_args(InSituQuant)


def _is_password_hash(v: str) -> bool:
    from helexa.passwords import parse_hash

    try:
        parse_hash(v)
    except ValueError:
        return False
    return True


PasswordHash = Annotated[
    str, Check("scrypt$N$r$p$salt$hash (from `helexa admin hash-password`)", _is_password_hash)
]

DERIVED = {"derived": True}  # filled by load_config from the environment; not a TOML key
HF_DEFAULTS = {"token_env": "HF_TOKEN"}  # its endpoint: $HF_ENDPOINT, else huggingface.co
# HELEXA_* variables that are not [section] overrides.
ENV_NOT_OVERRIDES = frozenset(
    {"HELEXA_CONFIG", "HELEXA_DEBUG_POISON", "HELEXA_DEBUG_FAULT", "HELEXA_ADMIN_PASSWORD"}
)
# HELEXA_DEBUG_FAULT: where a request whose `user` is "helexa-debug-fault" fails, alone.
DEBUG_FAULTS = ("sampler", "detokenizer", "nonfinite")


class _Listens:
    """`host`/`port` parsed from a section's `listen` key."""

    __slots__ = ()
    listen: str

    @property
    def host(self) -> str:
        return split_host_port(self.listen)[0]

    @property
    def port(self) -> int:
        return split_host_port(self.listen)[1]


@dataclass(slots=True)
class ImageLimits:
    """[node.images]: what images one request may carry into a vision model, and where the
    node may fetch them from; everything past these bounds is a 400 before any decode."""

    max_images_per_request: PositiveInt = 16
    max_image_bytes: PositiveInt = 20 << 20  # one image as sent (encoded), not its pixels
    # Decoded pixels, read from the image's header: a larger one (a decompression bomb: a
    # few KiB on the wire, gigabytes decoded) is refused before it is decoded.
    max_image_pixels: PositiveInt = 50_000_000
    # What each image is resized to lie between; the model's vision tower caps max_pixels
    # further (Qwen3.5/3.6: 2304 patches of 16², 576 tokens an image).
    min_pixels: PositiveInt = 256 * 256
    max_pixels: PositiveInt = 1024 * 1024
    # Hosts whose http(s) image URLs the node fetches; empty: remote URLs are refused and
    # only inline `data:` URLs are taken (the node makes no request on a client's behalf).
    allowed_url_hosts: list[HostName] = field(default_factory=list)
    url_fetch_timeout_s: PositiveFloat = 10.0


@dataclass(slots=True)
class DefaultModel:
    """A [node] default_models entry as a table: the model and every option a
    `POST /models/load` body takes (docs/node.md § Routes), each unset keeping the node's."""

    model: NonEmpty
    quant: str | None = None
    dtype: DType | None = None
    devices: list[NonNegativeInt] | None = None
    tensor_parallel: PositiveInt = 1
    revision: str | None = None
    speculative_method: Literal["ngram", "draft_model", "mtp", "off"] | None = None
    speculative_model: str | None = None
    num_speculative_tokens: (
        Annotated[int, Check("an integer from 1 to 16", lambda v: 1 <= v <= 16)] | None
    ) = None
    kv_cache_dtype: KvCacheDType | None = None
    max_model_len: PositiveInt | None = None
    kv_cache_memory_mb: PositiveInt | None = None

    def load_body(self) -> dict[str, Any]:
        """The `POST /models/load` body this entry stands for."""
        body = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "model"}
        return {"model_id": self.model, **{k: v for k, v in body.items() if v is not None}}


@dataclass(slots=True)
class NodeConfig(_Listens):
    """[node]: the inference node (`helexa serve --role node`)."""

    listen: HostPort = "0.0.0.0:13131"
    # each a model id, or a table with its load options (DefaultModel)
    default_models: list[str | DefaultModel] = field(default_factory=list)
    default_source: str = "huggingface"
    # Every route but GET /health needs `Authorization: Bearer <api_key>` when set
    # (env HELEXA_NODE_API_KEY). A node listening beyond loopback refuses to start without
    # one unless allow_unauthenticated is true.
    api_key: str | None = field(default=None, repr=False)
    # A token that opens `GET /metrics` alone (env HELEXA_NODE_METRICS_TOKEN), for a
    # Prometheus that must not hold the api_key that loads and unloads models; the api_key
    # opens /metrics too. Needs api_key: without one /metrics is open anyway.
    metrics_token: str | None = field(default=None, repr=False)
    allow_unauthenticated: bool = False
    gateway_secret: str | None = field(default=None, repr=False)  # deprecated: api_key
    # Where POST /models/load may read local models from; None: the hub cache and
    # state_dir/models. Hub-style ids ("org/name") are always allowed.
    model_dirs: list[Path] | None = None
    state_dir: Path = field(default_factory=lambda: Path.home() / ".local/state/helexa")
    max_running_requests: PositiveInt = 64
    max_waiting_requests: NonNegativeInt = 128
    max_queue_wait_s: PositiveFloat = 30.0
    # A hard cap on one gateway key's running + queued requests; 0: none (fair shares only).
    per_principal_max: NonNegativeInt = 0
    drain_timeout_s: NonNegativeFloat = 60.0
    advertise_endpoint: Url | None = None
    # A stream whose client reads nothing for this long is cut, freeing its slot and KV.
    stream_write_timeout_s: PositiveFloat = 60.0
    # Memory (weights + KV pools, MiB) all loaded models may hold together; a load past it
    # is refused with 503 insufficient_vram so a gateway can evict and retry. None: no cap.
    max_model_memory_mb: PositiveInt | None = None
    images: ImageLimits = field(default_factory=ImageLimits)  # the [node.images] table

    def default_loads(self) -> list[dict[str, Any]]:
        """`default_models` as `POST /models/load` bodies, one per model id (the first
        entry naming an id wins)."""
        bodies: dict[str, dict[str, Any]] = {}
        for entry in self.default_models:
            body = {"model_id": entry} if isinstance(entry, str) else entry.load_body()
            bodies.setdefault(body["model_id"], body)
        return list(bodies.values())

    def default_model_ids(self) -> list[str]:
        return [body["model_id"] for body in self.default_loads()]

    debug_poison: str | None = field(default=None, metadata=DERIVED)  # HELEXA_DEBUG_POISON
    debug_fault: str | None = field(default=None, metadata=DERIVED)  # HELEXA_DEBUG_FAULT


@dataclass(slots=True)
class EngineConfig:
    """[engine]: how the node runs models."""

    device: Device = "auto"
    dtype: DType = "auto"
    quant: InSituQuant | None = None
    kv_cache_memory_mb: PositiveInt | None = None
    kv_cache_memory_fraction: Fraction = 0.9
    kv_cache_cpu_max_mb: PositiveInt = 2048
    block_size: PowerOfTwo = 16
    max_num_seqs: PositiveInt = 64
    max_num_batched_tokens: PositiveInt = 2048
    # None: a prompt's chunk may take a whole step's budget. Smaller chunks interleave a long
    # prompt with the decodes beside it more finely, at a price per chunk: on the CPU every
    # chunk unpacks every GGUF weight for its GEMMs (a 1024-token TTFT: 2.0 s in chunks of
    # 512, 1.87 s whole, on a 2-core EPYC).
    max_prefill_chunk: PositiveInt | None = None
    max_model_len: PositiveInt | None = None
    num_threads: PositiveInt | None = None
    seed: int = 0
    enable_prefix_caching: bool = True
    # Which kernels run the model: "auto" (Triton on CUDA, plain torch on CPU), "naive"
    # (always plain torch: A/B checks), "triton" (always Triton).
    kernels: Literal["auto", "naive", "triton"] = "auto"
    # CUDA: capture one CUDA graph per decode batch-size bucket at load and replay it.
    cuda_graphs: bool = True
    # Hybrid (Gated DeltaNet) models: recurrent-state snapshots kept for the prefix cache.
    max_prefix_snapshots: NonNegativeInt = 8
    cpu_dense_copy: bool = False
    # The KV cache's element type. "auto": float16 on the CPU under a float32 model (half the
    # bytes a decode step reads and holds, as llama.cpp's default cache), else the model's
    # dtype. "float32" or "float16" to choose; on CUDA only the model's own dtype.
    kv_cache_dtype: KvCacheDType = "auto"
    # CPU: GGUF Q4_0/Q4_1/Q8_0 weights as the file's blocks, run by helexa's C kernels (built
    # at first use with the system compiler, -march=native; engine/layers/native.py), "auto";
    # or torch's packed int4 kernel, "torch". Without a compiler "auto" is "torch" (logged).
    cpu_kernels: Literal["auto", "torch"] = "auto"
    # CPU: time each packed weight shape's paths (int4 kernel, float32 GEMM on the weight
    # unpacked per call) at load, cached in state_dir/autotune (only plans measured on a
    # quiet machine; busy ones serve one run and are measured again once it is quiet), and
    # run each call the fastest measured way; false: the kernel on all rows, always.
    autotune: bool = True
    # A model's worker that answers nothing for this long while it has work (a hung step, a
    # hung collective across tensor-parallel ranks) is killed and its model reloaded.
    step_timeout_s: PositiveFloat = 120.0
    # Speculative decoding (vLLM's names; docs/engine.md § Speculative decoding): "ngram"
    # drafts the continuation of the longest recent n-gram match (prompt_lookup_max down to
    # prompt_lookup_min tokens) of the prompt and output, up to num_speculative_tokens, and
    # one step checks them all; "draft_model": speculative_model (a smaller model sharing
    # the tokenizer, loaded beside) drafts them greedily; "mtp": the checkpoint's own
    # multi-token-prediction head (Qwen3.5 / Qwen3.6 safetensors) does; None: off, until
    # measured.
    speculative_method: Literal["ngram", "draft_model", "mtp"] | None = None
    speculative_model: str | None = None  # the draft model's id or path ("draft_model")
    num_speculative_tokens: PositiveInt = 4
    prompt_lookup_min: PositiveInt = 2
    prompt_lookup_max: PositiveInt = 5


@dataclass(slots=True)
class SourceConfig:
    """[sources.<name>]: a hub that `name:org/name` model ids (and bare `org/name` ones, for
    [node] default_source) are fetched from. Unset keys fall back as helexa/sources/hub.py
    says (the HF_* variables for `huggingface`); `hub_source` resolves them."""

    endpoint: Url | None = None  # required but for `huggingface` ($HF_ENDPOINT, huggingface.co)
    token: str | None = field(default=None, repr=False)  # inline; else env[token_env]
    token_env: str | None = None
    cache_dir: Path | None = None
    offline: bool | None = None  # None: $HF_HUB_OFFLINE


@dataclass(slots=True)
class GatewayConfig(_Listens):
    """[gateway]: the fleet gateway (`helexa serve --role gateway`)."""

    listen: HostPort = "0.0.0.0:31313"
    metrics_listen: HostPort = "0.0.0.0:31314"
    database_url: DatabaseUrl = ""  # "" → sqlite:///<node.state_dir>/helexa.db
    require_auth: bool = False
    poll_interval_s: PositiveFloat = 5.0
    # A node silent this long while answering (no byte of a stream, no answer) is cut: the
    # client gets an error and the request's reservation and routing slot are freed.
    upstream_idle_timeout_s: PositiveFloat = 600.0
    # How long a request waits for the database (a reservation, its ledger row) before a
    # metered key gets 503; the row of an answer already given stays queued past it.
    database_timeout_s: PositiveFloat = 2.0
    # A gateway renews its reservations' lease every quarter of this; a gateway silent for
    # longer has its reservations booked as spent, whole, by any other.
    reservation_lease_s: PositiveFloat = 30.0
    # Writes the database has not taken yet, past which new requests get 503.
    ledger_backlog_max: PositiveInt = 10_000
    # Ledger rows older than this many days are deleted by the gateway (hourly, in small
    # batches); 0 keeps them forever. Budgets lose nothing (docs/gateway.md § The spend ledger).
    ledger_retention_days: RetentionDays = 90
    # Origins a browser may call the API from ("*": any); none: no CORS headers at all.
    cors_allow_origins: list[str] = field(default_factory=list)

    @property
    def metrics_host(self) -> str:
        return split_host_port(self.metrics_listen)[0]

    @property
    def metrics_port(self) -> int:
        return split_host_port(self.metrics_listen)[1]


@dataclass(slots=True)
class HttpConfig:
    """[http]: the HTTP server of whichever role runs (uvicorn's limits)."""

    # Connections plus in-flight requests one process holds; past it new ones get 503.
    limit_concurrency: PositiveInt = 2048
    keep_alive_timeout_s: PositiveFloat = 30.0  # an idle keep-alive connection is closed
    header_timeout_s: PositiveFloat = 10.0  # a request's headers must arrive within this
    max_body_mb: PositiveInt = 64  # a larger request body gets 413


@dataclass(slots=True)
class NodeEntry:
    """One [[nodes]] entry: a node the gateway polls and routes to."""

    name: NonEmpty
    endpoint: Url
    # the node's [node] api_key, or the name of an environment variable holding it;
    # neither: [node] api_key of this file (one file may serve both roles)
    api_key: str | None = field(default=None, repr=False)
    api_key_env: str | None = None


@dataclass(slots=True)
class Cost:
    """USD per 1M tokens: prompt tokens computed afresh (`input`), generated (`output`),
    read from the node's prefix cache (`cache_read`) and computed and stored in it
    (`cache_write`); each of the last two unset: the input price."""

    input: NonNegativeFloat = 0.0
    output: NonNegativeFloat = 0.0
    cache_read: NonNegativeFloat | None = None
    cache_write: NonNegativeFloat | None = None

    def price(self) -> Price:
        """The prices the books use, the cache's unset ones at the input price."""
        read = self.input if self.cache_read is None else self.cache_read
        write = self.input if self.cache_write is None else self.cache_write
        return Price(self.input, self.output, read, write)


@dataclass(slots=True)
class ModelEntry:
    """One [[models]] catalogue entry (seeds the gateway's database)."""

    id: NonEmpty
    source: str | None = None
    quant: str | None = None
    dtype: DType | None = None
    tensor_parallel: PositiveInt = 1
    min_devices: PositiveInt | None = None  # None → tensor_parallel
    min_device_vram_mb: PositiveInt | None = None
    pinned_on: list[str] = field(default_factory=list)
    cost: Cost = field(default_factory=Cost)
    # Speculative decoding the node loads it with (vLLM's names, as `POST /models/load`
    # takes them; protocol/wire.py): "ngram", "draft_model" (with speculative_model, the
    # draft's id), "mtp" (the checkpoint's MTP head) or "off"; each unset: the node's
    # [engine] setting.
    speculative_method: Literal["ngram", "draft_model", "mtp", "off"] | None = None
    speculative_model: str | None = None
    num_speculative_tokens: (
        Annotated[int, Check("an integer from 1 to 16", lambda v: 1 <= v <= 16)] | None
    ) = None
    revision: str | None = None  # the hub branch, tag or commit cold loads fetch; None: main
    # its KV cache on the node (each unset: the node's [engine] setting)
    kv_cache_dtype: KvCacheDType | None = None
    max_model_len: PositiveInt | None = None
    kv_cache_memory_mb: PositiveInt | None = None

    @property
    def required_devices(self) -> int:
        return self.min_devices or self.tensor_parallel

    def speculative_problem(self) -> str | None:
        """Why speculative_model and speculative_method do not go together (None: they do)."""
        method, draft = self.speculative_method, self.speculative_model
        if method == "draft_model" and not draft:
            return "speculative_model: required with speculative_method 'draft_model'"
        if method != "draft_model" and draft:
            now = "unset" if method is None else repr(method)
            return f"speculative_model: only with speculative_method 'draft_model' (it is {now})"
        return None


@dataclass(slots=True)
class AdminConfig:
    """[admin]: the /admin console login."""

    password_hash: PasswordHash | None = None  # none, and no HELEXA_ADMIN_PASSWORD: console off
    session_ttl_s: PositiveInt = 43200  # a login lasts this long
    # from HELEXA_ADMIN_PASSWORD, never from the file
    password: str | None = field(default=None, repr=False, metadata=DERIVED)


@dataclass(slots=True)
class LogConfig:
    """[log]"""

    level: Literal["debug", "info", "warning", "error"] = "info"
    json: bool = False


@dataclass(slots=True)
class Config:
    """The whole helexa.toml, both roles."""

    node: NodeConfig = field(default_factory=NodeConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    sources: dict[str, SourceConfig] = field(
        default_factory=lambda: {"huggingface": SourceConfig(**HF_DEFAULTS)}
    )
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    nodes: list[NodeEntry] = field(default_factory=list)
    models: list[ModelEntry] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)
    admin: AdminConfig = field(default_factory=AdminConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    log: LogConfig = field(default_factory=LogConfig)
    path: Path | None = field(default=None, compare=False, metadata=DERIVED)  # file read
    # [sources.*] resolved with the environment (helexa/sources/hub.py), by name
    hubs: dict[str, HubSource] = field(
        default_factory=dict, compare=False, repr=False, metadata=DERIVED
    )


def load_config(path: str | Path | None = None, env: Mapping[str, str] | None = None) -> Config:
    """TOML from `path`, else $HELEXA_CONFIG, else none; then HELEXA_<SECTION>_<KEY> overrides."""
    env = os.environ if env is None else env
    if path is None and env.get("HELEXA_CONFIG"):
        path = env["HELEXA_CONFIG"]
    path = Path(path).expanduser() if path is not None else None
    source = str(path) if path else "helexa configuration (no file)"
    raw = _read_toml(path) if path else {}
    problems: list[str] = []
    _set_default(raw, "node", "state_dir", str(_default_state_dir(env)))
    sources = raw.setdefault("sources", {})
    for key, value in HF_DEFAULTS.items() if isinstance(sources, dict) else ():
        _set_default(sources, "huggingface", key, value)
    _apply_env(raw, env, problems)
    cfg, bad = _build(raw, problems)
    _resolve(cfg, env, path)
    _check(cfg, problems, bad)
    if problems:
        raise ConfigError(source, problems)
    return cfg


def _build(raw: dict[str, Any], problems: list[str]) -> tuple[Config, set[str]]:
    """Config from the TOML document; sections that fail stay at their defaults, named in `bad`."""
    cfg, bad, sections = Config(), set(), _keys(Config)
    for name in raw.keys() - set(sections):
        hint = _did_you_mean(name, sections)
        problems.append(f"unknown section [{name}]{hint}; sections: {', '.join(sections)}")
    for name in sections:
        if name in raw:
            tp = _hints(Config)[name]
            label = f"[[{name}]]" if get_origin(tp) is list else f"[{name}]"
            value = _convert(tp, raw[name], label, problems)
            if value is _BAD:
                bad.add(name)
            else:
                setattr(cfg, name, value)
    return cfg, bad


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise ConfigError(str(path), [f"cannot read config file: {e.strerror}"]) from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(str(path), [f"invalid TOML: {e}"]) from e


def _default_state_dir(env: Mapping[str, str]) -> Path:
    xdg = env.get("XDG_STATE_HOME")
    return Path(xdg) / "helexa" if xdg else Path.home() / ".local/state/helexa"


def _set_default(raw: dict[str, Any], section: str, key: str, value: Any) -> None:
    table = raw.setdefault(section, {})
    if isinstance(table, dict):
        table.setdefault(key, value)


def _apply_env(raw: dict[str, Any], env: Mapping[str, str], problems: list[str]) -> None:
    """Overlay HELEXA_<SECTION>_<KEY> onto the TOML tables of the plain [sections]."""
    hints = _hints(Config)
    sections = {name: tp for name, tp in hints.items() if is_dataclass(tp)}
    for var in sorted(env):
        if not var.startswith("HELEXA_") or var in ENV_NOT_OVERRIDES:
            continue
        section, _, key = var.removeprefix("HELEXA_").lower().partition("_")
        if section not in sections:
            continue
        cls, keys = sections[section], _keys(sections[section])
        parent, name = raw, section
        nested = _nested_key(cls, key)  # HELEXA_NODE_IMAGES_MAX_PIXELS: [node.images]
        if nested is not None:
            parent = raw.setdefault(section, {})
            if not isinstance(parent, dict):
                continue
            section, key = nested
            name = f"{name}.{section}"
            cls = _hints(cls)[section]
            keys = _keys(cls)
        if key not in keys:
            hint = _did_you_mean(key, keys)
            problems.append(
                f"{var}: [{name}] has no key {key!r}{hint}; valid keys: {', '.join(keys)}"
            )
            continue
        value = _from_env_text(_hints(cls)[key], env[var])
        if _convert(_hints(cls)[key], value, f"{var} ([{name}] {key})", problems) is not _BAD:
            table = parent.setdefault(section, {})
            if isinstance(table, dict):
                table[key] = value


def _nested_key(cls: type, key: str) -> tuple[str, str] | None:
    """(table, key) when `key` is `<table>_<key>` of a nested table of section `cls`."""
    for name, tp in _hints(cls).items():
        if is_dataclass(tp) and key.startswith(name + "_"):
            return name, key.removeprefix(name + "_")
    return None


def _resolve(cfg: Config, env: Mapping[str, str], path: Path | None) -> None:
    """Fill in what defaults to something derived from other keys or the environment."""
    cfg.path = path
    cfg.node.debug_poison = env.get("HELEXA_DEBUG_POISON") or None
    cfg.node.debug_fault = env.get("HELEXA_DEBUG_FAULT") or None
    cfg.admin.password = env.get("HELEXA_ADMIN_PASSWORD") or None
    node = cfg.node
    if node.gateway_secret and not node.api_key:
        node.api_key = node.gateway_secret  # the deprecated name, for one release
    for entry in cfg.nodes:
        if entry.api_key is None and entry.api_key_env:
            entry.api_key = env.get(entry.api_key_env) or None
        elif entry.api_key is None and not entry.api_key_env:
            entry.api_key = node.api_key
    if not cfg.gateway.database_url:
        cfg.gateway.database_url = f"sqlite:///{cfg.node.state_dir / 'helexa.db'}"
    cfg.hubs = {}
    for name, src in cfg.sources.items():
        with contextlib.suppress(ValueError):  # no endpoint: _check says so
            cfg.hubs[name] = resolve_source(
                name, endpoint=src.endpoint, token=src.token, token_env=src.token_env,
                cache_dir=src.cache_dir, offline=src.offline, state_dir=node.state_dir, env=env,
            )  # fmt: skip
    if node.model_dirs is None:
        hf = cfg.hubs.get("huggingface")
        hub = hf.cache_dir if hf is not None else hf_cache_dir(env)
        node.model_dirs = [Path(hub), node.state_dir / "models"]


def _check(cfg: Config, problems: list[str], bad: set[str]) -> None:
    """Rules that span keys; each runs only when the sections it reads converted cleanly."""
    e, g = cfg.engine, cfg.gateway
    if "node" not in bad and cfg.node.metrics_token and not cfg.node.api_key:
        problems.append(
            "[node] metrics_token: set without [node] api_key, which /metrics would otherwise "
            "need; without one, every route, /metrics included, is open"
        )
    if cfg.node.debug_fault not in (None, *DEBUG_FAULTS):
        problems.append(
            f"HELEXA_DEBUG_FAULT: {cfg.node.debug_fault!r} is not one of {', '.join(DEBUG_FAULTS)}"
        )
    chunk = e.max_prefill_chunk
    if "engine" not in bad and chunk is not None and chunk > e.max_num_batched_tokens:
        problems.append(
            f"[engine] max_prefill_chunk: {e.max_prefill_chunk} exceeds "
            f"max_num_batched_tokens {e.max_num_batched_tokens}"
        )
    if "engine" not in bad and e.max_num_seqs > e.max_num_batched_tokens:
        problems.append(
            f"[engine] max_num_seqs: {e.max_num_seqs} exceeds max_num_batched_tokens "
            f"{e.max_num_batched_tokens} (every running sequence needs a token per step)"
        )
    if "engine" not in bad and e.speculative_method == "draft_model" and not e.speculative_model:
        problems.append(
            "[engine] speculative_model: required with speculative_method 'draft_model'"
        )
    images = cfg.node.images
    if "node" not in bad and images.min_pixels > images.max_pixels:
        problems.append(
            f"[node] images.min_pixels: {images.min_pixels} exceeds max_pixels {images.max_pixels}"
        )
    if "gateway" not in bad and g.port == g.metrics_port:
        problems.append(
            f"[gateway] metrics_listen: {g.metrics_listen!r} uses the API port {g.port}"
        )
    if not bad & {"node", "sources"} and cfg.node.default_source not in cfg.sources:
        problems.append(
            f"[node] default_source: {cfg.node.default_source!r} is not a [sources.*] table; "
            f"known: {', '.join(cfg.sources)}"
        )
    for name, src in cfg.sources.items():
        if not re.fullmatch(r"[a-z0-9][a-z0-9_-]*", name):
            problems.append(f"[sources.{name}]: a source name is a lowercase scheme like 'helexa'")
        elif name in HF_ALIASES:
            problems.append(f"[sources.{name}]: {name!r} names [sources.huggingface]; pick another")
        elif name != "huggingface" and not src.endpoint:
            problems.append(
                f"[sources.{name}] endpoint: required (only [sources.huggingface] has a default)"
            )
    node_names = [n.name for n in cfg.nodes]
    for name in _duplicates(node_names):
        problems.append(f"[[nodes]] name: {name!r} is used by more than one node")
    for model_id in _duplicates([m.id for m in cfg.models]):
        problems.append(f"[[models]] id: {model_id!r} is listed more than once")
    for i, m in enumerate(cfg.models, 1):  # a bad [[models]] leaves this list empty
        where = f"[[models]] #{i} ({m.id})"
        if (problem := m.speculative_problem()) is not None:
            problems.append(f"{where} {problem}")
        if m.min_devices is not None and m.min_devices < m.tensor_parallel:
            problems.append(
                f"{where} min_devices: {m.min_devices} is below tensor_parallel {m.tensor_parallel}"
            )
        for name in m.pinned_on:
            if node_names and name not in node_names:
                hint = _did_you_mean(name, node_names)
                problems.append(f"{where} pinned_on: {name!r} is not a [[nodes]] name{hint}")
    for alias in cfg.aliases:
        seen, target = [alias], cfg.aliases[alias]
        while target in cfg.aliases and target not in seen:
            seen.append(target)
            target = cfg.aliases[target]
        if target in seen:
            loop = " → ".join([*seen, target])
            problems.append(f'[aliases] "{alias}": points back at itself ({loop})')


def _duplicates(items: list[str]) -> list[str]:
    return sorted({x for x in items if items.count(x) > 1})


# --- generic conversion, driven by field types -------------------------------------------

_BAD = object()  # a value that failed conversion; its problem is already recorded
_NAMES = {
    str: "a string",
    int: "an integer",
    float: "a number",
    bool: "true or false",
    Path: "a path",
}
_BOOLS = {"true": True, "1": True, "yes": True, "on": True}
_BOOLS |= {"false": False, "0": False, "no": False, "off": False}


@cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls, include_extras=True)


@cache
def _keys(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls) if not f.metadata.get("derived"))


def _unwrap(tp: Any) -> tuple[Any, tuple[Check, ...]]:
    if get_origin(tp) is Annotated:
        base, *meta = get_args(tp)
        return base, tuple(m for m in meta if isinstance(m, Check))
    return tp, ()


def _optional(tp: Any) -> Any:
    """X for `X | None`, else None."""
    args = get_args(tp)
    if get_origin(tp) in (Union, types.UnionType) and len(args) == 2 and type(None) in args:
        return args[0] if args[1] is type(None) else args[1]
    return None


def _describe(tp: Any) -> str:
    base, checks = _unwrap(tp)
    if checks:
        return checks[0].expect
    origin, args = get_origin(base), get_args(base)
    if origin is Literal:
        return "one of " + ", ".join(map(repr, args))
    if origin in (Union, types.UnionType) and any(is_dataclass(a) for a in args):
        return "a string or a table"
    if origin is list:
        if get_origin(args[0]) in (Union, types.UnionType):
            return "a list of strings or tables"
        return "an array of tables" if is_dataclass(args[0]) else "a list of strings"
    if origin is dict:
        return "a table of tables" if is_dataclass(args[1]) else "a table of strings"
    return _NAMES.get(base, "a table")


def _did_you_mean(word: str, options: Any) -> str:
    close = difflib.get_close_matches(str(word), [str(o) for o in options], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _from_env_text(tp: Any, text: str) -> Any:
    """An environment string as the TOML value it stands for; left as text when it is not one."""
    inner = _optional(tp)
    if inner is not None:
        return None if text.strip().lower() in ("", "none") else _from_env_text(inner, text)
    base, _ = _unwrap(tp)
    if base is bool:
        return _BOOLS.get(text.strip().lower(), text)
    if base in (int, float):
        try:
            return base(text.strip())
        except ValueError:
            return text
    if get_origin(base) is list:
        return [item.strip() for item in text.split(",") if item.strip()]
    return text


def _convert(tp: Any, value: Any, label: str, problems: list[str]) -> Any:
    """A TOML value as type `tp`, or _BAD with the reason appended to `problems`."""
    inner = _optional(tp)
    if inner is not None:
        if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")):
            return None
        return _convert(inner, value, label, problems)
    base, checks = _unwrap(tp)
    origin, args = get_origin(base), get_args(base)

    def bad(expect: str | None = None, hint: str = "") -> object:
        problems.append(f"{label}: expected {expect or _describe(tp)}, got {value!r}{hint}")
        return _BAD

    if is_dataclass(base):
        return _from_table(base, value, label, problems)
    if origin in (Union, types.UnionType) and (tables := [a for a in args if is_dataclass(a)]):
        if isinstance(value, dict):  # `str | Table`: a table is the table, else the rest
            return _from_table(tables[0], value, label, problems)
        rest = [a for a in args if a is not tables[0]]
        if isinstance(value, str) and str in rest:
            return _convert(str, value, label, problems)
        return bad()
    if origin is list:
        if not isinstance(value, list):
            return bad()
        items = [
            _convert(args[0], v, _item_label(label, i, args[0]), problems)
            for i, v in enumerate(value)
        ]
        return _BAD if _BAD in items else items
    if origin is dict:
        if not isinstance(value, dict):
            return bad()
        out = {
            k: _convert(args[1], v, _entry_label(label, k, args[1]), problems)
            for k, v in value.items()
        }
        return _BAD if _BAD in out.values() else out
    if origin is Literal:
        ok = isinstance(value, str) and value in args
        return value if ok else bad(hint=_did_you_mean(value, args))
    if base is bool:
        ok = isinstance(value, bool)
    elif base is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif base is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        value = float(value) if ok else value
    else:  # str, Path
        ok = isinstance(value, str) and (base is not Path or value != "")
    if not ok:
        return bad()
    for check in checks:
        if not check.ok(value):
            return bad(check.expect)
    return Path(value).expanduser() if base is Path else value


def _from_table(cls: type, table: Any, label: str, problems: list[str]) -> Any:
    """Build dataclass `cls` from a TOML table: unknown keys, missing keys and bad values noted."""
    if not isinstance(table, dict):
        problems.append(f"{label}: expected a table, got {table!r}")
        return _BAD
    keys, values, ok = _keys(cls), {}, True
    for key, raw in table.items():
        if key not in keys:  # reported, then ignored so that later checks still run
            hint = _did_you_mean(key, keys)
            problems.append(f"{label} {key}: unknown key{hint}; valid keys: {', '.join(keys)}")
            continue
        value = _convert(_hints(cls)[key], raw, _field_label(label, key), problems)
        ok = ok and value is not _BAD
        values[key] = value
    for f in fields(cls):
        required = f.default is MISSING and f.default_factory is MISSING
        if required and f.name not in table:
            problems.append(f"{label}: missing required key {f.name!r}")
            ok = False
    return cls(**values) if ok else _BAD


def _field_label(label: str, key: str) -> str:
    last = label.rsplit(" ", 1)[-1]
    return f"{label} {key}" if last.startswith(("[", "#", "(")) else f"{label}.{key}"


def _item_label(label: str, i: int, item_type: Any) -> str:
    return f"{label} #{i + 1}" if is_dataclass(item_type) else f"{label}[{i}]"


def _entry_label(label: str, key: str, value_type: Any) -> str:
    return f"{label[:-1]}.{key}]" if is_dataclass(value_type) else f'{label} "{key}"'
