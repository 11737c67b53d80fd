"""A GGUF file written again as llama.cpp splits large ones (`gguf-split`, or the converter's
`--split-max-tensors`): parts `<stem>-0000k-of-0000n.gguf`, the metadata in the first, each
with `split.*` keys. gguf-py's writer makes the parts; every key and tensor is copied as it
is stored (quantized blocks untouched)."""

from __future__ import annotations

from pathlib import Path

import gguf

# what the writer writes itself
_OWN = ("GGUF.", "general.architecture", "split.")


def split_gguf(
    src: Path, dst: Path, max_tensors: int, extra: dict[str, str] | None = None
) -> list[Path]:
    """`src` as parts of at most `max_tensors` tensors in `dst`, with `extra` string keys
    added to its metadata; the parts' paths in order."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    dst.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(dst / src.name, arch, split_max_tensors=max_tensors)
    for name, field in reader.fields.items():
        if name.startswith(_OWN):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
    for name, value in (extra or {}).items():
        writer.add_key_value(name, value, gguf.GGUFValueType.STRING)
    for t in reader.tensors:
        writer.add_tensor(
            t.name,
            t.data,
            raw_shape=t.data.shape,
            raw_dtype=gguf.GGMLQuantizationType(t.tensor_type),
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sorted(dst.glob(f"{src.stem}-*-of-*.gguf"))
