"""The native K-quant kernels (native/kquants.c: Q4_K, Q5_K, Q6_K super-blocks) against the
loader's dequantization and their naive twin, at shapes that end mid-tile and mid-chunk; the
scalar build against the vector one; and the Linears that hold a Q4_K_M file's mix."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from helexa.engine.layers import native
from helexa.engine.layers.linear import MIXED, Linear, fuse
from helexa.engine.loader.dequant import dequantize
from helexa.engine.loader.gguf import GGUFTensor
from helexa.kernels.quant_pack import make_gguf_blocks
from tests.engine.test_native import rel

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler here")
KINDS = native.K_KINDS


def blocks(kind: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(random valid `kind` super-blocks [n, bytes], the loader's float32 weight [n, k])."""
    raw = make_gguf_blocks(kind, n, k, generator=torch.Generator().manual_seed(seed))
    return raw, dequantize(raw.reshape(-1), kind, (n, k))


def held(kind: str, raw: torch.Tensor) -> list[tuple[torch.Tensor, str]]:
    """The forms the Linears hold `raw` in: the file's rows, and (rows in 8s) interleaved."""
    forms = [(raw, kind)]
    if raw.shape[0] % native.XR == 0 and f"{kind}x8" in native.KINDS:
        forms.append(native.interleave(raw, kind))
    return forms


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("n", "k"), [(37, 256), (40, 768), (8, 1280)])
def test_unpacking_is_the_loaders_arithmetic_bit_for_bit(kind, n, k):
    raw, ref = blocks(kind, n, k)
    qtype = gguf.GGMLQuantizationType[kind]  # gguf-py's own reading agrees with the loader's
    theirs = gguf.quants.dequantize(raw.numpy(), qtype).reshape(n, k)
    assert torch.equal(ref, torch.from_numpy(np.ascontiguousarray(theirs)))
    ids = torch.tensor([n - 1, 0, n // 2, 3])
    for w, form in held(kind, raw):
        assert torch.equal(native.dequantize(w, form, n), ref), form
        assert torch.equal(native.unpack(w, form, n), ref), form
        assert torch.equal(native.unpack_t(w, form, n), ref.T), form
        assert torch.equal(native.rows(w, form, ids), ref[ids]), form


@pytest.mark.parametrize("kind", KINDS)
# rows 1-9 cross the 4-row tiles; 37 outputs end mid-chunk (chunks of 16); 130 rows of
# activations are quantized over threads
@pytest.mark.parametrize(
    ("m", "n", "k"), [(1, 37, 256), (3, 64, 768), (5, 24, 512), (9, 40, 256), (130, 16, 512)]
)
def test_the_kernels_compute_their_naive_twin(kind, m, n, k):
    raw, ref = blocks(kind, n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n))
    if m > 1:
        x[-1, :256] = 0  # an all-zero super-block of activations: scale 0, no division by it
    exact = (x.double() @ ref.double().T).float()
    for w, form in held(kind, raw):
        y = native.matmul(x, w, form, n)
        assert rel(y, native.naive_matmul(x, w, form, n)) < 2e-6, form
        assert rel(y, exact) < 3e-2, form  # int8 activations per 256: llama.cpp's Q8_K
        assert rel(native.matmul(x, w, form, n, exact=True), exact) < 1e-6, form


def test_the_scalar_build_for_cpus_without_avx2_agrees(scalar):
    for kind in KINDS:
        raw, ref = blocks(kind, 24, 512)
        x = torch.randn(5, 512, generator=torch.Generator().manual_seed(1))
        for w, form in held(kind, raw):
            assert torch.equal(native.unpack(w, form, 24, lib=scalar), ref), form
            y = native.matmul(x, w, form, 24, lib=scalar)
            assert rel(y, native.matmul(x, w, form, 24)) < 2e-6, form
            ye = native.matmul(x, w, form, 24, lib=scalar, exact=True)
            assert rel(ye, (x.double() @ ref.double().T).float()) < 1e-6, form


def test_bad_shapes_are_refused_not_computed():
    raw, _ = blocks("Q4_K", 8, 256)
    with pytest.raises(RuntimeError, match="refused"):
        native.matmul(torch.randn(1, 128), raw[:, :72].contiguous(), "Q4_K", 8)


def source(kind: str, n: int, k: int, seed: int = 0) -> tuple[GGUFTensor, torch.Tensor]:
    raw, ref = blocks(kind, n, k, seed)
    return GGUFTensor(f"w.{kind}", kind, (n, k), raw), ref


@pytest.mark.parametrize("kind", KINDS)
def test_a_k_quant_linear_holds_the_files_bytes_and_computes_their_weight(kind):
    src, ref = source(kind, 48, 512)
    lin = Linear(512, 48)
    lin.load_weight(src, dtype=torch.float32)
    assert lin.format == "blocks" and lin.block_kind.removesuffix("x8") == kind
    assert lin.memory_bytes <= 1.1 * src.data.nbytes  # kept as the file holds it, no float copy
    assert torch.equal(lin.dequantize(), ref)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    assert rel(lin.forward(x), x @ ref.T) < 3e-2
    assert rel(lin.exact_matmul(x), x @ ref.T) < 1e-6
    assert rel(lin.dense_matmul(x), x @ ref.T) < 1e-6


def test_a_q4_k_m_projection_of_q4_k_and_q6_k_parts_fuses_without_widening():
    # llama.cpp's Q4_K_M: q and k Q4_K, v Q6_K on some layers; q, k, v all read one input
    parts = [source("Q4_K", 64, 256, 1), source("Q4_K", 16, 256, 2), source("Q6_K", 16, 256, 3)]
    lins = []
    for src, _ in parts:
        lin = Linear(256, src.shape[0])
        lin.load_weight(src, dtype=torch.float32)
        lins.append(lin)
    fused = fuse(lins)
    assert fused.format == "blocks" and fused.block_kind == MIXED
    assert fused.split_sizes == [64, 16, 16]
    assert fused.memory_bytes == sum(lin.memory_bytes for lin in lins)
    ref = torch.cat([r for _, r in parts])
    assert torch.equal(fused.dequantize(), ref)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(0))
    y = fused.forward(x)
    assert torch.equal(y, torch.cat([lin.forward(x) for lin in lins], dim=1))
    assert rel(fused.dense_matmul(x), x @ ref.T) < 1e-6
    assert rel(fused.exact_matmul(x), x @ ref.T) < 1e-6
    assert "Q4_K" in repr(fused) and "Q6_K" in repr(fused)


# -- a whole model of a Q4_K_M file's mix -----------------------------------------------------
def write_kquant_qwen3(path: Path) -> Path:
    """A 2-layer Qwen3 GGUF (hidden 256: a super-block a row) in llama.cpp's Q4_K_M mix:
    Q4_K but for Q6_K v, down and output on layer 0, and a Q5_K down on layer 1 (Q5_K_M's)."""
    from gguf import GGMLQuantizationType as QT

    hidden, heads, kv_heads, head_dim, inter = 256, 4, 2, 64, 512
    tokens = [chr(c) for c in range(33, 127)] + ["Ġ", "hi", "Ġhi", "<|end|>"]
    writer = gguf.GGUFWriter(path, "qwen3")
    writer.add_block_count(2)
    writer.add_context_length(512)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 1) + [3])
    writer.add_token_merges(["h i", "Ġ hi"])
    writer.add_eos_token_id(len(tokens) - 1)
    gen = torch.Generator().manual_seed(0)

    def quant(name: str, kind: str, out: int, inp: int) -> None:
        raw = make_gguf_blocks(kind, out, inp, generator=gen).numpy()
        writer.add_tensor(name, raw, raw_dtype=QT[kind])

    def norm(name: str, size: int) -> None:
        writer.add_tensor(name, (1 + 0.1 * torch.randn(size, generator=gen)).numpy())

    quant("token_embd.weight", "Q4_K", len(tokens), hidden)
    quant("output.weight", "Q6_K", len(tokens), hidden)
    norm("output_norm.weight", hidden)
    for i, (v, down) in enumerate([("Q6_K", "Q6_K"), ("Q4_K", "Q5_K")]):
        norm(f"blk.{i}.attn_norm.weight", hidden)
        norm(f"blk.{i}.ffn_norm.weight", hidden)
        norm(f"blk.{i}.attn_q_norm.weight", head_dim)
        norm(f"blk.{i}.attn_k_norm.weight", head_dim)
        quant(f"blk.{i}.attn_q.weight", "Q4_K", heads * head_dim, hidden)
        quant(f"blk.{i}.attn_k.weight", "Q4_K", kv_heads * head_dim, hidden)
        quant(f"blk.{i}.attn_v.weight", v, kv_heads * head_dim, hidden)
        quant(f"blk.{i}.attn_output.weight", "Q4_K", hidden, heads * head_dim)
        quant(f"blk.{i}.ffn_gate.weight", "Q4_K", inter, hidden)
        quant(f"blk.{i}.ffn_up.weight", "Q4_K", inter, hidden)
        quant(f"blk.{i}.ffn_down.weight", down, hidden, inter)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_q4_k_m_model_decodes_on_the_blocks_as_its_float_weights_do(tmp_path, monkeypatch):
    from helexa.engine import LLM, SamplingParams
    from tests.engine.test_parity import _record_logits

    path = write_kquant_qwen3(tmp_path / "q4_k_m.gguf")
    prompts = [[5, 17, 30, 42, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    runs, models = {}, {}
    for how in ("float", "all layers", "each layer", "op by op"):
        kernels = "torch" if how == "float" else "auto"  # torch: K-quants widened to float
        if how == "each layer":
            monkeypatch.setattr(native, "stack_plan", lambda plans: None)
        if how == "op by op":
            monkeypatch.setattr(native, "layer_plan", lambda *a: None)
        try:
            llm = LLM(
                str(path), device="cpu", kv_cache_memory_mb=8, autotune=False, cpu_kernels=kernels
            )
            seen = _record_logits(llm)
            outs = llm.generate(prompts, params)
        finally:
            native.set_mode("auto")
        models[how] = llm.engine.runner.model
        runs[how] = [(o.token_ids, torch.stack(seen[o.request_id])) for o in outs]
    layer = models["all layers"].layers[0]
    assert layer.self_attn.qkv_proj.block_kind == MIXED  # Q4_K q/k with a Q6_K v
    assert layer.mlp.down_proj.block_kind == "Q6_Kx8"
    assert models["all layers"].layers[1].mlp.down_proj.block_kind == "Q5_Kx8"
    assert models["all layers"].__dict__.get("native_stack") is not None
    assert models["float"].layers[0].mlp.down_proj.format == "float"
    for other in ("each layer", "op by op"):  # the same kernels, in one call or op by op
        for (tokens_a, logits_a), (tokens_b, logits_b) in zip(
            runs["all layers"], runs[other], strict=True
        ):
            assert tokens_a == tokens_b
            assert torch.equal(logits_a, logits_b), other
    # prompt and decode steps alike within what int8 activations per 256 move the logits
    # (K-quant prompts run on the int8 kernel, as llama.cpp computes them)
    for (_, blocks_), (_, floats) in zip(runs["all layers"], runs["float"], strict=True):
        assert rel(blocks_[0], floats[0]) < 5e-2
        assert rel(blocks_[1], floats[1]) < 5e-2


def test_a_k_quant_prompts_logits_do_not_depend_on_its_chunking(tmp_path):
    from helexa.engine import LLM, SamplingParams
    from tests.engine.test_parity import _record_logits

    path = write_kquant_qwen3(tmp_path / "q4_k_m.gguf")
    prompt = [(7 * i) % 90 + 3 for i in range(37)]
    firsts = []
    for chunk in (None, 5):  # the whole prompt in one step, or in steps of 5 tokens
        llm = LLM(
            str(path), device="cpu", kv_cache_memory_mb=8, autotune=False, max_prefill_chunk=chunk
        )
        seen = _record_logits(llm)
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))[0]
        firsts.append(seen[out.request_id][0])
    assert rel(firsts[1], firsts[0]) < 1e-5


def test_the_prompt_gemm_unpacks_a_panel_of_rows_at_a_time(monkeypatch):
    from helexa.engine.layers import linear as linear_module

    monkeypatch.setattr(linear_module, "cache_bytes", lambda level: 4096)  # 8-row panels
    for kind in ("Q4_K", "Q6_K"):
        src, ref = source(kind, 44, 256)  # 5 panels of 8 and one of 4
        lin = Linear(256, 44)
        lin.load_weight(src, dtype=torch.float32)
        x = torch.randn(5, 256, generator=torch.Generator().manual_seed(0))
        assert rel(lin.dense_matmul(x), x @ ref.T) < 1e-6
