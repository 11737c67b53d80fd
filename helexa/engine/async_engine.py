"""The asyncio face of the engine for the web layer.

The engine loop runs on its own thread; the event loop only enqueues commands and
awaits per-request queues, so it never blocks on a forward pass.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from helexa.engine.llm_engine import LLMEngine
from helexa.engine.sampling_params import SamplingParams
from helexa.engine.sequence import RequestOutput, Sequence
from helexa.engine.vision.inputs import ImageInput

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no more requests can be served."""


class AsyncLLM:
    """Submit requests, iterate their deltas, abort them; one engine thread underneath."""

    def __init__(self, engine: LLMEngine) -> None:
        self._setup(engine)
        self._thread = threading.Thread(target=self._loop, name="helexa-engine", daemon=True)
        self._thread.start()

    def _setup(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._stopping = False

    @classmethod
    async def build(cls, make_engine: Callable[[], LLMEngine]) -> AsyncLLM:
        """Build the engine on the thread that will then run it.

        Measured on CPU (torch 2.13, 2 OpenMP threads): a model stepped on a thread other
        than the one that loaded it decodes at half the speed (27 vs 53 tok/s for SmolLM2).
        """
        loop = asyncio.get_running_loop()
        built: asyncio.Future[AsyncLLM] = loop.create_future()
        self = cls.__new__(cls)

        def settle(result: AsyncLLM | BaseException) -> None:
            if built.done():
                return
            if isinstance(result, BaseException):
                built.set_exception(result)
            else:
                built.set_result(result)

        def run() -> None:
            try:
                self._setup(make_engine())
            except BaseException as e:
                loop.call_soon_threadsafe(settle, e)
                return
            loop.call_soon_threadsafe(settle, self)
            self._loop()

        self._thread = threading.Thread(target=run, name="helexa-engine", daemon=True)
        self._thread.start()
        return await built

    # -- event-loop side -----------------------------------------------------------
    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        images: list[ImageInput] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Deltas of one request: new token ids and text, the last one `finished`.

        Closing the iterator early (client gone) aborts the request and frees its KV.
        Raises ContextLengthExceededError before any work when the prompt is too long.
        """
        if self._stopping or not self._thread.is_alive():
            raise EngineDeadError("engine is shut down")
        request_id = request_id or uuid.uuid4().hex
        if isinstance(prompt, str):  # tokenizing a long prompt is worth a worker thread
            seq = await asyncio.to_thread(
                self.engine.make_sequence, prompt, params, request_id, images=images
            )
        else:  # token ids: sizing is cheap, and a thread hop waits on the engine for the GIL
            seq = self.engine.make_sequence(prompt, params, request_id, images=images)
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue())
        self._send(("add", seq, stream))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id, None))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort everything and stop the engine thread."""
        self._stopping = True
        self._send(("stop", None, None))
        self._thread.join(timeout)

    def _send(self, cmd: tuple) -> None:
        self._cmds.put(cmd)
        self._wake.set()

    # -- engine thread -------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            while not self.engine.has_unfinished() and self.engine.idle(self._wake):
                pass  # idle: busy-machine plans measured again (layers/retune.py)
            self._wake.clear()
            if not self._drain():
                break
            if not self.engine.has_unfinished():
                continue
            try:
                updated = self.engine.step()
            except Exception as e:  # a failed step (the forward pass, a device fault)
                log.exception("engine step failed")  # fails its requests, not the engine
                self._fail_all(e)
                continue
            for seq in updated:
                self._publish(seq)
        self._fail_all(EngineDeadError("engine is shut down"))

    def _drain(self) -> bool:
        while True:
            try:
                op, arg, stream = self._cmds.get_nowait()
            except queue.Empty:
                return True
            if op == "add":
                seq: Sequence = arg
                self._streams[seq.request_id] = stream
                try:
                    self.engine.add_request(seq)
                except Exception as e:
                    self._streams.pop(seq.request_id).put(e)
            elif op == "abort":
                seq = self.engine.abort(arg)
                stream = self._streams.pop(arg, None)
                if seq is not None and stream is not None:
                    stream.put(seq.take_delta())
            elif op == "stop":
                return False

    def _publish(self, seq: Sequence) -> None:
        stream = self._streams.get(seq.request_id)
        if stream is None:
            return
        delta = self.engine.take_delta(seq)
        if isinstance(delta, Exception):  # the request's stream alone gets the error
            del self._streams[seq.request_id]
            stream.put(delta)
            return
        if delta.finished:
            del self._streams[seq.request_id]
        if delta.token_ids or delta.text or delta.finished:
            stream.put(delta)

    def _fail_all(self, error: BaseException) -> None:
        for request_id, stream in list(self._streams.items()):
            self.engine.abort(request_id)
            stream.put(error)
        self._streams.clear()
