"""Reading torch's CPU int4 packing back (layers/int4_cpu.py): every row count it packs reads
back exactly, whatever the ISA's layout, so a tensor-parallel shard of an int4 weight holds the
rows of the whole one and computes them alike. tests/engine/test_cpu_isas.py runs this file
under each of torch's CPU capabilities this machine has."""

from __future__ import annotations

import pytest
import torch

from helexa.engine import parallel
from helexa.engine.layers import int4_cpu
from helexa.engine.layers.linear import Linear, column_parallel
from helexa.engine.parallel import TensorParallel

pytestmark = pytest.mark.skipif(
    not hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"), reason="torch < 2.6"
)
# What torch's int4mm_kernel.cpp packs with: BLOCK_N is four float vectors; full blocks pair
# row j with j + BLOCK_N / 2 where the kernels are vectorized, the scalar ones pair neighbours.
TORCH_LAYOUTS = {
    "AVX512": int4_cpu.Layout(64, halves=True),
    "AVX2": int4_cpu.Layout(32, halves=True),
    "DEFAULT": int4_cpu.Layout(32, halves=False),
}
# row counts the packing takes (multiples of 16): whole blocks, short last blocks, and both
ROW_COUNTS = (16, 32, 48, 64, 80, 96, 112, 176, 1040)


def packed_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [n, k] of 0..15, its packing, bf16 (scale, zero) pairs [k / 32, n, 2])."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen)
    scales = (torch.rand(k // 32, n, 2, generator=gen) - 0.5).to(torch.bfloat16)
    return q, torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2), scales


def naive_weights(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """w = (q - 8) * scale + zero, one weight at a time's arithmetic: float32 [n, k]."""
    pairs = scales.float().repeat_interleave(32, dim=0).transpose(0, 1)  # [n, k, 2]
    return (q.float() - 8) * pairs[..., 0] + pairs[..., 1]


def test_the_probe_finds_the_layout_torch_packs_with_on_this_cpu():
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in TORCH_LAYOUTS:
        pytest.skip(f"torch's CPU capability {capability} packs in a layout not listed here")
    assert int4_cpu.layout() == TORCH_LAYOUTS[capability]


@pytest.mark.parametrize("n", ROW_COUNTS)
def test_every_row_count_the_packing_takes_reads_back_exactly(n):
    q, packed, scales = packed_weight(n, 96, seed=n)
    ref = naive_weights(q, scales)
    assert torch.equal(int4_cpu.dequantize(packed, scales, n, 1), ref)
    ids = torch.tensor([0, n - 1, n // 2, 15, 15, n - 16])
    assert torch.equal(int4_cpu.rows(packed, scales, ids, n, 1), ref[ids])


@pytest.mark.parametrize("n", [64, 96, 128, 192])  # shards of 32, 48, 64 and 96 rows
def test_a_shard_holds_and_computes_the_rows_of_the_whole_int4_weight(n, monkeypatch):
    w = torch.randn(n, 128, generator=torch.Generator().manual_seed(n))
    whole = Linear(128, n)
    whole.load_weight(w, dtype=torch.float32, quant="int4")
    monkeypatch.setattr(parallel, "_TP", TensorParallel(1, 2))
    shard = column_parallel(128, n)
    shard.load_weight(w, dtype=torch.float32, quant="int4")
    half = n // 2
    assert shard.format == "int4" and shard.can_read_rows() and whole.can_read_rows()
    assert torch.equal(shard.dequantize(), whole.dequantize()[half:])
    ids = torch.tensor([0, 5, half - 1])
    assert torch.equal(shard.rows(ids), whole.rows(ids + half))
    # the kernel's arithmetic per output does not depend on the block it sits in
    for m in (1, 3, 4, 9):
        x = torch.randn(m, 128, generator=torch.Generator().manual_seed(m)).bfloat16()
        assert torch.equal(shard.packed_matmul(x), whole.packed_matmul(x)[:, half:])
