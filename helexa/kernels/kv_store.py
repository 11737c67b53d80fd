"""Writing the new tokens' K and V into the paged KV cache, by slot.

The cache of one layer is k_cache, v_cache [num_blocks, block_size, KVH, D]; slot s is row
s % block_size of block s // block_size. Token t's K/V go to slot slot_mapping[t]; a
negative slot marks a padding row, which writes nothing.

`naive_store_kv` is two `index_copy_` (and a cast where the cache's dtype differs);
`triton_store_kv` is one launch for K and V together, one program per token, that casts as
it stores. Neither reads a tensor on the host, so a CUDA graph can hold the Triton one.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is optional: the naive path serves CPU hosts
    triton = None


def _check(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor):
    if k.shape != v.shape or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k {tuple(k.shape)} / v {tuple(v.shape)} and k_cache {tuple(k_cache.shape)} / "
            f"v_cache {tuple(v_cache.shape)} must match in pairs"
        )
    if k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"k {tuple(k.shape)} does not fit k_cache {tuple(k_cache.shape)}")


def naive_store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """In place: k, v [T, KVH, D] into k_cache, v_cache [num_blocks, block_size, KVH, D] at
    slot_mapping [T] int (negative: skipped; that check reads the slots on the host)."""
    _check(k, v, k_cache, v_cache)
    if bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    kvh, d = k_cache.shape[2:]
    k_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


if triton is not None:

    @triton.jit
    def _store_kv_kernel(
        k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
        stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
        stride_kcb, stride_kct, stride_kch, stride_kcd,
        stride_vcb, stride_vct, stride_vch, stride_vcd,
        NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        """Grid (T,): token t's [KVH, D] of K and of V to its slot, cast to the caches'."""
        t = tl.program_id(0)
        slot = tl.load(slots_ptr + t).to(tl.int64)
        if slot < 0:
            return
        block, row = slot // BLOCK_SIZE, slot % BLOCK_SIZE
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
        h, d = offs_h[:, None], offs_d[None, :]
        k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d * stride_kd, mask=mask)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d * stride_vd, mask=mask)
        k_dst = k_cache_ptr + block * stride_kcb + row * stride_kct
        v_dst = v_cache_ptr + block * stride_vcb + row * stride_vct
        k_dst = k_dst + h * stride_kch + d * stride_kcd
        v_dst = v_dst + h * stride_vch + d * stride_vcd
        tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _launch_store_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    block_h = triton.next_power_of_2(num_kv_heads)
    block_d = triton.next_power_of_2(head_dim)
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        *k_cache.stride(), *v_cache.stride(),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4 if block_h * block_d >= 1024 else 1,
    )  # fmt: skip


def triton_store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """As naive_store_kv, in one Triton launch for K and V: k, v [T, KVH, D] (any strides);
    k_cache, v_cache [num_blocks, block_size, KVH, D]; slot_mapping [T] int (negative:
    skipped, on the device). CUDA-graph safe."""
    if triton is None:
        raise RuntimeError("triton_store_kv needs triton, which is not installed")
    _check(k, v, k_cache, v_cache)
    if k.shape[0]:
        _launch_store_kv(k, v, k_cache, v_cache, slot_mapping)
