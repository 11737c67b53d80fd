"""Mixture of experts as Qwen3-MoE and Qwen3.5-MoE define it: a softmax router picks the
top-k experts of each token, each expert is a SwiGLU MLP, and Qwen3.5 adds an always-on
shared expert behind a sigmoid gate.

Experts run on their own tokens only. When every expert's weights are held as plain floats
they are stacked once into `w13` [E, 2I, H] and `w2` [E, H, I] and run through
`helexa.kernels.fused_moe` (Triton on CUDA; on CPU its naive twin, which sorts tokens by
expert and makes one matmul pair per expert that has any). Quantized experts (CPU int4/int8
from GGUF or an in-situ quant) stay per-expert `Linear`s and take the same sorted path, so a
quantization is never silently widened.

Tensor parallel splits every expert's intermediate size (not the experts across ranks):
each rank holds all E experts with I/N of their gate/up rows (column-parallel) and down
columns (row-parallel), so the router, the top-k and the fused kernels run unchanged on
every rank; the combined output (shared expert included) is this rank's partial sum, and
one all-reduce per layer completes it. The router and the shared expert's gate are
replicated. Expert parallelism would need a token all-to-all per layer and balanced
routing; this needs neither.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from helexa import kernels
from helexa.engine.layers.linear import Linear
from helexa.engine.parallel import all_reduce, tp
from helexa.kernels.quant_pack import QuantWeight, cat_rows

if TYPE_CHECKING:
    from helexa.engine.layers.linear import WeightSource

    # An expert: a SwiGLU MLP with gate_proj/up_proj (or fused gate_up_proj) and down_proj
    # Linears and fuse_projections(), as models/llama.py:MLP.
    MLP = nn.Module

# How a checkpoint may name stacked expert weights (HF fused layout, GGUF `*_exps`).
STACKED_NAMES = ("gate_up_proj", "gate_proj", "up_proj", "down_proj")


class Experts(nn.ModuleList):
    """E SwiGLU experts; `forward(x, weights, ids)` mixes each token's top-k of them."""

    def __init__(self, experts: list[MLP]) -> None:
        super().__init__(experts)
        self.num_experts = len(experts)
        self.w13: torch.Tensor | None = None  # [E, 2I, H] once stacked
        self.w2: torch.Tensor | None = None  # [E, H, I]
        self.qw13: QuantWeight | None = None  # [E*2I, H] quantized experts, once stacked
        self.qw2: QuantWeight | None = None  # [E*H, I]

    # -- loading -------------------------------------------------------------------
    def load_stacked(
        self, kind: str, src: WeightSource, *, dtype: torch.dtype, quant: str | None, dense: bool
    ) -> None:
        """Place a stacked tensor (`experts.gate_up_proj` [E, 2I, H] of HF's fused layout,
        or GGUF's `ffn_{gate,up,down}_exps` [E, out, in]) into the per-expert Linears."""
        if kind not in STACKED_NAMES:
            raise ValueError(f"unexpected stacked expert weight {kind!r}")
        parts = _split_experts(src, self.num_experts)
        for expert, w in zip(self, parts, strict=True):
            if kind == "gate_up_proj":
                gate, up = _split_rows(w)
                expert.gate_proj.load_weight(gate, dtype=dtype, quant=quant, dense_copy=dense)
                expert.up_proj.load_weight(up, dtype=dtype, quant=quant, dense_copy=dense)
            else:
                getattr(expert, kind).load_weight(w, dtype=dtype, quant=quant, dense_copy=dense)

    def fuse_projections(self) -> None:
        for expert in self:
            expert.fuse_projections()
        self._stack()

    def _stack(self) -> None:
        """Every expert's weights as one tensor per projection for the fused kernels: floats
        into w13/w2, GPU-quantized ones into qw13/qw2; CPU-packed experts stay per expert."""
        if self.w13 is not None or self.qw13 is not None:
            return
        linears = [lin for e in self for lin in _linears(e)]
        if all(lin.format == "quant" for lin in linears):
            self._stack_quantized()
            return
        if any(lin.format != "float" for lin in linears):
            return
        self.w13 = torch.stack([_gate_up(e) for e in self]).contiguous()
        self.w2 = torch.stack([e.down_proj.weight for e in self]).contiguous()
        for e in self:  # the stacked copies are the only ones kept
            for lin in _linears(e):
                lin.weight = None

    def _stack_quantized(self) -> None:
        """Every expert's fused gate/up rows, then every down_proj, as one QuantWeight each,
        when each set is of one kind (else the experts stay per-expert Linears)."""
        if not all(hasattr(e, "gate_up_proj") for e in self):
            return
        gate_up = [e.gate_up_proj.qweight for e in self]
        down = [e.down_proj.qweight for e in self]
        if len({w.kind for w in gate_up}) != 1 or len({w.kind for w in down}) != 1:
            return
        self.qw13, self.qw2 = cat_rows(gate_up), cat_rows(down)
        for e in self:  # the stacked copies are the only ones kept
            e.gate_up_proj.qweight = e.down_proj.qweight = None

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        for name in ("qw13", "qw2"):
            if (w := getattr(self, name)) is not None:
                setattr(self, name, w.map(fn))
        for name in ("w13", "w2"):
            if (t := getattr(self, name)) is not None:
                setattr(self, name, fn(t))
        out = super()._apply(fn, recurse)
        self._stack()  # packed CPU weights become float on an accelerator
        return out

    # -- running -------------------------------------------------------------------
    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        # x: [T, H]; weights, ids: [T, k] -> [T, H]
        if self.w13 is not None:
            return kernels.fused_moe(x, self.w13, self.w2, weights, ids)
        if self.qw13 is not None:
            return kernels.quant_fused_moe(x, self.qw13, self.qw2, weights, ids)
        return kernels.moe_by_expert(
            x, weights, ids, self.num_experts, lambda e, rows: self[e].forward(rows)
        )


class SparseMoE(nn.Module):
    """Router → top-k experts (+ a gated shared expert); a drop-in for the dense MLP."""

    def __init__(
        self,
        hidden_size: int,
        experts: list[MLP],
        *,
        top_k: int,
        norm_topk_prob: bool,
        shared_expert: MLP | None = None,
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = Linear(hidden_size, len(experts), False)  # the router
        self.experts = Experts(experts)
        if shared_expert is not None:
            self.shared_expert = shared_expert
            self.shared_expert_gate = Linear(hidden_size, 1, False)

    def fuse_projections(self) -> None:
        self.experts.fuse_projections()
        if hasattr(self, "shared_expert"):
            self.shared_expert.fuse_projections()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H]
        logits = self.gate.forward(x)  # [T, E]
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = probs.topk(self.top_k, dim=-1)  # [T, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = self.experts.forward(x, weights.to(x.dtype), ids)
        if hasattr(self, "shared_expert"):
            shared = self.shared_expert.forward(x)
            out = out + torch.sigmoid(self.shared_expert_gate.forward(x)) * shared
        return out


class TensorParallelMoE(SparseMoE):
    """SparseMoE over experts that each hold a slice of their intermediate size (built with
    `MLP(partial=True)`): the ranks' partial outputs are summed once, after the combine."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(SparseMoE.forward(self, x))


def sparse_moe(
    hidden_size: int,
    experts: list[MLP],
    *,
    top_k: int,
    norm_topk_prob: bool,
    shared_expert: MLP | None = None,
) -> SparseMoE:
    """A SparseMoE; under tensor parallel the one that all-reduces its partial output."""
    cls = TensorParallelMoE if tp().enabled else SparseMoE
    return cls(
        hidden_size,
        experts,
        top_k=top_k,
        norm_topk_prob=norm_topk_prob,
        shared_expert=shared_expert,
    )


def _linears(expert: MLP) -> list[Linear]:
    return [m for m in expert.modules() if isinstance(m, Linear)]


def _gate_up(expert: MLP) -> torch.Tensor:
    """[2I, H]: gate rows, then up rows (fused or not)."""
    if hasattr(expert, "gate_up_proj"):
        return expert.gate_up_proj.weight
    return torch.cat([expert.gate_proj.weight, expert.up_proj.weight])


def _split_experts(src: WeightSource, num_experts: int) -> list[WeightSource]:
    if isinstance(src, torch.Tensor):
        assert src.shape[0] == num_experts, (tuple(src.shape), num_experts)
        return list(src.unbind(0))
    from helexa.engine.loader.gguf import GGUFTensor  # only GGUF files hold these

    assert src.shape[0] == num_experts, (src.shape, num_experts)
    shape = src.shape[1:]
    data = src.data.reshape(num_experts, -1, src.data.shape[-1])
    return [
        GGUFTensor(name=f"{src.name}.{e}", qtype=src.qtype, shape=shape, data=data[e])
        for e in range(num_experts)
    ]


def _split_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    half = w.shape[0] // 2
    return w[:half], w[half:]
