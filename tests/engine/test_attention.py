"""The CPU's later-chunk attention: a cached prefix and the chunk itself attended apart and
merged by log-sum-exp, against one masked call over the whole context."""

import pytest
import torch
import torch.nn.functional as F

from helexa.engine.layers.attention import prefix_then_causal, split_prefix_attention


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
