"""How each CPU-packed Linear runs a call of a given number of rows, chosen by measuring
this machine at load instead of by thresholds fixed on another CPU.

torch's packed int4/int8 kernels are not equally good at every row count: on one CPU a
16-row call costs as much as a 32-row one, on another the 12-row case falls off a cliff. So
per weight shape, two paths are timed once per row bucket (1, 2, 4 … 128): the packed kernel
(bf16 activations) and a float32 GEMM, on the dense copy where `[engine] cpu_dense_copy`
keeps one, else on the weight dequantized within the call (no memory held: on wide prompt
chunks the dequantization is a few percent of the GEMM, and a GEMM can beat the packed
kernel by 2x there). Each bucket takes the cheapest way to cover its rows: either path on
all of them, or on chunks of a smaller bucket's size (b/c calls of c rows). Any smaller bucket's way is among the candidates, scaled, so more rows
never lower a call's throughput.

Prompt steps run in float32 whatever their size (linear.PREFILL_STEP). On GGUF blocks a
call of few rows takes the exact float32 block kernel (no weight unpacked), a wide one the
GEMM on the weight unpacked for the call: the two are timed at the buckets up to 128 rows,
and `exact_rows` is the largest bucket up to which the kernel stays the quicker (a prompt
tail after a prefix-cache hit is typically 1-100 rows: through the GEMM, 11 rows took the
whole weight's unpacking, ~120 ms a step for SmolLM2 on a 2-core EPYC).

The plans are kept in `<cache_dir>/<machine>.json` (the node: `state_dir/autotune`), keyed
by the CPU, its flags, torch's version, the thread count and the native kernels' source, so
a restart costs nothing and a changed kernel is timed again.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import logging
import os
import platform
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # 512: the default prompt chunk
# past this many seconds a call, a path's time at twice the rows is taken as twice its time
# (the lm_head at 512 rows would cost seconds of load to time, and says nothing new)
MAX_TIMED_CALL_S = 0.05
# A plan: (through the dense copy?, rows per call; 0: all of them at once)
Plan = tuple[bool, int]
WHOLE: Plan = (False, 0)
DENSE: Plan = (True, 0)
MIN_TIMED_S = 0.003  # each timing repeats the call until this much time has passed
CACHE_VERSION = 7  # 4: blocks timed cold; 5: exact_rows; 6: x8 unpack 4x quicker; 7: [K, N]
EXACT_BUCKETS = BUCKETS[: BUCKETS.index(128) + 1]  # prompt-step row counts timed both ways


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


# the native kernels' source: a change to it can change which path is quicker
NATIVE_SOURCE = Path(__file__).with_name("native") / "blocks.c"


def machine_key(num_threads: int) -> str:
    """The CPU (model and flags), torch's version, the thread count and the native kernels'
    source, hashed: plans measured under one never serve another."""
    cpu, flags = cpu_info()
    try:
        native = hashlib.sha256(NATIVE_SOURCE.read_bytes()).hexdigest()[:16]
    except OSError:
        native = "none"
    text = f"{cpu}|{flags}|{torch.__version__}|{num_threads}|v{CACHE_VERSION}|{native}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def shape_key(linear: torch.nn.Module) -> str:
    """What a plan depends on: the storage format and the kernel's shape."""
    k = linear.in_features * linear.k_repeat
    dense = "+dense" if linear.dense is not None else ""
    fmt = linear.format if linear.block_kind is None else f"{linear.format}-{linear.block_kind}"
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


def _timed(call: Callable[[], object]) -> float:
    """Seconds one `call` takes: the better of two runs of enough repeats."""
    call()  # warm
    best = float("inf")
    for _ in range(2):
        n, t0 = 0, time.perf_counter()
        while True:
            call()
            n += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= MIN_TIMED_S:
                break
        best = min(best, elapsed / n)
    return best


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


def measure(linear: torch.nn.Module) -> tuple[list[Plan], int | None]:
    """Time `linear`'s packed kernel and its float32 GEMM (on the dense copy, or on the
    weight dequantized within each call) at every bucket, and on GGUF blocks the exact
    float32 kernel up to 128 rows; the plans, and `exact_rows` (None: not blocks)."""
    gen = torch.Generator().manual_seed(0)
    kernel_s: list[float] = []
    dense_s: list[float] = []
    exact_s: list[float] = []
    pick = _cold_copies(linear)
    kernel = lambda rows: pick().packed_matmul(rows)  # noqa: E731
    dense = lambda rows: pick().dense_matmul(rows)  # noqa: E731
    exact = lambda rows: pick().exact_matmul(rows)  # noqa: E731
    for i, b in enumerate(BUCKETS):
        x = torch.randn(b, linear.in_features, generator=gen)
        h = linear.packed_input(x)
        paths = [(kernel_s, kernel, h), (dense_s, dense, x)]
        if linear.format == "blocks" and b in EXACT_BUCKETS:
            paths.append((exact_s, exact, h))
        for times, run, rows in paths:
            if i and times[-1] > MAX_TIMED_CALL_S:
                times.append(times[-1] * b / BUCKETS[i - 1])
            else:
                times.append(_timed(lambda run=run, rows=rows: run(rows)))
    return choose(kernel_s, dense_s), (exact_rows(exact_s, dense_s) if exact_s else None)


def exact_rows(exact_s: list[float], dense_s: list[float]) -> int:
    """The largest bucket up to which the exact kernel is at least as quick as the GEMM at
    every bucket (0: the GEMM from one row up)."""
    rows = 0
    for b, e, d in zip(EXACT_BUCKETS, exact_s, dense_s, strict=False):
        if e > d:
            break
        rows = b
    return rows


# Plans measured by this process where there is no cache directory, per machine key.
_MEASURED: dict[str, tuple[dict[str, list[Plan]], dict[str, int]]] = {}


class Autotuner:
    """Plans for every packed Linear of a model, from the cache file or measured now."""

    def __init__(self, cache_dir: str | os.PathLike | None, num_threads: int) -> None:
        self.machine = machine_key(num_threads)
        self.path = None
        if cache_dir is not None:
            self.path = Path(cache_dir) / f"{self.machine}.json"
        self.plans: dict[str, list[Plan]] = {}
        self.exact_rows: dict[str, int] = {}  # GGUF-block shapes only
        self._read()
        self.measured: list[str] = []  # shapes timed by this process, not read from cache

    def _read(self) -> None:
        if self.path is None:  # no cache directory: this process's own measurements
            self.plans, self.exact_rows = _MEASURED.setdefault(self.machine, ({}, {}))
            return
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return  # absent or damaged: measured again, then written anew
        if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
            return
        exact = data.get("exact_rows") or {}
        for key, value in (data.get("plans") or {}).items():
            try:
                read = [(bool(dense), int(chunk)) for dense, chunk in value]
                rows = exact.get(key)
                rows = None if rows is None else int(rows)
            except (TypeError, ValueError, AttributeError):
                continue  # a damaged entry is measured again
            if rows is not None and rows not in (0, *EXACT_BUCKETS):
                continue
            if len(read) == len(BUCKETS) and all(c in (0, *BUCKETS) for _, c in read):
                self.plans[key] = read
                if rows is not None:
                    self.exact_rows[key] = rows

    def _write(self) -> None:
        if self.path is None:  # self.plans is this process's table (_read): kept already
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".tmp{os.getpid()}")
            body = {
                "version": CACHE_VERSION,
                "buckets": list(BUCKETS),
                "plans": self.plans,
                "exact_rows": self.exact_rows,
            }
            tmp.write_text(json.dumps(body, indent=1, sort_keys=True))
            tmp.replace(self.path)
        except OSError as e:  # a read-only state_dir costs a re-measure next time, no more
            log.warning("autotune: cannot keep plans in %s: %s", self.path, e)

    def tune(self, linears: Iterable[torch.nn.Module]) -> None:
        """Give each packed Linear its plans (measuring each new shape once)."""
        for linear in linears:
            if linear.format not in ("int4", "int8", "blocks"):
                continue
            key = shape_key(linear)
            blocks = linear.format == "blocks"
            if key not in self.plans or (blocks and key not in self.exact_rows):
                t0 = time.perf_counter()
                self.plans[key], rows = measure(linear)
                if rows is not None:
                    self.exact_rows[key] = rows
                self.measured.append(key)
                log.debug(
                    "autotune %s: %s, exact up to %s rows, in %.2fs",
                    key, self.plans[key], rows, time.perf_counter() - t0,
                )  # fmt: skip
            linear.plans = plan_for_rows(self.plans[key])
            if blocks:
                linear.exact_rows = self.exact_rows[key]
        if self.measured:
            self._write()
