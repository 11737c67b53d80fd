"""llama.cpp as a reference measured in the same run: `llama-bench` on the same GGUF file
with the same thread count, its prompt-processing and generation rates turned into the
figures `helexa bench engine` reports (TTFT at N tokens = N / pp rate; batch-1 decode =
tg rate). Nothing measured elsewhere is ever printed as a reference here."""

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
    figures: dict[str, float] = field(default_factory=dict)  # ttft@N (s), decode@1 (tok/s)
    raw: list[dict[str, Any]] = field(default_factory=list)


def find(path: str | None) -> str | None:
    """`path` (it must exist), else llama-bench on PATH, else None."""
    if path:
        found = shutil.which(path) or (path if Path(path).is_file() else None)
        if found is None:
            raise FileNotFoundError(f"--llama-bench {path!r}: no such executable")
        return found
    return shutil.which("llama-bench")


def command(
    exe: str, gguf: str, threads: int, prompt_lengths: list[int], new_tokens: int, repeats: int
) -> list[str]:
    return [
        exe,
        "-m", gguf,
        "-t", str(threads),
        "-p", ",".join(str(n) for n in prompt_lengths),
        "-n", str(new_tokens),
        "-r", str(max(1, repeats)),
        "-o", "json",
    ]  # fmt: skip


def parse(text: str, new_tokens: int) -> LlamaBench:
    """llama-bench's `-o json` output: a list of tests, pp (n_gen 0) and tg (n_prompt 0)."""
    tests = json.loads(text)
    if not isinstance(tests, list) or not tests:
        raise ValueError("llama-bench printed no tests")
    first = tests[0]
    bench = LlamaBench(f"b{first.get('build_number', '?')} ({first.get('build_commit', '?')})")
    for t in tests:
        n_prompt, n_gen, rate = t.get("n_prompt", 0), t.get("n_gen", 0), t.get("avg_ts")
        if not isinstance(rate, int | float) or rate <= 0:
            continue
        if n_gen == 0 and n_prompt > 0:
            bench.figures[f"ttft@{n_prompt}"] = n_prompt / rate
        elif n_prompt == 0 and n_gen == new_tokens:
            bench.figures["decode@1"] = float(rate)
    bench.raw = tests
    return bench


def run(
    exe: str, gguf: str, threads: int, prompt_lengths: list[int], new_tokens: int, repeats: int
) -> LlamaBench:
    """Run llama-bench; its figures, or a ValueError saying why there are none."""
    cmd = command(exe, gguf, threads, prompt_lengths, new_tokens, repeats)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as e:
        raise ValueError(f"{exe}: {e}") from None
    if done.returncode != 0:
        raise ValueError(f"{exe} exited {done.returncode}: {done.stderr.strip()[-500:]}")
    try:
        return parse(done.stdout, new_tokens)
    except ValueError as e:
        raise ValueError(f"{exe}: unreadable output ({e}): {done.stdout[:300]!r}") from None
