"""How each CPU-packed Linear runs a call of a given number of rows, chosen by measuring
this machine at load instead of by thresholds fixed on another CPU.

torch's packed int4/int8 kernels are not equally good at every row count: on one CPU a
16-row call costs as much as a 32-row one, on another the 12-row case falls off a cliff. So
per weight shape, two paths are timed per row bucket (1, 2, 4 … 512): the packed kernel
(bf16 activations) and a float32 GEMM, on the dense copy where `[engine] cpu_dense_copy`
keeps one, else on the weight dequantized within the call (no memory held: on wide prompt
chunks the dequantization is a few percent of the GEMM, and a GEMM can beat the packed
kernel by 2x there). The paths take turns, ROUNDS times a bucket, and each keeps its
quickest turn, so a neighbour's burst during one turn cannot decide. Each bucket takes the
cheapest way to cover its rows: either path on all of them, or on chunks of a smaller
bucket's size (b/c calls of c rows). Any smaller bucket's way is among the candidates,
scaled, so more rows never lower a call's throughput.

Prompt steps run in float32 whatever their size (linear.PREFILL_STEP). On GGUF blocks a
call of few rows takes the exact float32 block kernel (no weight unpacked), a wide one the
GEMM on the weight unpacked for the call: the two are timed at the buckets up to 128 rows,
and `exact_rows` is the largest bucket up to which the kernel stays the quicker (a prompt
tail after a prefix-cache hit is typically 1-100 rows: through the GEMM, 11 rows took the
whole weight's unpacking, ~120 ms a step for SmolLM2 on a 2-core EPYC).

This module measures; `tuner.Autotuner` keeps the plans (in `<cache_dir>/<machine>.json`,
the node's `state_dir/autotune`, only those measured on a quiet machine), checks cached ones
at start (`holds`), and `retune.Retuner` re-measures the rest when the machine is quiet.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import itertools
import platform
import time
from collections.abc import Callable, Generator
from pathlib import Path
from typing import NamedTuple

import torch

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # 512: the default prompt chunk
# past this many seconds a call, a path's time at twice the rows is taken as twice its time
# (the lm_head at 512 rows would cost seconds of load to time, and says nothing new)
MAX_TIMED_CALL_S = 0.05
# A plan: (through the dense copy?, rows per call; 0: all of them at once)
Plan = tuple[bool, int]
WHOLE: Plan = (False, 0)
DENSE: Plan = (True, 0)
MIN_TIMED_S = 0.003  # each timing repeats the call until this much time has passed
# 4: blocks timed cold; 5: exact_rows; 6: x8 unpack 4x quicker; 7: [K, N]; 8: interleaved
# rounds, and each shape's conditions (only quiet measurements are kept)
CACHE_VERSION = 8
EXACT_BUCKETS = BUCKETS[: BUCKETS.index(128) + 1]  # prompt-step row counts timed both ways
ROUNDS = 3  # turns each path takes per bucket; its quickest counts
MAX_ROUNDS_FACTOR = 3  # up to 3x the rounds while the bucket's winner is not `settled`
# Where a cached plan is checked at start: one sequence decoding, and a few together.
CHECKED_BUCKETS = (1, 4)
# A cached plan is replaced when it loses by more than its timings' own spread, and never
# by less than this: a coin-flip between two equal paths is not worth a re-measure.
MIN_MARGIN = 0.05
# (call, path, rows) -> seconds one call takes; path: "kernel" | "dense" | "exact"
Timer = Callable[[Callable[[], object], str, int], float]


class Measured(NamedTuple):
    plans: list[Plan]  # per bucket
    exact_rows: int | None  # GGUF blocks only


def cpu_info() -> tuple[str, str]:
    """(the CPU's model name, its flags) from /proc/cpuinfo; platform's name elsewhere."""
    cpu, flags = platform.processor() or "unknown", ""
    try:
        with open("/proc/cpuinfo") as f:
            info = dict(line.split(":", 1) for line in f if ":" in line and line[0] != " ")
        info = {k.strip(): v.strip() for k, v in info.items()}  # the last CPU's lines win
        cpu, flags = info.get("model name", cpu), info.get("flags", "")
    except OSError:
        pass
    return cpu, flags


# the native kernels' sources: a change to them can change which path is quicker
NATIVE_SOURCE = Path(__file__).with_name("native") / "blocks.c"
KQUANT_SOURCE = NATIVE_SOURCE.with_name("kquants.c")
COMMON_HEADER = NATIVE_SOURCE.with_name("common.h")


def machine_key(num_threads: int) -> str:
    """The CPU (model and flags), torch's version, the thread count and the native kernels'
    source, hashed: plans measured under one never serve another."""
    cpu, flags = cpu_info()
    try:
        sources = b"".join(p.read_bytes() for p in (NATIVE_SOURCE, KQUANT_SOURCE, COMMON_HEADER))
        native = hashlib.sha256(sources).hexdigest()[:16]
    except OSError:
        native = "none"
    text = f"{cpu}|{flags}|{torch.__version__}|{num_threads}|v{CACHE_VERSION}|{native}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def shape_key(linear: torch.nn.Module) -> str:
    """What a plan depends on: the storage format and the kernel's shape."""
    k = linear.in_features * linear.k_repeat
    dense = "+dense" if linear.dense is not None else ""
    fmt = linear.format if linear.block_kind is None else f"{linear.format}-{linear.block_kind}"
    if getattr(linear, "block_parts", ()):  # a fused Linear of parts held as different kinds
        fmt += "-" + "+".join(f"{kind}:{rows}" for kind, rows in linear.block_parts)
    return f"{fmt}{dense}:{linear.out_features}x{k}"


def plan_for_rows(plans: list[Plan]) -> list[Plan]:
    """Per-bucket plans spread over row counts 0 … BUCKETS[-1] (index = rows): a call with
    r rows takes the plan of the smallest bucket that holds it."""
    by_rows = [WHOLE] * (BUCKETS[-1] + 1)
    for rows in range(1, len(by_rows)):
        i = next(i for i, b in enumerate(BUCKETS) if b >= rows)
        by_rows[rows] = plans[i]
    return by_rows


def choose(kernel_s: list[float], dense_s: list[float] | None) -> list[Plan]:
    """Each bucket's cheapest plan from the time of the kernel (and of the dense copy,
    where held) at every bucket: covering b rows with calls of c costs (b / c) x time(c)."""
    paths = [(False, kernel_s)] + ([(True, dense_s)] if dense_s is not None else [])
    plans: list[Plan] = []
    for i, b in enumerate(BUCKETS):
        best, best_s = WHOLE, float("inf")
        for dense, times in paths:
            for j in range(i + 1):
                cost = b / BUCKETS[j] * times[j]
                if cost < best_s:
                    best, best_s = (dense, 0 if j == i else BUCKETS[j]), cost
        plans.append(best)
    return plans


def timed(call: Callable[[], object], path: str, rows: int) -> float:
    """Seconds one `call` (of `path` on `rows` rows) takes: one warm call, then repeats
    until MIN_TIMED_S has passed. The default `Timer`."""
    call()  # warm
    n, t0 = 0, time.perf_counter()
    while True:
        call()
        n += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= MIN_TIMED_S:
            return elapsed / n


@functools.cache
def cache_bytes(level: int) -> int | None:
    """The size of cpu0's level-`level` data or unified cache (sysfs), None where unknown."""
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            if int((index / "level").read_text()) != level:
                continue
            if (index / "type").read_text().strip() == "Instruction":
                continue
            text = (index / "size").read_text().strip().upper()
            return int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20}[text[-1]]
        except (OSError, ValueError, KeyError):
            continue
    return None


def last_level_cache_bytes() -> int:
    """The largest CPU cache's size (sysfs), 32 MiB where it cannot be read."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = path.read_text().strip().upper()
            sizes.append(int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20}[text[-1]])
        except (OSError, ValueError, KeyError):
            continue
    return max(sizes, default=32 << 20)


def _cold_copies(linear: torch.nn.Module) -> Callable[[], torch.nn.Module]:
    """Copies of a native-block Linear whose weights together pass twice the last-level
    cache, served in turn: each timed call then streams its weight from memory, as in a real
    step where every layer's weights follow each other. Timed hot, unpacking the blocks for
    a float32 GEMV looked faster than the block kernel at one row (the weight 6.4x larger
    but cached), and a node that took that plan decoded 4x slower."""
    if linear.format != "blocks":
        return lambda: linear
    count = min(64, max(1, -(-2 * last_level_cache_bytes() // linear.weight.nbytes)))
    copies = [linear]
    for _ in range(count - 1):
        twin = copy.copy(linear)  # shares all but the weight, which it holds anew
        twin.weight = linear.weight.clone()
        copies.append(twin)
    turn = itertools.cycle(copies)
    return lambda: next(turn)


def measuring(
    linear: torch.nn.Module, timer: Timer = timed, rounds: int = ROUNDS
) -> Generator[None, None, Measured]:
    """Time `linear`'s packed kernel and its float32 GEMM (on the dense copy, or on the
    weight dequantized within each call) at every bucket, and on GGUF blocks the exact
    float32 kernel up to 128 rows. Per bucket the paths take turns, `rounds` times (more
    while the winner is not `settled`), and each keeps its quickest: a neighbour's burst
    slows one turn, not the verdict. Yields after
    every round (a slice: the retuner stops between them); returns the plans."""
    gen = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {"kernel": [], "dense": [], "exact": []}
    pick = _cold_copies(linear)
    runs = {
        "kernel": lambda rows: pick().packed_matmul(rows),
        "dense": lambda rows: pick().dense_matmul(rows),
        "exact": lambda rows: pick().exact_matmul(rows),
    }
    for i, b in enumerate(BUCKETS):
        x = torch.randn(b, linear.in_features, generator=gen)
        h = linear.packed_input(x)
        inputs = {"kernel": h, "dense": x, "exact": h}
        paths = ["kernel", "dense"]
        if linear.format == "blocks" and b in EXACT_BUCKETS:
            paths.append("exact")
        timing = []
        for path in paths:
            if i and times[path][-1] > MAX_TIMED_CALL_S:
                times[path].append(times[path][-1] * b / BUCKETS[i - 1])
            else:
                timing.append(path)
        turns: dict[str, list[float]] = {path: [] for path in timing}
        r = 0
        while r < rounds or (r < MAX_ROUNDS_FACTOR * rounds and not settled(turns)):
            for path in timing if r % 2 == 0 else reversed(timing):  # A B, B A, A B ...
                call = lambda path=path, x=inputs[path]: runs[path](x)  # noqa: E731
                turns[path].append(timer(call, path, b))
            r += 1
            yield
        for path in timing:
            times[path].append(min(turns[path]))
    exact = exact_rows(times["exact"], times["dense"]) if times["exact"] else None
    return Measured(choose(times["kernel"], times["dense"]), exact)


def settled(turns: dict[str, list[float]]) -> bool:
    """Whether the quickest path won twice: its second-best turn still beats every other
    path's best. A path unlucky in all but one turn (a neighbour's bursts) is not crowned
    on that one turn alone; more rounds are taken instead."""
    if len(turns) < 2:
        return True
    winner = min(turns, key=lambda p: min(turns[p]))
    again = sorted(turns[winner])[1] if len(turns[winner]) > 1 else float("inf")
    return all(again <= min(t) for p, t in turns.items() if p != winner)


def measure(linear: torch.nn.Module, timer: Timer = timed, rounds: int = ROUNDS) -> Measured:
    """`measuring` run to its end."""
    job = measuring(linear, timer, rounds)
    while True:
        try:
            next(job)
        except StopIteration as done:
            return done.value


def holds(
    linear: torch.nn.Module, plans: list[Plan], timer: Timer = timed, rounds: int = ROUNDS
) -> bool:
    """Whether a cached shape's plans still hold on this machine now: at CHECKED_BUCKETS the
    cached plan is timed in turns against each path whole, and loses when it is slower than
    the best of them by more than the noise (the spread of its own and their turns, at
    least MIN_MARGIN). A few dozen calls: cheap enough for every start."""
    gen = torch.Generator().manual_seed(0)
    pick = _cold_copies(linear)
    for b in CHECKED_BUCKETS:
        x = torch.randn(b, linear.in_features, generator=gen)
        h = linear.packed_input(x)
        cached = plans[BUCKETS.index(b)]
        rivals = [cached] + [p for p in (WHOLE, DENSE) if p != cached]
        turns: dict[Plan, list[float]] = {p: [] for p in rivals}
        for r in range(rounds):
            for plan in rivals if r % 2 == 0 else reversed(rivals):
                dense, chunk = plan
                rows = chunk or b
                part = (x if dense else h)[:rows]
                run = pick().dense_matmul if dense else pick().packed_matmul
                seconds = timer(lambda run=run, part=part: run(part), _path(plan), rows)
                turns[plan].append(seconds * b / rows)  # b/rows calls cover the bucket
        best = {p: min(t) for p, t in turns.items()}
        noise = max((max(t) / min(t) - 1 for t in turns.values() if min(t) > 0), default=0.0)
        rival_s = min(s for p, s in best.items() if p != cached) if len(best) > 1 else None
        if rival_s is not None and best[cached] > rival_s * (1 + max(noise, MIN_MARGIN)):
            return False
    return True


def _path(plan: Plan) -> str:
    return "dense" if plan[0] else "kernel"


def exact_rows(exact_s: list[float], dense_s: list[float]) -> int:
    """The largest bucket up to which the exact kernel is at least as quick as the GEMM at
    every bucket (0: the GEMM from one row up)."""
    rows = 0
    for b, e, d in zip(EXACT_BUCKETS, exact_s, dense_s, strict=False):
        if e > d:
            break
        rows = b
    return rows
