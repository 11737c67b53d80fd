"""A loaded model's engine in a process of its own: the node sends requests, it sends deltas.

Why a process: a device fault (an illegal memory access, an ECC error, a hung collective)
leaves the CUDA context unusable for the whole process that holds it. With the engine here,
the node kills this process and starts a fresh one; it never has to exit itself.

The node (`helexa.engine.worker_client.WorkerClient`) starts `python -m helexa.engine.worker
<fd> <spec json>` in a session of its own, `fd` being its end of a Unix socket pair. Both ways,
a frame is a 4-byte big-endian length and a msgpack body (msgspec):

- node → worker: `Add` (a request: prompt ids and sampling parameters), `Abort`, `Stop`;
- worker → node: `Ready` (the model's facts and its tokenizer) or `LoadFailed` once, then a
  `Step` per engine step (every sequence's delta, the requests that failed alone, the engine's
  stats), a `Tuned` when the CPU plans were measured again while idle, or one `Fault` (a
  device fault: the worker exits right after; the node reloads).

An `Abort` of a request still running is answered in the next `Step` by that request's last
delta: finished, `finish_reason` "abort", with what the engine generated that no delta had
carried yet and the prompt tokens it had computed (`num_computed_prompt_tokens`). With the
deltas already on their way, the node so counts every token the engine spent on a request its
client left, a prompt cut during its prefill included.

The engine runs on this process's main thread, the thread that loaded it (on CPU a model
stepped from another thread decodes at half the speed); a reader thread turns frames into
commands, as `AsyncLLM`'s event loop does in process.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import pickle
import queue
import signal
import socket
import struct
import sys
import threading
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor

import msgspec
import torch

from helexa.config import LogConfig
from helexa.engine.grammar import OutputGrammar
from helexa.engine.layers.tuner import TuneReport
from helexa.engine.llm_engine import EngineArgs, EngineStats, LLMEngine
from helexa.engine.model_runner import model_memory_mb
from helexa.engine.rank_worker import RankLostError
from helexa.engine.sampling_params import SamplingParams
from helexa.engine.sequence import Sequence, TokenLogprob
from helexa.engine.vision.inputs import ImageInput, VisionProfile

log = logging.getLogger("helexa.worker")
HEADER = struct.Struct("!I")
MiB = 1 << 20


# -- node → worker -------------------------------------------------------------------------
class Add(msgspec.Struct, tag="add", array_like=True):
    request_id: str
    prompt: list[int]
    params: SamplingParams
    images: list[ImageInput] | None = None  # decoded and resized by the node, in order


class Abort(msgspec.Struct, tag="abort", array_like=True):
    request_id: str


class Stop(msgspec.Struct, tag="stop", array_like=True):
    pass


Command = Add | Abort | Stop


# -- worker → node -------------------------------------------------------------------------
class ModelFacts(msgspec.Struct):
    """What the node tells about a loaded model without holding it."""

    max_model_len: int
    vocab_size: int  # the embedding table's rows (0: unknown)
    device: str  # rank 0's
    devices: list[str]  # every rank's, rank order
    dtype: str
    source_format: str
    path: str
    memory_mb: int  # weights and KV pools, every rank
    pids: list[int]  # every rank's worker process, rank order
    graphs_off_reason: str | None = None
    max_num_seqs: int = 0  # sequences the engine runs at once (0: unknown)
    autotune: TuneReport | None = None  # the CPU plans at load; `Tuned` tells of a change
    checkpoint_quant: str | None = None  # a pre-quantized checkpoint's: fp8 | awq | gptq
    linear_weights: str = ""  # how the Linears hold their weights: "int4×14 float×1"
    vision: VisionProfile | None = None  # how the model takes images; None: text only
    speculative_method: str | None = None  # [engine] speculative_method; None: off
    speculative_model: str | None = None  # the draft model's reference ("draft_model")
    tokenizer: str = "checkpoint"  # where the tokenizer came from (LoadedModel.tokenizer_source)


class Ready(msgspec.Struct, tag="ready", array_like=True):
    facts: ModelFacts
    tokenizer: bytes  # pickled `Tokenizer`: the node renders and tokenizes prompts itself


class LoadFailed(msgspec.Struct, tag="load_failed", array_like=True):
    kind: str  # model_not_found | unsupported_architecture | unsupported_quant | ...
    message: str
    suggestion: str | None = None


class Delta(msgspec.Struct, array_like=True):
    request_id: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    stop_reason: str | int | None
    logprobs: list[TokenLogprob] | None
    num_cached_tokens: int
    # only in the last delta of an aborted request: the prompt tokens whose KV the engine
    # had (computed, or reused from the prefix cache); None in every other delta
    num_computed_prompt_tokens: int | None = None
    num_cache_written_tokens: int = 0  # of the prompt, stored in the prefix cache


class Failed(msgspec.Struct, array_like=True):
    """One request failed alone (its sampling, its row of logits, its arguments)."""

    request_id: str
    kind: str  # invalid | nonfinite_row | error | step
    message: str


class Step(msgspec.Struct, tag="step", array_like=True):
    deltas: list[Delta]
    failed: list[Failed]
    stats: EngineStats


class Fault(msgspec.Struct, tag="fault", array_like=True):
    message: str


class Tuned(msgspec.Struct, tag="tuned", array_like=True):
    """The CPU plans changed while the engine idled (measured again on a quiet machine)."""

    report: TuneReport


Event = Ready | LoadFailed | Step | Fault | Tuned


class WorkerSpec(msgspec.Struct):
    """How to start a worker (argv, JSON)."""

    model_id: str
    args: EngineArgs
    log: LogConfig = msgspec.field(default_factory=LogConfig)
    debug_poison: bool = False  # HELEXA_DEBUG_POISON: one injected device fault


# -- what counts as a device fault ---------------------------------------------------------
# Messages of torch/CUDA/NCCL errors that leave the device (or the collective group) unusable.
_DEVICE_FAULT_MARKERS = (
    "CUDA error",
    "illegal memory access",
    "illegal address",
    "uncorrectable ECC",
    "device-side assert",
    "unspecified launch failure",
    "misaligned address",
    "CUBLAS_STATUS_EXECUTION_FAILED",
    "NCCL",
    "Connection closed by peer",  # gloo: a rank went away mid-collective
)


def is_device_fault(error: BaseException) -> bool:
    """Whether `error` leaves this process's device or rank group unusable (reload the
    model), rather than failing only the requests of one step."""
    from helexa.engine.model_runner import NonFiniteLogitsError

    faults: tuple[type[BaseException], ...] = (NonFiniteLogitsError, RankLostError)
    if hasattr(torch, "AcceleratorError"):  # torch's CUDA error type (2.8+)
        faults += (torch.AcceleratorError,)
    if torch.distributed.is_available():
        faults += (torch.distributed.DistError,)
    if isinstance(error, faults):
        return True
    return isinstance(error, RuntimeError) and any(m in str(error) for m in _DEVICE_FAULT_MARKERS)


def inject_device_fault(device: torch.device) -> None:
    """HELEXA_DEBUG_POISON: a real illegal-address fault on CUDA; on CPU, where no kernel can
    fault the device, the NaN logits a broken device gives."""
    from helexa.engine.model_runner import NonFiniteLogitsError

    if device.type == "cuda":
        from helexa.kernels.fault import triton_illegal_address

        triton_illegal_address(device)
        torch.cuda.synchronize(device)  # raises the sticky fault here
    raise NonFiniteLogitsError("fault injected by HELEXA_DEBUG_POISON")


# -- facts ---------------------------------------------------------------------------------
def model_facts(engine: LLMEngine) -> ModelFacts:
    device = engine.runner.device
    memory = model_memory_mb(engine.runner.model)
    if engine.runner.drafter is not None:  # the draft model's weights and KV cache
        memory += model_memory_mb(engine.runner.drafter.model)
    memory += sum(engine.follower_memory_mb)
    return ModelFacts(
        max_model_len=engine.max_model_len,
        vocab_size=engine.loaded.config.vocab_size or 0,
        device=str(device),
        devices=engine.devices,
        dtype=str(engine.dtype).removeprefix("torch."),
        source_format=engine.loaded.source_format,
        path=str(engine.loaded.path),
        memory_mb=memory,
        pids=engine.rank_pids,
        graphs_off_reason=engine.runner.graphs_off_reason if device.type == "cuda" else None,
        max_num_seqs=engine.scheduler.config.max_num_seqs,
        autotune=engine.autotune_report(),
        checkpoint_quant=engine.loaded.checkpoint_quant,
        linear_weights=linear_weights(engine.runner.model),
        vision=engine.loaded.vision,
        speculative_method=engine.args.speculative_method,
        speculative_model=engine.args.speculative_model,
        tokenizer=engine.loaded.tokenizer_source,
    )


def linear_weights(model: torch.nn.Module) -> str:
    """How many Linears hold their weight each way: format (float, int8, int4; "blocks" by
    GGUF kind) on the CPU, QuantWeight kind on an accelerator: "int4_zp×14 float×1"."""
    from helexa.engine.layers.linear import Linear

    def held(m: Linear) -> str:
        if m.qweight is not None:
            return m.qweight.kind
        return m.block_kind or m.format

    counts = Counter(held(m) for m in model.modules() if isinstance(m, Linear))
    return " ".join(f"{k}×{n}" for k, n in sorted(counts.items()))


def load_failure(error: BaseException) -> LoadFailed:
    """A failed load as the kind the node's 422/503 names."""
    from helexa.engine.layers.linear import UnsupportedQuantError
    from helexa.engine.loader.load import ModelNotFoundError
    from helexa.engine.models import UnsupportedModelError
    from helexa.engine.parallel import PlacementError

    if isinstance(error, (ModelNotFoundError, FileNotFoundError)):
        return LoadFailed("model_not_found", str(error))
    if isinstance(error, UnsupportedModelError):
        return LoadFailed("unsupported_architecture", str(error))
    if isinstance(error, UnsupportedQuantError):
        return LoadFailed("unsupported_quant", str(error), error.suggestion)
    if isinstance(error, PlacementError):
        return LoadFailed("invalid_placement", str(error), error.suggestion)
    if isinstance(error, (MemoryError, torch.OutOfMemoryError)):
        return LoadFailed("insufficient_vram", str(error))
    return LoadFailed("load_failed", f"{type(error).__name__}: {error}")


# -- the process ---------------------------------------------------------------------------
class _Channel:
    """Frames over the socket: the reader thread decodes, the engine thread encodes."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Command)
        self._send_lock = threading.Lock()

    def send(self, event: Ready | LoadFailed | Step | Fault | Tuned) -> None:
        body = self._encoder.encode(event)
        with self._send_lock:
            self.sock.sendall(HEADER.pack(len(body)) + body)

    def recv(self) -> Command | None:
        head = self._read(HEADER.size)
        if head is None:
            return None
        body = self._read(HEADER.unpack(head)[0])
        return None if body is None else self._decoder.decode(body)

    def _read(self, n: int) -> bytes | None:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                return None
            buf += chunk
        return bytes(buf)


class Worker:
    """The engine loop: drain commands, step, send what changed."""

    def __init__(self, engine: LLMEngine, channel: _Channel, *, debug_poison: bool) -> None:
        self.engine = engine
        self.channel = channel
        self.debug_poison = debug_poison
        self._cmds: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._live: set[str] = set()  # request ids the node still waits on
        self._failed: list[Failed] = []
        self._deltas: list[Delta] = []
        self._changed = False
        # structured output: requests whose grammar compiles on a thread of its own, so the
        # engine steps meanwhile (a cached grammar comes back at once)
        self._compiling: dict[str, tuple[Future, Add]] = {}
        self._compiler = ThreadPoolExecutor(1, thread_name_prefix="helexa-grammar")

    def run(self) -> None:
        threading.Thread(target=self._read, name="helexa-worker-reader", daemon=True).start()
        if self.engine.ranks is not None:
            threading.Thread(target=self._watch_ranks, name="helexa-rank-loss", daemon=True).start()
        engine = self.engine
        while True:
            # idle: the engine may re-measure busy-machine plans meanwhile (layers/retune.py)
            while not engine.has_unfinished() and engine.idle(self._wake):
                self.channel.send(Tuned(engine.autotune_report()))
            self._wake.clear()
            if not self._drain():
                break
            self._admit_compiled()
            if engine.has_unfinished():
                self._step()
            if self._changed:
                self._flush()
        for request_id in list(self._live):
            engine.abort(request_id)

    def _read(self) -> None:
        while True:
            try:
                cmd = self.channel.recv()
            except (OSError, msgspec.DecodeError) as e:
                log.error("worker: the node's channel failed (%s); stopping", e)
                cmd = None
            self._cmds.put(cmd if cmd is not None else Stop())
            self._wake.set()
            if cmd is None or isinstance(cmd, Stop):
                return

    def _watch_ranks(self) -> None:
        """A tensor-parallel rank that dies while the model idles: fault now, not at the
        next request (the group can never run another step)."""
        ranks = self.engine.ranks
        assert ranks is not None
        error = ranks.wait_lost()
        if error is not None:
            log.error("worker: %s", error)
            self._fault(f"{type(error).__name__}: {error}")

    def _drain(self) -> bool:
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return True
            self._changed = True
            if isinstance(cmd, Add) and cmd.params.grammar is not None:
                future = self._compiler.submit(self._compile, cmd.params.grammar)
                future.add_done_callback(lambda _: self._wake.set())
                self._compiling[cmd.request_id] = (future, cmd)
                self._live.add(cmd.request_id)
            elif isinstance(cmd, Add):
                self._add(cmd)
            elif isinstance(cmd, Abort):
                self._abort(cmd.request_id)
            else:
                return False

    def _add(self, cmd: Add) -> None:
        try:
            seq = self.engine.make_sequence(
                cmd.prompt, cmd.params, cmd.request_id, images=cmd.images
            )
            self.engine.add_request(seq)
        except Exception as e:
            self._live.discard(cmd.request_id)
            self._failed.append(Failed(cmd.request_id, "invalid", str(e)))
        else:
            self._live.add(cmd.request_id)

    def _compile(self, grammar: OutputGrammar) -> None:
        self.engine.grammars.compile(grammar)  # a GrammarError shows again in make_sequence

    def _admit_compiled(self) -> None:
        """Requests whose grammar is compiled join the engine (or fail, refused by it)."""
        for request_id, (future, cmd) in list(self._compiling.items()):
            if future.done():
                del self._compiling[request_id]
                self._changed = True
                self._add(cmd)  # the compiled grammar is cached: make_sequence takes it

    def _abort(self, request_id: str) -> None:
        """Stop a request; one still running is reported in the next Step (`aborted_delta`).
        One that finished or failed already is not: the node has that frame, or will."""
        self._compiling.pop(request_id, None)
        seq = self.engine.abort(request_id)
        if request_id not in self._live:
            return
        self._live.discard(request_id)
        if seq is None:  # live but unknown to the engine: never, but the node still waits
            self._deltas.append(Delta(request_id, [], "", True, "abort", None, None, 0, 0))
        else:
            self._deltas.append(aborted_delta(seq))

    def _step(self) -> None:
        try:
            if self.debug_poison:
                self.debug_poison = False
                inject_device_fault(self.engine.runner.device)
            updated = self.engine.step()
        except Exception as e:
            if is_device_fault(e):
                log.error("worker: device fault: %s", e)
                self._fault(f"{type(e).__name__}: {e}")
            log.exception("engine step failed")  # fails its requests, not the engine
            message = f"the engine step failed: {type(e).__name__}: {e}"
            for request_id in self._live:
                self.engine.abort(request_id)
                self._failed.append(Failed(request_id, "step", message))
            self._live.clear()
            self._changed = True
            return
        self._changed = True
        for seq in updated:
            self._collect(seq)

    def _collect(self, seq: Sequence) -> None:
        request_id = seq.request_id
        if request_id not in self._live:
            return
        out = self.engine.take_delta(seq)
        if isinstance(out, Exception):  # this request alone failed
            self._live.discard(request_id)
            kind = "nonfinite_row" if type(out).__name__ == "NonFiniteRowError" else "error"
            self._failed.append(Failed(request_id, kind, f"{type(out).__name__}: {out}"))
            return
        if out.finished:
            self._live.discard(request_id)
        if out.token_ids or out.text or out.finished:
            self._deltas.append(
                Delta(
                    request_id,
                    out.token_ids,
                    out.text,
                    out.finished,
                    out.finish_reason,
                    out.stop_reason,
                    out.logprobs,
                    out.num_cached_tokens,
                    num_cache_written_tokens=out.num_cache_written_tokens,
                )
            )

    def _flush(self) -> None:
        step = Step(self._deltas, self._failed, self.engine.stats())
        self._deltas, self._failed, self._changed = [], [], False
        self.channel.send(step)

    def _fault(self, message: str) -> None:
        """Tell the node, then go: this process's device is not to be trusted again."""
        with contextlib.suppress(OSError):
            self.channel.send(Fault(message))
        logging.shutdown()
        os._exit(3)


def computed_prompt_tokens(seq: Sequence) -> int:
    """The prompt tokens whose KV the engine has for `seq`, prefix-cache hits included: the
    whole prompt once it has sampled a token; in a chunked prefill, the chunks done so far;
    0 when it was never scheduled (or was preempted mid-prefill and waits to start again)."""
    if seq.num_output_tokens:
        return seq.num_prompt_tokens
    return min(seq.num_computed_tokens, seq.num_prompt_tokens)


def aborted_delta(seq: Sequence) -> Delta:
    """The last delta of an aborted sequence: the tokens no delta carried yet (none between
    steps, as every step's tokens are sent; there for exactness) and what it spent of its
    prompt. Its text is not sent: no one reads an aborted request's words."""
    return Delta(
        seq.request_id,
        seq.output_token_ids[seq.num_emitted_tokens :],
        "",
        True,
        "abort",
        None,
        None,
        seq.num_cached_tokens,
        computed_prompt_tokens(seq),
        seq.num_cache_written_tokens,
    )


def die_with_parent() -> None:
    """SIGKILL this process when its parent goes (Linux): a worker must never outlive the
    node and keep a GPU's memory."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent went before prctl took hold
        os._exit(1)


def main(argv: list[str]) -> int:
    die_with_parent()
    fd, spec_json = int(argv[0]), argv[1]
    spec = msgspec.json.decode(spec_json, type=WorkerSpec)
    from helexa.logs import configure

    configure(spec.log)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the node's Ctrl-C is the node's to handle
    channel = _Channel(socket.socket(fileno=fd))
    try:
        engine = LLMEngine(spec.args)
    except Exception as e:
        if not isinstance(e, (FileNotFoundError, ValueError)):
            log.exception("worker: loading %s failed", spec.model_id)
        channel.send(load_failure(e))
        return 0
    channel.send(Ready(model_facts(engine), pickle.dumps(engine.tokenizer)))
    try:
        Worker(engine, channel, debug_poison=spec.debug_poison).run()
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    # the engine is shut down and the node told: the interpreter's teardown of torch's
    # modules (~0.5 s) would only hold up the node's unload
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
