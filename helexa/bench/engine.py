"""`helexa bench engine`: TTFT and decode throughput of the in-process engine, beside HF
transformers on the same GGUF, the same prompts and the same thread count.

Prompts are random token ids (special and eos ids left out), seeded, shared by both
sides. Both models are loaded first (never timed); then every figure is measured on
both sides back to back, TTFT repeats interleaved, so that both see the same load from
whatever else runs on the machine. Each side warms up once per shape before timing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import statistics
import subprocess
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from helexa.bench import llama_cpp
from helexa.bench.llama_cpp import LlamaBench
from helexa.bench.settings import engine_settings

if TYPE_CHECKING:
    from helexa.config import Config
    from helexa.engine import LLMEngine

WARMUP_TOKENS = 4


def _int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 4,16, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `helexa bench engine`."""
    add = parser.add_argument
    add("--model", help="local dir, .gguf file or hub id (default: bundled SmolLM2)")
    add("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    add("--repeats", type=int, default=3, help="timed TTFT runs per length, median reported")
    add("--decode-tokens", type=int, default=128, help="new tokens per sequence (default 128)")
    add("--decode-prompt", type=int, default=64, help="prompt tokens in decode runs (default 64)")
    add(
        "--decode-repeats",
        type=int,
        default=3,
        help="timed decode runs per batch size, rounds over every size in turn; the median "
        "run reported (default 3)",
    )
    add("--concurrency", type=_int_list, default=[4, 8, 16], help="batch sizes (default 4,8,16)")
    add("--prompt-lengths", type=_int_list, default=[128, 1024], help="TTFT prompt lengths")
    add("--kv-cache-mb", type=int, default=512, help="helexa KV cache pool (default 512)")
    add("--skip-hf", action="store_true", help="measure helexa only")
    add("--hf-decode-tokens", type=int, help="cap HF new tokens per sequence (it is slow)")
    add("--seed", type=int, default=0, help="seed of the random prompts")
    add("--json", metavar="FILE", help="write the raw figures here")
    add(
        "--sides",
        action="store_true",
        help="only batch-1 decode of the engine's step loop, LLM.generate and a node over "
        "HTTP, side by side (helexa/bench/sides.py)",
    )
    add(
        "--llama-bench",
        metavar="PATH",
        help="llama.cpp's llama-bench, run on the same GGUF in the same run as a reference "
        "(default: llama-bench on PATH, if any)",
    )


# -- prompts and results -------------------------------------------------------------------
@dataclass(slots=True)
class Prompts:
    """Every prompt either side will see, drawn once: warm-ups apart from timed ones."""

    ttft: dict[int, list[list[int]]]  # length → warm-up + `repeats` prompts
    decode: dict[int, list[list[int]]]  # batch size → prompts (1 and each concurrency)
    warmup: list[list[int]]  # decode warm-ups take the first `batch` of these


def make_prompts(engine: LLMEngine, args: argparse.Namespace) -> Prompts:
    tok = engine.tokenizer
    special = set(tok.backend.get_added_tokens_decoder()) | tok.eos_token_ids
    vocab = min(tok.vocab_size, engine.loaded.config.vocab_size)
    ids = [i for i in range(vocab) if i not in special]
    rng = random.Random(args.seed)

    def draw(n: int, length: int) -> list[list[int]]:
        return [rng.choices(ids, k=length) for _ in range(n)]

    batches = sorted({1, *args.concurrency})
    return Prompts(
        ttft={n: draw(args.repeats + 1, n) for n in args.prompt_lengths},
        decode={b: draw(b, args.decode_prompt) for b in batches},
        warmup=draw(max(batches), args.decode_prompt),
    )


@dataclass(slots=True)
class DecodeRun:
    batch: int
    new_tokens: int  # per sequence
    ttft_s: float  # start → every sequence has its first token
    decode_s: float  # first tokens → all done
    total_s: float
    decode_tokens: int  # tokens generated within decode_s
    first_output: list[int] = field(default_factory=list)  # the first sequence's new tokens

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s

    @property
    def e2e_tok_s(self) -> float:
        return self.batch * self.new_tokens / self.total_s


@dataclass(slots=True)
class SideResult:
    name: str
    ttft_s: dict[int, list[float]] = field(default_factory=dict)  # length → samples
    decode: dict[int, DecodeRun] = field(default_factory=dict)  # batch → the median run
    decode_all: dict[int, list[DecodeRun]] = field(default_factory=dict)  # batch → every run
    notes: list[str] = field(default_factory=list)
    # "ttft@128", "decode@4" → CPUs the rest of the machine (others + steal) took meanwhile
    busy: dict[str, dict[str, float]] = field(default_factory=dict)

    def figures(self) -> dict[str, float]:
        out = {f"ttft@{n}": statistics.median(s) for n, s in self.ttft_s.items()}
        for b, run in self.decode.items():
            if b == 1:
                out["decode@1"] = run.decode_tok_s
            else:
                out[f"agg_decode@{b}"] = run.decode_tok_s
                out[f"agg_e2e@{b}"] = run.e2e_tok_s
        return out

    def raw(self) -> dict[str, Any]:
        runs = {
            str(b): {**asdict(r), "decode_tok_s": r.decode_tok_s, "e2e_tok_s": r.e2e_tok_s}
            for b, r in self.decode.items()
        }
        samples = {str(b): [r.decode_tok_s for r in rs] for b, rs in self.decode_all.items()}
        return {
            "ttft_samples_s": {str(n): s for n, s in self.ttft_s.items()},
            "decode_runs": runs,
            "decode_samples_tok_s": samples,
            "figures": self.figures(),
            "rest_of_machine": self.busy,
            "notes": self.notes,
        }


class Side(Protocol):
    name: str
    notes: list[str]

    def ttft(self, prompt: list[int]) -> float: ...

    def decode(self, prompts: list[list[int]], new_tokens: int) -> DecodeRun: ...


# -- helexa --------------------------------------------------------------------------------
class HelexaSide:
    """The engine driven through add_request/step, as the node drives it."""

    name = "helexa"

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.notes = ["prefix caching off; every TTFT prompt is distinct"]

    def ttft(self, prompt: list[int]) -> float:
        """Seconds from add_request to the first sampled token, batch of one, greedy."""
        from helexa.engine import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        t0 = time.perf_counter()
        seq = self.engine.add_request(prompt, params)
        while seq.num_output_tokens == 0:
            self.engine.step()
        t1 = time.perf_counter()
        assert not self.engine.has_unfinished()
        return t1 - t0

    def decode(self, prompts: list[list[int]], new_tokens: int) -> DecodeRun:
        """All prompts added at once; time to every first token, then to the last."""
        from helexa.engine import SamplingParams

        engine = self.engine
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        seqs = [engine.add_request(p, params) for p in prompts]
        while not all(s.num_output_tokens for s in seqs):
            engine.step()
        t1 = time.perf_counter()
        done_at_t1 = sum(s.num_output_tokens for s in seqs)
        while engine.has_unfinished():
            engine.step()
        t2 = time.perf_counter()
        assert all(s.num_output_tokens == new_tokens for s in seqs)
        produced = sum(s.num_output_tokens for s in seqs) - done_at_t1
        out = seqs[0].output_token_ids
        return DecodeRun(len(prompts), new_tokens, t1 - t0, t2 - t1, t2 - t0, produced, out)


# -- HF transformers ---------------------------------------------------------------------
class HFSide:
    """`generate` on a static batch: all that HF transformers offers."""

    name = "HF transformers"

    def __init__(self, path: str, max_new_tokens: int | None) -> None:
        import transformers

        gguf = os.path.abspath(path)
        with _gguf_without_accelerate() as lifted:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                os.path.dirname(gguf), gguf_file=os.path.basename(gguf), dtype=torch.float32
            )
        self.model = model.eval()
        self.max_new_tokens = max_new_tokens
        self.notes = ["GGUF dequantized to fp32 by transformers' own loader"]
        if lifted:
            self.notes.append("loaded with the accelerate guard lifted (accelerate not installed)")

    def generate(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[int]]:
        """Seconds for one `generate` call, and the first sequence's new tokens."""
        # Equal lengths, so the left padding HF batching needs is empty: the mask is all ones.
        ids = torch.tensor(prompts, dtype=torch.long)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=self.model.generation_config.pad_token_id or 0,
            )
        dt = time.perf_counter() - t0
        assert out.shape == (len(prompts), ids.shape[1] + new_tokens), tuple(out.shape)
        return dt, out[0, ids.shape[1] :].tolist()

    def ttft(self, prompt: list[int]) -> float:
        return self.generate([prompt], 1)[0]

    def decode(self, prompts: list[list[int]], new_tokens: int) -> DecodeRun:
        """TTFT = generate(1 token); decode = generate(N) minus that."""
        n = min(new_tokens, self.max_new_tokens or new_tokens)
        if n < new_tokens and new_tokens > WARMUP_TOKENS:
            note = f"decode capped at {n} new tokens per sequence (--hf-decode-tokens)"
            self.notes += [note] if note not in self.notes else []
        ttft, _ = self.generate(prompts, 1)
        total, out = self.generate(prompts, n)
        b = len(prompts)
        return DecodeRun(b, n, ttft, total - ttft, total, b * (n - 1), out)


@contextlib.contextmanager
def _gguf_without_accelerate() -> Iterator[bool]:
    """transformers guards GGUF loading on `accelerate` being installed but does not use
    it on CPU. Lift the guard while loading when it is absent; yields whether it did."""
    import importlib.util

    import transformers.modeling_utils as mu

    if importlib.util.find_spec("accelerate") is not None:
        yield False
        return
    saved = mu.is_accelerate_available
    mu.is_accelerate_available = lambda *a, **k: True
    try:
        yield True
    finally:
        mu.is_accelerate_available = saved


# -- the run -------------------------------------------------------------------------------
class CpuMeter:
    """CPU time the rest of the machine took (other processes, hypervisor steal) while we
    measured: on a 2-core box a single busy neighbour wrecks 2-thread figures. Read as the
    autotune reads it (engine/layers/cpu_meter.py), with the steal apart."""

    def __init__(self) -> None:
        from helexa.engine.layers.cpu_meter import ProcStatMeter

        self._meter = ProcStatMeter()
        self.start = self._meter.read()

    def read(self) -> dict[str, float]:
        """Mean CPUs busy with other processes, and stolen by the hypervisor, so far."""
        start, end = self.start, self._meter.read()
        wall = max(end.wall_s - start.wall_s, 1e-9)
        steal = end.steal_s - start.steal_s
        others = (end.busy_s - start.busy_s) - steal - (end.own_s - start.own_s)
        return {"others_cpus": max(0.0, others) / wall, "steal_cpus": steal / wall}


def run(sides: list[Side], prompts: Prompts, args: argparse.Namespace) -> list[SideResult]:
    """Every figure on every side back to back, TTFT repeats interleaved."""
    results = [SideResult(s.name) for s in sides]
    for n, ps in prompts.ttft.items():
        for side in sides:
            side.ttft(ps[0])  # warm-up
        meter = CpuMeter()
        for p in ps[1:]:
            for side, res in zip(sides, results, strict=True):
                res.ttft_s.setdefault(n, []).append(side.ttft(p))
        busy = meter.read()  # the repeats interleave, so both sides saw the same
        for res in results:
            res.busy[f"ttft@{n}"] = busy
            _progress(res, f"ttft@{n}", ", ".join(f"{v:.3f}s" for v in res.ttft_s[n]))
    # Rounds over every batch size in turn, so that a slow spell of the machine lands on
    # several sizes' runs rather than on all of one size's: the median run of each is kept.
    for rnd in range(args.decode_repeats):
        for b, ps in prompts.decode.items():
            for side, res in zip(sides, results, strict=True):
                if rnd == 0:
                    side.decode(prompts.warmup[:b], WARMUP_TOKENS)
                meter = CpuMeter()
                r = side.decode(ps, args.decode_tokens)
                busy = meter.read()
                key = f"decode@{b}"
                worst = res.busy.get(key)
                if worst is None or _cpus(busy) > _cpus(worst):  # the worst round's
                    res.busy[key] = busy
                runs = res.decode_all.setdefault(b, [])
                runs.append(r)
                res.decode[b] = sorted(runs, key=lambda x: x.decode_tok_s)[(len(runs) - 1) // 2]
                text = (
                    f"{r.decode_tok_s:.1f} tok/s decode, {r.e2e_tok_s:.1f} tok/s end-to-end, "
                    f"first tokens after {r.ttft_s:.2f}s"
                )
                _progress(res, f"{key} (round {rnd + 1}/{args.decode_repeats})", text)
    for side, res in zip(sides, results, strict=True):
        res.notes = list(side.notes)
    if len(results) > 1:
        results[1].notes.append(_agreement(results[0], results[1]))
    return results


def _busy(res: SideResult, key: str) -> float:
    """CPUs the rest of the machine took while `key` ("ttft@128", "agg_e2e@4") ran."""
    key = key if key.startswith("ttft@") else f"decode@{key.split('@')[1].split()[0]}"
    return _cpus(res.busy.get(key, {}))


def _cpus(reading: dict[str, float]) -> float:
    """Other processes' CPUs plus the hypervisor's steal, from a CpuMeter reading."""
    return reading.get("others_cpus", 0.0) + reading.get("steal_cpus", 0.0)


def _progress(res: SideResult, what: str, text: str) -> None:
    print(f"  [{res.name}] {what}: {text}  (rest of machine: {_busy(res, what):.2f} CPUs)")


def _agreement(ours: SideResult, hf: SideResult) -> str:
    """How far the batch-1 greedy outputs agree: a check that both do the same work."""
    a, b = ours.decode[1].first_output, hf.decode[1].first_output
    pairs = zip(a, b, strict=False)
    same = next((i for i, (x, y) in enumerate(pairs) if x != y), min(len(a), len(b)))
    why = "" if same == len(b) else " (random prompts give near-ties that rounding flips)"
    return f"batch-1 greedy output matches helexa's for the first {same} of {len(b)} tokens{why}"


# -- report ------------------------------------------------------------------------------
def _rows(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """(key, label, unit) for each figure, in table order."""
    rows = [(f"ttft@{n}", f"TTFT, {n}-token prompt", "s") for n in args.prompt_lengths]
    rows.append(("decode@1", "decode, batch 1", "tok/s"))
    batches = [b for b in args.concurrency if b > 1]
    rows += [(f"agg_decode@{b}", f"aggregate decode, {b} concurrent", "tok/s") for b in batches]
    rows += [(f"agg_e2e@{b}", f"aggregate incl. prefill, {b} concurrent", "tok/s") for b in batches]
    return rows


def format_table(
    results: list[SideResult], args: argparse.Namespace, llama: LlamaBench | None = None
) -> str:
    """Markdown: a row per figure, llama.cpp's (llama-bench, this run) where measured with
    helexa's speed over its; the last column is the CPU the rest of the machine took while
    each side measured it."""
    figs = [r.figures() for r in results]
    head = ["figure", *(r.name for r in results)]
    if llama is not None:
        head += [f"llama.cpp {llama.build}", "helexa / llama.cpp (speed)"]
    head.append("rest of machine (CPUs)")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, label, unit in _rows(args):
        digits = 2 if unit == "s" else 1
        cells = ["–" if key not in f else f"{f[key]:.{digits}f}" for f in figs]
        if llama is not None:
            value = llama.figures.get(key)
            cells.append("–" if value is None else f"{value:.{digits}f}")
            cells.append(speed_ratio(figs[0].get(key), value, unit))
        busy = " / ".join(f"{_busy(r, key):.2f}" for r in results)
        lines.append(f"| {label} ({unit}) | {' | '.join(cells)} | {busy} |")
    return "\n".join(lines)


def speed_ratio(ours: float | None, theirs: float | None, unit: str) -> str:
    """How many times faster helexa is: tok/s over tok/s, or their seconds over ours."""
    if not ours or not theirs:
        return "–"
    return f"{(theirs / ours if unit == 's' else ours / theirs):.2f}x"


def machine_info(threads: int) -> dict[str, Any]:
    from helexa.engine.layers.autotune import cpu_info

    info: dict[str, Any] = {
        "cpu": cpu_info()[0],
        "logical_cpus": os.cpu_count(),
        "threads": threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "helexa_git": _git_revision(),
    }
    with contextlib.suppress(ImportError):
        import transformers

        info["transformers"] = transformers.__version__
    return info


def _git_revision() -> str | None:
    """HEAD of the checkout this code runs from, '+dirty' when it has local changes."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def git(*cmd: str) -> str:
        try:
            run = subprocess.run(
                ["git", "-C", root, *cmd], capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.SubprocessError):
            return ""
        return run.stdout.strip() if run.returncode == 0 else ""

    head = git("rev-parse", "--short", "HEAD")
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return head + ("+dirty" if dirty else "") if head else None


def _llama_bench(args: argparse.Namespace, model: Path, device: torch.device) -> LlamaBench | None:
    """llama.cpp on the same file, threads (or the GPU: -ngl 99 -fa 1) and lengths,
    measured now; None (said why) when there is no llama-bench or no GGUF to give it."""
    exe = llama_cpp.find(args.llama_bench)
    if exe is None:
        print("llama.cpp: no llama-bench on PATH (--llama-bench PATH to compare); no reference")
        return None
    if model.suffix != ".gguf":
        print(f"llama.cpp: {model} is not a .gguf file; no reference")
        return None
    threads = None if device.type == "cuda" else args.threads
    where = f"{args.threads} threads" if threads else "the GPU (-ngl 99 -fa 1)"
    print(f"llama.cpp: running {exe} on the same file, {where} …", flush=True)
    try:
        return llama_cpp.run(
            exe,
            str(model),
            threads,
            args.prompt_lengths,
            args.decode_tokens,
            args.repeats,
            depth=args.decode_prompt,  # tg from the context our decode runs start at
        )
    except ValueError as e:
        print(f"llama.cpp: no reference ({e})")
        return None


# -- entry ---------------------------------------------------------------------------------
def main(args: argparse.Namespace, cfg: Config) -> int:
    """Load both sides, run every figure, print the table (and --json); 0 on success."""
    from helexa.engine import EngineArgs, LLMEngine
    from helexa.engine.loader.load import bundled_model_path

    names = ("threads", "repeats", "decode_tokens", "decode_prompt", "decode_repeats")
    for name in (*names, "hf_decode_tokens"):
        value = getattr(args, name)
        low = 2 if "decode_tokens" in name else 1  # decode speed needs tokens after the first
        if value is not None and value < low:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {value}")
    torch.set_num_threads(args.threads)
    model = args.model or bundled_model_path()
    if model is None:
        raise FileNotFoundError("no --model and the bundled SmolLM2 is not installed")
    eargs = EngineArgs.from_config(
        cfg.engine,
        str(model),
        num_threads=args.threads,
        kv_cache_memory_mb=args.kv_cache_mb,
        enable_prefix_caching=False,
        max_num_seqs=max(cfg.engine.max_num_seqs, *args.concurrency),
        autotune_dir=str(cfg.node.state_dir / "autotune"),
    )
    if args.sides:
        from helexa.bench import sides

        return sides.main(args, cfg, eargs)
    machine = machine_info(args.threads)
    t0 = time.perf_counter()
    engine = LLMEngine(eargs)
    sides: list[Side] = [HelexaSide(engine)]
    t1 = time.perf_counter()
    print(f"helexa engine loaded in {t1 - t0:.1f}s (not timed)", flush=True)
    if not args.skip_hf:
        path = engine.loaded.path
        if path.suffix != ".gguf":
            raise ValueError(f"the HF side loads a .gguf file; got {str(path)!r} (use --skip-hf)")
        sides.append(HFSide(str(path), args.hf_decode_tokens))
        print(f"HF transformers loaded in {time.perf_counter() - t1:.1f}s (not timed)", flush=True)

    results = run(sides, make_prompts(engine, args), args)
    settings = engine_settings(engine)
    worst = max(_busy(r, k) for r in results for k in r.busy)

    print()
    print(
        f"machine: {machine['cpu']}, {machine['logical_cpus']} logical CPUs, "
        f"{args.threads} torch threads, torch {machine['torch']}, "
        f"transformers {machine.get('transformers', '–')}; "
        f"helexa {machine['helexa_git'] or '(not a git checkout)'}"
    )
    print(
        f"rest of the machine (other processes + hypervisor steal) took up to {worst:.2f} CPUs "
        "during a measurement" + (": CONTENDED, figures are not reliable" if worst > 0.25 else "")
    )
    print("engine: " + ", ".join(f"{k}={v}" for k, v in settings.items()))
    print(
        f"prompts: random token ids (specials/eos excluded), seed {args.seed}; TTFT median of "
        f"{args.repeats} after 1 warm-up; decode: {args.decode_prompt}-token prompts, "
        f"{args.decode_tokens} new tokens, greedy, ignore_eos, after a warm-up the median of "
        f"{args.decode_repeats} timed runs, in rounds over the batch sizes"
    )
    for res in results:
        for note in res.notes:
            print(f"{res.name}: {note}")
    llama = _llama_bench(args, engine.loaded.path, engine.runner.device)
    if llama is not None and "decode@1/d0" in llama.figures:
        print(
            f"llama.cpp: decode, batch 1 is llama-bench's tg{args.decode_tokens} after "
            f"{args.decode_prompt} tokens (-d {args.decode_prompt}), where helexa's decode runs "
            f"start; from an empty context (tg{args.decode_tokens}): "
            f"{llama.figures['decode@1/d0']:.1f} tok/s"
        )
    print()
    print(format_table(results, args, llama))

    if args.json:
        report = {
            "machine": machine,
            "engine": settings,
            "args": {k: v for k, v in vars(args).items() if k != "func"},
            "sides": {r.name: r.raw() for r in results},
            "llama_cpp": None
            if llama is None
            else {"build": llama.build, "figures": llama.figures, "raw": llama.raw},
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
        print(f"\nraw figures written to {args.json}")
    return 0
