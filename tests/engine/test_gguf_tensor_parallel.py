"""GGUF under tensor parallel: each rank cuts its part of every tensor out of the file's
blocks, still quantized, and two gloo ranks on the CPU give one rank's greedy run; a split
that would cut through blocks is refused at load, before any weight is read."""

from __future__ import annotations

import zlib
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from helexa.engine import LLM, SamplingParams, parallel
from helexa.engine.layers.linear import Linear
from helexa.engine.loader.dequant import FORMATS, dequantize
from helexa.engine.loader.gguf import GGUFTensor
from helexa.engine.loader.gguf_shard import take_blocks, take_shard
from helexa.engine.loader.load import load_model
from helexa.engine.models.llama import Embedding
from helexa.engine.parallel import PlacementError, Shard, TensorParallel
from helexa.kernels.quant_pack import make_gguf_blocks
from tests.engine.test_gguf import random_raw
from tests.engine.test_parity import _record_logits, assert_same_greedy_run
from tests.shared_fixtures import needs_shared

VOCAB = 509  # odd: rank 1's rows of the embedding and lm_head end in a zero-byte row
HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 256, 512, 4, 2, 64
NUM_EXPERTS = 4
# o_proj's 256 input columns split into 128 a rank: blocks of 32 (or floats) only; down's
# 512 into 256: any qtype, the K-quants' super-blocks included
DENSE_LAYERS = [
    dict(q="Q4_K", k="Q5_K", v="Q6_K", o="Q8_0", gate="Q4_0", up="Q4_1", down="Q6_K"),
    dict(q="Q8_0", k="Q4_0", v="Q8_0", o="F16", gate="Q4_K", up="Q5_K", down="Q4_K"),
]
MOE_LAYERS = [dict(DENSE_LAYERS[0], gate="Q4_K", up="Q8_0", down="Q6_K")]
ENGINE = dict(
    device="cpu",
    dtype="float32",
    kv_cache_dtype="float32",
    num_kv_blocks=64,
    block_size=16,
    max_prefill_chunk=24,
    autotune=False,  # plans measured per process would differ between the runs compared
)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# Two ranks sum their partial products in another order than one rank: logits agree to
# float rounding (~1e-6), but where that moves an activation across a rounding boundary of
# the native kernels' int8 activations (blocks of 32), a step's logits move by about one
# int8 step times the weights (seen: 7e-3 at one step of 72).
LOGITS_ATOL = 2e-2
ROUNDING = 1e-5


# ---- cutting a tensor's blocks ---------------------------------------------------------------


def _tensor(qtype: str, shape: tuple[int, ...]) -> GGUFTensor:
    rng = np.random.default_rng(zlib.crc32(f"{qtype} {shape}".encode()))
    raw = torch.from_numpy(random_raw(qtype, shape, rng)).reshape(int(np.prod(shape[:-1])), -1)
    return GGUFTensor(
        name="model.layers.0.mlp.down_proj.weight", qtype=qtype, shape=shape, data=raw
    )


def _cut_is_the_dequantized_slice(src: GGUFTensor, shard: Shard) -> None:
    part = take_shard(shard, src)
    assert isinstance(part, GGUFTensor) and part.qtype == src.qtype
    expected = shard.take(src.dequantize())
    assert part.shape == tuple(expected.shape)
    assert part.data.dtype == torch.uint8 and part.data.shape[0] == np.prod(part.shape[:-1])
    assert torch.equal(dequantize(part.data, part.qtype, part.shape), expected)


@pytest.mark.parametrize("qtype", list(FORMATS))
def test_a_column_parallel_cut_of_any_qtype_is_the_dequantized_rows_exactly(qtype):
    block = FORMATS[qtype][0]
    src = _tensor(qtype, (6, 2 * max(block, 32)))
    _cut_is_the_dequantized_slice(src, Shard(0, 6, ((2, 5),)))
    _cut_is_the_dequantized_slice(src, Shard(0, 6, ((0, 1), (3, 6))))  # q/k/v, gate/up pieces
    _cut_is_the_dequantized_slice(src, Shard(0, 6, ((4, 8),)))  # padded: zero rows past 6


@pytest.mark.parametrize("qtype", list(FORMATS))
def test_a_row_parallel_cut_in_whole_blocks_is_the_dequantized_columns_exactly(qtype):
    b = max(FORMATS[qtype][0], 32)
    src = _tensor(qtype, (5, 4 * b))
    _cut_is_the_dequantized_slice(src, Shard(1, 4 * b, ((b, 3 * b),)))
    _cut_is_the_dequantized_slice(src, Shard(1, 4 * b, ((0, b), (2 * b, 4 * b))))
    _cut_is_the_dequantized_slice(src, Shard(1, 4 * b, ((3 * b, 5 * b),)))  # zero blocks past it


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "F16"])
def test_stacked_experts_cut_along_their_rows_or_whole_blocks_of_columns(qtype):
    b = max(FORMATS[qtype][0], 32)
    src = _tensor(qtype, (3, 4, 2 * b))  # [E, out, in]
    _cut_is_the_dequantized_slice(src, Shard(0, 3, ((1, 3),)))
    _cut_is_the_dequantized_slice(src, Shard(1, 4, ((2, 4),)))
    _cut_is_the_dequantized_slice(src, Shard(2, 2 * b, ((b, 2 * b),)))


def test_a_ranks_rows_are_a_view_of_the_mapped_bytes_and_float_tensors_cut_as_before():
    src = _tensor("Q4_K", (8, 256))
    part = take_blocks(src, Shard(0, 8, ((4, 8),)))
    assert part.data.data_ptr() == src.data[4].data_ptr()  # nothing read but its own rows
    w = torch.randn(8, 64)
    assert torch.equal(take_shard(Shard(1, 64, ((32, 64),)), w), w[:, 32:])
    assert take_shard(None, src) is src


@pytest.mark.parametrize(
    ("qtype", "columns", "block"), [("Q4_K", (0, 128), 256), ("Q8_0", (16, 48), 32)]
)
def test_columns_off_the_block_boundaries_are_refused_naming_tensor_qtype_and_why(
    qtype, columns, block, monkeypatch
):
    monkeypatch.setattr(parallel, "_TP", TensorParallel(0, 4))
    src = _tensor(qtype, (4, 512))
    with pytest.raises(PlacementError) as e:
        take_blocks(src, Shard(1, 512, (columns,)))
    message = str(e.value)
    assert "model.layers.0.mlp.down_proj.weight" in message and qtype in message
    assert f"blocks of {block} weights" in message and f"[{columns[0]}, {columns[1]})" in message
    assert "tensor_parallel=4" in message
    ways = [n for n in range(1, 512 // block + 1) if 512 // block % n == 0]
    assert f"tensor_parallel in {ways}" in e.value.suggestion


# ---- whole models on two ranks ---------------------------------------------------------------


def _quantized(w: gguf.GGUFWriter, name: str, qtype: str, *shape: int, seed: int) -> None:
    """A random tensor of `shape` (torch order) in `qtype`, weights of std ~0.02."""
    g = torch.Generator().manual_seed(seed)
    if qtype in ("F16", "F32"):
        a = (torch.randn(*shape, generator=g) * 0.02).numpy()
        w.add_tensor(name, a.astype(np.float16 if qtype == "F16" else np.float32))
        return
    rows = int(np.prod(shape[:-1]))
    raw = make_gguf_blocks(qtype, rows, shape[-1], generator=g).numpy()
    w.add_tensor(name, raw.reshape(*shape[:-1], -1), raw_dtype=QT[qtype])


def write_quantized_gguf(
    path: Path, arch: str, layers: list[dict[str, str]], *, embed: str, output: str | None
) -> Path:
    """A qwen3 or qwen3moe GGUF with random quantized weights: `layers` names each layer's
    projections' qtypes, `embed` the token embedding's, `output` the lm_head's (None: tied)."""
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(len(layers))
    w.add_context_length(4096)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    if arch == "qwen3moe":
        w.add_expert_count(NUM_EXPERTS)
        w.add_expert_used_count(2)
        w.add_expert_feed_forward_length(INTER)
    tokens = ["a", "b", "ab", *(f"t{i}" for i in range(3, VOCAB))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_merges(["a b"])
    w.add_eos_token_id(2)
    seed = iter(range(1, 1000))
    g = torch.Generator().manual_seed(0)

    def norm(name: str, n: int) -> None:
        w.add_tensor(name, (1 + 0.1 * torch.randn(n, generator=g)).numpy())

    _quantized(w, "token_embd.weight", embed, VOCAB, HIDDEN, seed=next(seed))
    if output is not None:
        _quantized(w, "output.weight", output, VOCAB, HIDDEN, seed=next(seed))
    norm("output_norm.weight", HIDDEN)
    for i, q in enumerate(layers):
        blk = f"blk.{i}"
        norm(f"{blk}.attn_norm.weight", HIDDEN)
        norm(f"{blk}.ffn_norm.weight", HIDDEN)
        norm(f"{blk}.attn_q_norm.weight", HEAD_DIM)
        norm(f"{blk}.attn_k_norm.weight", HEAD_DIM)
        _quantized(w, f"{blk}.attn_q.weight", q["q"], HEADS * HEAD_DIM, HIDDEN, seed=next(seed))
        for kv in ("k", "v"):
            shape = (KV_HEADS * HEAD_DIM, HIDDEN)
            _quantized(w, f"{blk}.attn_{kv}.weight", q[kv], *shape, seed=next(seed))
        o = (HIDDEN, HEADS * HEAD_DIM)
        _quantized(w, f"{blk}.attn_output.weight", q["o"], *o, seed=next(seed))
        if arch == "qwen3moe":
            router = torch.randn(NUM_EXPERTS, HIDDEN, generator=g) * 0.5
            w.add_tensor(f"{blk}.ffn_gate_inp.weight", router.numpy())
            e, suffix = (NUM_EXPERTS,), "_exps"
        else:
            e, suffix = (), ""
        for proj, shape in (("gate", (INTER, HIDDEN)), ("up", (INTER, HIDDEN))):
            name = f"{blk}.ffn_{proj}{suffix}.weight"
            _quantized(w, name, q[proj], *e, *shape, seed=next(seed))
        name = f"{blk}.ffn_down{suffix}.weight"
        _quantized(w, name, q["down"], *e, HIDDEN, INTER, seed=next(seed))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (1, 9, 40)]


def _greedy(llm: LLM) -> tuple[list[list[int]], list[torch.Tensor]]:
    seen = _record_logits(llm)
    outs = llm.generate(_prompts(), GREEDY)
    return [o.token_ids for o in outs], [torch.stack(seen[o.request_id]) for o in outs]


def _held(llm: LLM) -> tuple[dict[str, str], int]:
    """How rank 0 holds each Linear (format or block kind) and the bytes they hold."""
    linears = {
        name: m for name, m in llm.engine.runner.model.named_modules() if isinstance(m, Linear)
    }
    kinds = {name: m.block_kind or m.format for name, m in linears.items()}
    return kinds, sum(m.memory_bytes for m in linears.values())


CASES = {
    # tied embeddings; attention and a dense MLP in every 32- and 256-weight qtype
    "qwen3": ("qwen3", DENSE_LAYERS, "Q8_0", None),
    # stacked experts [E, I, H] cut per expert; an untied K-quant lm_head
    "qwen3moe": ("qwen3moe", MOE_LAYERS, "Q4_0", "Q6_K"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_of_a_quantized_gguf_give_one_ranks_tokens_and_logits(case, tmp_path):
    arch, layers, embed, output = CASES[case]
    path = write_quantized_gguf(tmp_path / f"{case}.gguf", arch, layers, embed=embed, output=output)
    with LLM(str(path), **ENGINE) as one:
        tokens, logits = _greedy(one)
        kinds, nbytes = _held(one)
    with LLM(str(path), tensor_parallel=2, **ENGINE) as two:
        assert two.engine.loaded.source_format == "gguf"
        split_tokens, split_logits = _greedy(two)
        split_kinds, split_nbytes = _held(two)
    for i, prompt in enumerate(_prompts()):
        assert_same_greedy_run(
            split_tokens[i], split_logits[i], tokens[i], logits[i],
            f"{case} tp=2 prompt len {len(prompt)}", atol=LOGITS_ATOL,
        )  # fmt: skip
    # and all but the odd step agree to rounding
    steps = torch.cat([(a - b).abs().amax(-1) for a, b in zip(split_logits, logits, strict=True)])
    assert (steps > ROUNDING).float().mean() <= 0.1, steps
    # each rank keeps the file's quantization, and about half of the bytes
    assert split_kinds == kinds
    assert split_nbytes < 0.55 * nbytes


def test_a_file_whose_columns_cannot_split_on_blocks_is_refused_before_any_weight_loads(
    tmp_path, monkeypatch
):
    layers = [dict(DENSE_LAYERS[0], o="Q4_K")]  # 256 columns: 128 a rank, half a super-block
    path = write_quantized_gguf(tmp_path / "odd.gguf", "qwen3", layers, embed="Q8_0", output=None)
    loads = []
    monkeypatch.setattr(Linear, "load_weight", lambda self, *a, **k: loads.append(self))
    monkeypatch.setattr(parallel, "_TP", TensorParallel(0, 2))
    with pytest.raises(PlacementError) as e:
        load_model(str(path), device=torch.device("cpu"))
    assert "model.layers.0.self_attn.o_proj.weight (Q4_K [256, 256])" in str(e.value)
    assert "blocks of 256 weights" in str(e.value) and "[0, 128)" in str(e.value)
    assert "tensor_parallel in [1]" in e.value.suggestion
    assert loads == []


ON_CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    ],
)


@pytest.mark.parametrize("device", ["cpu", ON_CUDA])
def test_rank_one_holds_its_half_of_every_tensor_in_the_files_quantization(
    device, tmp_path, monkeypatch
):
    arch, layers, embed, output = CASES["qwen3"]
    path = write_quantized_gguf(tmp_path / "q.gguf", arch, layers, embed=embed, output=output)
    on = torch.device(device)
    whole = load_model(str(path), device=on).model
    monkeypatch.setattr(parallel, "_TP", TensorParallel(1, 2))  # loading runs no collective
    half = load_model(str(path), device=on).model
    full = {n: m for n, m in whole.named_modules() if isinstance(m, Linear)}
    held = {n: m for n, m in half.named_modules() if isinstance(m, Linear)}
    assert held.keys() == full.keys()
    for name, m in held.items():
        f = full[name]
        assert (m.block_kind or m.format) == (f.block_kind or f.format), name
        w, fw = m.dequantize(), f.dequantize()
        if name.endswith(("o_proj", "down_proj")):  # row-parallel: the second half's columns
            assert torch.equal(w, fw[:, fw.shape[1] // 2 :]), name
        elif name == "lm_head":  # vocab-parallel: rows [255, 510) of 509, one of padding
            assert torch.equal(w[:-1], fw[255:]) and not w[-1].any()
        else:  # q/k/v, gate/up fused: the second half of each part's rows
            parts = fw.split(f.split_sizes)
            assert torch.equal(w, torch.cat([p[p.shape[0] // 2 :] for p in parts])), name
    assert sum(m.memory_bytes for m in held.values()) < 0.55 * sum(
        m.memory_bytes for m in full.values()
    )
    # the embedding's rows, still quantized: on the CPU read through the tied lm_head's blocks
    table = half.embed_tokens
    assert table.weight is None
    assert table.packed is half.lm_head if device == "cpu" else table.qweight is not None
    rows = Embedding.forward(table, torch.arange(255, device=on))
    assert torch.equal(rows[:-1], whole.embed_tokens(torch.arange(255, 509, device=on)))
    assert not rows[-1].any()


@needs_shared  # the converted file's tokenizer
def test_a_converted_qwen35_file_splits_in_floats_and_its_q8_0_down_proj_is_refused(tmp_path):
    # llama.cpp's converter on a tiny Qwen3.5 (test_gguf_qwen35.py; it skips without one)
    qwen35 = pytest.importorskip("tests.engine.test_gguf_qwen35")
    qwen35._converter()
    model_dir = qwen35._write_checkpoint(qwen35._hf_model("dense"), tmp_path / "hf")
    path = qwen35.convert(model_dir, "f16")
    with LLM(str(path), **ENGINE) as one:
        tokens, logits = _greedy(one)
    with LLM(str(path), tensor_parallel=2, **ENGINE) as two:
        split_tokens, split_logits = _greedy(two)
    for i, prompt in enumerate(_prompts()):
        assert_same_greedy_run(
            split_tokens[i], split_logits[i], tokens[i], logits[i],
            f"qwen35 f16 tp=2 prompt len {len(prompt)}", atol=1e-4,
        )  # fmt: skip
    # its MLP's 96 columns are 3 Q8_0 blocks: 48 a rank would cut one in half
    path = qwen35.convert(model_dir, "q8_0")
    with pytest.raises(PlacementError, match=r"mlp\.down_proj\.weight \(Q8_0 \[64, 96\]\)") as e:
        LLM(str(path), tensor_parallel=2, **ENGINE)
    assert "tensor_parallel in [1, 3]" in e.value.suggestion
