"""llama.cpp as a reference measured in the same run: `llama-bench` on the same GGUF file
with the same thread count, its prompt-processing and generation rates turned into the
figures `helexa bench engine` reports (TTFT at N tokens = N / pp rate; batch-1 decode =
tg rate). On a GPU (threads None) every layer is offloaded with flash attention on
(`-ngl 99 -fa 1`), as llama.cpp's own CUDA figures are taken. The engine's decode runs start after a prompt, so llama-bench's generation is also
measured at that depth (`-d`): "decode@1" is tg at the same context, "decode@1/d0" tg from an
empty one (llama-bench's plain tg128). Nothing measured elsewhere is ever printed as a
reference here."""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TIMEOUT_S = 3600.0


@dataclass(slots=True)
class LlamaBench:
    """What one llama-bench run measured."""

    build: str  # "b7300 (6c4e5a3)"
    # ttft@N (s); decode@1 and decode@1/d0 (tok/s): tg at the engine's depth, and from empty
    figures: dict[str, float] = field(default_factory=dict)
    raw: list[dict[str, Any]] = field(default_factory=list)


def find(path: str | None) -> str | None:
    """`path` (it must exist), else llama-bench on PATH, else None."""
    if path:
        found = shutil.which(path) or (path if Path(path).is_file() else None)
        if found is None:
            raise FileNotFoundError(f"--llama-bench {path!r}: no such executable")
        return found
    return shutil.which("llama-bench")


GPU_FLAGS = ("-ngl", "99", "-fa", "1")  # every layer on the GPU, flash attention


def command(
    exe: str,
    gguf: str,
    threads: int | None,
    prompt_lengths: list[int],
    new_tokens: int,
    repeats: int,
    depth: int = 0,
) -> list[str]:
    """llama-bench's command line: `threads` CPU threads, or None for the GPU."""
    return [
        exe,
        "-m", gguf,
        *(GPU_FLAGS if threads is None else ("-t", str(threads))),
        "-p", ",".join(str(n) for n in prompt_lengths),
        "-n", str(new_tokens),
        *(("-d", f"0,{depth}") if depth else ()),
        "-r", str(max(1, repeats)),
        "-o", "json",
    ]  # fmt: skip


def parse(text: str, new_tokens: int, depth: int = 0) -> LlamaBench:
    """llama-bench's `-o json` output: a list of tests, pp (n_gen 0) and tg (n_prompt 0),
    each at a depth (n_depth: tokens already in the context; 0 where it is not given)."""
    tests = json.loads(text)
    if not isinstance(tests, list) or not tests:
        raise ValueError("llama-bench printed no tests")
    first = tests[0]
    bench = LlamaBench(f"b{first.get('build_number', '?')} ({first.get('build_commit', '?')})")
    for t in tests:
        n_prompt, n_gen, rate = t.get("n_prompt", 0), t.get("n_gen", 0), t.get("avg_ts")
        at = t.get("n_depth", 0)
        if not isinstance(rate, int | float) or rate <= 0:
            continue
        if n_gen == 0 and n_prompt > 0 and at == 0:
            bench.figures[f"ttft@{n_prompt}"] = n_prompt / rate
        elif n_prompt == 0 and n_gen == new_tokens and at in (0, depth):
            bench.figures["decode@1" if at == depth else "decode@1/d0"] = float(rate)
    bench.raw = tests
    return bench


def run(
    exe: str,
    gguf: str,
    threads: int | None,
    prompt_lengths: list[int],
    new_tokens: int,
    repeats: int,
    depth: int = 0,
) -> LlamaBench:
    """Run llama-bench (generation at `depth` too; on the GPU when `threads` is None); its
    figures, or a ValueError saying why there are none."""
    cmd = command(exe, gguf, threads, prompt_lengths, new_tokens, repeats, depth)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as e:
        raise ValueError(f"{exe}: {e}") from None
    if done.returncode != 0:
        raise ValueError(f"{exe} exited {done.returncode}: {done.stderr.strip()[-500:]}")
    try:
        return parse(done.stdout, new_tokens, depth)
    except ValueError as e:
        raise ValueError(f"{exe}: unreadable output ({e}): {done.stdout[:300]!r}") from None
