"""`helexa bench speculative`: decode with speculative decoding off and on, on one model:
prompt lookup ("ngram"), with `--mtp` the checkpoint's MTP head ("mtp") and with
`--draft-model` a draft model ("draft_model").

Two figures, each measured off and with each method back to back, in rounds (`--repeats`),
medians kept:
- batch 1 on a code edit: the model is given a function (60 lines) and asked to rewrite it
  with one change, as a coding agent's edit turn does; greedy, so the two answers must be
  the same text (checked, and printed when they are not);
- batch `--batch` of varied chat prompts, greedy: throughput must not fall with it on.
Each figure twice: the decode rate (tokens after each sequence's first, over the time from
the step that gave the last of those first tokens to the end: what speculation changes) and
end to end (all tokens over the whole time, the prompt's prefill included, which is the
same with it on or off). Each engine warms up once before timing. Prefix caching is off, so
every round prefills.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from helexa.config import Config
    from helexa.engine import LLMEngine

TOPICS = (
    "the water cycle", "how a compiler works", "the history of tea", "prime numbers",
    "photosynthesis", "TCP congestion control", "the French revolution", "black holes",
    "sorting algorithms", "the immune system", "plate tectonics", "how vaccines work",
    "the Roman empire", "neural networks", "the stock market", "volcanoes",
)  # fmt: skip


def code_edit_prompt(lines: int = 60) -> str:
    """A function of `lines` lines and the request to rewrite it with one change."""
    body = ["def summarize(records, threshold):", '    """Totals per group above a threshold."""']
    body += ["    totals = {}", "    counts = {}"]
    i = 0
    while len(body) < lines - 2:
        body += [
            f"    for record in records[{i}::7]:",
            f"        key = record.group_{i % 5}",
            "        value = record.amount * record.weight",
            "        if value > threshold:",
            "            totals[key] = totals.get(key, 0) + value",
            "            counts[key] = counts.get(key, 0) + 1",
        ]
        i += 1
    body = [
        *body[: lines - 2],
        "    averages = {k: totals[k] / counts[k] for k in totals}",
        "    return totals, averages",
    ]
    code = "\n".join(body)
    return (
        "Rewrite this Python function with one change: rename the variable `totals` to "
        f"`sums`. Reply with the whole function and nothing else.\n\n```python\n{code}\n```"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", help="local dir, .gguf file or hub id (default: bundled SmolLM2)"
    )
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--prompt-lookup-max", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=768, help="the code edit's answer")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--batch-tokens", type=int, default=64, help="each batched answer")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--mtp",
        action="store_true",
        help="also measure speculative_method 'mtp': the model's own multi-token-prediction "
        "head (a Qwen3.5/3.6 safetensors checkpoint that ships mtp.* weights)",
    )
    parser.add_argument(
        "--draft-model",
        metavar="PATH",
        help="also measure speculative_method 'draft_model' with this draft (local dir, "
        ".gguf file or hub id; it must share the model's tokenizer)",
    )


@dataclass(slots=True)
class Run:
    """One timed generation: its outputs, wall time, and the seconds from the moment every
    sequence had its first token (prefill done) to the last token: the decode phase, which
    speculation speeds up (the prefill before it is the same with it on or off)."""

    outs: list
    seconds: float
    decode_seconds: float

    @property
    def tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outs)

    @property
    def decode_rate(self) -> float:
        """Tokens a second after each sequence's first (which the prefill step gives)."""
        return (self.tokens - len(self.outs)) / self.decode_seconds if self.decode_seconds else 0.0


def _timed(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> Run:
    from helexa.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    t0 = time.perf_counter()
    seqs = [engine.add_request(p, params) for p in prompts]
    first = None
    while any(not s.is_finished for s in seqs):
        engine.step()
        if first is None and all(s.num_output_tokens or s.is_finished for s in seqs):
            first = time.perf_counter()
    end = time.perf_counter()
    return Run([s.to_output() for s in seqs], end - t0, end - (first or end))


def main(args: argparse.Namespace, cfg: Config) -> int:
    from helexa.engine import EngineArgs, LLMEngine
    from helexa.engine.chat_template import render_chat
    from helexa.engine.loader.load import bundled_model_path

    torch.set_num_threads(args.threads)
    model = args.model or bundled_model_path()
    if model is None:
        raise FileNotFoundError("no --model and the bundled SmolLM2 is not installed")
    common = dict(
        num_threads=args.threads,
        enable_prefix_caching=False,
        max_num_seqs=max(args.batch, 1),
        autotune_dir=str(cfg.node.state_dir / "autotune"),
    )
    off = LLMEngine(
        EngineArgs.from_config(cfg.engine, str(model), speculative_method=None, **common)
    )
    spec = dict(num_speculative_tokens=args.num_speculative_tokens, **common)
    engines = {
        "off": off,
        "ngram": LLMEngine(
            EngineArgs.from_config(
                cfg.engine,
                str(model),
                speculative_method="ngram",
                prompt_lookup_min=args.prompt_lookup_min,
                prompt_lookup_max=args.prompt_lookup_max,
                **spec,
            )
        ),
    }
    if args.mtp:
        engines["mtp"] = LLMEngine(
            EngineArgs.from_config(cfg.engine, str(model), speculative_method="mtp", **spec)
        )
    if args.draft_model:
        engines["draft"] = LLMEngine(
            EngineArgs.from_config(
                cfg.engine,
                str(model),
                speculative_method="draft_model",
                speculative_model=args.draft_model,
                **spec,
            )
        )
    tok = off.tokenizer

    def chat(text: str) -> list[int]:
        return tok.encode(render_chat(tok, [{"role": "user", "content": text}]))

    edit = [chat(code_edit_prompt())]
    batch = [
        chat(f"Explain {TOPICS[i % len(TOPICS)]} in a few sentences.") for i in range(args.batch)
    ]
    for engine in engines.values():  # warm-up: kernels built, plans read
        _timed(engine, [edit[0][:64]], 8)
    figures: dict[str, dict[str, list[float]]] = {
        name: {side: [] for side in engines} for name in ("edit", "edit_e2e", "batch", "batch_e2e")
    }
    texts: dict[str, str] = {}
    for _ in range(args.repeats):
        for side, engine in engines.items():
            run = _timed(engine, edit, args.max_tokens)
            figures["edit"][side].append(run.decode_rate)
            figures["edit_e2e"][side].append(run.tokens / run.seconds)
            texts[side] = run.outs[0].text
            run = _timed(engine, batch, args.batch_tokens)
            figures["batch"][side].append(run.decode_rate)
            figures["batch_e2e"][side].append(run.tokens / run.seconds)
    draft = f", draft model {args.draft_model}" if args.draft_model else ""
    print(f"model {model}{draft}, {args.threads} threads, k={args.num_speculative_tokens}, "
          f"n-gram {args.prompt_lookup_min}..{args.prompt_lookup_max}, {args.repeats} rounds (medians)")  # fmt: skip
    sides = [side for side in engines if side != "off"]
    head = "".join(f" {side + ' tok/s':>12} {'ratio':>7}" for side in sides)
    print(f"{'figure':<34} {'off tok/s':>10}{head}")
    for name, label in (
        ("edit", "batch 1, code edit: decode"),
        ("edit_e2e", "batch 1, code edit: with prefill"),
        ("batch", f"batch {args.batch}, chat: decode"),
        ("batch_e2e", f"batch {args.batch}, chat: with prefill"),
    ):
        a = statistics.median(figures[name]["off"])
        cols = ""
        for side in sides:
            b = statistics.median(figures[name][side])
            cols += f" {b:>12.1f} {b / a:>6.2f}x"
        print(f"{label:<34} {a:>10.1f}{cols}")
    same = True
    for side in sides:
        sched = engines[side].scheduler
        drafted, accepted = sched.num_draft_tokens, sched.num_accepted_tokens
        rate = accepted / drafted if drafted else 0.0
        per_step = 1 + accepted / sched.num_drafts if sched.num_drafts else 1.0
        print(f"{side}: acceptance {rate:.2f} of drafted tokens; "
              f"{per_step:.2f} tokens a speculating row-step")  # fmt: skip
        if texts[side] != texts["off"]:
            same = False
            print(f"{side}: code edit answer DIFFERS from off's")
            print("--- off ---\n" + texts["off"] + f"\n--- {side} ---\n" + texts[side])
    print(f"code edit answers identical: {'yes' if same else 'NO'}")
    return 0 if same else 1
