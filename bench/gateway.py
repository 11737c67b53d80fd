"""`python bench/gateway.py`: what the gateway adds in front of a node, beside LiteLLM proxy.

One fake node (`bench/fake_node.py`, answers at once from a cache) and, in front of it, the
helexa gateway and LiteLLM proxy, one worker each, and two floors (`bench/floor_proxy.py`):
`floor` only relays bytes, on the gateway's event loop and parser, and `floor-asgi` relays
them as an ASGI app under uvicorn through the gateway's node client; so that what one more
hop costs here, what the server and ASGI layer cost, and what the gateway's own work costs
are read apart. All are started here and always stopped at the end. For chat completions,
streaming and not, each target gets (i) one client sending requests back to back, the
targets taking turns in blocks of 50, for latency percentiles, and (ii) wrk (or a Python
load generator without it) at 4, 16 and 64 connections, the best of which is the highest
request rate. "Added" latency is the target's percentile less the fake node's.

CPUs: the proxy under test gets one CPU to itself; the fake node, the load generator and
this script share the other (`taskset`), so both proxies compete on the same terms and the
load generator never takes CPU from the proxy it measures. The CPU time of everything else
on the machine during each measurement (other processes plus hypervisor steal, from
/proc/stat) is reported beside it.

`--metered`: the helexa target's requests carry an API key (`helexa keys create`, a cap of
10**12 tokens, in the gateway's own database), so that they pay for key lookup, budget
reservation and booking; direct and LiteLLM stay unauthenticated.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import itertools
import json
import math
import os
import re
import resource
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from helexa.bench.node import cpu_seconds  # noqa: E402  (after the path insert above)

MODEL = "fake-model"
ANSWER = "Hello from the fake node."  # what bench/fake_node.py says
TARGETS = ("direct", "floor", "floor-asgi", "helexa", "helexa-base", "litellm")
BASE = "helexa-base"  # `--against DIR`: the gateway of another checkout, beside this one
MODES = ("non-stream", "stream")
READY_TIMEOUT_S = 120.0
CONTENDED_CPUS = 0.25
BLOCK = 50  # timed single-client requests to one target before moving to the next
REWARM = 5  # untimed requests that lead each block
METERED_CAP_TOKENS = 10**12  # --metered: the key's budget, never reached in a run
# the aims (issue 40), printed beside each run's figures
AIM_ADDED_P50_MS = 0.5  # anonymous traffic, stream and not
AIM_ADDED_P50_METERED_MS = 1.0
AIM_FIRST_CONTENT_MS = 0.3  # added to the first content's p50 (streams)
AIM_RATE_RATIO = 40.0  # max req/s against LiteLLM's
AIM_P99_OVER_P50 = 3.0  # under 16 connections


def _int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 4,16,64, got {text!r}")
    return values


def body(stream: bool) -> bytes:
    req: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 16,
        "stream": stream,
    }
    if stream:
        req["stream_options"] = {"include_usage": True}
    return json.dumps(req).encode()


def auth_headers(args: argparse.Namespace, target: str) -> dict[str, str]:
    """`Authorization` for the helexa target once `--metered` gave it a key; else none."""
    secret = args.key_secret
    return {"Authorization": f"Bearer {secret}"} if target == "helexa" and secret else {}


# -- processes -----------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(
    cmd: list[str],
    log: Path,
    cpu: int | None,
    env: dict[str, str] | None = None,
    cwd: Path = ROOT,
) -> subprocess.Popen:
    """`cmd` in its own session (so that its children stop with it), pinned to `cpu`."""
    if cpu is not None:
        cmd = ["taskset", "-c", str(cpu), *cmd]
    with log.open("wb") as f:
        return subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True
        )


def imports_from(checkout: Path, env: dict[str, str]) -> None:
    """Exit unless `python -m` run in `checkout` with `env` imports helexa from there (a
    `python -m` puts its working directory first on sys.path, before PYTHONPATH)."""
    where = subprocess.run(
        [sys.executable, "-c", "import helexa; print(helexa.__file__)"],
        env=env, cwd=checkout, capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    if not Path(where).resolve().is_relative_to(checkout.resolve()):
        sys.exit(f"{BASE} would import helexa from {where}, not from {checkout}")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group, SIGKILL after 10 s, then to whatever is left of it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        print(f"  pid {proc.pid} ignored SIGTERM for 10 s; killed", flush=True)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def wait_ready(proc: subprocess.Popen, url: str, ready: Callable[[Any], bool], log: Path) -> None:
    """Poll `url` until its JSON satisfies `ready`; raise with the log if it never does."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}:\n{log.read_text()}")
        with contextlib.suppress(OSError, ValueError), urllib.request.urlopen(url, timeout=2) as r:
            if ready(json.load(r)):
                return
        time.sleep(0.2)
    raise TimeoutError(f"{url} not ready in {READY_TIMEOUT_S:.0f}s:\n{log.read_text()[-3000:]}")


def lists_model(models: Any) -> bool:
    return any(m.get("id") == MODEL for m in models.get("data", []))


def descendants(roots: list[int]) -> list[int]:
    """`roots` and every live process below them."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = [], list(roots)
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


@contextlib.contextmanager
def rest_of_machine(roots: list[int], out: dict[str, float]) -> Iterator[None]:
    """CPUs that everything but us (this process, `roots` and their children, and children
    reaped meanwhile such as wrk) took while the block ran, into `out["cpus"]`."""
    pids = descendants([os.getpid(), *roots])

    def reaped() -> float:
        r = resource.getrusage(resource.RUSAGE_CHILDREN)
        return r.ru_utime + r.ru_stime

    (m0, o0), r0, t0 = cpu_seconds(pids), reaped(), time.perf_counter()
    yield
    (m1, o1), r1, wall = cpu_seconds(pids), reaped(), time.perf_counter() - t0
    out["cpus"] = max(0.0, (m1 - m0) - (o1 - o0) - (r1 - r0)) / wall


# -- latency: one client, requests back to back --------------------------------------------
@dataclass(slots=True)
class Latency:
    total_s: list[float] = field(default_factory=list)  # send → whole answer ([DONE])
    first_s: list[float] = field(default_factory=list)  # send → first content (streams)
    errors: list[str] = field(default_factory=list)

    def ms(self, q: float, first: bool = False) -> float:
        """Nearest-rank percentile in ms."""
        xs = sorted(self.first_s if first else self.total_s)
        return 1000 * xs[max(0, math.ceil(q * len(xs)) - 1)] if xs else math.nan


class Client:
    """One keep-alive connection; an answer counts only if it says what the fake node said."""

    def __init__(self, base: str, stream: bool, headers: dict[str, str] | None = None) -> None:
        host, port = base.removeprefix("http://").split(":")
        self.host, self.port, self.stream, self.body = host, int(port), stream, body(stream)
        self.headers = {"Content-Type": "application/json", **(headers or {})}
        self.conn = http.client.HTTPConnection(self.host, self.port, timeout=60)

    def one(self, into: Latency | None) -> None:
        headers = self.headers
        t0 = time.perf_counter()
        try:
            self.conn.request("POST", "/v1/chat/completions", self.body, headers)
            resp = self.conn.getresponse()
            if resp.status != 200:
                raise ValueError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
            first, text = None, ""
            if self.stream:
                done = False
                while line := resp.readline():
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        done = True
                    else:
                        chunk = json.loads(payload)
                        if "error" in chunk:
                            raise ValueError(f"error event: {chunk['error']}")
                        for c in chunk.get("choices", []):
                            if piece := (c.get("delta") or {}).get("content"):
                                first = first or time.perf_counter()
                                text += piece
                if not done:
                    raise ValueError("the stream ended without data: [DONE]")
            else:
                data = json.loads(resp.read())
                text = data["choices"][0]["message"]["content"]
            total = time.perf_counter()
            if text != ANSWER:
                raise ValueError(f"answer {text!r}")
        except (OSError, ValueError, KeyError, IndexError, http.client.HTTPException) as e:
            if into is not None:
                into.errors.append(f"{type(e).__name__}: {e}"[:300])
            self.conn.close()  # next request on a fresh connection
            return
        if into is not None:
            into.total_s.append(total - t0)
            if first is not None:
                into.first_s.append(first - t0)


def measure_latency(
    bases: dict[str, str], stream: bool, args: argparse.Namespace, roots: list[int]
) -> tuple[dict[str, Latency], float]:
    """Every target in turn, in blocks of `BLOCK` back-to-back requests each led by
    `REWARM` untimed ones, so that a neighbour that comes and goes hits all alike.

    Blocks, not request by request: the two proxies share one CPU, and a LiteLLM request
    (~10 ms of work) just before each gateway request evicted the gateway's working set
    from the caches, which doubled the gateway's added p50 (~1 to ~2 ms)."""
    clients = {name: Client(base, stream, auth_headers(args, name)) for name, base in bases.items()}
    results = {name: Latency() for name in bases}
    for c in clients.values():
        for _ in range(args.warmup):
            c.one(None)
    busy: dict[str, float] = {}
    with rest_of_machine(roots, busy):
        for start in range(0, args.requests, BLOCK):
            for name, c in clients.items():
                for _ in range(REWARM):
                    c.one(None)
                for _ in range(min(BLOCK, args.requests - start)):
                    c.one(results[name])
    for c in clients.values():
        c.conn.close()
    return results, busy["cpus"]


# -- throughput: many connections ----------------------------------------------------------
@dataclass(slots=True)
class Throughput:
    concurrency: int
    req_s: float
    requests: int
    errors: dict[str, int]  # kind → count; non-200 and wrong bodies included
    latency_ms: tuple[float, float]  # p50, p99 under load
    others_cpus: float = 0.0

    @property
    def num_errors(self) -> int:
        return sum(self.errors.values())


WRK_SCRIPT = """
wrk.method = "POST"
wrk.body = %(body)s
wrk.headers["Content-Type"] = "application/json"
%(headers)slocal threads = {}
function setup(thread) table.insert(threads, thread) end
function init(args) bad = 0; non200 = 0 end
function response(status, headers, body)
  if status ~= 200 then non200 = non200 + 1
  elseif not string.find(body, %(marker)s, 1, true) or string.find(body, '"error"', 1, true)
  then bad = bad + 1 end
end
function done(summary, latency, requests)
  local b, n = 0, 0
  for _, t in ipairs(threads) do b = b + t:get("bad"); n = n + t:get("non200") end
  local e = summary.errors
  io.write(string.format('RESULT {"requests": %%d, "duration_us": %%d, "connect": %%d, ' ..
    '"read": %%d, "write": %%d, "timeout": %%d, "non200": %%d, "bad_body": %%d, ' ..
    '"p50_us": %%d, "p99_us": %%d}\\n', summary.requests, summary.duration, e.connect,
    e.read, e.write, e.timeout, n, b, latency:percentile(50), latency:percentile(99)))
end
"""


def _lua(s: str) -> str:
    return "[==[" + s + "]==]"


def run_wrk(
    url: str,
    stream: bool,
    seconds: float,
    concurrency: int,
    args: argparse.Namespace,
    tmp: Path,
    headers: dict[str, str],
) -> Throughput:
    """One wrk run; its Lua script counts non-200s and answers that lack the expected end."""
    marker = "data: [DONE]" if stream else ANSWER
    auth = "-auth" if headers else ""
    script = tmp / f"wrk-{'stream' if stream else 'plain'}{auth}.lua"
    extra = "".join(f"wrk.headers[ {_lua(k)} ] = {_lua(v)}\n" for k, v in headers.items())
    script.write_text(
        WRK_SCRIPT % {"body": _lua(body(stream).decode()), "marker": _lua(marker), "headers": extra}
    )
    cmd = ["wrk", "-t1", f"-c{concurrency}", f"-d{max(1, round(seconds))}s"]
    cmd += ["--timeout", "30s", "-s", str(script), url]
    if args.rest_cpu is not None:
        cmd = ["taskset", "-c", str(args.rest_cpu), *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    match = re.search(r"^RESULT (\{.*\})$", out.stdout, re.M)
    if not match:
        raise RuntimeError(f"wrk failed ({out.returncode}): {out.stdout}\n{out.stderr}")
    r = json.loads(match[1])
    kinds = ("connect", "read", "write", "timeout", "non200", "bad_body")
    return Throughput(
        concurrency=concurrency,
        req_s=r["requests"] / (r["duration_us"] / 1e6),
        requests=r["requests"],
        errors={k: r[k] for k in kinds if r[k]},
        latency_ms=(r["p50_us"] / 1000, r["p99_us"] / 1000),
    )


async def _python_load(
    url: str, stream: bool, seconds: float, concurrency: int, extra: dict[str, str]
) -> Throughput:
    """Without wrk: `concurrency` aiohttp connections sending back to back for `seconds`."""
    import aiohttp

    data, marker = body(stream), b"data: [DONE]" if stream else ANSWER.encode()
    errors: dict[str, int] = {}
    times: list[float] = []
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=30)
    headers = {"Content-Type": "application/json", **extra}
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        end = time.perf_counter() + seconds

        async def worker() -> None:
            while (t0 := time.perf_counter()) < end:
                try:
                    async with session.post(url, data=data, headers=headers) as resp:
                        text = await resp.read()
                    kind = None if resp.status == 200 else "non200"
                    if kind is None and (marker not in text or b'"error"' in text):
                        kind = "bad_body"
                except (TimeoutError, aiohttp.ClientError):
                    kind = "socket"
                if kind:
                    errors[kind] = errors.get(kind, 0) + 1
                else:
                    times.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    times.sort()
    n = len(times)
    pct = tuple(1000 * times[max(0, math.ceil(q * n) - 1)] if n else math.nan for q in (0.5, 0.99))
    return Throughput(concurrency, n / wall, n, errors, pct)  # type: ignore[arg-type]


def measure_throughput(
    url: str,
    stream: bool,
    concurrency: int,
    args: argparse.Namespace,
    tmp: Path,
    roots: list[int],
    headers: dict[str, str] | None = None,
) -> Throughput:
    headers = headers or {}

    def load(seconds: float) -> Throughput:
        if args.loadgen == "wrk":
            return run_wrk(url, stream, seconds, concurrency, args, tmp, headers)
        return asyncio.run(_python_load(url, stream, seconds, concurrency, headers))

    busy: dict[str, float] = {}
    try:
        load(max(1.0, args.duration / 5))  # warm-up: connections, caches, lazy imports
        with rest_of_machine(roots, busy):
            result = load(args.duration)
    except RuntimeError as e:  # wrk could not run at all (the target is gone): an error row
        print(f"  {e}".rstrip(), flush=True)
        return Throughput(concurrency, 0.0, 0, {"load run failed": 1}, (math.nan, math.nan))
    result.others_cpus = busy["cpus"]
    return result


# -- the targets ---------------------------------------------------------------------------
def helexa_config(
    path: Path, port: int, metrics_port: int, node_port: int, state: str = "state"
) -> None:
    path.write_text(
        "[gateway]\n"
        f'listen = "127.0.0.1:{port}"\n'
        f'metrics_listen = "127.0.0.1:{metrics_port}"\n'
        "[node]\n"
        f"state_dir = {json.dumps(str(path.parent / state))}\n"
        "[[nodes]]\n"
        'name = "fake"\n'
        f'endpoint = "http://127.0.0.1:{node_port}"\n'
    )


def litellm_config(path: Path, node_port: int) -> None:
    path.write_text(
        "model_list:\n"
        f"  - model_name: {MODEL}\n"
        "    litellm_params:\n"
        f"      model: openai/{MODEL}\n"
        f"      api_base: http://127.0.0.1:{node_port}/v1\n"
        "      api_key: fake\n"
        "litellm_settings:\n"
        "  telemetry: false\n"
    )


def create_key(config: Path, env: dict[str, str], log: Path) -> tuple[str, str]:
    """`helexa keys create` in the gateway's database (same config file and environment as
    the gateway) with a budget no run reaches; (key id, secret). Its output, less the
    secret, goes to `log`."""
    cmd = [sys.executable, "-m", "helexa.cli", "keys", "create", "--account", "bench"]
    cmd += ["--name", "bench/gateway.py", "--cap-tokens", str(METERED_CAP_TOKENS)]
    out = subprocess.run(
        [*cmd, "--config", str(config)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        check=False,
    )
    lines = out.stdout.strip().splitlines()
    key_id = next((ln.split()[1] for ln in lines if ln.startswith("key ")), None)
    if out.returncode != 0 or not key_id or len(lines) < 2:
        raise RuntimeError(
            f"helexa keys create failed ({out.returncode}):\n{out.stdout}{out.stderr}"
        )
    log.write_text("\n".join(lines[:-1]) + "\n" + out.stderr)  # never the secret
    return key_id, lines[-1].strip()


def ledger_rows(db: Path, key_id: str) -> str:
    """The helexa gateway's ledger after the run: its rows, and those booked to `key_id`."""
    try:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
            total, keyed, tokens = conn.execute(
                "SELECT COUNT(*), COUNT(*) FILTER (WHERE key_id = ?), "
                "COALESCE(SUM(prompt_tokens + completion_tokens) "
                "FILTER (WHERE key_id = ?), 0) FROM spend_ledger",
                (key_id, key_id),
            ).fetchone()
    except sqlite3.Error as e:
        return f"helexa ledger unreadable ({db}): {e}"
    return f"helexa ledger: {total} rows, {keyed} of them booked to {key_id} ({tokens} tokens)"


def find_litellm(given: str | None) -> str | None:
    if given:
        return given
    sibling = ROOT.parent / "litellm-venv" / "bin" / "litellm"
    return shutil.which("litellm") or (str(sibling) if sibling.exists() else None)


def start_targets(
    args: argparse.Namespace, tmp: Path, procs: dict[str, subprocess.Popen]
) -> dict[str, str]:
    """Start the fake node and the proxies asked for; {target: base URL}."""
    node_port = free_port()
    node_cmd = [sys.executable, str(ROOT / "bench" / "fake_node.py"), "--port", str(node_port)]
    procs["direct"] = start(node_cmd, tmp / "fake_node.log", args.rest_cpu)
    bases = {"direct": f"http://127.0.0.1:{node_port}"}
    helexa_env: dict[str, str] = {}
    wait_ready(procs["direct"], bases["direct"] + "/v1/models", lists_model, tmp / "fake_node.log")
    for floor in ("floor", "floor-asgi"):
        if floor not in args.only:
            continue
        port = free_port()
        cmd = [sys.executable, str(ROOT / "bench" / "floor_proxy.py"), "--port", str(port)]
        cmd += ["--node-port", str(node_port)] + (["--asgi"] if floor == "floor-asgi" else [])
        procs[floor] = start(cmd, tmp / f"{floor}.log", args.proxy_cpu)
        bases[floor] = f"http://127.0.0.1:{port}"
    if "helexa" in args.only:
        port, config = free_port(), tmp / "helexa.toml"
        helexa_config(config, port, free_port(), node_port)
        env = {k: v for k, v in os.environ.items() if not k.startswith("HELEXA_")}
        cmd = [sys.executable, "-m", "helexa.cli", "serve", "--role", "gateway"]
        procs["helexa"] = start(
            [*cmd, "--config", str(config)], tmp / "helexa.log", args.proxy_cpu, env
        )
        bases["helexa"] = f"http://127.0.0.1:{port}"
        helexa_env = env
    if BASE in args.only:  # the same, its code from the other checkout
        port, config = free_port(), tmp / f"{BASE}.toml"
        helexa_config(config, port, free_port(), node_port, state=f"{BASE}-state")
        env = {k: v for k, v in os.environ.items() if not k.startswith("HELEXA_")}
        env["PYTHONPATH"] = str(args.against)
        imports_from(args.against, env)
        cmd = [sys.executable, "-m", "helexa.cli", "serve", "--role", "gateway"]
        procs[BASE] = start(
            [*cmd, "--config", str(config)], tmp / f"{BASE}.log", args.proxy_cpu, env, args.against
        )
        bases[BASE] = f"http://127.0.0.1:{port}"
    if "litellm" in args.only:
        port, config = free_port(), tmp / "litellm.yaml"
        litellm_config(config, node_port)
        env = dict(os.environ)
        env.update(
            LITELLM_LOCAL_MODEL_COST_MAP="True",  # no fetch from GitHub at start
            LITELLM_LOG="ERROR",
            LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY="true",  # open, as helexa here
        )
        cmd = [args.litellm, "--config", str(config), "--host", "127.0.0.1", "--port", str(port)]
        procs["litellm"] = start(
            [*cmd, "--num_workers", "1"], tmp / "litellm.log", args.proxy_cpu, env
        )
        bases["litellm"] = f"http://127.0.0.1:{port}"
    for name in ("floor", "floor-asgi", "helexa", BASE, "litellm"):
        if name in procs:
            t0 = time.perf_counter()
            wait_ready(procs[name], bases[name] + "/v1/models", lists_model, tmp / f"{name}.log")
            print(f"{name} ready on {bases[name]} in {time.perf_counter() - t0:.1f}s", flush=True)
        if name == "helexa" and name in procs and args.metered:
            key_log = tmp / "helexa-key.log"
            args.key_id, args.key_secret = create_key(tmp / "helexa.toml", helexa_env, key_log)
            print(f"helexa requests metered with key {args.key_id}", flush=True)
    return {name: bases[name] for name in TARGETS if name in args.only}


def log_alarms(name: str, log: Path) -> list[str]:
    """Warning and error lines of a target's log."""
    alarms = (
        "WARNING",
        "ERROR",
        "CRITICAL",
        "Traceback",
        "Exception",
        '"level": "warn',
        '"level": "error',
    )
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return [f"{name}: {ln[:300]}" for ln in lines if any(a in ln for a in alarms)]


# -- report --------------------------------------------------------------------------------
@dataclass(slots=True)
class Row:
    target: str
    mode: str
    latency: Latency
    latency_cpus: float  # rest of machine during the latency runs of this mode
    loads: list[Throughput] = field(default_factory=list)  # one per concurrency

    @property
    def best(self) -> Throughput | None:
        return max(self.loads, key=lambda t: t.req_s, default=None)


def _ms(x: float) -> str:
    return "–" if math.isnan(x) else f"{x:.2f}"


def format_report(rows: list[Row], metered: str | None = None) -> str:
    by = {(r.target, r.mode): r for r in rows}
    out = [f"metered: {metered}", ""] if metered else []
    out += [
        "| target | mode | p50 ms | p99 ms | added p50 | added p99 | first content p50 ms "
        "| max req/s (connections) | errors | rest of machine (CPUs) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        base = by.get(("direct", r.mode))
        lat, tp = r.latency, r.best
        added = [
            lat.ms(q) - base.latency.ms(q) if base and r.target != "direct" else math.nan
            for q in (0.5, 0.99)
        ]
        first = lat.ms(0.5, first=True) if r.mode == "stream" else math.nan
        errors = len(lat.errors) + sum(t.num_errors for t in r.loads)
        load_cpus = max((t.others_cpus for t in r.loads), default=math.nan)
        cpus = f"{r.latency_cpus:.2f} / {load_cpus:.2f}"
        out.append(
            f"| {r.target} | {r.mode} | {_ms(lat.ms(0.5))} | {_ms(lat.ms(0.99))} | "
            f"{_ms(added[0])} | {_ms(added[1])} | {_ms(first)} | "
            f"{f'{tp.req_s:.0f} ({tp.concurrency})' if tp else '–'} | {errors} | {cpus} |"
        )
    notes = ["", "rest of machine: during the latency runs / the most during a load run"]
    added_aim = AIM_ADDED_P50_METERED_MS if metered else AIM_ADDED_P50_MS
    for mode in MODES:
        h, lt = by.get(("helexa", mode)), by.get(("litellm", mode))
        hb, lb = (h.best if h else None), (lt.best if lt else None)
        if hb and lb and lb.req_s > 0:
            ratio = hb.req_s / lb.req_s
            notes.append(
                f"helexa / LiteLLM max req/s, {mode}: {ratio:.1f}x (aim >= {AIM_RATE_RATIO:g}x)"
            )
        direct = by.get(("direct", mode))
        if h and direct:
            added = h.latency.ms(0.5) - direct.latency.ms(0.5)
            notes.append(f"helexa added p50, {mode}: {added:.2f} ms (aim <= {added_aim:g} ms)")
            if mode == "stream":
                first = h.latency.ms(0.5, first=True) - direct.latency.ms(0.5, first=True)
                notes.append(
                    f"helexa added first-content p50: {first:.2f} ms "
                    f"(aim <= {AIM_FIRST_CONTENT_MS:g} ms)"
                )
        if h and (base := by.get((BASE, mode))):
            over = h.latency.ms(0.5) - base.latency.ms(0.5)
            notes.append(f"helexa p50 over {BASE} (--against), {mode}: {over:+.2f} ms")
            if mode == "stream":
                first = h.latency.ms(0.5, first=True) - base.latency.ms(0.5, first=True)
                notes.append(f"helexa first-content p50 over {BASE}: {first:+.2f} ms")
        for floor, what in (("floor", "a bare relay"), ("floor-asgi", "uvicorn + ASGI")):
            if h and (row := by.get((floor, mode))):
                over = h.latency.ms(0.5) - row.latency.ms(0.5)
                notes.append(f"helexa p50 over {floor} ({what}), {mode}: {over:.2f} ms")
        at16 = next((t for t in (h.loads if h else []) if t.concurrency == 16), None)
        if at16 is not None and at16.latency_ms[0] > 0:
            spread = at16.latency_ms[1] / at16.latency_ms[0]
            notes.append(
                f"helexa p99 / p50 at 16 connections, {mode}: {spread:.1f}x "
                f"(aim <= {AIM_P99_OVER_P50:g}x)"
            )
    for r in rows:
        kinds = {f"{k} at {t.concurrency}": n for t in r.loads for k, n in t.errors.items()}
        if r.latency.errors:
            kinds["latency run"] = len(r.latency.errors)
        if kinds:
            notes.append(f"errors, {r.target} {r.mode}: {kinds}")
            notes += [f"  {e}" for e in sorted(set(r.latency.errors))[:5]]
    worst = max([r.latency_cpus for r in rows] + [t.others_cpus for r in rows for t in r.loads])
    if worst > CONTENDED_CPUS:
        notes.append(f"CONTENDED: the rest of the machine took up to {worst:.2f} CPUs")
    return "\n".join(out + notes)


# -- entry ---------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=300, help="timed single-client requests (300)")
    p.add_argument("--warmup", type=int, default=30, help="untimed requests first (30)")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of each load run (10)")
    p.add_argument(
        "--concurrency",
        type=_int_list,
        default=[4, 16, 64],
        help="load runs' connections (4,16,64)",
    )
    p.add_argument(
        "--only",
        default=",".join(t for t in TARGETS if t != BASE),
        help="targets (direct,floor,floor-asgi,helexa,litellm; helexa-base with --against)",
    )
    p.add_argument("--skip-litellm", action="store_true", help="leave LiteLLM out")
    p.add_argument("--litellm", help="litellm executable (PATH, else ../litellm-venv/bin)")
    p.add_argument("--loadgen", choices=("wrk", "python"), help="default: wrk when installed")
    p.add_argument("--no-pin", action="store_true", help="leave CPU placement to the kernel")
    p.add_argument("--logs", metavar="DIR", help="copy the targets' logs and configs here")
    p.add_argument(
        "--metered",
        action="store_true",
        help="helexa requests carry an API key with a 10**12-token budget",
    )
    p.add_argument(
        "--against",
        metavar="DIR",
        type=Path,
        help=f"also run the gateway of the helexa checkout in DIR ({BASE}), in the same "
        "blocks: before and after in one run",
    )
    args = p.parse_args(argv)
    args.only = [t.strip() for t in args.only.split(",") if t.strip()]
    if unknown := set(args.only) - set(TARGETS):
        p.error(f"unknown targets {sorted(unknown)}; known: {list(TARGETS)}")
    if args.against is not None:
        args.against = args.against.resolve()
        if not (args.against / "helexa" / "cli.py").is_file():
            p.error(f"--against {args.against}: no helexa checkout there (helexa/cli.py)")
        if args.metered:
            p.error("--against runs its gateway unmetered: leave out --metered")
        if BASE not in args.only:
            args.only.insert(args.only.index("helexa") + 1 if "helexa" in args.only else 0, BASE)
    elif BASE in args.only:
        p.error(f"{BASE} is the gateway of --against DIR: give the directory")
    if args.skip_litellm and "litellm" in args.only:
        args.only.remove("litellm")
    if args.requests < 1 or args.duration <= 0 or args.warmup < 0:
        p.error("--requests must be >= 1, --duration > 0 and --warmup >= 0")
    args.loadgen = args.loadgen or ("wrk" if shutil.which("wrk") else "python")
    if "litellm" in args.only:
        args.litellm = find_litellm(args.litellm)
        if not args.litellm:
            p.error(
                "litellm not found: python -m venv ../litellm-venv && "
                "../litellm-venv/bin/pip install 'litellm[proxy]' (or --litellm PATH, "
                "or --skip-litellm)"
            )
    cpus = sorted(os.sched_getaffinity(0))
    args.proxy_cpu = args.rest_cpu = None
    args.key_id = args.key_secret = None  # --metered: set once the gateway is up
    if not args.no_pin and len(cpus) >= 2 and shutil.which("taskset"):
        args.proxy_cpu, args.rest_cpu = cpus[0], cpus[1]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rest_cpu is not None:
        os.sched_setaffinity(0, {args.rest_cpu})
        where = (
            f"proxy on CPU {args.proxy_cpu}; "
            f"fake node, {args.loadgen} and client on CPU {args.rest_cpu}"
        )
    else:
        where = "no CPU pinning"
    print(
        f"targets {args.only}; {os.cpu_count()} CPUs, {where}; {args.requests} requests "
        f"(+{args.warmup} warm-up) a target for latency; {args.loadgen} at "
        f"{','.join(map(str, args.concurrency))} connections, {args.duration:g}s each, "
        "for throughput" + ("; helexa requests metered (API key)" if args.metered else ""),
        flush=True,
    )
    procs: dict[str, subprocess.Popen] = {}
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="helexa-bench-gateway-") as tmp_name:
        tmp = Path(tmp_name)
        try:
            bases = start_targets(args, tmp, procs)
            roots = [p.pid for p in procs.values()]
            for mode in MODES:
                stream = mode == "stream"
                latencies, cpus = measure_latency(bases, stream, args, roots)
                for name, lat in latencies.items():
                    rows.append(Row(name, mode, lat, cpus))
                    first = f", first content p50 {lat.ms(0.5, True):.2f}" if stream else ""
                    print(
                        f"  [{name} {mode}] single client: p50 {lat.ms(0.5):.2f} ms, p99 "
                        f"{lat.ms(0.99):.2f} ms{first}, {len(lat.errors)} errors; "
                        f"rest of machine {cpus:.2f} CPUs",
                        flush=True,
                    )
                for row, c in itertools.product(rows[-len(latencies) :], args.concurrency):
                    url = bases[row.target] + "/v1/chat/completions"
                    headers = auth_headers(args, row.target)
                    tp = measure_throughput(url, stream, c, args, tmp, roots, headers)
                    row.loads.append(tp)
                    print(
                        f"  [{row.target} {mode}] {c} connections: "
                        f"{tp.req_s:.0f} req/s, {tp.requests} requests, errors {tp.errors or 0}, "
                        f"p50 {tp.latency_ms[0]:.1f} ms / p99 {tp.latency_ms[1]:.1f} ms under "
                        f"load; rest of machine {tp.others_cpus:.2f} CPUs",
                        flush=True,
                    )
        finally:
            alarms = []
            for name, proc in reversed(procs.items()):  # the fake node last
                stop(proc)
                log = tmp / ("fake_node.log" if name == "direct" else f"{name}.log")
                alarms += log_alarms(name, log)
                if proc.returncode not in (0, -signal.SIGTERM):
                    alarms.append(f"{name}: exited with {proc.returncode}")
            if args.logs:
                shutil.copytree(tmp, args.logs, dirs_exist_ok=True)
            print(f"stopped; {len(alarms)} warning/error lines in the targets' logs")
            for line in alarms[-20:]:
                print(f"  {line}")
            if args.key_id:
                print(ledger_rows(tmp / "state" / "helexa.db", args.key_id))
    metered = None
    if args.metered:
        metered = (
            f"yes, helexa requests carry key {args.key_id or '(none made)'} (a cap of "
            f"{METERED_CAP_TOKENS} tokens); direct and litellm unauthenticated"
        )
    print()
    print(format_report(rows, metered))
    return 0


if __name__ == "__main__":
    sys.exit(main())
