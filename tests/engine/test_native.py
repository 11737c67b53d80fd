"""The native CPU block kernels (layers/native.py, native/blocks.c) against their naive twin,
the scalar build against the vector one, and what happens where they cannot be built."""

from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import torch

from helexa.engine import LLM, SamplingParams
from helexa.engine.layers import native
from helexa.engine.loader.gguf import GGUFTensor

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler here")
KINDS = ("Q4_0", "Q4_1", "Q8_0")


def blocks(kind: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(GGUF `kind` blocks of a random [n, k] weight, gguf's own dequantization of them)."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    qtype = gguf.GGMLQuantizationType[kind]
    raw = gguf.quants.quantize(w, qtype)
    ref = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(n, k).copy())
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8)).reshape(n, -1), ref


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_is_ggufs_arithmetic(kind):
    raw, ref = blocks(kind, 40, 96)
    assert torch.equal(native.dequantize(raw, kind, 40), ref)
    assert torch.equal(native.unpack(raw, kind, 40), ref)  # the C twin, bit for bit
    assert torch.equal(native.unpack_t(raw, kind, 40), ref.T)  # and transposed


@pytest.mark.parametrize("kind", KINDS)
# rows 1-9 cross the 4-row tiles; 37 outputs end mid-chunk (chunks of 16); 1056 = 33 blocks;
# 130 x 576 activations are quantized over threads
@pytest.mark.parametrize(
    ("m", "n", "k"), [(1, 37, 96), (3, 64, 1056), (4, 16, 32), (9, 37, 576), (130, 24, 576)]
)
def test_the_kernel_computes_its_naive_twin(kind, m, n, k):
    raw, ref = blocks(kind, n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n))
    x[0, :32] = 0  # an all-zero block of activations: scale 0, no division by it
    y = native.matmul(x, raw, kind, n)
    assert y.shape == (m, n) and y.dtype == torch.float32
    # the same function: int8 activations times the blocks, summed in float32
    assert rel(y, native.naive_matmul(x, raw, kind, n)) < 2e-6
    # and close to the float product: int8 activations cost ~0.5%
    assert rel(y, x @ ref.T) < 1.5e-2
    # the exact kernel (prompt steps): float32 activations on the file's exact weights
    assert rel(native.matmul(x, raw, kind, n, exact=True), x.double() @ ref.double().T) < 1e-6


@pytest.mark.parametrize("kind", KINDS)
def test_rows_in_8s_interleaved_are_the_same_bytes_and_the_same_products(kind):
    raw, ref = blocks(kind, 48, 576)
    x8, held = native.interleave(raw, kind)
    assert held == f"{kind}x8" and x8.shape == raw.shape
    assert torch.equal(x8.flatten().sort().values, raw.flatten().sort().values)  # reordered
    assert not torch.equal(x8, raw)
    back, back_kind = native.deinterleave(x8, held)
    assert back_kind == kind and torch.equal(back, raw)
    assert torch.equal(native.unpack(x8, held, 48), ref)
    assert torch.equal(native.unpack_t(x8, held, 48), ref.T)
    assert torch.equal(native.dequantize(x8, held, 48), ref)
    ids = torch.tensor([0, 47, 9, 9, 23])
    assert torch.equal(native.rows(x8, held, ids), ref[ids])
    for m in (1, 2, 3, 4, 5, 9):  # the 4-row tiles, whole and cut
        x = torch.randn(m, 576, generator=torch.Generator().manual_seed(m))
        x[0, :32] = 0
        y = native.matmul(x, x8, held, 48)
        assert rel(y, native.naive_matmul(x, raw, kind, 48)) < 2e-6
        assert rel(y, native.matmul(x, raw, kind, 48)) < 2e-6  # what the file's order gives
        exact = native.matmul(x, x8, held, 48, exact=True)
        assert rel(exact, x.double() @ ref.double().T) < 1e-6


@pytest.mark.parametrize("kind", [*KINDS, *native.K_KINDS])
def test_each_row_of_the_int8_kernel_is_what_it_gives_alone(kind):
    """Bit for bit, in both forms a weight is held in and over 1 and 2 threads: a row of x
    in a call of 2..12 rows (the 4-row tiles whole and cut) equals that row alone. A
    speculative step's check rows rely on it (linear.ROWS_ALONE): each is its one-row step."""
    from helexa.kernels.quant_pack import make_gguf_blocks

    n, k = 64, 1024
    if kind in native.K_KINDS:
        raw = make_gguf_blocks(kind, n, k, generator=torch.Generator().manual_seed(1))
    else:
        raw, _ = blocks(kind, n, k)
    forms = [(raw, kind)]
    if f"{kind}x8" in native.KINDS:
        forms.append(native.interleave(raw, kind))
    x = torch.randn(12, k, generator=torch.Generator().manual_seed(2))
    threads = torch.get_num_threads()
    try:
        for w, held in forms:
            for t in (1, 2):
                torch.set_num_threads(t)
                alone = torch.cat([native.matmul(x[i : i + 1], w, held, n) for i in range(12)])
                for m in range(2, 13):
                    assert torch.equal(native.matmul(x[:m], w, held, n), alone[:m]), (held, t, m)
    finally:
        torch.set_num_threads(threads)


def test_the_scalar_build_for_cpus_without_avx2_agrees(scalar):
    for kind in KINDS:
        raw, ref = blocks(kind, 40, 576)
        for w, held in ((raw, kind), native.interleave(raw, kind)):
            x = torch.randn(5, 576)
            a = native.matmul(x, w, held, 40, lib=scalar)
            assert rel(a, native.matmul(x, w, held, 40)) < 2e-6, held
            big = torch.randn(130, 576)  # quantized over threads, and by AVX2 in the other
            a = native.matmul(big, w, held, 40, lib=scalar)
            assert rel(a, native.matmul(big, w, held, 40)) < 2e-6, held
            a = native.matmul(x, w, held, 40, lib=scalar, exact=True)
            assert rel(a, native.matmul(x, w, held, 40, exact=True)) < 1e-6, held
            assert torch.equal(native.unpack(w, held, 40, lib=scalar), ref), held
            assert torch.equal(native.unpack_t(w, held, 40, lib=scalar), ref.T), held


def test_bad_shapes_are_refused_not_computed():
    raw, _ = blocks("Q4_1", 8, 64)
    with pytest.raises(RuntimeError, match="refused"):
        native.matmul(torch.randn(2, 48), raw, "Q4_1", 8)  # K not a multiple of 32
    raw, _ = blocks("Q4_1", 12, 64)
    with pytest.raises(RuntimeError, match="refused"):
        native.matmul(torch.randn(2, 64), raw, "Q4_1x8", 12)  # rows not in 8s


def test_without_a_compiler_the_weights_stay_on_torchs_kernel(monkeypatch, caplog):
    monkeypatch.setattr(native, "_compiler", lambda: None)
    native.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=native.__name__):
            assert not native.enabled()
        assert "no C compiler" in caplog.text
        from helexa.engine.layers.linear import Linear

        raw, _ = blocks("Q4_1", 64, 576)
        lin = Linear(576, 64)
        lin.load_weight(GGUFTensor("w", "Q4_1", (64, 576), raw), dtype=torch.float32)
        assert lin.format == "int4"  # torch's packed kernel, not float
    finally:
        native.library.cache_clear()


def test_the_bundled_model_runs_on_the_blocks_and_its_prompt_logits_are_transformers():
    from transformers import AutoModelForCausalLM

    from helexa.bench.engine import _gguf_without_accelerate
    from helexa.engine.loader.load import bundled_model_path
    from tests.engine.test_parity import record_model_logits

    llm = LLM(device="cpu", kv_cache_memory_mb=16)
    assert llm.engine.runner.kv_dtype == torch.float16  # the CPU's default cache
    model = llm.engine.runner.model
    assert model.layers[0].mlp.down_proj.format == "blocks"
    # the file's blocks, 8 rows side by side (native.interleave)
    assert model.layers[0].mlp.down_proj.block_kind == "Q4_1x8"
    assert model.lm_head.block_kind == "Q8_0x8"  # the tied table, shared with the embeddings
    assert model.embed_tokens.packed is model.lm_head
    seen = record_model_logits(model)
    # without "Answer in one word", "The" leads "L" by 0.08 in transformers' first logits:
    # int8 activations in the prompt step's logits once swapped them ("L'Étoile, la Cité…")
    question = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(question, SamplingParams(temperature=0, max_tokens=8))[0]
    assert out.text.startswith("The capital of France is Paris")
    path = bundled_model_path()
    with _gguf_without_accelerate():
        hf = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
    with torch.no_grad():
        ref = hf(torch.tensor([out.prompt_token_ids])).logits[0, -1]
    # the prompt step runs float32 on the file's exact weights, attending over K/V as the
    # float16 cache holds them: ~0.1% of the logits' scale off transformers' fp32 model
    assert (seen[out.request_id][0] - ref).abs().max().item() < 5e-2
    # and with a float32 cache, transformers' model itself
    exact = LLM(device="cpu", kv_cache_memory_mb=16, kv_cache_dtype="float32")
    assert exact.engine.runner.model.layers[0].self_attn.attn.k_cache.dtype == torch.float32
    seen = record_model_logits(exact.engine.runner.model)
    again = exact.chat(question, SamplingParams(temperature=0, max_tokens=8))[0]
    assert again.text.startswith("The capital of France is Paris")
    assert (seen[again.request_id][0] - ref).abs().max().item() < 1e-3


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])  # q/k norms; qkv bias
def test_native_decode_steps_give_the_torch_paths_logits(family, tmp_path, monkeypatch):
    from tests.engine.test_parity import _prompts, _record_logits
    from tests.engine.tiny import make_tiny_model
    from tests.shared_fixtures import need_shared

    need_shared()
    model_dir, hf = make_tiny_model(family, tmp_path)
    calls = {"decode_attention": 0, "qk_prepare": 0, "rms_norm": 0, "silu_mul": 0}
    for name in calls:
        real = getattr(native, name)

        def counting(*args, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*args, **kw)

        monkeypatch.setattr(native, name, counting)
    prompts = _prompts(hf.config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    runs = {}
    for mode in ("torch", "auto"):
        native.set_mode(mode)
        try:
            llm = LLM(
                str(model_dir),
                device="cpu",
                kv_cache_memory_mb=8,
                kv_cache_dtype="float32",  # K of the two paths may differ in the last bit,
                block_size=16,  # which a float16 cache can round a half-ulp apart
                max_prefill_chunk=24,
            )
            seen = _record_logits(llm)
            outs = llm.generate(prompts, params)
        finally:
            native.set_mode("auto")
        runs[mode] = [(o.token_ids, torch.stack(seen[o.request_id])) for o in outs]
    assert all(calls.values()), calls  # every native op ran in the "auto" run
    for (tokens_t, logits_t), (tokens_n, logits_n) in zip(runs["torch"], runs["auto"], strict=True):
        assert tokens_n == tokens_t
        assert (logits_n - logits_t).abs().max().item() < 1e-5


@pytest.mark.parametrize(
    ("family", "arch"), [("smollm2", "llama"), ("qwen2", "qwen2"), ("qwen3", "qwen3")]
)
def test_all_layers_or_one_layer_in_one_call_compute_what_the_layers_op_by_op_do(
    family, arch, tmp_path, monkeypatch
):
    # a Q8_0 GGUF of a tiny model of each family (qkv bias: qwen2; q/k norms: qwen3)
    from gguf import GGMLQuantizationType as QT

    from tests.engine.test_gguf_parity import write_gguf_from_hf
    from tests.engine.test_parity import _record_logits
    from tests.engine.tiny import make_tiny_model
    from tests.shared_fixtures import need_shared

    need_shared()
    _, hf = make_tiny_model(family, tmp_path, head_dim=16)
    add = gguf.GGUFWriter.add_tensor

    def quantized(self, name, tensor, raw_shape=None, raw_dtype=None):
        if tensor.ndim == 2 and tensor.shape[1] % 32 == 0 and "token_embd" not in name:
            return add(self, name, gguf.quants.quantize(tensor, QT.Q8_0), raw_dtype=QT.Q8_0)
        return add(self, name, tensor, raw_shape, raw_dtype)

    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", quantized)
    (tmp_path / "gguf").mkdir()
    path = write_gguf_from_hf(hf, arch, tmp_path / "gguf" / f"{family}.gguf")
    prompts = [[5, 17, 300, 42, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    runs, plans, stacks = [], [], []
    for how in ("all layers", "each layer", "op by op"):
        if how == "each layer":
            monkeypatch.setattr(native, "stack_plan", lambda plans: None)
        if how == "op by op":
            monkeypatch.setattr(native, "layer_plan", lambda *a: None)
        llm = LLM(str(path), device="cpu", kv_cache_memory_mb=8, autotune=False)
        seen = _record_logits(llm)
        outs = llm.generate(prompts, params)
        model = llm.engine.runner.model
        plans.append([layer.__dict__.get("native_plan") for layer in model.layers])
        stacks.append(model.__dict__.get("native_stack"))
        runs.append([(o.token_ids, torch.stack(seen[o.request_id])) for o in outs])
    assert all(p is not None for p in plans[0] + plans[1]) and not any(plans[2])
    assert stacks[0] is not None and stacks[1] is None and stacks[2] is None
    for other in runs[1:]:
        for (tokens_a, logits_a), (tokens_b, logits_b) in zip(runs[0], other, strict=True):
            assert tokens_a == tokens_b
            assert torch.equal(logits_a, logits_b)  # the same kernels in the same order


def _paged_decode_reference(q, k_cache, v_cache, tables, lens, scale):
    """Each row's context gathered token by token through its table, softmax in float64."""
    _, block_size, kvh, d = k_cache.shape
    group = q.shape[1] // kvh
    out = []
    for i, n in enumerate(lens.tolist()):
        table = tables[i].tolist()
        slots = [table[t // block_size] * block_size + t % block_size for t in range(n)]
        k = k_cache.view(-1, kvh, d)[slots].double().repeat_interleave(group, 1)  # [n, H, d]
        v = v_cache.view(-1, kvh, d)[slots].double().repeat_interleave(group, 1)
        p = (torch.einsum("hd,thd->ht", q[i].double(), k) * scale).softmax(-1)
        out.append(torch.einsum("ht,thd->hd", p, v))
    return torch.stack(out).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # the cache's
@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(9, 3, 64), (4, 4, 32), (8, 1, 36)])
@pytest.mark.parametrize("lens", [[1], [7], [200], [600, 1, 33, 17]])
def test_paged_decode_attention_is_softmax_over_each_rows_blocks(heads, kv_heads, d, lens, dtype):
    g = torch.Generator().manual_seed(len(lens) * 1000 + lens[0])
    block_size, num_blocks = 16, 64
    k_cache = torch.randn(num_blocks, block_size, kv_heads, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, d, generator=g).to(dtype)
    width = -(-max(lens) // block_size)
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:width] for _ in lens])
    q = torch.randn(len(lens), heads, d, generator=g) * 2
    lens_t = torch.tensor(lens, dtype=torch.int32)
    want = _paged_decode_reference(q, k_cache, v_cache, tables, lens_t, d**-0.5)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):  # the context split into spans for each thread count
            torch.set_num_threads(n)
            got = native.paged_decode(q, k_cache, v_cache, tables, lens_t, d**-0.5)
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # the cache's
def test_a_decode_rows_floats_do_not_depend_on_the_rows_beside_it(dtype):
    """Bit for bit: a row alone, in a batch of others, and as one of a sequence's check rows
    (several rows on one table, each a token longer: speculative decoding) gives the same
    output; its span split comes from its own length alone."""
    g = torch.Generator().manual_seed(5)
    block_size, num_blocks, heads, kvh, d = 16, 96, 9, 3, 64
    k_cache = torch.randn(num_blocks, block_size, kvh, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kvh, d, generator=g).to(dtype)
    table = torch.randperm(num_blocks, generator=g)[:40]
    lens = [300, 301, 302, 303, 304, 20, 611, 1]  # five check rows, then other sequences
    tables = torch.stack([table] * 5 + [torch.randperm(num_blocks, generator=g)[:40]] * 3)
    q = torch.randn(len(lens), heads, d, generator=g)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            batched = native.paged_decode(q, k_cache, v_cache, tables, lens_t, d**-0.5)
            for i in range(len(lens)):
                alone = native.paged_decode(
                    q[i : i + 1], k_cache, v_cache, tables[i : i + 1], lens_t[i : i + 1], d**-0.5
                )
                assert torch.equal(batched[i], alone[0]), (n, i)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("rows", [1, 5, 300])  # 300: rows split over threads
@pytest.mark.parametrize(("heads", "kv_heads", "d", "r"), [(9, 3, 64, 64), (4, 2, 32, 16)])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_prompt_qk_prepare_is_the_heads_norms_then_torchs_rotary(
    rows, heads, kv_heads, d, r, qk_norm
):
    from helexa import kernels
    from helexa.engine.layers.rotary import RotaryEmbedding

    g = torch.Generator().manual_seed(rows * 10 + d)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, generator=g)
    cos, sin = RotaryEmbedding(r, 4096, 10000.0).lookup(torch.randperm(4096)[:rows], torch.float32)
    norms = (torch.rand(d, generator=g) + 0.5, torch.rand(d, generator=g) + 0.5)
    q, k, v = qkv.view(rows, -1, d).split([heads, kv_heads, kv_heads], dim=1)
    if qk_norm:
        q, k = (kernels.naive_rms_norm(t, w, 1e-6) for t, w in zip((q, k), norms, strict=True))
    q, k = kernels.naive_rotary(q, k, cos, sin)  # each head's first r dims
    want = torch.cat((q, k, v), dim=1)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            got = qkv.clone()
            qk_norms = norms if qk_norm else (None, None)
            native.qk_prepare(got, heads, kv_heads, d, *qk_norms, 1e-6, cos, sin)
            torch.testing.assert_close(got.view(rows, -1, d), want, atol=1e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("rows", [1, 300])  # 300: rows split over threads
def test_rms_norm_with_and_without_a_residual_is_torchs(rows):
    from helexa import kernels

    g = torch.Generator().manual_seed(rows)
    x, res = torch.randn(2, rows, 576, generator=g)
    w = torch.rand(576, generator=g) + 0.5
    torch.testing.assert_close(native.rms_norm(x, w, 1e-5), kernels.naive_rms_norm(x, w, 1e-5))
    got, got_res = native.rms_norm(x, w, 1e-5, res)
    torch.testing.assert_close(got_res, x + res)
    torch.testing.assert_close(got, kernels.naive_rms_norm(x + res, w, 1e-5))


def test_paged_decode_of_the_scalar_build_agrees(scalar):
    g = torch.Generator().manual_seed(1)
    k_cache, v_cache = torch.randn(2, 8, 16, 2, 64, generator=g)
    tables = torch.arange(16).view(1, 16).repeat(2, 1)
    lens = torch.tensor([100, 3], dtype=torch.int32)
    q = torch.randn(2, 6, 64, generator=g)
    a = native.paged_decode(q, k_cache, v_cache, tables, lens, 0.125, lib=scalar)
    torch.testing.assert_close(a, native.paged_decode(q, k_cache, v_cache, tables, lens, 0.125))
    k_half, v_half = k_cache.half(), v_cache.half()  # a float16 cache, widened as it is read
    a = native.paged_decode(q, k_half, v_half, tables, lens, 0.125, lib=scalar)
    torch.testing.assert_close(a, native.paged_decode(q, k_half, v_half, tables, lens, 0.125))
    torch.testing.assert_close(
        a, native.paged_decode(q, k_half.float(), v_half.float(), tables, lens, 0.125)
    )


# floats whose rounding to half is an edge: signed zeros, subnormal halves and their ties
# (2^-25 rounds to 0, 3 x 2^-25 up to 2^-23), below the smallest subnormal, ties between
# normals (1 + 2^-11 to 1, 1 + 3 x 2^-11 to 1 + 2^-9), the largest half and past it (65519.99
# to 65504, 65520 and up to inf)
HALF_EDGES = [0.0, -0.0, 2**-24, 2**-25, 3 * 2**-25, -(2**-26), 1e-9, 6.1e-5, 2**-14, 1.0,
              1 + 2**-11, 1 + 3 * 2**-11, -(1 + 2**-10), 0.1, 65504.0, 65519.99, 65520.0,
              -70000.0, 1e30, float("inf"), -float("inf"), 3.14159, -2.5e-6]  # fmt: skip


def test_decode_writes_a_half_cache_rounded_as_torch_rounds(scalar):
    # K and V reach the cache as computed (no norms, no rotary): each stored half must be the
    # bits of torch's .half() of it, by F16C (8 lanes at a time) and by the scalar tail and
    # build (D = 36: four vectors and a tail of 4)
    h, kvh, d, m = 2, 1, 36, 3
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(m, (h + 2 * kvh) * d, generator=g) * 100
    edges = torch.tensor(HALF_EDGES)
    qkv[0, h * d : h * d + len(edges)] = edges  # into K
    qkv[1, (h + kvh) * d : (h + kvh) * d + len(edges)] = -edges  # into V
    no_rotary = torch.empty(m, 1, 0)
    slots = torch.tensor([5, 17, 30])
    tables = torch.tensor([[0, 1]]).repeat(m, 1)
    lens = torch.tensor([6, 18, 31], dtype=torch.int32)
    for lib in (None, scalar):
        k_cache, v_cache = torch.zeros(2, 2, 16, kvh, d, dtype=torch.float16)
        native.decode_attention(
            qkv.clone(), h, kvh, d, None, None, 0.0, no_rotary, no_rotary, slots,
            k_cache, v_cache, tables, lens, d**-0.5, lib=lib,
        )  # fmt: skip
        k_new, v_new = qkv.view(m, h + 2 * kvh, d)[:, h:].split([kvh, kvh], dim=1)
        for cache, new in ((k_cache, k_new), (v_cache, v_new)):
            held = cache.view(-1, kvh, d)[slots]
            assert torch.equal(held.view(torch.int16), new.half().view(torch.int16)), lib


def test_argmax_and_finiteness_are_torchs(scalar):
    g = torch.Generator().manual_seed(0)
    for n in (1, 7, 8, 49152, 49155):
        x = torch.randn(6, n, generator=g)
        x[1, n // 2] = x[1].max() + 1  # a lone max mid-row
        x[2, :] = 3.0  # ties: the first index
        x[3, n - 1] = float("inf")
        x[4, n // 3] = float("nan")  # the first NaN is the argmax, the row not finite
        x[5, 0] = float("-inf")
        want = (x.argmax(-1), x.isfinite().all(-1))
        for lib in (None, scalar):
            idx, finite = native.argmax_finite(x, lib=lib)
            assert torch.equal(idx, want[0]), (n, idx, want[0])
            assert torch.equal(finite, want[1]), (n, finite, want[1])
