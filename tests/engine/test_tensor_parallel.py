"""Tensor parallel, the process side: rank 0 in the test process, its follower ranks spawned
(gloo on the CPU). Greedy tokens match one rank and logits match transformers; followers live
exactly as long as the engine; a lost rank makes the next step raise RankLostError at once;
impossible placements are refused before anything loads."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from helexa.engine import LLM, RankLostError, SamplingParams
from helexa.engine.parallel import PlacementError, tp
from helexa.engine.vision.preprocess import resize_image
from tests.engine.test_parity import _prompts, assert_matches_transformers
from tests.engine.test_vision_engine import _image, _prompt, _run
from tests.engine.tiny import make_tiny_model, make_tiny_new_family, make_tiny_vision_model
from tests.shared_fixtures import needs_shared

pytestmark = needs_shared

# small blocks and chunks: prompts span blocks and prefill in pieces beside decodes; ranks on
# the CPU wherever the tests run (a host with one GPU has no room for two CUDA ranks; CUDA's
# own: test_two_gpus_give_one_gpus_greedy_tokens)
ENGINE = dict(
    device="cpu",
    dtype="float32",
    kv_cache_dtype="float32",
    num_kv_blocks=64,
    block_size=16,
    max_prefill_chunk=24,
)
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def _model(family: str, root):
    if family in ("smollm2", "qwen3"):
        return make_tiny_model(family, root)
    return make_tiny_new_family(family, root)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("family", ["smollm2", "qwen3", "qwen3_moe", "qwen3_5"])
def test_two_ranks_give_one_ranks_greedy_tokens_and_transformers_logits(family, tmp_path):
    model_dir, hf = _model(family, tmp_path)
    prompts = _prompts(hf.config.get_text_config().vocab_size)
    with LLM(str(model_dir), **ENGINE) as one:
        expected = [o.token_ids for o in one.generate(prompts, GREEDY)]
    with LLM(str(model_dir), tensor_parallel=2, **ENGINE) as two:
        assert [o.token_ids for o in two.generate(prompts, GREEDY)] == expected
        assert_matches_transformers(two, hf, prompts, f"{family} tp=2")
    assert not tp().enabled


def test_followers_live_as_long_as_the_engine_and_wait_idle_past_the_step_timeout(tmp_path):
    model_dir, _ = make_tiny_model("qwen3", tmp_path)
    llm = LLM(str(model_dir), tensor_parallel=2, step_timeout_s=3, **ENGINE)
    engine = llm.engine
    assert engine.rank_pids[0] == os.getpid() and len(engine.rank_pids) == 2
    assert engine.devices == ["cpu", "cpu"]
    assert engine.runner.graphs_off_reason  # no graphs without the followers' steps
    follower = engine.rank_pids[1]
    assert _alive(follower)
    with pytest.raises(RuntimeError, match="one per process"):
        LLM(str(model_dir), **ENGINE)  # would shard itself and join the group's collectives
    first = llm.generate([[5, 6, 7]], GREEDY)[0].token_ids
    time.sleep(4)  # idle longer than a collective may wait: a follower waits on its socket
    assert llm.generate([[5, 6, 7]], GREEDY)[0].token_ids == first
    llm.close()
    assert not _alive(follower)
    assert not tp().enabled
    llm.close()  # idempotent


def test_a_follower_killed_mid_generation_fails_the_next_step_at_once(tmp_path):
    model_dir, _ = make_tiny_model("qwen3", tmp_path)
    with LLM(str(model_dir), tensor_parallel=2, **ENGINE) as llm:
        engine = llm.engine
        follower = engine.rank_pids[1]
        params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
        for prompt in _prompts(512)[:3]:
            engine.add_request(prompt, params)
        engine.step()
        killer = threading.Timer(0.2, os.kill, (follower, signal.SIGKILL))
        killer.start()
        start = time.monotonic()
        with pytest.raises(RankLostError) as lost:
            while True:
                engine.step()
        killer.join()
        # a hang guard with room for a loaded machine: not the 120 s collective timeout
        assert time.monotonic() - start < 60
        assert lost.value.rank == 1 and lost.value.exit_code == -signal.SIGKILL
        assert "rank 1" in str(lost.value)
        with pytest.raises(RankLostError):  # the group stays lost
            engine.step()
    assert not tp().enabled


def test_a_step_that_fails_on_rank_zero_loses_the_group(tmp_path):
    model_dir, _ = make_tiny_model("qwen3", tmp_path)
    with LLM(str(model_dir), tensor_parallel=2, **ENGINE) as llm:
        engine = llm.engine

        def broken(*args):
            raise ValueError("rank 0 forward broke")

        engine.runner.model.forward = broken
        engine.add_request([5, 6, 7], GREEDY)
        with pytest.raises(RankLostError, match=r"rank 0 lost.*forward broke") as lost:
            engine.step()  # the follower went on into a collective rank 0 never joins
        assert lost.value.rank == 0
        follower = engine.rank_pids[1]
    assert not _alive(follower)


def test_placements_that_cannot_work_are_refused_before_loading(tmp_path, monkeypatch):
    missing = str(tmp_path / "nowhere")  # nothing is read: the checks come first
    # (a GGUF splits on its blocks, or is refused at load: test_gguf_tensor_parallel.py)
    with pytest.raises(PlacementError, match="devices") as e:
        LLM(missing, tensor_parallel=2, devices=[0])
    assert e.value.suggestion
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(PlacementError, match="needs 2 CUDA devices; this host has 1"):
        LLM(missing, device="cuda", tensor_parallel=2)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(PlacementError, match="no CUDA device"):
        LLM(missing, device="cuda", tensor_parallel=2, devices=[0, 2])
    with pytest.raises(PlacementError, match="its own device"):
        LLM(missing, device="cuda", tensor_parallel=2, devices=[1, 1])


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
)
def test_two_gpus_give_one_gpus_greedy_tokens(tmp_path):
    model_dir, _ = make_tiny_model("qwen3", tmp_path)
    prompts = _prompts(512)
    cuda = dict(ENGINE, device="cuda")
    with LLM(str(model_dir), **cuda) as one:
        expected = [o.token_ids for o in one.generate(prompts, GREEDY)]
    with LLM(str(model_dir), tensor_parallel=2, **cuda) as two:
        assert two.engine.devices == ["cuda:0", "cuda:1"]
        assert two.engine.runner.graphs_off_reason == "tensor parallel"
        assert [o.token_ids for o in two.generate(prompts, GREEDY)] == expected


def test_two_ranks_take_images_as_one_rank_does(tmp_path):
    """Rank 0 runs the vision tower; the plan carries the spliced embeddings to rank 1."""
    model_dir, _ = make_tiny_vision_model("qwen3_5", tmp_path)
    runs = []
    for world in (1, 2):
        with LLM(str(model_dir), tensor_parallel=world, **ENGINE) as llm:
            image = resize_image(_image(100, 200, 0), llm.engine.loaded.vision)
            (seq,) = _run(llm, [(_prompt([image], llm, [3838, 374]), [image])])
            runs.append(seq.output_token_ids)
    assert runs[0] == runs[1] and len(runs[0]) == 8
