"""Pre-quantized safetensors checkpoints: config.json's `quantization_config`, read and kept.

Three methods load, each as its reference code lays it out on disk (W is [out, in], as torch
holds it; G the group size, -1 for the whole input):

- fp8 (transformers' finegrained_fp8, vLLM's Fp8LinearMethod; DeepSeek-V3, Qwen3-FP8):
  `weight` float8_e4m3fn [out, in] and `weight_scale_inv` float32 [ceil(out/bn), ceil(in/bk)]
  for weight_block_size [bn, bk] (128 x 128 as a rule): w = e4m3 * scale_inv[i // bn, j // bk].
  Without weight_block_size, one `weight_scale` for the tensor: w = e4m3 * weight_scale. A
  static activation scheme's `input_scale` (and KV-cache scales) are dropped: activations are
  not quantized here.
- awq (AutoAWQ's GEMM version, as vLLM's AWQ and CPU-AWQ read it): `qweight` int32 [in, out/8],
  `qzeros` int32 [in/G, out/8], `scales` f16 [in/G, out]. Eight 4-bit values an int32 along
  the output: nibble i (bits 4i..4i+3) of column c holds output 8c + AWQ_ORDER[i]. w = (q - z) s.
- gptq (AutoGPTQ, GPTQModel, vLLM's GPTQ; 4-bit, desc_act false): `qweight` int32 [in/8, out]
  packed along the input (nibble i of row r: input 8r + i), `qzeros` int32 [groups, out/8]
  packed along the output (nibble i of column c: output 8c + i), `scales` f16 [groups, out],
  `g_idx` int32 [in] (j // G). checkpoint_format "gptq" (v1, the default) stores z - 1 (read as
  nibble + 1, as vLLM's and exllama's kernels do), "gptq_v2" z itself. w = (q - z) s.

Any other quant_method (bitsandbytes, compressed-tensors, exl2, hqq, ...) or variant (AWQ GEMV,
other bit widths, desc_act) raises UnsupportedQuantError: the node's 422 unsupported_quant.
`gather` turns the checkpoint's tensors into one `PrequantTensor` per quantized weight, under
the module's `.weight` name, and refuses fp8 or packed tensors it cannot place, so nothing is
ever read as if it were a float weight. How a Linear holds one: layers/prequant.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from helexa.engine.layers import prequant as held
from helexa.engine.layers.linear import UnsupportedQuantError

if TYPE_CHECKING:
    from helexa.engine.layers.linear import Linear

METHODS = ("fp8", "awq", "gptq")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output (of 8) that nibble i of an AWQ int32 holds
AWQ_UNPACK = tuple(AWQ_ORDER.index(j) for j in range(8))  # the nibble holding output j
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
# static activation and KV-cache scales: activations and the KV cache are not fp8 here
FP8_DROPPED = ("input_scale", "k_scale", "v_scale", "kv_scale")
# tensor names that only a quantized checkpoint holds
PACKED_SUFFIXES = (".qweight", ".qzeros", ".g_idx", ".weight_scale_inv", ".weight_scale")
SUGGESTION = (
    "load the model's unquantized checkpoint (quant = 'int4' or 'int8' quantizes it at load), "
    "or an FP8 (block-scaled), AWQ (GEMM, 4-bit), GPTQ (4-bit, desc_act false) or GGUF one"
)


@dataclass(frozen=True, slots=True)
class Scheme:
    """One checkpoint's quantization, as far as loading it goes."""

    method: str  # one of METHODS
    group_size: int = -1  # awq/gptq: inputs per scale; -1 the whole input
    block: tuple[int, int] | None = None  # fp8: (bn, bk); None: one scale per tensor
    zero_offset: int = 0  # gptq v1: its files store z - 1

    @property
    def parts(self) -> tuple[str, ...]:
        """The tensors (name suffixes) one weight is made of."""
        if self.method == "fp8":
            return ("weight", "weight_scale_inv" if self.block else "weight_scale")
        packed = ("qweight", "qzeros", "scales")
        return (*packed, "g_idx") if self.method == "gptq" else packed

    def describe(self) -> str:
        """A few words for logs and errors: 'awq 4-bit, groups of 128'."""
        if self.method == "fp8":
            blocks = f"blocks of {list(self.block)}" if self.block else "one scale per tensor"
            return f"fp8 e4m3, {blocks}"
        group = "whole rows" if self.group_size == -1 else f"groups of {self.group_size}"
        fmt = " (gptq v1 zeros)" if self.zero_offset else ""
        return f"{self.method} 4-bit, {group}{fmt}"


def scheme_of(hf_cfg: dict) -> Scheme | None:
    """The checkpoint's quantization from config.json, None for a float checkpoint; raises
    UnsupportedQuantError (naming what it found) for anything that cannot load quantized."""
    qc = hf_cfg.get("quantization_config")
    if qc is None:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method not in METHODS:
        raise UnsupportedQuantError(
            f"checkpoint quantization {method or qc!r} is not supported; pre-quantized "
            f"checkpoints load as {', '.join(METHODS)}",
            SUGGESTION,
        )

    def refuse(what: str) -> UnsupportedQuantError:
        return UnsupportedQuantError(
            f"{method} checkpoint with {what} is not supported", SUGGESTION
        )

    if method == "fp8":
        if str(qc.get("fmt", "e4m3")).lower() != "e4m3":
            raise refuse(f"fmt {qc.get('fmt')!r} (only e4m3)")
        block = qc.get("weight_block_size")
        if block is not None and (len(block) != 2 or min(block) < 1):
            raise refuse(f"weight_block_size {block!r}")
        return Scheme("fp8", block=None if block is None else (int(block[0]), int(block[1])))
    bits = qc.get("bits", qc.get("w_bit"))
    group = int(qc.get("group_size", qc.get("q_group_size", -1)))
    if bits != 4:
        raise refuse(f"bits {bits!r} (only 4)")
    if group != -1 and group < 1:
        raise refuse(f"group_size {group}")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise refuse(f"version {version!r} (only gemm's layout)")
        if not qc.get("zero_point", True):
            raise refuse("zero_point false")
        return Scheme("awq", group_size=group)
    if qc.get("desc_act"):
        raise refuse("desc_act true (act-order: groups permuted along the input)")
    fmt = str(qc.get("checkpoint_format", qc.get("format", "gptq"))).lower()
    if fmt not in ("gptq", "gptq_v2") or qc.get("is_marlin_format"):
        raise refuse(f"checkpoint_format {fmt!r} (only gptq and gptq_v2)")
    return Scheme("gptq", group_size=group, zero_offset=1 if fmt == "gptq" else 0)


@dataclass(slots=True)
class PrequantTensor:
    """One pre-quantized weight: its checkpoint tensors, as the file holds them."""

    name: str  # the module's `.weight` name
    scheme: Scheme
    shape: tuple[int, int]  # (out_features, in_features)
    parts: dict[str, torch.Tensor]

    @property
    def qtype(self) -> str:
        return self.scheme.method

    def describe(self) -> str:
        return self.scheme.describe()

    @property
    def device(self) -> torch.device:
        return self.parts[self.scheme.parts[0]].device

    def load_into(self, linear: Linear, *, dtype: torch.dtype, dense_copy: bool) -> None:
        """Hand the weight to `linear`, held quantized (layers/prequant.py)."""
        held.hold(linear, self, dtype=dtype, dense_copy=dense_copy)

    # -- AWQ / GPTQ ------------------------------------------------------------------
    def int4_groups(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes uint8 [out, in] 0..15, scales [out, groups] in the file's dtype, zeros uint8
        [out, groups] 0..16, group int64 [in]: each input's group), w = (q - z) * s."""
        assert self.scheme.method in ("awq", "gptq"), self.scheme.method
        out, inp = self.shape
        p = self.parts
        if self.scheme.method == "awq":
            codes = _nibbles_along_last(p["qweight"])[..., AWQ_UNPACK].reshape(inp, out).t()
            zeros = _nibbles_along_last(p["qzeros"])[..., AWQ_UNPACK].reshape(-1, out).t()
        else:
            codes = _nibbles_along_first(p["qweight"]).t()
            zeros = _nibbles_along_last(p["qzeros"]).reshape(-1, out).t() + self.scheme.zero_offset
        scales = p["scales"].t()
        group_size = inp if self.scheme.group_size == -1 else self.scheme.group_size
        group = torch.arange(inp, device=codes.device) // group_size
        if "g_idx" in p and not torch.equal(p["g_idx"].to(group.device, torch.int64), group):
            raise UnsupportedQuantError(
                f"{self.name}: g_idx is not j // {group_size} (an act-order or reordered GPTQ "
                "checkpoint); only desc_act false loads",
                SUGGESTION,
            )
        want = -(-inp // group_size)
        if scales.shape != (out, want) or zeros.shape != (out, want):
            raise ValueError(
                f"{self.name}: {self.scheme.describe()} of [{out}, {inp}] needs scales and zeros "
                f"of [{want}, {out}]; got {list(p['scales'].shape)} and zeros for {zeros.shape[1]}"
            )
        return codes.contiguous(), scales.contiguous(), zeros.contiguous(), group

    def groups_of_32(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(codes [out, in], scales [out, in/32], zeros [out, in/32]): int4_groups with each
        group's scale and zero over its runs of 32 inputs; None where a run of 32 would span
        two groups (a group size that is no multiple of 32, in_features that is none)."""
        codes, scales, zeros, group = self.int4_groups()
        inp = self.shape[1]
        if inp % 32:
            return None
        runs = group.reshape(-1, 32)
        if not torch.equal(runs, runs[:, :1].expand_as(runs)):
            return None
        first = runs[:, 0]
        return codes, scales[:, first].contiguous(), zeros[:, first].contiguous()

    # -- fp8 ---------------------------------------------------------------------------
    def fp8_blocks(self) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
        """(weight float8_e4m3fn [out, in], scale float32 [ceil(out/bn), ceil(in/bk)], (bn,
        bk)): a per-tensor scale as one block of the whole weight."""
        assert self.scheme.method == "fp8", self.scheme.method
        out, inp = self.shape
        w = self.parts["weight"]
        if self.scheme.block is None:
            scale = self.parts["weight_scale"].float().reshape(-1)
            if scale.numel() != 1:
                raise ValueError(f"{self.name}: weight_scale of {scale.numel()} values, not 1")
            return w, scale.reshape(1, 1), (out, inp)
        bn, bk = self.scheme.block
        scale = self.parts["weight_scale_inv"].float()
        want = (-(-out // bn), -(-inp // bk))
        if tuple(scale.shape) != want:
            raise ValueError(
                f"{self.name}: weight_scale_inv {list(scale.shape)} for [{out}, {inp}] in blocks "
                f"of {[bn, bk]}; expected {list(want)}"
            )
        return w, scale, (bn, bk)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as `dtype` [out, in], in float32 arithmetic (exact to the file's)."""
        if self.scheme.method == "fp8":
            w, scale, (bn, bk) = self.fp8_blocks()
            out, inp = self.shape
            s = scale.repeat_interleave(bn, 0)[:out].repeat_interleave(bk, 1)[:, :inp]
            return (w.float() * s).to(dtype)
        codes, scales, zeros, group = self.int4_groups()
        w = (codes.float() - zeros.float()[:, group]) * scales.float()[:, group]
        return w.to(dtype)


def _nibbles_along_last(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., n] -> uint8 [..., n, 8]: nibble i (bits 4i..4i+3) of each at [..., i]."""
    _check_int32(packed)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8)


def _nibbles_along_first(packed: torch.Tensor) -> torch.Tensor:
    """int32 [n, m] -> uint8 [8n, m]: row 8r + i is nibble i of row r."""
    _check_int32(packed)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nib = (packed.unsqueeze(1) >> shifts[:, None]) & 0xF  # [n, 8, m]
    return nib.to(torch.uint8).reshape(-1, packed.shape[1])


def _check_int32(packed: torch.Tensor) -> None:
    if packed.dtype != torch.int32:
        raise UnsupportedQuantError(
            f"packed 4-bit weights are int32 in AWQ and GPTQ files; got {packed.dtype} (a "
            "GPTQModel pack_dtype other than int32)",
            SUGGESTION,
        )


# -- the tensor stream -------------------------------------------------------------------
def gather(
    weights: Iterable[tuple[str, torch.Tensor]], scheme: Scheme | None
) -> Iterator[tuple[str, torch.Tensor | PrequantTensor]]:
    """The checkpoint's tensors, each quantized weight's parts gathered (in whatever order and
    files they come) into one PrequantTensor named `<module>.weight`; other tensors as they
    are. A float8 tensor, or a packed one, that belongs to no weight of `scheme` raises."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in weights:
        module, _, part = name.rpartition(".")
        if scheme is not None and scheme.method == "fp8" and part in FP8_DROPPED:
            continue
        if scheme is None or not _is_part(scheme, part, t):
            _refuse_stray(name, t, scheme)
            yield name, t
            continue
        parts = pending.setdefault(module, {})
        parts[part] = t
        if set(parts) == set(scheme.parts):
            yield f"{module}.weight", _make(module, scheme, pending.pop(module))
    for module, parts in pending.items():
        missing = set(scheme.parts) - set(parts) - {"g_idx"}  # GPTQ's g_idx is optional
        if missing:
            raise ValueError(
                f"{module}: a {scheme.describe()} checkpoint without {sorted(missing)} "
                f"(found {sorted(parts)})"
            )
        yield f"{module}.weight", _make(module, scheme, parts)


def _is_part(scheme: Scheme, part: str, t: torch.Tensor) -> bool:
    if part not in scheme.parts:
        return False
    return part != "weight" or t.dtype == torch.float8_e4m3fn  # float weights: not quantized


def _refuse_stray(name: str, t: torch.Tensor, scheme: Scheme | None) -> None:
    """A tensor no weight of `scheme` takes, that only a quantized checkpoint would hold."""
    if t.dtype not in FP8_DTYPES and not name.endswith(PACKED_SUFFIXES):
        return
    held = "config.json has no quantization_config" if scheme is None else scheme.describe()
    raise UnsupportedQuantError(
        f"{name} ({str(t.dtype).removeprefix('torch.')} {list(t.shape)}) is a quantized "
        f"tensor this loader cannot place ({held})",
        SUGGESTION,
    )


def _make(module: str, scheme: Scheme, parts: dict[str, torch.Tensor]) -> PrequantTensor:
    if scheme.method == "fp8":
        shape = tuple(parts["weight"].shape)
    elif scheme.method == "awq":
        shape = (parts["qweight"].shape[1] * 8, parts["qweight"].shape[0])
    else:
        shape = (parts["qweight"].shape[1], parts["qweight"].shape[0] * 8)
    return PrequantTensor(f"{module}.weight", scheme, shape, parts)
