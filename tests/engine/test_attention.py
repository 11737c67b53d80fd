"""The CPU's later-chunk attention: a cached prefix and the chunk itself attended apart and
merged by log-sum-exp, against one masked call over the whole context."""

import pytest
import torch
import torch.nn.functional as F

from helexa.engine.attention.sdpa import prefix_then_causal, split_prefix_attention
from tests.shared_fixtures import need_shared


def _masked(q, k, v, cached, scale):
    """The reference: every query sees the prefix and the chunk up to itself."""
    n, span = q.shape[2], k.shape[2]
    mask = torch.ones(n, span, dtype=torch.bool).tril(span - n)
    assert span - n == cached
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


@pytest.mark.skipif(not split_prefix_attention(torch.device("cpu")), reason="no CPU flash op")
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (9, 3)])
@pytest.mark.parametrize(("cached", "chunk"), [(1, 1), (1, 7), (37, 1), (64, 64), (200, 33)])
def test_prefix_then_causal_is_one_masked_call_over_the_context(heads, kv_heads, cached, chunk):
    g = torch.Generator().manual_seed(cached * 100 + chunk)
    d, scale = 32, 32**-0.5
    q = torch.randn(1, heads, chunk, d, generator=g) * 3  # sharp softmaxes too
    k = torch.randn(1, kv_heads, cached + chunk, d, generator=g)
    v = torch.randn(1, kv_heads, cached + chunk, d, generator=g)
    # non-contiguous like the layer's: [tokens, heads, d] transposed
    q, k, v = (t[0].transpose(0, 1).contiguous().transpose(0, 1)[None] for t in (q, k, v))
    got = prefix_then_causal(
        q, k[:, :, :cached], v[:, :, :cached], k[:, :, cached:], v[:, :, cached:], scale
    )
    want = _masked(q, k, v, cached, scale)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_only_the_cpu_attends_without_a_mask():
    assert not split_prefix_attention(torch.device("meta"))


def test_the_kv_cache_is_float16_on_the_cpu_under_a_float32_model_unless_asked_otherwise():
    from helexa import kernels
    from helexa.engine.engine_args import kv_dtype

    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # no CUDA needed: nothing allocated
    assert kv_dtype("auto", cpu, torch.float32) == torch.float16
    assert kv_dtype("auto", cpu, torch.bfloat16) == torch.bfloat16  # a half model's own
    assert kv_dtype("float32", cpu, torch.float32) == torch.float32
    assert kv_dtype("float16", cpu, torch.bfloat16) == torch.float16
    assert kv_dtype("auto", cuda, torch.bfloat16) == torch.bfloat16
    assert kv_dtype("float16", cuda, torch.float16) == torch.float16
    with pytest.raises(ValueError, match="model's dtype \\(bfloat16\\)"):
        kv_dtype("float16", cuda, torch.bfloat16)  # the Triton kernels read the model's dtype
    kernels.set_backend("triton")  # the same kernels on the CPU (TRITON_INTERPRET)
    try:
        assert kv_dtype("auto", cpu, torch.float32) == torch.float32
        with pytest.raises(ValueError, match="Triton"):
            kv_dtype("float16", cpu, torch.float32)
    finally:
        kernels.set_backend("auto")


def test_a_float16_cache_holds_twice_the_tokens_in_the_same_memory(tmp_path):
    from helexa.engine import LLM
    from tests.engine.tiny import make_tiny_model

    need_shared()
    model_dir, _ = make_tiny_model("smollm2", tmp_path)
    blocks = {}
    for setting in ("auto", "float32"):
        llm = LLM(str(model_dir), device="cpu", kv_cache_memory_mb=4, kv_cache_dtype=setting)
        cache = llm.engine.runner.model.layers[0].self_attn.attn.k_cache
        blocks[setting] = (cache.dtype, llm.engine.block_manager.num_blocks)
    assert blocks["auto"][0] == torch.float16 and blocks["float32"][0] == torch.float32
    assert blocks["auto"][1] == 2 * blocks["float32"][1]
