"""`helexa bench gpu`: batch-1 decode against the memory bandwidth, TTFT at long prompts
and nano-vllm's throughput protocol, for random weights in the shapes of Qwen3-0.6B,
Qwen3-8B and Qwen3-30B-A3B (and, asked for, the hybrid Qwen3.6-27B and -35B-A3B), in bf16
and in Q4_K, beside HF transformers on the same shapes, device and prompts (Qwen3 only).

One model at a time: helexa's (each format), then HF's (bf16 only: it has no Q4_K
kernel), each freed before the next is built. Timings are wall clock between
`torch.cuda.synchronize()` points (the engine's steps end with their tokens on the host);
the copy bandwidth is timed with CUDA events.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib.util
import json
import platform
import random
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from helexa.bench.engine import HelexaSide, HFSide, Side, _git_revision
from helexa.bench.random_models import (
    FORMATS,
    HYBRID_TYPES,
    PRESETS,
    build_hf_model,
    build_random_model,
    estimate_weight_bytes,
    hf_weight_bytes,
    kv_bytes_per_token,
    state_bytes,
    weight_bytes,
)
from helexa.bench.settings import engine_settings

if TYPE_CHECKING:
    from helexa.config import Config
    from helexa.engine import LLMEngine

GiB, MiB = 1 << 30, 1 << 20
NO_CUDA = (
    "helexa bench gpu needs a CUDA device; torch sees none (use --device cpu --quick to check "
    "the harness)"
)
FULL_MODELS = ("qwen3-0.6b", "qwen3-8b", "qwen3-30b-a3b")
QUICK_MODELS = ("tiny-dense", "tiny-moe")
THROUGHPUT_MODELS = ("qwen3-0.6b", "tiny-dense")  # nano-vllm's protocol runs on 0.6B shapes


@dataclass(frozen=True, slots=True)
class Plan:
    """The sizes of every measurement; --quick shrinks them all."""

    ttft_lengths: tuple[int, ...]
    decode_prompt: int
    decode_tokens: int
    num_seqs: int  # nano-vllm protocol: sequences, input and output lengths in [lo, hi]
    min_len: int
    max_len: int
    copy_mb: int  # the buffer timed for the copy bandwidth


FULL = Plan((1024, 8192, 32768), 128, 256, 256, 100, 1024, 1024)
QUICK = Plan((32, 256, 1024), 16, 16, 8, 8, 32, 64)


def _names(allowed: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        names = [n.strip().lower() for n in text.split(",") if n.strip()]
        bad = [n for n in names if n not in allowed]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"unknown {bad or text!r}; choose from {allowed}")
        return names

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `helexa bench gpu`."""
    add = parser.add_argument
    add(
        "--models",
        type=_names(tuple(PRESETS)),
        help=f"of {', '.join(PRESETS)} (default: the 3 Qwen3; the Qwen3.6 two when named)",
    )
    add("--formats", type=_names(FORMATS), default=list(FORMATS), help="bf16,q4_k (default both)")
    add("--device", default="cuda", help="torch device (default cuda; cpu only with --quick)")
    add("--quick", action="store_true", help="tiny models and short lengths: checks the harness")
    add("--no-hf", action="store_true", help="measure helexa only")
    add("--decode-tokens", type=int, help=f"batch-1 decode tokens (default {FULL.decode_tokens})")
    add("--repeats", type=int, default=3, help="timed TTFT runs per length, median reported")
    add("--prefill-chunk", type=int, default=8192, help="[engine] max_prefill_chunk (8192)")
    add("--max-batched-tokens", type=int, default=16384, help="[engine] max_num_batched_tokens")
    add("--hf-batch", type=int, help="HF sequences per generate call (default: largest that fits)")
    add("--seed", type=int, default=0, help="seed of the weights and prompts")
    add("--json", metavar="FILE", help="write every figure and setting here")


# -- results ---------------------------------------------------------------------------------
@dataclass(slots=True)
class Run:
    """One model in one format on one side: its figures, or why it was skipped."""

    model: str
    fmt: str
    side: str  # "helexa" | "hf"
    figures: dict[str, float] = field(default_factory=dict)  # "decode@1", "ttft@1024", ...
    bytes_held: int = 0
    bytes_per_token: int = 0  # weights read plus recurrent state read and written
    state_bytes_per_token: int = 0  # of which recurrent state (hybrid models)
    settings: dict[str, Any] = field(default_factory=dict)
    status: str = "ok"  # "ok" | "skipped" (does not fit) | "failed"
    reason: str | None = None


def _progress(run: Run, text: str) -> None:
    print(f"[{run.model} {run.fmt} {run.side}] {text}", file=sys.stderr, flush=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _free_bytes(device: torch.device) -> int | None:
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None


def copy_bandwidth(device: torch.device, nbytes: int, iters: int = 20) -> float:
    """Bytes/s a device-to-device copy moves, reads plus writes."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            dst.copy_(src)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
    else:
        t0 = time.perf_counter()
        for _ in range(iters):
            dst.copy_(src)
        seconds = time.perf_counter() - t0
    return 2 * nbytes * iters / seconds


# -- prompts ---------------------------------------------------------------------------------
@dataclass(slots=True)
class Prompts:
    decode: list[int]
    warmup: list[int]
    ttft: dict[int, list[list[int]]]  # length -> warm-up + repeats
    seqs: list[list[int]]  # nano-vllm protocol
    out_lens: list[int]


def make_prompts(vocab: int, eos: int, plan: Plan, repeats: int, seed: int) -> Prompts:
    """Random token ids (eos left out), seeded: the same lists for both sides."""
    rng = random.Random(seed)
    ids = [i for i in range(vocab) if i != eos]

    def draw(n: int) -> list[int]:
        return rng.choices(ids, k=n)

    lo, hi = plan.min_len, plan.max_len
    seqs = [draw(rng.randint(lo, hi)) for _ in range(plan.num_seqs)]
    return Prompts(
        decode=draw(plan.decode_prompt),
        warmup=draw(plan.decode_prompt),
        ttft={n: [draw(n) for _ in range(repeats + 1)] for n in plan.ttft_lengths},
        seqs=seqs,
        out_lens=[rng.randint(lo, hi) for _ in seqs],
    )


# -- memory ----------------------------------------------------------------------------------
def kv_tokens(plan: Plan, prompts: Prompts, block: int) -> tuple[int, int]:
    """KV slots for the longest single request, and for all of the protocol's at once."""
    longest = max(max(plan.ttft_lengths) + 1, plan.decode_prompt + plan.decode_tokens)
    lens = zip(prompts.seqs, prompts.out_lens, strict=True)
    every = sum(-(-(len(p) + n) // block) for p, n in lens) * block
    return (-(-longest // block) + 1) * block, every


def _margin(weights: int) -> int:
    """Room for activations, CUDA graphs and the allocator's slack."""
    return 3 * GiB + weights // 10


def _room(device: torch.device, weights: int, kv: int, what: str) -> tuple[int, str | None]:
    """Bytes left for the KV cache beside the weights (no limit off CUDA), or why the
    model does not fit with `kv` bytes of it."""
    free = _free_bytes(device)
    if free is None:
        return 1 << 62, None
    room = free - weights - _margin(weights)
    if room < kv:
        need = (weights + kv + _margin(weights)) / GiB
        return 0, f"needs ~{need:.1f} GiB ({what}), {free / GiB:.1f} GiB free"
    return room, None


def _fail(run: Run, e: BaseException) -> None:
    """A model that fails costs its own figures, not the run's: say why, go on."""
    run.status = "skipped" if isinstance(e, torch.cuda.OutOfMemoryError) else "failed"
    run.reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    traceback.print_exc(file=sys.stderr)


# -- helexa -----------------------------------------------------------------------------------
def run_helexa(run: Run, cfg: Config, plan: Plan, prompts: Prompts, args) -> None:
    """Build the model in `run.fmt`, measure it, free it."""
    from helexa.engine import EngineArgs, LLMEngine

    model_cfg = PRESETS[run.model]
    device = torch.device(args.device)
    throughput = run.model in THROUGHPUT_MODELS
    per_token = kv_bytes_per_token(model_cfg)
    one, every = kv_tokens(plan, prompts, cfg.engine.block_size)
    weights = estimate_weight_bytes(model_cfg, run.fmt)
    room, why = _room(device, weights, one * per_token, f"KV for a {one}-token request")
    if why:
        run.status, run.reason = "skipped", why
        return
    # every protocol sequence at once when that fits, else the engine preempts as it must
    kv = min(room, max(one, every if throughput else 0) * per_token)
    eargs = EngineArgs.from_config(
        cfg.engine,
        None,
        device=str(device),
        dtype="bfloat16",
        kv_cache_memory_mb=max(1, -(-kv // MiB)),
        max_num_seqs=plan.num_seqs if throughput else 1,
        max_num_batched_tokens=max(args.max_batched_tokens, args.prefill_chunk),
        max_prefill_chunk=args.prefill_chunk,
        max_model_len=model_cfg["max_position_embeddings"],
        enable_prefix_caching=False,
        seed=args.seed,
    )
    engine: LLMEngine | None = None
    try:
        _progress(run, "building random weights")
        engine = LLMEngine(eargs, build_random_model(run.model, model_cfg, run.fmt, device))
        measure_helexa(run, engine, plan, prompts, device, throughput)
    except Exception as e:
        _fail(run, e)
    finally:
        del engine  # the measuring frame is gone: nothing else holds the model
        _free(device)


def measure_helexa(
    run: Run,
    engine: LLMEngine,
    plan: Plan,
    prompts: Prompts,
    device: torch.device,
    throughput: bool,
) -> None:
    from helexa.engine import SamplingParams

    run.bytes_held, run.bytes_per_token = weight_bytes(engine.loaded.model, PRESETS[run.model])
    # each Gated DeltaNet layer reads its conv and ssm state and writes it back, every token
    run.state_bytes_per_token = 2 * state_bytes(PRESETS[run.model], engine.dtype)
    run.bytes_per_token += run.state_bytes_per_token
    run.settings = _settings(engine)
    side = HelexaSide(engine)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    out = engine.generate([prompts.warmup], greedy)[0]
    if out.finish_reason == "error":
        raise RuntimeError(f"non-finite logits from the random weights of {run.model}")
    measure_latency(run, side, plan, prompts)
    if throughput:
        _progress(run, f"throughput, {len(prompts.seqs)} sequences")
        run.figures["throughput"] = helexa_throughput(engine, prompts, device)


def helexa_throughput(engine: LLMEngine, prompts: Prompts, device: torch.device) -> float:
    """nano-vllm's bench.py: all sequences at once, temperature 0.6, ignore_eos; output
    tokens over the wall time of the whole generate."""
    from helexa.engine import SamplingParams

    engine.generate([prompts.warmup], SamplingParams(max_tokens=16))  # nano-vllm warms up too
    params = [
        SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in prompts.out_lens
    ]
    _sync(device)
    t0 = time.perf_counter()
    outs = engine.generate(prompts.seqs, params)
    _sync(device)
    seconds = time.perf_counter() - t0
    assert [len(o.token_ids) for o in outs] == prompts.out_lens
    return sum(prompts.out_lens) / seconds


def _settings(engine: LLMEngine) -> dict[str, Any]:
    """bench engine's settings plus what matters on a GPU."""
    from helexa import kernels

    s = engine_settings(engine)
    s["max_model_len"] = engine.max_model_len
    s["kernels"] = kernels.backend()
    if engine.runner.device.type == "cuda" and hasattr(engine.args, "cuda_graphs"):
        if getattr(engine.runner, "graphs", None) is not None:
            s["cuda_graphs"] = "captured"
        else:
            s["cuda_graphs"] = f"off ({getattr(engine.runner, 'graphs_off_reason', None)})"
    return s


# -- HF transformers ---------------------------------------------------------------------------
class HFRandomSide(HFSide):
    """bench engine's HF side on a model built here, on any device."""

    def __init__(self, model: torch.nn.Module, device: torch.device, pad_id: int) -> None:
        self.model, self.device, self.pad_id = model, device, pad_id
        self.max_new_tokens = None
        self.notes = []

    def generate(
        self, prompts: list[list[int]], new_tokens: int, sample: bool = False
    ) -> tuple[float, list[int]]:
        """Seconds for one `generate` (left-padded batch), and the first row's new tokens."""
        width = max(map(len, prompts))
        ids = [[self.pad_id] * (width - len(p)) + p for p in prompts]
        mask = [[0] * (width - len(p)) + [1] * len(p) for p in prompts]
        ids_t = torch.tensor(ids, device=self.device)
        how = dict(do_sample=True, temperature=0.6, top_k=0, top_p=1.0) if sample else {}
        _sync(self.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids_t,
                attention_mask=torch.tensor(mask, device=self.device),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=self.pad_id,
                **(how or {"do_sample": False}),
            )
        _sync(self.device)
        dt = time.perf_counter() - t0
        assert out.shape == (len(prompts), width + new_tokens), tuple(out.shape)
        return dt, out[0, width:].tolist()


def run_hf(run: Run, plan: Plan, prompts: Prompts, args) -> None:
    """Build the HF model (bf16), measure it, free it."""
    model_cfg = PRESETS[run.model]
    device = torch.device(args.device)
    weights = estimate_weight_bytes(model_cfg, "bf16")
    n = max(plan.ttft_lengths) + 1
    _, why = _room(device, weights, n * kv_bytes_per_token(model_cfg), f"KV for {n} tokens")
    if why:
        run.status, run.reason = "skipped", why
        return
    model = None
    try:
        _progress(run, "building random weights (transformers' init)")
        model = build_hf_model(model_cfg, device, args.seed)
        measure_hf(run, model, plan, prompts, device, args.hf_batch)
    except Exception as e:
        _fail(run, e)
    finally:
        del model
        _free(device)


def measure_latency(run: Run, side: Side, plan: Plan, prompts: Prompts) -> None:
    """Batch-1 decode tok/s and TTFT per prompt length (the first prompt of each a warm-up),
    the same way for either side."""
    _progress(run, f"decode, batch 1, {plan.decode_tokens} tokens")
    run.figures["decode@1"] = side.decode([prompts.decode], plan.decode_tokens).decode_tok_s
    for n, ps in prompts.ttft.items():
        _progress(run, f"TTFT, {n}-token prompt")
        side.ttft(ps[0])
        run.figures[f"ttft@{n}"] = statistics.median(side.ttft(p) for p in ps[1:])


def measure_hf(
    run: Run,
    model: torch.nn.Module,
    plan: Plan,
    prompts: Prompts,
    device: torch.device,
    batch: int | None,
) -> None:
    model_cfg = PRESETS[run.model]
    run.bytes_held, run.bytes_per_token = hf_weight_bytes(model, model_cfg)
    run.settings = {"attn_implementation": model.config._attn_implementation}
    experts = getattr(model.config, "_experts_implementation", None)
    if experts and model_cfg.get("num_experts"):
        run.settings["experts_implementation"] = experts
    side = HFRandomSide(model, device, model_cfg["eos_token_id"])
    side.decode([prompts.warmup], 8)
    measure_latency(run, side, plan, prompts)
    if run.model in THROUGHPUT_MODELS:
        batch = batch or hf_batch_size(model_cfg, plan, device)
        run.settings["batch"] = batch
        _progress(run, f"throughput, {len(prompts.seqs)} sequences in batches of {batch}")
        run.figures["throughput"] = hf_throughput(side, prompts, batch)


def hf_batch_size(cfg: dict[str, Any], plan: Plan, device: torch.device) -> int:
    """The largest power of two (up to all sequences) whose padded KV cache, with half
    as much again for the cache's growth and prefill, fits in 80% of the free memory."""
    free = _free_bytes(device)
    if free is None:
        return plan.num_seqs
    per_seq = 2 * plan.max_len * kv_bytes_per_token(cfg) * 3 // 2
    batch = 1
    while batch * 2 <= plan.num_seqs and batch * 2 * per_seq <= free * 0.8:
        batch *= 2
    return batch


def hf_throughput(side: HFRandomSide, prompts: Prompts, batch: int) -> float:
    """The protocol as static batches: each runs to its longest output; only the tokens
    each sequence asked for count."""
    side.generate(prompts.seqs[:batch], 4, sample=True)
    t0 = time.perf_counter()
    for i in range(0, len(prompts.seqs), batch):
        side.generate(prompts.seqs[i : i + batch], max(prompts.out_lens[i : i + batch]), True)
    return sum(prompts.out_lens) / (time.perf_counter() - t0)


# -- report -----------------------------------------------------------------------------------
def _rows(plan: Plan, model: str) -> list[tuple[str, str]]:
    rows = [("decode@1", "decode, batch 1 (tok/s)")]
    rows += [(f"ttft@{n}", f"TTFT, {n}-token prompt (ms)") for n in plan.ttft_lengths]
    if model in THROUGHPUT_MODELS:
        lo, hi = plan.min_len, plan.max_len
        label = f"output tok/s, {plan.num_seqs} seqs, in/out {lo}-{hi} (nano-vllm)"
        rows.append(("throughput", label))
    return rows


def _cell(run: Run | None, key: str) -> str:
    if run is None:
        return "–"
    if run.status != "ok":
        return run.status
    value = run.figures.get(key)
    if value is None:
        return "–"
    return f"{value * 1e3:.1f}" if key.startswith("ttft@") else f"{value:.1f}"


def _pct(run: Run | None, bandwidth: float) -> str:
    if run is None or run.status != "ok" or "decode@1" not in run.figures:
        return "–"
    pct = 100 * run.bytes_per_token * run.figures["decode@1"] / bandwidth
    return f"{pct:.0f}%" if pct >= 10 else f"{pct:.2g}%"


def format_table(runs: list[Run], plan: Plan, bandwidth: float, hf_note: str) -> str:
    head = (
        "| model | format | figure | helexa | HF transformers | % of copy bandwidth (helexa / HF) |"
    )
    lines = [head, "|---|---|---|---|---|---|"]
    by_key = {(r.model, r.fmt, r.side): r for r in runs}
    for model, fmt in dict.fromkeys((r.model, r.fmt) for r in runs if r.side == "helexa"):
        ours, hf = by_key[(model, fmt, "helexa")], by_key.get((model, "bf16", "hf"))
        for key, label in _rows(plan, model):
            no_hf = fmt == "q4_k" or PRESETS[model]["model_type"] in HYBRID_TYPES
            theirs = "n/a" if no_hf else (_cell(hf, key) if hf else hf_note)
            pct = "–"
            if key == "decode@1":
                pct = f"{_pct(ours, bandwidth)} / " + ("n/a" if no_hf else _pct(hf, bandwidth))
            lines.append(f"| {model} | {fmt} | {label} | {_cell(ours, key)} | {theirs} | {pct} |")
    return "\n".join(lines)


def _moved(run: Run, bandwidth: float) -> str:
    """What one decoded token moves, and the tok/s the copy bandwidth allows for it."""
    moe = " (active experts only)" if "moe" in PRESETS[run.model]["model_type"] else ""
    weights = run.bytes_per_token - run.state_bytes_per_token
    text = f"weights {_size(run.bytes_held)} held, {_size(weights)} read per token{moe}"
    if run.state_bytes_per_token:
        text += f", + recurrent state {_size(run.state_bytes_per_token)} read and written"
    if run.bytes_per_token:
        text += f"; bandwidth ceiling {bandwidth / run.bytes_per_token:.1f} tok/s"
        if "decode@1" in run.figures:
            text += f", measured {run.figures['decode@1']:.1f}"
    return text


def _size(nbytes: int) -> str:
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB else f"{nbytes / MiB:.1f} MiB"


def machine_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"device": str(device), "torch": torch.__version__}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = props.name
        info["gpu_memory_gib"] = round(props.total_memory / GiB, 1)
        info["driver"] = _nvidia_driver()
        info["cuda"] = torch.version.cuda
    else:
        info["cpu"] = platform.processor() or platform.machine()
    for mod in ("triton", "transformers"):
        with contextlib.suppress(ImportError):
            info[mod] = __import__(mod).__version__
    info["python"] = platform.python_version()
    info["helexa_git"] = _git_revision()
    return info


def _nvidia_driver() -> str:
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown (no nvidia-smi)"
    return (
        done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout else "unknown"
    )


# -- entry ------------------------------------------------------------------------------------
def main(args: argparse.Namespace, cfg: Config) -> int:
    """Every model and format, one at a time; the table, then the machine; 2 without CUDA."""
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    plan = QUICK if args.quick else FULL
    if args.decode_tokens is not None:
        if args.decode_tokens < 2:
            raise ValueError(f"--decode-tokens must be >= 2, got {args.decode_tokens}")
        plan = dataclasses.replace(plan, decode_tokens=args.decode_tokens)
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    models = args.models or list(QUICK_MODELS if args.quick else FULL_MODELS)
    hf_note = "–"
    if args.no_hf:
        hf_note = "not run (--no-hf)"
    elif importlib.util.find_spec("transformers") is None:
        hf_note = "not installed"
    machine = machine_info(device)
    nbytes = plan.copy_mb * MiB
    if (free := _free_bytes(device)) is not None:
        nbytes = min(nbytes, free // 4)
    print(f"timing a {nbytes // MiB} MiB device copy", file=sys.stderr, flush=True)
    bandwidth = copy_bandwidth(device, nbytes)
    _free(device)  # the copy's buffers, before the first model sizes its KV cache

    runs: list[Run] = []
    for name in models:
        model_cfg = PRESETS[name]
        prompts = make_prompts(
            model_cfg["vocab_size"], model_cfg["eos_token_id"], plan, args.repeats, args.seed
        )
        for fmt in args.formats:
            runs.append(Run(name, fmt, "helexa"))
            run_helexa(runs[-1], cfg, plan, prompts, args)
        no_hf = model_cfg["model_type"] in HYBRID_TYPES  # HF's builds them from text_config
        if hf_note == "–" and "bf16" in args.formats and not no_hf:
            runs.append(Run(name, "bf16", "hf"))
            run_hf(runs[-1], plan, prompts, args)

    print(format_table(runs, plan, bandwidth, hf_note))
    print()
    _print_machine(machine, bandwidth, nbytes, runs, plan, args)
    if args.json:
        report = {
            "machine": machine,
            "copy_bandwidth_bytes_s": bandwidth,
            "plan": dataclasses.asdict(plan),
            "args": {k: v for k, v in vars(args).items() if k != "func"},
            "runs": [dataclasses.asdict(r) for r in runs],
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
        print(f"\nfigures written to {args.json}")
    return 0


def _print_machine(
    machine: dict[str, Any],
    bandwidth: float,
    nbytes: int,
    runs: list[Run],
    plan: Plan,
    args: argparse.Namespace,
) -> None:
    if "gpu" in machine:
        print(
            f"GPU: {machine['gpu']} ({machine['gpu_memory_gib']} GiB), driver {machine['driver']}, "
            f"CUDA {machine['cuda']}"
        )
    else:
        print(f"device: {machine['device']} ({machine['cpu']})")
    print(
        f"torch {machine['torch']}, triton {machine.get('triton', '–')}, transformers "
        f"{machine.get('transformers', '–')}, python {machine['python']}; helexa "
        f"{machine['helexa_git'] or '(not a git checkout)'}"
    )
    print(
        f"copy bandwidth: {bandwidth / 1e9:.0f} GB/s ({nbytes // MiB} MiB device-to-device "
        "copy, read + write bytes)"
    )
    print(
        "% of copy bandwidth = weight bytes read per decoded token x decode tok/s / copy "
        "bandwidth; bytes read per token: every weight tensor held, less the input embedding "
        "table unless the lm_head shares it, and for MoE only the top-k of the experts, plus "
        "for hybrid models each Gated DeltaNet layer's conv and ssm state, read and written; "
        "ceiling = copy bandwidth / bytes per token"
    )
    for r in runs:
        tag = f"{r.model} {r.fmt} {'helexa' if r.side == 'helexa' else 'HF'}"
        if r.status != "ok":
            print(f"{tag}: {r.status}: {r.reason}")
            continue
        print(
            f"{tag}: {_moved(r, bandwidth)}; "
            + ", ".join(f"{k}={v}" for k, v in r.settings.items())
        )
    print(
        f"prompts: random token ids, seed {args.seed}; decode: {plan.decode_prompt}-token prompt, "
        f"{plan.decode_tokens} new tokens, greedy, after a warm-up; TTFT: one request, "
        f"max_tokens=1, median of {args.repeats} after a warm-up; nano-vllm protocol: "
        f"{plan.num_seqs} sequences, input and output lengths uniform in "
        f"{plan.min_len}-{plan.max_len}, temperature 0.6, ignore_eos; HF runs static left-padded "
        "batches to each batch's longest output and is credited only the requested tokens"
    )
