"""One sequence's error fails that request alone: its batch-mates get their solo tokens."""

from __future__ import annotations

import asyncio

import pytest
import torch

from helexa.engine import LLM, AsyncLLM, SamplingParams
from helexa.engine.detokenizer import IncrementalDetokenizer
from helexa.engine.layers.sampler import Sampler
from helexa.engine.model_runner import NonFiniteLogitsError, NonFiniteRowError
from helexa.engine.sequence import Sequence
from tests.engine.tiny import make_tiny_model
from tests.shared_fixtures import needs_shared

pytestmark = needs_shared

NUM_SEQS = 8
NUM_TOKENS = 16
VICTIM = 3  # in the middle: rows before it draw their noise before it fails


class InjectedError(RuntimeError):
    pass


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    model_dir, _ = make_tiny_model("smollm2", tmp_path_factory.mktemp("m"))
    return LLM(str(model_dir), kv_cache_memory_mb=16)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    lengths = torch.randint(4, 40, (NUM_SEQS,), generator=g).tolist()
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]


def _params(kind: str, i: int) -> SamplingParams:
    if kind == "greedy":
        return SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    return SamplingParams(temperature=0.9, seed=100 + i, max_tokens=NUM_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def solo(llm) -> dict[str, list[list[int]]]:
    """Each prompt's tokens run alone, greedy and seeded."""
    return {
        kind: [llm.generate([p], _params(kind, i))[0].token_ids for i, p in enumerate(_prompts())]
        for kind in ("greedy", "seeded")
    }


def _run_batch(llm: LLM, kind: str):
    """All prompts together, run to the end; the sequences in prompt order."""
    engine = llm.engine
    seqs = [
        engine.add_request(p, _params(kind, i), request_id=f"r{i}")
        for i, p in enumerate(_prompts())
    ]
    while engine.has_unfinished():
        engine.step()
    return seqs


def _inject(monkeypatch, llm: LLM, fault: str) -> None:
    """Make the victim's sampling, its row of logits or its detokenizer fail, mid-batch."""
    victim = f"r{VICTIM}"
    if fault == "sampler":  # after the real sampler has drawn every row's noise
        sample = Sampler.sample  # what the runner and Sampler.__call__ both call

        def failing_sample(self, logits, seqs):
            out = sample(self, logits, seqs)
            if any(s.request_id == victim for s in seqs):
                raise InjectedError("sampler")
            return out

        monkeypatch.setattr(Sampler, "sample", failing_sample)
    elif fault == "nonfinite":
        model = llm.engine.runner.model
        compute_logits = model.compute_logits

        def nan_row(hidden, seqs):
            logits = compute_logits(hidden, seqs)
            for j, s in enumerate(seqs):
                if s.request_id == victim and s.num_output_tokens >= 2:
                    logits[j] = torch.nan
            return logits

        monkeypatch.setattr(model, "compute_logits", nan_row)
    else:
        step = IncrementalDetokenizer.step

        def failing_step(self, ids, final=False):
            seq = llm.engine._seqs.get(victim)
            if seq is not None and seq._detok is self and len(ids) > seq.num_prompt_tokens + 2:
                raise InjectedError("detokenizer")
            return step(self, ids, final)

        monkeypatch.setattr(IncrementalDetokenizer, "step", failing_step)


@pytest.mark.parametrize(
    ("fault", "kind"),
    [
        ("sampler", "greedy"),
        ("sampler", "seeded"),
        ("nonfinite", "greedy"),
        ("nonfinite", "seeded"),
        ("detokenizer", "greedy"),
    ],
)
def test_one_sequence_failing_fails_alone_and_the_others_get_their_solo_tokens(
    llm, solo, monkeypatch, fault, kind
):
    _inject(monkeypatch, llm, fault)
    seqs = _run_batch(llm, kind)
    victim = seqs[VICTIM]
    assert victim.finish_reason == "error"
    expected = NonFiniteRowError if fault == "nonfinite" else InjectedError
    assert isinstance(victim.error, expected), victim.error
    for i, seq in enumerate(seqs):
        if i != VICTIM:
            assert (seq.finish_reason, seq.error) == ("length", None)
            assert seq.output_token_ids == solo[kind][i], f"prompt {i} changed beside the failure"
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # the victim's blocks came back too


@pytest.mark.parametrize("fault", ["sampler", "nonfinite", "detokenizer"])
def test_the_debug_fault_hook_fails_its_sequence_alone(llm, solo, fault):
    engine = llm.engine
    seqs = []
    for i, p in enumerate(_prompts()):
        params = _params("greedy", i)
        if i == VICTIM:
            params.debug_fault = fault
        seqs.append(engine.add_request(p, params))
    while engine.has_unfinished():
        engine.step()
    assert seqs[VICTIM].finish_reason == "error"
    assert "HELEXA_DEBUG_FAULT" in str(seqs[VICTIM].error) or fault == "nonfinite"
    others = [s.output_token_ids for i, s in enumerate(seqs) if i != VICTIM]
    assert others == [t for i, t in enumerate(solo["greedy"]) if i != VICTIM]


def _all_nan(monkeypatch, llm: LLM) -> None:
    model = llm.engine.runner.model
    compute_logits = model.compute_logits
    monkeypatch.setattr(
        model, "compute_logits", lambda hidden, seqs: compute_logits(hidden, seqs) * torch.nan
    )


@pytest.mark.parametrize("num_seqs", [1, NUM_SEQS])
def test_non_finite_logits_in_every_row_are_still_a_device_fault(llm, monkeypatch, num_seqs):
    _all_nan(monkeypatch, llm)
    engine = llm.engine
    ids = [
        engine.add_request(p, _params("greedy", i)).request_id
        for i, p in enumerate(_prompts()[:num_seqs])
    ]
    try:
        with pytest.raises(NonFiniteLogitsError):
            while engine.has_unfinished():
                engine.step()
    finally:
        for request_id in ids:
            engine.abort(request_id)


@pytest.mark.parametrize("fault", ["sampler", "take_delta"])
def test_an_async_stream_gets_its_own_error_while_the_others_finish(llm, solo, monkeypatch, fault):
    if fault == "take_delta":  # on the engine thread, as the delta is published
        take_delta = Sequence.take_delta

        def failing_take_delta(self):
            if self.request_id == f"r{VICTIM}" and self.num_output_tokens > 2:
                raise InjectedError("take_delta")
            return take_delta(self)

        monkeypatch.setattr(Sequence, "take_delta", failing_take_delta)
    else:
        _inject(monkeypatch, llm, fault)

    async def one(engine: AsyncLLM, i: int, prompt: list[int]) -> list[int]:
        tokens = []
        async for delta in engine.generate(prompt, _params("greedy", i), f"r{i}"):
            tokens += delta.token_ids
        return tokens

    async def run():
        engine = AsyncLLM(llm.engine)
        try:
            jobs = [one(engine, i, p) for i, p in enumerate(_prompts())]
            return await asyncio.gather(*jobs, return_exceptions=True)
        finally:
            engine.shutdown()

    results = asyncio.run(run())
    assert isinstance(results[VICTIM], InjectedError)
    for i, tokens in enumerate(results):
        if i != VICTIM:
            assert tokens == solo["greedy"][i]
    bm = llm.engine.block_manager
    assert not llm.engine.has_unfinished() and bm.num_free_blocks == bm.num_blocks
