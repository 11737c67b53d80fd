"""The CPU's own GGUF block kernels (native/blocks.c), built with the system C compiler the
first time a process needs them and loaded with ctypes.

Why C rather than torch: torch's packed int4 kernel dequantizes each weight to bf16 and
multiplies in floating point; a GGUF Q4 block times activations quantized to int8 is one
integer multiply-add of 32 bytes (AVX2), and the weights stay exactly the file's bytes.
`-march=native` fits the build to this CPU, so the library is cached per source, compiler and
CPU: `$HELEXA_NATIVE_DIR`, else `$CACHE_DIRECTORY/native` (the systemd unit's), else
`~/.cache/helexa/native`. Where no compiler is found or the build fails, `library()` returns
None, says why once in the log, and the Linears keep torch's int4 path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from helexa import kernels
from helexa.engine.layers.autotune import cpu_info
from helexa.engine.loader.dequant import dequantize as gguf_dequantize

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native") / "blocks.c"
# the K-quants' kernels, built into the same library (blocks.c hands those kinds to them)
SOURCES = (SOURCE, SOURCE.with_name("kquants.c"))
HEADERS = (SOURCE.with_name("common.h"),)  # what both include: part of the build's key
# GGUF block kinds the kernels take: the file's rows, or ("…x8") 8 rows interleaved; the
# K-quants as the file's rows of 256-weight super-blocks
KINDS = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2, "Q4_0x8": 3, "Q4_1x8": 4, "Q8_0x8": 5}
K_KINDS = ("Q4_K", "Q5_K", "Q6_K")
KINDS |= {k: 6 + i for i, k in enumerate(K_KINDS)} | {"Q4_Kx8": 9, "Q6_Kx8": 10, "Q5_Kx8": 11}
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}  # one row's block (x8: its share)
BLOCK_BYTES |= {f"{k}x8": v for k, v in BLOCK_BYTES.items()}
# Q4_Kx8 and Q5_Kx8 unpack the 6-bit scales and mins of their blocks to a byte each
BLOCK_BYTES |= {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "Q4_Kx8": 148, "Q5_Kx8": 180}
BLOCK_BYTES |= {"Q6_Kx8": 210}
QK = 32  # weights a block
QK_K = 256  # weights a K-quant super-block
# weights of one block of each kind: rows of a weight held as `kind` are multiples of it
BLOCK_WEIGHTS = {k: QK_K if k.removesuffix("x8") in K_KINDS else QK for k in KINDS}
XR = 8  # rows an x8 group interleaves
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")


def cache_dir() -> Path:
    if d := os.environ.get("HELEXA_NATIVE_DIR"):
        return Path(d)
    if d := os.environ.get("CACHE_DIRECTORY"):  # systemd's CacheDirectory=
        return Path(d.split(":")[0]) / "native"
    return Path.home() / ".cache" / "helexa" / "native"


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and (path := shutil.which(name)):
            return path
    return None


def _version(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def build(cc: str, flags: tuple[str, ...] = FLAGS) -> Path:
    """The library built from SOURCE with `cc` and `flags`, from the cache when it is there
    (keyed by the source, the compiler's version, the CPU and the flags). Raises RuntimeError
    with the compiler's message when the build fails."""
    cpu, cpu_flags = cpu_info()
    code = [src.read_bytes() for src in (*SOURCES, *HEADERS)]
    parts = [*code, _version(cc).encode(), cpu.encode(), cpu_flags.encode()]
    key = hashlib.sha256(b"|".join([*parts, *map(str.encode, flags)])).hexdigest()[:16]
    target = cache_dir() / f"blocks-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        cmd = [cc, *flags, *map(str, SOURCES), "-o", str(out), "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(done.stderr.strip()[-2000:] or f"exit {done.returncode}")
        os.replace(out, target)  # atomic: concurrent builders agree on one file
    return target


def load(path: Path) -> ctypes.CDLL:
    """The library at `path` with its functions' signatures set."""
    lib = ctypes.CDLL(str(path))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.hx_blocks_matmul.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, ptr, ctypes.c_int]
    lib.hx_blocks_matmul.restype = ctypes.c_int
    lib.hx_blocks_matmul_f32.argtypes = lib.hx_blocks_matmul.argtypes
    lib.hx_blocks_matmul_f32.restype = ctypes.c_int
    lib.hx_dequantize.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, ctypes.c_int]
    lib.hx_dequantize.restype = ctypes.c_int
    lib.hx_dequantize_t.argtypes = lib.hx_dequantize.argtypes
    lib.hx_dequantize_t.restype = ctypes.c_int
    lib.hx_kq_interleave.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, ctypes.c_int, ctypes.c_int]
    lib.hx_kq_interleave.restype = ctypes.c_int
    lib.hx_rows.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, ptr]
    lib.hx_rows.restype = ctypes.c_int
    lib.hx_rms_norm.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, ctypes.c_float, ctypes.c_int]
    lib.hx_rms_norm.restype = ctypes.c_int
    lib.hx_qk_prepare.argtypes = [
        ptr, i64, i64, i64, i64, ptr, ptr, ctypes.c_float, ptr, ptr, i64, ctypes.c_int,
    ]  # fmt: skip
    lib.hx_qk_prepare.restype = ctypes.c_int
    lib.hx_paged_decode.argtypes = [
        ptr, i64, i64, i64, i64, ptr, ptr, ctypes.c_int, i64, ptr, i64, ptr, ctypes.c_float,
        ptr, ctypes.c_int,
    ]  # fmt: skip
    lib.hx_paged_decode.restype = ctypes.c_int
    lib.hx_decode_attention.argtypes = [
        ptr, i64, i64, i64, i64, ptr, ptr, ctypes.c_float, ptr, ptr, i64, ptr, ptr, ptr,
        ctypes.c_int, i64, ptr, i64, ptr, ctypes.c_float, ptr, ctypes.c_int,
    ]  # fmt: skip
    lib.hx_decode_attention.restype = ctypes.c_int
    lib.hx_silu_mul.argtypes = [ptr, i64, i64, ptr]
    lib.hx_silu_mul.restype = ctypes.c_int
    lib.hx_argmax_finite.argtypes = [ptr, i64, i64, ptr, ptr]
    lib.hx_argmax_finite.restype = ctypes.c_int
    lin = ctypes.POINTER(HxLinear)
    f32 = ctypes.c_float
    lib.hx_decode_layer.argtypes = [
        ptr, ptr, ptr, i64, i64, ptr, ptr, f32, lin, lin, lin, lin, i64, i64, i64, ptr, ptr,
        f32, ptr, ptr, i64, ptr, ptr, ptr, ctypes.c_int, i64, ptr, i64, ptr, f32, ptr,
        ctypes.c_int,
    ]  # fmt: skip
    lib.hx_decode_layer.restype = ctypes.c_int
    lib.hx_decode_layers.argtypes = [
        ctypes.POINTER(HxLayer), i64, ptr, ptr, ptr, i64, i64, ptr, ptr, i64, ptr, ptr, i64,
        ptr, ctypes.c_int,
    ]  # fmt: skip
    lib.hx_decode_layers.restype = ctypes.c_int
    return lib


class HxLinear(ctypes.Structure):
    """blocks.c's hx_linear: one Linear held as GGUF blocks, or one part of a Linear fused
    from parts of different kinds (`next`: the part whose outputs follow)."""


HxLinear._fields_ = [
    ("kind", ctypes.c_int),
    ("w", ctypes.c_void_p),
    ("n", ctypes.c_int64),
    ("k", ctypes.c_int64),
    ("bias", ctypes.c_void_p),
    ("next", ctypes.POINTER(HxLinear)),
]


class HxLayer(ctypes.Structure):
    """blocks.c's hx_layer: what hx_decode_layers needs of one decoder layer."""

    _fields_ = [
        ("norm1", ctypes.c_void_p),
        ("norm2", ctypes.c_void_p),
        ("eps", ctypes.c_float),
        ("qkv", ctypes.POINTER(HxLinear)),
        ("o", ctypes.POINTER(HxLinear)),
        ("gate_up", ctypes.POINTER(HxLinear)),
        ("down", ctypes.POINTER(HxLinear)),
        ("H", ctypes.c_int64),
        ("KVH", ctypes.c_int64),
        ("D", ctypes.c_int64),
        ("q_norm", ctypes.c_void_p),
        ("k_norm", ctypes.c_void_p),
        ("qk_eps", ctypes.c_float),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
        ("block_size", ctypes.c_int64),
        ("scale", ctypes.c_float),
        ("kv_f16", ctypes.c_int),
    ]


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernels, or None (logged once) where they cannot be built here."""
    cc = _compiler()
    if cc is None:
        log.warning(
            "no C compiler (cc, gcc or clang) on PATH: GGUF Q4_0/Q4_1/Q8_0 weights run "
            "through torch's int4 kernel, slower at decode, and Q4_K/Q5_K/Q6_K ones are "
            "widened to float32 (~7x the memory); install one for the native kernels"
        )
        return None
    try:
        path = build(cc, FLAGS)  # read now: tests/engine/test_cpu_isas.py narrows -march
        lib = load(path)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning(
            "the native CPU kernels did not build with %s (GGUF K-quants are widened to "
            "float32 without them): %s", cc, e,
        )  # fmt: skip
        return None
    log.info("native CPU kernels: %s", path)
    return lib


def available() -> bool:
    """Whether the kernels build (or were built) on this machine."""
    return library() is not None


_MODE = ["auto"]  # set_mode: "auto" (native wherever it builds) or "torch"
MODES = ("auto", "torch")


def set_mode(mode: str) -> None:
    """`[engine] cpu_kernels`: "auto" holds GGUF Q4_0/Q4_1/Q8_0 weights as blocks for the
    native kernels wherever they build; "torch" keeps torch's packed int4 kernel. Process-wide,
    read when weights load."""
    if mode not in MODES:
        raise ValueError(f"unknown cpu_kernels {mode!r}; supported: {list(MODES)}")
    _MODE[0] = mode


def enabled() -> bool:
    """Whether weights loading now are held for the native kernels."""
    return _MODE[0] == "auto" and library() is not None


def matmul(
    x: torch.Tensor,
    blocks: torch.Tensor,
    kind: str,
    out_features: int,
    lib=None,
    *,
    exact: bool = False,
) -> torch.Tensor:
    """x [M, K] float32 (contiguous) @ W.T → [M, out_features] float32, W as GGUF `kind`
    blocks: `blocks` uint8 [out_features, K / 32 * block bytes]. The activations go to int8
    per block of 32 (decode's fast path), or with `exact` stay float32 against the exact
    weights (prompt steps' few rows: F.linear on `dequantize`'s weights, to ~1e-6). `lib`:
    another build of the kernels (tests)."""
    lib = lib or library()
    assert lib is not None, "native kernels unavailable"
    m, k = x.shape
    y = torch.empty(m, out_features, dtype=torch.float32)
    run = lib.hx_blocks_matmul_f32 if exact else lib.hx_blocks_matmul
    rc = run(
        KINDS[kind],
        blocks.data_ptr(),
        out_features,
        k,
        x.data_ptr(),
        m,
        y.data_ptr(),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError(f"native {kind} matmul refused [{m}, {k}] x [{out_features}, {k}]")
    return y


# what a KV cache may hold for the native kernels, and the flag that tells them which
KV_DTYPES = {torch.float32: 0, torch.float16: 1}


def usable(*tensors: torch.Tensor, caches: Sequence[torch.Tensor] = ()) -> bool:
    """Whether the native ops may take these tensors: native kernels on, torch's kernel
    backend "auto" (not an A/B run of "naive" or "triton"), every tensor a float32 one on
    the CPU (made contiguous for the call), and every KV cache in `caches` a contiguous
    float32 or float16 one on the CPU (the kernels address it in place)."""
    return (
        enabled()
        and kernels.backend() == "auto"
        and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
        and all(
            c.device.type == "cpu" and c.dtype in KV_DTYPES and c.is_contiguous() for c in caches
        )
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`kernels.rms_norm` in one call: x [..., D] float32 → RMSNorm(x), or with a residual
    (RMSNorm(x + residual), x + residual). Callers check `usable` first."""
    x, weight = x.contiguous(), weight.contiguous()
    residual = residual.contiguous() if residual is not None else None
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else None
    dim = x.shape[-1]
    rc = library().hx_rms_norm(
        x.data_ptr(),
        residual.data_ptr() if residual is not None else None,
        weight.data_ptr(),
        out.data_ptr(),
        res_out.data_ptr() if res_out is not None else None,
        x.numel() // dim,
        dim,
        eps,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError(f"native rms_norm refused {list(x.shape)}")
    return out if residual is None else (out, res_out)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    lib=None,
) -> torch.Tensor:
    """One decode step's attention, float32: q [n, H, D]; caches [blocks, block_size, KVH,
    D], float32 or float16 (`usable`'s caches); tables [n, max_blocks] int64; lens [n] int32 →
    [n, H, D]. The torch path gathers the blocks and runs SDPA; this reads them in place.
    `lib`: another build (tests)."""
    assert k_cache.dtype == v_cache.dtype
    q, k_cache, v_cache = q.contiguous(), k_cache.contiguous(), v_cache.contiguous()
    tables, lens = tables.contiguous(), lens.to(torch.int32).contiguous()
    n, h, d = q.shape
    _, block_size, kvh, _ = k_cache.shape
    out = torch.empty_like(q)
    rc = (lib or library()).hx_paged_decode(
        q.data_ptr(),
        n,
        h,
        kvh,
        d,
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        KV_DTYPES[k_cache.dtype],
        block_size,
        tables.data_ptr(),
        tables.shape[1],
        lens.data_ptr(),
        scale,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError(f"native paged_decode refused q {list(q.shape)}, lens {lens.tolist()}")
    return out


def _rotary_rows(cos: torch.Tensor, signed_sin: torch.Tensor, m: int):
    """rotary.py's tables [M, 1, R] as the kernels read them: (cos, signed_sin) [M, R]
    contiguous, and R."""
    r = cos.shape[-1]
    return cos.reshape(m, r).contiguous(), signed_sin.reshape(m, r).contiguous(), r


def qk_prepare(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
) -> None:
    """In place on a prompt step's qkv [M, (H + 2 KVH) D] float32, contiguous: each q and k
    head normalised (q_norm / k_norm [D], or None) and rotated (cos, signed_sin [M, 1, R],
    rotary.py's tables), as `kernels.rotary` after the heads' RMSNorms computes them, with
    the rows split over threads. v is left as it is."""
    assert qkv.is_contiguous() and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim
    m = qkv.shape[0]
    cos, signed_sin, r = _rotary_rows(cos, signed_sin, m)
    rc = library().hx_qk_prepare(
        qkv.data_ptr(), m, num_heads, num_kv_heads, head_dim,
        q_norm.data_ptr() if q_norm is not None else None,
        k_norm.data_ptr() if k_norm is not None else None,
        eps, cos.data_ptr(), signed_sin.data_ptr(), r, torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"native qk_prepare refused qkv {list(qkv.shape)}, rotary {r}")


def decode_attention(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    lib=None,
) -> torch.Tensor:
    """A decode step's attention after the qkv projection, in one call: qkv [M, (H + 2 KVH)
    D] float32, a fresh tensor (it is overwritten: q and k normalised and rotated in place);
    q_norm / k_norm [D] or None; cos, signed_sin [M, 1, R] (rotary.py's tables); slots [M]
    the new tokens' cache slots; caches as `paged_decode` takes them; tables [M, max_blocks]
    int64; lens [M] → [M, H D]. What Attention.forward's torch ops compute: split, per-head
    norms, rotary, the K/V writes (rounded to a float16 cache's values as torch rounds) and
    paged attention (`paged_decode`). `lib`: another build (tests)."""
    m = qkv.shape[0]
    cos, signed_sin, r = _rotary_rows(cos, signed_sin, m)
    qkv, slots = qkv.contiguous(), slots.contiguous()
    tables, lens = tables.contiguous(), lens.to(torch.int32).contiguous()
    out = qkv.new_empty(m, num_heads * head_dim)
    rc = (lib or library()).hx_decode_attention(
        qkv.data_ptr(), m, num_heads, num_kv_heads, head_dim,
        q_norm.data_ptr() if q_norm is not None else None,
        k_norm.data_ptr() if k_norm is not None else None,
        eps, cos.data_ptr(), signed_sin.data_ptr(), r, slots.data_ptr(),
        k_cache.data_ptr(), v_cache.data_ptr(), KV_DTYPES[k_cache.dtype], k_cache.shape[1],
        tables.data_ptr(), tables.shape[1], lens.data_ptr(), scale, out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"native decode_attention refused qkv {list(qkv.shape)}")
    return out


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """`kernels.silu_and_mul`: x [M, 2I] float32 → silu(x[:, :I]) * x[:, I:] [M, I]."""
    x = x.contiguous()
    m, two_i = x.shape
    out = x.new_empty(m, two_i // 2)
    library().hx_silu_mul(x.data_ptr(), m, two_i // 2, out.data_ptr())
    return out


def argmax_finite(x: torch.Tensor, lib=None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, N] float32 on the CPU → (x.argmax(-1) int64 [M], x.isfinite().all(-1) bool [M])
    in one C call: the greedy tokens of a step's logits and which rows were finite, ~10x
    quicker than the two torch reductions. `lib`: another build (tests)."""
    x = x.contiguous()
    m, n = x.shape
    idx = torch.empty(m, dtype=torch.int64)
    finite = torch.empty(m, dtype=torch.bool)
    rc = (lib or library()).hx_argmax_finite(x.data_ptr(), m, n, idx.data_ptr(), finite.data_ptr())
    if rc != 0:
        raise RuntimeError(f"native argmax refused [{m}, {n}]")
    return idx, finite


def unpack(blocks: torch.Tensor, kind: str, out_features: int, lib=None) -> torch.Tensor:
    """`dequantize` in one threaded C call: the weight as float32 [out_features, K] (Q4_1's
    3072 x 576 gate/up: well under a millisecond). `lib`: another build of the kernels
    (tests)."""
    return _unpack(blocks, kind, out_features, lib, transposed=False)


def unpack_t(blocks: torch.Tensor, kind: str, out_features: int, lib=None) -> torch.Tensor:
    """`unpack`'s weight transposed, float32 [K, out_features] row-major: a prompt chunk's
    GEMM as x @ W^T reads it as it lies (torch.mm(x, unpack_t(...)))."""
    return _unpack(blocks, kind, out_features, lib, transposed=True)


def _unpack(blocks: torch.Tensor, kind: str, out_features: int, lib, *, transposed: bool):
    k = blocks.shape[1] // BLOCK_BYTES[kind] * BLOCK_WEIGHTS[kind]
    lib = lib or library()
    run = lib.hx_dequantize_t if transposed else lib.hx_dequantize
    shape = (k, out_features) if transposed else (out_features, k)
    out = torch.empty(shape, dtype=torch.float32)
    rc = run(
        KINDS[kind], blocks.data_ptr(), out_features, k, out.data_ptr(), torch.get_num_threads()
    )
    if rc != 0:
        raise RuntimeError(f"native unpack refused {kind} [{out_features}, {k}]")
    return out


def rows(blocks: torch.Tensor, kind: str, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the weight as float32 [len(ids), K] (a tied embedding's lookup), each
    unpacked from its blocks where it lies (x8 too)."""
    n, k = blocks.shape[0], blocks.shape[1] // BLOCK_BYTES[kind] * BLOCK_WEIGHTS[kind]
    ids = ids.to(torch.int64).contiguous()
    out = torch.empty(len(ids), k, dtype=torch.float32)
    rc = library().hx_rows(
        KINDS[kind], blocks.data_ptr(), n, k, ids.data_ptr(), len(ids), out.data_ptr()
    )
    if rc != 0:
        raise RuntimeError(f"native rows refused ids {ids.tolist()} of {kind} [{n}, {k}]")
    return out


# -- x8: 8 rows side by side (blocks.c says why) ----------------------------------------------
def _x8_parts(kind: str) -> tuple[int, int]:
    """(bytes of scales, rounds of 4 code bytes) in one row's block of `kind`."""
    return {"Q4_0": (2, 4), "Q4_1": (4, 4), "Q8_0": (2, 8)}[kind.removesuffix("x8")]


def interleave(blocks: torch.Tensor, kind: str) -> tuple[torch.Tensor, str]:
    """A file-order weight [N, K/32 × block bytes] (N a multiple of 8) as its x8 form, same
    shape and bytes: per group of 8 rows and block, the 8 d's, the 8 m's (Q4_1), then the
    codes with byte 32c + 4r + k = byte 4c + k of row r's codes. The K-quants: kquants.c's
    x8 forms (its comment), made there."""
    if kind in K_KINDS:
        return _kq_interleave(blocks, kind, f"{kind}x8", reverse=False), f"{kind}x8"
    n, row_bytes = blocks.shape
    bb = BLOCK_BYTES[kind]
    head, rounds = _x8_parts(kind)
    b = blocks.view(n // XR, XR, row_bytes // bb, bb).transpose(1, 2)  # [G, nb, 8, bb]
    scales = [b[..., i : i + 2].reshape(*b.shape[:2], -1) for i in range(0, head, 2)]
    codes = b[..., head:].reshape(*b.shape[:3], rounds, 4).transpose(2, 3)  # [G, nb, c, 8, 4]
    out = torch.cat([*scales, codes.reshape(*b.shape[:2], -1)], dim=-1)
    return out.reshape(n, row_bytes).contiguous(), f"{kind}x8"


def deinterleave(blocks: torch.Tensor, kind: str) -> tuple[torch.Tensor, str]:
    """`interleave` undone: (the file-order weight, the file's kind)."""
    base = kind.removesuffix("x8")
    if base in K_KINDS:
        return _kq_interleave(blocks, kind, base, reverse=True), base
    n, row_bytes = blocks.shape
    bb = BLOCK_BYTES[base]
    head, rounds = _x8_parts(base)
    g = blocks.view(n // XR, row_bytes // bb, XR * bb)  # [G, nb, group block]
    scales = [g[..., XR * i : XR * (i + 2)].reshape(*g.shape[:2], XR, 2) for i in range(0, head, 2)]
    codes = g[..., XR * head :].reshape(*g.shape[:2], rounds, XR, 4).transpose(2, 3)
    b = torch.cat([*scales, codes.reshape(*g.shape[:2], XR, -1)], dim=-1)  # [G, nb, 8, bb]
    return b.transpose(1, 2).reshape(n, row_bytes).contiguous(), base


def _kq_interleave(blocks: torch.Tensor, kind: str, to: str, *, reverse: bool) -> torch.Tensor:
    """A K-quant weight [N, row bytes] of `kind` as `to` (its x8 form, or back)."""
    n = blocks.shape[0]
    k = blocks.shape[1] // BLOCK_BYTES[kind] * QK_K
    out = torch.empty(n, k // QK_K * BLOCK_BYTES[to], dtype=torch.uint8)
    src = blocks.contiguous()
    rc = library().hx_kq_interleave(
        KINDS[to.removesuffix("x8")], src.data_ptr(), n, k, out.data_ptr(), int(reverse),
        torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"native interleave refused {kind} [{n}, {k}]")
    return out


def dequantize(blocks: torch.Tensor, kind: str, out_features: int) -> torch.Tensor:
    """The weight as float32 [out_features, K] (GGUF's arithmetic), in torch: the naive twin
    of `unpack`, which the tests and `naive_matmul` read."""
    if kind.removesuffix("x8") in K_KINDS:  # the loader's own arithmetic
        if kind.endswith("x8"):
            blocks, kind = deinterleave(blocks, kind)
        k = blocks.shape[1] // BLOCK_BYTES[kind] * QK_K
        return gguf_dequantize(blocks.reshape(-1), kind, (out_features, k))
    if kind.endswith("x8"):
        blocks, kind = deinterleave(blocks, kind)
    bb = BLOCK_BYTES[kind]
    b = blocks.view(out_features, -1, bb)
    d = b[..., 0:2].contiguous().view(torch.float16).float()  # [N, nb, 1]
    if kind == "Q8_0":
        q = b[..., 2:].contiguous().view(torch.int8).float()
        return (q * d).reshape(out_features, -1)
    qs = b[..., 4:] if kind == "Q4_1" else b[..., 2:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()  # weights 0..15, then 16..31
    if kind == "Q4_1":
        m = b[..., 2:4].contiguous().view(torch.float16).float()
        return (q * d + m).reshape(out_features, -1)
    return ((q - 8) * d).reshape(out_features, -1)


# -- the naive twin ---------------------------------------------------------------------------
def quantize_activations(x: torch.Tensor, group: int = QK) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float32 as the kernels quantize it: per `group` (32; the K-quants' 256),
    d = max|x| / 127 and q = round(x * 127 / max|x|) (half to even). Returns (q as float32
    [M, K], d [M, K/group])."""
    m, k = x.shape
    blocks = x.reshape(m, k // group, group)
    amax = blocks.abs().amax(dim=-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inv[..., None])
    return q.reshape(m, k), amax / 127.0


def naive_matmul(x: torch.Tensor, blocks: torch.Tensor, kind: str, out_features: int):
    """What `matmul` computes, in float64 torch: the activations quantized as the kernels
    quantize them, times the weight as the blocks hold it."""
    group = BLOCK_WEIGHTS[kind.removesuffix("x8")]
    q, d = quantize_activations(x.float(), group)
    xq = (q.reshape(*d.shape, group) * d[..., None]).reshape(q.shape).double()
    return (xq @ dequantize(blocks, kind, out_features).double().T).float()


# -- a whole decoder layer --------------------------------------------------------------------
@dataclass(slots=True)
class LayerPlan:
    """What `decode_layer` passes for one Llama-family layer, built once: its four block
    Linears as HxLinear structs (pointing into the layer's own tensors, kept alive here),
    its norms, and the attention's shape."""

    linears: tuple[HxLinear, HxLinear, HxLinear, HxLinear]  # qkv, o, gate_up, down
    keep: list[torch.Tensor]
    norm1: torch.Tensor
    norm2: torch.Tensor
    eps: float
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    qk_eps: float
    heads: tuple[int, int, int]  # H, KVH, D
    attn: torch.nn.Module  # the layer's PagedAttention: its caches and scale
    # by row count: whether every projection's autotuned plan runs the block kernel (whole,
    # or in chunks, which the kernel's own 4-row tiles do too); where one measured a float32
    # GEMM faster, the layer runs op by op
    rows_ok: list[bool]


def _hx_linear(lin, keep: list[torch.Tensor]) -> HxLinear | None:
    if lin.format != "blocks" or (lin.bias is not None and lin.bias.dtype != torch.float32):
        return None
    keep += [t for t in (lin.weight, lin.bias) if t is not None]
    bias = lin.bias.data_ptr() if lin.bias is not None else None
    head = after = None
    for kind, w, rows in lin.block_views():  # one part, or a MIXED Linear's parts chained
        part = HxLinear(KINDS[kind], w.data_ptr(), rows, lin.in_features, None)
        if after is None:
            head = part
        else:
            after.next = ctypes.pointer(part)  # the struct keeps what it points at alive
        after = part
    head.bias = bias
    return head


def layer_plan(layer, attention_cls, mlp_cls, linear_cls) -> LayerPlan | None:
    """The plan of a Llama/Qwen2/Qwen3 DecoderLayer whose projections are all GGUF blocks
    (fused qkv and gate/up, no tensor parallel), else None: such layers run op by op."""
    attn, mlp = layer.self_attn, layer.mlp
    if type(attn).forward is not attention_cls.forward or type(mlp) is not mlp_cls:
        return None
    if attn.q_parts != 1 or not hasattr(attn, "qkv_proj") or not hasattr(mlp, "gate_up_proj"):
        return None
    lins = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if any(type(lin) is not linear_cls for lin in lins):  # a tensor-parallel subclass
        return None
    keep: list[torch.Tensor] = []
    structs = tuple(_hx_linear(lin, keep) for lin in lins)
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if any(st is None for st in structs) or layer.input_layernorm.eps != norms[1].eps:
        return None
    qk = (attn.q_norm, attn.k_norm) if attn.qk_norm else (None, None)
    weights = [n.weight for n in (*norms, *(n for n in qk if n is not None))]
    if any(w.dtype != torch.float32 or not w.is_contiguous() for w in weights):
        return None
    most = max(len(lin.plans) if lin.plans is not None else 1 for lin in lins)
    rows_ok = [
        all(lin.plans is None or not lin.plans[min(r, len(lin.plans) - 1)][0] for lin in lins)
        for r in range(most)
    ]
    return LayerPlan(
        structs, keep, norms[0].weight, norms[1].weight, norms[0].eps,
        qk[0].weight if qk[0] is not None else None,
        qk[1].weight if qk[1] is not None else None,
        qk[0].eps if qk[0] is not None else 0.0,
        (attn.num_heads, attn.num_kv_heads, attn.head_dim), attn.attn, rows_ok,
    )  # fmt: skip


def decode_layer(
    plan: LayerPlan, x: torch.Tensor, residual: torch.Tensor | None, ctx
) -> tuple[torch.Tensor, torch.Tensor]:
    """DecoderLayer.forward for a decode-only step in one C call: (out, residual), the same
    floats the op-by-op native path computes (tests/engine/test_native.py)."""
    m, hidden = x.shape
    x = x.contiguous()
    res_out = torch.empty_like(x)
    out = torch.empty_like(x)
    h, kvh, d = plan.heads
    cos, ssin, r = _rotary_rows(ctx.cos, ctx.sin, m)
    tables, lens = ctx.decode_blocks, ctx.decode_lens
    qkv, o, gate_up, down = plan.linears
    attn = plan.attn
    rc = library().hx_decode_layer(
        x.data_ptr(), residual.contiguous().data_ptr() if residual is not None else None,
        res_out.data_ptr(), m, hidden, plan.norm1.data_ptr(), plan.norm2.data_ptr(), plan.eps,
        ctypes.byref(qkv), ctypes.byref(o), ctypes.byref(gate_up), ctypes.byref(down),
        h, kvh, d,
        plan.q_norm.data_ptr() if plan.q_norm is not None else None,
        plan.k_norm.data_ptr() if plan.k_norm is not None else None,
        plan.qk_eps, cos.data_ptr(), ssin.data_ptr(), r, ctx.slot_mapping.data_ptr(),
        attn.k_cache.data_ptr(), attn.v_cache.data_ptr(), KV_DTYPES[attn.k_cache.dtype],
        attn.k_cache.shape[1], tables.data_ptr(), tables.shape[1], lens.data_ptr(), attn.scale,
        out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"native decode_layer refused x {list(x.shape)}")
    return out, res_out


# -- every decoder layer ----------------------------------------------------------------------
@dataclass(slots=True)
class StackPlan:
    """What `decode_layers` passes for a model's decoder layers, built once from their
    LayerPlans: an hx_layer array pointing at each layer's tensors, and the KV caches it was
    built on (a model given new caches gets a new plan)."""

    layers: ctypes.Array
    plans: list[LayerPlan]
    caches: list[torch.Tensor]
    rows_ok: list[bool]

    def fits(self) -> bool:
        """Whether the layers' caches are still the ones the plan points at."""
        return all(p.attn.k_cache is k for p, k in zip(self.plans, self.caches, strict=True))


def stack_plan(plans: list[LayerPlan]) -> StackPlan:
    """The plan of every layer at once (each must have its LayerPlan)."""
    layers = (HxLayer * len(plans))()
    caches = []
    for slot, p in zip(layers, plans, strict=True):
        attn = p.attn
        slot.norm1, slot.norm2, slot.eps = p.norm1.data_ptr(), p.norm2.data_ptr(), p.eps
        slot.qkv, slot.o, slot.gate_up, slot.down = (ctypes.pointer(lin) for lin in p.linears)
        slot.H, slot.KVH, slot.D = p.heads
        slot.q_norm = p.q_norm.data_ptr() if p.q_norm is not None else None
        slot.k_norm = p.k_norm.data_ptr() if p.k_norm is not None else None
        slot.qk_eps = p.qk_eps
        slot.k_cache, slot.v_cache = attn.k_cache.data_ptr(), attn.v_cache.data_ptr()
        slot.block_size, slot.scale = attn.k_cache.shape[1], attn.scale
        slot.kv_f16 = KV_DTYPES[attn.k_cache.dtype]
        caches.append(attn.k_cache)
    most = max(len(p.rows_ok) for p in plans)
    rows_ok = [all(p.rows_ok[min(r, len(p.rows_ok) - 1)] for p in plans) for r in range(most)]
    return StackPlan(layers, plans, caches, rows_ok)


def decode_layers(stack: StackPlan, x: torch.Tensor, ctx) -> tuple[torch.Tensor, torch.Tensor]:
    """Every DecoderLayer.forward of a decode-only step in one C call, from the embeddings:
    the last layer's (out, residual), what `decode_layer` layer by layer gives."""
    m, hidden = x.shape
    x = x.contiguous()
    out, residual = torch.empty_like(x), torch.empty_like(x)
    cos, ssin, r = _rotary_rows(ctx.cos, ctx.sin, m)
    tables, lens = ctx.decode_blocks, ctx.decode_lens
    rc = library().hx_decode_layers(
        stack.layers, len(stack.plans), x.data_ptr(), out.data_ptr(), residual.data_ptr(), m,
        hidden, cos.data_ptr(), ssin.data_ptr(), r, ctx.slot_mapping.data_ptr(),
        tables.data_ptr(), tables.shape[1], lens.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"native decode_layers refused x {list(x.shape)}")
    return out, residual
