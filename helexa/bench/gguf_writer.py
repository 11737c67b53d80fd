"""`helexa bench gguf`: write a GGUF in a real checkpoint's shapes to measure with.

    helexa bench gguf --preset qwen3-8b --mix Q4_K_M --tokenizer DIR --out qwen3-8b.gguf

The file is what llama.cpp's converter and llama-quantize make of the checkpoint (see
gguf_files, gguf_mix), holding random but valid blocks. It is written one tensor at a time,
each in chunks of generated blocks, so a 20 GB file never passes through RAM whole.
"""

from __future__ import annotations

import argparse
import math
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from helexa.bench.gguf_files import (
    PRE_TOKENIZER,
    PRESETS,
    Preset,
    arch_metadata,
    num_blocks,
    special_vocab,
    tensor_shapes,
    vocab,
    with_layers,
)
from helexa.bench.gguf_mix import MIXES, tensor_types

if TYPE_CHECKING:
    from helexa.config import Config

CHUNK_BYTES = 64 << 20  # blocks generated and written per step: memory stays flat
# the files a tokenizer needs, fetched alone when --tokenizer is a hub id
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "config.json", "chat_template.jinja"]


@dataclass(slots=True)
class Written:
    """What `write_gguf` wrote."""

    path: Path
    nbytes: int
    seconds: float
    types: dict[str, str]  # tensor name -> GGML type


def write_gguf(
    path: str | Path,
    preset: Preset,
    mix: str,
    tokenizer_dir: str | Path,
    *,
    chat_template: str | None = None,
    num_layers: int | None = None,
    mtp: bool = True,
    seed: int = 0,
) -> Written:
    """Write `preset` as a `mix` GGUF at `path` with random blocks and the tokenizer of
    `tokenizer_dir` (tokenizer.json, tokenizer_config.json, config.json as on the Hub);
    `chat_template` replaces the one found there; `num_layers` keeps only the first layers;
    `mtp=False` leaves out the MTP layers, as the converter's --no-mtp."""
    import gguf

    start = time.perf_counter()
    path, tokenizer_dir = Path(path), Path(tokenizer_dir)
    cfg = with_layers(preset.config, num_layers)
    shapes = tensor_shapes(cfg, mtp)
    types = tensor_types(shapes, mix, cfg.get("num_experts", 0), num_blocks(cfg, mtp))

    writer = gguf.GGUFWriter(path, preset.arch)
    writer.add_type("model")
    writer.add_name(preset.name)
    writer.add_basename(preset.name.split()[0])
    writer.add_size_label(preset.size_label)
    for key, value, kind in arch_metadata(preset.arch, cfg, mtp):
        _add(writer, f"{preset.arch}.{key}", value, kind)
    tokens, token_types = vocab(tokenizer_dir, cfg["vocab_size"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(PRE_TOKENIZER[preset.arch])
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    special = special_vocab(tokenizer_dir, len(tokens), preset.arch, chat_template)
    special.add_to_gguf(writer, quiet=True)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_file_type(MIXES[mix][1])

    for name, shape in shapes.items():
        qtype = gguf.GGMLQuantizationType[types[name]]
        nbytes = tensor_nbytes(types[name], shape)
        writer.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    assert writer.fout is not None
    out = writer.fout[0]
    writer.write_padding(out, out.tell())
    gen = torch.Generator().manual_seed(seed)
    for name, shape in shapes.items():
        written = 0
        for chunk in random_chunks(name, types[name], shape, gen):
            out.write(memoryview(chunk).cast("B"))
            written += chunk.nbytes
        assert written == tensor_nbytes(types[name], shape), name
        writer.write_padding(out, written)
    writer.close()
    return Written(path, path.stat().st_size, time.perf_counter() - start, types)


def _add(writer: Any, key: str, value: Any, kind: str) -> None:
    from gguf import GGUFValueType

    vtype = GGUFValueType[kind.upper()]
    if isinstance(value, list):
        writer.add_key_value(key, value, GGUFValueType.ARRAY, sub_type=vtype)
    else:
        writer.add_key_value(key, value, vtype)


# -- random tensors --------------------------------------------------------------------------
def tensor_nbytes(qtype: str, shape: tuple[int, ...]) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    return math.prod(shape) // block * size


def random_chunks(
    name: str, qtype: str, shape: tuple[int, ...], gen: torch.Generator
) -> Iterator[np.ndarray]:
    """The tensor's bytes in runs of whole rows: norms 1, ssm_a -1 (a decay), other F32 and
    F16 tensors N(0, 0.02), quantized ones random valid blocks of std ~0.02."""
    rows, cols = math.prod(shape[:-1]), shape[-1]
    if qtype == "F32" and name.endswith(("norm.weight", ".ssm_a")):
        yield np.full(math.prod(shape), -1.0 if name.endswith(".ssm_a") else 1.0, np.float32)
        return
    step = max(1, CHUNK_BYTES // tensor_nbytes(qtype, (1, cols)))
    for start in range(0, rows, step):
        yield _random_rows(qtype, min(step, rows - start), cols, gen).numpy()


def _random_rows(qtype: str, rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    from helexa.kernels.quant_pack import GGUF_KINDS, make_gguf_blocks

    if qtype in GGUF_KINDS:
        return make_gguf_blocks(qtype, rows, cols, generator=gen)
    if qtype in ("F32", "F16"):
        w = torch.randn(rows, cols, generator=gen).mul_(0.02)
        return w if qtype == "F32" else w.half()
    if qtype in ("Q5_0", "Q5_1"):  # the fallbacks of rows made of 32-blocks only
        nb = rows * cols // 32
        d = (0.02 / 9.2 * (0.75 + 0.5 * torch.rand(nb, 1, generator=gen))).half()
        head = [d.view(torch.uint8)]
        if qtype == "Q5_1":  # m = -15.5 d centres the 5-bit codes
            head.append((d.float() * -15.5).half().view(torch.uint8))
        codes = torch.randint(0, 256, (nb, 20), dtype=torch.uint8, generator=gen)  # qh, qs
        return torch.cat([*head, codes], dim=1).reshape(rows, -1)
    raise ValueError(f"no random blocks for {qtype!r}")


# -- the command -----------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `helexa bench gguf`."""
    add = parser.add_argument
    add("--preset", required=True, choices=list(PRESETS), help="the checkpoint to imitate")
    add("--mix", default="Q4_K_M", choices=list(MIXES), help="llama.cpp's type mix (Q4_K_M)")
    add("--out", type=Path, help="file to write (default: ./<preset>[-L<layers>]-<mix>.gguf)")
    add(
        "--tokenizer",
        metavar="DIR|HUB_ID",
        help="the tokenizer's files: a model dir or a hub id (default: the preset's repo)",
    )
    add("--chat-template", type=Path, metavar="FILE", help="a .jinja replacing the tokenizer's")
    add("--layers", type=int, metavar="N", help="only the first N layers (quick checks)")
    add(
        "--no-mtp",
        action="store_true",
        help="leave out Qwen3.6's MTP layer (the converter's --no-mtp)",
    )
    add("--seed", type=int, default=0, help="seed of the random blocks")
    add("--threads", type=int, help="torch threads generating the blocks")  # fmt: skip


def main(args: argparse.Namespace, cfg: Config) -> int:
    """Write the file; print its size, the time taken and how many tensors of each type."""
    preset = PRESETS[args.preset]
    if args.threads:
        torch.set_num_threads(args.threads)
    layers = f"-L{args.layers}" if args.layers else ""
    out = args.out or Path(f"{args.preset}{layers}-{args.mix}.gguf")
    template = args.chat_template.read_text(encoding="utf-8") if args.chat_template else None
    tokenizer_dir = _tokenizer_dir(args.tokenizer or preset.hub_id)
    done = write_gguf(
        out, preset, args.mix, tokenizer_dir, chat_template=template,
        num_layers=args.layers, mtp=not args.no_mtp, seed=args.seed,
    )  # fmt: skip
    counts = Counter(done.types.values())
    print(
        f"wrote {done.path}: {done.nbytes / 1e9:.2f} GB in {done.seconds:.1f} s "
        f"({done.nbytes / 1e6 / done.seconds:.0f} MB/s); {len(done.types)} tensors: "
        + ", ".join(f"{n} {t}" for t, n in sorted(counts.items()))
    )
    return 0


def _tokenizer_dir(ref: str) -> Path:
    """A local dir as it is, else the hub repo's tokenizer files (cached by huggingface_hub)."""
    if Path(ref).is_dir():
        return Path(ref)
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(ref, allow_patterns=TOKENIZER_FILES))
    except Exception as e:  # offline, unknown repo: say so, with what to do instead
        raise ValueError(
            f"no tokenizer at {ref!r} ({type(e).__name__}); pass --tokenizer DIR, a dir with "
            "tokenizer.json and tokenizer_config.json"
        ) from None
