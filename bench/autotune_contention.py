"""Does a node that started on a busy machine decode as fast, once the machine is quiet, as
one that started quiet? (issue 34, point 2: autotune that cannot poison a node)

(a) `--busy` busy-loop processes hold the CPUs while an engine loads with an empty autotune
    cache (its plans measured busy: provisional, never kept); the loops stop; its decode is
    measured on the provisional plans; then the engine idles as a node's worker does
    (`LLMEngine.idle`) until its plans are measured again on the quiet machine and swapped in.
(b) another engine loads with another empty cache on the quiet machine.
Then both decode in turns (a, b, a, b …: both see the same machine) and the medians are
printed, with the ratio and what the rest of the machine took during each measurement.

    python bench/autotune_contention.py [--model PATH] [--threads 2] [--busy 2]
        [--batch 1,4] [--decode-tokens 128] [--repeats 3] [--settle-s 300]

The figures mean something only on a machine that nothing else uses: the script says, per
measurement, how many CPUs other processes took, and whether each engine's plans are fresh.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from helexa.bench.engine import HelexaSide
from helexa.engine import EngineArgs, LLMEngine
from helexa.engine.layers.cpu_meter import ProcStatMeter, Window
from helexa.engine.loader.load import bundled_model_path


def busy_loops(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
        p.wait()


def load(model: str, args: argparse.Namespace, cache: Path) -> LLMEngine:
    t0 = time.perf_counter()
    engine = LLMEngine(
        EngineArgs(
            model=model,
            num_threads=args.threads,
            kv_cache_memory_mb=256,
            enable_prefix_caching=False,
            max_num_seqs=max(args.batch),
            autotune_dir=str(cache),
        )
    )
    print(f"  loaded in {time.perf_counter() - t0:.1f}s: {engine.autotune_report()}", flush=True)
    return engine


def settle(engine: LLMEngine, limit_s: float) -> None:
    """Idle as a node's worker does until the provisional plans are swapped in (or limit_s)."""
    if engine.retuner is None or not engine.retuner.pending:
        return
    t0 = time.perf_counter()
    wake = threading.Event()
    timer = threading.Timer(limit_s, wake.set)
    timer.start()
    try:
        while engine.retuner.pending and not wake.is_set():
            engine.idle(wake)
    finally:
        timer.cancel()
    took = time.perf_counter() - t0
    print(f"  after {took:.0f}s idle: {engine.autotune_report()}", flush=True)


def prompts(engine: LLMEngine, batch: int, length: int, seed: int) -> list[list[int]]:
    vocab = min(engine.tokenizer.vocab_size, engine.loaded.config.vocab_size)
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(batch)]


def decode(engine: LLMEngine, batch: int, args: argparse.Namespace, window: Window) -> float:
    """Decode tok/s of one run (all `batch` sequences together), metered into `window`."""
    meter = ProcStatMeter()
    side = HelexaSide(engine)
    todo = prompts(engine, batch, 64, args.seed)
    start = meter.read()
    run = side.decode(todo, args.decode_tokens)
    window.add(start, meter.read())
    return run.decode_tok_s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help=".gguf or model dir (default: the bundled SmolLM2)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--busy", type=int, default=2, help="busy loops during (a)'s load")
    ap.add_argument("--batch", default="1,4", help="batch sizes (default 1,4)")
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="turns per engine, median kept")
    ap.add_argument("--settle-s", type=float, default=300.0, help="most idle time for (a)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    args.batch = [int(b) for b in args.batch.split(",")]
    torch.set_num_threads(args.threads)
    model = args.model or bundled_model_path()
    if model is None:
        raise SystemExit("no --model and the bundled SmolLM2 is not installed")
    model = str(model)
    with tempfile.TemporaryDirectory() as busy_dir, tempfile.TemporaryDirectory() as quiet_dir:
        print(f"(a) {args.busy} busy loops while an engine loads {Path(model).name}", flush=True)
        loops = busy_loops(args.busy)
        try:
            time.sleep(0.5)  # running
            started_busy = load(model, args, Path(busy_dir))
        finally:
            stop(loops)
        provisional = {b: decode(started_busy, b, args, Window(1, 1)) for b in args.batch}
        print(f"  on its first plans: {fmt(provisional)}", flush=True)
        settle(started_busy, args.settle_s)
        print("(b) an engine loads on the quiet machine", flush=True)
        started_quiet = load(model, args, Path(quiet_dir))
        engines = {"a": started_busy, "b": started_quiet}
        for name, engine in engines.items():  # (a) may not have seen a quiet spell yet
            if engine.retuner is not None and engine.retuner.pending:
                print(f"({name}) idles until its plans are measured again", flush=True)
                settle(engine, args.settle_s)
        cpus = ProcStatMeter().num_cpus
        runs = {k: {b: [] for b in args.batch} for k in engines}
        windows = {k: Window(cpus, args.threads) for k in engines}
        for _ in range(args.repeats):
            for b in args.batch:
                for k, engine in engines.items():
                    runs[k][b].append(decode(engine, b, args, windows[k]))
        a = {b: statistics.median(v) for b, v in runs["a"].items()}
        q = {b: statistics.median(v) for b, v in runs["b"].items()}
    print()
    print(f"decode tok/s, median of {args.repeats}, {args.decode_tokens} tokens a sequence:")
    for b in args.batch:
        print(
            f"  batch {b}: (a) started busy {a[b]:.1f}   (b) started quiet {q[b]:.1f}   "
            f"a/b {a[b] / q[b]:.3f}   (a on its first plans: {provisional[b]:.1f})"
        )
    for k, w in windows.items():
        print(f"  rest of the machine during ({k})'s runs: {w.others_s / w.wall_s:.2f} CPUs")
    print(f"  plans: (a) {engines['a'].autotune_report().state}, ", end="")
    print(f"(b) {engines['b'].autotune_report().state}")
    return 0


def fmt(tok_s: dict[int, float]) -> str:
    return ", ".join(f"batch {b}: {v:.1f} tok/s" for b, v in tok_s.items())


if __name__ == "__main__":
    sys.exit(main())
