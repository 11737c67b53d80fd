"""Tensor-parallel sharding: two gloo ranks on the CPU, each holding its shard of a tiny
model, give the unsharded model's logits and greedy tokens (and transformers'); models
that cannot be split say so at build time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helexa.engine import parallel
from helexa.engine.layers.linear import Linear, column_parallel, row_parallel
from helexa.engine.llm_engine import EngineArgs, LLMEngine
from helexa.engine.loader.load import load_model
from helexa.engine.models.config import ModelConfig
from helexa.engine.models.llama import LlamaForCausalLM
from helexa.engine.models.qwen3_5 import Qwen3_5ForCausalLM
from helexa.engine.parallel import PlacementError, TensorParallel
from helexa.engine.sampling_params import SamplingParams
from tests.engine.test_parity import _hf_greedy, record_model_logits
from tests.engine.tiny import (
    HYBRID_TEXT,
    make_tiny_model,
    make_tiny_new_family,
    shrunk_config,
)
from tests.shared_fixtures import needs_shared

pytestmark = needs_shared

REPO = Path(__file__).resolve().parents[2]
WORLD = 2
NUM_TOKENS = 32
PROMPT_LENGTHS = (1, 9, 40)  # 40 > the prefill chunk: prefilled in two pieces, beside decodes
VOCAB = 509  # odd: each rank's vocabulary slice is padded with a zero row
ENGINE = dict(
    dtype="float32",
    kv_cache_dtype="float32",  # transformers' logits to float rounding
    device="cpu",
    num_kv_blocks=48,
    block_size=16,
    max_prefill_chunk=24,
    num_threads=1,
    seed=0,
    autotune=False,  # plans measured per process would differ between the runs compared
)
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)

# name → (family, overrides, quant): what each case splits
CASES: dict[str, tuple[str, dict, str | None]] = {
    # tied embeddings; 4 query / 2 KV heads: one KV head per rank
    "smollm2": ("smollm2", {}, None),
    # q/k/v biases and an o_proj without; untied lm_head; one KV head replicated on both ranks
    "qwen2_untied": ("qwen2_untied", {"num_key_value_heads": 1}, None),
    # per-head q/k norms, explicit head_dim
    "qwen3": ("qwen3", {}, None),
    # experts split by intermediate size, a dense layer between sparse ones
    "qwen3_moe": ("qwen3_moe", {}, None),
    # Gated DeltaNet heads and the gated attention's query+gate rows
    "qwen3_5": ("qwen3_5", {}, None),
    # a gated shared expert beside the routed ones
    "qwen3_5_moe": ("qwen3_5_moe", {}, None),
    # in-situ int4: each rank quantizes its shard
    "smollm2_int4": ("smollm2", {}, "int4"),
}
NEW_FAMILIES = ("qwen3_moe", "qwen3_5", "qwen3_5_moe")


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _engine(model_dir: Path | str, quant: str | None) -> LLMEngine:
    """An engine over the model as this process's place in the group shards it."""
    # a quantized case keeps float copies of its shards: its prompts then run exactly
    args = EngineArgs(model=str(model_dir), quant=quant, cpu_dense_copy=quant is not None, **ENGINE)
    if not parallel.tp().enabled:
        return LLMEngine(args)
    loaded = load_model(
        args.model,
        device=torch.device("cpu"),
        dtype=torch.float32,
        quant=quant,
        dense_copies=args.cpu_dense_copy,
    )
    # An engine refuses to start in a process of a tensor-parallel group (it would shard its
    # model and join the group's collectives beside the group's own engine). Here that is
    # the point: each rank runs its own engine over its own shard, SPMD, the model already
    # loaded, so the engine is built as at world size 1.
    held = parallel._TP
    parallel._TP = TensorParallel()
    try:
        return LLMEngine(args, loaded)
    finally:
        parallel._TP = held


def _run(model_dir: Path | str, quant: str | None) -> tuple[LLMEngine, list, list]:
    """Greedy NUM_TOKENS for the prompts, batched: (engine, token lists, logits [n, vocab]
    per prompt)."""
    engine = _engine(model_dir, quant)
    seen = record_model_logits(engine.runner.model)
    outs = engine.generate(_prompts(), GREEDY)
    return engine, [o.token_ids for o in outs], [torch.stack(seen[o.request_id]) for o in outs]


def _layout(engine: LLMEngine) -> dict:
    """What this rank holds: KV heads and cache shapes, recurrent state shapes, formats."""
    model = engine.runner.model
    return {
        "num_heads": [a.num_heads for a in model.attention_layers],
        "num_kv_heads": [a.num_kv_heads for a in model.attention_layers],
        "k_cache": [list(a.k_cache.shape) for a in model.attention_layers],
        "states": [
            [list(s) for s in layer.state_shapes()]
            for layer in getattr(model, "recurrent_layers", ())
        ],
        "formats": sorted({m.format for m in model.modules() if isinstance(m, Linear)}),
        "embed_rows": model.embed_tokens.weight.shape[0],
    }


def _rank_main(rank: str, rdzv: str, jobs_file: str, out_dir: str) -> None:
    """One rank: join the group, then run every job SPMD-style (the same engine, prompts and
    steps as the other rank, so each collective meets its peer) and save what it saw."""
    torch.set_num_threads(1)
    parallel.init_tensor_parallel(int(rank), WORLD, rdzv, torch.device("cpu"), 60)
    try:
        for job in json.loads(Path(jobs_file).read_text()):
            engine, tokens, logits = _run(job["dir"], job["quant"])
            result = {"tokens": tokens, "logits": logits, "layout": _layout(engine)}
            torch.save(result, Path(out_dir) / f"{job['name']}.rank{rank}.pt")
    finally:
        parallel.destroy_tensor_parallel()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, tuple[Path, torch.nn.Module]]:
    root = tmp_path_factory.mktemp("tp_models")
    made = {}
    for name, (family, overrides, _) in CASES.items():
        if family in made:
            continue
        if family in NEW_FAMILIES:
            made[family] = make_tiny_new_family(family, root, vocab_size=VOCAB)
        else:
            made[family] = make_tiny_model(family, root, vocab_size=VOCAB, **overrides)
        assert made[family][1].config.get_text_config().vocab_size == VOCAB, name
    return {name: made[family] for name, (family, _, _) in CASES.items()}


@pytest.fixture(scope="module")
def two_ranks(tiny, tmp_path_factory) -> dict[str, list[dict]]:
    """Every case run once on two ranks (one spawn of two processes for the whole file)."""
    work = tmp_path_factory.mktemp("tp_run")
    jobs = [{"name": n, "dir": str(tiny[n][0]), "quant": CASES[n][2]} for n in CASES]
    (work / "jobs.json").write_text(json.dumps(jobs))
    code = (
        "import sys; from tests.engine.test_tensor_parallel_layers import _rank_main; "
        "_rank_main(*sys.argv[1:])"
    )
    rdzv = f"file://{work / 'rdzv'}"
    env = {"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(r), rdzv, str(work / "jobs.json"), str(work)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(WORLD)
    ]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} failed:\n{logs[r][-4000:]}"
    return {n: [torch.load(work / f"{n}.rank{r}.pt") for r in range(WORLD)] for n in CASES}


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n][2] is None])
def test_two_ranks_give_the_unsharded_logits_and_tokens_and_transformers_own(name, tiny, two_ranks):
    model_dir, hf = tiny[name]
    rank0, rank1 = two_ranks[name]
    # every rank ends a step with the same full-vocabulary logits, so samples the same tokens
    assert rank0["tokens"] == rank1["tokens"]
    for a, b in zip(rank0["logits"], rank1["logits"], strict=True):
        assert a.shape[-1] == VOCAB and torch.equal(a, b)
    _, tokens, logits = _run(model_dir, None)
    for i, n in enumerate(PROMPT_LENGTHS):
        assert rank0["tokens"][i] == tokens[i], f"{name} prompt len {n}"
        diff = (rank0["logits"][i] - logits[i]).abs().max().item()
        assert diff <= 1e-4, f"{name} prompt len {n}: max |Δlogits| vs TP=1 {diff:.2e}"
        ref_tokens, ref_logits = _hf_greedy(hf, _prompts()[i])
        assert rank0["tokens"][i] == ref_tokens, f"{name} prompt len {n} vs transformers"
        diff = (rank0["logits"][i] - ref_logits).abs().max().item()
        assert diff <= 1e-4, f"{name} prompt len {n}: max |Δlogits| vs transformers {diff:.2e}"


def test_each_rank_holds_its_heads_kv_cache_and_vocabulary_slice(two_ranks):
    for r in range(WORLD):
        split = two_ranks["smollm2"][r]["layout"]  # 4 query / 2 KV heads
        assert split["num_heads"] == [2, 2] and split["num_kv_heads"] == [1, 1]
        assert all(shape[2] == 1 for shape in split["k_cache"])
        assert split["embed_rows"] == 255  # 509 padded to 510, halved
        shared = two_ranks["qwen2_untied"][r]["layout"]  # 4 query / 1 KV head: replicated
        assert shared["num_heads"] == [2, 2] and shared["num_kv_heads"] == [1, 1]
        hybrid = two_ranks["qwen3_5"][r]["layout"]
        kd, vd = HYBRID_TEXT["linear_key_head_dim"], HYBRID_TEXT["linear_value_head_dim"]
        hk = HYBRID_TEXT["linear_num_key_heads"] // WORLD
        hv = HYBRID_TEXT["linear_num_value_heads"] // WORLD
        conv = [2 * hk * kd + hv * vd, HYBRID_TEXT["linear_conv_kernel_dim"] - 1]
        assert hybrid["states"] == [[conv, [hv, kd, vd]]] * 2
        assert hybrid["num_heads"] == [2, 2] and hybrid["num_kv_heads"] == [1, 1]


def test_in_situ_int4_quantizes_each_shard_and_stays_close_to_the_unsharded_run(tiny, two_ranks):
    rank0, rank1 = two_ranks["smollm2_int4"]
    assert "int4" in rank0["layout"]["formats"] and rank0["tokens"] == rank1["tokens"]
    _, tokens, logits = _run(tiny["smollm2_int4"][0], "int4")
    for i in range(len(PROMPT_LENGTHS)):
        ours, ref = rank0["logits"][i], logits[i]
        # the prompt runs on the float copies of the shards (dense_copy): as exact as floats
        assert (ours[0] - ref[0]).abs().max().item() <= 1e-4
        # int4 groups never straddle a shard, so the decode steps' weights are the same too,
        # but the int4 kernel rounds each rank's partial sum to bf16: compare at that
        # precision, over the steps whose contexts are still the same
        pairs = zip(rank0["tokens"][i], tokens[i], strict=True)
        first_other = next((j for j, (a, b) in enumerate(pairs) if a != b), None)
        steps = len(ref) if first_other is None else first_other + 1
        assert (ours[:steps] - ref[:steps]).abs().max().item() <= 0.25


# ---- placement errors and shards, in one process (no collectives run) -----------------------


@pytest.fixture
def fake_tp(monkeypatch):
    """Pretend to be `rank` of `world_size`: enough to build and load shards."""

    def set_tp(rank: int, world_size: int) -> None:
        monkeypatch.setattr(parallel, "_TP", TensorParallel(rank, world_size))

    return set_tp


def _llama_cfg(**overrides) -> ModelConfig:
    return ModelConfig.from_hf(shrunk_config("smollm2", **overrides))


def test_query_heads_that_do_not_divide_are_refused_at_build(fake_tp):
    fake_tp(0, 3)
    with pytest.raises(PlacementError, match=r"num_attention_heads \(4\).*tensor_parallel=3"):
        LlamaForCausalLM(_llama_cfg())


def test_kv_heads_that_do_not_divide_are_refused_at_build(fake_tp):
    fake_tp(0, 2)
    with pytest.raises(PlacementError, match=r"num_key_value_heads \(3\)"):
        LlamaForCausalLM(_llama_cfg(num_attention_heads=6, num_key_value_heads=3))
    fake_tp(0, 4)  # fewer KV heads than ranks, and the ranks cannot share them evenly
    with pytest.raises(PlacementError, match="cannot share KV heads"):
        LlamaForCausalLM(_llama_cfg(num_attention_heads=12, num_key_value_heads=3))


def test_fewer_kv_heads_than_ranks_are_replicated_to_the_ranks_that_read_them(fake_tp):
    for rank, kv in [(0, 0), (1, 0), (2, 1), (3, 1)]:
        fake_tp(rank, 4)
        attn = LlamaForCausalLM(_llama_cfg(num_attention_heads=8)).layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
        d = attn.head_dim
        assert attn.k_proj.shard.ranges == ((kv * d, (kv + 1) * d),)


def test_linear_attention_heads_that_do_not_divide_are_refused_at_build(fake_tp):
    fake_tp(0, 4)  # attention's 4 heads split, but the 2 linear key heads do not
    text = dict(HYBRID_TEXT, vocab_size=VOCAB, model_type="qwen3_5_text", intermediate_size=96)
    with pytest.raises(PlacementError, match=r"linear_num_key_heads \(2\)"):
        Qwen3_5ForCausalLM(ModelConfig.from_hf(text))


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_a_shard_is_cut_from_the_float_weight_then_quantized(fake_tp, quant):
    torch.manual_seed(0)
    w = torch.randn(64, 128)
    whole = Linear(128, 64)
    whole.load_weight(w, dtype=torch.float32, quant=quant)
    fake_tp(1, 2)
    col = column_parallel(128, 64)
    col.load_weight(w, dtype=torch.float32, quant=quant)
    assert col.format == quant and (col.out_features, col.in_features) == (32, 128)
    # per-row int8 scales and int4 groups along the input: rows quantize alike either way
    assert torch.equal(col.dequantize(), whole.dequantize()[32:])
    row = row_parallel(128, 64)
    row.load_weight(w, dtype=torch.float32, quant=quant)
    assert row.format == quant and (row.out_features, row.in_features) == (64, 64)
    ref = Linear(64, 64)
    ref.load_weight(w[:, 64:], dtype=torch.float32, quant=quant)
    assert torch.equal(row.dequantize(), ref.dequantize())


def test_row_parallel_bias_is_added_on_rank_zero_only(fake_tp):
    b = torch.arange(4.0)
    for rank in range(2):
        fake_tp(rank, 2)
        lin = row_parallel(8, 4, bias=True)
        lin.load_bias(b, dtype=torch.float32)
        assert (lin.bias is not None) == (rank == 0)
        col = column_parallel(8, 4, bias=True)
        col.load_bias(b, dtype=torch.float32)
        assert torch.equal(col.bias, b[2 * rank : 2 * rank + 2])


def test_one_rank_builds_the_plain_layers(tmp_path):
    assert not parallel.tp().enabled
    lin = row_parallel(8, 4)
    assert type(lin) is Linear and lin.shard is None
    model = LlamaForCausalLM(_llama_cfg())
    assert type(model.lm_head) is Linear and type(model.layers[0].self_attn.o_proj) is Linear
