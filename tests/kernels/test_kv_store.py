"""Storing new K/V into the paged cache: the Triton launch against its naive twin."""

from __future__ import annotations

import pytest
import torch

import helexa.kernels as kernels
from helexa.kernels.kv_store import naive_store_kv, triton_store_kv

from . import DEVICE, needs_triton


@pytest.fixture(autouse=True)
def restore_backend():
    yield
    kernels.set_backend("auto")


def _inputs(num_tokens, kv_heads, head_dim, block_size, dtype, seed=0, kv_dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = -(-num_tokens // block_size) + 3
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(*shape, generator=gen).to(DEVICE, dtype)
    v_cache = torch.randn(*shape, generator=gen).to(DEVICE, dtype)
    # k, v as a layer has them: views into one qkv row of several heads
    qkv = torch.randn(num_tokens, 3 * kv_heads, head_dim, generator=gen).to(DEVICE, kv_dtype)
    k, v = qkv[:, kv_heads : 2 * kv_heads], qkv[:, 2 * kv_heads :]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    return k, v, k_cache, v_cache, slots.to(DEVICE)


def test_naive_store_writes_each_token_to_its_slot_and_casts_to_the_cache():
    k, v, k_cache, v_cache, slots = _inputs(7, 2, 8, 4, torch.float16)
    naive_store_kv(k, v, k_cache, v_cache, slots)
    for t, s in enumerate(slots.tolist()):
        assert torch.equal(k_cache[s // 4, s % 4], k[t].half())
        assert torch.equal(v_cache[s // 4, s % 4], v[t].half())


def test_a_negative_slot_is_padding_and_writes_nothing():
    k, v, k_cache, v_cache, slots = _inputs(5, 2, 8, 4, torch.float32)
    slots[[1, 3]] = -1
    before_k, before_v = k_cache.clone(), v_cache.clone()
    naive_store_kv(k, v, k_cache, v_cache, slots)
    k_rows = (k_cache != before_k).flatten(2).any(-1)  # [num_blocks, block_size]
    v_rows = (v_cache != before_v).flatten(2).any(-1)
    assert torch.equal(k_rows, v_rows)
    assert sorted((k_rows.flatten().nonzero()[:, 0]).tolist()) == sorted(slots[[0, 2, 4]].tolist())


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_tokens", "kv_heads", "head_dim", "block_size"), [(1, 1, 16, 8), (63, 3, 60, 16)]
)
def test_triton_store_matches_naive(num_tokens, kv_heads, head_dim, block_size, dtype):
    # K/V in the cache's dtype, as the engine has them on the Triton path
    shape = (num_tokens, kv_heads, head_dim, block_size)
    k, v, k_cache, v_cache, slots = _inputs(*shape, dtype, kv_dtype=dtype)
    slots[num_tokens // 2] = -1  # a padding row in the middle
    want_k, want_v = k_cache.clone(), v_cache.clone()
    naive_store_kv(k, v, want_k, want_v, slots)
    triton_store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@needs_triton
def test_the_dispatcher_takes_the_triton_store_when_asked():
    k, v, k_cache, v_cache, slots = _inputs(9, 2, 32, 8, torch.float32, seed=1)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    naive_store_kv(k, v, want_k, want_v, slots)
    kernels.set_backend("triton")
    kernels.store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
