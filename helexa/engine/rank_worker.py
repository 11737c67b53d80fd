"""Tensor parallel: one process per rank. Rank 0 is the engine's own process; it spawns the
others (followers) and drives them over one control socket each (after nano-vllm).

Control messages, pickled (`multiprocessing.connection`; both ends are this code):

    rank 0 → follower   Start, then PoolSize, then a StepPlan per step; None: exit
    follower → rank 0   ("joining"|"loaded"|"ready"|"error", payload)

A follower waits for its next step with no timeout (idle for hours is fine) and exits on
None or on EOF (rank 0 gone); PR_SET_PDEATHSIG kills it if rank 0 dies in a way that leaves
it in a collective. The device collectives carry `[engine] step_timeout_s`. A follower whose
step raises reports it and exits 1; rank 0 learns of a lost rank from its socket (a watcher
thread) and its step raises RankLostError.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from helexa.engine.parallel import PlacementError

if TYPE_CHECKING:
    from helexa.engine.engine_args import EngineArgs
    from helexa.engine.model_runner import StepPlan

log = logging.getLogger(__name__)
STARTUP_POLL_S = 0.1
LOST_GRACE_S = 3.0  # after a failed collective, how long rank 0 waits to learn which rank went
EXIT_GRACE_S = 5.0  # followers asked to exit that are still running then are killed


class RankLostError(RuntimeError):
    """A tensor-parallel rank died or its step failed: the whole group is unusable (a device
    fault: the model is reloaded)."""

    def __init__(self, rank: int | None, exit_code: int | None, detail: str) -> None:
        who = f"tensor-parallel rank {rank}" if rank is not None else "a tensor-parallel rank"
        code = f" (exit code {exit_code})" if exit_code is not None else ""
        super().__init__(f"{who} lost{code}: {detail}")
        self.rank = rank
        self.exit_code = exit_code


@dataclass(slots=True)
class Start:
    """What a follower needs to join the group and load its shard."""

    args: EngineArgs
    rank: int
    world_size: int
    init_method: str
    device: str


@dataclass(slots=True)
class PoolSize:
    """Rank 0's sizing of the KV pool and state rows, which every rank's runner takes."""

    num_blocks: int
    num_state_slots: int
    max_num_seqs: int


def placement(args: EngineArgs) -> list[torch.device]:
    """Each rank's device, or PlacementError before anything loads: more ranks than CUDA
    devices, a `devices` list of the wrong length or naming a missing device. (A GGUF
    tensor that cannot be split on its blocks is refused by the load, before any read.)"""
    n = args.tensor_parallel
    device = args.torch_device()
    if n < 1:
        raise PlacementError(f"tensor_parallel={n}: must be >= 1", "tensor_parallel = 1")
    if args.devices is not None and len(args.devices) != n:
        raise PlacementError(
            f"devices {args.devices} name {len(args.devices)} devices for tensor_parallel={n}",
            "give one device per rank, or leave devices unset",
        )
    if n == 1 and args.devices is None:
        return [device]
    if device.type != "cuda":
        return [device] * n  # N processes on the CPU
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    indices = list(args.devices) if args.devices is not None else list(range(n))
    if n > count:
        raise PlacementError(
            f"tensor_parallel={n} needs {n} CUDA devices; this host has {count}",
            f"load with tensor_parallel <= {count}",
        )
    missing = [d for d in indices if not 0 <= d < count]
    if missing:
        raise PlacementError(
            f"devices {indices}: no CUDA device {missing} (this host has {count})",
            f"name devices in 0..{count - 1}",
        )
    if len(set(indices)) != n:
        raise PlacementError(
            f"devices {indices}: each rank needs its own device", "name distinct devices"
        )
    return [torch.device("cuda", d) for d in indices]


def cpu_threads(args: EngineArgs) -> int:
    """Torch threads of each rank on the CPU: [engine] num_threads, else an equal share of
    the cores so that N ranks do not oversubscribe them."""
    return args.num_threads or max(1, (os.cpu_count() or 1) // args.tensor_parallel)


# -- rank 0's side ----------------------------------------------------------------------------
_spawner: ThreadPoolExecutor | None = None


def _spawn(cmd: list[str], **kw: Any) -> subprocess.Popen:
    """Popen from a thread that lives as long as the process: PR_SET_PDEATHSIG fires when
    the thread that forked the child ends, and an engine may be built on a short-lived one."""
    global _spawner
    if _spawner is None:
        _spawner = ThreadPoolExecutor(1, thread_name_prefix="helexa-rank-spawner")
    return _spawner.submit(subprocess.Popen, cmd, **kw).result()


@dataclass(slots=True)
class _Follower:
    rank: int
    proc: subprocess.Popen
    conn: Connection
    memory_mb: int = 0


class Followers:
    """Rank 0's handle on ranks 1..N-1: spawn, start-up handshake, per-step plans, loss
    detection, shutdown."""

    def __init__(self, args: EngineArgs, devices: list[torch.device]) -> None:
        self.world_size = len(devices)
        _sweep_rendezvous()
        self._dir = tempfile.mkdtemp(prefix=f"helexa-tp-{os.getpid()}-")
        self.init_method = f"file://{self._dir}/rendezvous"
        self.followers: list[_Follower] = []
        self.error: RankLostError | None = None  # set once the group is unusable
        self._lost = threading.Event()
        self._closing = False
        self._watcher: threading.Thread | None = None
        self._abort_on_loss = devices[0].type == "cuda"
        root = str(Path(__file__).resolve().parents[2])  # the helexa this process runs
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
        }
        code = "from helexa.engine.rank_worker import main; main()"
        try:
            self._spawn_all(args, devices, env, code)
        except BaseException:
            self.close(kill=True)
            raise

    def _spawn_all(
        self, args: EngineArgs, devices: list[torch.device], env: dict, code: str
    ) -> None:
        for rank in range(1, self.world_size):
            ours, theirs = socket.socketpair()
            try:
                proc = _spawn(
                    [sys.executable, "-c", code, str(theirs.fileno()), str(os.getpid())],
                    pass_fds=(theirs.fileno(),),
                    stdin=subprocess.DEVNULL,
                    env=env,
                )
            finally:
                theirs.close()
            follower = _Follower(rank, proc, Connection(ours.detach()))
            self.followers.append(follower)
            follower.conn.send(
                Start(args, rank, self.world_size, self.init_method, str(devices[rank]))
            )

    @property
    def pids(self) -> list[int]:
        return [f.proc.pid for f in self.followers]

    # -- start-up: each step waits for every follower, or raises what stopped one ----------
    def wait_joining(self) -> None:
        """Every follower has imported torch and is about to join the group."""
        self._expect("joining")

    def wait_loaded(self) -> list[int]:
        """Every follower's shard is loaded: their available memory in bytes."""
        return [p["available"] for p in self._expect("loaded")]

    def start_runners(self, size: PoolSize) -> None:
        """Send rank 0's pool size; wait until every follower's runner is built."""
        for f in self.followers:
            f.conn.send(size)
        for f, payload in zip(self.followers, self._expect("ready"), strict=True):
            f.memory_mb = payload["memory_mb"]
        self._watcher = threading.Thread(target=self._watch, name="helexa-rank-watch", daemon=True)
        self._watcher.start()

    def _expect(self, kind: str) -> list[dict]:
        out = []
        for f in self.followers:
            while not f.conn.poll(STARTUP_POLL_S):
                if f.proc.poll() is not None:
                    raise RankLostError(f.rank, f.proc.returncode, f"exited before {kind!r}")
            try:
                got, payload = f.conn.recv()
            except (EOFError, OSError):
                raise RankLostError(f.rank, f.proc.wait(), f"exited before {kind!r}") from None
            if got == "error":
                raise _startup_error(f.rank, payload)
            assert got == kind, (got, kind)
            out.append(payload)
        return out

    # -- steps ------------------------------------------------------------------------------
    def send(self, plan: StepPlan) -> None:
        """Hand the step's plan to every follower (they then run it as rank 0 does)."""
        if self.error is not None:
            raise self.error
        data = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
        for f in self.followers:
            f.conn.send_bytes(data)

    def check(self) -> None:
        """Raise RankLostError if the group was lost (a rank died, a step failed)."""
        if self.error is not None:
            raise self.error

    def wait_lost(self, timeout: float | None = None) -> RankLostError | None:
        """Block until the group is lost (or `timeout` passes): its error, else None. Lets
        an idle engine's owner notice a dead rank before the next step runs into it."""
        self._lost.wait(timeout)
        return self.error

    def failed(self, cause: BaseException) -> RankLostError:
        """Rank 0's step raised midway: the group is out of step and unusable. The error to
        raise: the lost follower's, when one goes within LOST_GRACE_S, else rank 0's."""
        if self.error is None:
            self._lost.wait(LOST_GRACE_S)
        if self.error is None:
            self._lose(RankLostError(0, None, f"its step failed: {type(cause).__name__}: {cause}"))
        assert self.error is not None
        return self.error

    def _lose(self, error: RankLostError) -> None:
        if self.error is None:
            self.error = error
            log.error("%s", error)
        self._lost.set()

    def _watch(self) -> None:
        """Wait on every follower's socket: a message now is an error report, EOF is exit."""
        pending = {f.conn: f for f in self.followers}
        while pending:
            for conn in wait(list(pending)):
                f = pending.pop(conn)
                try:
                    _, payload = conn.recv()
                    detail = payload["traceback"].rstrip().rsplit("\n", 1)[-1]
                except (EOFError, OSError):
                    detail = "the process ended"
                except Exception as e:  # a report that does not unpickle here
                    detail = f"its error report was unreadable: {e!r}"
                if self._closing:
                    continue
                try:
                    code = f.proc.wait(EXIT_GRACE_S)
                except subprocess.TimeoutExpired:
                    code = None
                self._lose(RankLostError(f.rank, code, detail))
                if self._abort_on_loss:  # NCCL waits out its timeout on a dead peer
                    _abort_group()

    # -- shutdown ---------------------------------------------------------------------------
    def close(self, *, kill: bool = False) -> None:
        """Ask every follower to exit, kill those still running after EXIT_GRACE_S (at once
        with `kill` or when the group was lost: they may sit in a collective), release the
        sockets."""
        if self._closing:
            return
        self._closing = True
        lost = kill or self.error is not None
        if self.error is None:
            self.error = RankLostError(None, None, "the engine was shut down")
        for f in self.followers:
            if lost:
                f.proc.kill()
            else:
                with contextlib.suppress(OSError):
                    f.conn.send(None)
        deadline = time.monotonic() + EXIT_GRACE_S
        for f in self.followers:
            try:
                f.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("tensor-parallel rank %d did not exit: killed", f.rank)
                f.proc.kill()
                f.proc.wait()
        if self._watcher is not None:
            self._watcher.join(EXIT_GRACE_S)
        for f in self.followers:
            f.conn.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def _sweep_rendezvous() -> None:
    """Remove the rendezvous dirs of rank-0 processes that are gone (killed, not closed)."""
    for path in Path(tempfile.gettempdir()).glob("helexa-tp-*-*"):
        pid = path.name.split("-")[2]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass  # alive, another user's


def _startup_error(rank: int, payload: dict) -> BaseException:
    """A follower's start-up error as rank 0 raises it: the same exception (a PlacementError
    stays one) with the follower's traceback as a note, else RankLostError."""
    error = payload.get("error")
    if isinstance(error, Exception):
        error.add_note(f"on tensor-parallel rank {rank}:\n{payload['traceback']}")
        return error
    return RankLostError(rank, None, payload["traceback"])


def _abort_group() -> None:
    """Abort the NCCL communicators so that rank 0's pending collective returns."""
    with contextlib.suppress(Exception):
        from torch.distributed.distributed_c10d import _abort_process_group

        _abort_process_group()


# -- a follower -------------------------------------------------------------------------------
def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when rank 0 goes (Linux), and exit if it already has."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)


def _report(conn: Connection, error: BaseException) -> None:
    text = "".join(traceback.format_exception(error))
    try:
        pickle.loads(pickle.dumps(error))  # rank 0 must be able to rebuild it
        conn.send(("error", {"error": error, "traceback": text}))
    except Exception:
        with contextlib.suppress(Exception):
            conn.send(("error", {"error": None, "traceback": text}))


def main(argv: list[str] | None = None) -> None:
    """A follower rank: `python -c "...; main()" <socket fd> <rank 0's pid>`."""
    argv = sys.argv[1:] if argv is None else argv
    _die_with_parent(int(argv[1]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when the group stops
    conn = Connection(int(argv[0]))
    try:
        start = conn.recv()
    except EOFError:
        os._exit(0)
    logging.basicConfig(
        level=logging.WARNING, format=f"%(asctime)s rank {start.rank} %(name)s: %(message)s"
    )
    try:
        runner = _start(conn, start)
    except BaseException as e:
        _report(conn, e)
        os._exit(1)
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            break
        plan = pickle.loads(data)
        if plan is None:
            break
        try:
            runner.run_plan(plan)
        except BaseException as e:
            log.exception("tensor-parallel rank %d: step failed", start.rank)
            _report(conn, e)
            os._exit(1)
    from helexa.engine.parallel import destroy_tensor_parallel

    with contextlib.suppress(Exception):
        destroy_tensor_parallel()
    os._exit(0)


def _start(conn: Connection, start: Start):
    """Join the group, load this rank's shard, build the runner at rank 0's pool size."""
    from helexa import kernels
    from helexa.engine.engine_args import available_memory_bytes, kv_dtype
    from helexa.engine.layers import native
    from helexa.engine.loader.load import default_dtype
    from helexa.engine.model_runner import ModelRunner, model_memory_mb
    from helexa.engine.parallel import init_tensor_parallel

    args = start.args
    device = torch.device(start.device)
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads(args))
    else:
        torch.cuda.set_device(device)
    torch.manual_seed(args.seed)
    kernels.set_backend(args.kernels)
    native.set_mode(args.cpu_kernels)
    conn.send(("joining", {"pid": os.getpid()}))
    init_tensor_parallel(
        start.rank, start.world_size, start.init_method, device, args.step_timeout_s
    )
    loaded = args.load(args.model, device)
    conn.send(("loaded", {"available": available_memory_bytes(device)}))
    size: PoolSize = conn.recv()
    dtype = args.torch_dtype(device) or default_dtype(device)
    runner = ModelRunner(
        loaded.model,
        device=device,
        dtype=dtype,
        kv_dtype=kv_dtype(args.kv_cache_dtype, device, dtype),
        num_blocks=size.num_blocks,
        block_size=args.block_size,
        num_state_slots=size.num_state_slots,
    )
    runner.graphs_off_reason = "tensor parallel"
    conn.send(("ready", {"pid": os.getpid(), "memory_mb": model_memory_mb(runner.model)}))
    return runner
