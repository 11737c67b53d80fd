"""Linear layers whose weights may arrive as float tensors or as GGUF quantized blocks.

On CPU the weights stay quantized:

- GGUF Q4_0 / Q4_1 / Q8_0 → held as the file's blocks (format "blocks") and run by the native
  kernels (`layers/native.py`: C built at first use, activations quantized to int8 per block
  of 32 as llama.cpp does), wherever a C compiler builds them; else as below.
- GGUF Q4_K / Q5_K / Q6_K → held as the file's super-blocks too, run by the native K-quant
  kernels (native/kquants.c: activations quantized to int8 per 256). A fused projection
  whose parts are held as different kinds (a Q4_K_M file's Q4_K q/k beside its Q6_K v) keeps
  each part's blocks as they are, one after the other (`block_kind` MIXED, `block_parts`).
  Without a C compiler they are dequantized to float (logged at load).
- GGUF Q4_0 / Q4_1, and quant="int4" → `_weight_int4pack_mm_for_cpu`, groups of 32 along the
  input. A GGUF block is one group: the kernel computes w = (q - 8) * scale + zero, so Q4_1's
  w = d*q + m is scale = d, zero = m + 8d, and Q4_0's w = d*(q - 8) is scale = d, zero = 0.
- GGUF Q8_0 → two int4 groups per block along a doubled input (`_q8_0_as_int4`): exact apart
  from the scale rounding below, at 1.25 bytes a weight.
- quant="int8" → `_weight_int8pack_mm`, one symmetric scale per output channel. On a Q8_0
  tensor this requantizes (~1% rms error on SmolLM2's embeddings), so it is opt-in.

On an accelerator (the source tensors already there) the weights stay quantized too, as a
`kernels.QuantWeight` run through `kernels.quant_matmul` (Triton dequantize-GEMV/GEMM on
CUDA): GGUF Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K as they are, and quant="int8", "int4" or
"fp8" made at load. A quantization with no kernel there raises UnsupportedQuantError (a 422
at load); nothing is widened to float behind the caller's back.

Both CPU kernels are vectorized only for bfloat16 (float32 takes a scalar loop 20-40x slower than
a float32 F.linear), so scales are held in bf16 and activations are cast to bf16 around the
call. Rounding the f16 block scales to bf16 costs ~0.2% rms on the weights: the same as
storing them in bf16. On the CPU everything else (other qtypes, shapes the kernels reject) is
dequantized to `dtype` and runs through F.linear.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextvars import ContextVar
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from helexa import kernels
from helexa.engine.layers import int4_cpu, native
from helexa.engine.layers.autotune import WHOLE, Plan, cache_bytes
from helexa.engine.loader.gguf_shard import take_shard
from helexa.engine.parallel import Shard, all_gather_last, all_reduce, shard_range, tp, vocab_range
from helexa.kernels.quant_pack import GGUF_KINDS, QuantWeight, cat_rows, naive_dequantize

if TYPE_CHECKING:
    from helexa.engine.loader.gguf import GGUFTensor

    # A checkpoint tensor as the loaders hand it over: torch, or GGUF still quantized.
    WeightSource = torch.Tensor | GGUFTensor

QUANTS = (None, "int8", "int4", "fp8")
FLOAT_QTYPES = ("F32", "F16", "BF16")  # GGUF tensors that are plain floats
GROUP = int4_cpu.GROUP  # int4 group along in_features: one GGUF Q4_0/Q4_1/Q8_0 block
# rows of the CPU int4 packing's widest block (AVX-512; int4_cpu): packings of whole blocks
# concatenate, so fuse takes parts of multiples of it (but the last)
PACK_BLOCK_N = 64
PACKED_DTYPE = torch.bfloat16  # the only activation dtype the CPU packed kernels vectorize
# float32, not bfloat16: a whole prefill in bf16 (weights and activations rounded) turns
# SmolLM2's greedy "The capital of France is Paris." into "L'Étoile, ...". f32 costs ~45%
# more TTFT than bf16 and 4 bytes a weight, and stays right.
DENSE_DTYPE = torch.float32
# Set by the model runner for steps that carry prompt tokens: they run in float32 (the
# dense copy, else the weight unpacked for the call) whatever their row count. Through the
# bf16 kernel, SmolLM2's prompt "What is the capital of France?" got "L'Étoile, la
# Marseillaise…" instead of "Paris"; and a prompt's logits then do not depend on how much
# of it came from the prefix cache (a cold 123-token prefill and an 11-token cached one agree).
PREFILL_STEP: ContextVar[bool] = ContextVar("PREFILL_STEP", default=False)
# Set by the model runner for steps in which a sequence checks a draft (speculative
# decoding): every call then runs as a call of one row would, so that each check row's floats
# are those of the one-row decode step it stands for. The packed kernels compute each row
# alone (tests/engine/test_native.py); a dense plan then runs one row a call. The plans of
# more rows are this machine's timings: where a busy CI machine timed a float32 GEMM quicker
# for 5 rows than the int8 kernel, SmolLM2's code edit parted from its answer without
# speculation at the 35th token.
ROWS_ALONE: ContextVar[bool] = ContextVar("ROWS_ALONE", default=False)
# block_kind of a Linear fused from parts held as different GGUF kinds (`Linear.block_parts`)
MIXED = "mixed"
_HAS_INT4 = hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")  # torch >= 2.6
# Prompt-step calls of up to this many rows on GGUF blocks (a short chunk, the logits of the
# prompt's last token) take the native float32 kernel, which reads the blocks as they are,
# rather than unpacking the whole weight for a GEMM: until the autotune has measured where
# the GEMM starts to pay on this machine (Linear.exact_rows).
EXACT_ROWS = 8


def planned_rows(rows: int) -> int:
    """The row count whose plan a call of `rows` rows takes: 1 in a ROWS_ALONE step."""
    return 1 if ROWS_ALONE.get() else rows


def kernel_layout(device: torch.device) -> bool:
    """Whether weights on `device` are held for helexa.kernels (QuantWeight, quant_matmul)
    rather than for torch's CPU packed kernels: on every accelerator."""
    return device.type != "cpu"


class UnsupportedQuantError(ValueError):
    """A weight's quantization cannot run on the device it is loaded to (a 422 at load):
    it is refused rather than silently widened to float."""

    def __init__(self, message: str, suggestion: str | None = None) -> None:
        super().__init__(message)
        self.suggestion = suggestion


class Linear(nn.Module):
    """y = x @ W.T (+ b). W is [out_features, in_features] like torch/HF.

    `format` says how W is held: "float" (`weight` in the load dtype), "int8" (`weight` int8
    [out, in], `scales` [out]), "int4" (`weight` packed uint8, `scales` [in/32, out, 2] of
    (scale, zero)) or "blocks" (`weight` uint8 [out, in/32 * block bytes], the GGUF blocks of
    `block_kind`, run by the native kernels) on the CPU, or "quant" (`qweight`, a
    kernels.QuantWeight) on an accelerator. A Linear made by `fuse` computes several;
    `split_sizes` cuts its output.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.has_bias = bias
        self.format = "float"
        self.dtype = torch.float32  # activation dtype asked for at load
        self.k_repeat = 1  # int4 from Q8_0 reads the input twice (high then low nibbles)
        self.block_kind: str | None = None  # format "blocks": Q4_0, Q4_1, Q8_0 (+"x8"), K kinds
        # block_kind MIXED: (kind, rows) of each part, whose blocks lie one after the other in
        # the 1-D `weight`, each part's rows as a Linear of its own kind holds them
        self.block_parts: tuple[tuple[str, int], ...] = ()
        self.split_sizes = [out_features]
        # plain attributes, not buffers: buffer lookups cost ~0.6 µs a call; _apply moves them
        self.weight: torch.Tensor | None = None
        self.scales: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        # Optional f32 copy of a packed weight for calls with many rows (prefill, wide
        # decode batches), where a dense GEMM beats the int4 kernel (2x at 128 rows).
        self.dense: torch.Tensor | None = None
        self.qweight: QuantWeight | None = None  # format "quant"
        # CPU-packed formats: how a call of r rows runs (index r, the last for more rows),
        # chosen by measurement at load (layers/autotune.py); None: the kernel on all rows
        self.plans: list[Plan] | None = None
        # format "blocks": prompt-step calls of up to this many rows take the exact float32
        # kernel, more the GEMM on the unpacked weight (measured at load, see EXACT_ROWS)
        self.exact_rows = EXACT_ROWS
        # Tensor parallel: the rows (column-parallel) or columns (row-parallel) of the
        # checkpoint's weight this rank holds; in/out_features are then the local sizes.
        self.shard: Shard | None = None

    # -- loading -------------------------------------------------------------------
    def load_weight(
        self,
        src: torch.Tensor | GGUFTensor,
        *,
        dtype: torch.dtype,
        quant: str | None = None,
        dense_copy: bool = False,
    ) -> None:
        """Take the weight from a float tensor or a GGUF tensor, kept quantized where it pays.

        `dtype` is the activation dtype (and the float weights' dtype); `quant` asks for int8
        or int4 where the source is not already 4-bit: Q4_0/Q4_1 blocks always stay int4.
        """
        if hasattr(src, "load_into"):  # a pre-quantized checkpoint's (loader/prequant.py)
            src.load_into(self, dtype=dtype, dense_copy=dense_copy)  # its own quant, not `quant`
            return
        if quant not in QUANTS:
            raise ValueError(f"unknown quant {quant!r}; supported: {list(QUANTS)}")
        shape = (self.out_features, self.in_features)
        if self.shard is not None:  # this rank's part, then held (quantized) as any weight
            full = self.shard.full_shape(shape)
            assert tuple(src.shape) == full, f"weight shape {tuple(src.shape)} != {full}"
            src = take_shard(self.shard, src)  # GGUF: its whole blocks, still quantized
        assert tuple(src.shape) == shape, f"weight shape {tuple(src.shape)} != {shape}"
        self.dtype = dtype
        raw = src if isinstance(src, torch.Tensor) else src.data
        qtype = "float" if isinstance(src, torch.Tensor) else src.qtype
        if kernel_layout(raw.device):
            self._load_on_device(src, raw, qtype, dtype, quant)
            return
        if quant == "fp8":
            raise UnsupportedQuantError(
                "quant 'fp8' runs on CUDA only; this model is loading on the CPU",
                "on the CPU use quant 'int8' or 'int4'",
            )
        as_blocks = qtype in ("Q4_0", "Q4_1") or (qtype == "Q8_0" and quant is None)
        kernel = "int4" if as_blocks else quant  # GGUF blocks map onto int4 groups as they are
        native_ok = as_blocks and native.enabled() and self.in_features % native.QK == 0
        # K-quants run on the native kernels only (no torch kernel takes 6-bit sub-scales)
        native_ok |= qtype in native.K_KINDS and quant is None and native.enabled()
        if native_ok and raw.device.type == "cpu":
            self._set_blocks(raw, qtype)
        elif kernel is None or raw.device.type != "cpu" or not self._can_pack(kernel):
            self._set_float(as_dense(src), dtype)
        elif qtype in ("Q4_0", "Q4_1"):
            self._set_int4(*_q4_as_int4(raw, qtype, shape))
        elif qtype == "Q8_0" and quant is None:
            self._set_int4(*_q8_0_as_int4(raw, shape), k_repeat=2)
        elif kernel == "int8":
            self._set_int8(*_quantize_int8(as_dense(src)))
        else:
            self._set_int4(*_quantize_int4(as_dense(src)))
        if dense_copy and self.format != "float":
            self.dense = as_dense(src).to(DENSE_DTYPE).contiguous()

    def _load_on_device(
        self,
        src: torch.Tensor | GGUFTensor,
        raw: torch.Tensor,
        qtype: str,
        dtype: torch.dtype,
        quant: str | None,
    ) -> None:
        """Hold the weight quantized on the accelerator it came to, or as float if it is one
        (a GGUF file's quantized tensors keep their own quant; `quant` applies to floats)."""
        is_float = qtype == "float" or qtype in FLOAT_QTYPES
        if is_float and quant is None:
            self._set_float(as_dense(src), dtype)
            return
        kind = quant if is_float else qtype
        name = getattr(src, "name", None) or "a weight"
        shape = (self.out_features, self.in_features)
        if not is_float and kind not in GGUF_KINDS:
            raise UnsupportedQuantError(
                f"{name}: GGUF {kind} has no kernel on {raw.device.type}; quantized weights "
                f"run there as {', '.join(GGUF_KINDS)}",
                "load a file of another quantization (e.g. Q4_K_M or Q8_0), or on the CPU",
            )
        reason = kernels.check_shape(kind, shape) or kernels.unsupported_reason(kind, raw.device)
        if reason is not None:
            raise UnsupportedQuantError(f"{name} {list(shape)} as {kind}: {reason}")
        if is_float:
            qw = kernels.quantize(as_dense(src), kind)
        else:
            qw = kernels.pack_gguf(raw, kind, shape)
        self.format, self.k_repeat = "quant", 1
        self.weight, self.scales, self.dense, self.qweight = None, None, None, qw

    def load_bias(self, b: torch.Tensor, *, dtype: torch.dtype) -> None:
        if self.shard is not None and self.shard.dim == 0:
            b = self.shard.take(b)
        elif self.shard is not None and tp().rank != 0:
            return  # row-parallel: the ranks' outputs are summed, so rank 0 alone adds it
        assert tuple(b.shape) == (self.out_features,), f"bias shape {tuple(b.shape)}"
        self.bias = b.to(dtype).contiguous()

    def sharded(self, shard: Shard) -> Linear:
        """Hold only `shard` of the checkpoint's weight: rows (dim 0) or columns (dim 1)."""
        self.shard = shard
        if shard.dim == 0:
            self.out_features = shard.size
            self.split_sizes = [shard.size]
        else:
            self.in_features = shard.size
        return self

    def _can_pack(self, kernel: str) -> bool:
        # int8pack_mm crashes or miscomputes when in_features is not a multiple of 16
        if self.in_features % GROUP:
            return False
        return kernel == "int8" or (_HAS_INT4 and self.out_features % 16 == 0)

    def _set_float(self, w: torch.Tensor, dtype: torch.dtype) -> None:
        self.format, self.k_repeat, self.scales, self.block_kind = "float", 1, None, None
        self.weight = w.to(dtype).contiguous()

    def _set_int8(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        # q: int8 [out, in]; scale: [out]
        self.format, self.k_repeat, self.block_kind = "int8", 1, None
        self.weight, self.scales = q.contiguous(), scale.to(PACKED_DTYPE).contiguous()

    def _set_blocks(self, raw: torch.Tensor, kind: str) -> None:
        # the file's bytes, a row of blocks per output feature; rows in 8s of the 32-weight
        # kinds are held interleaved (native.interleave: the kernel's "x8" kinds), the same
        # bytes reordered
        self.format, self.k_repeat, self.block_kind, self.scales = "blocks", 1, kind, None
        self.block_parts = ()
        self.weight = raw.reshape(self.out_features, -1).contiguous()
        if self.out_features % native.XR == 0 and f"{kind}x8" in native.KINDS:
            self.weight, self.block_kind = native.interleave(self.weight, kind)

    def _set_int4(
        self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, k_repeat: int = 1
    ) -> None:
        # q: [out, k] of 0..15; scale, zero: [out, k / 32], with w = (q - 8) * scale + zero
        self.format, self.k_repeat, self.block_kind = "int4", k_repeat, None
        # innerKTiles (2) only matters to the CUDA layout
        self.weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2)
        self.scales = torch.stack([scale.t(), zero.t()], dim=-1).to(PACKED_DTYPE).contiguous()

    # -- running -------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features] -> [..., out_features], in x's dtype
        if self.format == "float":
            w = self.weight
            if x.dtype == w.dtype:
                return F.linear(x, w, self.bias)
            return F.linear(x.to(w.dtype), w, self.bias).to(x.dtype)
        if self.format == "quant":
            h = x.reshape(-1, self.in_features)
            if h.dtype != self.dtype:
                h = h.to(self.dtype)
            y = kernels.quant_matmul(h, self.qweight, self.bias)
            return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        if x.dim() != 2:  # Linear's own forward: a subclass's collective runs once, outside
            y = Linear.forward(self, x.reshape(-1, self.in_features))
            return y.reshape(*x.shape[:-1], self.out_features)
        # decode calls this ~200 times a token: every skipped no-op counts
        rows, plans, exact = x.shape[0], self.plans, False
        if PREFILL_STEP.get() and self.kquant_prompts:  # see kquant_prompts
            dense, chunk = False, 0
        elif PREFILL_STEP.get():  # prompts in float32 whatever their size (see PREFILL_STEP)
            exact = self.format == "blocks" and rows <= self.exact_rows  # no weight unpacked
            dense, chunk = not exact, 0
        elif plans is None:
            dense, chunk = WHOLE
        elif ROWS_ALONE.get():  # see ROWS_ALONE
            dense = plans[1][0]
            chunk = 1 if dense else 0
        else:
            dense, chunk = plans[rows] if rows < len(plans) else plans[-1]
        if dense:
            h, run = x.to(DENSE_DTYPE), self.dense_matmul
        else:
            h = self.packed_input(x)
            run = self.exact_matmul if exact else self.packed_matmul
        if chunk and rows > chunk:  # smaller calls do better on this machine
            y = torch.cat([run(part) for part in h.split(chunk)])
        else:
            y = run(h)
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias

    def dense_matmul(self, h: torch.Tensor) -> torch.Tensor:
        """A float32 GEMM on h: [rows, in_features] float32, with the dense copy where one is
        kept, else with the weight dequantized for this call (it pays on wide calls): GGUF
        blocks unpacked transposed, [in, out], which the GEMM reads faster than [out, in]."""
        if self.dense is None and self.format == "blocks":
            parts = [_panels_mm(h, w, kind, rows) for kind, w, rows in self.block_views()]
            return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        return F.linear(h, self.dense if self.dense is not None else self.dequantize())

    @property
    def kquant_prompts(self) -> bool:
        """Whether prompt steps take the int8 kernel, as decode steps do: GGUF K-quant blocks
        (every part of them), whose activations llama.cpp too quantizes per 256 in prompts.
        A float32 GEMM cannot keep up there: an 8B's 128-token prompt took 31 s through it
        on 2 cores, llama.cpp 3.9 s; the int8 kernel multiplies a 12288 x 4096 Q4_K weight
        by 128 rows in 35 ms, the GEMM in ~60 (a Q4_0/Q4_1/Q8_0 prompt stays float32:
        SmolLM2 in Q4_1 needs it). Every row count alike, so a prompt's logits do not depend
        on how it was chunked or how much of it came from the prefix cache."""
        return self.format == "blocks" and all(
            kind.removesuffix("x8") in native.K_KINDS for kind, _, _ in self.block_views()
        )

    def block_views(self) -> list[tuple[str, torch.Tensor, int]]:
        """A "blocks" weight as (kind, blocks [rows, row bytes], rows) per part: itself, or
        each part of a MIXED one, in the order of the outputs."""
        if self.block_kind != MIXED:
            return [(self.block_kind, self.weight, self.out_features)]
        views, at = [], 0
        for kind, rows in self.block_parts:
            row_bytes = self.in_features // native.BLOCK_WEIGHTS[kind] * native.BLOCK_BYTES[kind]
            views.append(
                (kind, self.weight[at : at + rows * row_bytes].view(rows, row_bytes), rows)
            )
            at += rows * row_bytes
        return views

    def _blocks_matmul(self, h: torch.Tensor, *, exact: bool) -> torch.Tensor:
        parts = [
            native.matmul(h, w, kind, rows, exact=exact) for kind, w, rows in self.block_views()
        ]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def packed_input(self, x: torch.Tensor) -> torch.Tensor:
        """x as the packed kernel takes it: float32 for the native kernels, else in the
        scales' dtype (bf16); contiguous."""
        dtype = torch.float32 if self.format == "blocks" else self.scales.dtype
        return (x if x.dtype == dtype else x.to(dtype)).contiguous()

    def exact_matmul(self, h: torch.Tensor) -> torch.Tensor:
        """Float32 h on the exact weights of GGUF blocks, without unpacking them."""
        return self._blocks_matmul(h, exact=True)

    def packed_matmul(self, h: torch.Tensor) -> torch.Tensor:
        """The packed kernel on h: [rows, in_features] as `packed_input` makes it."""
        if self.format == "blocks":
            return self._blocks_matmul(h, exact=False)
        if self.format == "int8":
            return torch.ops.aten._weight_int8pack_mm(h, self.weight, self.scales)
        if self.k_repeat > 1:
            h = h.repeat(1, self.k_repeat)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(h, self.weight, GROUP, self.scales)

    def dequantize(self) -> torch.Tensor:
        """The weight as float32 [out, in], whatever the storage (int4 read through the
        kernel, where int4_cpu does not know torch's packing: to bf16 precision)."""
        if self.format == "float":
            return self.weight.float()
        if self.format == "quant":
            return naive_dequantize(self.qweight)
        if self.format == "blocks":
            return torch.cat([native.unpack(w, kind, rows) for kind, w, rows in self.block_views()])
        if self.format == "int8":
            return self.weight.float() * self.scales.float()[:, None]
        if self.can_read_rows():  # unpacked directly: milliseconds, and exact to the scales
            return int4_cpu.dequantize(self.weight, self.scales, self.out_features, self.k_repeat)
        # run the kernel on an identity: row k of the output is column k of W
        k = self.in_features * self.k_repeat
        eye = torch.eye(k, dtype=self.scales.dtype, device=self.weight.device)
        w = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.weight, GROUP, self.scales)
        w = w.float().t().reshape(self.out_features, self.k_repeat, self.in_features)
        return w.sum(dim=1)

    def can_read_rows(self) -> bool:
        """Whether `rows` reads single rows of W without dequantizing the rest of it."""
        if self.format == "int4":
            return int4_cpu.layout() is not None
        return self.format in ("float", "int8", "blocks") and self.block_kind != MIXED

    def rows(self, ids: torch.Tensor, scales: torch.Tensor | None = None) -> torch.Tensor:
        """Rows `ids` of W as float32 [len(ids), in_features] (a tied embedding's lookup);
        `scales` replaces an int4 weight's bf16 (scale, zero) pairs with unrounded ones."""
        if self.format == "float":
            return self.weight[ids].float()
        if self.format == "int8":
            return self.weight[ids].float() * self.scales[ids].float()[:, None]
        if self.format == "blocks":
            assert self.block_kind != MIXED, "rows() of a Linear fused from parts"
            return native.rows(self.weight, self.block_kind, ids)
        assert self.format == "int4", f"rows() of a {self.format} weight"
        scales = self.scales if scales is None else scales
        return int4_cpu.rows(self.weight, scales, ids, self.out_features, self.k_repeat)

    @property
    def memory_bytes(self) -> int:
        """Bytes held for the weight: the (packed) values, their scales, any dense copy."""
        held = sum(t.nbytes for t in (self.weight, self.scales, self.dense) if t is not None)
        return held + (self.qweight.nbytes if self.qweight is not None else 0)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        if self.qweight is not None:
            self.qweight = self.qweight.map(fn)
        # model.to(device) lands here; CPU-packed weights cannot follow onto an accelerator.
        # A "quant" Linear without its qweight is an expert whose blocks its Experts stacked
        # (moe.py): the stack moves with the Experts, and there is nothing here to widen.
        elif self.format in ("int8", "int4", "blocks") and fn(torch.empty(0)).device.type != "cpu":
            self._set_float(self.dequantize(), self.dtype)
            self.dense = None
        for name in ("weight", "scales", "bias", "dense"):
            if (t := getattr(self, name)) is not None:
                setattr(self, name, fn(t))
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        held = self.format if self.block_kind is None else self.block_kind
        if self.block_parts:
            held = "+".join(f"{kind}[{rows}]" for kind, rows in self.block_parts)
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"format={held}, bias={self.bias is not None}"
        )


class RowParallelLinear(Linear):
    """This rank's columns of W times its slice of the input; forward sums the ranks'
    partial outputs (all_reduce). Only built when tensor parallel is on."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(Linear.forward(self, x))


class VocabParallelHead(Linear):
    """lm_head split by vocabulary: this rank's rows of the table padded to a multiple of
    the ranks (`vocab_range`); forward gathers every rank's logits and drops the padding,
    so each rank returns the full [..., vocab_size]. Only built when tensor parallel is on."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        super().__init__(hidden_size, vocab_size, False)
        self.vocab_size = vocab_size
        self.sharded(Shard(0, vocab_size, (vocab_range(vocab_size),)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = all_gather_last(Linear.forward(self, x))
        return logits if logits.shape[-1] == self.vocab_size else logits[..., : self.vocab_size]


def column_parallel(
    in_features: int,
    out_features: int,
    bias: bool = False,
    *,
    rows: Sequence[tuple[int, int]] | None = None,
    what: str = "out_features",
) -> Linear:
    """A Linear whose rank holds `rows` ([start, end) ranges of out_features; by default an
    even split of them, `what` naming them in a PlacementError) and their bias: its output
    is this rank's part. At world size 1, a plain Linear."""
    if not tp().enabled:
        return Linear(in_features, out_features, bias)
    ranges = tuple(rows) if rows is not None else (shard_range(out_features, what),)
    return Linear(in_features, out_features, bias).sharded(Shard(0, out_features, ranges))


def row_parallel(
    in_features: int,
    out_features: int,
    bias: bool = False,
    *,
    reduce: bool = True,
    cols: Sequence[tuple[int, int]] | None = None,
    what: str = "in_features",
) -> Linear:
    """A Linear whose rank holds `cols` ([start, end) ranges of in_features; by default an
    even split of them) of the columns (its input is the matching slice of a column-parallel
    output). `reduce`: forward all-reduces, so every rank gets the whole output; else the
    caller sums the ranks' partial outputs once (MoE, after the experts are combined). At
    world size 1, a plain Linear."""
    if not tp().enabled:
        return Linear(in_features, out_features, bias)
    cls = RowParallelLinear if reduce else Linear
    ranges = tuple(cols) if cols is not None else (shard_range(in_features, what),)
    shard = Shard(1, in_features, ranges)
    return cls(in_features, out_features, bias).sharded(shard)


def lm_head(hidden_size: int, vocab_size: int) -> Linear:
    """The output projection: vocab-parallel under tensor parallel, else a plain Linear."""
    if not tp().enabled:
        return Linear(hidden_size, vocab_size, False)
    return VocabParallelHead(hidden_size, vocab_size)


def fuse(linears: Sequence[Linear]) -> Linear:
    """One Linear computing all of `linears` (which read the same input) in a single call.

    Weights are concatenated along out_features in the form they are held. The fused output is
    [..., sum(out_features)]; the caller splits it with
    `q, k, v = fused(x).split(fused.split_sizes, dim=-1)`.
    """
    first = linears[0]
    layout = [(m.in_features, m.format, m.k_repeat, _held_as(m)) for m in linears]
    if (
        len({held[:3] for held in layout}) == 1
        and first.format == "blocks"
        and len(set(layout)) > 1
    ):
        return _fuse_parts(linears)  # GGUF blocks of different kinds: each part as it is
    if len(set(layout)) != 1:
        raise ValueError(f"cannot fuse linears held differently: {layout}")
    sizes = [m.out_features for m in linears]
    if first.format == "quant":
        fused = Linear(first.in_features, sum(sizes), any(m.has_bias for m in linears))
        fused.format, fused.dtype, fused.split_sizes = "quant", first.dtype, sizes
        fused.qweight = cat_rows([m.qweight for m in linears])
        fused.bias = _cat_biases(linears)
        return fused
    if first.format == "int4" and any(n % PACK_BLOCK_N for n in sizes[:-1]):
        raise ValueError(f"packed int4 fuses only {PACK_BLOCK_N}-row multiples; got {sizes}")
    fused = Linear(first.in_features, sum(sizes), any(m.has_bias for m in linears))
    fused.format, fused.dtype, fused.k_repeat = first.format, first.dtype, first.k_repeat
    fused.block_kind = first.block_kind
    fused.split_sizes = sizes
    if first.format == "blocks" and not all(m.block_kind.endswith("x8") for m in linears):
        fused._set_blocks(_cat_file_order(linears), _held_as(first))  # x8 where it can be
    else:  # x8 groups, like file rows, concatenate as they are
        fused.weight = torch.cat([m.weight for m in linears])
    if all(m.dense is not None for m in linears):
        fused.dense = torch.cat([m.dense for m in linears])
    if first.scales is not None:
        # int4 scales are [groups, out, 2], int8 scales [out]
        fused.scales = torch.cat(
            [m.scales for m in linears], dim=1 if first.format == "int4" else 0
        )
    fused.bias = _cat_biases(linears)
    return fused


def _panels_mm(h: torch.Tensor, blocks: torch.Tensor, kind: str, rows: int) -> torch.Tensor:
    """h @ W^T for W of `rows` rows held as `kind` blocks, unpacked (transposed) a panel of
    rows at a time of about twice the L2 cache, which the GEMM then reads from cache: a
    whole 12288 x 4096 weight unpacked took 60 of its 92 ms at 128 rows (200 MB written to
    memory and read back), in 256-row panels 63 ms all told."""
    k = h.shape[1]
    per = max(native.XR, (2 * (cache_bytes(2) or 1 << 20)) // (4 * k) // native.XR * native.XR)
    if per >= rows:
        return torch.mm(h, native.unpack_t(blocks, kind, rows))
    out = torch.empty(h.shape[0], rows, dtype=torch.float32)
    for n0 in range(0, rows, per):
        n1 = min(rows, n0 + per)
        out[:, n0:n1] = torch.mm(h, native.unpack_t(blocks[n0:n1], kind, n1 - n0))
    return out


def _held_as(m: Linear) -> str:
    """What a Linear's weight is, for fusing: its dtype, or its quant kind (GGUF blocks'
    file kind: interleaved or not, they fuse)."""
    if m.qweight is not None:
        return m.qweight.kind
    if m.block_kind == MIXED:
        return "+".join(kind.removesuffix("x8") for kind, _ in m.block_parts)
    return m.block_kind.removesuffix("x8") if m.block_kind else str(m.weight.dtype)


def _fuse_parts(linears: Sequence[Linear]) -> Linear:
    """One MIXED "blocks" Linear of `linears`, whose blocks are of different kinds: each
    part's bytes as its Linear holds them (x8 or not), one after the other, run part by part
    (the native layer call chains them: native.HxLinear.next)."""
    first = linears[0]
    parts = [p for m in linears for p in m.block_views()]
    fused = Linear(first.in_features, sum(m.out_features for m in linears), False)
    fused.has_bias = any(m.has_bias for m in linears)
    fused.format, fused.dtype, fused.block_kind = "blocks", first.dtype, MIXED
    fused.block_parts = tuple((kind, rows) for kind, _, rows in parts)
    fused.split_sizes = [m.out_features for m in linears]
    fused.weight = torch.cat([w.reshape(-1) for _, w, _ in parts])
    if all(m.dense is not None for m in linears):
        fused.dense = torch.cat([m.dense for m in linears])
    fused.bias = _cat_biases(linears)
    return fused


def _cat_file_order(linears: Sequence[Linear]) -> torch.Tensor:
    """The blocks of `linears` in the file's row order, one after the other."""
    parts = [
        native.deinterleave(m.weight, m.block_kind)[0] if m.block_kind.endswith("x8") else m.weight
        for m in linears
    ]
    return torch.cat(parts)


def _cat_biases(linears: Sequence[Linear]) -> torch.Tensor | None:
    if not any(m.has_bias for m in linears):
        return None
    like = next(m.bias for m in linears if m.bias is not None)
    return torch.cat(
        [like.new_zeros(m.out_features) if m.bias is None else m.bias for m in linears]
    )


# -- weight conversions ------------------------------------------------------------
def as_dense(src: torch.Tensor | GGUFTensor) -> torch.Tensor:
    """A weight source as a float tensor: itself, or a GGUF tensor dequantized to float32."""
    return src if isinstance(src, torch.Tensor) else src.dequantize(torch.float32)


def _blocks(raw: torch.Tensor, shape: tuple[int, int], block_bytes: int) -> torch.Tensor:
    """Raw GGUF rows [out, bytes_per_row] -> [out, in / 32, block_bytes] uint8."""
    out, inp = shape
    return raw.reshape(out, inp // GROUP, block_bytes)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 little-endian float16 -> [...] float32."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _q4_as_int4(
    raw: torch.Tensor, qtype: str, shape: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 (d | 16B nibbles) or Q4_1 (d | m | 16B nibbles) blocks as (q, scale, zero)."""
    b = _blocks(raw, shape, 18 if qtype == "Q4_0" else 20)
    d = _f16(b[..., 0:2])
    zero = torch.zeros_like(d) if qtype == "Q4_0" else _f16(b[..., 2:4]) + 8 * d
    nibbles = b[..., -16:]  # low nibbles hold weights 0..15 of a block, high ones 16..31
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).reshape(shape)
    return q, d, zero


def _q8_0_as_int4(
    raw: torch.Tensor, shape: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q8_0 blocks (d | 32 x int8) as int4 over a doubled input: [high nibbles | low nibbles].

    q = 16*hi + lo with hi = q >> 4 in -8..7 and lo = q & 15, so w = d*q is the sum of
    (hi+8 - 8) * 16d and (lo - 8) * d + 8d: the kernel's form with x repeated twice.
    """
    b = _blocks(raw, shape, 34)
    d = _f16(b[..., 0:2])
    q = b[..., 2:].contiguous().view(torch.int8).reshape(shape)
    hi, lo = (q >> 4) + 8, q & 0x0F
    q4 = torch.cat([hi, lo], dim=1)
    scale = torch.cat([16 * d, d], dim=1)
    zero = torch.cat([torch.zeros_like(d), 8 * d], dim=1)
    return q4, scale, zero


def int4_scales(src: GGUFTensor) -> torch.Tensor | None:
    """The (scale, zero) pairs the int4 packing of a GGUF Q4_0/Q4_1/Q8_0 tensor holds, before
    their rounding to bf16: float32 [K / 32, out, 2] (None for other qtypes)."""
    shape = tuple(src.shape)
    if src.qtype in ("Q4_0", "Q4_1"):
        _, scale, zero = _q4_as_int4(src.data, src.qtype, shape)
    elif src.qtype == "Q8_0":
        _, scale, zero = _q8_0_as_int4(src.data, shape)
    else:
        return None
    return torch.stack([scale.t(), zero.t()], dim=-1).contiguous()


def _round_scale(s: torch.Tensor) -> torch.Tensor:
    """Round scales to what the kernel will hold, so values are quantized against those."""
    return s.to(PACKED_DTYPE).float()


def _quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: w ~ q * scale[:, None]."""
    w = w.float()
    scale = _round_scale(w.abs().amax(dim=1) / 127)
    q = (w / scale.clamp_min(1e-30)[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, scale


def _quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 in groups of 32 along in_features: w ~ (q - 8) * scale + zero."""
    out, inp = w.shape
    g = w.float().reshape(out, inp // GROUP, GROUP)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = _round_scale((hi - lo) / 15)
    zero = _round_scale(lo + 8 * scale)
    q = (g - zero[..., None]) / scale.clamp_min(1e-30)[..., None] + 8
    return q.round().clamp(0, 15).reshape(out, inp), scale, zero
