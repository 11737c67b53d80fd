"""`helexa bench run`: the SPEC's scenarios (helexa/bench/scenarios.py) against any
OpenAI-compatible server, every sample filed in the database under the build the server
reports; `helexa bench report`.

The target's build is read from `/version` (helexa, vLLM), `/api/version` (Ollama) or
`/props` (llama.cpp's `build_info`): a (target, build, model, scenario) cell that already
holds `--samples` samples is skipped, so a steady fleet costs a few cheap requests until a
new build ships.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx

from helexa.bench import history
from helexa.bench.history import Build
from helexa.bench.scenarios import (
    SCENARIOS,
    Calibration,
    RequestFailed,
    ResendOnClosed,
    Scenario,
    Target,
    list_models,
    measure,
    pick_scenarios,
    read_build,
)

if TYPE_CHECKING:
    from sqlalchemy.orm import Session, sessionmaker

    from helexa.config import Config


# -- the run -------------------------------------------------------------------------------
def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--target", required=True, metavar="URL", help="OpenAI base URL: http://host:13131/v1")
    add("--target-name", metavar="NAME", help="what to file samples under (default: host:port)")
    add(
        "--scenario",
        action="append",
        metavar="NAME",
        help=f"run only these (repeatable, or comma-separated): {', '.join(SCENARIOS)}",
    )
    add(
        "--model",
        action="append",
        metavar="ID",
        help="models to bench (default: the first the target lists)",
    )
    add("--samples", type=int, metavar="N", help="samples per cell (default 3; --quick: 1)")
    add("--quick", action="store_true", help="short answers and one round: a smoke test")
    add(
        "--api-key",
        default=os.environ.get("HELEXA_BENCH_API_KEY"),
        help="Bearer key for the target (default: $HELEXA_BENCH_API_KEY)",
    )
    add("--sha", help="the build to file samples under when the target reports none")


@dataclass(slots=True)
class Plan:
    """One cell of this run: how many samples it holds, how many it still needs."""

    model: str
    scenario: Scenario
    taken: int
    needed: int


async def run(args: argparse.Namespace, sessions: sessionmaker[Session]) -> int:
    target = Target.parse(args.target, args.target_name)
    scenarios = pick_scenarios(args.scenario, args.quick)
    samples = args.samples if args.samples is not None else (1 if args.quick else 3)
    if samples < 1:
        raise ValueError("--samples must be at least 1")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    transport = ResendOnClosed(max(s.concurrency for s in scenarios) + 4)
    async with httpx.AsyncClient(headers=headers, transport=transport) as client:
        build, info, models = await _survey(client, target, args.model, args.sha)
        print(f"bench {target.name} ({target.v1}) at build {build.label}", flush=True)
        if build.sha == "unknown":
            print(
                "  the target reports no build: its samples are filed under 'unknown' "
                "(pass --sha to name it)",
                flush=True,
            )
        todo = []
        for model in models:
            for scenario in scenarios:
                taken = history.samples_taken(sessions, target.name, build, model, scenario.name)
                if taken >= samples:
                    print(
                        f"  skip {scenario.name} · {model}: {taken} of {samples} samples "
                        f"at {build.label} already",
                        flush=True,
                    )
                else:
                    todo.append(Plan(model, scenario, taken, samples - taken))
        if not todo:
            print("nothing to do: every cell has its samples", flush=True)
            return 0
        run_id = history.start_run(
            sessions,
            target=target.name,
            target_url=target.url,
            build=build,
            build_info=info,
            host=socket.gethostname(),
            quick=args.quick,
        )
        try:
            failed = await _sample(client, sessions, run_id, target, build, todo, samples)
        finally:
            history.finish_run(sessions, run_id)
        planned = sum(p.needed for p in todo)
        print(f"run #{run_id}: {planned} samples planned, {failed} cell(s) failed", flush=True)
        return 1 if failed else 0


async def _survey(
    client: httpx.AsyncClient, target: Target, models: list[str] | None, sha: str | None
) -> tuple[Build, dict[str, Any] | None, list[str]]:
    """The target's build (or `sha` where it reports none) and the models to bench."""
    try:
        build, info = await read_build(client, target)
        models = models or (await list_models(client, target))[:1]
    except httpx.HTTPError as e:
        raise ValueError(f"{target.url}: cannot reach the target: {e}") from None
    except RequestFailed as e:
        raise ValueError(f"{target.url}: {e}") from None
    if sha and build.sha == "unknown":
        build = Build(sha, False)
    elif sha and sha != build.sha:
        raise ValueError(f"--sha {sha}: the target reports build {build.label}")
    if not models:
        raise ValueError(f"{target.url}: the target lists no models; pass --model")
    return build, info, models


async def _sample(
    client: httpx.AsyncClient,
    sessions: sessionmaker[Session],
    run_id: int,
    target: Target,
    build: Build,
    todo: list[Plan],
    samples: int,
) -> int:
    """Take every planned sample, each committed as it is taken; the cells that failed."""
    from tqdm import tqdm

    failed = 0
    calibrations: dict[str, Calibration] = {}
    estimated: set[str] = set()  # models whose prompt sizes could not be measured
    total = sum(p.needed for p in todo)
    with tqdm(total=total, unit="sample", file=sys.stderr, disable=None) as bar:
        for plan in todo:
            bar.set_description(f"{plan.scenario.name} · {plan.model}"[-60:])
            cal = calibrations.setdefault(plan.model, Calibration(client, target, plan.model))
            rows: list[dict[str, Any]] = []
            try:
                for _ in range(plan.needed):
                    row = await measure(client, target, plan.model, plan.scenario, cal)
                    history.record_sample(
                        sessions,
                        run_id,
                        target=target.name,
                        sha=build.sha,
                        dirty=build.dirty,
                        model=plan.model,
                        scenario=plan.scenario.name,
                        **row,
                    )
                    rows.append(row)
                    bar.update(1)
            except (RequestFailed, httpx.HTTPError) as e:
                failed += 1
                bar.update(plan.needed - len(rows))
                bar.write(f"  FAILED {plan.scenario.name} · {plan.model}: {e}{_hint(e, plan)}")
                continue
            if not cal.measured and plan.model not in estimated:
                estimated.add(plan.model)
                bar.write(
                    f"  {plan.model}: the target reports no usage; prompt sizes are estimates"
                )
            bar.write(
                f"  {plan.scenario.name} · {plan.model}: {summary(rows)} "
                f"({plan.taken + len(rows)} of {samples} samples at {build.label})"
            )
    return failed


def _hint(error: Exception, plan: Plan) -> str:
    if plan.scenario.concurrency > 1 and "HTTP 429" in str(error):
        return (
            " (the target caps one client's concurrent requests: on a helexa node, "
            "[node] per_principal_max caps a gateway key; bench with a key that has no cap)"
        )
    return ""


def summary(rows: list[dict[str, Any]]) -> str:
    """The medians of this run's samples of one cell, in words."""
    parts = []
    for metric, (label, _) in history.METRICS.items():
        values = [r[metric] for r in rows if r.get(metric) is not None]
        if values:
            parts.append(f"{label} {history.format_value(metric, statistics.median(values))}")
    return ", ".join(parts) or "no figures"


def main_run(args: argparse.Namespace, cfg: Config) -> int:
    from helexa.db.session import open_database

    engine, sessions = open_database(cfg)
    try:
        return asyncio.run(run(args, sessions))
    finally:
        engine.dispose()


# -- the report ----------------------------------------------------------------------------
def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--target-name", metavar="NAME", help="only this target")
    add("--model", metavar="ID", help="only this model")
    add("--scenario", metavar="NAME", help="only this scenario")


def main_report(args: argparse.Namespace, cfg: Config) -> int:
    from helexa.db.session import open_database

    engine, sessions = open_database(cfg)
    try:
        series = history.history(
            sessions, target=args.target_name, model=args.model, scenario=args.scenario
        )
    finally:
        engine.dispose()
    print(history.report(series))
    return 0
