"""The node's side of a model's worker process (helexa/engine/worker.py): start it, send
requests, route its deltas to the requests' iterators, and notice when it faults.

A worker faults when it reports a device fault, when its process ends without being asked
(SIGKILL, a segfault, the OOM killer), or when it has work and says nothing for
`step_timeout_s` (a hung step or collective). Then every in-flight request fails with
`WorkerFaultError`, the worker's whole process group (every tensor-parallel rank) is
killed, and `on_fault` tells the owner, which reloads the model in a fresh worker.

A request stopped with `abort` keeps its iterator until the worker's last word on it (see
`abort`), so that what it cost is known to the token.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import signal
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from helexa.config import LogConfig
from helexa.engine.async_engine import EngineDeadError
from helexa.engine.llm_engine import EngineArgs, EngineStats
from helexa.engine.sampling_params import SamplingParams
from helexa.engine.sequence import RequestOutput
from helexa.engine.tokenizer import Tokenizer
from helexa.engine.vision.inputs import ImageInput
from helexa.engine.worker import (
    HEADER,
    Abort,
    Add,
    Delta,
    Event,
    Failed,
    Fault,
    LoadFailed,
    ModelFacts,
    Ready,
    Step,
    Stop,
    Tuned,
    WorkerSpec,
)

log = logging.getLogger(__name__)
SOCKET_BUFFER = 4 << 20  # a step's deltas rarely need more than a few KiB
# An aborted request waits for the worker's last word on it: normally the next step,
# milliseconds away, but a step on a loaded CPU can take seconds, and what the engine
# generated meanwhile is spent (a fixed 2 s wait lost such tokens from the books). A worker
# that says nothing at all is the watchdog's (step_timeout_s: every request, the aborted
# ones included, then fails). Only a worker that goes on stepping and never reports on one
# aborted request (a fault of ours) leaves it to end with what is known, after this many
# step timeouts.
ABORT_REPORT_STEP_TIMEOUTS = 2
_NO_REPORT = object()  # an aborted request's stream: no report came in time


@dataclass(slots=True)
class AbortedOutput(RequestOutput):
    """The last delta of an aborted request: finished, `finish_reason` "abort", carrying
    the tokens the engine generated that no delta had carried, and how much of the prompt
    the engine had computed (prefix-cache hits included) when it stopped: all of it once
    a token was generated, less when it was cut during a chunked prefill, 0 when it never
    ran."""

    num_computed_prompt_tokens: int = 0


class WorkerFaultError(RuntimeError):
    """The model's worker faulted (device fault, died, stopped answering): the request
    ended with it, and the model is being reloaded."""


class WorkerLoadError(Exception):
    """The worker could not load the model: `kind` names why (see worker.load_failure)."""

    def __init__(self, kind: str, message: str, suggestion: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.suggestion = suggestion


class RequestFailedError(RuntimeError):
    """One request failed alone in the worker; the others went on."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class WorkerClient:
    """One model's engine in worker processes, as the node's event loop sees it: the same
    `generate` / `abort` / `shutdown` as an in-process `AsyncLLM`."""

    def __init__(
        self,
        model_id: str,
        proc: asyncio.subprocess.Process,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        step_timeout_s: float,
    ) -> None:
        self.model_id = model_id
        self.proc = proc
        self.state = "loading"  # loading | running | faulted | stopped
        self.fault: str | None = None  # why it faulted
        self.on_fault: Callable[[str], None] | None = None
        self.facts: ModelFacts
        self.tokenizer: Tokenizer
        self.stats = EngineStats(0, 0, 0.0, 0, 0, 0, 0)
        self.step_timeout_s = step_timeout_s
        self._reader = reader
        self._writer = writer
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Event)
        self._streams: dict[str, asyncio.Queue[Any]] = {}
        # aborted requests awaiting the worker's report, with the timer that gives up on it
        self._aborting: dict[str, asyncio.TimerHandle] = {}
        self._last_heard = time.monotonic()
        self._tasks: list[asyncio.Task] = []

    # -- start -----------------------------------------------------------------------
    @classmethod
    async def start(
        cls,
        model_id: str,
        args: EngineArgs,
        *,
        log_cfg: LogConfig | None = None,
        debug_poison: bool = False,
        on_fault: Callable[[str], None] | None = None,
    ) -> WorkerClient:
        """Start a worker and wait until it serves the model; WorkerLoadError when it cannot
        load it (its process is gone by then)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        for s in (ours, theirs):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
        spec = WorkerSpec(model_id, args, log_cfg or LogConfig(), debug_poison)
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "helexa.engine.worker",
                str(theirs.fileno()),
                msgspec.json.encode(spec).decode(),
                pass_fds=(theirs.fileno(),),
                start_new_session=True,  # its own process group: killed as one, ranks and all
                stdin=asyncio.subprocess.DEVNULL,
            )
        finally:
            theirs.close()
        reader, writer = await asyncio.open_unix_connection(sock=ours, limit=SOCKET_BUFFER)
        self = cls(model_id, proc, reader, writer, args.step_timeout_s)
        try:
            first = await self._recv()
        except BaseException:
            self.kill()
            await proc.wait()
            raise
        if first is None:
            code = await proc.wait()
            raise WorkerLoadError(
                "load_failed", f"the worker loading {model_id!r} exited ({_exit_text(code)})"
            )
        if isinstance(first, LoadFailed):
            await self._reap()
            raise WorkerLoadError(first.kind, first.message, first.suggestion)
        assert isinstance(first, Ready), first
        self.facts = first.facts
        self.tokenizer = pickle.loads(first.tokenizer)
        self.state = "running"
        self.on_fault = on_fault
        self._last_heard = time.monotonic()
        self._tasks = [
            asyncio.create_task(self._read_loop(), name=f"worker-reader-{model_id}"),
            asyncio.create_task(self._watchdog(), name=f"worker-watchdog-{model_id}"),
        ]
        log.info("worker for %s ready: pids %s", model_id, self.facts.pids)
        return self

    # -- requests --------------------------------------------------------------------
    async def generate(
        self,
        prompt: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        images: list[ImageInput] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Deltas of one request, the last one `finished`. Closing the iterator early (client
        gone) aborts the request in the worker, and drops what was on its way; `abort` ends
        it with what the engine spent instead. Raises WorkerFaultError when the worker
        faults meanwhile, EngineDeadError when the model is unloaded meanwhile,
        RequestFailedError / ValueError when this request alone fails."""
        if self.state != "running":
            raise self._dead_error()
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise ValueError(f"duplicate request id {request_id!r}")
        stream: asyncio.Queue[Any] = asyncio.Queue()
        if not self._streams:  # the watchdog's clock starts with the first request
            self._last_heard = time.monotonic()
        self._streams[request_id] = stream
        prompt_ids = list(prompt)
        self._send(Add(request_id, prompt_ids, params, images))
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item is _NO_REPORT:
                    finished = True
                    return
                out = _output(item, prompt_ids)
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            timer = self._aborting.pop(request_id, None)
            if timer is not None:
                timer.cancel()
            elif not finished and self.state == "running":
                self._send(Abort(request_id))

    def abort(self, request_id: str) -> None:
        """Stop a request, and learn what the engine spent on it: its iterator goes on with
        the deltas already on their way and ends with the worker's report, an
        `AbortedOutput` (in the worker's next step, however long it takes); a worker that
        falls silent meanwhile is faulted by the watchdog, and one that steps on without a
        report ends it after `abort_report_s`, without one. Its tokens then count every
        token the engine generated for it. No-op for a request that has ended or is being
        aborted; a request whose last delta crossed the abort ends with that delta."""
        if request_id not in self._streams or request_id in self._aborting:
            return
        if self.state != "running":
            return
        self._send(Abort(request_id))
        self._aborting[request_id] = asyncio.get_running_loop().call_later(
            self.abort_report_s, self._no_report, request_id
        )

    @property
    def abort_report_s(self) -> float:
        """How long an aborted request waits for a stepping worker's report on it."""
        return ABORT_REPORT_STEP_TIMEOUTS * self.step_timeout_s

    def _no_report(self, request_id: str) -> None:
        self._aborting.pop(request_id, None)
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            log.warning(
                "worker for %s: no report on aborted request %s within %gs",
                self.model_id,
                request_id,
                self.abort_report_s,
            )
            stream.put_nowait(_NO_REPORT)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # -- stop ------------------------------------------------------------------------
    async def shutdown(self, timeout: float = 10.0) -> None:
        """Abort every request and stop the worker (killed after `timeout`); a faulted
        worker, killed already, is only reaped."""
        if self.state == "running":
            self.state = "stopped"
            self._fail_all(EngineDeadError("engine is shut down"))
            with contextlib.suppress(OSError, RuntimeError):
                self._send(Stop())
                await self._writer.drain()
            try:
                await asyncio.wait_for(self.proc.wait(), timeout)
            except TimeoutError:
                log.warning("worker for %s ignored stop for %.0fs; killed", self.model_id, timeout)
        await self._reap()

    def kill(self) -> None:
        """SIGKILL the worker's process group: rank 0 and every other rank it started."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    async def _reap(self) -> None:
        self.kill()
        await self.proc.wait()
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()
        self._writer.close()

    def describe_workers(self) -> list[dict[str, Any]]:
        """Each rank's worker: pid, device and state, for /health and /models."""
        facts = self.facts
        return [
            {"rank": rank, "pid": pid, "device": device, "state": self.state}
            for rank, (pid, device) in enumerate(zip(facts.pids, facts.devices, strict=True))
        ]

    # -- the worker's frames -----------------------------------------------------------
    def _send(self, cmd: Add | Abort | Stop) -> None:
        body = self._encoder.encode(cmd)
        self._writer.write(HEADER.pack(len(body)) + body)

    async def _recv(self) -> Event | None:
        try:
            head = await self._reader.readexactly(HEADER.size)
            body = await self._reader.readexactly(HEADER.unpack(head)[0])
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        return self._decoder.decode(body)

    async def _read_loop(self) -> None:
        while True:
            event = await self._recv()
            self._last_heard = time.monotonic()
            if event is None:
                if self.state == "running":
                    code = await self.proc.wait()
                    self._faulted(f"the worker process exited ({_exit_text(code)})")
                return
            if isinstance(event, Step):
                self._dispatch(event)
            elif isinstance(event, Fault):
                self._faulted(event.message)
                return
            elif isinstance(event, Tuned):
                self.facts.autotune = event.report

    def _dispatch(self, step: Step) -> None:
        streams = self._streams
        for delta in step.deltas:
            stream = streams.get(delta.request_id)
            if stream is not None:
                stream.put_nowait(delta)
        for failed in step.failed:
            stream = streams.pop(failed.request_id, None)
            if stream is not None:
                stream.put_nowait(_request_error(failed))
        self.stats = step.stats

    async def _watchdog(self) -> None:
        tick = min(1.0, self.step_timeout_s / 4)
        while self.state == "running":
            await asyncio.sleep(tick)
            silent = time.monotonic() - self._last_heard
            if self._streams and silent > self.step_timeout_s:
                self._faulted(
                    f"the worker said nothing for {silent:.0f}s with {len(self._streams)} "
                    f"requests in flight (step_timeout_s = {self.step_timeout_s:g})"
                )
                return

    def _faulted(self, message: str) -> None:
        if self.state != "running":
            return
        self.state = "faulted"
        self.fault = message
        log.error("worker for %s faulted: %s", self.model_id, message)
        self.kill()
        self._fail_all(WorkerFaultError(message))
        if self.on_fault is not None:
            self.on_fault(message)

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.put_nowait(error)
        self._streams.clear()
        for timer in self._aborting.values():
            timer.cancel()
        self._aborting.clear()

    def _dead_error(self) -> BaseException:
        if self.state == "faulted":
            return WorkerFaultError(self.fault or "the worker faulted")
        return EngineDeadError("engine is shut down")


def _output(delta: Delta, prompt_ids: list[int]) -> RequestOutput:
    fields = (
        delta.request_id,
        prompt_ids,
        delta.token_ids,
        delta.text,
        delta.finished,
        delta.finish_reason,
        delta.stop_reason,
        delta.logprobs,
        delta.num_cached_tokens,
        delta.num_cache_written_tokens,
    )
    if delta.num_computed_prompt_tokens is not None:  # an aborted request's report
        return AbortedOutput(*fields, delta.num_computed_prompt_tokens)
    return RequestOutput(*fields)


def _request_error(failed: Failed) -> BaseException:
    if failed.kind == "invalid":
        return ValueError(failed.message)
    return RequestFailedError(failed.kind, failed.message)


def _exit_text(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"signal {-code}"
    return f"exit code {code}"
